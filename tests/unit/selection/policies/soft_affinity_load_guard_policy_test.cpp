// soft-affinity-load-guard: keep the affinity target up to the limit, leave it only for a worker
// lighter by the margin, least loaded without a target; and the reference's soft-pinning
// walkthrough at the policy level.
#include "selection/policies/soft_affinity_load_guard/soft_affinity_load_guard_policy.hpp"

#include <string>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class SoftAffinityLoadGuardPolicyTest : public PolicyTest {
 protected:
  WorkerSelectionPolicy policy(const SoftAffinityLoadGuardParameters& parameters = {
                                   .max_active_requests = 4, .margin = 2, .seed = 1}) {
    return make_soft_affinity_load_guard_policy(parameters, config_, WorkerType::Aggregated,
                                                partition_);
  }
  void target(WorkerId worker) { request_.affinity_target = WorkerAffinityTarget{worker}; }
  void set_active(WorkerId worker, std::size_t active_requests) {
    for (testing::FakeWorker& fake : signals_.mutable_workers()) {
      if (fake.worker.worker_id == worker) fake.load->active_requests = active_requests;
    }
    signals_.refresh();
  }
};

TEST_F(SoftAffinityLoadGuardPolicyTest, KeepsTheTargetUpToTheLimitEvenWhenOthersAreLighter) {
  signals_.set_workers({loaded_worker(1, 4), loaded_worker(2, 0)});
  target(1);
  auto guard = policy();
  EXPECT_EQ(pick(guard), 1U);
}

TEST_F(SoftAffinityLoadGuardPolicyTest, AboveTheLimitMovesOnlyToAWorkerLighterByTheMargin) {
  signals_.set_workers({loaded_worker(1, 5), loaded_worker(2, 4)});
  target(1);
  auto guard = policy();
  EXPECT_EQ(pick(guard), 1U);  // 5 − 4 < margin 2: stay
  set_active(2, 3);
  EXPECT_EQ(pick(guard), 2U);  // 5 − 3 = margin: move
}

TEST_F(SoftAffinityLoadGuardPolicyTest, WithoutATargetPicksTheLeastLoaded) {
  signals_.set_workers({loaded_worker(1, 3), loaded_worker(2, 1), loaded_worker(3, 2)});
  auto guard = policy();
  EXPECT_EQ(pick(guard), 2U);
}

TEST_F(SoftAffinityLoadGuardPolicyTest, TargetThatIsNotACandidateMeansLeastLoaded) {
  signals_.set_workers({loaded_worker(1, 3), loaded_worker(2, 1)});
  target(9);
  auto guard = policy();
  EXPECT_EQ(pick(guard), 2U);
}

TEST_F(SoftAffinityLoadGuardPolicyTest, TargetWithoutRankUsesItsLightestRank) {
  signals_.set_workers(
      {loaded_worker(1, 3, 0, 0, /*rank=*/0), loaded_worker(1, 1, 0, 0, 1), loaded_worker(2, 0)});
  target(1);
  auto guard = policy();
  auto result = select(guard);
  ASSERT_TRUE(result) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 1}));
}

TEST_F(SoftAffinityLoadGuardPolicyTest, SoftPinningWalkthrough) {
  signals_.set_workers({loaded_worker(1, 0), loaded_worker(2, 0)});  // A = 1, B = 2
  auto guard = policy();

  // Request 1 is bound to A, which is idle: it stays on A.
  target(1);
  EXPECT_EQ(pick(guard), 1U);

  // A now holds more requests than the limit; request 2, still bound to A, moves to B (the
  // session's binding then follows it to B).
  set_active(1, 6);
  set_active(2, 1);
  EXPECT_EQ(pick(guard), 2U);

  // A's load drains; request 3 carries the new binding, B, and stays there although A is
  // now the lighter worker.
  set_active(1, 0);
  target(2);
  EXPECT_EQ(pick(guard), 2U);
}

TEST_F(SoftAffinityLoadGuardPolicyTest, ValidationNamesTheParameterAndItsRange) {
  const auto error_of = [](const SoftAffinityLoadGuardParameters& parameters) {
    auto valid = parameters.validate();
    return valid ? std::string{} : std::string{valid.error().message()};
  };
  EXPECT_EQ(error_of({}), "");
  EXPECT_EQ(error_of({.max_active_requests = 0, .margin = 1}), "");
  EXPECT_NE(error_of({.max_active_requests = -3}).find("'max_active_requests'"), std::string::npos);
  const std::string margin = error_of({.margin = 0});
  EXPECT_NE(margin.find("'margin'"), std::string::npos) << margin;
  EXPECT_NE(margin.find(">= 1"), std::string::npos) << margin;
}

}  // namespace
}  // namespace kvr::selection::policies
