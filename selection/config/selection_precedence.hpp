// Merges the per-role worker-selection choice from the command line and the environment into a
// loaded RouterPolicyConfig. Prefill and decode: role flag → role env var →
// KVR_ROUTER_WORKER_SELECTION_POLICY → YAML → built-in. Aggregated and encode have no flag or
// variable of their own: the global variable → YAML → built-in; their old role flag and variable
// are still read, at their old rank, as deprecated aliases that the caller logs once. Used by the
// node at startup, before resolve_plugins.
#pragma once

#include <array>
#include <expected>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"
#include "selection/config/router_policy_config.hpp"

namespace kvr::selection {

/// Sets every role's worker selection at once, below the role-specific flags and variables.
inline constexpr std::string_view kGlobalSelectionEnvVar = "KVR_ROUTER_WORKER_SELECTION_POLICY";

/// The role's environment variable, e.g. "KVR_ROUTER_PREFILL_POLICY" (for aggregated and encode,
/// the deprecated alias).
std::string_view role_selection_env_var(WorkerType role);

/// The role's command-line flag, e.g. "--router-prefill-policy" (for aggregated and encode, the
/// deprecated alias).
std::string_view role_selection_flag(WorkerType role);

/// True for the roles with a flag and variable of their own: prefill and decode.
bool role_has_own_selection_override(WorkerType role);

/// The role values given on the command line (--router-<role>-policy), indexed by WorkerType.
struct SelectionOverrides {
  std::array<std::optional<std::string>, 4> cli;
};

/// Looks up an environment variable; nullopt when unset.
using EnvironmentLookup = std::function<std::optional<std::string>(std::string_view)>;

/// The process environment (std::getenv); call only at startup, before threads start.
std::optional<std::string> process_environment(std::string_view name);

/// One notice per deprecated alias that was used, naming it and what replaces it.
using SelectionDeprecations = std::vector<std::string>;

/// Replaces each role's selection with the highest-precedence value present and records its
/// SelectionSource. An empty environment value counts as unset; an empty flag value is an error
/// naming the flag. The value "default" wins like any other and selects the built-in. Returns
/// the deprecation notices of the aliases that were used, for the caller to log.
std::expected<SelectionDeprecations, std::string> apply_selection_precedence(
    RouterPolicyConfig& config, const SelectionOverrides& overrides,
    const EnvironmentLookup& environment);

/// Where the role's value came from, for the startup log and for error messages: the flag, the
/// variable, "<source>: worker_selection.<role>" or "built-in default".
std::string selection_origin(const RouterPolicyConfig& config, WorkerType role);

}  // namespace kvr::selection
