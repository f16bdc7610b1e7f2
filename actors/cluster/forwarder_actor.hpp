// The forwarder actor (cluster mode): any node accepts any request. The NATS bridge hands it every
// route, report, generate request and generate cancel. A request whose partition this node owns,
// or whose owner is unknown, goes to this node's actors as without a cluster. A request whose
// partition another node owns is sent, re-encoded as its wire form, to that node's ingress actor
// over CAF's middleman, and the answer returns through this node: the decision (or ack) on the
// client's reply subject, and a generate request's chunks on its stream subject. A report goes to
// the node whose lease it names (a lease id starts with its node's incarnation).
//
// A route request whose partition has no known owner yet, or that its presumed owner refused as
// not its own (the partition changing hands), waits for the next view once and is routed again.
// Every forward carries a timeout. A forward whose owner is gone or silent ends with an explicit
// `owner_lost` error (route, report), or, for a generate request that has produced no chunk yet,
// is retried once on this node's current view of the owner; after its first chunk it ends with an
// `owner_lost` error chunk. Peers are connected asynchronously through the middleman (with a
// timeout) from the address in their member record, and monitored: a peer whose connection drops
// is connected again at its next forward.
//
// Messages it handles (its typed interface, `forwarder_actor`, in actors/actor_types.hpp):
//   route(RouteEnvelope), report(ReportEnvelope), generate(GenerateEnvelope), cancel(request id)
//                         — from the NATS bridge;
//   forward(RouteEnvelope | ReportEnvelope | GenerateEnvelope) → the decision or ack
//                         — from this node's published ingress, for actor clients (a generate
//                           request's chunks go to the client's actor);
//   chunk(GenerateChunkMessage) — a forwarded generate request's chunk, from the owner's ingress;
//   ownership(ClusterView)     — the cluster actor's last step;
//   shard(ShardFleet)          — a sharded model's workers, from the discovery actor;
//   shard_load(ShardLoadData)  — a shard's published load, from the NATS bridge.
// A request of a sharded model (one whose routing group names no shard yet) first gets its shard
// (cluster::ShardBalancer: its prompt prefix's, or another that is the faster way), which names
// the partition it is then served or forwarded by.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "messages/metrics/metrics_registry.hpp"
#include "selection/cluster/forward_table.hpp"
#include "selection/wire/nats_bridge.hpp"

namespace kvr::actors {

/// What the forwarder is spawned with.
struct ForwarderActorConfig : NodeServices {
  /// This node's member record node id (its own partitions are served locally).
  std::string node_id;
  /// The subject namespace (for the partitions' own route subjects).
  std::string ns = "default";
  /// The prefix of this node's booking ids (booking_id_prefix of its incarnation).
  std::string booking_id_prefix;
  /// This node's own entry, where the requests it serves go (RequestEntry::local).
  RequestEntry local;
  /// Serves each owned partition's own route subject (subjects::router_partition_route); may be
  /// null (tests).
  std::shared_ptr<NatsBridge> bridge;
  /// Bound on a forward's answer (a generate request's first decision) and on connecting a peer.
  std::chrono::milliseconds forward_timeout{5000};
  std::chrono::milliseconds connect_timeout{1000};
  /// The models split into shards: their requests go to a shard chosen here (sharding.hpp).
  std::map<std::string, cluster::ShardingConfig, std::less<>> sharding;
};

/// A request the forwarder serves, answered on the envelope's NATS subjects (a NATS client's)
/// and through `promise` (to the actor that asked: this node's ingress for an actor client, none
/// for a NATS client), its chunks streamed to the envelope's actor or subject.
struct RouteJob {
  RouteEnvelope envelope;
  caf::typed_response_promise<RouteDecisionMessage> promise;
};
struct ReportJob {
  ReportEnvelope envelope;
  caf::typed_response_promise<LifecycleAckMessage> promise;
};
struct GenerateJob {
  GenerateEnvelope envelope;
  caf::typed_response_promise<RouteDecisionMessage> promise;
};

/// The forwarder's state: where requests go is the table's answer; the state keeps what only an
/// actor can hold (promises, peers' connections, streams in flight, requests awaiting a view).
struct ForwarderActorState {
  static inline const char* name = "kvr.forwarder";
  ForwarderActorConfig config;
  /// Owned partitions, owners elsewhere, members' lease prefixes and addresses, from the last
  /// view.
  cluster::ForwardTable table;
  /// The partition route subjects served, by partition key.
  std::map<std::string, std::string> served_subjects;

  /// A peer's ingress actor, or the forwards waiting for it to connect.
  struct Peer {
    std::string address;
    ingress_actor ingress;
    bool connecting = false;
    std::vector<std::function<void(const ingress_actor&)>> waiting;
  };
  std::map<std::string, Peer> peers;

  /// A generate request forwarded to another node, until its last chunk.
  struct ForwardedStream {
    GenerateJob job;
    std::string owner;
    bool decided = false;  ///< the client has its decision
    bool first_chunk_seen = false;
    bool retried = false;
  };
  std::unordered_map<std::string, ForwardedStream> streams;
  /// Route requests that wait for the next view: their partition had no known owner, or the
  /// owner they were sent to no longer served it (a handover or takeover in progress). Each
  /// waits for at most cluster::kMaxViewWaits views (the table decides); then it is served here
  /// or forwarded as the last view says, and its answer is final.
  std::vector<std::pair<RouteJob, int>> awaiting_view;  // with the views waited so far
  /// Reports naming a lease prefix no member of the last view has, waiting likewise.
  std::vector<std::pair<ReportJob, int>> awaiting_reports;

  /// A sharded model (model, routing group) as this node sees it: which shard owns each worker
  /// (from the discovery actor), the shards' published loads, this node's series.
  struct ShardedModel {
    explicit ShardedModel(std::uint32_t shards)
        : map(shards), balancer(shards), published(shards, 0), home(shards), spilled(shards) {}
    cluster::ShardMap map;
    cluster::ShardBalancer balancer;
    std::uint32_t block_size = 0;
    /// Each shard's last published load, in tokens (for its share of the model's).
    std::vector<std::uint64_t> published;
    /// kvr_shard_routes_total by shard, resolved on first use.
    std::vector<std::optional<metrics::ValueHandle>> home;
    std::vector<std::optional<metrics::ValueHandle>> spilled;
  };
  std::map<std::pair<std::string, std::string>, ShardedModel> sharded;
  /// Scratch for a prompt's shard key hashes.
  std::vector<BlockHash> shard_key_scratch;
};

/// The forwarder's behaviour.
forwarder_actor::behavior_type forwarder_behavior(
    forwarder_actor::stateful_pointer<ForwarderActorState> self, ForwarderActorConfig config);

/// The lease-id prefix of a node's leases in cluster mode (forward_table.hpp).
using cluster::booking_id_prefix;

}  // namespace kvr::actors
