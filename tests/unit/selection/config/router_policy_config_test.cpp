#include "selection/config/router_policy_config.hpp"

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::selection {
namespace {

using ::testing::HasSubstr;

// The router-policy YAML of PLUGIN_API.md.
constexpr std::string_view kReferenceYaml = R"(worker_selection:
  aggregated: least-busy          # also prefill, decode, encode; an omitted role uses the built-in
  instances:
    - name: least-busy
      type: least-busy
      parameters: {min_device_overlap_blocks: 0}
request_classifier:
  type: max-in-flight
  parameters: {max_in_flight: 32}
)";

std::string parse_error(std::string_view yaml) {
  auto config = parse_router_policy_config(yaml, "router.yaml");
  EXPECT_FALSE(config.has_value()) << "parsed without error";
  return config.has_value() ? std::string{} : config.error();
}

TEST(RouterPolicyConfigTest, ParsesTheReferenceExample) {
  auto config = parse_router_policy_config(kReferenceYaml, "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_EQ(config->source_name, "router.yaml");
  EXPECT_EQ(config->selection_for(WorkerType::Aggregated), "least-busy");
  EXPECT_EQ(config->source_for(WorkerType::Aggregated), SelectionSource::Yaml);
  for (WorkerType role : {WorkerType::Prefill, WorkerType::Decode, WorkerType::Encode}) {
    EXPECT_EQ(config->selection_for(role), std::nullopt);
    EXPECT_EQ(config->source_for(role), SelectionSource::BuiltIn);
  }
  ASSERT_EQ(config->instances.size(), 1U);
  EXPECT_EQ(config->instances[0].name, "least-busy");
  EXPECT_EQ(config->instances[0].type, "least-busy");
  ASSERT_NE(config->instances[0].parameters, nullptr);
  EXPECT_EQ(config->instances[0].parameters->keys(),
            (std::vector<std::string>{"min_device_overlap_blocks"}));
  ASSERT_TRUE(config->request_classifier.has_value());
  EXPECT_EQ(config->request_classifier->type, "max-in-flight");
  EXPECT_EQ(config->request_classifier->parameters->keys(),
            (std::vector<std::string>{"max_in_flight"}));
}

TEST(RouterPolicyConfigTest, ParsesEveryRole) {
  auto config = parse_router_policy_config(
      "worker_selection: {aggregated: a, prefill: b, decode: default, encode: d}", "inline");
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_EQ(config->selection_for(WorkerType::Aggregated), "a");
  EXPECT_EQ(config->selection_for(WorkerType::Prefill), "b");
  EXPECT_EQ(config->selection_for(WorkerType::Decode), "default");
  EXPECT_EQ(config->selection_for(WorkerType::Encode), "d");
}

TEST(RouterPolicyConfigTest, AnInstanceWithoutParametersGetsAnEmptyMapping) {
  auto config = parse_router_policy_config(
      "worker_selection:\n  instances:\n    - {name: x, type: kv-cost}\n", "inline");
  ASSERT_TRUE(config.has_value()) << config.error();
  ASSERT_NE(config->instances[0].parameters, nullptr);
  EXPECT_TRUE(config->instances[0].parameters->keys().empty());
}

TEST(RouterPolicyConfigTest, AnEmptyDocumentIsAnEmptyConfiguration) {
  for (std::string_view yaml : {"", "# nothing configured\n", "worker_selection:\n"}) {
    auto config = parse_router_policy_config(yaml, "router.yaml");
    ASSERT_TRUE(config.has_value()) << config.error();
    EXPECT_TRUE(config->instances.empty());
    EXPECT_FALSE(config->request_classifier.has_value());
    EXPECT_EQ(config->selection_for(WorkerType::Aggregated), std::nullopt);
  }
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownTopLevelKey) {
  EXPECT_EQ(parse_error("worker_selection: {}\nworker_selections: {}\n"),
            "router.yaml:2: worker_selections: unknown key; allowed: worker_selection, "
            "request_classifier");
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownKeyUnderWorkerSelection) {
  EXPECT_EQ(parse_error("worker_selection:\n  aggregated: x\n  fallback: y\n"),
            "router.yaml:3: worker_selection.fallback: unknown key; allowed: aggregated, prefill, "
            "decode, encode, instances");
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownRole) {
  EXPECT_EQ(parse_error("worker_selection:\n  prefil: least-busy\n"),
            "router.yaml:2: worker_selection.prefil: unknown key; allowed: aggregated, prefill, "
            "decode, encode, instances");
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownKeyInAnInstance) {
  EXPECT_EQ(parse_error("worker_selection:\n"
                        "  instances:\n"
                        "    - name: a\n"
                        "      type: least-busy\n"
                        "      paramters: {x: 1}\n"),
            "router.yaml:5: worker_selection.instances[0].paramters: unknown key; allowed: name, "
            "type, parameters");
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownKeyInTheRequestClassifier) {
  EXPECT_EQ(parse_error("request_classifier:\n  type: max-in-flight\n  max_in_flight: 3\n"),
            "router.yaml:3: request_classifier.max_in_flight: unknown key; allowed: type, "
            "parameters");
}

TEST(RouterPolicyConfigTest, RejectsADuplicateInstanceName) {
  EXPECT_EQ(parse_error("worker_selection:\n"
                        "  instances:\n"
                        "    - {name: fast, type: least-busy}\n"
                        "    - {name: fast, type: kv-cost}\n"),
            "router.yaml:4: worker_selection.instances[1].name: duplicate instance name 'fast' "
            "(also worker_selection.instances[0])");
}

TEST(RouterPolicyConfigTest, RejectsAnInstanceWithoutAType) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - name: fast\n"),
            "router.yaml:3: worker_selection.instances[0]: missing key 'type'");
}

