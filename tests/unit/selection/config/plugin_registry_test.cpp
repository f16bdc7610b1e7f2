#include "selection/plugin_registry.hpp"

#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "tests/unit/selection/config/stand_in_plugins.hpp"

namespace kvr::plugins {
namespace {

using selection::testing::ProviderRuns;
using selection::testing::stand_in_classifier;
using selection::testing::stand_in_policy;
using ::testing::HasSubstr;
using worker_selection::RouterConfig;
using worker_selection::RoutingPartition;
using worker_selection::WorkerSelectionPolicyFactory;
using worker_selection::WorkerSelectionPolicyParameters;
using worker_selection::WorkerSelectionPolicyProviderError;

selection::RouterPolicyConfig config_from(std::string_view yaml) {
  auto config = selection::parse_router_policy_config(yaml, "router.yaml");
  EXPECT_TRUE(config.has_value()) << config.error();
  return config.value_or(selection::RouterPolicyConfig{});
}

std::string error_of(const auto& result) {
  EXPECT_FALSE(result.has_value());
  return result.has_value() ? std::string{} : std::string{result.error().message()};
}

// A registry with stand-ins for the built-in `kv-cost` and a catalog type `least-busy`.
class PluginRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(registry_.register_worker_selection("kv-cost", stand_in_policy(kv_cost_runs_)));
    ASSERT_TRUE(
        registry_.register_worker_selection("least-busy", stand_in_policy(least_busy_runs_)));
  }

  RouterPluginRegistry registry_;
  std::shared_ptr<ProviderRuns> kv_cost_runs_ = std::make_shared<ProviderRuns>();
  std::shared_ptr<ProviderRuns> least_busy_runs_ = std::make_shared<ProviderRuns>();
};

TEST_F(PluginRegistryTest, RejectsADuplicateRegistrationListingTheRegisteredTypes) {
  EXPECT_EQ(error_of(registry_.register_worker_selection("least-busy",
                                                         stand_in_policy(least_busy_runs_))),
            "worker-selection policy type 'least-busy' is already registered; registered types: "
            "[kv-cost, least-busy]");
}

TEST_F(PluginRegistryTest, RejectsTheReservedNameDefault) {
  EXPECT_EQ(
      error_of(registry_.register_worker_selection("default", stand_in_policy(kv_cost_runs_))),
      "cannot register worker-selection policy type 'default': the name is reserved (it "
      "selects the built-in kv-cost)");
  EXPECT_THAT(error_of(registry_.register_request_classifier(
                  "default", stand_in_classifier(std::make_shared<std::uint32_t>()))),
              HasSubstr("the name is reserved"));
}

TEST_F(PluginRegistryTest, RejectsAnEmptyNameOrProvider) {
  EXPECT_EQ(error_of(registry_.register_worker_selection("", stand_in_policy(kv_cost_runs_))),
            "cannot register a worker-selection policy with an empty type name");
  EXPECT_EQ(error_of(registry_.register_worker_selection("mine", nullptr)),
            "cannot register worker-selection policy type 'mine': the provider is empty");
  EXPECT_EQ(error_of(registry_.register_request_classifier("", nullptr)),
            "cannot register a request classifier with an empty type name");
}

TEST_F(PluginRegistryTest, RejectsADuplicateClassifierRegistration) {
  ASSERT_TRUE(registry_.register_request_classifier(
      "max-in-flight", stand_in_classifier(std::make_shared<std::uint32_t>())));
  EXPECT_EQ(error_of(registry_.register_request_classifier(
                "max-in-flight", stand_in_classifier(std::make_shared<std::uint32_t>()))),
            "request classifier type 'max-in-flight' is already registered; registered types: "
            "[max-in-flight]");
}

TEST_F(PluginRegistryTest, ListsRegisteredTypesSorted) {
  ASSERT_TRUE(registry_.register_worker_selection("aardvark", stand_in_policy(kv_cost_runs_)));
  EXPECT_EQ(registry_.worker_selection_types(),
            (std::vector<std::string>{"aardvark", "kv-cost", "least-busy"}));
  EXPECT_TRUE(registry_.request_classifier_types().empty());
}

TEST_F(PluginRegistryTest, AnOmittedRoleUsesTheBuiltInKvCost) {
  auto plugins = registry_.resolve_plugins(config_from(""));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  for (WorkerType role : kAllWorkerTypes) {
    EXPECT_EQ(plugins->selection_for(role).instance_name, "default");
    EXPECT_EQ(plugins->selection_for(role).type, "kv-cost");
    EXPECT_TRUE(plugins->selection_for(role).factory);
  }
  // One implicit instance shared by all four roles, without parameters.
  EXPECT_EQ(kv_cost_runs_->runs, 1);
  EXPECT_EQ(kv_cost_runs_->parameter_keys, (std::vector<std::vector<std::string>>{{}}));
  EXPECT_FALSE(plugins->request_classifier.has_value());
}

