// Runs the factories of a resolved plugin bundle (RouterPlugins): the built-in default for a role
// the bundle leaves empty, one partition's policy with its failure worded for the operator (the
// selector's partition core), and every factory at once (`kvr node --check-config`).
#pragma once

#include <expected>
#include <span>
#include <string>
#include <string_view>

#include "selection/plugin_registry.hpp"

namespace kvr::selection {

/// The model `kvr node --check-config` builds the factories for when the configuration names none.
inline constexpr std::string_view kCheckConfigModel = "*";

/// The role's selection in `plugins`, or the built-in default (instance `default`, type kv-cost,
/// no parameters) when the bundle holds no factory for the role, as a default-constructed
/// RouterPlugins does.
const plugins::RouterPlugins::WorkerSelection& selection_or_builtin(
    const plugins::RouterPlugins& plugins, WorkerType role);

/// Runs `selection`'s factory for one partition and role. Fails naming the instance, its type, the
/// role, the partition and the cause when the factory throws (as WorkerSelectionPolicy's
/// constructor does for a null component) or returns a policy for another role.
std::expected<plugins::worker_selection::WorkerSelectionPolicy, std::string> build_policy(
    const plugins::RouterPlugins::WorkerSelection& selection,
    const plugins::worker_selection::RouterConfig& router, WorkerType role,
    const plugins::worker_selection::RoutingPartition& partition);

/// Builds every role's policy and the request classifier (with a context of `router`'s block
/// size and no workers) once for each of `models` in routing group `default`, and drops them: the
/// first failure, naming the model, the role or classifier and the plugin, or nothing.
std::expected<void, std::string> check_plugin_factories(
    const plugins::RouterPlugins& plugins, const plugins::worker_selection::RouterConfig& router,
    std::span<const std::string> models);

}  // namespace kvr::selection
