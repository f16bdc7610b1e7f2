// The plain state behind a selector actor: one routing partition's workers (catalog, KV index,
// predicted load), its worker-selection policies per worker type, and the signal source the
// selection host reads. The selector actor is a thin shell over it; `kvr replay` drives it
// directly on a logical clock. Single-threaded: exactly one owner calls it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "classifiers/queue/policy_class_config.hpp"
#include "discovery/partition_workers.hpp"
#include "messages/error.hpp"
#include "selection/partition/booking_caps.hpp"
#include "selection/partition/route_request.hpp"
#include "selection/partition/route_result.hpp"
#include "selection/partition/worker_health.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/selection_host.hpp"

namespace kvr {

/// Settings of one selector.
struct SelectorOptions {
  /// The partition served; registrations for other partitions are refused.
  plugins::worker_selection::RoutingPartition partition;
  /// Router settings handed to the policy factories (block size, kv-cost defaults ...). A
  /// block size of 0 is learnt from the partition's first registered worker (block_size()).
  plugins::worker_selection::RouterConfig router;
  /// A booking that is never reported (first token, completion) is released after this long.
  std::chrono::milliseconds booking_ttl{120'000};
  discovery::IndexerConfig index;
  discovery::RegistrationLimits registration;
  /// Passive health: outlier ejection and slow start (selection/partition/worker_health.hpp).
  selection::WorkerHealthConfig health;
  /// This partition's caps on open bookings (0: none); a route beyond one is refused with
  /// Error::overloaded before selection.
  BookingCaps partition_caps;
  /// The node's totals and caps, shared by its selectors; null: no node-wide cap.
  std::shared_ptr<NodeBookingTotals> node_totals;
  /// Each client's totals over the node and the per-client caps, shared by the node's
  /// selectors; null: no per-client cap.
  std::shared_ptr<ClientBookingTotals> client_totals;
  /// Told each refusal by a cap (a metric); may be empty.
  BookingCapRefusalSink on_cap_refusal;
  /// Told each role whose policy could not be built, with the reason (a metric and the log);
  /// may be empty.
  std::function<void(const plugins::worker_selection::RoutingPartition&, WorkerType,
                     const std::string& reason)>
      on_policy_build_failure;
};

/// One partition's routing state.
class SelectorState final : public selection::WorkerSignalSource {
 public:
  /// `plugins` must outlive the state. Each role's policy factory runs once, when the partition's
  /// block size is known (here when configured, else at the first registration), and again only
  /// when a later fleet brings another block size: a policy's state outlives its workers. A
  /// factory that throws, or returns a policy without a picker or for another role, fails that
  /// role's requests with Error::policy_failed naming the reason (on_policy_build_failure). A
  /// role the bundle holds no factory for (a default-constructed RouterPlugins) is served by the
  /// built-in default policy.

  SelectorState(SelectorOptions options, const plugins::RouterPlugins& plugins);

  // ---- worker state, fed by the discovery path ----------------------------------------------
  /// Registers (or re-registers) a worker of this partition. A worker whose block size differs
  /// from the partition's is refused and remembered (until its liveness would have ended), so that
  /// a request that finds no worker says why.
  std::expected<discovery::RegistrationChange, discovery::RegistrationError> register_worker(
      discovery::WorkerRegistration registration, TimePoint now);
  std::expected<void, discovery::CatalogError> heartbeat(WorkerId worker, Incarnation incarnation,
                                                         TimePoint now);
  std::expected<void, discovery::CatalogError> deregister(WorkerId worker, Incarnation incarnation);
  /// Applies a KV event batch; the outcome reports an event-id gap (ask the worker for a dump).
  std::expected<discovery::ApplyOutcome, discovery::IndexError> apply_kv_events(
      const KvEventBatch& batch);
  /// Replaces a rank's index contents with a dump.
  std::expected<discovery::ApplyOutcome, discovery::IndexError> load_kv_dump(const KvDump& dump);
  /// Records a rank's load report.
  std::expected<void, discovery::LoadError> update_load(WorkerWithDpRank worker,
                                                        const discovery::ConfirmedLoad& load);
  /// Expires leases, bookings and approximate blocks; appends removed worker ids.
  void expire(TimePoint now, std::vector<WorkerId>& removed_workers);
  /// The node's own NATS connection is down: workers' liveness is held (not expired) until
  /// resume_liveness(); see discovery::WorkerCatalog::hold_liveness().
  void hold_liveness() { workers_.hold_liveness(); }
  /// The connection is back at `now`: every worker's liveness runs at least one TTL from `now`.
  discovery::LivenessGrace resume_liveness(TimePoint now) { return workers_.resume_liveness(now); }
  /// Releases at most `limit` bookings that expired; returns how many.
  std::size_t expire_bookings(TimePoint now, std::size_t limit) {
    const std::size_t expired = workers_.load().expire(now, limit);
    if (expired > 0) sync_node_share();
    return expired;
  }

