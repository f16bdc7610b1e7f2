#include "selection/selection_host.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <stdexcept>
#include <typeinfo>

#include <cxxabi.h>
#include <fmt/format.h>

namespace kvr::selection {
namespace {

using plugins::worker_selection::LearntValue;
using plugins::worker_selection::RoutedRequest;
using plugins::worker_selection::RoutedRequestEnd;
using plugins::worker_selection::ScoredWorkerCandidate;
using plugins::worker_selection::TtftCalibration;
using plugins::worker_selection::WorkerInputView;
using plugins::worker_selection::WorkerSelectionContext;
using plugins::worker_selection::WorkerSelectionObserver;
using Kind = WorkerSelectionPolicyError::Kind;

// Readable component names for error messages and per-scorer cost reports.
template <class T>
std::string type_name_of(const T& component) {
  const char* mangled = typeid(component).name();
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled != nullptr ? demangled : mangled;
  std::free(
      demangled);  // NOLINT(cppcoreguidelines-no-malloc): __cxa_demangle allocates with malloc
  return name;
}

std::string describe_exception(std::exception_ptr thrown) {
  try {
    std::rethrow_exception(std::move(thrown));
  } catch (const std::exception& error) {
    return fmt::format("{}{}", "threw: ", error.what());
  } catch (...) {
    return "threw a non-standard exception";
  }
}

std::string row_name(std::size_t row, WorkerWithDpRank worker) {
  return fmt::format("{}{}{}{}{}{}{}", "row ", row, " (worker ", worker.worker_id, " rank ",
                     worker.dp_rank, ")");
}

WorkerSelectionPolicyError component_failure(std::string_view role, std::size_t index,
                                             std::string_view name, std::string_view detail) {
  return WorkerSelectionPolicyError::failed(
      fmt::format("{}{}{}{}{}{}{}", role, " ", index, " (", name, ") failed: ", detail));
}

// Makes `buffer` hold at least `size` elements. Scratch only grows, so a warm selection neither
// allocates nor re-initialises elements (callers track how many rows are current).
template <class T>
void grow_to(std::vector<T>& buffer, std::size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

}  // namespace

double preferred_taint_multiplier(std::span<const PreferredTaint> preferred,
                                  std::span<const std::string> worker_taints) {
  double matching_weight = 0;
  for (const PreferredTaint& taint : preferred) {
    if (std::ranges::find(worker_taints, taint.taint) != worker_taints.end()) {
      matching_weight += taint.weight;
    }
  }
  return std::exp(-std::tanh(matching_weight));
}

SelectionHost::SelectionHost(const RouterConfig& config, WorkerType worker_type,
                             std::vector<std::unique_ptr<WorkerFilter>> filters,
                             std::vector<std::unique_ptr<WorkerScorer>> scorers,
                             std::unique_ptr<WorkerPicker> picker,
                             std::vector<std::shared_ptr<WorkerSelectionObserver>> observers)
    : config_(config),
      worker_type_(worker_type),
      filters_(std::move(filters)),
      scorers_(std::move(scorers)),
      picker_(std::move(picker)),
      observers_(std::move(observers)) {
  for (const auto& observer : observers_) {
    if (!observer) throw std::invalid_argument("WorkerSelectionPolicy got a null observer");
  }
  // A policy without a picker or with null components cannot be used: fail at construction,
  // which happens at startup inside the factory, never on the data path.
  if (!picker_) throw std::invalid_argument("WorkerSelectionPolicy needs a picker");
  for (const auto& filter : filters_) {
    if (!filter) throw std::invalid_argument("WorkerSelectionPolicy got a null filter");
    filter_names_.push_back(type_name_of(*filter));
    declared_inputs_ |= filter->required_worker_inputs();
  }
  for (const auto& scorer : scorers_) {
    if (!scorer) throw std::invalid_argument("WorkerSelectionPolicy got a null scorer");
    scorer_names_.push_back(type_name_of(*scorer));
    declared_inputs_ |= scorer->required_worker_inputs();
  }
  picker_name_ = type_name_of(*picker_);
  declared_inputs_ |= picker_->required_worker_inputs();
  picker_inputs_ = picker_->required_worker_inputs();
}

bool SelectionHost::eligible(const SelectionRequest& request,
                             const WorkerDescriptor& descriptor) const {
  if (violated_restriction(request, descriptor.worker, descriptor.available, descriptor.taints)) {
    return false;
  }
  if (config_.busy_kv_usage_threshold && descriptor.kv_usage &&
      *descriptor.kv_usage > *config_.busy_kv_usage_threshold) {
    return false;
  }
  if (config_.busy_prefill_tokens_threshold &&
      descriptor.active_prefill_tokens > *config_.busy_prefill_tokens_threshold) {
    return false;
  }
  return true;
}

std::size_t SelectionHost::collect_eligible_rows(const SelectionRequest& request,
                                                 WorkerInputs inputs) {
  const std::size_t total = descriptors_.size();
  grow_to(rows_, total);
  grow_to(candidates_, total);
  // The signal columns are sized before the signals exist so that candidates can already point
  // at their row's slot.
  const bool with_cache = declared_inputs_.contains(WorkerInputs::CACHE);
  const bool with_load = declared_inputs_.contains(WorkerInputs::LOAD);
  if (with_cache) grow_to(cache_, total);
  if (with_load) grow_to(load_, total);
  const RowColumns columns = columns_for(inputs);
  // Per-row multipliers are computed after eligibility; until then the candidates expose none.
  const bool taint_pending =
      inputs.contains(WorkerInputs::PREFERRED_TAINT) && !uniform_taint_multiplier_;
  const std::optional<double> taint =
      inputs.contains(WorkerInputs::PREFERRED_TAINT) && uniform_taint_multiplier_
          ? std::optional<double>{1.0}
          : std::nullopt;
  // Most requests carry no restriction and no busy threshold is set: then availability is the
  // only rule. Either way each row is written unconditionally and kept by advancing the count,
  // so the loop has no data-dependent branch.
  const bool restricted = request.pinned_worker || !request.allowed_workers.empty() ||
                          !request.excluded_workers.empty() || !request.required_taints.empty() ||
                          config_.busy_kv_usage_threshold || config_.busy_prefill_tokens_threshold;
  const WorkerDescriptor* descriptors = descriptors_.data();
  std::uint32_t* rows = rows_.data();
  WorkerCandidate* candidates = candidates_.data();
  // One loop per rule: with the out-of-line eligibility call in the same loop as the common
  // availability test, the compiler ran out of registers and kept the row pointers on the stack,
  // reloading them on every row.
  const auto collect = [&](auto keep) {
    std::size_t count = 0;
    for (std::size_t row = 0; row < total; ++row) {
      const WorkerDescriptor& descriptor = descriptors[row];
      rows[count] = static_cast<std::uint32_t>(row);
      candidates[count] =
          WorkerCandidate{descriptor.worker, columns.cache + count * columns.cache_step,
                          columns.load + count * columns.load_step, taint};
      count += keep(descriptor) ? 1 : 0;
    }
    return count;
  };
  const auto available = [](const WorkerDescriptor& descriptor) { return descriptor.available; };
  const auto passes_rules = [&](const WorkerDescriptor& descriptor) {
    return eligible(request, descriptor);
  };
  const std::size_t count = restricted ? collect(passes_rules) : collect(available);
  exposed_ = taint_pending ? std::nullopt : std::optional<WorkerInputs>{inputs};
  return count;
}

SelectionHost::RowColumns SelectionHost::columns_for(WorkerInputs inputs) const {
  // A group the component did not declare is a null base with step 0, so every row is built the
  // same way without a per-row branch on the declaration.
  const bool with_cache = inputs.contains(WorkerInputs::CACHE);
  const bool with_load = inputs.contains(WorkerInputs::LOAD);
  return RowColumns{
      .cache = with_cache ? cache_.data() : nullptr,
      .cache_step = with_cache ? std::size_t{1} : 0,
      .load = with_load ? load_.data() : nullptr,
      .load_step = with_load ? std::size_t{1} : 0,
  };
}

std::span<const WorkerCandidate> SelectionHost::candidates_for(WorkerInputs inputs) {
  const std::size_t count = rows_count_;
  WorkerCandidate* candidates = candidates_.data();
  if (exposed_ == inputs) return {candidates, count};
  // Rebuilt in place: each candidate keeps its worker and gets its row's groups.
  const RowColumns columns = columns_for(inputs);
  const auto build = [&](auto taint_of) {
    for (std::size_t i = 0; i < count; ++i) {
      candidates[i] =
          WorkerCandidate{candidates[i].worker(), columns.cache + i * columns.cache_step,
                          columns.load + i * columns.load_step, taint_of(i)};
    }
  };
  if (!inputs.contains(WorkerInputs::PREFERRED_TAINT)) {
    build([](std::size_t) { return std::optional<double>{}; });
  } else if (uniform_taint_multiplier_) {
    build([](std::size_t) { return std::optional<double>{1.0}; });
  } else {
    const double* taints = taint_multipliers_.data();
    build([taints](std::size_t i) { return std::optional<double>{taints[i]}; });
  }
  exposed_ = inputs;
  return {candidates, count};
}

void SelectionHost::compact_rows() {
  const bool with_cache = declared_inputs_.contains(WorkerInputs::CACHE);
  const bool with_load = declared_inputs_.contains(WorkerInputs::LOAD);
  const bool with_taint =
      declared_inputs_.contains(WorkerInputs::PREFERRED_TAINT) && !uniform_taint_multiplier_;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < rows_count_; ++i) {
    if (keep_[i] == 0) continue;
    rows_[kept] = rows_[i];
    candidates_[kept] = candidates_[i];  // its worker; the groups are rebuilt on next use
    if (with_cache) cache_[kept] = cache_[i];
    if (with_load) load_[kept] = load_[i];
    if (with_taint) taint_multipliers_[kept] = taint_multipliers_[i];
    ++kept;
  }
  if (kept != rows_count_) exposed_.reset();
  rows_count_ = kept;
}

std::expected<void, WorkerSelectionPolicyError> SelectionHost::run_filters(
    const WorkerSelectionContext& context) {
  for (std::size_t f = 0; f < filters_.size() && rows_count_ > 0; ++f) {
    WorkerFilter& filter = *filters_[f];
    const auto candidates = candidates_for(filter.required_worker_inputs());
    keep_.assign(candidates.size(), 0);
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      PolicyResult<bool> kept = false;
      try {
        kept = filter.keep(context, candidates[i]);
      } catch (...) {
        return std::unexpected(
            component_failure("filter", f, filter_names_[f],
                              fmt::format("{}{}{}", row_name(i, candidates[i].worker()), " ",
                                          describe_exception(std::current_exception()))));
      }
      if (!kept) {
        return std::unexpected(
            component_failure("filter", f, filter_names_[f], kept.error().message()));
      }
      keep_[i] = *kept ? 1 : 0;
    }
    compact_rows();
  }
  return {};
}

