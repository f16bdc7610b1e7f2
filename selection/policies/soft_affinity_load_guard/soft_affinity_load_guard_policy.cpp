#include "selection/policies/soft_affinity_load_guard/soft_affinity_load_guard_policy.hpp"

#include <memory>

#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {

ProviderResult<SoftAffinityLoadGuardParameters> SoftAffinityLoadGuardParameters::read(
    ParameterReader& reader) {
  const SoftAffinityLoadGuardParameters defaults;
  auto limit = reader.optional<std::int64_t>("max_active_requests", defaults.max_active_requests);
  if (!limit) return std::unexpected(limit.error());
  auto margin = reader.optional<std::int64_t>("margin", defaults.margin);
  if (!margin) return std::unexpected(margin.error());
  auto seed = read_seed(reader);
  if (!seed) return std::unexpected(seed.error());
  return SoftAffinityLoadGuardParameters{
      .max_active_requests = *limit, .margin = *margin, .seed = *seed};
}

ProviderResult<void> SoftAffinityLoadGuardParameters::validate() const {
  return first_failure({
      check_integer_at_least(kSoftAffinityLoadGuardPolicyType, "max_active_requests",
                             max_active_requests, 0),
      check_integer_at_least(kSoftAffinityLoadGuardPolicyType, "margin", margin, 1),
  });
}

PolicyResult<std::size_t> SoftAffinityLoadGuardPicker::pick(const WorkerSelectionContext& context,
                                                            const WorkerInputView& view) {
  const auto load = view.load();  // throws unless the picker declared LOAD
  const auto candidates = view.candidates();
  if (candidates.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  const std::optional<WorkerAffinityTarget> target = context.affinity_target();
  std::optional<std::size_t> target_row;
  if (target) {
    for (std::size_t row = 0; row < candidates.size(); ++row) {
      if (!target->matches(candidates[row].worker())) continue;
      if (!target_row || compare_load((*load)[row], (*load)[*target_row]) < 0) target_row = row;
    }
  }
  if (!target_row) return least_loaded_row(*load, rng_);

  const std::size_t target_active = active_requests_of((*load)[*target_row]);
  if (target_active <= max_active_requests_) return *target_row;
  const std::size_t lightest = least_loaded_row(*load, rng_);
  return active_requests_of((*load)[lightest]) + margin_ <= target_active ? lightest : *target_row;
}

WorkerSelectionPolicy make_soft_affinity_load_guard_policy(
    const SoftAffinityLoadGuardParameters& parameters, const RouterConfig& config,
    WorkerType worker_type, const RoutingPartition& partition) {
  return picker_only_policy(
      config, worker_type,
      std::make_unique<SoftAffinityLoadGuardPicker>(
          parameters, resolve_seed(parameters.seed, config, worker_type, partition)));
}

ProviderResult<WorkerSelectionPolicyFactory> soft_affinity_load_guard_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<SoftAffinityLoadGuardParameters>(parameters,
                                                  &make_soft_affinity_load_guard_policy);
}

}  // namespace kvr::selection::policies
