// The public worker-selection plugin API: the types a custom filter, scorer or picker is written
// against, and the host-side policy that composes them. A plugin includes <kvr/plugin.hpp>, which
// includes this header. The contract: docs/plugin-api.md.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/plugin_parameters.hpp"
#include "messages/ids.hpp"
#include "messages/session_context.hpp"
#include "selection/router_config.hpp"

namespace kvr::selection {
class SelectionHost;
struct SelectionRequest;
}  // namespace kvr::selection

namespace kvr::plugins::worker_selection {

using kvr::as_str;
using kvr::DpRank;
using kvr::InputTrigger;
using kvr::SessionContext;
using kvr::WorkerId;
using kvr::WorkerType;
using kvr::WorkerWithDpRank;

/// A soft routing target: a worker, or one data-parallel rank of it.
struct WorkerAffinityTarget {
  WorkerId worker_id = 0;
  std::optional<DpRank> dp_rank;  ///< empty: matches every rank of the worker

  /// True when `worker` is this target (any rank when dp_rank is empty).
  bool matches(WorkerWithDpRank worker) const {
    return worker.worker_id == worker_id && (!dp_rank || *dp_rank == worker.dp_rank);
  }
  friend bool operator==(const WorkerAffinityTarget&, const WorkerAffinityTarget&) = default;
};

/// The routing partition a policy instance serves: one model and routing group.
struct RoutingPartition {
  std::string model;
  std::string routing_group = "default";

  friend bool operator==(const RoutingPartition&, const RoutingPartition&) = default;
};

/// The signal groups a component asks the host to compute; combine with |.
class WorkerInputs {
 public:
  static const WorkerInputs NONE;
  static const WorkerInputs CACHE;
  static const WorkerInputs LOAD;
  static const WorkerInputs PREFERRED_TAINT;

  constexpr WorkerInputs() = default;
  /// True when every group of `other` is in this set.
  constexpr bool contains(WorkerInputs other) const { return (bits_ & other.bits_) == other.bits_; }
  constexpr WorkerInputs operator|(WorkerInputs other) const {
    return WorkerInputs{static_cast<std::uint8_t>(bits_ | other.bits_)};
  }
  constexpr WorkerInputs& operator|=(WorkerInputs other) { return *this = *this | other; }
  constexpr bool empty() const { return bits_ == 0; }
  friend constexpr bool operator==(WorkerInputs, WorkerInputs) = default;

 private:
  constexpr explicit WorkerInputs(std::uint8_t bits) : bits_(bits) {}
  std::uint8_t bits_ = 0;
};

inline constexpr WorkerInputs WorkerInputs::NONE{0};
inline constexpr WorkerInputs WorkerInputs::CACHE{1};
inline constexpr WorkerInputs WorkerInputs::LOAD{2};
inline constexpr WorkerInputs WorkerInputs::PREFERRED_TAINT{4};

/// How much of the request's prompt a worker already holds, per tier, in blocks. The matched
/// prefix counts each block once, on the cheapest tier holding it; a missing tier or worker is 0.
class WorkerCacheInput {
 public:
  constexpr WorkerCacheInput() = default;
  constexpr WorkerCacheInput(double device, double host, double disk)
      : device_(device), host_(host), disk_(disk) {}

  double device_overlap_blocks() const { return device_; }
  double host_overlap_blocks() const { return host_; }
  double disk_overlap_blocks() const { return disk_; }

 private:
  double device_ = 0;
  double host_ = 0;
  double disk_ = 0;
};

/// The projected load of a worker if it takes the request: confirmed metrics plus bookings.
class WorkerLoadInput {
 public:
  /// Field values of a load observation; the host fills them from its load tracking.
  struct Values {
    std::size_t active_requests = 0;
    std::size_t active_prefill_tokens = 0;
    double decode_cost_blocks = 0;
    std::optional<std::uint64_t> total_kv_blocks;
  };

  /// A worker with no load observation yet (not the same as idle).
  constexpr WorkerLoadInput() = default;
  constexpr explicit WorkerLoadInput(const Values& values)
      : active_requests_(values.active_requests),
        active_prefill_tokens_(values.active_prefill_tokens),
        decode_cost_blocks_(values.decode_cost_blocks),
        total_kv_blocks_(values.total_kv_blocks.value_or(0)),
        has_total_kv_blocks_(values.total_kv_blocks.has_value()),
        available_(true) {}

