#include "selection/config/selection_precedence.hpp"

#include <cstdlib>

#include <fmt/format.h>

namespace kvr::selection {

std::string_view role_selection_env_var(WorkerType role) {
  switch (role) {
    case WorkerType::Aggregated:
      return "KVR_ROUTER_AGGREGATED_POLICY";
    case WorkerType::Prefill:
      return "KVR_ROUTER_PREFILL_POLICY";
    case WorkerType::Decode:
      return "KVR_ROUTER_DECODE_POLICY";
    case WorkerType::Encode:
      return "KVR_ROUTER_ENCODE_POLICY";
  }
  return "KVR_ROUTER_UNKNOWN_POLICY";
}

std::string_view role_selection_flag(WorkerType role) {
  switch (role) {
    case WorkerType::Aggregated:
      return "--router-aggregated-policy";
    case WorkerType::Prefill:
      return "--router-prefill-policy";
    case WorkerType::Decode:
      return "--router-decode-policy";
    case WorkerType::Encode:
      return "--router-encode-policy";
  }
  return "--router-unknown-policy";
}

bool role_has_own_selection_override(WorkerType role) {
  return role == WorkerType::Prefill || role == WorkerType::Decode;
}

std::optional<std::string> process_environment(std::string_view name) {
  const char* value = std::getenv(std::string{name}.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string{value};
}

std::expected<SelectionDeprecations, std::string> apply_selection_precedence(
    RouterPolicyConfig& config, const SelectionOverrides& overrides,
    const EnvironmentLookup& environment) {
  SelectionDeprecations deprecations;
  auto deprecated = [&deprecations](WorkerType role, std::string_view alias) {
    deprecations.push_back(fmt::format(
        "{} is deprecated: {} workers take {} or worker_selection.{} of the router-policy YAML",
        alias, as_str(role), kGlobalSelectionEnvVar, as_str(role)));
  };
  auto non_empty_env = [&environment](std::string_view name) -> std::optional<std::string> {
    auto value = environment(name);
    if (value && value->empty()) return std::nullopt;
    return value;
  };
  const std::optional<std::string> global = non_empty_env(kGlobalSelectionEnvVar);

  for (const WorkerType role : kAllWorkerTypes) {
    const auto index = static_cast<std::size_t>(role);
    std::optional<std::string>& value = config.worker_selection[index];
    SelectionSource& source = config.worker_selection_sources[index];
    if (const auto& flag = overrides.cli[index]) {
      if (flag->empty()) {
        return std::unexpected(
            fmt::format("{}: the value must not be empty (use 'default' for "
                        "the built-in policy)",
                        role_selection_flag(role)));
      }
      value = *flag;
      source = SelectionSource::CommandLine;
      if (!role_has_own_selection_override(role)) deprecated(role, role_selection_flag(role));
    } else if (auto role_env = non_empty_env(role_selection_env_var(role))) {
      value = std::move(*role_env);
      source = SelectionSource::RoleEnv;
      if (!role_has_own_selection_override(role)) deprecated(role, role_selection_env_var(role));
    } else if (global) {
      value = *global;
      source = SelectionSource::GlobalEnv;
    } else if (value) {
      source = SelectionSource::Yaml;
    } else {
      source = SelectionSource::BuiltIn;
    }
  }
  return deprecations;
}

std::string selection_origin(const RouterPolicyConfig& config, WorkerType role) {
  switch (config.source_for(role)) {
    case SelectionSource::CommandLine:
      return std::string{role_selection_flag(role)};
    case SelectionSource::RoleEnv:
      return std::string{role_selection_env_var(role)};
    case SelectionSource::GlobalEnv:
      return fmt::format("{} (for {})", kGlobalSelectionEnvVar, as_str(role));
    case SelectionSource::Yaml:
      return fmt::format("{}: worker_selection.{}", config.source_name, as_str(role));
    case SelectionSource::BuiltIn:
      break;
  }
  return fmt::format("built-in default (worker_selection.{} not set)", as_str(role));
}

}  // namespace kvr::selection
