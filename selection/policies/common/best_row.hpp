// Choosing the best candidate row with a uniformly random tie-break, shared by every built-in
// picker that minimises something (cost, load, overlap). One pass, no allocation.
#pragma once

#include <compare>
#include <cstddef>
#include <span>

#include "selection/policies/common/plugin_api.hpp"
#include "selection/policies/common/policy_rng.hpp"

namespace kvr::selection::policies {

/// The best of rows [0, count) by `compare(i, j)` (a std::weak_ordering; less means row i is
/// better), ties among the best broken uniformly at random. `count` must be positive.
template <class Compare>
std::size_t best_row(std::size_t count, Compare compare, PolicyRng& rng) {
  std::size_t best = 0;
  std::size_t ties = 1;
  for (std::size_t row = 1; row < count; ++row) {
    const std::weak_ordering order = compare(row, best);
    if (order < 0) {
      best = row;
      ties = 1;
    } else if (order == 0) {
      // Reservoir sampling: the k-th tie replaces the choice with probability 1/k, so every tied
      // row ends up chosen with the same probability without collecting the ties.
      ++ties;
      if (rng.uniform_index(ties) == 0) best = row;
    }
  }
  return best;
}

/// Orders doubles for best_row: the lower value is better. Costs are finite (the host checks).
constexpr std::weak_ordering lower_is_better(double a, double b) {
  if (a < b) return std::weak_ordering::less;
  if (b < a) return std::weak_ordering::greater;
  return std::weak_ordering::equivalent;
}

/// The row with the lowest cost, ties broken uniformly at random. `candidates` is non-empty.
inline std::size_t lowest_cost_row(std::span<const ScoredWorkerCandidate> candidates,
                                   PolicyRng& rng) {
  return best_row(
      candidates.size(),
      [candidates](std::size_t a, std::size_t b) {
        return lower_is_better(candidates[a].cost(), candidates[b].cost());
      },
      rng);
}

}  // namespace kvr::selection::policies