TEST(RouterPolicyConfigTest, RejectsAnInstanceWithoutAName) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - type: kv-cost\n"),
            "router.yaml:3: worker_selection.instances[0]: missing key 'name'");
}

TEST(RouterPolicyConfigTest, RejectsARequestClassifierWithoutAType) {
  EXPECT_EQ(parse_error("request_classifier:\n  parameters: {max_in_flight: 3}\n"),
            "router.yaml:2: request_classifier: missing key 'type'");
}

TEST(RouterPolicyConfigTest, RejectsAnEmptyNameOrType) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - {name: '', type: kv-cost}\n"),
            "router.yaml:3: worker_selection.instances[0].name: an instance name must not be "
            "empty");
  EXPECT_EQ(parse_error("worker_selection:\n  aggregated: ''\n"),
            "router.yaml:2: worker_selection.aggregated: a policy: an instance name, a policy "
            "type or 'default' must not be empty");
}

TEST(RouterPolicyConfigTest, RejectsBadSyntaxNamingTheLine) {
  const std::string error = parse_error("worker_selection:\n  aggregated: [a,\n  prefill: b\n");
  EXPECT_THAT(error, HasSubstr("router.yaml:4:"));
  EXPECT_THAT(error, HasSubstr("invalid YAML"));
}

TEST(RouterPolicyConfigTest, RejectsDefaultAsAnInstanceName) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - {name: default, type: kv-cost}\n"),
            "router.yaml:3: worker_selection.instances[0].name: 'default' is reserved (it selects "
            "the built-in policy); choose another instance name");
}

TEST(RouterPolicyConfigTest, RejectsDefaultAsAType) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - {name: mine, type: default}\n"),
            "router.yaml:3: worker_selection.instances[0].type: 'default' is reserved and is not "
            "a type; use type: kv-cost to configure the built-in policy");
}

TEST(RouterPolicyConfigTest, RejectsAListAsARoleValue) {
  EXPECT_EQ(parse_error("worker_selection:\n  decode: [a, b]\n"),
            "router.yaml:2: worker_selection.decode: expected a policy: an instance name, a "
            "policy type or 'default', got a list");
}

