// Registers kvr's built-in worker-selection policies, and with them the built-in request
// classifiers, with the plugin registry. The node, replay and tests call register_builtin_policies
// once at startup, before any catalog registers.
#pragma once

#include <expected>
#include <span>
#include <string_view>

#include "selection/plugin_registry.hpp"

namespace kvr::selection {

/// The type names register_builtin_policies registers, the default (kv-cost) first.
std::span<const std::string_view> builtin_policy_types();

/// Registers kv-cost, least-loaded, round-robin, random, power-of-two, two-tier,
/// soft-affinity-load-guard, bounded-load-hash and predicted-ttft, then the built-in request
/// classifiers (register_builtin_classifiers, selection/classifiers_registration.hpp); fails when a
/// name is already registered.
std::expected<void, plugins::RegistryError> register_builtin_policies(
    plugins::RouterPluginRegistry& registry);

}  // namespace kvr::selection
