// The plain state behind a selector actor: one routing partition's workers (catalog, KV index,
// predicted load), its worker-selection policies per worker type, and the signal source the
// selection host reads. The selector actor is a thin shell over it; `kvr replay` drives it
// directly on a logical clock. Single-threaded: exactly one owner calls it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "discovery/discovery_state.hpp"
#include "messages/error.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/selection_host.hpp"

namespace kvr::actors {

using TimePoint = std::chrono::steady_clock::time_point;

/// Settings of one selector.
struct SelectorOptions {
  /// The partition served; registrations for other partitions are refused.
  plugins::worker_selection::RoutingPartition partition;
  /// Router settings handed to the policy factories (block size, kv-cost defaults ...).
  plugins::worker_selection::RouterConfig router;
  /// A booking that is never reported (first token, completion) is released after this long.
  std::chrono::milliseconds lease_ttl{120'000};
  discovery::IndexerConfig index;
  discovery::RegistrationLimits registration;
};

/// One request to route, as the selector receives it. Spans refer to the caller's storage.
struct RouteInput {
  std::string request_id;
  WorkerType worker_type = WorkerType::Aggregated;
  std::size_t prompt_tokens = 0;
  std::span<const BlockHash> block_hashes;
  std::optional<std::uint32_t> expected_output_tokens;
  const plugins::worker_selection::SessionContext* session = nullptr;
  std::optional<plugins::worker_selection::WorkerAffinityTarget> affinity_target;
  std::optional<plugins::worker_selection::WorkerAffinityTarget> pinned_worker;
  std::uint32_t priority = 0;
  std::span<const WorkerId> allowed_workers;
  /// Never eligible: a retry excludes the worker that failed the request before.
  std::span<const WorkerId> excluded_workers;
  std::span<const std::string> required_taints;
  std::span<const selection::PreferredTaint> preferred_taints;
};

/// A routing decision that has been booked.
struct RouteOutcome {
  WorkerWithDpRank worker;
  /// The chosen worker's matched prefix, by tier, in blocks.
  std::uint32_t device_overlap_blocks = 0;
  std::uint32_t host_overlap_blocks = 0;
  std::uint32_t disk_overlap_blocks = 0;
  /// Prompt tokens the worker has to compute.
  std::uint64_t uncached_prefill_tokens = 0;
  double total_cost = 0;
  absl::InlinedVector<double, 4> scorer_costs;
  /// The scorers' names, index-aligned with scorer_costs (shared, built once per policy).
  std::shared_ptr<const std::vector<std::string>> scorer_names;
  /// The booking is released at this time unless reported earlier.
  TimePoint lease_expires_at;
  std::size_t eligible_workers = 0;
};

/// Why a request could not be routed; `code` maps onto the wire's RouteErrorCode.
struct RouteFailure {
  Error code = Error::policy_failed;
  std::string message;
};

/// One partition's routing state.
class SelectorState final : public selection::WorkerSignalSource {
 public:
  /// `plugins` must outlive the state; the policy factories run on first use of each role.
  SelectorState(SelectorOptions options, const plugins::RouterPlugins& plugins);

  // ---- worker state, fed by the discovery path ----------------------------------------------
  /// Registers (or re-registers) a worker of this partition.
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
  /// Releases at most `limit` bookings whose lease ended; returns how many.
  std::size_t expire_bookings(TimePoint now, std::size_t limit) {
    return discovery_.load().expire(now, limit);
  }

  // ---- routing ------------------------------------------------------------------------------
  /// Selects a worker and books the request on it before returning, so the next selection
  /// already sees this one (no herding on stale metrics).
  std::expected<RouteOutcome, RouteFailure> route(const RouteInput& input, TimePoint now);
  /// Books the request on exactly `worker` without running the policy (hard session affinity, a
  /// pinned dispatch). The worker must serve the request's worker type in this partition and pass
  /// the request's hard restrictions: availability, pin, allow-list, exclusions and required
  /// taints; busy thresholds do not apply (the caller asked for this worker). Fails with
  /// Error::no_workers, naming the reason, when `worker` cannot take the request, and as route()
  /// does for an invalid request. The outcome reports `worker`'s overlap, no costs and one
  /// eligible worker.
  std::expected<RouteOutcome, RouteFailure> route_to(const RouteInput& input,
                                                     WorkerWithDpRank worker, TimePoint now);
  /// The request produced its first token: its prefill tokens are released.
  std::expected<void, discovery::LoadError> first_token(std::string_view request_id);
  /// The request ended (completed, cancelled or failed): its booking is released.
  std::expected<void, discovery::LoadError> release(std::string_view request_id,
                                                    discovery::BookingEnd end);

  // ---- selection::WorkerSignalSource ------------------------------------------------------
  std::span<const selection::WorkerDescriptor> workers(WorkerType worker_type) const override;
  void compute_signals(const selection::SelectionRequest& request, WorkerType worker_type,
                       std::span<const std::uint32_t> rows,
                       std::span<selection::WorkerCacheInput> cache_out,
                       std::span<selection::WorkerLoadInput> load_out) override;

  const discovery::DiscoveryState& discovery() const { return discovery_; }
  const SelectorOptions& options() const { return options_; }
  /// The policy serving a worker type (created on first use).
  plugins::worker_selection::WorkerSelectionPolicy& policy(WorkerType worker_type);
  /// The instance name chosen for a worker type.
  const std::string& policy_name(WorkerType worker_type) const;

 private:
  // Per worker type: the rows the host selects over and what each row needs for its signals.
  struct RoleRows {
    std::vector<selection::WorkerDescriptor> descriptors;
    std::vector<discovery::SlotId> slots;
    std::vector<std::uint64_t> total_kv_blocks;
  };

  /// Checks the prompt and that the request id has no open booking.
  std::expected<void, RouteFailure> validate(const RouteInput& input) const;
  /// Why `worker` cannot take `input` on its own (empty: it can).
  std::optional<std::string> unroutable_reason(const RouteInput& input,
                                               WorkerWithDpRank worker) const;
  /// Completes `outcome` (uncached tokens, lease) and books the request on outcome.worker.
  std::expected<RouteOutcome, RouteFailure> book(const RouteInput& input, RouteOutcome outcome,
                                                 TimePoint now);
  void rebuild_rows() const;
  void refresh_busy_signals(RoleRows& rows) const;
  /// The request's matched prefix on every rank: one index lookup per routed request, shared by
  /// the signal computation and the booking.
  const discovery::MatchResult& matches_for(std::span<const BlockHash> block_hashes);

  SelectorOptions options_;
  const plugins::RouterPlugins* plugins_;
  discovery::DiscoveryState discovery_;
  std::array<std::optional<plugins::worker_selection::WorkerSelectionPolicy>, 4> policies_;
  std::array<std::shared_ptr<const std::vector<std::string>>, 4> scorer_names_;
  mutable std::array<RoleRows, 4> rows_;
  mutable bool rows_dirty_ = true;

  // Per-request scratch, reused so that a warm selection does not allocate.
  discovery::MatchResult matches_;
  std::uint64_t route_counter_ = 0;      // numbers route() calls
  std::uint64_t matches_for_route_ = 0;  // the route() call matches_ belongs to (0: none)
  bool in_route_ = false;
  discovery::ProjectionScratch projection_scratch_;
};

}  // namespace kvr::actors
