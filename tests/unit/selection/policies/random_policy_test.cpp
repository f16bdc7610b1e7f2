// random: uniform over the candidates, reproducible with a seed.
#include "selection/policies/random/random_policy.hpp"

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class RandomPolicyTest : public PolicyTest {
 protected:
  RandomPolicyTest() {
    signals_.set_workers(
        {loaded_worker(1, 9), loaded_worker(2, 0), loaded_worker(3, 4), loaded_worker(4, 1)});
  }
  WorkerSelectionPolicy policy(std::optional<std::uint64_t> seed) {
    return make_random_policy({.seed = seed}, config_, WorkerType::Aggregated, partition_);
  }
};

TEST_F(RandomPolicyTest, PicksEveryCandidateAboutEquallyOften) {
  auto random = policy(17);
  const auto counts = pick_counts(random, 4000);
  ASSERT_EQ(counts.size(), 4U);
  for (const auto& [worker, count] : counts) {
    EXPECT_NEAR(count, 1000, 100) << "worker " << worker;
  }
}

TEST_F(RandomPolicyTest, SameSeedGivesTheSameSequence) {
  auto first = policy(8);
  auto second = policy(8);
  auto other = policy(9);
  const auto sequence = picks(first, 100);
  EXPECT_EQ(picks(second, 100), sequence);
  EXPECT_NE(picks(other, 100), sequence);
}

TEST_F(RandomPolicyTest, WithoutSeedEachPartitionDrawsItsOwnReproducibleSequence) {
  auto first = policy(std::nullopt);
  auto again = policy(std::nullopt);
  const auto sequence = picks(first, 100);
  EXPECT_EQ(picks(again, 100), sequence);
  auto other_partition = make_random_policy({}, config_, WorkerType::Aggregated,
                                            RoutingPartition{.model = "m", .routing_group = "b"});
  EXPECT_NE(picks(other_partition, 100), sequence);
}

}  // namespace
}  // namespace kvr::selection::policies
