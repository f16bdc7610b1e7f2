#include "selection/config/selection_precedence.hpp"

#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::selection {
namespace {

// A fake environment; the test never touches the process's own.
class FakeEnvironment {
 public:
  FakeEnvironment& set(std::string name, std::string value) {
    values_[std::move(name)] = std::move(value);
    return *this;
  }
  EnvironmentLookup lookup() const {
    return [this](std::string_view name) -> std::optional<std::string> {
      const auto found = values_.find(name);
      if (found == values_.end()) return std::nullopt;
      return found->second;
    };
  }

 private:
  std::map<std::string, std::string, std::less<>> values_;
};

RouterPolicyConfig yaml_config(std::string_view yaml) {
  auto config = parse_router_policy_config(yaml, "router.yaml");
  EXPECT_TRUE(config.has_value()) << config.error();
  return config.value_or(RouterPolicyConfig{});
}

SelectionOverrides cli(WorkerType role, std::string value) {
  SelectionOverrides overrides;
  overrides.cli[static_cast<std::size_t>(role)] = std::move(value);
  return overrides;
}

constexpr std::string_view kPrefillYaml = "worker_selection: {prefill: from-yaml}";

TEST(SelectionPrecedenceTest, WithoutAnyValueTheRoleUsesTheBuiltIn) {
  RouterPolicyConfig config;
  ASSERT_TRUE(apply_selection_precedence(config, {}, FakeEnvironment{}.lookup()).has_value());
  for (WorkerType role : kAllWorkerTypes) {
    EXPECT_EQ(config.selection_for(role), std::nullopt);
    EXPECT_EQ(config.source_for(role), SelectionSource::BuiltIn);
  }
}

TEST(SelectionPrecedenceTest, YamlBeatsTheBuiltIn) {
  auto config = yaml_config(kPrefillYaml);
  ASSERT_TRUE(apply_selection_precedence(config, {}, FakeEnvironment{}.lookup()).has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Prefill), "from-yaml");
  EXPECT_EQ(config.source_for(WorkerType::Prefill), SelectionSource::Yaml);
  EXPECT_EQ(config.source_for(WorkerType::Decode), SelectionSource::BuiltIn);
}

TEST(SelectionPrecedenceTest, TheGlobalVariableBeatsYamlForEveryRole) {
  auto config = yaml_config(kPrefillYaml);
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "from-global");
  ASSERT_TRUE(apply_selection_precedence(config, {}, environment.lookup()).has_value());
  for (WorkerType role : kAllWorkerTypes) {
    EXPECT_EQ(config.selection_for(role), "from-global");
    EXPECT_EQ(config.source_for(role), SelectionSource::GlobalEnv);
  }
}

TEST(SelectionPrecedenceTest, TheRoleVariableBeatsTheGlobalVariableForItsRoleOnly) {
  auto config = yaml_config(kPrefillYaml);
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "from-global")
      .set("KVR_ROUTER_PREFILL_POLICY", "from-role-env");
  ASSERT_TRUE(apply_selection_precedence(config, {}, environment.lookup()).has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Prefill), "from-role-env");
  EXPECT_EQ(config.source_for(WorkerType::Prefill), SelectionSource::RoleEnv);
  EXPECT_EQ(config.selection_for(WorkerType::Decode), "from-global");
}

TEST(SelectionPrecedenceTest, TheFlagBeatsTheRoleVariable) {
  auto config = yaml_config(kPrefillYaml);
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "from-global")
      .set("KVR_ROUTER_PREFILL_POLICY", "from-role-env");
  ASSERT_TRUE(apply_selection_precedence(config, cli(WorkerType::Prefill, "from-flag"),
                                         environment.lookup())
                  .has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Prefill), "from-flag");
  EXPECT_EQ(config.source_for(WorkerType::Prefill), SelectionSource::CommandLine);
}

TEST(SelectionPrecedenceTest, OnlyPrefillAndDecodeHaveAFlagAndVariableOfTheirOwn) {
  EXPECT_TRUE(role_has_own_selection_override(WorkerType::Prefill));
  EXPECT_TRUE(role_has_own_selection_override(WorkerType::Decode));
  EXPECT_FALSE(role_has_own_selection_override(WorkerType::Aggregated));
  EXPECT_FALSE(role_has_own_selection_override(WorkerType::Encode));
  auto config = yaml_config(kPrefillYaml);
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_PREFILL_POLICY", "p").set("KVR_ROUTER_DECODE_POLICY", "d");
  auto notices = apply_selection_precedence(config, {}, environment.lookup());
  ASSERT_TRUE(notices);
  EXPECT_TRUE(notices->empty()) << "prefill's and decode's own spellings are not deprecated";
}