  /// False: no load observation yet (not the same as idle).
  bool is_available() const { return available_; }
  std::size_t active_requests() const { return active_requests_; }
  /// Prompt tokens waiting for prefill on the worker, in-flight reservations included.
  std::size_t active_prefill_tokens() const { return active_prefill_tokens_; }
  /// Projected decode footprint in blocks, including this request's new blocks.
  double decode_cost_blocks() const { return decode_cost_blocks_; }
  /// The worker's registered KV capacity per rank, in blocks; nullopt when its engine did not
  /// say (the host then treats it as never full by KV).
  std::optional<std::uint64_t> total_kv_blocks() const {
    return has_total_kv_blocks_ ? std::optional<std::uint64_t>{total_kv_blocks_} : std::nullopt;
  }

 private:
  // Flat fields with both flags side by side: 40 bytes a row instead of 48 with a nested
  // std::optional, which matters because the host keeps one per candidate row.
  std::size_t active_requests_ = 0;
  std::size_t active_prefill_tokens_ = 0;
  double decode_cost_blocks_ = 0;
  std::uint64_t total_kv_blocks_ = 0;
  bool has_total_kv_blocks_ = false;
  bool available_ = false;
};

/// Thrown by an accessor of a signal group the component did not declare (cache() or load() of a
/// WorkerCandidate or WorkerInputView): the host fails that selection with an error naming the
/// component and the group, and the node goes on.
class UndeclaredSignalGroup : public std::logic_error {
 public:
  explicit UndeclaredSignalGroup(const char* group)
      : std::logic_error(std::string{"read the "} + group +
                         " signal group, which it did not declare in required_worker_inputs()") {}
};

namespace detail {
[[noreturn]] inline void undeclared_signal_group(const char* group) {
  throw UndeclaredSignalGroup{group};
}
}  // namespace detail

/// One candidate row, restricted to the signal groups its component declared.
class WorkerCandidate {
 public:
  WorkerCandidate() = default;
  WorkerCandidate(WorkerWithDpRank worker, const WorkerCacheInput* cache,
                  const WorkerLoadInput* load, std::optional<double> preferred_taint_multiplier)
      : worker_id_(worker.worker_id),
        dp_rank_(worker.dp_rank),
        has_preferred_taint_multiplier_(preferred_taint_multiplier.has_value()),
        cache_(cache),
        load_(load),
        preferred_taint_multiplier_(preferred_taint_multiplier.value_or(0.0)) {}

  WorkerWithDpRank worker() const { return {worker_id_, dp_rank_}; }
  /// The row's cache signals, never null; throws UndeclaredSignalGroup unless the component
  /// declared CACHE.
  const WorkerCacheInput* cache() const {
    if (cache_ == nullptr) [[unlikely]]
      detail::undeclared_signal_group("CACHE");
    return cache_;
  }
  /// The row's load signals, never null; throws UndeclaredSignalGroup unless the component
  /// declared LOAD.
  const WorkerLoadInput* load() const {
    if (load_ == nullptr) [[unlikely]]
      detail::undeclared_signal_group("LOAD");
    return load_;
  }
  /// exp(−tanh(Σ weights of the request's preferred taints the worker carries)), in (0.46, 1];
  /// empty unless the component requested PREFERRED_TAINT.
  std::optional<double> preferred_taint_multiplier() const {
    return has_preferred_taint_multiplier_ ? std::optional<double>{preferred_taint_multiplier_}
                                           : std::nullopt;
  }

 private:
  // The rank and the flag share the word that WorkerWithDpRank and std::optional would each pad
  // out: 40 bytes a row instead of 48.
  WorkerId worker_id_ = 0;
  DpRank dp_rank_ = 0;
  bool has_preferred_taint_multiplier_ = false;
  const WorkerCacheInput* cache_ = nullptr;
  const WorkerLoadInput* load_ = nullptr;
  double preferred_taint_multiplier_ = 0;
};

/// A row after scoring, as the picker sees it.
class ScoredWorkerCandidate {
 public:
  ScoredWorkerCandidate() = default;
  ScoredWorkerCandidate(WorkerWithDpRank worker, double cost,
                        std::optional<double> preferred_taint_multiplier)
      : worker_id_(worker.worker_id),
        dp_rank_(worker.dp_rank),
        has_preferred_taint_multiplier_(preferred_taint_multiplier.has_value()),
        cost_(cost),
        preferred_taint_multiplier_(preferred_taint_multiplier.value_or(0.0)) {}

