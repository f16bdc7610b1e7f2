// The router-policy YAML (`--router-policy-config`): which worker-selection policy each role uses,
// the configured policy instances and the request classifier. Loaded once at startup by the node
// and by replay, merged with flags and environment (selection_precedence.hpp), then resolved
// against the plugin registry (selection/plugin_registry.hpp).
//
//   worker_selection:
//     aggregated: least-busy        # also prefill, decode, encode; omitted: the built-in
//     instances:
//       - name: least-busy
//         type: least-busy
//         parameters: {min_device_overlap_blocks: 0}
//   request_classifier:
//     type: max-in-flight
//     parameters: {max_in_flight: 32}
//   policy_classes:                 # omitted: the single class `default`
//     - name: interactive
//       quantum: 2048               # uncached tokens per deficit-round-robin turn
//       order: wspt                 # or fcfs (the default)
//       prefill_busy_threshold_frac: 0.75
//       kv_busy_threshold: 0.9         # busy above this fraction of KV blocks in use
//       request_queue_limit_per_worker: 64
//   worker_health:                  # omitted: the defaults
//   (selection/config/worker_health_config.hpp)
//     consecutive_failures: 3
//     slow_start_window_ms: 0
//   models:                         # per model (selection/config/model_config.hpp)
//     llama-3.1-8b: {tokenizer_mode: estimate}
//   tokenizers:                     # the native mode's tokenizer files, per model: a folder with
//     qwen3-8b: /models/qwen3-8b    # tokenizer.json and tokenizer_config.json (relative paths
//                                   # are from this file's folder)
#pragma once

#include <array>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "classifiers/queue/policy_class_config.hpp"
#include "messages/ids.hpp"
#include "selection/config/model_config.hpp"
#include "selection/config/parameter_source.hpp"
#include "selection/config/worker_health_config.hpp"

namespace kvr::selection {

/// Where a role's worker-selection value came from, for the startup log and error messages.
enum class SelectionSource : std::uint8_t {
  BuiltIn,      ///< nothing set it: the built-in policy
  Yaml,         ///< worker_selection.<role> in the router-policy YAML
  GlobalEnv,    ///< KVR_ROUTER_WORKER_SELECTION_POLICY
  RoleEnv,      ///< KVR_ROUTER_<ROLE>_POLICY
  CommandLine,  ///< --router-<role>-policy
};

/// One `worker_selection.instances[i]` entry: a named, parameterised use of a registered type.
struct WorkerSelectionInstanceConfig {
  std::string name;
  std::string type;
  /// The instance's `parameters` mapping (empty when absent).
  std::shared_ptr<const ParameterSource> parameters;
};

/// The `request_classifier` section.
struct RequestClassifierConfig {
  std::string type;
  std::shared_ptr<const ParameterSource> parameters;
};

/// The router-policy configuration, as loaded and then merged with flags and environment.
struct RouterPolicyConfig {
  /// Per WorkerType (indexed by its value): an instance name, a registered type name, or
  /// "default"; empty or "default" selects the built-in policy.
  std::array<std::optional<std::string>, 4> worker_selection;
  /// Per WorkerType: where worker_selection's value came from.
  std::array<SelectionSource, 4> worker_selection_sources{};
  /// In document order; names are unique and never "default".
  std::vector<WorkerSelectionInstanceConfig> instances;
  std::optional<RequestClassifierConfig> request_classifier;
  /// `policy_classes`, in document order, each valid (classifiers::validate_policy_class), names
  /// unique. Empty: the single class `default`. A class named `default` configures that class;
  /// otherwise it is added with the node's settings (classifiers::resolve_policy_classes).
  std::vector<classifiers::PolicyClassConfig> policy_classes;
  /// `worker_health`: passive health of every partition (valid; the defaults when omitted).
  WorkerHealthConfig worker_health;
  /// `models`: per-model settings, by model name.
  std::map<std::string, ModelConfig, std::less<>> models;
  /// `tokenizers`: the tokenizer files of models served in the `native` mode, by model name;
  /// relative paths resolved against the file's folder.
  std::map<std::string, std::string, std::less<>> tokenizers;
  /// `plugins`: plugin libraries (<kvr/plugin.hpp>) to load before the types are resolved, in
  /// order; relative paths resolved against the file's folder.
  std::vector<std::string> plugins;
  /// The file path (or the name given to parse_router_policy_config), used in messages.
  std::string source_name;

  const std::optional<std::string>& selection_for(WorkerType type) const {
    return worker_selection[static_cast<std::size_t>(type)];
  }
  SelectionSource source_for(WorkerType type) const {
    return worker_selection_sources[static_cast<std::size_t>(type)];
  }

  /// True when a request may be put in the class `name`: "default" or a configured class.
  bool has_policy_class(std::string_view name) const;
  /// For startup checks of what a classifier may set: fails, naming `where` (e.g. the classifier's
  /// parameter path) and the known classes, when has_policy_class(name) is false.
  std::expected<void, std::string> check_policy_class(std::string_view name,
                                                      std::string_view where) const;
};

/// Parses router-policy YAML. Fails, naming `source_name`, the line and the key path, on bad
/// syntax, an unknown key at any level (listing the allowed keys), a duplicate key, instance name
/// or policy class name, a missing or empty name or type, the reserved name "default" as an
/// instance name or type, values of the wrong kind, and policy-class settings out of range (an
/// order other than fcfs or wspt, a zero quantum or limit, a fraction outside (0, 1]) and
/// worker_health settings out of range (WorkerHealthConfig::validate). An empty
/// document is an empty configuration.
std::expected<RouterPolicyConfig, std::string> parse_router_policy_config(
    std::string_view yaml_text, std::string source_name);

/// Reads and parses the router-policy YAML file at `path`.
std::expected<RouterPolicyConfig, std::string> load_router_policy_config(
    const std::filesystem::path& path);

}  // namespace kvr::selection
