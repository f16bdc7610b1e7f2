// The partition core: everything one routing partition (model × routing group) decides, as a plain
// state machine. It owns the partition's routing state (SelectorState: workers, KV index,
// predicted load with bookings, policies, passive health), its session affinity, its policy-class
// queue, the schedule of KV dumps (event-id gaps, the resync after a NATS outage) and, in cluster
// mode, the ownership fence. It takes inputs — a route request, a booking change, a worker
// message, a tick, the NATS link going down or up, the partition's lease — each with the time, and
// returns effects: answers to requests that waited, dumps to ask for, workers that left, the
// classifier's fleet and KV usage, and events to count and log. It never reads a clock for its
// decisions, never blocks and never throws.
//
// The selector actor is its mailbox and timers; `kvr replay` drives the same core on a logical
// clock, so a node and a replay make the same decisions for the same inputs.
// Single-threaded: exactly one owner calls it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <expected>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "classifiers/queue/policy_class_config.hpp"
#include "classifiers/request_classifier.hpp"
#include "discovery/catalog/worker_registration.hpp"
#include "discovery/worker_reports.hpp"
#include "messages/clock.hpp"
#include "messages/ids.hpp"
#include "messages/kv_event.hpp"
#include "messages/metrics/hit_rate_ceilings.hpp"
#include "selection/config/model_config.hpp"
#include "selection/partition/disaggregation.hpp"
#include "selection/partition/partition_messages.hpp"
#include "selection/partition/partition_queue.hpp"
#include "selection/partition/rank_budget.hpp"
#include "selection/partition/route_request.hpp"
#include "selection/partition/route_result.hpp"
#include "selection/partition/selector_state.hpp"
#include "selection/partition/session_affinity.hpp"
#include "selection/partition/worker_health.hpp"

namespace kvr {

/// The caller's handle on a route request that waits (a response promise's key, a trace index).
using RouteTicket = QueueTicket;

/// What happened, for the owner's metrics and logs; the core itself neither counts nor logs.
namespace partition_event {
struct WorkerJoined {
  WorkerId worker;
  bool restarted = false;  ///< a new incarnation of a worker already registered
};
struct WorkerLeft {
  WorkerId worker;
  bool expired = false;  ///< its liveness ran out (no heartbeat); else it deregistered
};
struct WorkerReturned {
  WorkerId worker;  ///< back in routing after its ejection
};
struct MessageRefused {
  std::string_view kind;  ///< "registration", "heartbeat", "load", "kv_events", ...
  std::string reason;
};
struct KvEventGap {};
struct WorkerFailed {
  WorkerId worker;
  FailureCause cause;
};
struct WorkerEjected {
  WorkerId worker;
  std::chrono::milliseconds backoff;
  FailureCause cause;
  std::uint32_t consecutive_failures;
};
struct EjectionCapped {
  WorkerId worker;
  std::size_t ejected;
  std::size_t workers;
};
struct SessionRebound {};
struct QueueOutcome {
  std::string policy_class;
  std::string_view outcome;  ///< dispatched, queue_full, refused, cancelled, timeout, ...
};
struct QueueWaited {
  std::string policy_class;
  double seconds;
};
struct LinkRestored {
  std::size_t workers;    ///< workers kept through the outage
  std::size_t held_over;  ///< workers whose liveness had run out during it
  std::size_t renewed;    ///< workers granted one TTL from the reconnect
};
struct SelectionTimed {
  double seconds;
};
/// A policy's observer predicted a request's time to first token, and it arrived.
struct TtftPredicted {
  WorkerWithDpRank worker;
  double predicted_seconds;
  double observed_seconds;
};
/// A generate request of a disaggregated partition was planned: the prefill hop or decode alone.
struct DisaggregationDecided {
  DisaggregationReason reason;
};
/// A routed request's prompt and its cached tokens under the hit-rate ceilings.
struct CeilingsRecorded {
  std::uint64_t prompt_tokens;
  std::uint64_t workload_cached_tokens;
  std::uint64_t capacity_cached_tokens;
};
}  // namespace partition_event

using PartitionEvent =
    std::variant<partition_event::WorkerJoined, partition_event::WorkerLeft,
                 partition_event::WorkerReturned, partition_event::MessageRefused,
                 partition_event::KvEventGap, partition_event::WorkerFailed,
                 partition_event::WorkerEjected, partition_event::EjectionCapped,
                 partition_event::SessionRebound, partition_event::QueueOutcome,
                 partition_event::QueueWaited, partition_event::LinkRestored,
                 partition_event::SelectionTimed, partition_event::CeilingsRecorded,
                 partition_event::TtftPredicted, partition_event::DisaggregationDecided>;

/// What one input asks of the core's owner. Reused across inputs: clear() keeps the capacity.
struct PartitionEffects {
  /// Answers to requests that had waited (in the queue or for ownership), by their tickets.
  std::vector<std::pair<RouteTicket, RouteReply>> answers;
  /// KV dumps to ask for.
  std::vector<DumpRequest> dumps;
  /// Workers that left the partition (deregistered or expired): requests in flight on them end.
  std::vector<WorkerId> removed;
  /// The fleet changed (a worker joined, restarted or left): fleet() is the classifier's new one.
  bool fleet_changed = false;
  /// The KV usage moved by at least 0.01 since it was last reported (only when report_kv_usage).
  std::optional<PartitionKvUsage> kv_usage;
  /// The queue's next deadline, when it is earlier than any wake-up armed before: call wake()
  /// then.
  std::optional<TimePoint> wake_at;
  /// Routed prompts wait for the hit-rate ceilings: call record_due_ceilings() once the answers
  /// are on their way.
  bool ceilings_due = false;
  std::vector<PartitionEvent> events;

