// The CAF message types and atoms of the router node, in one place: the atoms, the local message
// structs exchanged between the node's actors, the protobuf wrappers that actor clients send to
// the published ingress actor, and the typed interface of every actor. Include only from actor
// code: every translation unit that includes CAF costs seconds of compile time and ~0.7 GB.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/meta/load_callback.hpp>
#include <caf/meta/save_callback.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/type_id.hpp>
#include <caf/typed_actor.hpp>

#include "actors/caf_error.hpp"
#include "actors/client/ingress_protocol.hpp"
#include "classifiers/request_classifier.hpp"
#include "kvr/v1/routing.pb.h"
#include "messages/clock.hpp"
#include "selection/cluster/cluster_values.hpp"
#include "selection/cluster/sharding.hpp"
#include "selection/front_door/routing_gateway.hpp"
#include "selection/partition/partition_messages.hpp"
#include "selection/partition/route_request.hpp"
#include "selection/wire/generate_messages.hpp"
#include "selection/wire/route_messages.hpp"
#include "selection/wire/shard_messages.hpp"
#include "selection/wire/worker_messages.hpp"

namespace kvr {
class RouterPublisher;  // selection/wire/nats_bridge.hpp
namespace metrics {
class MetricsRegistry;  // messages/metrics/metrics_registry.hpp
class RateLimitedLog;   // messages/metrics/rate_limited_log.hpp
}  // namespace metrics
}  // namespace kvr