TEST_F(PluginRegistryTest, TheValueDefaultSelectsTheBuiltIn) {
  auto plugins = registry_.resolve_plugins(
      config_from("worker_selection: {aggregated: default, prefill: least-busy}"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  EXPECT_EQ(plugins->selection_for(WorkerType::Aggregated).type, "kv-cost");
  EXPECT_EQ(plugins->selection_for(WorkerType::Prefill).type, "least-busy");
}

TEST_F(PluginRegistryTest, ABuiltInThatIsNotRegisteredIsAnError) {
  RouterPluginRegistry empty;
  ASSERT_TRUE(empty.register_worker_selection("least-busy", stand_in_policy(least_busy_runs_)));
  EXPECT_EQ(
      error_of(empty.resolve_plugins(config_from("worker_selection: {aggregated: least-busy}"))),
      "built-in default (worker_selection.prefill not set): the built-in policy 'kv-cost' is "
      "not registered (register_builtin_policies was not called); types: [least-busy]");
}

TEST_F(PluginRegistryTest, ARoleNamingATypeGetsAnImplicitInstanceWithoutParameters) {
  auto plugins = registry_.resolve_plugins(
      config_from("worker_selection: {prefill: least-busy, decode: least-busy}"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  EXPECT_EQ(plugins->selection_for(WorkerType::Prefill).instance_name, "least-busy");
  EXPECT_EQ(plugins->selection_for(WorkerType::Prefill).type, "least-busy");
  EXPECT_EQ(least_busy_runs_->runs, 1);
}

TEST_F(PluginRegistryTest, EachConfiguredInstanceRunsItsProviderOnceEvenWhenSharedOrUnused) {
  auto plugins = registry_.resolve_plugins(config_from(R"(
worker_selection:
  aggregated: shared
  prefill: shared
  decode: shared
  encode: shared
  instances:
    - {name: shared, type: least-busy, parameters: {a: 1}}
    - {name: unused, type: least-busy, parameters: {b: 2}}
)"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  EXPECT_EQ(least_busy_runs_->runs, 2);
  EXPECT_EQ(least_busy_runs_->parameter_keys,
            (std::vector<std::vector<std::string>>{{"a"}, {"b"}}));
  EXPECT_EQ(kv_cost_runs_->runs, 0);
  EXPECT_EQ(plugins->selection_for(WorkerType::Encode).instance_name, "shared");
}

TEST_F(PluginRegistryTest, AnInstanceNameWinsOverATypeOfTheSameName) {
  auto plugins = registry_.resolve_plugins(config_from(R"(
worker_selection:
  aggregated: kv-cost
  instances:
    - {name: kv-cost, type: least-busy}
)"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  EXPECT_EQ(plugins->selection_for(WorkerType::Aggregated).type, "least-busy");
}

TEST_F(PluginRegistryTest, AnUnknownPolicyListsInstancesAndTypes) {
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from(R"(
worker_selection:
  prefill: lest-busy
  instances:
    - {name: least-busy, type: least-busy}
)"))),
            "router.yaml: worker_selection.prefill: unknown policy 'lest-busy'; instances: "
            "[least-busy]; types: [kv-cost, least-busy]");
}

TEST_F(PluginRegistryTest, AnUnknownPolicyFromTheEnvironmentNamesTheVariable) {
  auto config = config_from("");
  ASSERT_TRUE(selection::apply_selection_precedence(
                  config, {},
                  [](std::string_view name) -> std::optional<std::string> {
                    if (name == "KVR_ROUTER_DECODE_POLICY") return "lest-busy";
                    return std::nullopt;
                  })
                  .has_value());
  EXPECT_EQ(error_of(registry_.resolve_plugins(config)),
            "KVR_ROUTER_DECODE_POLICY: unknown policy 'lest-busy'; instances: []; types: [kv-cost, "
            "least-busy]");
}

TEST_F(PluginRegistryTest, AnUnknownInstanceTypeListsTheTypes) {
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from(R"(
worker_selection:
  instances:
    - {name: mine, type: least-bussy}
)"))),
            "router.yaml: worker_selection.instances[0].type: unknown policy type 'least-bussy' "
            "(instance 'mine'); types: [kv-cost, least-busy]");
}

TEST_F(PluginRegistryTest, AProviderErrorNamesTheInstance) {
  // The stand-in takes a, b and min_device_overlap_blocks only.
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from(R"(
worker_selection:
  instances:
    - {name: ok, type: least-busy}
    - {name: typo, type: least-busy, parameters: {min_device_overlap: 1}}
)"))),
            "router.yaml: worker_selection.instances[1] (typo): parameters: unknown parameter "
            "'min_device_overlap'; accepted: 'a', 'b', 'min_device_overlap_blocks'");
}

TEST_F(PluginRegistryTest, AProviderExceptionNamesTheInstance) {
  ASSERT_TRUE(registry_.register_worker_selection(
      "throws",
      [](const WorkerSelectionPolicyParameters&)
          -> std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
        throw std::runtime_error("boom");
      }));
  EXPECT_EQ(error_of(registry_.resolve_plugins(
                config_from("worker_selection:\n  instances:\n    - {name: bad, type: throws}\n"))),
            "router.yaml: worker_selection.instances[0] (bad): the provider threw: boom");
}

TEST_F(PluginRegistryTest, AProviderReturningNoFactoryIsAnError) {
  ASSERT_TRUE(registry_.register_worker_selection(
      "hollow",
      [](const WorkerSelectionPolicyParameters&)
          -> std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> {
        return WorkerSelectionPolicyFactory{};
      }));
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from("worker_selection: {encode: hollow}"))),
            "router.yaml: worker_selection.encode: policy type 'hollow': the provider returned no "
            "factory");
}