  void clear() {
    answers.clear();
    dumps.clear();
    removed.clear();
    fleet_changed = false;
    kv_usage.reset();
    wake_at.reset();
    ceilings_due = false;
    events.clear();
  }
};

/// The partition's gauges, read after each input.
struct PartitionGauges {
  std::size_t bookings_open = 0;
  std::uint64_t booked_blocks = 0;
  std::size_t workers = 0;
  std::size_t index_blocks = 0;
  std::size_t session_bindings = 0;
  std::size_t workers_ejected = 0;
  /// Requests waiting in the queue.
  std::size_t queued = 0;
};

/// Settings of one partition core.
struct PartitionRouterOptions {
  SelectorOptions options;
  /// Session affinity (off unless affinity.ttl is set); must be valid.
  SessionAffinityOptions affinity;
  /// The policy classes, resolved (classifiers::resolve_policy_classes); the queue runs only
  /// when queues_requests() holds for them.
  std::vector<classifiers::PolicyClassConfig> policy_classes;
  /// A request waits in the queue at most this long, then is refused with `timeout`.
  std::chrono::milliseconds queue_max_wait{30'000};
  /// A rank's dump is not asked for again within this time.
  std::chrono::milliseconds dump_retry{1000};
  /// After the node's NATS connection came back, at most this many KV dumps are asked for per
  /// tick (the rest wait for the next ticks), so that a large fleet's resync is no storm.
  std::size_t resync_dumps_per_tick = 16;
  /// Cluster mode: the partition routes only while its lease fence (set_owned_until) lies ahead,
  /// and asks every worker that joins for its KV dump. A request that arrives while the partition
  /// is not (or not yet) owned waits up to ownership_wait for the lease (a handover or takeover
  /// in progress), then is refused with `unavailable`.
  bool fenced = false;
  std::chrono::milliseconds ownership_wait{3000};
  /// Report the partition's KV usage in effects (a classifier reads it).
  bool report_kv_usage = false;
  /// When set, each selection is timed with this clock (a SelectionTimed event); decisions
  /// never read it.
  std::shared_ptr<const Clock> stopwatch;
  /// When set, each routed request's prompt is run through the hit-rate ceilings measured so (a
  /// CeilingsRecorded event), when the owner calls record_due_ceilings(): a diagnostic, kept off
  /// the decision's way out.
  std::optional<metrics::HitRateCeilingsOptions> hit_rate_ceilings;
  /// A registration of a new worker beyond this many is refused; 0: no cap.
  std::size_t max_workers = 0;
  /// The node's rank entries, shared by its partitions: a registration whose data-parallel
  /// ranks it cannot hold is refused. Null: no cap.
  std::shared_ptr<RankBudget> rank_budget;
};

/// One partition's core (file comment).
class PartitionRouter {
 public:
  /// `plugins` must outlive the core.
  PartitionRouter(PartitionRouterOptions options, const plugins::RouterPlugins& plugins);
  /// Gives its workers' ranks back to the node's budget.
  ~PartitionRouter();
  PartitionRouter(const PartitionRouter&) = delete;
  PartitionRouter& operator=(const PartitionRouter&) = delete;

