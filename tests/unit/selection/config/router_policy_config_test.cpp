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

// The router-policy YAML of the reference (docs/policies.md).
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
            "request_classifier, policy_classes, worker_health, models, tokenizers, plugins");
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
            "request_classifier, policy_classes, worker_health, models, tokenizers, plugins, got a "
            "list");
}

TEST(RouterPolicyConfigTest, RejectsADuplicateKey) {
  EXPECT_EQ(parse_error("worker_selection:\n  aggregated: a\n  aggregated: b\n"),
            "router.yaml:3: worker_selection.aggregated: duplicate key");
}

TEST(RouterPolicyConfigTest, RejectsSeveralDocuments) {
  EXPECT_EQ(parse_error("worker_selection: {}\n---\nworker_selection: {}\n"),
            "router.yaml: expected one YAML document, found 2");
}

TEST(RouterPolicyConfigTest, CountsEveryDocument) {
  EXPECT_EQ(parse_error("a: 1\n---\nb: 2\n---\nc: 3\n"),
            "router.yaml: expected one YAML document, found 3");
}

// yaml-cpp 0.7 stops consuming this input and reports empty documents without end; collecting
// them (YAML::LoadAll) ran out of memory (found by tests/fuzz, corpus regression_parser_stall).
TEST(RouterPolicyConfigTest, RejectsInputTheYamlParserCannotReadPast) {
  EXPECT_EQ(parse_error(",orker_selection:\n  instsac:ne\n    - n}\n"),
            "router.yaml:1:1: invalid YAML: cannot read past this point");
}

constexpr std::string_view kPolicyClassesYaml = R"(policy_classes:
  - name: interactive
    quantum: 512
    order: wspt
    prefill_busy_threshold: 8192
    prefill_busy_threshold_frac: 0.75
    kv_busy_threshold: 0.9
    request_queue_limit_per_worker: 64
    uncached_token_queue_limit_per_worker: 131072
  - name: batch
    quantum: 128
)";

TEST(RouterPolicyConfigTest, ParsesEachModelsTokenizerMode) {
  auto config = parse_router_policy_config(R"(models:
  llama-3.1-8b: {tokenizer_mode: estimate}
  "org/qwen:7b":
    tokenizer_mode: engine
    content_special_tokens: text
  plain:
)",
                                           "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  ASSERT_EQ(config->models.size(), 3U);
  EXPECT_EQ(config->models.at("llama-3.1-8b").tokenizer_mode, TokenizerMode::estimate);
  EXPECT_EQ(config->models.at("org/qwen:7b").tokenizer_mode, TokenizerMode::engine);
  EXPECT_FALSE(config->models.at("plain").tokenizer_mode.has_value());
  EXPECT_TRUE(config->models.at("org/qwen:7b").content_special_tokens_as_text);
  EXPECT_FALSE(config->models.at("plain").content_special_tokens_as_text);

  // The CLI's default applies to every model the YAML leaves unset.
  const TokenizerModes modes = tokenizer_modes(TokenizerMode::engine, config->models);
  EXPECT_EQ(modes.for_model("llama-3.1-8b"), TokenizerMode::estimate);
  EXPECT_EQ(modes.for_model("plain"), TokenizerMode::engine);
  EXPECT_EQ(modes.for_model("unlisted"), TokenizerMode::engine);
  EXPECT_TRUE(modes.uses(TokenizerMode::estimate));
  EXPECT_FALSE(tokenizer_modes(TokenizerMode::engine, {}).uses(TokenizerMode::estimate));
}

