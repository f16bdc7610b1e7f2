#include "selection/policies/random/random_policy.hpp"

#include <memory>

namespace kvr::selection::policies {

PolicyResult<std::size_t> RandomPicker::pick(const WorkerSelectionContext& /*context*/,
                                             const WorkerInputView& view) {
  if (view.candidates().empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  return rng_.uniform_index(view.candidates().size());
}

WorkerSelectionPolicy make_random_policy(const RandomParameters& parameters,
                                         const RouterConfig& config, WorkerType worker_type,
                                         const RoutingPartition& partition) {
  return picker_only_policy(config, worker_type,
                            std::make_unique<RandomPicker>(
                                resolve_seed(parameters.seed, config, worker_type, partition)));
}

ProviderResult<WorkerSelectionPolicyFactory> random_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<RandomParameters>(parameters, &make_random_policy);
}

}  // namespace kvr::selection::policies
