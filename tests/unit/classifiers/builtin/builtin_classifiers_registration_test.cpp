// The built-in classifiers as the node and replay get them: registered by type name with the
// built-in policies, loaded from a router-policy YAML through the real loader and registry, each
// building a working classifier, and failing startup with the section and key on bad parameters.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "selection/classifiers_registration.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/unit/classifiers/builtin/classifier_host.hpp"

namespace kvr::selection {
namespace {

using namespace std::chrono_literals;
using classifiers::builtin::testing::Admission;
using classifiers::builtin::testing::make_request;
using plugins::RouterPluginRegistry;
using plugins::RouterPlugins;
using plugins::request_classifier::RequestClassifier;
using plugins::request_classifier::RequestClassifierContext;
using plugins::request_classifier::TimePoint;
using ::testing::HasSubstr;

struct ClassifierCase {
  std::string_view type;
  std::string_view parameters;
  std::string_view bad_parameters;
  std::string_view bad_key;
};

constexpr ClassifierCase kCases[] = {
    {"kv-capacity-pause", "{pause_above: 0.9, resume_below: 0.7, max_pause_ms: 500}",
     "{pause_above: 0.5, resume_below: 0.7}", "resume_below"},
    {"length-class",
     "{buckets: [{max_input_tokens: 512, policy_class: short}], default_class: long}",
     "{buckets: [{max_input_tokens: 512, policy_class: short, quantum: 4}]}", "quantum"},
    {"max-in-flight", "{max_in_flight: 32}", "{max_in_flight: 0}", "max_in_flight"},
    {"tenant-class", "{tenants: [{tenant: heavy, policy_class: long}], default_class: short}",
     "{tenants: [{tenant: heavy, policy_class: long, quantum: 4}]}", "quantum"},
    {"token-bucket", "{rate_tokens_per_s: 1000, burst_tokens: 4000, mode: defer}",
     "{rate_tokens_per_s: 1000, burst_tokens: 4000, mode: later}", "mode"},
};

// Names the case in test output instead of its bytes.
void PrintTo(const ClassifierCase& builtin, std::ostream* out) { *out << builtin.type; }

// The classes the cases name are configured, as a classifier's classes must be.
std::string classifier_yaml(std::string_view type, std::string_view parameters) {
  return fmt::format(
      "request_classifier: {{type: {}, parameters: {}}}\n"
      "policy_classes: [{{name: short}}, {{name: long}}]\n",
      type, parameters);
}

class BuiltinClassifiersTest : public ::testing::TestWithParam<ClassifierCase> {
 protected:
  BuiltinClassifiersTest() {
    auto registered = register_builtin_policies(registry_);
    EXPECT_TRUE(registered) << registered.error().message();
  }

  std::expected<RouterPlugins, std::string> resolve(const std::string& yaml) {
    auto parsed = parse_router_policy_config(yaml, "router.yaml");
    if (!parsed) return std::unexpected(parsed.error());
    auto plugins = registry_.resolve_plugins(*parsed);
    if (!plugins) return std::unexpected(std::string{plugins.error().message()});
    return std::move(*plugins);
  }

