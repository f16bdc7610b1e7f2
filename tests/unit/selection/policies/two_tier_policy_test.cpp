// two-tier: load tier under imbalance (absolute and relative), else cache tier when the best
// overlap reaches the fraction, else least loaded.
#include "selection/policies/two_tier/two_tier_policy.hpp"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class TwoTierPolicyTest : public PolicyTest {
 protected:
  TwoTierPolicyTest() {
    config_.block_size = 16;
    request_.prompt_tokens = 160;  // 10 blocks: the default cache tier needs 5 overlap blocks
  }

  WorkerSelectionPolicy policy(const TwoTierParameters& parameters = {.seed = 1}) {
    return make_two_tier_policy(parameters, config_, WorkerType::Aggregated, partition_);
  }

  // The decision for the current fleet, computed directly.
  TwoTierDecision decision(const TwoTierParameters& parameters = {}) {
    std::vector<WorkerCacheInput> cache;
    std::vector<WorkerLoadInput> load;
    for (const testing::FakeWorker& worker : signals_.mutable_workers()) {
      cache.push_back(worker.cache);
      load.push_back(worker.load ? WorkerLoadInput{*worker.load} : WorkerLoadInput{});
    }
    return decide_two_tier(parameters, 10, cache, load);
  }
};

TEST_F(TwoTierPolicyTest, ImbalancedActiveRequestsUseTheLoadTier) {
  // Spread 18 > 8 and (20 + 1) / (2 + 1) = 7 > 1.5: the cached but busy worker is passed over.
  signals_.set_workers({cached_worker(1, {10, 0, 0}, 20), cached_worker(2, {0, 0, 0}, 2)});
  EXPECT_EQ(decision(), TwoTierDecision::LoadTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 2U);
}

TEST_F(TwoTierPolicyTest, SmoothedRatioCountsAnIdleWorker) {
  // Spread 9 > 8 and (9 + 1) / (0 + 1) = 10 > 1.5.
  signals_.set_workers({cached_worker(1, {10, 0, 0}, 9), cached_worker(2, {0, 0, 0}, 0)});
  EXPECT_EQ(decision(), TwoTierDecision::LoadTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 2U);
}

TEST_F(TwoTierPolicyTest, LargeSpreadWithSmallRatioIsNotImbalance) {
  // Spread 9 > 8 but (109 + 1) / (100 + 1) ≈ 1.09 ≤ 1.5: the cache decides.
  signals_.set_workers({cached_worker(1, {10, 0, 0}, 109), cached_worker(2, {0, 0, 0}, 100)});
  EXPECT_EQ(decision(), TwoTierDecision::CacheTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 1U);
}

TEST_F(TwoTierPolicyTest, LargeRatioWithSmallSpreadIsNotImbalance) {
  // (5 + 1) / (0 + 1) = 6 > 1.5 but the spread 5 ≤ 8: the cache decides.
  signals_.set_workers({cached_worker(1, {10, 0, 0}, 5), cached_worker(2, {0, 0, 0}, 0)});
  EXPECT_EQ(decision(), TwoTierDecision::CacheTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 1U);
}

TEST_F(TwoTierPolicyTest, CacheTierAddsOverlapOfAllTiers) {
  // 2 + 2 + 2 = 6 total overlap beats 5 device blocks.
  signals_.set_workers({cached_worker(1, {5, 0, 0}, 0), cached_worker(2, {2, 2, 2}, 3)});
  EXPECT_EQ(decision(), TwoTierDecision::CacheTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 2U);
}

TEST_F(TwoTierPolicyTest, CacheTierTiesGoToFewerActiveRequests) {
  signals_.set_workers({cached_worker(1, {6, 0, 0}, 3), cached_worker(2, {6, 0, 0}, 1),
                        cached_worker(3, {0, 0, 0}, 0)});
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 2U);
}

TEST_F(TwoTierPolicyTest, OverlapExactlyAtTheFractionIsEnough) {
  signals_.set_workers({cached_worker(1, {5, 0, 0}, 4), cached_worker(2, {0, 0, 0}, 0)});
  EXPECT_EQ(decision(), TwoTierDecision::CacheTier);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 1U);
}

TEST_F(TwoTierPolicyTest, OverlapBelowTheFractionFallsBackToLeastLoaded) {
  signals_.set_workers({cached_worker(1, {4, 0, 0}, 4), cached_worker(2, {0, 0, 0}, 1)});
  EXPECT_EQ(decision(), TwoTierDecision::LeastLoaded);
  auto two_tier = policy();
  EXPECT_EQ(pick(two_tier), 2U);
  // A lower fraction turns the same overlap into a cache hit.
  auto lenient = policy({.cache_fraction = 0.4, .seed = 1});
  EXPECT_EQ(pick(lenient), 1U);
}

TEST_F(TwoTierPolicyTest, ValidationNamesTheParameterAndItsRange) {
  const auto error_of = [](const TwoTierParameters& parameters) {
    auto valid = parameters.validate();
    return valid ? std::string{} : std::string{valid.error().message()};
  };
  EXPECT_EQ(error_of({}), "");
  EXPECT_NE(error_of({.imbalance_absolute = -1}).find("'imbalance_absolute'"), std::string::npos);
  const std::string relative = error_of({.imbalance_relative = 0.5});
  EXPECT_NE(relative.find("'imbalance_relative'"), std::string::npos) << relative;
  EXPECT_NE(relative.find(">= 1"), std::string::npos) << relative;
  const std::string fraction = error_of({.cache_fraction = 1.5});
  EXPECT_NE(fraction.find("'cache_fraction'"), std::string::npos) << fraction;
  EXPECT_NE(fraction.find("[0, 1]"), std::string::npos) << fraction;
}

}  // namespace
}  // namespace kvr::selection::policies