  // ---- routing ------------------------------------------------------------------------------
  /// Selects a worker and books the request on it before returning, so the next selection
  /// already sees this one (no herding on stale metrics).
  /// Token ids (or the prompt's text) are hashed into the request's block hashes at the
  /// partition's block size, and the request is stamped with `now`.
  /// A pinned request takes the exact-target path (route_to): no filter, scorer or picker runs;
  /// a pin that names no rank goes to the worker's rank that holds most of the prompt.
  /// A query-only request is selected the same way and nothing is booked; a worker in slow start
  /// is offered as if its ramp were over, since a query takes none of its share.
  std::expected<RouteOutcome, RouteFailure> route(RouteRequest& request, TimePoint now);
  /// Books the request on exactly `worker` without running the policy (hard session affinity, a
  /// pinned dispatch), or only answers for a query-only request. The worker must serve the
  /// request's worker type in this partition and pass the request's hard restrictions:
  /// availability, pin, allow-list, exclusions and required taints; busy thresholds do not apply
  /// (the caller asked for this worker). Fails with Error::no_workers, naming the reason, when
  /// `worker` cannot take the request, and as route() does for an invalid request. The outcome
  /// reports `worker`'s overlap, no costs and one eligible worker.
  std::expected<RouteOutcome, RouteFailure> route_to(RouteRequest& request, WorkerWithDpRank worker,
                                                     TimePoint now);
  /// The request produced its first token at `now`: its prefill tokens are released and the
  /// policies' observers are told; `calibration`, when given, receives an observer's prediction
  /// for the request.
  std::expected<void, discovery::LoadError> first_token(
      std::string_view request_id, TimePoint now = {},
      std::optional<plugins::worker_selection::TtftCalibration>* calibration = nullptr);
  /// The request ended (completed, cancelled or failed) at `now`: its booking is released and the
  /// policies' observers are told.
  std::expected<void, discovery::LoadError> release(std::string_view request_id,
                                                    discovery::BookingEnd end, TimePoint now = {});
  /// What the observers of each role's policy have learnt (empty for a policy without any), by
  /// worker type.
  std::vector<std::pair<WorkerType, plugins::worker_selection::LearntValue>> learnt_values() const;

  // ---- passive health (selection/partition/worker_health.hpp) -----------------------------------
  /// A success or failure reported against a worker of this partition; an ejection takes its
  /// ranks out of routing at once. Empty: the worker is not registered here (nothing changed).
  std::optional<FailureVerdict> report_health(const WorkerHealthReport& report, TimePoint now);
  /// Ejected workers whose back-off ended return to routing (route() and expire() do it too).
  void return_ejected(TimePoint now);
  /// The workers that returned from an ejection since the last call (for the log).
  std::vector<WorkerId> take_returned() { return std::exchange(returned_, {}); }
  const WorkerHealth& health() const { return health_; }