  WorkerWithDpRank worker() const { return {worker_id_, dp_rank_}; }
  /// Sum of all scorer contributions; lower is better by convention of the built-in pickers.
  double cost() const { return cost_; }
  /// Empty unless the picker requested PREFERRED_TAINT.
  std::optional<double> preferred_taint_multiplier() const {
    return has_preferred_taint_multiplier_ ? std::optional<double>{preferred_taint_multiplier_}
                                           : std::nullopt;
  }

 private:
  // Packed as WorkerCandidate: 32 bytes a row instead of 40.
  WorkerId worker_id_ = 0;
  DpRank dp_rank_ = 0;
  bool has_preferred_taint_multiplier_ = false;
  double cost_ = 0;
  double preferred_taint_multiplier_ = 0;
};

/// What a picker sees; the cache and load arrays are index-aligned with candidates().
class WorkerInputView {
 public:
  WorkerInputView(std::span<const ScoredWorkerCandidate> candidates,
                  std::optional<std::span<const WorkerCacheInput>> cache,
                  std::optional<std::span<const WorkerLoadInput>> load)
      : candidates_(candidates), cache_(cache), load_(load) {}

  std::span<const ScoredWorkerCandidate> candidates() const { return candidates_; }
  /// The rows' cache signals, always present (the optional keeps the reference API's shape);
  /// throws UndeclaredSignalGroup unless the picker declared CACHE.
  std::optional<std::span<const WorkerCacheInput>> cache() const {
    if (!cache_) [[unlikely]]
      detail::undeclared_signal_group("CACHE");
    return cache_;
  }
  /// The rows' load signals, always present; throws UndeclaredSignalGroup unless the picker
  /// declared LOAD.
  std::optional<std::span<const WorkerLoadInput>> load() const {
    if (!load_) [[unlikely]]
      detail::undeclared_signal_group("LOAD");
    return load_;
  }

 private:
  std::span<const ScoredWorkerCandidate> candidates_;
  std::optional<std::span<const WorkerCacheInput>> cache_;
  std::optional<std::span<const WorkerLoadInput>> load_;
};

/// The request being routed and where; always available to every component.
class WorkerSelectionContext {
 public:
  WorkerSelectionContext(const selection::SelectionRequest& request, std::uint32_t block_size,
                         WorkerType worker_type, const RoutingPartition& partition);

  // Inline and precomputed: scorers read these once per candidate, and a plugin would otherwise
  // pay a call through its PLT each time.
  std::size_t prompt_tokens() const { return prompt_tokens_; }
  /// prompt_tokens rounded up to whole blocks.
  std::size_t request_blocks() const { return request_blocks_; }
  std::size_t block_size() const { return block_size_; }
  /// The request's chained block hashes (full blocks only).
  std::span<const std::uint64_t> block_hashes() const;
  std::optional<std::uint32_t> expected_output_tokens() const;
  /// nullptr without session metadata.
  const SessionContext* session_context() const;
  /// A soft session binding or a classifier's target; the policy may honour it.
  std::optional<WorkerAffinityTarget> affinity_target() const;
  /// The worker the request is pinned to (rank 0 when the pin names no rank; eligibility then
  /// admits every rank of the worker).
  std::optional<WorkerWithDpRank> pinned_worker() const;
  std::uint32_t strict_priority() const;
  WorkerType worker_type() const { return worker_type_; }
  const RoutingPartition& partition() const { return *partition_; }
  /// Logical time in replay, the steady clock in a node.
  std::chrono::steady_clock::time_point now() const;

 private:
  const selection::SelectionRequest* request_;
  std::size_t prompt_tokens_;
  std::size_t request_blocks_;
  std::uint32_t block_size_;
  WorkerType worker_type_;
  const RoutingPartition* partition_;
};

/// Why a selection failed: a component's own failure or one of the host's checks.
class WorkerSelectionPolicyError {
 public:
  enum class Kind {
    Failed,             ///< a component returned failed(...) or threw
    NonFiniteCost,      ///< a scorer's contribution or the total is not finite, or unwritten
    InvalidPickerRow,   ///< the picker returned a row outside the candidates
    AllFiltered,        ///< filters removed every eligible worker
    NoEligibleWorkers,  ///< eligibility (allow-list, pin, ranks, taints, busy, availability)
                        ///< left no worker
    NoEndpoints,        ///< the partition has no worker of the requested type
  };

