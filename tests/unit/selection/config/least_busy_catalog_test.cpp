// The reference's custom policy (least_busy_catalog.cpp), configured by YAML and run through the
// selection host: aggregated with min_device_overlap_blocks 0, prefill with 1.
#include "tests/unit/selection/config/least_busy_catalog.hpp"

#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/selection_host.hpp"
#include "tests/testing/fake_worker_signals.hpp"
#include "tests/unit/selection/config/stand_in_plugins.hpp"

namespace kvr::selection {
namespace {

using ::kvr::testing::FakeWorker;
using ::kvr::testing::FakeWorkerSignals;
using plugins::RouterPluginRegistry;
using plugins::RouterPlugins;

// The reference's YAML (docs/policies.md), plus prefill through a second instance that needs
// device overlap.
constexpr std::string_view kRouterPolicyYaml = R"(worker_selection:
  aggregated: least-busy
  prefill: least-busy-prefill
  instances:
    - name: least-busy
      type: least-busy
      parameters: {min_device_overlap_blocks: 0}
    - name: least-busy-prefill
      type: least-busy
      parameters: {min_device_overlap_blocks: 1}
request_classifier:
  type: max-in-flight
  parameters: {max_in_flight: 32}
)";

FakeWorker worker(WorkerId id, WorkerType type, double device_overlap_blocks,
                  std::size_t active_requests) {
  FakeWorker fake;
  fake.worker = WorkerWithDpRank{id, 0};
  fake.type = type;
  fake.cache = WorkerCacheInput{device_overlap_blocks, 0, 0};
  fake.load = WorkerLoadInput::Values{.active_requests = active_requests};
  return fake;
}

class LeastBusyCatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(examples::least_busy::register_catalog(registry_));
    // Stand-ins for what a node also registers: the built-in (decode, encode) and a classifier.
    ASSERT_TRUE(registry_.register_worker_selection(
        "kv-cost", testing::stand_in_policy(std::make_shared<testing::ProviderRuns>())));
    ASSERT_TRUE(registry_.register_request_classifier(
        "max-in-flight", testing::stand_in_classifier(std::make_shared<std::uint32_t>())));

    auto config = parse_router_policy_config(kRouterPolicyYaml, "router.yaml");
    ASSERT_TRUE(config.has_value()) << config.error();
    ASSERT_TRUE(apply_selection_precedence(*config, {}, [](std::string_view) {
                  return std::optional<std::string>{};
                }).has_value());
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
    plugins_ = std::move(*plugins);
  }

  std::expected<SelectionResult, WorkerSelectionPolicyError> select(WorkerType role) {
    WorkerSelectionPolicy policy =
        plugins_.selection_for(role).factory(RouterConfig{}, role, partition_);
    SelectionRequest request;
    request.request_id = "r1";
    request.prompt_tokens = 64;
    return select_worker(policy, request, partition_, signals_);
  }

  RouterPluginRegistry registry_;
  RouterPlugins plugins_;
  RoutingPartition partition_{"llama"};
  FakeWorkerSignals signals_;
};

TEST_F(LeastBusyCatalogTest, YamlSelectsTheCatalogPolicyForAggregatedAndPrefill) {
  EXPECT_EQ(plugins_.selection_for(WorkerType::Aggregated).instance_name, "least-busy");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Prefill).instance_name, "least-busy-prefill");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Prefill).type, "least-busy");
  EXPECT_EQ(plugins_.selection_for(WorkerType::Decode).type, "kv-cost");
}

TEST_F(LeastBusyCatalogTest, AggregatedPicksTheFewestActiveRequestsRegardlessOfOverlap) {
  signals_.set_workers({worker(1, WorkerType::Aggregated, 8, 4),
                        worker(2, WorkerType::Aggregated, 0, 1),
                        worker(3, WorkerType::Aggregated, 3, 2)});
  auto result = select(WorkerType::Aggregated);
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(result->total_cost, 1.0);
  EXPECT_EQ(result->kept_workers, 3U);
}

TEST_F(LeastBusyCatalogTest, PrefillDropsWorkersWithoutDeviceOverlapThenPicksTheLeastBusy) {
  signals_.set_workers({worker(1, WorkerType::Prefill, 8, 4), worker(2, WorkerType::Prefill, 0, 1),
                        worker(3, WorkerType::Prefill, 1, 2)});
  auto result = select(WorkerType::Prefill);
  ASSERT_TRUE(result.has_value()) << result.error().message();
  EXPECT_EQ(result->worker, (WorkerWithDpRank{3, 0}));
  EXPECT_EQ(result->eligible_workers, 3U);
  EXPECT_EQ(result->kept_workers, 2U);
}

TEST_F(LeastBusyCatalogTest, PrefillFailsWhenEveryWorkerIsFiltered) {
  signals_.set_workers(
      {worker(1, WorkerType::Prefill, 0, 4), worker(2, WorkerType::Prefill, 0, 1)});
  auto result = select(WorkerType::Prefill);
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().kind(), WorkerSelectionPolicyError::Kind::AllFiltered);
}

TEST_F(LeastBusyCatalogTest, RejectsAMisspelledParameterAtStartup) {
  auto config = parse_router_policy_config(
      "worker_selection:\n  instances:\n    - {name: lb, type: least-busy, parameters: "
      "{min_overlap_blocks: 1}}\n",
      "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  auto plugins = registry_.resolve_plugins(*config);
  ASSERT_FALSE(plugins.has_value());
  EXPECT_EQ(plugins.error().message(),
            "router.yaml: worker_selection.instances[0] (lb): parameters: unknown parameter "
            "'min_overlap_blocks'; accepted: 'min_device_overlap_blocks'");
}

}  // namespace
}  // namespace kvr::selection
