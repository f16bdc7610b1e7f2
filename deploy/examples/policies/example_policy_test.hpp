// The fixture the example policies' tests share: a registry with the built-ins and the example
// catalog, one policy type configured for the aggregated role from router-policy YAML (as a node
// reads it), and selections of a 256-token prompt (16 blocks of 16 tokens) through the real
// selection host over a fake fleet.
#pragma once

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

/// Runs selections of the type `type` (an instance named `instance` when parameters are given).
class ExamplePolicyTest : public ::testing::Test {
 protected:
  ExamplePolicyTest(std::string type, std::string instance)
      : type_(std::move(type)), instance_(std::move(instance)) {}

  void SetUp() override {
    ASSERT_TRUE(selection::register_builtin_policies(registry_));
    ASSERT_TRUE(register_example_catalog(registry_));
    auto configured = configure();
    ASSERT_TRUE(configured.has_value()) << configured.error();
  }

  /// Gives the aggregated role the type with `parameters` (a YAML flow mapping; empty: the type
  /// itself, with its defaults); the registry's error when it refuses them.
  std::expected<void, std::string> configure(std::string_view parameters = {}) {
    std::string yaml = "worker_selection:\n  aggregated: " + type_ + "\n";
    if (!parameters.empty()) {
      yaml = "worker_selection:\n  aggregated: " + instance_ +
             "\n  instances:\n    - {name: " + instance_ + ", type: " + type_ +
             ", parameters: " + std::string{parameters} + "}\n";
    }
    auto config = selection::parse_router_policy_config(yaml, "router.yaml");
    if (!config) return std::unexpected(config.error());
    auto plugins = registry_.resolve_plugins(*config);
    if (!plugins) return std::unexpected(std::string{plugins.error().message()});
    plugins_ = std::move(*plugins);
    return {};
  }

  /// Routes a 256-token prompt (16 blocks of 16 tokens) over the fake fleet.
  std::expected<selection::SelectionResult, plugins::worker_selection::WorkerSelectionPolicyError>
  select() {
    plugins::worker_selection::WorkerSelectionPolicy policy =
        plugins_.selection_for(WorkerType::Aggregated)
            .factory(plugins::worker_selection::RouterConfig{}, WorkerType::Aggregated, partition_);
    selection::SelectionRequest request;
    request.request_id = "r1";
    request.prompt_tokens = 256;
    return selection::select_worker(policy, request, partition_, signals_);
  }

  /// The worker select() chooses (worker 0 when the selection fails).
  WorkerWithDpRank chosen() {
    auto result = select();
    EXPECT_TRUE(result.has_value()) << result.error().message();
    return result ? result->worker : WorkerWithDpRank{};
  }

  plugins::RouterPluginRegistry registry_;
  plugins::RouterPlugins plugins_;
  plugins::worker_selection::RoutingPartition partition_{"llama"};
  ::kvr::testing::FakeWorkerSignals signals_;

 private:
  std::string type_;
  std::string instance_;
};

}  // namespace kvr::examples
