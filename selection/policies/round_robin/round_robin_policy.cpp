#include "selection/policies/round_robin/round_robin_policy.hpp"

#include <memory>

namespace kvr::selection::policies {

PolicyResult<std::size_t> RoundRobinPicker::pick(const WorkerSelectionContext& /*context*/,
                                                 const WorkerInputView& view) {
  const auto candidates = view.candidates();
  if (candidates.empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  // One pass finds both the first candidate overall (the wrap-around) and the first one after
  // the last served.
  std::size_t first = 0;
  std::optional<std::size_t> next;
  for (std::size_t row = 0; row < candidates.size(); ++row) {
    const WorkerWithDpRank worker = candidates[row].worker();
    if (worker < candidates[first].worker()) first = row;
    if (last_served_ && *last_served_ < worker && (!next || worker < candidates[*next].worker())) {
      next = row;
    }
  }
  const std::size_t chosen = next.value_or(first);
  last_served_ = candidates[chosen].worker();
  return chosen;
}

WorkerSelectionPolicy make_round_robin_policy(const RoundRobinParameters& /*parameters*/,
                                              const RouterConfig& config, WorkerType worker_type,
                                              const RoutingPartition& /*partition*/) {
  return picker_only_policy(config, worker_type, std::make_unique<RoundRobinPicker>());
}

ProviderResult<WorkerSelectionPolicyFactory> round_robin_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<RoundRobinParameters>(parameters, &make_round_robin_policy);
}

}  // namespace kvr::selection::policies
