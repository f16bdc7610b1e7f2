// The built-in policy `random`: a candidate drawn uniformly at random; with a `seed` the draws
// are reproducible. No scorers (reported cost 0).
#pragma once

#include <cstdint>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kRandomPolicyType = "random";

/// `random` YAML parameters: `seed` only.
using RandomParameters = SeedParameters;

/// Picks a candidate uniformly at random.
class RandomPicker final : public WorkerPicker {
 public:
  explicit RandomPicker(std::uint64_t seed) : rng_(seed) {}

  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  PolicyRng rng_;
};

/// A `random` policy: one RandomPicker.
WorkerSelectionPolicy make_random_policy(const RandomParameters& parameters,
                                         const RouterConfig& config, WorkerType worker_type,
                                         const RoutingPartition& partition);

/// The registered provider of `random`.
ProviderResult<WorkerSelectionPolicyFactory> random_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
