#include "selection/policies/two_tier/two_tier_policy.hpp"

#include <algorithm>
#include <limits>
#include <memory>

#include "selection/policies/common/best_row.hpp"
#include "selection/policies/common/worker_signals.hpp"

namespace kvr::selection::policies {

ProviderResult<TwoTierParameters> TwoTierParameters::read(ParameterReader& reader) {
  const TwoTierParameters defaults;
  auto absolute = reader.optional<std::int64_t>("imbalance_absolute", defaults.imbalance_absolute);
  if (!absolute) return std::unexpected(absolute.error());
  auto relative = reader.optional<double>("imbalance_relative", defaults.imbalance_relative);
  if (!relative) return std::unexpected(relative.error());
  auto fraction = reader.optional<double>("cache_fraction", defaults.cache_fraction);
  if (!fraction) return std::unexpected(fraction.error());
  auto seed = read_seed(reader);
  if (!seed) return std::unexpected(seed.error());
  return TwoTierParameters{.imbalance_absolute = *absolute,
                           .imbalance_relative = *relative,
                           .cache_fraction = *fraction,
                           .seed = *seed};
}

ProviderResult<void> TwoTierParameters::validate() const {
  return first_failure({
      check_integer_at_least(kTwoTierPolicyType, "imbalance_absolute", imbalance_absolute, 0),
      check_at_least(kTwoTierPolicyType, "imbalance_relative", imbalance_relative, 1.0),
      check_range(kTwoTierPolicyType, "cache_fraction", cache_fraction, 0.0, 1.0),
  });
}

TwoTierDecision decide_two_tier(const TwoTierParameters& parameters, std::size_t request_blocks,
                                std::span<const WorkerCacheInput> cache,
                                std::span<const WorkerLoadInput> load) {
  std::size_t min_active = std::numeric_limits<std::size_t>::max();
  std::size_t max_active = 0;
  for (const WorkerLoadInput& worker : load) {
    min_active = std::min(min_active, active_requests_of(worker));
    max_active = std::max(max_active, active_requests_of(worker));
  }
  const double spread = static_cast<double>(max_active - min_active);
  const double ratio = static_cast<double>(max_active + 1) / static_cast<double>(min_active + 1);
  if (spread > static_cast<double>(parameters.imbalance_absolute) &&
      ratio > parameters.imbalance_relative) {
    return TwoTierDecision::LoadTier;
  }
  double best_overlap = 0.0;
  for (const WorkerCacheInput& worker : cache) {
    best_overlap = std::max(best_overlap, total_overlap_blocks(worker));
  }
  if (best_overlap >= parameters.cache_fraction * static_cast<double>(request_blocks)) {
    return TwoTierDecision::CacheTier;
  }
  return TwoTierDecision::LeastLoaded;
}

PolicyResult<std::size_t> TwoTierPicker::pick(const WorkerSelectionContext& context,
                                              const WorkerInputView& view) {
  const auto cache = view.cache();  // throws unless the picker declared CACHE
  const auto load = view.load();    // throws unless the picker declared LOAD
  if (load->empty()) {
    return std::unexpected(WorkerSelectionPolicyError::failed("no candidates to pick from"));
  }
  if (decide_two_tier(parameters_, context.request_blocks(), *cache, *load) !=
      TwoTierDecision::CacheTier) {
    return least_loaded_row(*load, rng_);
  }
  return best_row(
      load->size(),
      [cache = *cache, load = *load](std::size_t a, std::size_t b) {
        // More overlap is better, so the comparison is reversed.
        const auto by_overlap =
            lower_is_better(total_overlap_blocks(cache[b]), total_overlap_blocks(cache[a]));
        return by_overlap != 0 ? by_overlap : compare_load(load[a], load[b]);
      },
      rng_);
}

WorkerSelectionPolicy make_two_tier_policy(const TwoTierParameters& parameters,
                                           const RouterConfig& config, WorkerType worker_type,
                                           const RoutingPartition& partition) {
  return picker_only_policy(
      config, worker_type,
      std::make_unique<TwoTierPicker>(
          parameters, resolve_seed(parameters.seed, config, worker_type, partition)));
}

ProviderResult<WorkerSelectionPolicyFactory> two_tier_policy_provider(
    const WorkerSelectionPolicyParameters& parameters) {
  return provide<TwoTierParameters>(parameters, &make_two_tier_policy);
}

}  // namespace kvr::selection::policies