namespace kvr::actors {

// ---- what every actor of a node shares ----------------------------------------------------------

/// The node's shared services, one of each per node; every actor config is one (it derives from
/// this struct), so the node sets them in one place and a test fakes them in one place.
struct NodeServices {
  /// Publishes answers, chunks and dump requests on NATS (a fake in actor tests).
  std::shared_ptr<RouterPublisher> publisher;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  /// Warnings that a flood of bad input could repeat, rate-limited.
  std::shared_ptr<metrics::RateLimitedLog> log;
  /// Stamps arrivals and drives deadlines (tests inject a manual clock).
  std::shared_ptr<const Clock> clock = Clock::steady();
};

// ---- local messages (never leave the process) -------------------------------------------------

/// A route request on its way from an ingress to the reservation actor.
struct RouteEnvelope {
  RouteRequest request;
  /// NATS subject the decision is published on; empty for actor clients (they get the reply).
  std::string reply_subject;
  std::chrono::steady_clock::time_point received;
};

/// A selector's answer to a route request (the partition core's RouteReply).
using SelectorReply = RouteReply;

/// A lifecycle report on its way to the reservation actor.
struct ReportEnvelope {
  LifecycleReportData report;
  std::string reply_subject;  ///< NATS subject the ack is published on; empty for actors
};

/// A booking change (first token or release) addressed to one partition's selector.
struct BookingUpdate {
  plugins::worker_selection::RoutingPartition partition;
  BookingChange change;
};

/// Expired bookings the reservation actor ends with every route request, before the tick ends the
/// rest (the partition core does the same for its bookings): when clients do not report, bookings
/// end as fast as requests arrive instead of piling up into one burst per tick of thousands of
/// releases that every queued request waits behind.
inline constexpr std::size_t kExpiriesPerRequest = 4;

/// A generate request on its way from the NATS bridge or the ingress actor to the lifecycle actor.
struct GenerateEnvelope {
  GenerateRequestData request;
  /// NATS subject the first RouteDecision is published on; empty: none.
  std::string reply_subject;
  std::chrono::steady_clock::time_point received;
  /// An actor client: gets the first RouteDecision as the response to its request and the chunks
  /// as (chunk_atom, GenerateChunkMessage); the NATS subjects are then unused.
  caf::actor stream_actor;
};

/// A worker's chunk that arrived on the node's stream inbox `<prefix>.<stream_id>`.
struct ChunkEnvelope {
  std::uint64_t stream_id = 0;
  v1::GenerateChunk chunk;
};

/// A lifecycle event of an admitted request, from the reservation or lifecycle actor to the
/// classifier actor, with the model whose classifier admitted it.
struct ClassifierEvent {
  std::string model;
  plugins::request_classifier::ClassifyEvent event;
};

/// What this node's cluster actor learnt in its last step (cluster mode): the partitions it owns
/// (each with its epoch and fence), those to warm up or drop, and who owns the others.
struct ClusterView {
  std::vector<cluster::OwnedPartition> owned;
  std::vector<std::string> prepare;
  std::vector<std::string> drop;
  std::map<std::string, cluster::PartitionOwner> elsewhere;
  std::vector<cluster::MemberRecord> members;
};

/// Sharded partitions: the workers of one sharded model (model, routing group) as the discovery
/// actor last saw them, from which the forwarder computes the same shard of every worker
/// (cluster::ShardMap) and learns the block size a prompt's shard key is hashed at.
struct ShardFleet {
  std::string model;
  std::string routing_group;
  std::uint32_t block_size = 0;
  std::vector<cluster::ShardedWorker> workers;
};

/// Where the front door's gateway actor hands a route decision back to the HTTP server (whose
/// callback posts it to the connection's strand).
struct DecisionCallback {
  std::function<void(v1::RouteDecision)> done;
};

/// A generate stream the front door starts through the gateway actor: the relay the gateway
/// spawns for it is handed to `relay` (which may have been cancelled already).
struct GenerateRelayStart {
  v1::GenerateRequest request;
  front_door::GenerateCallbacks callbacks;
  std::function<void(caf::actor)> relay;
};

/// The selector's answer to a BookingUpdate.
struct BookingUpdateReply {
  bool applied = false;
  std::string message;
};

// ---- messages of actor clients (cross nodes: registered, serialised as protobuf bytes) -------
// ProtoMessage and its aliases: actors/client/ingress_protocol.hpp.

}  // namespace kvr::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::RouteEnvelope)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::SelectorReply)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::ReportEnvelope)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::BookingUpdate)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::BookingUpdateReply)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::GenerateEnvelope)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::ChunkEnvelope)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::ClassifierEvent)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::DecisionCallback)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::GenerateRelayStart)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::PartitionFleet)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::ClusterView)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::actors::ShardFleet)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::ShardLoadData)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::RouteRequest)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::WorkerLiveness)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::WorkerLoadReport)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::discovery::WorkerRegistration)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::KvEventBatch)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(kvr::KvDump)