  /// A component's own failure, with its message.
  static WorkerSelectionPolicyError failed(std::string message) {
    return {Kind::Failed, std::move(message)};
  }
  /// Host-raised errors.
  static WorkerSelectionPolicyError host(Kind kind, std::string message) {
    return {kind, std::move(message)};
  }

  Kind kind() const { return kind_; }
  std::string_view message() const { return message_; }

 private:
  WorkerSelectionPolicyError(Kind kind, std::string message)
      : kind_(kind), message_(std::move(message)) {}
  Kind kind_;
  std::string message_;
};

template <class T>
using PolicyResult = std::expected<T, WorkerSelectionPolicyError>;

/// A hard yes/no per candidate; filters run in declaration order and a worker must pass all.
class WorkerFilter {
 public:
  virtual ~WorkerFilter() = default;
  virtual WorkerInputs required_worker_inputs() const { return WorkerInputs::NONE; }
  /// True keeps the candidate.
  virtual PolicyResult<bool> keep(const WorkerSelectionContext&, const WorkerCandidate&) = 0;
};

/// A cost contribution per candidate; contributions of all scorers are added.
class WorkerScorer {
 public:
  virtual ~WorkerScorer() = default;
  virtual WorkerInputs required_worker_inputs() const { return WorkerInputs::NONE; }
  virtual PolicyResult<double> score(const WorkerSelectionContext&, const WorkerCandidate&) = 0;
  /// Optional batch form for speed; the default calls score() per row. `costs` is pre-filled
  /// with NaN and index-aligned with `candidates`.
  virtual PolicyResult<void> score_all(const WorkerSelectionContext& context,
                                       std::span<const WorkerCandidate> candidates,
                                       std::span<double> costs);
};

/// Chooses the final row among the scored candidates.
class WorkerPicker {
 public:
  virtual ~WorkerPicker() = default;
  virtual WorkerInputs required_worker_inputs() const { return WorkerInputs::NONE; }
  /// Returns an index into view.candidates(); the host bounds-checks it.
  virtual PolicyResult<std::size_t> pick(const WorkerSelectionContext&, const WorkerInputView&) = 0;
};

/// How a routed request ended, as observers are told.
enum class RoutedRequestEnd : std::uint8_t { Completed, Cancelled, Failed };

/// A request the policy's partition has just booked on a worker, as observers see it.
struct RoutedRequest {
  std::string_view request_id;
  WorkerWithDpRank worker;
  std::size_t prompt_tokens = 0;
  std::size_t block_size = 0;
  /// The chosen worker's signals as this selection computed them; empty when the policy did not
  /// run (a pin or a hard session binding booked the worker directly) or no component declared
  /// the group.
  std::optional<WorkerCacheInput> cache;
  std::optional<WorkerLoadInput> load;
  /// When it was booked: logical time in replay, the steady clock in a node.
  std::chrono::steady_clock::time_point routed_at;
};

/// An observer's prediction of a request's time to first token beside the time observed, shown
/// in the node's metrics and the replay report so that a user sees whether the model fits.
struct TtftCalibration {
  WorkerWithDpRank worker;
  double predicted_seconds = 0;
  double observed_seconds = 0;
};

/// One number an observer has learnt (a rate, a per-worker factor), for metrics and reports.
struct LearntValue {
  std::string name;                ///< snake_case with its unit, e.g. "prefill_ms_per_1k_tokens"
  std::optional<WorkerId> worker;  ///< empty: the value holds for the whole partition
  double value = 0;
};

/// Learns from what the router sees of the requests a policy routed: each booking, its first
/// token and its end, with their times (the same in a node and in `kvr replay`). A policy that
/// adapts online hands one to WorkerSelectionPolicy beside its components and shares state with
/// them. Called on the policy's owner thread, never during a selection; must not block; an
/// exception is caught and counted, and the node goes on.
class WorkerSelectionObserver {
 public:
  virtual ~WorkerSelectionObserver() = default;
  /// Right after the booking of a request this policy's partition routed for its role.
  virtual void on_routed(const RoutedRequest& /*request*/) {}
  /// A routed request's first token arrived at `at`; returns the observer's prediction for it
  /// when it made one.
  virtual std::optional<TtftCalibration> on_first_token(
      std::string_view /*request_id*/, std::chrono::steady_clock::time_point /*at*/) {
    return std::nullopt;
  }
  /// A routed request ended (its booking was released) at `at`. Requests of other roles and
  /// requests never routed through on_routed() may be reported too: ignore unknown ids.
  virtual void on_ended(std::string_view /*request_id*/, RoutedRequestEnd /*end*/,
                        std::chrono::steady_clock::time_point /*at*/) {}
  /// What the observer has learnt so far.
  virtual std::vector<LearntValue> learnt_values() const { return {}; }
};

/// Host-side composition of filters, scorers and a picker, created per partition and role by a
/// factory. Move-only; owned by one selector, so it is never used from two threads at once.
class WorkerSelectionPolicy {
 public:
  WorkerSelectionPolicy(const RouterConfig& config, WorkerType worker_type,
                        std::vector<std::unique_ptr<WorkerScorer>> scorers,
                        std::unique_ptr<WorkerPicker> picker);
  WorkerSelectionPolicy(const RouterConfig& config, WorkerType worker_type,
                        std::vector<std::unique_ptr<WorkerFilter>> filters,
                        std::vector<std::unique_ptr<WorkerScorer>> scorers,
                        std::unique_ptr<WorkerPicker> picker);
  /// With observers told of every request the policy's partition routes for its role.
  WorkerSelectionPolicy(const RouterConfig& config, WorkerType worker_type,
                        std::vector<std::unique_ptr<WorkerFilter>> filters,
                        std::vector<std::unique_ptr<WorkerScorer>> scorers,
                        std::unique_ptr<WorkerPicker> picker,
                        std::vector<std::shared_ptr<WorkerSelectionObserver>> observers);
  WorkerSelectionPolicy(WorkerSelectionPolicy&&) noexcept;
  WorkerSelectionPolicy& operator=(WorkerSelectionPolicy&&) noexcept;
  WorkerSelectionPolicy(const WorkerSelectionPolicy&) = delete;
  WorkerSelectionPolicy& operator=(const WorkerSelectionPolicy&) = delete;
  ~WorkerSelectionPolicy();

