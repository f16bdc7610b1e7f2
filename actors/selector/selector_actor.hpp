// The selector actor: one per routing partition (model × routing group), a thin shell over that
// partition's SelectorState. Spawned on demand (linked) by the discovery actor.
//
// State it owns: the partition's SelectorState (worker catalog, KV index, predicted load with
// bookings, the policy instances per worker type), its SessionAffinity table (session → worker
// bindings; off unless a TTL is configured) and the dump requests in flight.
// Messages it handles (its typed interface, `selector_actor`, in actors/actor_types.hpp):
//   worker_up(WorkerRegistration), heartbeat(WorkerLiveness), worker_dn(WorkerLiveness),
//   load(WorkerLoadReport), kv_events(KvEventBatch), kv_dump(KvDump)   — worker state;
//   route(RouteRequest) → SelectorReply     — select (through route_with_session_affinity)
//                                                  and book (the pick is in the predicted load
//                                                  before the next selection runs); the pick is
//                                                  proposed to the session's binding;
//   booking(BookingUpdate) → BookingUpdateReply — first token / release of a booking, and the
//                                                  affinity commit / abandon / finish and the
//                                                  worker health report it carries (a failure
//                                                  may eject the worker: worker_health.hpp);
//   cancel(model, group, request id)            — the caller gave up: a request still in the
//                                                  queue leaves it unbooked;
//   tick                                        — internal, its own timer: expires worker leases,
//                                                  unreported bookings, approximate blocks and idle
//                                                  session bindings, and tells the discovery actor
//                                                  which workers left (removed);
//   wake                                        — internal: the queue's next due time or wait
//                                                  limit (one delayed message, re-armed earlier
//                                                  when needed).
//   nats_link(bool connected)                   — the node's own NATS connection went down
//                                                  (false): worker leases are held, none expires
//                                                  for heartbeats the node could not receive; it
//                                                  came back (true): each lease runs one TTL
//                                                  from now, and every worker heard from again
//                                                  is asked for its KV dump (a few per tick).
// The admission queue (actors/selector/partition_queue.hpp) runs only when one of the node's
// policy classes has a busy threshold; then a route request whose eligible workers are all busy
// for its class waits, its reply a response promise, and capacity that frees (first token,
// release, a worker joining, a load report, expired bookings) dispatches waiting requests in
// the same turn. Without it the route path is unchanged.
// A worker that deregistered is also reported to the discovery actor (removed), which tells the
// lifecycle actor, so that requests in flight on it are retried.
// It asks a worker for a KV dump (through RouterPublisher, never waiting) when its event ids
// show a gap. It must never block, throw, share its state, or call NATS request().
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <caf/stateful_actor.hpp>
#include <caf/typed_response_promise.hpp>

#include "actors/actor_types.hpp"
#include "actors/metrics/metrics_registry.hpp"
#include "actors/metrics/node_metrics.hpp"
#include "actors/metrics/rate_limited_log.hpp"
#include "actors/nats/nats_bridge.hpp"
#include "actors/selector/partition_queue.hpp"
#include "actors/selector/selector_state.hpp"
#include "actors/selector/session_affinity.hpp"
#include "messages/clock.hpp"

