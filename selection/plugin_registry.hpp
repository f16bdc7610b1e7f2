// The router plugin registry: worker-selection policies and request classifiers
// registered by type name, then resolved once at startup against the router-policy YAML.
// Built-ins and catalogs register from one function each; afterwards the registry is read-only.
// The contract: docs/plugin-api.md.
#pragma once

#include <array>
#include <expected>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/queue/policy_class_config.hpp"
#include "classifiers/request_classifier.hpp"
#include "selection/config/model_config.hpp"
#include "selection/config/worker_health_config.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::selection {
struct RouterPolicyConfig;
}  // namespace kvr::selection

namespace kvr::plugins {

/// A registration or resolution failure, worded for the operator (names key, lists what exists).
class RegistryError {
 public:
  explicit RegistryError(std::string message) : message_(std::move(message)) {}
  std::string_view message() const { return message_; }

 private:
  std::string message_;
};

/// The reserved type and instance name that selects the built-in policy (kv-cost).
inline constexpr std::string_view kDefaultPolicyName = "default";
/// The type name of the built-in default policy.
inline constexpr std::string_view kBuiltinDefaultPolicyType = "kv-cost";

/// What resolve_plugins produced: a ready factory per worker type, and the classifier.
struct RouterPlugins {
  struct WorkerSelection {
    std::string instance_name;  ///< the YAML instance name, or "default"
    std::string type;           ///< the registered type name
    worker_selection::WorkerSelectionPolicyFactory factory;
  };
  struct RequestClassifier {
    std::string type;
    request_classifier::RequestClassifierFactory factory;
  };

  /// One entry per WorkerType, indexed by its value.
  std::array<WorkerSelection, 4> worker_selection;
  /// Empty: every request is admitted at once.
  std::optional<RequestClassifier> request_classifier;
  /// The configured `policy_classes`, in document order (empty: only the class `default`);
  /// classifiers::resolve_policy_classes turns them into a queue's classes.
  std::vector<classifiers::PolicyClassConfig> policy_classes;
  /// The configured `worker_health` (the defaults when omitted).
  selection::WorkerHealthConfig worker_health;
  /// The configured `models`: the front doors' tokenizer mode per model.
  std::map<std::string, selection::ModelConfig, std::less<>> models;
  /// The router-policy YAML's `tokenizers` (model → tokenizer path, the `native` mode's files).
  std::map<std::string, std::string, std::less<>> tokenizers;

  const WorkerSelection& selection_for(WorkerType type) const {
    return worker_selection[static_cast<std::size_t>(type)];
  }
};

/// Registered providers by type name.
class RouterPluginRegistry {
 public:
  /// An empty registry; call register_builtin_policies (selection/policies/builtin_policies.hpp)
  /// and any catalog's register_catalog before resolving.
  RouterPluginRegistry() = default;

  /// Fails on an empty or reserved name, or a name already registered.
  std::expected<void, RegistryError> register_worker_selection(
      std::string type, worker_selection::WorkerSelectionPolicyProvider provider);
  /// Fails on an empty or reserved name, or a name already registered.
  std::expected<void, RegistryError> register_request_classifier(
      std::string type, request_classifier::RequestClassifierProvider provider);

  /// Runs each configured instance's provider once and picks a factory per role following the
  /// config's (already merged) selection; unknown types or instances and provider errors fail
  /// naming the key and listing what is available.
  std::expected<RouterPlugins, RegistryError> resolve_plugins(
      const selection::RouterPolicyConfig& config) const;

  /// Registered type names, sorted.
  std::vector<std::string> worker_selection_types() const;
  std::vector<std::string> request_classifier_types() const;

 private:
  std::map<std::string, worker_selection::WorkerSelectionPolicyProvider, std::less<>>
      worker_selection_;
  std::map<std::string, request_classifier::RequestClassifierProvider, std::less<>>
      request_classifiers_;
};

/// The reference's names for the registry and its error, kept so that a catalog ported from it
/// compiles unchanged. (Its worker-only `register` method cannot be named in C++, where `register`
/// is a keyword: such a catalog calls register_worker_selection.)
using WorkerSelectionPolicyRegistry = RouterPluginRegistry;
using WorkerSelectionPolicyRegistryError = RegistryError;

}  // namespace kvr::plugins
