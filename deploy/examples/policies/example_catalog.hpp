// The example catalog: registers the example policies (cache_headroom_policy.hpp,
// tool_turn_policy.hpp, lmetric_policy.hpp, sticky_until_saturated_policy.hpp) with a plugin
// registry. A binary that links kvr_example_policies calls it once at startup, after
// register_builtin_policies and before the router-policy YAML is resolved.
#pragma once

#include <expected>

#include "selection/plugin_registry.hpp"

namespace kvr::examples {

/// Registers the worker-selection types `cache-headroom`, `tool-turn-local`, `lmetric` and
/// `sticky-until-saturated`; fails if a name is already taken.
std::expected<void, plugins::RegistryError> register_example_catalog(
    plugins::RouterPluginRegistry& registry);

}  // namespace kvr::examples
