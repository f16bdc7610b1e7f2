// The router-policy YAML as `kvr node --router-policy-config` reads it: parse, merge with (empty)
// flags and environment, resolve against the built-in policies and classifiers (each configured
// instance's parameters are read by its provider) and build every role's policy. The file comes
// from the operator rather than the network, but a typo in it must end in an error message, never
// a crash.
#include "classifiers/queue/policy_class_config.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/router_config.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

const plugins::RouterPluginRegistry& builtin_registry() {
  static const plugins::RouterPluginRegistry registry = [] {
    plugins::RouterPluginRegistry built;
    KVR_FUZZ_CHECK(selection::register_builtin_policies(built).has_value());
    return built;
  }();
  return registry;
}

}  // namespace

void router_policy_yaml(Input input) {
  auto config = selection::parse_router_policy_config(as_text(input), "fuzz.yaml");
  if (!config) {
    KVR_FUZZ_CHECK(!config.error().empty());
    return;
  }
  for (const auto& instance : config->instances) {
    KVR_FUZZ_CHECK(!instance.name.empty() && instance.name != plugins::kDefaultPolicyName);
    KVR_FUZZ_CHECK(!instance.type.empty());
  }
  for (const classifiers::PolicyClassConfig& policy_class : config->policy_classes) {
    KVR_FUZZ_CHECK(classifiers::validate_policy_class(policy_class).has_value());
  }
  const auto no_environment = [](std::string_view) { return std::optional<std::string>{}; };
  if (!selection::apply_selection_precedence(*config, {}, no_environment)) return;
  auto plugins = builtin_registry().resolve_plugins(*config);
  if (!plugins) {
    KVR_FUZZ_CHECK(!plugins.error().message().empty());
    return;
  }
  (void)classifiers::resolve_policy_classes(plugins->policy_classes,
                                            classifiers::default_policy_class());
  const plugins::worker_selection::RouterConfig router;
  for (WorkerType role : kAllWorkerTypes) {
    const auto& selection = plugins->selection_for(role);
    KVR_FUZZ_CHECK(static_cast<bool>(selection.factory));
    (void)selection.factory(router, role, {.model = "fuzz", .routing_group = "default"});
  }
}

}  // namespace kvr::fuzz
