// power-of-two: two distinct uniform samples, the one with fewer active requests wins, then
// fewer prefill tokens, then the first sampled.
#include "selection/policies/power_of_two/power_of_two_policy.hpp"

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class PowerOfTwoPolicyTest : public PolicyTest {
 protected:
  WorkerSelectionPolicy policy(std::uint64_t seed = 1) {
    return make_power_of_two_policy({.seed = seed}, config_, WorkerType::Aggregated, partition_);
  }
};

TEST_F(PowerOfTwoPolicyTest, OfTwoCandidatesAlwaysTakesTheOneWithFewerActiveRequests) {
  // With two candidates both are always sampled.
  signals_.set_workers({loaded_worker(1, 6, 0), loaded_worker(2, 5, 4000)});
  auto power_of_two = policy();
  const auto counts = pick_counts(power_of_two, 50);
  EXPECT_EQ(counts.at(2), 50);
}

TEST_F(PowerOfTwoPolicyTest, EqualActiveRequestsGoToFewerPrefillTokens) {
  signals_.set_workers({loaded_worker(1, 5, 300), loaded_worker(2, 5, 200)});
  auto power_of_two = policy();
  EXPECT_EQ(pick_counts(power_of_two, 50).at(2), 50);
}

TEST_F(PowerOfTwoPolicyTest, FullTieTakesTheFirstSampledSoBothAreUsed) {
  signals_.set_workers({loaded_worker(1, 5, 200), loaded_worker(2, 5, 200)});
  auto power_of_two = policy(4);
  const auto counts = pick_counts(power_of_two, 400);
  EXPECT_NEAR(counts.at(1), 200, 40);
}

TEST_F(PowerOfTwoPolicyTest, NeverPicksTheSingleHeaviestAndSamplesTheOthers) {
  // The heaviest can only win against itself, and the two samples are distinct.
  signals_.set_workers(
      {loaded_worker(1, 1), loaded_worker(2, 2), loaded_worker(3, 3), loaded_worker(4, 9)});
  auto power_of_two = policy(5);
  const auto counts = pick_counts(power_of_two, 600);
  EXPECT_FALSE(counts.contains(4));
  // Worker 1 wins every pair it is in (1/2 of the pairs), worker 2 the pairs {2,3} and {2,4}
  // (1/3), worker 3 the pair {3,4} (1/6).
  EXPECT_NEAR(counts.at(1), 300, 50);
  EXPECT_NEAR(counts.at(2), 200, 50);
  EXPECT_NEAR(counts.at(3), 100, 40);
}

TEST_F(PowerOfTwoPolicyTest, SingleCandidateIsTaken) {
  signals_.set_workers({loaded_worker(7, 100)});
  auto power_of_two = policy();
  EXPECT_EQ(pick(power_of_two), 7U);
}

}  // namespace
}  // namespace kvr::selection::policies