// The loader and the parameters reader name YAML values alike: null is "null".
TEST(RouterPolicyConfigTest, RejectsANullRoleValue) {
  EXPECT_EQ(parse_error("worker_selection:\n  decode: null\n"),
            "router.yaml:2: worker_selection.decode: expected a policy: an instance name, a "
            "policy type or 'default', got null");
}

TEST(RouterPolicyConfigTest, RejectsInstancesThatAreNotAList) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances: {name: a, type: b}\n"),
            "router.yaml:2: worker_selection.instances: expected a list of instances, got a "
            "mapping");
}

TEST(RouterPolicyConfigTest, RejectsAnInstanceThatIsNotAMapping) {
  EXPECT_EQ(parse_error("worker_selection:\n  instances:\n    - least-busy\n"),
            "router.yaml:3: worker_selection.instances[0]: expected a mapping with the keys name, "
            "type, parameters, got 'least-busy'");
}

TEST(RouterPolicyConfigTest, RejectsParametersThatAreNotAMapping) {
  EXPECT_EQ(parse_error("worker_selection:\n"
                        "  instances:\n"
                        "    - name: a\n"
                        "      type: b\n"
                        "      parameters: 5\n"),
            "router.yaml:5: worker_selection.instances[0].parameters: expected a mapping, got '5'");
}

TEST(RouterPolicyConfigTest, RejectsADuplicateParameter) {
  EXPECT_EQ(parse_error("request_classifier:\n  type: t\n  parameters: {a: 1, a: 2}\n"),
            "router.yaml:3: request_classifier.parameters: parameters.a: duplicate key");
}

TEST(RouterPolicyConfigTest, RejectsATopLevelList) {
  EXPECT_EQ(parse_error("- worker_selection\n"),
            "router.yaml:1: expected a mapping with the keys worker_selection, "
            "request_classifier, got a list");
}

TEST(RouterPolicyConfigTest, RejectsADuplicateKey) {
  EXPECT_EQ(parse_error("worker_selection:\n  aggregated: a\n  aggregated: b\n"),
            "router.yaml:3: worker_selection.aggregated: duplicate key");
}

TEST(RouterPolicyConfigTest, RejectsSeveralDocuments) {
  EXPECT_EQ(parse_error("worker_selection: {}\n---\nworker_selection: {}\n"),
            "router.yaml: expected one YAML document, found 2");
}

class RouterPolicyConfigFileTest : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove_all(directory_); }

  std::filesystem::path write(std::string_view text) {
    std::filesystem::create_directories(directory_);
    const auto path = directory_ / "router.yaml";
    std::ofstream{path} << text;
    return path;
  }

  std::filesystem::path directory_ =
      std::filesystem::temp_directory_path() /
      ("kvr_router_policy_config_test_" +
       std::string{::testing::UnitTest::GetInstance()->current_test_info()->name()});
};

TEST_F(RouterPolicyConfigFileTest, LoadsAFileAndNamesItInErrors) {
  const auto path = write(kReferenceYaml);
  auto config = load_router_policy_config(path);
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_EQ(config->source_name, path.string());

  const auto bad = write("worker_selection:\n  prefil: x\n");
  auto error = load_router_policy_config(bad);
  ASSERT_FALSE(error.has_value());
  EXPECT_THAT(error.error(), HasSubstr(bad.string() + ":2: worker_selection.prefil"));
}

TEST_F(RouterPolicyConfigFileTest, AMissingFileIsAnErrorNamingThePath) {
  const auto path = directory_ / "missing.yaml";
  auto config = load_router_policy_config(path);
  ASSERT_FALSE(config.has_value());
  EXPECT_THAT(config.error(), HasSubstr(path.string() + ": cannot open the router-policy config"));
}

}  // namespace
}  // namespace kvr::selection
