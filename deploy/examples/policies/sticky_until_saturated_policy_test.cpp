// The example policy `sticky-until-saturated`, run through the selection host as a node would run
// it: a worker holding most of the prompt keeps it while the prefill queued on it is below the
// saturation point; past it, or without such a worker, the least uncached work wins.
#include "deploy/examples/policies/sticky_until_saturated_policy.hpp"

#include <cstddef>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "deploy/examples/policies/example_policy_test.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::examples {
namespace {

using ::kvr::testing::FakeWorker;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerLoadInput;

/// A worker holding `cached_blocks` of the prompt on its device, with `queued_prefill_tokens`
/// waiting for prefill and a projected decode footprint of `decode_blocks` blocks (16 tokens each
/// in these tests).
FakeWorker worker(WorkerId id, double cached_blocks, std::size_t queued_prefill_tokens,
                  double decode_blocks) {
  FakeWorker fake;
  fake.worker = WorkerWithDpRank{id, 0};
  fake.type = WorkerType::Aggregated;
  fake.cache = WorkerCacheInput{cached_blocks, 0, 0};
  fake.load = WorkerLoadInput::Values{.active_requests = 1,
                                      .active_prefill_tokens = queued_prefill_tokens,
                                      .decode_cost_blocks = decode_blocks};
  return fake;
}

class StickyUntilSaturatedPolicyTest : public ExamplePolicyTest {
 protected:
  StickyUntilSaturatedPolicyTest() : ExamplePolicyTest("sticky-until-saturated", "sticky") {}
};

TEST_F(StickyUntilSaturatedPolicyTest, AHolderKeepsThePromptBelowSaturation) {
  // Worker 1 holds 13 of 16 blocks (81%) and has 2000 prefill tokens queued, below 16384: it
  // keeps the prompt although its uncached work (48 + 2000) is far above idle worker 2's 256. Its
  // decode footprint (500 blocks) does not count towards saturation.
  signals_.set_workers({worker(1, 13, 2000, 500), worker(2, 0, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(result->total_cost, 2048.0);
  ASSERT_EQ(result->scorer_costs.size(), 1U);
}

TEST_F(StickyUntilSaturatedPolicyTest, AtSaturationTokensStickinessIsDropped) {
  // 16384 prefill tokens queued: saturated, so the least uncached work wins.
  signals_.set_workers({worker(1, 13, 16384, 0), worker(2, 0, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(result->total_cost, 256.0);

  // One token below it the holder is sticky again.
  signals_.set_workers({worker(1, 13, 16383, 0), worker(2, 0, 0, 0)});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{1, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, SaturationTokensIsAParameter) {
  // The holder of the first case, 2000 tokens queued, is saturated at 1500.
  signals_.set_workers({worker(1, 13, 2000, 500), worker(2, 0, 0, 0)});
  auto configured = configure("{saturation_tokens: 1500}");
  ASSERT_TRUE(configured.has_value()) << configured.error();
  EXPECT_EQ(chosen(), (WorkerWithDpRank{2, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, AWorkerBelowTheFractionIsNoHolder) {
  // 12 of 16 blocks is 75%, below the default 80%: uncached work 64 + 2000 loses to 256.
  signals_.set_workers({worker(1, 12, 2000, 0), worker(2, 0, 0, 0)});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{2, 0}));

  auto configured = configure("{sticky_fraction: 0.75}");
  ASSERT_TRUE(configured.has_value()) << configured.error();
  EXPECT_EQ(chosen(), (WorkerWithDpRank{1, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, HostAndDiskBlocksCountTowardsTheFraction) {
  // 4 + 5 + 4 = 13 blocks over the three tiers; 4 on the device alone would be no holder.
  FakeWorker tiered = worker(1, 0, 2000, 0);
  tiered.cache = WorkerCacheInput{4, 5, 4};
  signals_.set_workers({tiered, worker(2, 0, 0, 0)});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{1, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, AmongHoldersTheLeastUncachedWorkWins) {
  // Uncached work: worker 1 holds the whole prompt but has 1000 tokens queued (1 + 1000: the
  // last token is prefilled again); worker 2 holds 14 blocks with 300 queued (32 + 300); worker
  // 3 holds nothing and is idle (256). Worker 2 wins: neither the largest holder nor the least
  // work over all workers.
  signals_.set_workers({worker(1, 16, 1000, 0), worker(2, 14, 300, 0), worker(3, 0, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(result->total_cost, 332.0);
}

TEST_F(StickyUntilSaturatedPolicyTest, ASaturatedHolderGivesWayToAnUnsaturatedOne) {
  // Worker 1 holds the whole prompt but has 20000 tokens queued: saturated. Worker 2 holds 13
  // blocks with 500 queued (work 48 + 500). Stickiness stays with worker 2 rather than falling
  // back to the least work over all (idle worker 3, 256).
  signals_.set_workers({worker(1, 16, 20000, 0), worker(2, 13, 500, 10), worker(3, 0, 0, 0)});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{2, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, EqualWorkGoesToFewerActiveRequests) {
  // Three idle workers without the prompt (a new conversation): the one running fewest requests
  // takes it, whatever its id, so that a burst of new prompts is spread.
  FakeWorker busy = worker(1, 0, 0, 0);
  busy.load->active_requests = 5;
  FakeWorker quiet = worker(9, 0, 0, 0);
  quiet.load->active_requests = 0;
  signals_.set_workers({busy, worker(4, 0, 0, 0), quiet});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{9, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, EqualWorkGoesToTheLowestWorkerId) {
  signals_.set_workers({worker(7, 14, 100, 0), worker(5, 14, 100, 0), worker(6, 14, 100, 0)});
  EXPECT_EQ(chosen(), (WorkerWithDpRank{5, 0}));
}

TEST_F(StickyUntilSaturatedPolicyTest, BadParametersStopStartupNamingTheKey) {
  const auto error_for = [&](std::string_view parameters) {
    auto configured = configure(parameters);
    EXPECT_FALSE(configured.has_value()) << parameters;
    return configured ? std::string{} : configured.error();
  };
  EXPECT_EQ(error_for("{saturation: 100}"),
            "router.yaml: worker_selection.instances[0] (sticky): parameters: unknown parameter "
            "'saturation'; accepted: 'sticky_fraction', 'saturation_tokens'");
  EXPECT_EQ(error_for("{sticky_fraction: 0}"),
            "router.yaml: worker_selection.instances[0] (sticky): sticky_fraction: must be in "
            "(0, 1]");
  EXPECT_EQ(error_for("{sticky_fraction: 1.5}"),
            "router.yaml: worker_selection.instances[0] (sticky): sticky_fraction: must be in "
            "(0, 1]");
  EXPECT_EQ(error_for("{saturation_tokens: 0}"),
            "router.yaml: worker_selection.instances[0] (sticky): saturation_tokens: must be at "
            "least 1");
}

}  // namespace
}  // namespace kvr::examples