// The node's internal atoms (at most 10 characters in CAF 0.17); the types and atoms actor clients
// exchange with a node are in actors/client/ingress_protocol.hpp. One meaning per atom, whichever
// actor handles it: a worker's `load` report is not the classifier's `kv_usage`; the selector's
// `tick`, the reservation's booking `expire` and the cluster actor's `step` are three timers;
// `nats_link` (the connection went down or up) is not `reregister` (ask the workers to register
// again); the selector's `fence` (owned until) is not the cluster actor's `ownership` view; the
// cluster's `partition` (one seen) is not the discovery actor's `handover` (stop serving these);
// `watch` subscribes an actor to what its handle's type receives (removals or `selector`
// announcements).
CAF_ADD_ATOM(kvr_actors, kvr::actors, worker_up_atom, "worker_up")
CAF_ADD_ATOM(kvr_actors, kvr::actors, heartbeat_atom, "heartbeat")
CAF_ADD_ATOM(kvr_actors, kvr::actors, worker_down_atom, "worker_dn")
CAF_ADD_ATOM(kvr_actors, kvr::actors, load_atom, "load")
CAF_ADD_ATOM(kvr_actors, kvr::actors, kv_events_atom, "kv_events")
CAF_ADD_ATOM(kvr_actors, kvr::actors, kv_dump_atom, "kv_dump")
CAF_ADD_ATOM(kvr_actors, kvr::actors, booking_atom, "booking")
CAF_ADD_ATOM(kvr_actors, kvr::actors, expire_atom, "expire")
CAF_ADD_ATOM(kvr_actors, kvr::actors, tick_atom, "tick")
CAF_ADD_ATOM(kvr_actors, kvr::actors, step_atom, "step")
CAF_ADD_ATOM(kvr_actors, kvr::actors, reregister_atom, "reregister")
CAF_ADD_ATOM(kvr_actors, kvr::actors, nats_link_atom, "nats_link")
CAF_ADD_ATOM(kvr_actors, kvr::actors, kv_usage_atom, "kv_usage")
CAF_ADD_ATOM(kvr_actors, kvr::actors, fleet_atom, "fleet")
CAF_ADD_ATOM(kvr_actors, kvr::actors, removed_atom, "removed")
CAF_ADD_ATOM(kvr_actors, kvr::actors, deadline_atom, "deadline")
CAF_ADD_ATOM(kvr_actors, kvr::actors, watch_atom, "watch")
CAF_ADD_ATOM(kvr_actors, kvr::actors, selector_atom, "selector")
CAF_ADD_ATOM(kvr_actors, kvr::actors, flush_atom, "flush")
CAF_ADD_ATOM(kvr_actors, kvr::actors, classify_atom, "classify")
CAF_ADD_ATOM(kvr_actors, kvr::actors, wake_atom, "wake")
CAF_ADD_ATOM(kvr_actors, kvr::actors, targets_atom, "targets")
CAF_ADD_ATOM(kvr_actors, kvr::actors, ownership_atom, "ownership")
CAF_ADD_ATOM(kvr_actors, kvr::actors, fence_atom, "fence")
CAF_ADD_ATOM(kvr_actors, kvr::actors, partition_atom, "partition")
CAF_ADD_ATOM(kvr_actors, kvr::actors, handover_atom, "handover")
CAF_ADD_ATOM(kvr_actors, kvr::actors, ready_atom, "ready")
CAF_ADD_ATOM(kvr_actors, kvr::actors, shard_atom, "shard")
CAF_ADD_ATOM(kvr_actors, kvr::actors, shard_load_atom, "shardload")