TEST(RouterPolicyConfigTest, RejectsABadModelsSectionNamingTheKey) {
  EXPECT_EQ(parse_error("models:\n  llama: {tokenizer_mode: turbo}\n"),
            "router.yaml:2: models.llama.tokenizer_mode: 'turbo' is not a tokenizer mode; one "
            "of: engine, estimate, native");
  EXPECT_EQ(parse_error("models:\n  llama: {tokenizer: estimate}\n"),
            "router.yaml:2: models.llama.tokenizer: unknown key; allowed: tokenizer_mode, "
            "disaggregation, content_special_tokens");
  EXPECT_EQ(parse_error("models:\n  llama: estimate\n"),
            "router.yaml:2: models.llama: expected a mapping with the keys tokenizer_mode, "
            "disaggregation, content_special_tokens, got 'estimate'");
  EXPECT_EQ(parse_error("models:\n  llama: {content_special_tokens: plain}\n"),
            "router.yaml:2: models.llama.content_special_tokens: 'plain' is not one of: special, "
            "text");
  EXPECT_EQ(parse_error("models:\n  llama: {}\n  llama: {}\n"),
            "router.yaml:3: models.llama: duplicate model");
  EXPECT_THAT(parse_error("models: [llama]\n"),
              HasSubstr("models: expected a mapping from model names to their settings"));
}