WorkerSelectionPolicyError SelectionHost::non_finite_cost(std::size_t scorer,
                                                          std::span<const double> costs) const {
  for (std::size_t i = 0; i < costs.size(); ++i) {
    const WorkerWithDpRank worker = candidates_[i].worker();
    if (!std::isfinite(costs[i])) {
      return WorkerSelectionPolicyError::host(
          Kind::NonFiniteCost,
          fmt::format("scorer {} ({}) gave {} a non-finite or unwritten cost ({})", scorer,
                      scorer_names_[scorer], row_name(i, worker), costs[i]));
    }
    if (!std::isfinite(total_cost(i))) {
      return WorkerSelectionPolicyError::host(
          Kind::NonFiniteCost,
          fmt::format("the total cost of {} is not finite after scorer {} ({})",
                      row_name(i, worker), scorer, scorer_names_[scorer]));
    }
  }
  return WorkerSelectionPolicyError::host(Kind::NonFiniteCost, "a cost is not finite");
}

bool SelectionHost::accumulate_costs(std::size_t scorer, std::span<const double> costs) {
  const std::size_t count = costs.size();
  const bool last = scorer + 1 == scorers_.size();
  const WorkerCandidate* candidates = candidates_.data();
  ScoredWorkerCandidate* scored = scored_.data();
  // Each loop is branch-free per row: finiteness is and-ed up, and the row is looked up for the
  // message only when something was not finite.
  const auto emit = [&](auto taint_of) {
    bool all_finite = true;
    if (scorers_.size() == 1) {
      // A single scorer's column is the total (total_cost() reads it there): no copy.
      for (std::size_t i = 0; i < count; ++i) {
        all_finite &= std::isfinite(costs[i]);
        scored[i] = ScoredWorkerCandidate{candidates[i].worker(), costs[i], taint_of(i)};
      }
    } else {
      double* totals = total_costs_.data();
      for (std::size_t i = 0; i < count; ++i) {
        totals[i] += costs[i];
        all_finite &= std::isfinite(costs[i]) && std::isfinite(totals[i]);
        scored[i] = ScoredWorkerCandidate{candidates[i].worker(), totals[i], taint_of(i)};
      }
    }
    return all_finite;
  };
  if (last) {
    if (!picker_inputs_.contains(WorkerInputs::PREFERRED_TAINT)) {
      return emit([](std::size_t) { return std::optional<double>{}; });
    }
    if (uniform_taint_multiplier_) {
      return emit([](std::size_t) { return std::optional<double>{1.0}; });
    }
    const double* taints = taint_multipliers_.data();
    return emit([taints](std::size_t i) { return std::optional<double>{taints[i]}; });
  }
  bool all_finite = true;
  double* totals = total_costs_.data();
  if (scorer == 0) {
    for (std::size_t i = 0; i < count; ++i) {
      totals[i] = costs[i];
      all_finite &= std::isfinite(costs[i]);
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      totals[i] += costs[i];
      all_finite &= std::isfinite(costs[i]) && std::isfinite(totals[i]);
    }
  }
  return all_finite;
}