namespace kvr::actors {

/// What a selector actor is spawned with.
struct SelectorActorConfig {
  SelectorOptions options;
  /// Session affinity (off unless options.ttl is set); must be valid.
  SessionAffinityOptions affinity;
  /// Resolved policies; must outlive the actor system.
  const plugins::RouterPlugins* plugins = nullptr;
  std::shared_ptr<RouterPublisher> publisher;
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  std::shared_ptr<metrics::RateLimitedLog> log;
  /// Told about workers that left (expired); may be empty.
  removal_watcher_actor discovery;
  /// Period of the expiry timer.
  std::chrono::milliseconds tick_interval{100};
  /// A rank's dump is not asked for again within this time.
  std::chrono::milliseconds dump_retry{1000};
  /// After the node's NATS connection came back, at most this many KV dumps are asked for per
  /// tick (the rest wait for the next ticks), so that a large fleet's resync is no storm.
  std::size_t resync_dumps_per_tick = 16;
  /// Where the actor reads the time (injected by tests).
  std::shared_ptr<const Clock> clock = Clock::steady();
  /// The node's classifier actor, told the partition's KV blocks (used, total) after load
  /// reports, for its fleet load; null (no classifier configured): nothing is sent.
  classifier_actor classifier;
  /// The policy classes, resolved (classifiers::resolve_policy_classes); the queue runs only
  /// when queues_requests() holds for them.
  std::vector<classifiers::PolicyClassConfig> policy_classes;
  /// A request waits in the queue at most this long, then is refused with `timeout`.
  std::chrono::milliseconds queue_max_wait{30'000};
  /// Cluster mode: the selector routes only while its partition's lease fence (fence
  /// messages) lies ahead, and asks every worker that joins for its KV dump. A request that
  /// arrives while the partition is not (or not yet) owned here waits up to ownership_wait for
  /// the lease (a handover or takeover in progress), then is refused with `unavailable`.
  bool fenced = false;
  std::chrono::milliseconds ownership_wait{3000};
};

/// The selector actor's state.
struct SelectorActorState {
  static inline const char* name = "kvr.selector";
  std::optional<SelectorState> selector;
  SessionAffinity affinity;
  SelectorActorConfig config;
  /// When a dump was last asked for, per (worker, rank).
  absl::flat_hash_map<WorkerWithDpRank, std::chrono::steady_clock::time_point> dump_requested;
  /// After a NATS reconnect: the workers whose KV state is to be dumped again once they are
  /// heard from (a registration, heartbeat or KV event proves the request can reach them), each
  /// until its grace period ends.
  absl::flat_hash_map<WorkerId, TimePoint> resync_wanted;
  /// The ranks of workers heard from whose resync dump is still to be asked for, oldest first.
  std::deque<WorkerWithDpRank> resync_dumps;
  /// Resync dumps that may still be asked for in this tick.
  std::size_t resync_budget = 0;
  /// "model/routing group": the partition label of this selector's metrics and logs.
  std::string partition;
  /// The KV usage last sent to the classifier actor; empty: none yet.
  std::optional<double> sent_kv_usage;
  /// The admission queue; empty when no class can queue.
  std::optional<PartitionQueue> queue;
  /// The reply promise of each waiting request, by its queue ticket.
  std::unordered_map<QueueTicket, caf::typed_response_promise<SelectorReply>> queued_replies;
  QueueTicket next_ticket = 1;
  /// The time the wake message on its way is for; empty: none.
  std::optional<TimePoint> wake_armed_for;
  /// Cluster mode: the partition is this node's until then.
  TimePoint owned_until{};
  /// Cluster mode: requests waiting for the partition's lease, oldest first.
  struct AwaitingOwnership {
    RouteRequest request;
    caf::typed_response_promise<SelectorReply> promise;
    TimePoint until;
  };
  std::vector<AwaitingOwnership> awaiting_ownership;
  /// The series written per request, resolved once.
  struct Series {
    metrics::ValueHandle bookings_open;
    metrics::ValueHandle booked_blocks;
    metrics::ValueHandle workers;
    metrics::ValueHandle index_blocks;
    metrics::ValueHandle session_bindings;
    metrics::HistogramHandle selection_latency;
    metrics::ValueHandle worker_ejections;
    metrics::ValueHandle workers_ejected;
    /// By FailureCause.
    std::array<metrics::ValueHandle, kFailureCauses> worker_failures;
    /// Per policy class (in queue order), when the queue runs.
    std::vector<metrics::ValueHandle> queue_depth;
  } series;
};

/// The selector actor's behaviour.
selector_actor::behavior_type selector_behavior(
    selector_actor::stateful_pointer<SelectorActorState> self, SelectorActorConfig config);

}  // namespace kvr::actors
