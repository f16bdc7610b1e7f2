// The example policy `cache-headroom`, configured by deploy/examples/router_policy.yaml and run
// through the selection host as a node would run it: registration, YAML, parameters, selection.
#include "deploy/examples/policies/cache_headroom_policy.hpp"

#include <cstddef>
#include <optional>
#include <string_view>

#include <gtest/gtest.h>

#include "deploy/examples/policies/example_catalog.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/selection_host.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace kvr::examples {
namespace {

using ::kvr::testing::FakeWorker;
using ::kvr::testing::FakeWorkerSignals;
using plugins::RouterPluginRegistry;
using plugins::RouterPlugins;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerCacheInput;
using plugins::worker_selection::WorkerLoadInput;
using plugins::worker_selection::WorkerSelectionPolicy;
using plugins::worker_selection::WorkerSelectionPolicyError;

/// A worker holding `cached_blocks` of the prompt on its device with `active_requests` running.
FakeWorker worker(WorkerId id, WorkerType type, double cached_blocks, std::size_t active_requests) {
  FakeWorker fake;
  fake.worker = WorkerWithDpRank{id, 0};
  fake.type = type;
  fake.cache = WorkerCacheInput{cached_blocks, 0, 0};
  fake.load = WorkerLoadInput::Values{.active_requests = active_requests};
  return fake;
}

std::optional<std::string> no_environment(std::string_view) { return std::nullopt; }

class CacheHeadroomPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // What a binary that links the catalog does at startup: built-ins first, then the catalog.
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    ASSERT_TRUE(register_example_catalog(registry_));

    auto config = selection::load_router_policy_config(KVR_EXAMPLES_DIR "/router_policy.yaml");
    ASSERT_TRUE(config.has_value()) << config.error();
    ASSERT_TRUE(selection::apply_selection_precedence(*config, {}, no_environment).has_value());
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
    plugins_ = std::move(*plugins);
  }

  /// Routes a 16-block prompt (block size 16) for `role` over the fake fleet.
  std::expected<selection::SelectionResult, WorkerSelectionPolicyError> select(WorkerType role) {
    WorkerSelectionPolicy policy =
        plugins_.selection_for(role).factory(RouterConfig{}, role, partition_);
    selection::SelectionRequest request;
    request.request_id = "r1";
    request.prompt_tokens = 256;
    return selection::select_worker(policy, request, partition_, signals_);
  }

  RouterPluginRegistry registry_;
  RouterPlugins plugins_;
  RoutingPartition partition_{"llama"};
  FakeWorkerSignals signals_;
};

TEST_F(CacheHeadroomPolicyTest, TheYamlSelectsAnInstancePerRole) {
  EXPECT_EQ(plugins_.selection_for(WorkerType::Aggregated).instance_name, "cache-headroom");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Prefill).instance_name, "strict-headroom");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Prefill).type, "cache-headroom");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Decode).type, "least-loaded");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Encode).type, "kv-cost");
}

TEST_F(CacheHeadroomPolicyTest, CostIsUncachedBlocksPlusActiveRequests) {
  // Costs: 16 − 10 + 3 = 9, 16 − 0 + 0 = 16, 16 − 12 + 1 = 5.
  signals_.set_workers({worker(1, WorkerType::Aggregated, 10, 3),
                        worker(2, WorkerType::Aggregated, 0, 0),
                        worker(3, WorkerType::Aggregated, 12, 1)});
  auto result = select(WorkerType::Aggregated);
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{3, 0}));
  EXPECT_EQ(result->total_cost, 5.0);
  ASSERT_EQ(result->scorer_costs.size(), 2U);
  EXPECT_EQ(result->scorer_costs[0], 4.0);
  EXPECT_EQ(result->scorer_costs[1], 1.0);
}

TEST_F(CacheHeadroomPolicyTest, TheFilterDropsWorkersWithoutHeadroom) {
  // strict-headroom: at most 2 active requests, 4.0 per request. Worker 1 holds the whole prompt
  // but runs 2 requests, so it is filtered; worker 3 (cost 16 − 8 + 4) beats worker 2 (16 + 0).
  signals_.set_workers({worker(1, WorkerType::Prefill, 16, 2), worker(2, WorkerType::Prefill, 0, 0),
                        worker(3, WorkerType::Prefill, 8, 1)});
  auto result = select(WorkerType::Prefill);
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{3, 0}));
  EXPECT_EQ(result->total_cost, 12.0);
  EXPECT_EQ(result->eligible_workers, 3U);
  EXPECT_EQ(result->kept_workers, 2U);
}

TEST_F(CacheHeadroomPolicyTest, AFleetWithoutHeadroomFailsTheSelection) {
  signals_.set_workers(
      {worker(1, WorkerType::Prefill, 16, 2), worker(2, WorkerType::Prefill, 0, 5)});
  auto result = select(WorkerType::Prefill);
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().kind(), WorkerSelectionPolicyError::Kind::AllFiltered);
}

TEST_F(CacheHeadroomPolicyTest, EqualCostsGoToTheLowestWorkerId) {
  signals_.set_workers({worker(7, WorkerType::Aggregated, 4, 0),
                        worker(5, WorkerType::Aggregated, 4, 0),
                        worker(6, WorkerType::Aggregated, 4, 0)});
  auto result = select(WorkerType::Aggregated);
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{5, 0}));
}

TEST_F(CacheHeadroomPolicyTest, BadParametersStopStartupNamingTheInstance) {
  const auto error_for = [&](std::string_view parameters) {
    auto config = selection::parse_router_policy_config(
        "worker_selection:\n  instances:\n    - {name: ch, type: cache-headroom, parameters: " +
            std::string{parameters} + "}\n",
        "router.yaml");
    EXPECT_TRUE(config.has_value()) << config.error();
    auto plugins = registry_.resolve_plugins(*config);
    EXPECT_FALSE(plugins.has_value());
    return plugins ? std::string{} : std::string{plugins.error().message()};
  };
  EXPECT_EQ(error_for("{max_active: 4}"),
            "router.yaml: worker_selection.instances[0] (ch): parameters: unknown parameter "
            "'max_active'; accepted: 'max_active_requests', 'queue_weight'");
  EXPECT_EQ(error_for("{max_active_requests: 0}"),
            "router.yaml: worker_selection.instances[0] (ch): max_active_requests: must be at "
            "least 1");
  EXPECT_EQ(error_for("{queue_weight: -1}"),
            "router.yaml: worker_selection.instances[0] (ch): queue_weight: must be finite and "
            "not negative");
}

}  // namespace
}  // namespace kvr::examples