namespace kvr::actors {

// ---- the typed interfaces of the node's internal actors -----------------------------------------
// A message an actor does not handle is a compile error. "internal" marks the messages an actor
// sends itself (timers, burst writes).

/// The validated worker messages the NATS bridge decodes, as the discovery actor takes them and
/// forwards them to the worker's selector.
using worker_feed_actor = caf::typed_actor<
    // a worker joined, restarted or renewed its registration
    caf::reacts_to<worker_up_atom, discovery::WorkerRegistration>,
    // a worker's heartbeat
    caf::reacts_to<heartbeat_atom, WorkerLiveness>,
    // a worker deregistered
    caf::reacts_to<worker_down_atom, WorkerLiveness>,
    // a worker's load report
    caf::reacts_to<load_atom, WorkerLoadReport>,
    // a batch of a worker's KV cache events
    caf::reacts_to<kv_events_atom, KvEventBatch>,
    // a worker's KV dump (the answer to a dump request after an event-id gap)
    caf::reacts_to<kv_dump_atom, KvDump>>;

/// Where a partition's route requests and booking updates go: its selector, or the discovery actor
/// actor, which delegates to the selector or answers that the partition has none.
using route_target_actor = caf::typed_actor<
    // select a worker and book it
    caf::replies_to<route_atom, RouteRequest>::with<SelectorReply>,
    // first token or release of a booking, with its session-affinity action
    caf::replies_to<booking_atom, BookingUpdate>::with<BookingUpdateReply>,
    // the caller gave up on a route request (model, routing group, request id): if it still
    // waits in the partition's queue, it leaves without being booked
    caf::reacts_to<cancel_atom, std::string, std::string, std::string>>;

/// The selector actor of one partition (actors/selector/selector_actor.hpp).
using selector_actor = worker_feed_actor::extend_with<route_target_actor>::extend<
    // cluster mode: the partition is owned until this time (its lease's fence)
    caf::reacts_to<fence_atom, std::chrono::steady_clock::time_point>,
    // the node's NATS connection went down (false: hold workers' liveness) or came back (true: each
    // liveness runs one TTL from now, and the workers' KV state is asked for again)
    caf::reacts_to<nats_link_atom, bool>,
    // internal: the periodic tick (expires workers' liveness, bookings and session bindings;
    // refills the KV dump budget; gauges)
    caf::reacts_to<tick_atom>,
    // internal: the queue's next due time or wait limit
    caf::reacts_to<wake_atom>,
    // internal: the hit-rate ceilings of the prompts routed since the last one
    caf::reacts_to<flush_atom>>;

/// An actor told of the workers that left (expired or deregistered).
using removal_watcher_actor = caf::typed_actor<
    // these workers left
    caf::reacts_to<removed_atom, std::vector<WorkerId>>>;

/// An actor told of every partition's selector, so that it addresses the selector directly.
using selector_subscriber_actor = caf::typed_actor<
    // the selector of partition (model, routing group); an invalid handle: it was retired
    caf::reacts_to<selector_atom, std::string, std::string, selector_actor>>;

/// An actor told of every sharded model's fleet (the forwarder, which chooses shards).
using shard_watcher_actor = caf::typed_actor<
    // a sharded model's workers, now and whenever they change
    caf::reacts_to<shard_atom, ShardFleet>>;

/// The discovery actor (actors/discovery/discovery_actor.hpp).
using discovery_actor = worker_feed_actor::extend_with<route_target_actor>::extend<
    // cluster mode: what this node owns, warms up or drops, from the cluster actor
    caf::reacts_to<ownership_atom, ClusterView>,
    // cluster mode: stop serving these partitions now (their leases are about to be handed
    // over); answered once their selectors are retired
    caf::replies_to<handover_atom, std::vector<std::string>>::with<bool>,
    // ask every worker to register again (at startup: those that registered before the node)
    caf::reacts_to<reregister_atom>,
    // the NATS connection went down (false) or came back (true): told to every selector, and
    // after a reconnect every worker is asked to register again
    caf::reacts_to<nats_link_atom, bool>,
    // from a selector: these workers left; forwarded to the watchers
    caf::reacts_to<removed_atom, std::vector<WorkerId>>,
    // the given actor gets every removal from now on
    caf::reacts_to<watch_atom, removal_watcher_actor>,
    // the given actor gets every partition's selector, now and when one is spawned or retired
    caf::reacts_to<watch_atom, selector_subscriber_actor>,
    // the given actor gets every sharded model's fleet, now and whenever it changes
    caf::reacts_to<watch_atom, shard_watcher_actor>>;

/// The reservation actor (actors/reservation/reservation_actor.hpp).
using reservation_actor = caf::typed_actor<
    // a route request → its decision (success with a booking, or an error)
    caf::replies_to<route_atom, RouteEnvelope>::with<RouteDecisionMessage>,
    // a lifecycle report against a booking → its ack
    caf::replies_to<report_atom, ReportEnvelope>::with<LifecycleAckMessage>,
    // from the discovery actor: the selector of partition (model, routing group)
    caf::reacts_to<selector_atom, std::string, std::string, selector_actor>,
    // internal: the booking-expiry timer (bookings not reported in time, overdue requests)
    caf::reacts_to<expire_atom>,
    // internal: write the NATS answers of the burst
    caf::reacts_to<flush_atom>>;

/// stream_client_actor, an actor client's generate stream: actors/client/ingress_protocol.hpp.

/// The lifecycle actor (actors/lifecycle/lifecycle_actor.hpp).
using lifecycle_actor = caf::typed_actor<
    // a generate request → the first decision (answered to actor clients only; NATS clients get
    // it on their reply subject)
    caf::replies_to<generate_atom, GenerateEnvelope>::with<RouteDecisionMessage>,
    // the client's cancel, by request id
    caf::reacts_to<cancel_atom, std::string>,
    // a worker's chunk on the node's stream inbox
    caf::reacts_to<chunk_atom, ChunkEnvelope>,
    // from the discovery actor: these workers left
    caf::reacts_to<removed_atom, std::vector<WorkerId>>,
    // from the discovery actor: the selector of partition (model, routing group)
    caf::reacts_to<selector_atom, std::string, std::string, selector_actor>,
    // internal: the deadline of (stream id, timer): the request's flight is ticked
    caf::reacts_to<deadline_atom, std::uint64_t, std::uint32_t>,
    // the node's NATS connection went down (false: every stream in flight ends) or came back
    caf::reacts_to<nats_link_atom, bool>,
    // internal: write the decisions and chunks relayed to NATS clients
    caf::reacts_to<flush_atom>>;

/// The classifier actor (actors/classifier/classifier_actor.hpp): admission in front of the
/// reservation (route) and lifecycle (generate) actors, when the node runs a request classifier.
using classifier_actor = caf::typed_actor<
    // a route request → its decision: admitted ones are delegated to the reservation actor
    caf::replies_to<route_atom, RouteEnvelope>::with<RouteDecisionMessage>,
    // a generate request → its first decision: admitted ones are delegated to the lifecycle actor
    caf::replies_to<generate_atom, GenerateEnvelope>::with<RouteDecisionMessage>,
    // the client's cancel, by request id: drops an undecided request, else goes to the lifecycle
    caf::reacts_to<cancel_atom, std::string>,
    // a lifecycle event of an admitted request (reservation and lifecycle actors)
    caf::reacts_to<classify_atom, ClassifierEvent>,
    // an admitted request's context grew: model, request id, tokens (prompt plus generated)
    caf::reacts_to<classify_atom, std::string, std::string, std::uint64_t>,
    // internal: a wake time passed or a Waker fired
    caf::reacts_to<wake_atom>,
    // a selector's partition KV blocks after a load report: model, routing group, used, total
    caf::reacts_to<kv_usage_atom, std::string, std::string, std::uint64_t, std::uint64_t>,
    // a selector's partition fleet after it changed, for the context a classifier is made with
    caf::reacts_to<fleet_atom, PartitionFleet>,
    // from the node, first: where admitted route and generate requests go
    caf::reacts_to<targets_atom, reservation_actor, lifecycle_actor>>;

// ---- the published actor ------------------------------------------------------------------------

/// ingress_actor, the published request API for actor clients: actors/client/ingress_protocol.hpp.

/// The front door's gateway actor (actors/front_door/gateway_actor.hpp): the HTTP server's
/// route requests and lifecycle reports, sent on to the node's ingress actor.
using gateway_actor = caf::typed_actor<
    // route, and answer through the callback (always: an ingress failure becomes an error)
    caf::reacts_to<route_atom, RouteRequestMessage, DecisionCallback>,
    // a lifecycle report; a refused one is logged
    caf::reacts_to<report_atom, LifecycleReportMessage>,
    // a generate stream: spawns its relay, the actor client the answer streams to
    caf::reacts_to<generate_atom, GenerateRelayStart>,
    // the deadlines' sweep (the gateway's own timer)
    caf::reacts_to<tick_atom>>;

// ---- cluster mode -------------------------------------------------------------------------------

/// The forwarder actor (actors/cluster/forwarder_actor.hpp): in cluster mode, every request
/// enters the node through it (RequestEntry); those whose partition (or booking) another node owns
/// go to that node's ingress actor over CAF's middleman, the others to this node's own entry.
/// Each answer goes to the request's NATS reply subject and to the actor that asked.
using forwarder_actor =
    caf::typed_actor<caf::replies_to<route_atom, RouteEnvelope>::with<RouteDecisionMessage>,
                     caf::replies_to<report_atom, ReportEnvelope>::with<LifecycleAckMessage>,
                     caf::replies_to<generate_atom, GenerateEnvelope>::with<RouteDecisionMessage>,
                     // a client's cancel of a generate request, by request id
                     caf::reacts_to<cancel_atom, std::string>,
                     // a forwarded generate request's chunk, from the owner's ingress actor
                     caf::reacts_to<chunk_atom, GenerateChunkMessage>,
                     // the cluster actor's last step
                     caf::reacts_to<ownership_atom, ClusterView>,
                     // from the discovery actor: a sharded model's workers
                     caf::reacts_to<shard_atom, ShardFleet>,
                     // from the NATS bridge: a shard's published load
                     caf::reacts_to<shard_load_atom, ShardLoadData>>;

// ---- the entry ----------------------------------------------------------------------------------
// The first stage a request meets is the forwarder (cluster mode), else the classifier (the node
// admits requests), else the reservation (route, report) or lifecycle (generate, cancel) actor.
// Each of them serves the same entry interfaces, and the choice is made once, where the node is
// wired: the NATS bridge and the ingress actor send every request to a RequestEntry.

/// The first stage of a route request: answers the decision (to the actor that asked; a NATS
/// client's also on the envelope's reply subject).
using route_entry_actor =
    caf::typed_actor<caf::replies_to<route_atom, RouteEnvelope>::with<RouteDecisionMessage>>;
/// The first stage of a lifecycle report: answers the ack likewise.
using report_entry_actor =
    caf::typed_actor<caf::replies_to<report_atom, ReportEnvelope>::with<LifecycleAckMessage>>;
/// The first stage of a generate request (answers its first decision, streams its chunks) and
/// of its cancel.
using generate_entry_actor =
    caf::typed_actor<caf::replies_to<generate_atom, GenerateEnvelope>::with<RouteDecisionMessage>,
                     caf::reacts_to<cancel_atom, std::string>>;

/// Where requests enter a node's pipeline.
struct RequestEntry {
  route_entry_actor route;
  report_entry_actor report;
  /// Null: generate is not served.
  generate_entry_actor generate;

