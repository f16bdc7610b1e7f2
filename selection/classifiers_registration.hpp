// Registers kvr's built-in request classifiers (classifiers/builtin/) with the plugin registry by
// type name. register_builtin_policies calls it, so the node, replay and every registry that has
// the built-in policies also has the built-in classifiers.
#pragma once

#include <expected>
#include <span>
#include <string_view>

#include "selection/plugin_registry.hpp"

namespace kvr::selection {

/// The type names register_builtin_classifiers registers, sorted.
std::span<const std::string_view> builtin_classifier_types();

/// Registers kv-capacity-pause, length-class, max-in-flight, tenant-class and token-bucket; fails
/// when a name is already registered.
std::expected<void, plugins::RegistryError> register_builtin_classifiers(
    plugins::RouterPluginRegistry& registry);

}  // namespace kvr::selection
