// Loads plugin libraries (<kvr/plugin.hpp>) into a plugin registry at startup, before the
// router-policy YAML is resolved. A library stays loaded for the life of the process: the
// factories it registered are called from it.
#pragma once

#include <expected>
#include <span>
#include <string>

#include "selection/plugin_registry.hpp"

namespace kvr::plugins {

/// Loads the plugin at `path` and runs its catalog against `registry`. The error names the
/// plugin and the cause: a missing or unloadable file (with the loader's reason), a library
/// without KVR_PLUGIN_CATALOG, one built for another kvr version, plugin API or C++ ABI, a
/// refused registration (a duplicate type name) or one that threw.
std::expected<void, std::string> load_plugin(const std::string& path,
                                             RouterPluginRegistry& registry);

/// load_plugin for each path in order; stops at the first failure.
std::expected<void, std::string> load_plugins(std::span<const std::string> paths,
                                              RouterPluginRegistry& registry);

}  // namespace kvr::plugins