std::expected<void, WorkerSelectionPolicyError> SelectionHost::run_scorers(
    const WorkerSelectionContext& context) {
  const std::size_t count = rows_count_;
  grow_to(scored_, count);
  grow_to(scorer_costs_, scorers_.size() * count);
  if (scorers_.size() != 1) grow_to(total_costs_, count);
  if (scorers_.empty()) {
    // No scorer: every total is 0.
    std::fill_n(total_costs_.begin(), count, 0.0);
    const bool with_taint = picker_inputs_.contains(WorkerInputs::PREFERRED_TAINT);
    for (std::size_t i = 0; i < count; ++i) {
      scored_[i] = ScoredWorkerCandidate{
          candidates_[i].worker(), 0.0,
          with_taint ? std::optional<double>{taint_multiplier(i)} : std::nullopt};
    }
    return {};
  }
  for (std::size_t s = 0; s < scorers_.size(); ++s) {
    WorkerScorer& scorer = *scorers_[s];
    const std::span<double> costs{scorer_costs_.data() + s * count, count};
    const auto candidates = candidates_for(scorer.required_worker_inputs());
    std::ranges::fill(costs, std::numeric_limits<double>::quiet_NaN());
    PolicyResult<void> scored;
    try {
      scored = scorer.score_all(context, candidates, costs);
    } catch (...) {
      return std::unexpected(component_failure("scorer", s, scorer_names_[s],
                                               describe_exception(std::current_exception())));
    }
    if (!scored) {
      return std::unexpected(
          component_failure("scorer", s, scorer_names_[s], scored.error().message()));
    }
    if (!accumulate_costs(s, costs)) return std::unexpected(non_finite_cost(s, costs));
  }
  return {};
}

