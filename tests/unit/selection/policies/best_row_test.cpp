// The lowest-cost row: the same picks and random draws as the generic best_row it specialises.
#include "selection/policies/common/best_row.hpp"

#include <vector>

#include <gtest/gtest.h>

namespace kvr::selection::policies {
namespace {

TEST(BestRowTest, LowestCostRowPicksAndDrawsAsBestRowDoes) {
  PolicyRng fleet_rng{3};
  for (int trial = 0; trial < 200; ++trial) {
    // Few distinct costs, so that ties (and ties that a later lower cost supersedes) are common.
    const std::size_t count = 1 + fleet_rng.uniform_index(40);
    std::vector<ScoredWorkerCandidate> candidates;
    for (std::size_t row = 0; row < count; ++row) {
      const double cost = static_cast<double>(fleet_rng.uniform_index(4));
      candidates.emplace_back(WorkerWithDpRank{row + 1, 0}, cost, std::nullopt);
    }
    PolicyRng generic_rng{static_cast<std::uint64_t>(trial)};
    PolicyRng specialised_rng{static_cast<std::uint64_t>(trial)};
    const std::size_t generic = best_row(
        count,
        [&](std::size_t a, std::size_t b) {
          return lower_is_better(candidates[a].cost(), candidates[b].cost());
        },
        generic_rng);
    EXPECT_EQ(lowest_cost_row(candidates, specialised_rng), generic) << "trial " << trial;
    EXPECT_EQ(specialised_rng(), generic_rng()) << "trial " << trial;
  }
}

}  // namespace
}  // namespace kvr::selection::policies