  // ---- requests ---------------------------------------------------------------------------
  /// Routes `request` (through the queue and session affinity), booking its worker. Returns the
  /// answer when there is one now; empty when the request waits (queued, or for the partition's
  /// lease), and its answer then comes in a later input's effects under `ticket`.
  std::optional<RouteReply> route(RouteRequest& request, RouteTicket ticket, TimePoint now,
                                  PartitionEffects& out);
  /// A booking's first token or release, its affinity action and health report. Fails, naming
  /// why, when the request holds no booking here (the affinity action still applies).
  std::expected<void, std::string> change_booking(const BookingChange& change, TimePoint now,
                                                  PartitionEffects& out);
  /// The caller gave up on `request_id`: when it still waits in the queue it leaves, unbooked,
  /// and its answer (cancelled) is in `out`.
  void cancel(std::string_view request_id, TimePoint now, PartitionEffects& out);

  // ---- worker messages --------------------------------------------------------------------
  void register_worker(discovery::WorkerRegistration registration, TimePoint now,
                       PartitionEffects& out);
  void heartbeat(const discovery::WorkerLiveness& heartbeat, TimePoint now, PartitionEffects& out);
  void deregister(const discovery::WorkerLiveness& deregistration, TimePoint now,
                  PartitionEffects& out);
  void update_load(const discovery::WorkerLoadReport& report, TimePoint now, PartitionEffects& out);
  void apply_kv_events(const KvEventBatch& batch, TimePoint now, PartitionEffects& out);
  void load_kv_dump(const KvDump& dump, TimePoint now, PartitionEffects& out);

  // ---- time and links ---------------------------------------------------------------------
  /// The periodic tick: expires workers' liveness, unreported bookings, approximate blocks and idle
  /// session bindings; answers requests whose ownership wait ended; paces resync dumps.
  void tick(TimePoint now, PartitionEffects& out);
  /// The queue's deadline (effects.wake_at) arrived.
  void wake(TimePoint now, PartitionEffects& out);
  /// The node's NATS connection went down (false: workers' liveness is held, none expires for
  /// heartbeats the node could not receive) or came back (true: each worker's liveness runs one TTL
  /// from now, and every worker heard from again is asked for its KV dump, a few per tick).
  void set_link(bool connected, TimePoint now, PartitionEffects& out);
  /// Cluster mode: the partition is owned until `owned_until` (its lease's fence); requests that
  /// waited for it are routed.
  void set_owned_until(TimePoint owned_until, TimePoint now, PartitionEffects& out);
  /// The owner stops: every waiting request gets an explicit `unavailable` answer.
  void shut_down(PartitionEffects& out);
  /// Runs the prompts routed since the last call through the hit-rate ceilings (effects'
  /// ceilings_due said some wait), in the order they were routed.
  void record_due_ceilings(PartitionEffects& out);

  // ---- reading ----------------------------------------------------------------------------
  PartitionGauges gauges() const;
  /// Each policy class's waiting requests, in configuration order; empty when no queue runs.
  std::vector<classifiers::PolicyClassDepth> queue_depths() const;
  bool queues() const { return queue_.has_value(); }
  /// The fleet as the classifier is created with.
  PartitionFleet fleet() const;
  /// "model/routing group".
  const std::string& label() const { return label_; }
  const PartitionRouterOptions& options() const { return options_; }
  const SelectorState& state() const { return selector_; }
  SelectorState& state() { return selector_; }
  const SessionAffinity& affinity() const { return affinity_; }
  /// How this partition's model splits generate requests (the router-policy YAML's
  /// models.<model>.disaggregation).
  const selection::DisaggregationConfig& disaggregation() const { return disaggregation_; }
  /// The hit-rate ceilings of the requests routed here; null unless measured.
  const metrics::HitRateCeilings* ceilings() const { return ceilings_ ? &*ceilings_ : nullptr; }

 private:
  struct AwaitingOwnership {
    RouteRequest request;
    RouteTicket ticket;
    TimePoint until;
  };