std::expected<SelectionResult, WorkerSelectionPolicyError> SelectionHost::select(
    const SelectionRequest& request, const RoutingPartition& partition,
    WorkerSignalSource& signals) {
  descriptors_ = signals.workers(worker_type_);
  if (descriptors_.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::host(
        Kind::NoEndpoints,
        fmt::format("{}{}{}{}{}{}{}", "no ", as_str(worker_type_), " workers serve model '",
                    partition.model, "' group '", partition.routing_group, "'")));
  }

  // Without preferred taints every multiplier is exp(-tanh(0)) = 1: no per-row array at all.
  const bool with_taint = declared_inputs_.contains(WorkerInputs::PREFERRED_TAINT);
  uniform_taint_multiplier_ = with_taint && request.preferred_taints.empty();
  // The eligibility pass already builds the candidates the first component will see.
  const WorkerInputs first_inputs = !filters_.empty()   ? filters_.front()->required_worker_inputs()
                                    : !scorers_.empty() ? scorers_.front()->required_worker_inputs()
                                                        : WorkerInputs::NONE;
  rows_count_ = collect_eligible_rows(request, first_inputs);
  if (rows_count_ == 0) {
    return std::unexpected(WorkerSelectionPolicyError::host(
        Kind::NoEligibleWorkers,
        fmt::format("{}{}{}{}{}", "none of ", descriptors_.size(), " ", as_str(worker_type_),
                    " workers is eligible (pin, allow-list, exclusions, required taints, busy "
                    "thresholds or availability)")));
  }
  const std::size_t eligible_count = rows_count_;

  // Compute only the signal groups some component declared.
  const bool with_cache = declared_inputs_.contains(WorkerInputs::CACHE);
  const bool with_load = declared_inputs_.contains(WorkerInputs::LOAD);
  if (with_cache || with_load) {
    signals.compute_signals(request, worker_type_, {rows_.data(), eligible_count},
                            with_cache ? std::span<WorkerCacheInput>{cache_.data(), eligible_count}
                                       : std::span<WorkerCacheInput>{},
                            with_load ? std::span<WorkerLoadInput>{load_.data(), eligible_count}
                                      : std::span<WorkerLoadInput>{});
  }
  if (with_taint && !uniform_taint_multiplier_) {
    grow_to(taint_multipliers_, eligible_count);
    for (std::size_t i = 0; i < eligible_count; ++i) {
      taint_multipliers_[i] =
          preferred_taint_multiplier(request.preferred_taints, descriptors_[rows_[i]].taints);
    }
  }

  const WorkerSelectionContext context{request, config_.block_size, worker_type_, partition};
  if (auto filtered = run_filters(context); !filtered) return std::unexpected(filtered.error());
  if (rows_count_ == 0) {
    return std::unexpected(WorkerSelectionPolicyError::host(
        Kind::AllFiltered,
        fmt::format("{}{}{}{}{}", "all eligible workers filtered (", eligible_count, " eligible, ",
                    filters_.size(), " filters)")));
  }
  if (auto scored = run_scorers(context); !scored) return std::unexpected(scored.error());

  const std::size_t count = rows_count_;
  const WorkerInputView view{
      std::span<const ScoredWorkerCandidate>{scored_.data(), count},
      picker_inputs_.contains(WorkerInputs::CACHE)
          ? std::optional<std::span<const WorkerCacheInput>>{{cache_.data(), count}}
          : std::nullopt,
      picker_inputs_.contains(WorkerInputs::LOAD)
          ? std::optional<std::span<const WorkerLoadInput>>{{load_.data(), count}}
          : std::nullopt};
  PolicyResult<std::size_t> picked = std::size_t{0};
  try {
    picked = picker_->pick(context, view);
  } catch (...) {
    return std::unexpected(
        component_failure("picker", 0, picker_name_, describe_exception(std::current_exception())));
  }
  if (!picked) {
    return std::unexpected(component_failure("picker", 0, picker_name_, picked.error().message()));
  }
  if (*picked >= count) {
    return std::unexpected(WorkerSelectionPolicyError::host(
        Kind::InvalidPickerRow,
        fmt::format("{}{}{}{}{}{}{}", "picker (", picker_name_, ") returned row ", *picked, " of ",
                    count, " candidates")));
  }

  const std::size_t row = *picked;
  SelectionResult result;
  result.worker = scored_[row].worker();
  result.total_cost = total_cost(row);
  for (std::size_t s = 0; s < scorers_.size(); ++s) {
    result.scorer_costs.push_back(scorer_costs_[s * count + row]);
  }
  if (with_cache) result.cache = cache_[row];
  if (with_load) result.load = load_[row];
  result.eligible_workers = eligible_count;
  result.kept_workers = count;
  return result;
}