TEST(RouterPolicyConfigTest, ParsesTokenizersRelativeToTheFile) {
  auto config = parse_router_policy_config(
      "models:\n  qwen: {tokenizer_mode: native}\ntokenizers:\n  qwen: tokenizers/qwen3\n"
      "  llama: /models/llama\n",
      "/etc/kvr/router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_EQ(config->models.at("qwen").tokenizer_mode, TokenizerMode::native);
  EXPECT_EQ(config->tokenizers.at("qwen"), "/etc/kvr/tokenizers/qwen3");
  EXPECT_EQ(config->tokenizers.at("llama"), "/models/llama");
}

TEST(RouterPolicyConfigTest, ListsPluginsInOrderRelativeToTheFile) {
  auto config = parse_router_policy_config("plugins: [lib/libmine.so, /opt/kvr/libtheirs.so]\n",
                                           "/etc/kvr/router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_EQ(config->plugins,
            (std::vector<std::string>{"/etc/kvr/lib/libmine.so", "/opt/kvr/libtheirs.so"}));
}

TEST(RouterPolicyConfigTest, RejectsABadPluginsListNamingTheEntry) {
  EXPECT_THAT(parse_error("plugins: libmine.so\n"),
              HasSubstr("plugins: expected a list of plugin library paths, got"));
  EXPECT_THAT(parse_error("plugins: [libmine.so, {path: x}]\n"),
              HasSubstr("plugins[1]: expected the path of a plugin library, got"));
  EXPECT_THAT(parse_error("plugins: [\"\"]\n"),
              HasSubstr("plugins[0]: expected the path of a plugin library"));
}

TEST(RouterPolicyConfigTest, RejectsABadTokenizersSectionNamingTheKey) {
  EXPECT_THAT(parse_error("tokenizers: [qwen]\n"),
              HasSubstr("tokenizers: expected a mapping from model names to tokenizer paths"));
  EXPECT_THAT(parse_error("tokenizers:\n  qwen: [a, b]\n"),
              HasSubstr("router.yaml:2: tokenizers.qwen: expected the path of a tokenizer"));
  EXPECT_EQ(parse_error("tokenizers:\n  qwen: a\n  qwen: b\n"),
            "router.yaml:3: tokenizers.qwen: duplicate model");
}

TEST(RouterPolicyConfigTest, ParsesPolicyClasses) {
  auto config = parse_router_policy_config(kPolicyClassesYaml, "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  ASSERT_EQ(config->policy_classes.size(), 2U);
  const classifiers::PolicyClassConfig& interactive = config->policy_classes[0];
  EXPECT_EQ(interactive.name, "interactive");
  EXPECT_EQ(interactive.quantum, 512U);
  EXPECT_EQ(interactive.order, classifiers::QueueOrder::Wspt);
  EXPECT_EQ(interactive.prefill_busy_threshold, 8192U);
  EXPECT_EQ(interactive.prefill_busy_threshold_frac, 0.75);
  EXPECT_EQ(interactive.kv_busy_threshold, 0.9);
  EXPECT_EQ(interactive.request_queue_limit_per_worker, 64U);
  EXPECT_EQ(interactive.uncached_token_queue_limit_per_worker, 131072U);
  const classifiers::PolicyClassConfig& batch = config->policy_classes[1];
  EXPECT_EQ(batch.name, "batch");
  EXPECT_EQ(batch.quantum, 128U);
  EXPECT_EQ(batch.order, classifiers::QueueOrder::Fcfs);
  EXPECT_EQ(batch.prefill_busy_threshold, std::nullopt);
  EXPECT_EQ(batch.prefill_busy_threshold_frac, std::nullopt);
  EXPECT_EQ(batch.request_queue_limit_per_worker, std::nullopt);
  EXPECT_EQ(batch.uncached_token_queue_limit_per_worker, std::nullopt);
}

TEST(RouterPolicyConfigTest, WithoutPolicyClassesOnlyTheDefaultClassIsKnown) {
  for (std::string_view yaml : {"", "policy_classes:\n", "policy_classes: []\n"}) {
    auto config = parse_router_policy_config(yaml, "router.yaml");
    ASSERT_TRUE(config.has_value()) << config.error();
    EXPECT_TRUE(config->policy_classes.empty());
    EXPECT_TRUE(config->has_policy_class("default"));
    EXPECT_FALSE(config->has_policy_class("interactive"));
  }
}

TEST(RouterPolicyConfigTest, KnowsTheConfiguredPolicyClassesAndDefault) {
  auto config = parse_router_policy_config(kPolicyClassesYaml, "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  EXPECT_TRUE(config->has_policy_class("interactive"));
  EXPECT_TRUE(config->has_policy_class("batch"));
  EXPECT_TRUE(config->has_policy_class("default"));
  EXPECT_FALSE(config->has_policy_class("Batch"));
  EXPECT_TRUE(
      config->check_policy_class("batch", "request_classifier.parameters.class").has_value());
  auto unknown = config->check_policy_class("bulk", "request_classifier.parameters.class");
  ASSERT_FALSE(unknown.has_value());
  EXPECT_EQ(unknown.error(),
            "router.yaml: request_classifier.parameters.class: unknown policy class 'bulk'; known: "
            "interactive, batch, default");
}

TEST(RouterPolicyConfigTest, CheckPolicyClassSaysWhenNoneAreConfigured) {
  auto config = parse_router_policy_config("", "router.yaml");
  ASSERT_TRUE(config.has_value()) << config.error();
  auto unknown = config->check_policy_class("short", "");
  ASSERT_FALSE(unknown.has_value());
  EXPECT_EQ(unknown.error(),
            "router.yaml: unknown policy class 'short'; no policy_classes are configured, so the "
            "only class is default");
}

TEST(RouterPolicyConfigTest, AcceptsAConfiguredDefaultClass) {
  auto config =
      parse_router_policy_config("policy_classes:\n  - {name: default, quantum: 64}\n", "inline");
  ASSERT_TRUE(config.has_value()) << config.error();
  ASSERT_EQ(config->policy_classes.size(), 1U);
  EXPECT_EQ(config->policy_classes[0].quantum, 64U);
}

TEST(RouterPolicyConfigTest, RejectsAnUnknownKeyInAPolicyClass) {
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantun: 5\n"),
            "router.yaml:3: policy_classes[0].quantun: unknown key; allowed: name, quantum, order, "
            "prefill_busy_threshold, prefill_busy_threshold_frac, kv_busy_threshold, "
            "request_queue_limit_per_worker, uncached_token_queue_limit_per_worker");
}

TEST(RouterPolicyConfigTest, RejectsADuplicatePolicyClassName) {
  EXPECT_EQ(parse_error("policy_classes:\n  - {name: a}\n  - {name: b}\n  - {name: a}\n"),
            "router.yaml:4: policy_classes[2].name: duplicate policy class name 'a' (also "
            "policy_classes[0])");
}

TEST(RouterPolicyConfigTest, RejectsAPolicyClassWithoutAName) {
  EXPECT_EQ(parse_error("policy_classes:\n  - quantum: 5\n"),
            "router.yaml:2: policy_classes[0]: missing key 'name'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: ''\n"),
            "router.yaml:2: policy_classes[0].name: a policy class name must not be empty");
}

TEST(RouterPolicyConfigTest, RejectsABadOrder) {
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    order: sjf\n"),
            "router.yaml:3: policy_classes[0].order: expected fcfs or wspt, got 'sjf'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    order: [fcfs]\n"),
            "router.yaml:3: policy_classes[0].order: expected a queue order: fcfs or wspt, got a "
            "list");
}

