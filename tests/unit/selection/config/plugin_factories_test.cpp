// Running a resolved bundle's factories: the built-in default for a role without a factory, and
// the check `kvr node --check-config` makes of every factory, whose failure names the model, the
// role or classifier and the plugin.
#include "selection/config/plugin_factories.hpp"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/selection/config/stand_in_plugins.hpp"

namespace kvr::selection {
namespace {

namespace rc = plugins::request_classifier;
using plugins::RouterPlugins;
using plugins::worker_selection::RouterConfig;
using plugins::worker_selection::RoutingPartition;
using plugins::worker_selection::WorkerSelectionPolicy;
using ::testing::HasSubstr;

// A factory of a one-picker policy, counting its calls in `calls`.
plugins::worker_selection::WorkerSelectionPolicyFactory counting_factory(
    std::shared_ptr<int> calls) {
  return [calls](const RouterConfig& config, WorkerType role, const RoutingPartition&) {
    ++*calls;
    return WorkerSelectionPolicy(config, role, {},
                                 std::make_unique<testing::FirstCandidatePicker>());
  };
}

// Every role served by `counting_factory`, as instance `steady` of type `steady-type`.
RouterPlugins steady_bundle(const std::shared_ptr<int>& calls) {
  RouterPlugins plugins;
  for (auto& selection : plugins.worker_selection) {
    selection = RouterPlugins::WorkerSelection{"steady", "steady-type", counting_factory(calls)};
  }
  return plugins;
}

TEST(PluginFactoriesTest, AnEmptyBundleSelectsTheBuiltInDefaultForEveryRole) {
  const RouterPlugins empty;
  for (const WorkerType role : kAllWorkerTypes) {
    const RouterPlugins::WorkerSelection& selection = selection_or_builtin(empty, role);
    EXPECT_EQ(selection.instance_name, plugins::kDefaultPolicyName) << as_str(role);
    EXPECT_EQ(selection.type, plugins::kBuiltinDefaultPolicyType) << as_str(role);
    const auto built = build_policy(selection, RouterConfig{}, role, RoutingPartition{"llama"});
    ASSERT_TRUE(built) << built.error();
    EXPECT_EQ(built->worker_type(), role);
  }
}

TEST(PluginFactoriesTest, ABundlesOwnFactoryIsKeptOverTheBuiltIn) {
  const auto calls = std::make_shared<int>(0);
  const RouterPlugins plugins = steady_bundle(calls);
  const RouterPlugins::WorkerSelection& selection =
      selection_or_builtin(plugins, WorkerType::Decode);
  EXPECT_EQ(selection.instance_name, "steady");
  ASSERT_TRUE(build_policy(selection, RouterConfig{}, WorkerType::Decode, RoutingPartition{"m"}));
  EXPECT_EQ(*calls, 1);
}

TEST(PluginFactoriesTest, CheckBuildsEveryRoleAndTheClassifierOncePerModel) {
  const auto calls = std::make_shared<int>(0);
  RouterPlugins plugins = steady_bundle(calls);
  std::vector<std::size_t> block_sizes;
  plugins.request_classifier = RouterPlugins::RequestClassifier{
      "admit-all", [&block_sizes](const rc::RequestClassifierContext& context) {
        block_sizes.push_back(context.block_size());
        return std::make_unique<rc::RequestClassifier>();
      }};
  RouterConfig router;
  router.block_size = 32;
  const std::vector<std::string> models{"llama", "mistral"};
  const auto checked = check_plugin_factories(plugins, router, models);
  ASSERT_TRUE(checked) << checked.error();
  EXPECT_EQ(*calls, 8) << "four roles, two models";
  EXPECT_EQ(block_sizes, (std::vector<std::size_t>{32, 32}));
}

TEST(PluginFactoriesTest, CheckReportsAThrowingPolicyFactoryNamingModelRoleAndPlugin) {
  const auto calls = std::make_shared<int>(0);
  RouterPlugins plugins = steady_bundle(calls);
  plugins.worker_selection[static_cast<std::size_t>(WorkerType::Decode)] =
      RouterPlugins::WorkerSelection{
          "fragile", "fragile-type",
          [](const RouterConfig&, WorkerType, const RoutingPartition&) -> WorkerSelectionPolicy {
            throw std::runtime_error("no GPU budget for decode");
          }};
  const std::vector<std::string> models{"llama"};
  const auto checked = check_plugin_factories(plugins, RouterConfig{}, models);
  ASSERT_FALSE(checked);
  EXPECT_EQ(checked.error(),
            "policy 'fragile' (type fragile-type) for decode requests of model 'llama' group "
            "'default' could not be built: its factory threw: no GPU budget for decode");
}

TEST(PluginFactoriesTest, CheckReportsAPolicyForAnotherRole) {
  RouterPlugins plugins = steady_bundle(std::make_shared<int>(0));
  plugins.worker_selection[static_cast<std::size_t>(WorkerType::Prefill)] =
      RouterPlugins::WorkerSelection{
          "confused", "confused-type",
          [](const RouterConfig& config, WorkerType, const RoutingPartition&) {
            return WorkerSelectionPolicy(config, WorkerType::Aggregated, {},
                                         std::make_unique<testing::FirstCandidatePicker>());
          }};
  const std::vector<std::string> models{"llama"};
  const auto checked = check_plugin_factories(plugins, RouterConfig{}, models);
  ASSERT_FALSE(checked);
  EXPECT_THAT(checked.error(), HasSubstr("policy 'confused' (type confused-type) for prefill"));
  EXPECT_THAT(checked.error(), HasSubstr("returned a policy for aggregated requests"));
}

TEST(PluginFactoriesTest, CheckReportsAClassifierFactoryThatFailsNamingModelAndType) {
  RouterPlugins plugins = steady_bundle(std::make_shared<int>(0));
  plugins.request_classifier = RouterPlugins::RequestClassifier{
      "picky", [](const rc::RequestClassifierContext&) -> std::unique_ptr<rc::RequestClassifier> {
        throw std::runtime_error("no admission budget configured");
      }};
  const std::vector<std::string> models{"llama"};
  const auto thrown = check_plugin_factories(plugins, RouterConfig{}, models);
  ASSERT_FALSE(thrown);
  EXPECT_EQ(thrown.error(),
            "the request classifier 'picky' of model 'llama' could not be built: its factory "
            "threw: no admission budget configured");

  plugins.request_classifier->factory =
      [](const rc::RequestClassifierContext&) -> std::unique_ptr<rc::RequestClassifier> {
    return nullptr;
  };
  const auto nothing = check_plugin_factories(plugins, RouterConfig{}, models);
  ASSERT_FALSE(nothing);
  EXPECT_THAT(nothing.error(), HasSubstr("its factory returned no classifier"));
}

}  // namespace
}  // namespace kvr::selection
