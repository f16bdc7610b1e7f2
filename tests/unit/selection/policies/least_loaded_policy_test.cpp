// least-loaded: fewest active requests, then prefill tokens, then decode blocks, then random.
#include "selection/policies/least_loaded/least_loaded_policy.hpp"

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class LeastLoadedPolicyTest : public PolicyTest {
 protected:
  WorkerSelectionPolicy policy(std::uint64_t seed = 1) {
    return make_least_loaded_policy({.seed = seed}, config_, WorkerType::Aggregated, partition_);
  }
};

TEST_F(LeastLoadedPolicyTest, PicksTheFewestActiveRequests) {
  signals_.set_workers({loaded_worker(1, 5), loaded_worker(2, 2, 900, 90), loaded_worker(3, 7)});
  auto least_loaded = policy();
  EXPECT_EQ(pick(least_loaded), 2U);
}

TEST_F(LeastLoadedPolicyTest, TiesOnActiveRequestsGoToFewerPrefillTokens) {
  signals_.set_workers({loaded_worker(1, 3, 500, 1), loaded_worker(2, 3, 100, 50)});
  auto least_loaded = policy();
  EXPECT_EQ(pick(least_loaded), 2U);
}

TEST_F(LeastLoadedPolicyTest, TiesOnPrefillTokensGoToFewerDecodeBlocks) {
  signals_.set_workers({loaded_worker(1, 3, 100, 12.5), loaded_worker(2, 3, 100, 12.0)});
  auto least_loaded = policy();
  EXPECT_EQ(pick(least_loaded), 2U);
}

TEST_F(LeastLoadedPolicyTest, FullTiesAreBrokenUniformlyAtRandom) {
  signals_.set_workers({loaded_worker(1, 2, 10, 1), loaded_worker(2, 2, 10, 1),
                        loaded_worker(3, 2, 10, 1), loaded_worker(4, 3, 0, 0)});
  auto least_loaded = policy(3);
  const auto counts = pick_counts(least_loaded, 300);
  EXPECT_FALSE(counts.contains(4));
  for (const WorkerId tied : {1U, 2U, 3U}) {
    ASSERT_TRUE(counts.contains(tied));
    EXPECT_GT(counts.at(tied), 70) << "worker " << tied;  // 100 expected of each
  }
}

TEST_F(LeastLoadedPolicyTest, WorkerWithoutLoadObservationCountsAsIdle) {
  testing::FakeWorker fresh = loaded_worker(2, 0);
  fresh.load.reset();
  signals_.set_workers({loaded_worker(1, 1), fresh});
  auto least_loaded = policy();
  EXPECT_EQ(pick(least_loaded), 2U);
}

}  // namespace
}  // namespace kvr::selection::policies
