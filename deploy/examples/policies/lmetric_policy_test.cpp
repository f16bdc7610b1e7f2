// The example policy `lmetric`, run through the selection host as a node would run it: a worker
// costs the request's new prefill tokens plus its queued ones, times its batch size, and the
// cheapest worker wins.
#include "deploy/examples/policies/lmetric_policy.hpp"

#include <cstddef>
#include <expected>
#include <string>
#include <string_view>
#include <utility>

#include <gtest/gtest.h>

#include "deploy/examples/policies/example_catalog.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/selection_host.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::examples {
namespace {

using ::kvr::testing::FakeWorker;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

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

class LMetricPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    ASSERT_TRUE(register_example_catalog(registry_));
    auto configured = configure();
    ASSERT_TRUE(configured.has_value()) << configured.error();
  }

  /// Gives the aggregated role an `lmetric` instance with `parameters` (a YAML flow mapping;
  /// empty: the type itself, with its defaults); the registry's error when it refuses them.
  std::expected<void, std::string> configure(std::string_view parameters = {}) {
    std::string yaml = "worker_selection:\n  aggregated: lmetric\n";
    if (!parameters.empty()) {
      yaml =
          "worker_selection:\n  aggregated: lm\n  instances:\n"
          "    - {name: lm, type: lmetric, parameters: " +
          std::string{parameters} + "}\n";
    }
    auto config = selection::parse_router_policy_config(yaml, "router.yaml");
    if (!config) return std::unexpected(config.error());
    auto plugins = registry_.resolve_plugins(*config);
    if (!plugins) return std::unexpected(std::string{plugins.error().message()});
    plugins_ = std::move(*plugins);
    return {};
  }

  /// Routes a 256-token prompt (16 blocks of 16 tokens) over the fake fleet.
  std::expected<selection::SelectionResult, WorkerSelectionPolicyError> select() {
    WorkerSelectionPolicy policy = plugins_.selection_for(WorkerType::Aggregated)
                                       .factory(RouterConfig{}, WorkerType::Aggregated, partition_);
    selection::SelectionRequest request;
    request.request_id = "r1";
    request.prompt_tokens = 256;
    return selection::select_worker(policy, request, partition_, signals_);
  }

  plugins::RouterPluginRegistry registry_;
  plugins::RouterPlugins plugins_;
  RoutingPartition partition_{"llama"};
  ::kvr::testing::FakeWorkerSignals signals_;
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