  WorkerType worker_type() const;

 private:
  friend class selection::SelectionHost;
  std::unique_ptr<selection::SelectionHost> host_;
};

/// A startup diagnostic shown to the operator (bad parameters, unsupported role ...).
class WorkerSelectionPolicyProviderError {
 public:
  explicit WorkerSelectionPolicyProviderError(std::string message) : message_(std::move(message)) {}
  std::string_view message() const { return message_; }

 private:
  std::string message_;
};

/// Reads one instance's `parameters` mapping strictly: required<T>(key), optional<T>(key,
/// fallback), or optional<T>(key) for a std::optional; then finish() rejects keys nobody read. T is
/// bool, std::int32_t, std::int64_t, std::uint32_t, std::uint64_t, double, std::string, or a
/// std::vector of one of those (classifiers/plugin_parameters.hpp).
using ParameterReader = plugins::BasicParameterReader<WorkerSelectionPolicyProviderError>;

/// The instance's YAML `parameters` mapping (may be absent: then every key is absent).
class WorkerSelectionPolicyParameters {
 public:
  /// A null `source` means no parameters.
  explicit WorkerSelectionPolicyParameters(
      std::shared_ptr<const classifiers::ParameterSource> source)
      : source_(std::move(source)) {}
  /// A fresh strict reader over the mapping.
  ParameterReader reader() const { return ParameterReader{source_}; }

 private:
  std::shared_ptr<const classifiers::ParameterSource> source_;
};

using WorkerSelectionPolicyFactory =
    std::function<WorkerSelectionPolicy(const RouterConfig&, WorkerType, const RoutingPartition&)>;
using WorkerSelectionPolicyProvider =
    std::function<std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError>(
        const WorkerSelectionPolicyParameters&)>;

}  // namespace kvr::plugins::worker_selection
