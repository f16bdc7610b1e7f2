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
/// Draws exactly what best_row with lower_is_better draws, so a seed picks the same rows.
inline std::size_t lowest_cost_row(std::span<const ScoredWorkerCandidate> candidates,
                                   PolicyRng& rng) {
  // best_row's comparator reloads the best row's cost and compares twice per row; keeping the
  // best cost in a register lets the common row (costlier than the best) cost one compare.
  std::size_t best = 0;
  double best_cost = candidates[0].cost();
  std::size_t ties = 1;
  for (std::size_t row = 1; row < candidates.size(); ++row) {
    const double cost = candidates[row].cost();
    if (cost > best_cost) continue;
    if (cost < best_cost) {
      best = row;
      best_cost = cost;
      ties = 1;
    } else {
      ++ties;
      if (rng.uniform_index(ties) == 0) best = row;
    }
  }
  return best;
}

}  // namespace kvr::selection::policies