  /// This node's own stages: the classifier in front when the node runs one. Without a
  /// lifecycle actor, generate is not served.
  static RequestEntry local(const classifier_actor& classifier,
                            const reservation_actor& reservation,
                            const lifecycle_actor& lifecycle) {
    RequestEntry entry;
    entry.report = reservation;
    if (classifier) {
      entry.route = classifier;
      if (lifecycle) entry.generate = classifier;
    } else {
      entry.route = reservation;
      entry.generate = lifecycle;
    }
    return entry;
  }

  /// Cluster mode: every request through the forwarder, which serves it at its partition's
  /// owner.
  static RequestEntry forwarding(const forwarder_actor& forwarder) {
    return RequestEntry{forwarder, forwarder, forwarder};
  }
};

/// The cluster actor (actors/cluster/cluster_actor.hpp): this node's membership and partition
/// leases in NATS JetStream, stepped on its own thread.
using cluster_actor = caf::typed_actor<
    // the discovery actor learnt of a partition ("<model>/<routing group>")
    caf::reacts_to<partition_atom, std::string>,
    // the discovery actor warmed a partition up (its selector runs and the workers were asked for
    // their registrations)
    caf::reacts_to<ready_atom, std::string>,
    // from the node, once its actors run: whom to tell each step, and this node's middleman
    // address ("host:port") for its member record; the first step follows
    caf::reacts_to<targets_atom, discovery_actor, forwarder_actor, std::string>,
    // internal: the next step
    caf::reacts_to<step_atom>>;

}  // namespace kvr::actors
