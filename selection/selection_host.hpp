// The selection host: runs a WorkerSelectionPolicy for one request (eligibility → filters →
// scorers → picker) over the workers and signals a WorkerSignalSource provides. Used by the
// selector actor and by replay; it knows no indexer, no actor and no network.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "selection/selection_request.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::selection {

using plugins::worker_selection::PolicyResult;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::SessionContext;
using plugins::worker_selection::WorkerAffinityTarget;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerCandidate;
using plugins::worker_selection::WorkerFilter;
using plugins::worker_selection::WorkerInputs;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerPicker;
using plugins::worker_selection::WorkerScorer;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

/// What the host needs to know of a (worker, rank) before any signal is computed.
struct WorkerDescriptor {
  WorkerWithDpRank worker;
  /// Labels matched against required and preferred taints; storage owned by the source.
  std::span<const std::string> taints;
  /// False while the worker is unhealthy, draining or not yet ready.
  bool available = true;
  /// Fraction of KV blocks in use, bookings included; empty without a load observation or
  /// without a registered capacity (never busy by KV then).
  std::optional<double> kv_usage;
  /// Prompt tokens waiting for prefill, bookings included.
  std::uint64_t active_prefill_tokens = 0;
};

/// Where workers and their signal groups come from (the selector's catalog, index and predicted
/// load; replay's simulated fleet; a test fixture).
class WorkerSignalSource {
 public:
  virtual ~WorkerSignalSource() = default;

  /// Every (worker, rank) of the partition that serves `worker_type`.
  virtual std::span<const WorkerDescriptor> workers(WorkerType worker_type) const = 0;

  /// Fills the requested groups for `rows` (indices into workers(worker_type)). `cache_out` and
  /// `load_out` are index-aligned with `rows`, and empty when that group was not requested.
  virtual void compute_signals(const SelectionRequest& request, WorkerType worker_type,
                               std::span<const std::uint32_t> rows,
                               std::span<WorkerCacheInput> cache_out,
                               std::span<WorkerLoadInput> load_out) = 0;
};

/// The outcome of one selection: which worker, why, and at what cost.
struct SelectionResult {
  WorkerWithDpRank worker;
  /// Sum of the scorer contributions for the chosen worker.
  double total_cost = 0;
  /// Each scorer's contribution for the chosen worker, in declaration order (scorer_names()).
  absl::InlinedVector<double, 4> scorer_costs;
  /// The chosen worker's cache and load inputs, when some component declared those groups.
  std::optional<WorkerCacheInput> cache;
  std::optional<WorkerLoadInput> load;
  /// Workers that passed eligibility, and of those, the ones every filter kept.
  std::size_t eligible_workers = 0;
  std::size_t kept_workers = 0;
};

/// Runs one selection with `policy`; never throws. A failure names the component and row.
std::expected<SelectionResult, WorkerSelectionPolicyError> select_worker(
    WorkerSelectionPolicy& policy, const SelectionRequest& request,
    const RoutingPartition& partition, WorkerSignalSource& signals);

/// Readable names of the policy's scorers (their C++ type names), index-aligned with
/// SelectionResult::scorer_costs.
std::span<const std::string> scorer_names(const WorkerSelectionPolicy& policy);

/// The union of the signal groups the policy's components declared.
WorkerInputs declared_inputs(const WorkerSelectionPolicy& policy);

/// exp(−tanh(Σ weights of `preferred` taints that `worker_taints` carries)).
double preferred_taint_multiplier(std::span<const PreferredTaint> preferred,
                                  std::span<const std::string> worker_taints);

/// The host behind a WorkerSelectionPolicy: its components and reusable scratch buffers.
class SelectionHost {
 public:
  SelectionHost(const RouterConfig& config, WorkerType worker_type,
                std::vector<std::unique_ptr<WorkerFilter>> filters,
                std::vector<std::unique_ptr<WorkerScorer>> scorers,
                std::unique_ptr<WorkerPicker> picker,
                std::vector<std::shared_ptr<plugins::worker_selection::WorkerSelectionObserver>>
                    observers = {});

  static SelectionHost& of(WorkerSelectionPolicy& policy) { return *policy.host_; }
  static const SelectionHost& of(const WorkerSelectionPolicy& policy) { return *policy.host_; }

  std::expected<SelectionResult, WorkerSelectionPolicyError> select(
      const SelectionRequest& request, const RoutingPartition& partition,
      WorkerSignalSource& signals);

  WorkerType worker_type() const { return worker_type_; }
  std::span<const std::string> scorer_names() const { return scorer_names_; }

