// The custom policy of the reference ("Write Custom Routing Strategies"), compiled as an example
// catalog: a minimum-device-overlap filter, an active-requests scorer and a lowest-cost picker,
// registered as `least-busy`. Written against the public plugin API only, as a user would.
#pragma once

#include <expected>

#include "selection/plugin_registry.hpp"

namespace kvr::examples::least_busy {

/// Registers the worker-selection type `least-busy`; parameter min_device_overlap_blocks (0).
std::expected<void, plugins::RegistryError> register_catalog(
    plugins::RouterPluginRegistry& registry);

}  // namespace kvr::examples::least_busy
