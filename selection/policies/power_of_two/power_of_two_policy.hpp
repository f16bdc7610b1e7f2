// The built-in policy `power-of-two` (power of two choices): samples two distinct candidates
// uniformly and takes the one with fewer active requests; on a tie the one with fewer active
// prefill tokens, then the first sampled. A worker without a load observation counts as idle.
// With one candidate it takes that one. No scorers (reported cost 0).
#pragma once

#include <cstdint>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kPowerOfTwoPolicyType = "power-of-two";

/// `power-of-two` YAML parameters: `seed` only (the sampling draws).
using PowerOfTwoParameters = SeedParameters;

/// The lighter of two uniformly sampled distinct candidates. Needs LOAD.
class PowerOfTwoPicker final : public WorkerPicker {
 public:
  explicit PowerOfTwoPicker(std::uint64_t seed) : rng_(seed) {}

  WorkerInputs required_worker_inputs() const override { return WorkerInputs::LOAD; }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  PolicyRng rng_;
};

/// A `power-of-two` policy: one PowerOfTwoPicker.
WorkerSelectionPolicy make_power_of_two_policy(const PowerOfTwoParameters& parameters,
                                               const RouterConfig& config, WorkerType worker_type,
                                               const RoutingPartition& partition);

/// The registered provider of `power-of-two`.
ProviderResult<WorkerSelectionPolicyFactory> power_of_two_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
