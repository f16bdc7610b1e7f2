// The built-in policy `least-loaded`: the candidate with the fewest active requests, then the
// fewest active prefill tokens, then the fewest projected decode blocks; remaining ties uniformly
// at random. A worker without a load observation counts as idle (all zero). No scorers: every
// candidate's reported cost is 0.
#pragma once

#include <cstdint>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kLeastLoadedPolicyType = "least-loaded";

/// `least-loaded` YAML parameters: `seed` only (the tie-break draws).
using LeastLoadedParameters = SeedParameters;

/// Picks the least-loaded candidate (compare_load), ties uniformly at random. Needs LOAD.
class LeastLoadedPicker final : public WorkerPicker {
 public:
  explicit LeastLoadedPicker(std::uint64_t seed) : rng_(seed) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  PolicyRng rng_;
};

/// A `least-loaded` policy: one LeastLoadedPicker.
WorkerSelectionPolicy make_least_loaded_policy(const LeastLoadedParameters& parameters,
                                               const RouterConfig& config, WorkerType worker_type,
                                               const RoutingPartition& partition);

/// The registered provider of `least-loaded`.
ProviderResult<WorkerSelectionPolicyFactory> least_loaded_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