std::expected<SelectionResult, WorkerSelectionPolicyError> select_worker(
    WorkerSelectionPolicy& policy, const SelectionRequest& request,
    const RoutingPartition& partition, WorkerSignalSource& signals) {
  return SelectionHost::of(policy).select(request, partition, signals);
}

std::span<const std::string> scorer_names(const WorkerSelectionPolicy& policy) {
  return SelectionHost::of(policy).scorer_names();
}

WorkerInputs declared_inputs(const WorkerSelectionPolicy& policy) {
  return SelectionHost::of(policy).declared_inputs();
}

void SelectionHost::notify_routed(const RoutedRequest& request) {
  for (const auto& observer : observers_) {
    try {
      observer->on_routed(request);
    } catch (...) {
      ++observer_failures_;
    }
  }
}

std::optional<TtftCalibration> SelectionHost::notify_first_token(
    std::string_view request_id, std::chrono::steady_clock::time_point at) {
  std::optional<TtftCalibration> calibration;
  for (const auto& observer : observers_) {
    try {
      auto told = observer->on_first_token(request_id, at);
      if (!calibration) calibration = told;
    } catch (...) {
      ++observer_failures_;
    }
  }
  return calibration;
}

void SelectionHost::notify_ended(std::string_view request_id, RoutedRequestEnd end,
                                 std::chrono::steady_clock::time_point at) {
  for (const auto& observer : observers_) {
    try {
      observer->on_ended(request_id, end, at);
    } catch (...) {
      ++observer_failures_;
    }
  }
}

std::vector<LearntValue> SelectionHost::learnt_values() const {
  std::vector<LearntValue> values;
  for (const auto& observer : observers_) {
    try {
      auto learnt = observer->learnt_values();
      values.insert(values.end(), std::make_move_iterator(learnt.begin()),
                    std::make_move_iterator(learnt.end()));
    } catch (...) {
      ++observer_failures_;
    }
  }
  return values;
}

}  // namespace kvr::selection