  // ---- admission queue (selection/partition/partition_queue.hpp) --------------------------------
  /// Hashes the request's token ids or text (at block_size()), stamps it with `now` and checks the
  /// prompt and that its id has no open booking; route() and route_to() run it first themselves,
  /// and it may run again on a prepared request.
  std::expected<void, RouteFailure> prepare(RouteRequest& request, TimePoint now);
  /// The prefill load of every worker rank eligible for `request` (of its role, passing its hard
  /// restrictions), into `out` (cleared first): what the policy-class busy rule reads.
  void eligible_prefill_loads(const RouteRequest& request,
                              std::vector<classifiers::WorkerPrefillLoad>& out) const;
  /// The fewest prompt tokens an eligible worker rank would have to compute for the prepared
  /// `request` (its whole prompt when no eligible rank holds any of it): its queue cost.
  std::uint64_t fewest_uncached_tokens(const RouteRequest& request);
  /// The least prefill work an eligible worker rank of the request's role has ahead of the
  /// prepared `request`'s first token: its queued prefill tokens (bookings included) plus the
  /// request's uncached tokens there. Empty when no rank of the role may take the request.
  std::optional<std::uint64_t> least_prefill_work(const RouteRequest& request);
  /// The prefill tokens queued on `worker` (bookings included); 0 for an unknown rank.
  std::uint64_t queued_prefill_tokens(WorkerWithDpRank worker) const;
  /// The KV blocks `worker`'s running requests hold (its report plus the bookings since); 0 for
  /// an unknown rank.
  std::uint64_t active_kv_blocks(WorkerWithDpRank worker) const;
  /// The work ahead of each rank a request's prompt goes to first (the prefill workers when the
  /// partition has some), in tokens: its queued prefill plus the KV its running requests hold. A
  /// shard publishes it as its load (selection/cluster/sharding.hpp).
  std::vector<std::uint64_t> work_ahead_tokens() const;

  // ---- selection::WorkerSignalSource ------------------------------------------------------
  std::span<const selection::WorkerDescriptor> workers(WorkerType worker_type) const override;
  void compute_signals(const selection::SelectionRequest& request, WorkerType worker_type,
                       std::span<const std::uint32_t> rows,
                       std::span<selection::WorkerCacheInput> cache_out,
                       std::span<selection::WorkerLoadInput> load_out) override;

  const discovery::PartitionWorkers& partition_workers() const { return workers_; }
  const SelectorOptions& options() const { return options_; }
  /// The partition's block size: the configured one, else the one its first worker announced;
  /// 0 while no worker has registered (and again once the last one has left).
  std::uint32_t block_size() const { return block_size_; }
  /// The policy serving a worker type (created on first use).
  // Runs every role's factory at the current block size.
  void build_policies();
  // The rank of a pinned `worker` that may take `request` and holds most of its prompt.
  WorkerWithDpRank pinned_rank(const RouteRequest& request, WorkerId worker);
  /// The instance name chosen for a worker type.
  const std::string& policy_name(WorkerType worker_type) const;

 private:
  // Per worker type: the rows the host selects over and what each row needs for its signals.
  struct RoleRows {
    std::vector<selection::WorkerDescriptor> descriptors;
    std::vector<discovery::SlotId> slots;       // in the KV index
    std::vector<discovery::SlotId> text_slots;  // in the text index
    std::vector<std::uint64_t> max_batched_tokens;

    const std::vector<discovery::SlotId>& slots_for(selection::PromptKeys keys) const;
  };

  /// A worker refused for its block size, remembered to explain a request that finds no worker.
  struct RefusedWorker {
    std::uint32_t block_size = 0;
    TimePoint forget_at;
  };