TEST(SelectionPrecedenceTest, AggregatedAndEncodeAliasesStillApplyAndAreEachNoticedOnce) {
  auto config = yaml_config("worker_selection: {aggregated: from-yaml, encode: from-yaml}");
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "from-global")
      .set("KVR_ROUTER_ENCODE_POLICY", "from-alias-env");
  auto notices = apply_selection_precedence(config, cli(WorkerType::Aggregated, "from-alias-flag"),
                                            environment.lookup());
  ASSERT_TRUE(notices);
  // The aliases keep their old rank, above the global variable and the YAML.
  EXPECT_EQ(config.selection_for(WorkerType::Aggregated), "from-alias-flag");
  EXPECT_EQ(config.selection_for(WorkerType::Encode), "from-alias-env");
  ASSERT_EQ(notices->size(), 2U);
  EXPECT_THAT((*notices)[0], ::testing::AllOf(::testing::HasSubstr("--router-aggregated-policy is "
                                                                   "deprecated"),
                                              ::testing::HasSubstr("worker_selection.aggregated")));
  EXPECT_THAT((*notices)[1],
              ::testing::AllOf(::testing::HasSubstr("KVR_ROUTER_ENCODE_POLICY is deprecated"),
                               ::testing::HasSubstr("KVR_ROUTER_WORKER_SELECTION_POLICY")));
  // Without them, the two roles take the global variable, then the YAML.
  auto plain = yaml_config("worker_selection: {aggregated: from-yaml}");
  FakeEnvironment global;
  global.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "from-global");
  ASSERT_TRUE(apply_selection_precedence(plain, {}, global.lookup()));
  EXPECT_EQ(plain.selection_for(WorkerType::Aggregated), "from-global");
  EXPECT_EQ(plain.source_for(WorkerType::Encode), SelectionSource::GlobalEnv);
}

TEST(SelectionPrecedenceTest, DefaultFromTheFlagBeatsYaml) {
  auto config = yaml_config(kPrefillYaml);
  ASSERT_TRUE(apply_selection_precedence(config, cli(WorkerType::Prefill, "default"),
                                         FakeEnvironment{}.lookup())
                  .has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Prefill), "default");
  EXPECT_EQ(config.source_for(WorkerType::Prefill), SelectionSource::CommandLine);
}

TEST(SelectionPrecedenceTest, DefaultFromTheRoleVariableBeatsTheGlobalVariable) {
  RouterPolicyConfig config;
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "least-busy")
      .set("KVR_ROUTER_DECODE_POLICY", "default");
  ASSERT_TRUE(apply_selection_precedence(config, {}, environment.lookup()).has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Decode), "default");
  EXPECT_EQ(config.selection_for(WorkerType::Encode), "least-busy");
}

TEST(SelectionPrecedenceTest, AnEmptyVariableCountsAsUnset) {
  auto config = yaml_config(kPrefillYaml);
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "").set("KVR_ROUTER_PREFILL_POLICY", "");
  ASSERT_TRUE(apply_selection_precedence(config, {}, environment.lookup()).has_value());
  EXPECT_EQ(config.selection_for(WorkerType::Prefill), "from-yaml");
  EXPECT_EQ(config.source_for(WorkerType::Prefill), SelectionSource::Yaml);
}

TEST(SelectionPrecedenceTest, AnEmptyFlagIsAnErrorNamingTheFlag) {
  RouterPolicyConfig config;
  auto applied =
      apply_selection_precedence(config, cli(WorkerType::Encode, ""), FakeEnvironment{}.lookup());
  ASSERT_FALSE(applied.has_value());
  EXPECT_EQ(applied.error(),
            "--router-encode-policy: the value must not be empty (use 'default' for the built-in "
            "policy)");
}

TEST(SelectionPrecedenceTest, NamesTheFlagAndVariableOfEachRole) {
  EXPECT_EQ(role_selection_flag(WorkerType::Aggregated), "--router-aggregated-policy");
  EXPECT_EQ(role_selection_flag(WorkerType::Prefill), "--router-prefill-policy");
  EXPECT_EQ(role_selection_flag(WorkerType::Decode), "--router-decode-policy");
  EXPECT_EQ(role_selection_flag(WorkerType::Encode), "--router-encode-policy");
  EXPECT_EQ(role_selection_env_var(WorkerType::Aggregated), "KVR_ROUTER_AGGREGATED_POLICY");
  EXPECT_EQ(role_selection_env_var(WorkerType::Prefill), "KVR_ROUTER_PREFILL_POLICY");
  EXPECT_EQ(role_selection_env_var(WorkerType::Decode), "KVR_ROUTER_DECODE_POLICY");
  EXPECT_EQ(role_selection_env_var(WorkerType::Encode), "KVR_ROUTER_ENCODE_POLICY");
}

TEST(SelectionPrecedenceTest, DescribesWhereEachValueCameFrom) {
  RouterPolicyConfig config;
  FakeEnvironment environment;
  environment.set("KVR_ROUTER_WORKER_SELECTION_POLICY", "g").set("KVR_ROUTER_DECODE_POLICY", "d");
  ASSERT_TRUE(apply_selection_precedence(config, cli(WorkerType::Encode, "e"), environment.lookup())
                  .has_value());
  EXPECT_EQ(selection_origin(config, WorkerType::Aggregated),
            "KVR_ROUTER_WORKER_SELECTION_POLICY (for aggregated)");
  EXPECT_EQ(selection_origin(config, WorkerType::Decode), "KVR_ROUTER_DECODE_POLICY");
  EXPECT_EQ(selection_origin(config, WorkerType::Encode), "--router-encode-policy");

  auto from_yaml = yaml_config("worker_selection: {prefill: b}");
  ASSERT_TRUE(apply_selection_precedence(from_yaml, {}, FakeEnvironment{}.lookup()).has_value());
  EXPECT_EQ(selection_origin(from_yaml, WorkerType::Prefill),
            "router.yaml: worker_selection.prefill");
  EXPECT_EQ(selection_origin(from_yaml, WorkerType::Decode),
            "built-in default (worker_selection.decode not set)");
}

}  // namespace
}  // namespace kvr::selection