TEST(RouterPolicyConfigTest, RejectsBadNumbersInAPolicyClass) {
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantum: 0\n"),
            "router.yaml:3: policy_classes[0].quantum: must be greater than 0");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantum: -5\n"),
            "router.yaml:3: policy_classes[0].quantum: expected a non-negative 64-bit integer, got "
            "'-5'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantum: 1.5\n"),
            "router.yaml:3: policy_classes[0].quantum: expected a non-negative 64-bit integer, got "
            "'1.5'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantum: \"512\"\n"),
            "router.yaml:3: policy_classes[0].quantum: expected a non-negative 64-bit integer, got "
            "\"512\" (quoted, so a string)");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    prefill_busy_threshold: lots\n"),
            "router.yaml:3: policy_classes[0].prefill_busy_threshold: expected a non-negative "
            "64-bit integer, got 'lots'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    prefill_busy_threshold_frac: 1.5\n"),
            "router.yaml:3: policy_classes[0].prefill_busy_threshold_frac: must be a fraction in "
            "(0, 1] of the worker's max batched tokens, got 1.5");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    prefill_busy_threshold_frac: 0\n"),
            "router.yaml:3: policy_classes[0].prefill_busy_threshold_frac: must be a fraction in "
            "(0, 1] of the worker's max batched tokens, got 0");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    prefill_busy_threshold_frac: .nan\n"),
            "router.yaml:3: policy_classes[0].prefill_busy_threshold_frac: expected a finite "
            "number, got '.nan'");
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    request_queue_limit_per_worker: 0\n"),
            "router.yaml:3: policy_classes[0].request_queue_limit_per_worker: must be greater "
            "than 0 (omit the key for no limit)");
  EXPECT_EQ(
      parse_error("policy_classes:\n  - name: a\n    uncached_token_queue_limit_per_worker: 0\n"),
      "router.yaml:3: policy_classes[0].uncached_token_queue_limit_per_worker: must be greater "
      "than 0 (omit the key for no limit)");
}

TEST(RouterPolicyConfigTest, RejectsPolicyClassesThatAreNotAListOfMappings) {
  EXPECT_EQ(parse_error("policy_classes: {name: a}\n"),
            "router.yaml:1: policy_classes: expected a list of policy classes, got a mapping");
  EXPECT_EQ(parse_error("policy_classes:\n  - interactive\n"),
            "router.yaml:2: policy_classes[0]: expected a mapping with the keys name, quantum, "
            "order, prefill_busy_threshold, prefill_busy_threshold_frac, kv_busy_threshold, "
            "request_queue_limit_per_worker, uncached_token_queue_limit_per_worker, got "
            "'interactive'");
}

TEST(RouterPolicyConfigTest, RejectsADuplicateKeyInAPolicyClass) {
  EXPECT_EQ(parse_error("policy_classes:\n  - name: a\n    quantum: 1\n    quantum: 2\n"),
            "router.yaml:4: policy_classes[0].quantum: duplicate key");
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