  /// Why `worker` cannot take `request` on its own (empty: it can).
  std::optional<std::string> unroutable_reason(const RouteRequest& request,
                                               WorkerWithDpRank worker) const;
  /// Completes `outcome` (uncached tokens, booking) and books the request on outcome.worker
  /// (a query-only request: completes it only).
  /// `selected` is the policy's selection, when one ran: its signals go to the observers.
  std::expected<RouteOutcome, RouteFailure> book(
      const RouteRequest& request, RouteOutcome outcome, TimePoint now,
      const selection::SelectionResult* selected = nullptr);
  /// `failure`, with the workers refused for their block size named when it found no worker.
  RouteFailure explain(RouteFailure failure) const;
  /// The refusal when one more booking of `blocks` prompt blocks for `client` (empty: none)
  /// would pass a cap (counted).
  std::optional<RouteFailure> over_cap(std::uint64_t blocks, std::string_view client) const;
  /// Brings the node totals up to this partition's bookings (after any change to them).
  void sync_node_share() {
    const discovery::PredictedLoad& load = workers_.load();
    node_share_.set(load.open_bookings(), load.booked_prompt_blocks());
  }
  /// Forgets the learnt block size and the policies built for it once the last worker has left.
  void forget_block_size_when_empty();
  /// Calls `visit` with the host of each of `policies` that has observers (const with a const
  /// array).
  template <class Policies, class Visit>
  static void for_each_observed_policy(Policies& policies, Visit&& visit) {
    for (auto& policy : policies) {
      if (!policy) continue;
      auto& host = selection::SelectionHost::of(*policy);
      if (host.has_observers()) visit(host);
    }
  }
  /// Fills the outcome's overlap by tier from the chosen worker's match.
  void set_overlap(RouteOutcome& outcome, const selection::SelectionRequest& request);
  void rebuild_rows() const;
  /// Re-marks every row's availability from the ejections after they changed.
  void mark_ejections();
  /// Slow start: hides the ramping rows of `worker_type` that are not offered to this selection
  /// (remembered in hidden_rows_).
  void hide_ramping(WorkerType worker_type, TimePoint now);
  void unhide_ramping(WorkerType worker_type);
  void refresh_busy_signals(RoleRows& rows) const;
  /// The least `cost(rank, uncached tokens of the request there)` over the ranks of the prepared
  /// request's role that pass its hard restrictions; empty when none does.
  template <class Cost>
  std::optional<std::uint64_t> least_over_eligible_ranks(const RouteRequest& request, Cost cost);
  /// The request's matched prefix on every rank: one index lookup per routed request, shared by
  /// the signal computation and the booking.
  const discovery::MatchResult& matches_for(const selection::SelectionRequest& request);
  /// The KV index, or the text index for text-block keys.
  const discovery::KvIndexer& index_for(selection::PromptKeys keys) const;

  SelectorOptions options_;
  const plugins::RouterPlugins* plugins_;
  discovery::PartitionWorkers workers_;
  // This partition's part of the node totals; given back when the state goes.
  NodeBookingShare node_share_;
  // Each client's part of the per-client totals; at a fixed address, since the load ledger tells
  // it of ended bookings.
  std::unique_ptr<ClientBookingShare> client_share_;
  std::uint32_t block_size_ = 0;
  absl::flat_hash_map<WorkerId, RefusedWorker> refused_;
  std::array<std::optional<plugins::worker_selection::WorkerSelectionPolicy>, 4> policies_;
  std::array<std::shared_ptr<const std::vector<std::string>>, 4> scorer_names_;
  // Why a role's policy could not be built; empty where it was.
  std::array<std::string, 4> policy_failures_;
  // The block size the policies were built at (0: not built yet).
  std::uint32_t policies_block_size_ = 0;
  mutable std::array<RoleRows, 4> rows_;
  mutable bool rows_dirty_ = true;
  WorkerHealth health_;
  std::vector<WorkerId> returned_;
  std::vector<std::uint32_t> hidden_rows_;

  // Per-request scratch, reused so that a warm selection does not allocate.
  discovery::MatchResult matches_;
  std::uint64_t route_counter_ = 0;      // numbers route() calls
  std::uint64_t matches_for_route_ = 0;  // the route() call matches_ belongs to (0: none)
  bool in_route_ = false;
  discovery::ProjectionScratch projection_scratch_;
};

}  // namespace kvr
