// The built-in policy `two-tier`: balance load while the fleet is clearly imbalanced, follow the
// cache while one worker holds enough of the prompt, else balance load. No scorers (reported
// cost 0). With a = active requests (0 without a load observation) over the candidates:
//   1. load tier: when max(a) − min(a) > imbalance_absolute AND
//      (max(a) + 1) / (min(a) + 1) > imbalance_relative — the +1 keeps an idle worker from making
//      every difference an infinite ratio — take the least-loaded candidate;
//   2. cache tier: else, when the best total overlap (device + host + disk blocks) is at least
//      cache_fraction · request_blocks, take the candidate with the best total overlap (ties: the
//      least loaded);
//   3. else take the least-loaded candidate.
// "Least loaded" is the least-loaded order (fewer active requests, then prefill tokens, then
// decode blocks); remaining ties are broken uniformly at random.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "selection/policies/common/parameters.hpp"
#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The registered type name.
inline constexpr std::string_view kTwoTierPolicyType = "two-tier";

/// `two-tier` YAML parameters.
struct TwoTierParameters {
  /// Load tier needs max − min active requests above this; an integer >= 0; default 8.
  std::int64_t imbalance_absolute = 8;
  /// ... and (max + 1) / (min + 1) above this; >= 1; default 1.5.
  double imbalance_relative = 1.5;
  /// Cache tier when the best total overlap reaches this share of the prompt's blocks; in
  /// [0, 1]; default 0.5.
  double cache_fraction = 0.5;
  /// Seed of the tie-break draws; default as resolve_seed.
  std::optional<std::uint64_t> seed;

  /// Reads the keys above; the caller rejects any other key.
  static ProviderResult<TwoTierParameters> read(ParameterReader& reader);
  /// Fails naming the first parameter outside its range.
  ProviderResult<void> validate() const;
};

/// Which rule of the file comment decided.
enum class TwoTierDecision { LoadTier, CacheTier, LeastLoaded };

/// The rule that applies to these candidates; `cache` and `load` are index-aligned, non-empty.
TwoTierDecision decide_two_tier(const TwoTierParameters& parameters, std::size_t request_blocks,
                                std::span<const WorkerCacheInput> cache,
                                std::span<const WorkerLoadInput> load);

/// Applies decide_two_tier and picks accordingly. Needs CACHE and LOAD.
class TwoTierPicker final : public WorkerPicker {
 public:
  TwoTierPicker(const TwoTierParameters& parameters, std::uint64_t seed)
      : parameters_(parameters), rng_(seed) {}

  WorkerInputs required_worker_inputs() const override {
    return WorkerInputs::CACHE | WorkerInputs::LOAD;
  }
  PolicyResult<std::size_t> pick(const WorkerSelectionContext& context,
                                 const WorkerInputView& view) override;

 private:
  TwoTierParameters parameters_;
  PolicyRng rng_;
};

/// A `two-tier` policy: one TwoTierPicker.
WorkerSelectionPolicy make_two_tier_policy(const TwoTierParameters& parameters,
                                           const RouterConfig& config, WorkerType worker_type,
                                           const RoutingPartition& partition);

/// The registered provider of `two-tier`.
ProviderResult<WorkerSelectionPolicyFactory> two_tier_policy_provider(
    const WorkerSelectionPolicyParameters& parameters);

}  // namespace kvr::selection::policies
