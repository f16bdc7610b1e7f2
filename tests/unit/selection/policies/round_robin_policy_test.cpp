// round-robin: rotation in (worker id, rank) order whatever the candidate order, and how the
// rotation carries on when the fleet changes.
#include "selection/policies/round_robin/round_robin_policy.hpp"

#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class RoundRobinPolicyTest : public PolicyTest {
 protected:
  WorkerSelectionPolicy policy() {
    return make_round_robin_policy({}, config_, WorkerType::Aggregated, partition_);
  }

  std::vector<WorkerWithDpRank> served(WorkerSelectionPolicy& policy, int picks) {
    std::vector<WorkerWithDpRank> workers;
    for (int i = 0; i < picks; ++i) {
      auto result = select(policy);
      EXPECT_TRUE(result) << result.error().message();
      if (result) workers.push_back(result->worker);
    }
    return workers;
  }
};

TEST_F(RoundRobinPolicyTest, RotatesInWorkerAndRankOrderWhateverTheCandidateOrder) {
  signals_.set_workers({loaded_worker(3, 0), loaded_worker(1, 0, 0, 0, /*rank=*/1),
                        loaded_worker(2, 0), loaded_worker(1, 0)});
  auto round_robin = policy();
  EXPECT_EQ(served(round_robin, 6),
            (std::vector<WorkerWithDpRank>{{1, 0}, {1, 1}, {2, 0}, {3, 0}, {1, 0}, {1, 1}}));
}

TEST_F(RoundRobinPolicyTest, CandidateOrderChangesDoNotDisturbTheRotation) {
  signals_.set_workers({loaded_worker(1, 0), loaded_worker(2, 0), loaded_worker(3, 0)});
  auto round_robin = policy();
  EXPECT_EQ(pick(round_robin), 1U);
  signals_.set_workers({loaded_worker(3, 0), loaded_worker(1, 0), loaded_worker(2, 0)});
  EXPECT_EQ(pick(round_robin), 2U);
  EXPECT_EQ(pick(round_robin), 3U);
}

TEST_F(RoundRobinPolicyTest, RotationContinuesWhenWorkersJoinAndLeave) {
  signals_.set_workers({loaded_worker(10, 0), loaded_worker(20, 0), loaded_worker(30, 0)});
  auto round_robin = policy();
  EXPECT_EQ(pick(round_robin), 10U);
  // A worker joins after the last one served: it is next in line.
  signals_.set_workers(
      {loaded_worker(10, 0), loaded_worker(15, 0), loaded_worker(20, 0), loaded_worker(30, 0)});
  EXPECT_EQ(pick(round_robin), 15U);
  // The worker that would come next leaves: the rotation moves on to the one after it.
  signals_.set_workers({loaded_worker(10, 0), loaded_worker(15, 0), loaded_worker(30, 0)});
  EXPECT_EQ(pick(round_robin), 30U);
  EXPECT_EQ(pick(round_robin), 10U);
}

}  // namespace
}  // namespace kvr::selection::policies
