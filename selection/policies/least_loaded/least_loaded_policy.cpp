#include "selection/policies/least_loaded/least_loaded_policy.hpp"

#include <memory>

#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {

PolicyResult<std::size_t> LeastLoadedPicker::pick(const WorkerSelectionContext& /*context*/,
                                                  const WorkerInputView& view) {
  const auto loads = view.load();  // throws unless the picker declared LOAD
  if (loads->empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  return least_loaded_row(*loads, rng_);
}

WorkerSelectionPolicy make_least_loaded_policy(const LeastLoadedParameters& parameters,
                                               const RouterConfig& config, WorkerType worker_type,
                                               const RoutingPartition& partition) {
  return picker_only_policy(config, worker_type,
                            std::make_unique<LeastLoadedPicker>(
                                resolve_seed(parameters.seed, config, worker_type, partition)));
}

ProviderResult<WorkerSelectionPolicyFactory> least_loaded_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<LeastLoadedParameters>(parameters, &make_least_loaded_policy);
}

}  // namespace kvr::selection::policies
