// Registration of the built-in policies: each type name is registered, resolves from the
// router-policy YAML with and without parameters, builds a working policy, and rejects a bad
// parameter value and an unknown parameter key by name.
#include "selection/policies/builtin_policies.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/policies/round_robin/round_robin_policy.hpp"
#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection {
namespace {

using plugins::RouterPluginRegistry;
using plugins::RouterPlugins;
using plugins::worker_selection::WorkerSelectionPolicyFactory;

// One built-in type with parameters that are valid but not the defaults, and one bad value.
struct BuiltinCase {
  std::string_view type;
  std::string_view good_parameters;
  std::string_view bad_parameters;
  std::string_view bad_key;
};

constexpr BuiltinCase kCases[] = {
    {"kv-cost",
     "{device_overlap_credit: 0.9, host_overlap_credit: 0.5, disk_overlap_credit: 0.1, "
     "prefill_load_scale: 2, active_request_weight: 1, temperature: 0.5, seed: 3}",
     "{temperature: -1}", "temperature"},
    {"least-loaded", "{seed: 9}", "{seed: -4}", "seed"},
    // round-robin draws nothing at random, so even a seed is a key it does not know.
    {"round-robin", "{}", "{seed: 1}", "seed"},
    {"random", "{seed: 12}", "{seed: 1.5}", "seed"},
    {"power-of-two", "{seed: 0}", "{seed: many}", "seed"},
    {"two-tier", "{imbalance_absolute: 4, imbalance_relative: 2.0, cache_fraction: 0.3, seed: 1}",
     "{cache_fraction: 2}", "cache_fraction"},
    {"soft-affinity-load-guard", "{max_active_requests: 2, margin: 1, seed: 2}", "{margin: 0}",
     "margin"},
    {"bounded-load-hash", "{prefix_blocks: 2, load_factor: 1.5, virtual_nodes: 10}",
     "{virtual_nodes: 0}", "virtual_nodes"},
    {"predicted-ttft",
     "{prior_step_ms: 10, prior_prefill_ms_per_1k_tokens: 30, prior_decode_interference_ms: 20, "
     "prior_decode_interference_ms_per_1k_tokens: 2, learn: false, memory: 500, "
     "worker_factor_weight: 0.1, sticky_fraction: 0.8, sticky_margin: 0.5, sticky_margin_ms: 5, "
     "seed: 4}",
     "{sticky_fraction: 1.5}", "sticky_fraction"},
};

class BuiltinPoliciesTest : public ::testing::TestWithParam<BuiltinCase> {
 protected:
  BuiltinPoliciesTest() {
    auto registered = register_builtin_policies(registry_);
    EXPECT_TRUE(registered) << registered.error().message();
    config_.block_size = 16;
    signals_.set_workers({policies::cached_worker(1, {4, 0, 0}, 3),
                          policies::cached_worker(2, {0, 0, 0}, 0),
                          policies::cached_worker(3, {8, 1, 0}, 1)});
  }

  // Resolves a router-policy document and returns the aggregated role's selection.
  std::expected<RouterPlugins::WorkerSelection, std::string> resolve(const std::string& yaml) {
    auto parsed = parse_router_policy_config(yaml, "test.yaml");
    if (!parsed) return std::unexpected(parsed.error());
    auto plugins = registry_.resolve_plugins(*parsed);
    if (!plugins) return std::unexpected(std::string{plugins.error().message()});
    return plugins->selection_for(WorkerType::Aggregated);
  }

  // Resolves one instance of `type` with `parameters` (YAML flow mapping) for the aggregated role.
  std::expected<RouterPlugins::WorkerSelection, std::string> resolve_instance(
      std::string_view type, std::string_view parameters) {
    return resolve(
        fmt::format("worker_selection:\n  aggregated: chosen\n  instances:\n    - name: chosen\n"
                    "      type: {}\n      parameters: {}\n",
                    type, parameters));
  }