TEST_F(PluginRegistryTest, ResolvedFactoriesBuildPoliciesForTheirRole) {
  auto plugins = registry_.resolve_plugins(config_from("worker_selection: {prefill: least-busy}"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  const auto policy = plugins->selection_for(WorkerType::Prefill)
                          .factory(RouterConfig{}, WorkerType::Prefill, RoutingPartition{"m"});
  EXPECT_EQ(policy.worker_type(), WorkerType::Prefill);
}

TEST_F(PluginRegistryTest, ResolvesTheRequestClassifierWithItsParameters) {
  auto seen = std::make_shared<std::uint32_t>(0);
  ASSERT_TRUE(registry_.register_request_classifier("max-in-flight", stand_in_classifier(seen)));
  auto plugins = registry_.resolve_plugins(
      config_from("request_classifier: {type: max-in-flight, parameters: {max_in_flight: 32}}"));
  ASSERT_TRUE(plugins.has_value()) << plugins.error().message();
  ASSERT_TRUE(plugins->request_classifier.has_value());
  EXPECT_EQ(plugins->request_classifier->type, "max-in-flight");
  EXPECT_EQ(*seen, 32U);
  EXPECT_NE(
      plugins->request_classifier->factory(request_classifier::RequestClassifierContext{16, {}}),
      nullptr);
}

TEST_F(PluginRegistryTest, AnUnknownClassifierTypeListsTheTypes) {
  ASSERT_TRUE(registry_.register_request_classifier(
      "max-in-flight", stand_in_classifier(std::make_shared<std::uint32_t>())));
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from("request_classifier: {type: fifo}"))),
            "router.yaml: request_classifier.type: unknown request-classifier type 'fifo'; types: "
            "[max-in-flight]");
}

TEST_F(PluginRegistryTest, AClassifierProviderErrorNamesTheSection) {
  ASSERT_TRUE(registry_.register_request_classifier(
      "max-in-flight", stand_in_classifier(std::make_shared<std::uint32_t>())));
  EXPECT_EQ(error_of(registry_.resolve_plugins(config_from(
                "request_classifier: {type: max-in-flight, parameters: {max_in_flight: -3}}"))),
            "router.yaml: request_classifier (max-in-flight): parameters.max_in_flight: expected a "
            "non-negative 32-bit integer, got '-3'");
}

// A catalog written with the reference's names: its signature is a PluginCatalog's, and what it
// registers resolves.
std::expected<void, WorkerSelectionPolicyRegistryError> register_ported_catalog(
    WorkerSelectionPolicyRegistry& registry) {
  return registry.register_worker_selection("ported",
                                            stand_in_policy(std::make_shared<ProviderRuns>()));
}

TEST(PluginRegistryCompatibilityTest, ACatalogWrittenWithTheReferencesNamesRegistersAndResolves) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_ported_catalog(registry));
  EXPECT_EQ(registry.worker_selection_types(), (std::vector<std::string>{"ported"}));
  const auto again = register_ported_catalog(registry);
  ASSERT_FALSE(again);
  EXPECT_THAT(std::string{again.error().message()}, HasSubstr("ported"));
  // The roles the config leaves unset take the built-in default, stood in for here.
  ASSERT_TRUE(registry.register_worker_selection(
      "kv-cost", stand_in_policy(std::make_shared<ProviderRuns>())));
  selection::RouterPolicyConfig config;
  config.worker_selection[0] = "ported";
  const auto resolved = registry.resolve_plugins(config);
  ASSERT_TRUE(resolved) << resolved.error().message();
  EXPECT_EQ(resolved->worker_selection[0].type, "ported");
}

}  // namespace
}  // namespace kvr::plugins