  // ---- observers (WorkerSelectionObserver); each call catches what an observer throws ------
  bool has_observers() const { return !observers_.empty(); }
  void notify_routed(const plugins::worker_selection::RoutedRequest& request);
  /// The first calibration an observer returned.
  std::optional<plugins::worker_selection::TtftCalibration> notify_first_token(
      std::string_view request_id, std::chrono::steady_clock::time_point at);
  void notify_ended(std::string_view request_id, plugins::worker_selection::RoutedRequestEnd end,
                    std::chrono::steady_clock::time_point at);
  /// Every observer's learnt values, in observer order.
  std::vector<plugins::worker_selection::LearntValue> learnt_values() const;
  /// Calls into observers that threw (each was caught).
  std::uint64_t observer_failures() const { return observer_failures_; }
  WorkerInputs declared_inputs() const { return declared_inputs_; }

 private:
  bool eligible(const SelectionRequest& request, const WorkerDescriptor& descriptor) const;
  /// Where a candidate's cache and load pointers come from: row i points at base + i * step, and
  /// an undeclared group is a null base with step 0.
  struct RowColumns {
    const WorkerCacheInput* cache = nullptr;
    std::size_t cache_step = 0;
    const WorkerLoadInput* load = nullptr;
    std::size_t load_step = 0;
  };

  /// One pass over descriptors_: writes the eligible rows into rows_ and their candidates,
  /// exposing `inputs`, into candidates_; returns how many.
  std::size_t collect_eligible_rows(const SelectionRequest& request, WorkerInputs inputs);
  RowColumns columns_for(WorkerInputs inputs) const;
  /// The current rows' candidates exposing only the groups in `inputs`; rebuilt only when they
  /// expose something else.
  std::span<const WorkerCandidate> candidates_for(WorkerInputs inputs);
  /// The summed cost of row `i` (with one scorer, its column; with none, 0).
  double total_cost(std::size_t i) const {
    return scorers_.size() == 1 ? scorer_costs_[i] : total_costs_[i];
  }
  /// The preferred-taint multiplier of the current row `i`.
  double taint_multiplier(std::size_t i) const {
    return uniform_taint_multiplier_ ? 1.0 : taint_multipliers_[i];
  }
  /// Keeps only rows whose keep_ flag is set, in every row-aligned buffer.
  void compact_rows();

  std::expected<void, WorkerSelectionPolicyError> run_filters(
      const plugins::worker_selection::WorkerSelectionContext& context);
  /// The error for the first non-finite contribution or total of scorer `scorer`.
  WorkerSelectionPolicyError non_finite_cost(std::size_t scorer,
                                             std::span<const double> costs) const;
  /// Runs the scorers and fills scored_ for the picker.
  std::expected<void, WorkerSelectionPolicyError> run_scorers(
      const plugins::worker_selection::WorkerSelectionContext& context);
  /// Adds scorer `scorer`'s column to the totals and checks it; after the last scorer, the same
  /// pass writes the picker's rows. Returns false when a contribution or total is not finite.
  bool accumulate_costs(std::size_t scorer, std::span<const double> costs);

  RouterConfig config_;
  WorkerType worker_type_;
  std::vector<std::unique_ptr<WorkerFilter>> filters_;
  std::vector<std::unique_ptr<WorkerScorer>> scorers_;
  std::unique_ptr<WorkerPicker> picker_;
  std::vector<std::shared_ptr<plugins::worker_selection::WorkerSelectionObserver>> observers_;
  mutable std::uint64_t observer_failures_ = 0;
  std::vector<std::string> filter_names_;
  std::vector<std::string> scorer_names_;
  std::string picker_name_;
  WorkerInputs declared_inputs_;
  WorkerInputs picker_inputs_;

  // Row-aligned scratch, reused across selections so that a warm selection does not allocate.
  // The vectors only grow (to the largest fleet seen); rows [0, rows_count_) are current, so a
  // selection never pays for value-initialising elements a previous one already had.
  std::span<const WorkerDescriptor> descriptors_;
  std::size_t rows_count_ = 0;
  std::vector<std::uint32_t> rows_;  // index into descriptors_
  // Each row's worker, and its groups as the last component saw them: the eligibility pass
  // builds them, so later passes never re-read the source's descriptors.
  std::vector<WorkerCandidate> candidates_;
  std::optional<WorkerInputs> exposed_;  // what candidates_ expose; empty: rebuild before use
  std::vector<WorkerCacheInput> cache_;
  std::vector<WorkerLoadInput> load_;
  std::vector<double> taint_multipliers_;  // unused when uniform_taint_multiplier_
  bool uniform_taint_multiplier_ = false;
  std::vector<char> keep_;
  std::vector<double> scorer_costs_;  // scorer-major: scorer s, row i at s * rows + i
  std::vector<double> total_costs_;   // unused with fewer than two scorers
  std::vector<plugins::worker_selection::ScoredWorkerCandidate> scored_;
};

}  // namespace kvr::selection