  RouteReply select(RouteRequest& request, TimePoint now, PartitionEffects& out);
  /// A RouteHop::plan request: served by prefill and decode workers here (it then names the
  /// decode role), or a single route (its hop is cleared).
  void resolve_hop(RouteRequest& request) const;
  /// Decides whether the prepared decode-role `request` takes the prefill hop (file comment of
  /// disaggregation.hpp); fails as its route would when no decode worker may take it.
  std::expected<DisaggregationDecision, RouteFailure> plan_disaggregation(RouteRequest& request,
                                                                          TimePoint now);
  RouteReply failure(const RouteRequest& request, RouteFailure failure) const;
  RouteFailure not_owned() const;
  std::optional<RouteReply> offer_to_queue(RouteRequest& request, RouteTicket ticket, TimePoint now,
                                           PartitionEffects& out);
  void drain_queue(TimePoint now, PartitionEffects& out);
  void expire_queue(TimePoint now, PartitionEffects& out);
  void arm_wake(PartitionEffects& out);
  void apply_affinity(const BookingChange& change, TimePoint now, PartitionEffects& out);
  void apply_health(const WorkerHealthReport& report, TimePoint now, PartitionEffects& out);
  void refuse(std::string_view kind, std::string reason, PartitionEffects& out);
  /// Why `registration` would exceed the partition's worker cap or the node's rank budget (its
  /// ranks are then taken from the budget); empty when it fits.
  std::optional<std::string> take_ranks(const discovery::WorkerRegistration& registration);
  /// Gives back to the budget what the catalog no longer holds (workers that left or shrank).
  void settle_ranks();
  void request_dump(WorkerWithDpRank worker, TimePoint now, PartitionEffects& out);
  void forget_dumps(WorkerId id);
  void send_resync_dumps(TimePoint now, PartitionEffects& out);
  void heard_from(WorkerId id, TimePoint now, PartitionEffects& out);
  void report_kv_usage(PartitionEffects& out);
  void answer_overdue_awaiting(TimePoint now, PartitionEffects& out);
  /// Ends every input: the workers back from an ejection.
  void finish(PartitionEffects& out);
  void record_ceilings(const RouteRequest& request, PartitionEffects& out);
  void note_fleet_changed(PartitionEffects& out);

  PartitionRouterOptions options_;
  SelectorState selector_;
  selection::DisaggregationConfig disaggregation_;
  SessionAffinity affinity_;
  std::optional<PartitionQueue> queue_;
  std::string label_;
  /// When a dump was last asked for, per (worker, rank).
  absl::flat_hash_map<WorkerWithDpRank, TimePoint> dump_requested_;
  /// After a NATS reconnect: the workers whose KV state is to be dumped again once they are
  /// heard from (a registration, heartbeat or KV event proves the request can reach them), each
  /// until its grace period ends.
  absl::flat_hash_map<WorkerId, TimePoint> resync_wanted_;
  /// The ranks of workers heard from whose resync dump is still to be asked for, oldest first.
  std::deque<WorkerWithDpRank> resync_dumps_;
  std::size_t resync_budget_ = 0;
  /// The KV usage last reported; empty: none yet.
  std::optional<double> reported_kv_usage_;
  /// The deadline the owner was last asked to wake at and has not yet woken for.
  std::optional<TimePoint> wake_armed_for_;
  /// Cluster mode: the partition is owned until then.
  TimePoint owned_until_{};
  /// Cluster mode: requests waiting for the partition's lease, oldest first.
  std::vector<AwaitingOwnership> awaiting_ownership_;
  /// The hit-rate ceilings of the requests routed here, when measured.
  std::optional<metrics::HitRateCeilings> ceilings_;
  /// Every rank's registered KV blocks (none for a rank without a capacity), summed when a
  /// ceiling next needs it after the fleet changed.
  std::optional<std::uint64_t> fleet_kv_blocks_;
  /// Routed prompts not yet through the ceilings.
  struct DueCeilings {
    std::vector<BlockHash> block_hashes;
    std::uint64_t prompt_tokens = 0;
  };
  std::vector<DueCeilings> due_ceilings_;
  /// Ranks of this partition's workers taken from options_.rank_budget.
  std::uint64_t ranks_held_ = 0;
};

}  // namespace kvr