  // Builds a policy with `factory` and checks that it selects one of the fleet's workers.
  void expect_working_policy(const WorkerSelectionPolicyFactory& factory) {
    WorkerSelectionPolicy policy = factory(config_, WorkerType::Aggregated, partition_);
    const std::vector<BlockHash> hashes{11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    const SelectionRequest request{.request_id = "r", .prompt_tokens = 160, .block_hashes = hashes};
    for (int i = 0; i < 3; ++i) {
      auto result = select_worker(policy, request, partition_, signals_);
      ASSERT_TRUE(result) << result.error().message();
      EXPECT_GE(result->worker.worker_id, 1U);
      EXPECT_LE(result->worker.worker_id, 3U);
    }
  }

  RouterPluginRegistry registry_;
  RouterConfig config_;
  RoutingPartition partition_{.model = "m"};
  testing::FakeWorkerSignals signals_;
};

TEST_P(BuiltinPoliciesTest, IsRegisteredResolvesAndBuildsAWorkingPolicy) {
  const BuiltinCase& builtin = GetParam();
  const std::vector<std::string> types = registry_.worker_selection_types();
  EXPECT_NE(std::ranges::find(types, builtin.type), types.end());

  auto by_type = resolve(fmt::format("worker_selection:\n  aggregated: {}\n", builtin.type));
  ASSERT_TRUE(by_type) << by_type.error();
  EXPECT_EQ(by_type->type, builtin.type);
  expect_working_policy(by_type->factory);

  auto with_parameters = resolve_instance(builtin.type, builtin.good_parameters);
  ASSERT_TRUE(with_parameters) << with_parameters.error();
  EXPECT_EQ(with_parameters->type, builtin.type);
  EXPECT_EQ(with_parameters->instance_name, "chosen");
  expect_working_policy(with_parameters->factory);
}

TEST_P(BuiltinPoliciesTest, BadParameterValueFailsNamingTheParameter) {
  const BuiltinCase& builtin = GetParam();
  auto resolved = resolve_instance(builtin.type, builtin.bad_parameters);
  ASSERT_FALSE(resolved);
  EXPECT_NE(resolved.error().find(builtin.bad_key), std::string::npos) << resolved.error();
  EXPECT_NE(resolved.error().find("chosen"), std::string::npos) << resolved.error();
}

TEST_P(BuiltinPoliciesTest, UnknownParameterKeyFailsNamingTheKey) {
  const BuiltinCase& builtin = GetParam();
  auto resolved = resolve_instance(builtin.type, "{no_such_parameter: 1}");
  ASSERT_FALSE(resolved);
  EXPECT_NE(resolved.error().find("no_such_parameter"), std::string::npos) << resolved.error();
}

INSTANTIATE_TEST_SUITE_P(EachType, BuiltinPoliciesTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<BuiltinCase>& param_info) {
                           std::string name{param_info.param.type};
                           std::ranges::replace(name, '-', '_');
                           return name;
                         });

TEST(BuiltinPoliciesRegistrationTest, RegistersExactlyTheBuiltinTypesWithKvCostAsDefault) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  std::vector<std::string> expected;
  for (const BuiltinCase& builtin : kCases) expected.emplace_back(builtin.type);
  std::ranges::sort(expected);
  EXPECT_EQ(registry.worker_selection_types(), expected);
  ASSERT_EQ(builtin_policy_types().size(), expected.size());
  EXPECT_EQ(builtin_policy_types().front(), plugins::kBuiltinDefaultPolicyType);

  auto parsed = parse_router_policy_config("", "empty.yaml");
  ASSERT_TRUE(parsed) << parsed.error();
  auto plugins = registry.resolve_plugins(*parsed);
  ASSERT_TRUE(plugins) << plugins.error().message();
  EXPECT_EQ(plugins->selection_for(WorkerType::Aggregated).type, "kv-cost");
}

TEST(BuiltinPoliciesRegistrationTest, RegisteringTwiceFailsNamingTheType) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  auto again = register_builtin_policies(registry);
  ASSERT_FALSE(again);
  EXPECT_NE(again.error().message().find("kv-cost"), std::string::npos);
}

TEST(BuiltinPoliciesRegistrationTest, EachFactoryCallBuildsFreshComponents) {
  // Two round-robin policies from one factory each start their own rotation.
  auto factory = policies::round_robin_policy_provider(
      plugins::worker_selection::WorkerSelectionPolicyParameters{nullptr});
  ASSERT_TRUE(factory) << factory.error().message();
  testing::FakeWorkerSignals signals{
      {policies::loaded_worker(1, 0), policies::loaded_worker(2, 0)}};
  const RouterConfig config;
  const RoutingPartition partition{.model = "m"};
  const SelectionRequest request{.request_id = "r", .prompt_tokens = 16};
  WorkerSelectionPolicy first = (*factory)(config, WorkerType::Aggregated, partition);
  WorkerSelectionPolicy second = (*factory)(config, WorkerType::Aggregated, partition);
  EXPECT_EQ(select_worker(first, request, partition, signals)->worker.worker_id, 1U);
  EXPECT_EQ(select_worker(first, request, partition, signals)->worker.worker_id, 2U);
  EXPECT_EQ(select_worker(second, request, partition, signals)->worker.worker_id, 1U);
}

}  // namespace
}  // namespace kvr::selection
