#include "selection/plugin_registry.hpp"

#include <exception>

#include <fmt/format.h>

#include "selection/config/router_policy_config.hpp"
#include "selection/config/selection_precedence.hpp"

namespace kvr::plugins {
namespace {

// The class names a classifier may set: the configured ones (a provider checks against them).
std::vector<std::string> policy_class_names(const selection::RouterPolicyConfig& config) {
  std::vector<std::string> names;
  for (const auto& policy_class : config.policy_classes) names.push_back(policy_class.name);
  return names;
}

using request_classifier::RequestClassifierParameters;
using worker_selection::WorkerSelectionPolicyParameters;

template <class Providers>
std::vector<std::string> names_of(const Providers& providers) {
  std::vector<std::string> names;
  names.reserve(providers.size());
  for (const auto& [name, provider] : providers) names.push_back(name);
  return names;  // std::map keeps them sorted
}

std::string bracketed(const std::vector<std::string>& names) {
  std::string joined = "[";
  for (const std::string& name : names) {
    if (joined.size() > 1) joined += ", ";
    joined += name;
  }
  return joined + "]";
}

template <class Providers, class Provider>
std::expected<void, RegistryError> register_provider(Providers& providers, std::string_view kind,
                                                     std::string type, Provider provider) {
  if (type.empty()) {
    return std::unexpected(
        RegistryError{fmt::format("cannot register a {} with an empty type name", kind)});
  }
  if (type == kDefaultPolicyName) {
    return std::unexpected(RegistryError{
        fmt::format("cannot register {} type '{}': the name is reserved (it selects the built-in "
                    "{})",
                    kind, type, kBuiltinDefaultPolicyType)});
  }
  if (!provider) {
    return std::unexpected(RegistryError{
        fmt::format("cannot register {} type '{}': the provider is empty", kind, type)});
  }
  if (providers.contains(type)) {
    return std::unexpected(
        RegistryError{fmt::format("{} type '{}' is already registered; registered types: {}", kind,
                                  type, bracketed(names_of(providers)))});
  }
  providers.emplace(std::move(type), std::move(provider));
  return {};
}

// Runs a provider once; its error, an exception or an empty factory fail naming `where`.
template <class Provider, class Parameters>
auto run_provider(const Provider& provider, const Parameters& parameters, std::string_view where)
    -> std::expected<typename std::invoke_result_t<const Provider&, const Parameters&>::value_type,
                     RegistryError> {
  try {
    auto factory = provider(parameters);
    if (!factory) {
      return std::unexpected(
          RegistryError{fmt::format("{}: {}", where, factory.error().message())});
    }
    if (!*factory) {
      return std::unexpected(
          RegistryError{fmt::format("{}: the provider returned no factory", where)});
    }
    return std::move(*factory);
  } catch (const std::exception& error) {
    return std::unexpected(
        RegistryError{fmt::format("{}: the provider threw: {}", where, error.what())});
  } catch (...) {
    return std::unexpected(
        RegistryError{fmt::format("{}: the provider threw a non-standard exception", where)});
  }
}

}  // namespace

std::expected<void, RegistryError> RouterPluginRegistry::register_worker_selection(
    std::string type, worker_selection::WorkerSelectionPolicyProvider provider) {
  return register_provider(worker_selection_, "worker-selection policy", std::move(type),
                           std::move(provider));
}

std::expected<void, RegistryError> RouterPluginRegistry::register_request_classifier(
    std::string type, request_classifier::RequestClassifierProvider provider) {
  return register_provider(request_classifiers_, "request classifier", std::move(type),
                           std::move(provider));
}

std::vector<std::string> RouterPluginRegistry::worker_selection_types() const {
  return names_of(worker_selection_);
}

std::vector<std::string> RouterPluginRegistry::request_classifier_types() const {
  return names_of(request_classifiers_);
}

std::expected<RouterPlugins, RegistryError> RouterPluginRegistry::resolve_plugins(
    const selection::RouterPolicyConfig& config) const {
  RouterPlugins plugins;

  // Every configured instance is validated by running its provider once, used by a role or not.
  std::map<std::string, RouterPlugins::WorkerSelection, std::less<>> instances;
  std::vector<std::string> instance_names;
  for (std::size_t i = 0; i < config.instances.size(); ++i) {
    const selection::WorkerSelectionInstanceConfig& instance = config.instances[i];
    const auto provider = worker_selection_.find(instance.type);
    if (provider == worker_selection_.end()) {
      return std::unexpected(RegistryError{fmt::format(
          "{}: worker_selection.instances[{}].type: unknown policy type '{}' (instance '{}'); "
          "types: {}",
          config.source_name, i, instance.type, instance.name,
          bracketed(worker_selection_types()))});
    }
    auto factory =
        run_provider(provider->second, WorkerSelectionPolicyParameters{instance.parameters},
                     fmt::format("{}: worker_selection.instances[{}] ({})", config.source_name, i,
                                 instance.name));
    if (!factory) return std::unexpected(std::move(factory.error()));
    instances.emplace(instance.name, RouterPlugins::WorkerSelection{instance.name, instance.type,
                                                                    std::move(*factory)});
    instance_names.push_back(instance.name);
  }

  // A role naming a type directly (or `default`, the built-in type) gets an implicit instance
  // without parameters; one per type, shared by the roles that name it.
  std::map<std::string, worker_selection::WorkerSelectionPolicyFactory, std::less<>> implicit;
  for (const WorkerType role : kAllWorkerTypes) {
    const std::optional<std::string>& value = config.selection_for(role);
    const std::string origin = selection::selection_origin(config, role);
    const bool built_in = !value || *value == kDefaultPolicyName;
    RouterPlugins::WorkerSelection& chosen =
        plugins.worker_selection[static_cast<std::size_t>(role)];

    if (!built_in) {
      if (const auto instance = instances.find(*value); instance != instances.end()) {
        chosen = instance->second;
        continue;
      }
    }
    const std::string_view type = built_in ? kBuiltinDefaultPolicyType : std::string_view{*value};
    const auto provider = worker_selection_.find(type);
    if (provider == worker_selection_.end()) {
      if (built_in) {
        return std::unexpected(RegistryError{fmt::format(
            "{}: the built-in policy '{}' is not registered (register_builtin_policies was not "
            "called); types: {}",
            origin, kBuiltinDefaultPolicyType, bracketed(worker_selection_types()))});
      }
      return std::unexpected(RegistryError{
          fmt::format("{}: unknown policy '{}'; instances: {}; types: {}", origin, *value,
                      bracketed(instance_names), bracketed(worker_selection_types()))});
    }
    auto factory = implicit.find(type);
    if (factory == implicit.end()) {
      auto made = run_provider(
          provider->second,
          WorkerSelectionPolicyParameters{classifiers::ParameterSource::empty("parameters")},
          fmt::format("{}: {} '{}'", origin, built_in ? "built-in policy" : "policy type", type));
      if (!made) return std::unexpected(std::move(made.error()));
      factory = implicit.emplace(std::string{type}, std::move(*made)).first;
    }
    chosen = RouterPlugins::WorkerSelection{built_in ? std::string{kDefaultPolicyName} : *value,
                                            std::string{type}, factory->second};
  }

  if (config.request_classifier) {
    const selection::RequestClassifierConfig& classifier = *config.request_classifier;
    const auto provider = request_classifiers_.find(classifier.type);
    if (provider == request_classifiers_.end()) {
      return std::unexpected(RegistryError{
          fmt::format("{}: request_classifier.type: unknown request-classifier type '{}'; "
                      "types: {}",
                      config.source_name, classifier.type, bracketed(request_classifier_types()))});
    }
    auto factory = run_provider(
        provider->second,
        RequestClassifierParameters{classifier.parameters, policy_class_names(config)},
        fmt::format("{}: request_classifier ({})", config.source_name, classifier.type));
    if (!factory) return std::unexpected(std::move(factory.error()));
    plugins.request_classifier =
        RouterPlugins::RequestClassifier{classifier.type, std::move(*factory)};
  }
  plugins.policy_classes = config.policy_classes;
  plugins.worker_health = config.worker_health;
  plugins.models = config.models;
  plugins.tokenizers = config.tokenizers;
  return plugins;
}

}  // namespace kvr::plugins
