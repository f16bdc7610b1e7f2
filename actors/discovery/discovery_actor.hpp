// The discovery actor: one per node. Receives the validated worker messages from the NATS bridge
// and forwards each to the selector actor of the worker's partition (model × routing group),
// spawning (linked) one selector per partition on first registration; a selector serves every
// worker role of its partition. Also the router's way into the selectors: route requests and
// booking updates are delegated to the partition's selector.
//
// State it owns: partition → selector actor, worker id → partition, the actors watching worker
// removals, when it last asked the workers to register again, and in cluster mode the sharded
// models' fleets (cluster::ShardedFleetView, whose changes it carries out).
// Messages it handles (its typed interface, `discovery_actor`, in actors/actor_types.hpp):
//   worker_up(WorkerRegistration), heartbeat(WorkerLiveness), worker_dn(WorkerLiveness),
//   load(WorkerLoadReport), kv_events(KvEventBatch), kv_dump(KvDump)   — forwarded;
//   route(RouteRequest) → SelectorReply          — delegated, or a no_workers reply;
//   booking(BookingUpdate) → BookingUpdateReply      — delegated, or "unknown partition";
//   cancel(model, group, request id)                 — forwarded to the partition's selector;
//   reregister                                       — ask every worker to register again (at
//                                                      startup: those that registered before the
//                                                      node started);
//   nats_link(bool connected)                        — the NATS connection went down (false) or
//                                                      came back (true): told to every selector
//                                                      (workers' liveness held, then renewed for
//                                                      one TTL, and KV dumps asked for again);
//                                                      after a reconnect every worker is asked to
//                                                      register again;
//   removed(std::vector<WorkerId>)                   — from a selector: these workers expired
//                                                      or deregistered; forwarded to watchers;
//   watch(removal_watcher_actor)                     — `actor` (the lifecycle actor) gets every
//                                                      removed(...) from now;
//   watch(selector_subscriber_actor)                 — `actor` (the reservation actor) gets
//                                                      selector(model, group, selector) for every
//                                                      partition, now and when one is spawned or
//                                                      retired, so that it can skip this actor's
//                                                      hop;
//   ownership(ClusterView)                           — cluster mode: what this node owns, warms
//                                                      up or drops (fence(owned until) to each
//                                                      owned partition's selector);
//   handover(partitions) → bool                      — cluster mode: stop serving these now.
// In cluster mode it runs selectors only for the partitions the cluster actor says this node owns
// or warms up (ownership, with each owned partition's fence passed to its selector), drops the
// worker messages of the others early, retires a selector whose partition it lost, and tells the
// cluster actor of every partition it sees. A sharded model's routing group is S partitions, one
// per shard: its cluster::ShardedFleetView assigns each worker to its shard (from every
// registration it has heard, whichever node owns the shard) and tracks the liveness of workers
// whose shards it does not serve; the actor moves workers between shards as the view says when
// the fleet changes (a move is no removal: requests in flight on the worker go on), and tells the
// shard watchers (the forwarder) every change:
//   watch(shard_watcher_actor)                       — `actor` gets shard(ShardFleet) for every
//                                                      sharded model, now and on every change.
// It follows (WorkerFeed) the load and KV event subjects of the partitions whose selectors run
// here, for a shard those of each of its workers, and stops when it retires the selector or the
// worker leaves the shard, so that a node decodes only its share of the fleet's worker traffic.
// Messages from a worker it does not know (heartbeat, load, KV events) make it ask the workers to
// register again (at most once per throttle period). Spawned by the router node. It must never
// block, throw, touch a selector's state, or call NATS request().
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <caf/stateful_actor.hpp>

#include "actors/actor_types.hpp"
#include "actors/selector/selector_actor.hpp"
#include "selection/cluster/sharded_fleet_view.hpp"

namespace kvr::actors {

/// What the discovery actor is spawned with.
struct DiscoveryActorConfig {
  /// Template of every selector's configuration (the node's services included); the partition
  /// is filled in per selector.
  SelectorActorConfig selector;
  /// Workers are asked to register again at most this often.
  std::chrono::milliseconds reregistration_throttle{1000};
  /// Cluster mode: told of every partition; a selector runs only for the partitions this node
  /// owns or warms up (its ownership messages). Null: a node that owns every partition.
  cluster_actor cluster;
  /// Cluster mode: the models split into shards (selection/cluster/sharding.hpp), each of whose
  /// routing groups is then S partitions "<group>#<shard>", leased and served like any other.
  std::map<std::string, cluster::ShardingConfig, std::less<>> sharding;
  /// Where the shards publish their load (subjects::router_shard_load).
  std::string shard_load_subject;
  /// The worker messages this node follows: the load and KV events of each partition it serves
  /// (its selector runs), of each worker of a shard it serves; null: none are followed (tests).
  std::shared_ptr<WorkerFeed> feed;
};

/// The discovery actor's state.
struct DiscoveryActorState {
  static inline const char* name = "kvr.discovery";
  DiscoveryActorConfig config;
  std::map<std::pair<std::string, std::string>, selector_actor> selectors;
  absl::flat_hash_map<WorkerId, std::pair<std::string, std::string>> worker_partition;
  std::chrono::steady_clock::time_point last_reregistration_request{};
  /// False while the node's NATS connection is down (resync(false) until resync(true)).
  bool nats_connected = true;
  /// Told of every worker removal (removed_atom).
  std::vector<removal_watcher_actor> watchers;
  /// Told of every selector (selector_atom), and of a retired one (an invalid handle).
  std::vector<selector_subscriber_actor> selector_subscribers;
  /// Cluster mode: every partition seen in a registration, by its placement key.
  std::map<std::string, std::pair<std::string, std::string>> known_partitions;
  /// Cluster mode: each worker's last registration of an unsharded partition, so that a selector
  /// spawned to take a partition over knows its workers at once.
  absl::flat_hash_map<WorkerId, discovery::WorkerRegistration> registrations;
  /// Cluster mode: the partitions owned at the last ownership message.
  std::set<std::pair<std::string, std::string>> owned;
  /// Cluster mode: the sharded models' workers (their registrations, shards and liveness, which
  /// this node tracks itself since it may own none of their shards); `worker_partition` and
  /// `registrations` hold the other workers.
  cluster::ShardedFleetView fleet;
  /// Told of every sharded model's fleet.
  std::vector<shard_watcher_actor> shard_watchers;
};

/// The discovery actor's behaviour.
discovery_actor::behavior_type discovery_behavior(
    discovery_actor::stateful_pointer<DiscoveryActorState> self, DiscoveryActorConfig config);

}  // namespace kvr::actors
