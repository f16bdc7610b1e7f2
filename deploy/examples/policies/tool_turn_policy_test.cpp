// The example policy `tool-turn-local`, run through the selection host as a node would run it: a
// tool-result turn goes to the worker holding most of its prompt, any other turn to the cheapest.
#include "deploy/examples/policies/tool_turn_policy.hpp"

#include <optional>
#include <string>

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

FakeWorker worker(WorkerId id, double cached_blocks, std::size_t active_requests) {
  FakeWorker fake;
  fake.worker = WorkerWithDpRank{id, 0};
  fake.type = WorkerType::Aggregated;
  fake.cache = WorkerCacheInput{cached_blocks, 0, 0};
  fake.load = WorkerLoadInput::Values{.active_requests = active_requests};
  return fake;
}

class ToolTurnLocalPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    ASSERT_TRUE(register_example_catalog(registry_));
    auto config = selection::parse_router_policy_config(
        "worker_selection:\n  aggregated: agent\n  instances:\n"
        "    - {name: agent, type: tool-turn-local, parameters: {queue_weight: 1.0}}\n",
        "router.yaml");
    ASSERT_TRUE(config.has_value()) << config.error();
    auto plugins = registry_.resolve_plugins(*config);
    ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
    plugins_ = std::move(*plugins);
    // Worker 1 holds 12 of the 16 prompt blocks but runs 20 requests (cost 4 + 20 = 24); worker 2
    // holds nothing and is idle (cost 16).
    signals_.set_workers({worker(1, 12, 20), worker(2, 0, 0)});
  }

  WorkerWithDpRank select(std::optional<InputTrigger> trigger) {
    WorkerSelectionPolicy policy = plugins_.selection_for(WorkerType::Aggregated)
                                       .factory(RouterConfig{}, WorkerType::Aggregated, partition_);
    selection::SelectionRequest request;
    request.request_id = "turn";
    request.prompt_tokens = 256;
    if (trigger) request.session.emplace("agent-7", std::nullopt, std::nullopt, *trigger);
    auto result = selection::select_worker(policy, request, partition_, signals_);
    EXPECT_TRUE(result.has_value()) << result.error().message();
    return result ? result->worker : WorkerWithDpRank{};
  }

  plugins::RouterPluginRegistry registry_;
  plugins::RouterPlugins plugins_;
  RoutingPartition partition_{"llama"};
  ::kvr::testing::FakeWorkerSignals signals_;
};

TEST_F(ToolTurnLocalPolicyTest, AToolResultTurnGoesWhereItsConversationIsCached) {
  EXPECT_EQ(select(InputTrigger::ToolResult), (WorkerWithDpRank{1, 0}));
}

TEST_F(ToolTurnLocalPolicyTest, OtherTurnsGoToTheCheapestWorker) {
  EXPECT_EQ(select(InputTrigger::UserMessage), (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(select(InputTrigger::Other), (WorkerWithDpRank{2, 0}));
  EXPECT_EQ(select(std::nullopt), (WorkerWithDpRank{2, 0})) << "no session at all";
}

TEST_F(ToolTurnLocalPolicyTest, EqualOverlapsGoToTheCheaperWorker) {
  signals_.set_workers({worker(1, 12, 20), worker(2, 12, 3), worker(3, 4, 0)});
  EXPECT_EQ(select(InputTrigger::ToolResult), (WorkerWithDpRank{2, 0}));
}

TEST_F(ToolTurnLocalPolicyTest, AnUnknownParameterStopsStartup) {
  auto config = selection::parse_router_policy_config(
      "worker_selection:\n  instances:\n"
      "    - {name: agent, type: tool-turn-local, parameters: {queue: 1}}\n",
      "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  auto plugins = registry_.resolve_plugins(*config);
  ASSERT_FALSE(plugins.has_value());
  EXPECT_NE(std::string{plugins.error().message()}.find("unknown parameter 'queue'"),
            std::string::npos)
      << plugins.error().message();
}

}  // namespace
}  // namespace kvr::examples
