#include "selection/config/plugin_factories.hpp"

#include <exception>
#include <utility>

#include <fmt/format.h>

#include "classifiers/plugin_parameters.hpp"
#include "messages/check.hpp"
#include "selection/policies/kv_cost/kv_cost_policy.hpp"

namespace kvr::selection {
namespace {

namespace rc = plugins::request_classifier;
using plugins::RouterPlugins;
using plugins::worker_selection::WorkerSelectionPolicyParameters;

// Made once, on first use: the provider only reads its (empty) parameters, and the factory it
// returns keeps no state, so one copy serves every selector.
const RouterPlugins::WorkerSelection& builtin_default_selection() {
  static const RouterPlugins::WorkerSelection selection = [] {
    auto factory = policies::kv_cost_policy_provider(
        WorkerSelectionPolicyParameters{classifiers::ParameterSource::empty("parameters")});
    KVR_CHECK(factory.has_value());
    return RouterPlugins::WorkerSelection{std::string{plugins::kDefaultPolicyName},
                                          std::string{plugins::kBuiltinDefaultPolicyType},
                                          std::move(*factory)};
  }();
  return selection;
}

// Why the classifier factory gives no classifier for `context`; empty when it gives one.
std::string classifier_failure(const rc::RequestClassifierFactory& factory,
                               const rc::RequestClassifierContext& context) {
  try {
    return factory(context) ? std::string{} : std::string{"returned no classifier"};
  } catch (const std::exception& error) {
    return fmt::format("threw: {}", error.what());
  } catch (...) {
    return "threw a non-standard exception";
  }
}

}  // namespace

const RouterPlugins::WorkerSelection& selection_or_builtin(const RouterPlugins& plugins,
                                                           WorkerType role) {
  const RouterPlugins::WorkerSelection& selection = plugins.selection_for(role);
  return selection.factory ? selection : builtin_default_selection();
}

std::expected<plugins::worker_selection::WorkerSelectionPolicy, std::string> build_policy(
    const RouterPlugins::WorkerSelection& selection,
    const plugins::worker_selection::RouterConfig& router, WorkerType role,
    const plugins::worker_selection::RoutingPartition& partition) {
  std::string failure;
  // A plugin's fault fails its partition's role, never the caller.
  try {
    auto policy = selection.factory(router, role, partition);
    if (policy.worker_type() == role) return policy;
    failure = fmt::format("returned a policy for {} requests", as_str(policy.worker_type()));
  } catch (const std::exception& error) {
    failure = fmt::format("threw: {}", error.what());
  } catch (...) {
    failure = "threw a non-standard exception";
  }
  return std::unexpected(fmt::format(
      "policy '{}' (type {}) for {} requests of model '{}' group '{}' could not be built: its "
      "factory {}",
      selection.instance_name, selection.type, as_str(role), partition.model,
      partition.routing_group, failure));
}

std::expected<void, std::string> check_plugin_factories(
    const RouterPlugins& plugins, const plugins::worker_selection::RouterConfig& router,
    std::span<const std::string> models) {
  for (const std::string& model : models) {
    const plugins::worker_selection::RoutingPartition partition{model, "default"};
    for (const WorkerType role : kAllWorkerTypes) {
      auto built = build_policy(selection_or_builtin(plugins, role), router, role, partition);
      if (!built) return std::unexpected(std::move(built.error()));
    }
    if (!plugins.request_classifier) continue;
    const rc::RequestClassifierContext context{router.block_size, {}};
    if (std::string failure = classifier_failure(plugins.request_classifier->factory, context);
        !failure.empty()) {
      return std::unexpected(fmt::format(
          "the request classifier '{}' of model '{}' could not be built: its factory {}",
          plugins.request_classifier->type, model, failure));
    }
  }
  return {};
}

}  // namespace kvr::selection
