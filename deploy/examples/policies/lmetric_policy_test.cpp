// The example policy `lmetric`, run through the selection host as a node would run it: a worker
// costs the request's new prefill tokens plus its queued ones, times its batch size, and the
// cheapest worker wins.
#include "deploy/examples/policies/lmetric_policy.hpp"

#include <cstddef>
#include <expected>
#include <string>

#include <gtest/gtest.h>

#include "deploy/examples/policies/example_policy_test.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::examples {
namespace {

using ::kvr::testing::FakeWorker;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerLoadInput;

/// A worker holding `cached_blocks` of the prompt on its device, running `active_requests` with
/// `queued_prefill_tokens` waiting for prefill.
FakeWorker worker(WorkerId id, double cached_blocks, std::size_t active_requests,
                  std::size_t queued_prefill_tokens = 0) {
  FakeWorker fake;
  fake.worker = WorkerWithDpRank{id, 0};
  fake.type = WorkerType::Aggregated;
  fake.cache = WorkerCacheInput{cached_blocks, 0, 0};
  fake.load = WorkerLoadInput::Values{.active_requests = active_requests,
                                      .active_prefill_tokens = queued_prefill_tokens};
  return fake;
}

class LMetricPolicyTest : public ExamplePolicyTest {
 protected:
  LMetricPolicyTest() : ExamplePolicyTest("lmetric", "lm") {}
};

TEST_F(LMetricPolicyTest, ACachedWorkerWithASmallBatchBeatsAnIdleUncachedOne) {
  // Costs: (256 − 12·16) · (1 + 1) = 128 against 256 · 1.
  signals_.set_workers({worker(1, 12, 1), worker(2, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(result->total_cost, 128.0);
  ASSERT_EQ(result->scorer_costs.size(), 1U);
}

TEST_F(LMetricPolicyTest, AnIdleUncachedWorkerBeatsACachedOneWithAHugeBatch) {
  // Costs: 64 · (20 + 1) = 1344 against 256 · 1. A sum of the two terms (64 + 21 against 256)
  // would have kept the cached worker.
  signals_.set_workers({worker(1, 12, 20), worker(2, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(result->total_cost, 256.0);
}

TEST_F(LMetricPolicyTest, QueuedPrefillCountsUnlessTurnedOff) {
  // Worker 1 has 512 prompt tokens waiting: (64 + 512) · 2 = 1152 against 256 · 1.
  signals_.set_workers({worker(1, 12, 1, 512), worker(2, 0, 0)});
  auto counted = select();
  ASSERT_TRUE(counted.has_value()) << counted.error().message();
  EXPECT_EQ(counted->worker, (WorkerWithDpRank{2, 0}));

  // Without the queue: 64 · 2 = 128 against 256 · 1.
  auto configured = configure("{count_queued_prefill: false}");
  ASSERT_TRUE(configured.has_value()) << configured.error();
  auto uncounted = select();
  ASSERT_TRUE(uncounted.has_value()) << uncounted.error().message();
  EXPECT_EQ(uncounted->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(uncounted->total_cost, 128.0);
}

TEST_F(LMetricPolicyTest, HostAndDiskBlocksCountAsCached) {
  // 4 blocks on each tier: (256 − 12·16) · 2 = 128 against 256. Counting the device alone
  // (256 − 4·16) · 2 = 384 would lose.
  FakeWorker tiered = worker(1, 0, 1);
  tiered.cache = WorkerCacheInput{4, 4, 4};
  signals_.set_workers({tiered, worker(2, 0, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(result->total_cost, 128.0);
}

TEST_F(LMetricPolicyTest, AWorkerWithoutALoadReportRunsAlone) {
  // No report: batch size 1 and nothing queued, (256 − 8·16) · 1 = 128, against worker 2's
  // (256 − 10·16) · 2 = 192. A worker without a report is not treated as busy.
  FakeWorker unreported = worker(1, 8, 0);
  unreported.load.reset();
  signals_.set_workers({unreported, worker(2, 10, 1)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{1, 0}));
  EXPECT_EQ(result->total_cost, 128.0);
}

TEST_F(LMetricPolicyTest, AFullyCachedPromptStillWeighsTheBatch) {
  // Both hold the whole prompt; the last token is still prefilled: 1 · 4 against 1 · 1. Costing
  // a full hit 0 would tie them whatever their batches.
  signals_.set_workers({worker(1, 16, 3), worker(2, 16, 0)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(result->total_cost, 1.0);
}

TEST_F(LMetricPolicyTest, EqualCostsGoToTheLowestWorkerId) {
  signals_.set_workers({worker(7, 8, 1), worker(5, 8, 1), worker(6, 8, 1)});
  auto result = select();
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{5, 0}));
}

TEST_F(LMetricPolicyTest, BadParametersStopStartupNamingTheKey) {
  auto misspelled = configure("{count_queued: false}");
  ASSERT_FALSE(misspelled.has_value());
  EXPECT_EQ(misspelled.error(),
            "router.yaml: worker_selection.instances[0] (lm): parameters: unknown parameter "
            "'count_queued'; accepted: 'count_queued_prefill'");
  auto not_a_boolean = configure("{count_queued_prefill: 3}");
  ASSERT_FALSE(not_a_boolean.has_value());
  EXPECT_NE(not_a_boolean.error().find("count_queued_prefill: expected a boolean"),
            std::string::npos)
      << not_a_boolean.error();
}

}  // namespace
}  // namespace kvr::examples