  RouterPluginRegistry registry_;
};

TEST_P(BuiltinClassifiersTest, LoadsFromTheRouterPolicyYamlAndBuildsAClassifier) {
  const ClassifierCase& builtin = GetParam();
  auto plugins = resolve(classifier_yaml(builtin.type, builtin.parameters));
  ASSERT_TRUE(plugins) << plugins.error();
  ASSERT_TRUE(plugins->request_classifier.has_value());
  EXPECT_EQ(plugins->request_classifier->type, builtin.type);

  const std::unique_ptr<RequestClassifier> classifier =
      plugins->request_classifier->factory(RequestClassifierContext{16, {}});
  ASSERT_NE(classifier, nullptr);
  // With nothing in flight and no load report, every built-in admits a small request at once.
  auto admission =
      Admission::start(*classifier, make_request({.id = "r1", .input_tokens = 64}), TimePoint{});
  EXPECT_TRUE(admission->is_ready());
}

TEST_P(BuiltinClassifiersTest, ABadParameterStopsStartupNamingTheSectionAndKey) {
  const ClassifierCase& builtin = GetParam();
  auto plugins = resolve(classifier_yaml(builtin.type, builtin.bad_parameters));
  ASSERT_FALSE(plugins);
  EXPECT_THAT(plugins.error(),
              HasSubstr(fmt::format("router.yaml: request_classifier ({}): ", builtin.type)));
  EXPECT_THAT(plugins.error(), HasSubstr(builtin.bad_key));
}

TEST_P(BuiltinClassifiersTest, AnUnknownParameterStopsStartupNamingIt) {
  const ClassifierCase& builtin = GetParam();
  auto plugins = resolve(classifier_yaml(builtin.type, "{no_such_parameter: 1}"));
  ASSERT_FALSE(plugins);
  EXPECT_THAT(plugins.error(), HasSubstr("no_such_parameter"));
}

TEST(LengthClassStartupTest, AClassThatIsNotConfiguredStopsStartupNamingTheKey) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  auto parsed = parse_router_policy_config(
      "request_classifier: {type: length-class, parameters: {buckets: [{max_input_tokens: 512, "
      "policy_class: short}, {max_input_tokens: 4096, policy_class: shrot}]}}\n"
      "policy_classes: [{name: short}]\n",
      "router.yaml");
  ASSERT_TRUE(parsed) << parsed.error();
  auto plugins = registry.resolve_plugins(*parsed);
  ASSERT_FALSE(plugins);
  EXPECT_THAT(std::string{plugins.error().message()},
              HasSubstr("parameters.buckets[1].policy_class: unknown policy class 'shrot'; "
                        "policy_classes configures: short, default"));
}

INSTANTIATE_TEST_SUITE_P(EachType, BuiltinClassifiersTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<ClassifierCase>& param_info) {
                           std::string name{param_info.param.type};
                           std::ranges::replace(name, '-', '_');
                           return name;
                         });

TEST(BuiltinClassifiersRegistrationTest, TheBuiltinPoliciesBringExactlyTheBuiltinClassifiers) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  std::vector<std::string> expected;
  for (const ClassifierCase& builtin : kCases) expected.emplace_back(builtin.type);
  EXPECT_EQ(registry.request_classifier_types(), expected);
  const std::vector<std::string> listed{builtin_classifier_types().begin(),
                                        builtin_classifier_types().end()};
  EXPECT_EQ(listed, expected);
}

TEST(BuiltinClassifiersRegistrationTest, RegisteringTwiceFailsNamingTheType) {
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_classifiers(registry));
  auto again = register_builtin_classifiers(registry);
  ASSERT_FALSE(again);
  EXPECT_THAT(std::string{again.error().message()}, HasSubstr("kv-capacity-pause"));
}

TEST(BuiltinClassifiersRegistrationTest, TheDocumentedMaxInFlightFileLoads) {
  namespace fs = std::filesystem;
  const fs::path path =
      fs::temp_directory_path() / fmt::format("kvr-router-policy-{}.yaml", ::getpid());
  {
    std::ofstream file{path};
    file << "request_classifier: {type: max-in-flight, parameters: {max_in_flight: 32}}\n";
  }
  auto config = load_router_policy_config(path);
  fs::remove(path);
  ASSERT_TRUE(config) << config.error();
  RouterPluginRegistry registry;
  ASSERT_TRUE(register_builtin_policies(registry));
  auto plugins = registry.resolve_plugins(*config);
  ASSERT_TRUE(plugins) << plugins.error().message();
  ASSERT_TRUE(plugins->request_classifier.has_value());
  EXPECT_EQ(plugins->request_classifier->type, "max-in-flight");

  // The limit read from the file holds: 32 admitted, the 33rd deferred.
  auto classifier = plugins->request_classifier->factory(RequestClassifierContext{16, {}});
  std::vector<std::unique_ptr<Admission>> admissions;
  for (int i = 0; i < 33; ++i) {
    admissions.push_back(
        Admission::start(*classifier, make_request({.id = fmt::format("r{}", i)}), TimePoint{}));
  }
  EXPECT_EQ(std::ranges::count_if(admissions, [](const auto& a) { return a->is_ready(); }), 32);
  EXPECT_TRUE(admissions.back()->is_pending());
}

}  // namespace
}  // namespace kvr::selection
