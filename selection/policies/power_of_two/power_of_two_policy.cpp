#include "selection/policies/power_of_two/power_of_two_policy.hpp"

#include <memory>

#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {

PolicyResult<std::size_t> PowerOfTwoPicker::pick(const WorkerSelectionContext& /*context*/,
                                                 const WorkerInputView& view) {
  const auto loads = view.load();  // throws unless the picker declared LOAD
  const std::size_t count = loads->size();
  if (count == 0) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  if (count == 1) return std::size_t{0};
  const std::size_t first = rng_.uniform_index(count);
  // Drawing from count − 1 and skipping `first` gives a uniformly drawn distinct second row.
  std::size_t second = rng_.uniform_index(count - 1);
  if (second >= first) ++second;

  const WorkerLoadInput& a = (*loads)[first];
  const WorkerLoadInput& b = (*loads)[second];
  if (active_requests_of(b) != active_requests_of(a)) {
    return active_requests_of(b) < active_requests_of(a) ? second : first;
  }
  return active_prefill_tokens_of(b) < active_prefill_tokens_of(a) ? second : first;
}

WorkerSelectionPolicy make_power_of_two_policy(const PowerOfTwoParameters& parameters,
                                               const RouterConfig& config, WorkerType worker_type,
                                               const RoutingPartition& partition) {
  return picker_only_policy(config, worker_type,
                            std::make_unique<PowerOfTwoPicker>(
                                resolve_seed(parameters.seed, config, worker_type, partition)));
}

ProviderResult<WorkerSelectionPolicyFactory> power_of_two_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<PowerOfTwoParameters>(parameters, &make_power_of_two_policy);
}

}  // namespace kvr::selection::policies
