// The built-in policy `round-robin`: serves the candidates in turn, in (worker id, rank) order,
// whatever order the host lists them in. No parameters, no scorers (reported cost 0).
//
// The rotation's state is the last (worker, rank) served: each pick takes the first candidate
// after it in (worker id, rank) order, wrapping to the first candidate. So when the fleet or the
// candidate set changes (a worker joins or leaves, a pin or allow-list narrows the candidates),
// the rotation continues from where it was: a new worker is served when the rotation reaches its
// place, a departed one is simply not met, and no candidate is served twice in a row while there
// is another.
#pragma once

#include <optional>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kRoundRobinPolicyType = "round-robin";

/// `round-robin` YAML parameters: none; any key is rejected.
struct RoundRobinParameters {
  static ProviderResult<RoundRobinParameters> read(ParameterReader& /*reader*/) {
    return RoundRobinParameters{};
  }
  ProviderResult<void> validate() const { return {}; }
};

/// Picks the candidate after the last one served, in (worker id, rank) order. O(candidates) per
/// pick, no allocation.
class RoundRobinPicker final : public WorkerPicker {
 public:
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  std::optional<WorkerWithDpRank> last_served_;
};

/// A `round-robin` policy: one RoundRobinPicker.
WorkerSelectionPolicy make_round_robin_policy(const RoundRobinParameters& parameters,
                                              const RouterConfig& config, WorkerType worker_type,
                                              const RoutingPartition& partition);

/// The registered provider of `round-robin`.
ProviderResult<WorkerSelectionPolicyFactory> round_robin_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
