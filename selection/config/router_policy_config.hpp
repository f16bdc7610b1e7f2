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
#pragma once

#include <array>
#include <cstdint>
#include <expected>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"
#include "selection/config/parameter_source.hpp"

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
  /// The file path (or the name given to parse_router_policy_config), used in messages.
  std::string source_name;

  const std::optional<std::string>& selection_for(WorkerType type) const {
    return worker_selection[static_cast<std::size_t>(type)];
  }
  SelectionSource source_for(WorkerType type) const {
    return worker_selection_sources[static_cast<std::size_t>(type)];
  }
};

/// Parses router-policy YAML. Fails, naming `source_name`, the line and the key path, on bad
/// syntax, an unknown key at any level (listing the allowed keys), a duplicate key or instance
/// name, a missing or empty name or type, the reserved name "default" as an instance name or
/// type, and values of the wrong kind. An empty document is an empty configuration.
std::expected<RouterPolicyConfig, std::string> parse_router_policy_config(
    std::string_view yaml_text, std::string source_name);

/// Reads and parses the router-policy YAML file at `path`.
std::expected<RouterPolicyConfig, std::string> load_router_policy_config(
    const std::filesystem::path& path);

}  // namespace kvr::selection
