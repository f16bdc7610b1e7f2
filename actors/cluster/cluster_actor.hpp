// The cluster actor: a router node's membership and partition leases in cluster mode. It owns the
// node's ClusterSession (its own NATS connection and the two JetStream buckets) and steps it every
// renew interval on a thread of its own (spawned detached: every step makes blocking KV calls,
// which must never hold up the scheduler's threads). After each step it tells the discovery actor
// and the forwarder what the node owns (with each partition's fence), what to warm up or drop and
// who owns the rest. It learns the partitions from the discovery actor, which sees every
// registration.
//
// Messages it handles (its typed interface, `cluster_actor`, in actors/actor_types.hpp):
//   targets(discovery, forwarder, address) — from the node once its actors run: the session
//                     starts (with the node's middleman address in its member record) and steps;
//   partition(key)  — from the discovery actor: a partition exists ("<model>/<routing group>");
//   ready(key)      — from the discovery actor: a partition it was asked to warm up is warm;
//   step            — internal: the next step;
//   an exit message — leaves the cluster: erases its member record and hands every lease back,
//                     so the others take the partitions at their next step, not after the TTL.
#pragma once

#include <memory>
#include <set>
#include <string>

#include <caf/stateful_actor.hpp>

#include "actors/actor_types.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "messages/nats/nats_client.hpp"
#include "selection/cluster/cluster_session.hpp"
#include "selection/cluster/jetstream_kv.hpp"

namespace kvr::actors {

/// The cluster's connection and buckets, opened by the router node before it spawns the actor
/// (so that a server without JetStream stops startup with a clear error), and the session the
/// actor starts. Destroyed in reverse order: session, buckets, connection.
struct ClusterLink {
  std::unique_ptr<nats::NatsClient> client;
  std::unique_ptr<cluster::JetStreamKv> members;
  std::unique_ptr<cluster::JetStreamKv> partitions;
  std::unique_ptr<cluster::ClusterSession> session;
  /// This node's member record, its address filled in by the targets message.
  cluster::MemberRecord self;
  cluster::PartitionLeaseOptions leases;

  ~ClusterLink() {
    session.reset();
    members.reset();
    partitions.reset();
    client.reset();
  }
};

/// What the cluster actor is spawned with.
struct ClusterActorConfig : NodeServices {
  std::shared_ptr<ClusterLink> link;
};

/// The cluster actor's state.
struct ClusterActorState {
  static inline const char* name = "kvr.cluster";
  ClusterActorConfig config;
  discovery_actor discovery;
  forwarder_actor forwarder;
  std::set<std::string> partitions;
  /// The partitions owned after the last step.
  std::set<std::string> owned;
};

/// The cluster actor's behaviour.
cluster_actor::behavior_type cluster_behavior(
    cluster_actor::stateful_pointer<ClusterActorState> self, ClusterActorConfig config);

}  // namespace kvr::actors
