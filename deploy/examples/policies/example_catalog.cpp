#include "example_catalog.hpp"

#include <string>

#include "cache_headroom_policy.hpp"
#include "lmetric_policy.hpp"
#include "sticky_until_saturated_policy.hpp"
#include "tool_turn_policy.hpp"

namespace kvr::examples {

std::expected<void, plugins::RegistryError> register_example_catalog(
    plugins::RouterPluginRegistry& registry) {
  if (auto registered = registry.register_worker_selection(std::string{kCacheHeadroomPolicyType},
                                                           cache_headroom_provider);
      !registered) {
    return registered;
  }
  if (auto registered = registry.register_worker_selection(std::string{kToolTurnLocalPolicyType},
                                                           tool_turn_local_provider);
      !registered) {
    return registered;
  }
  if (auto registered =
          registry.register_worker_selection(std::string{kLMetricPolicyType}, lmetric_provider);
      !registered) {
    return registered;
  }
  return registry.register_worker_selection(std::string{kStickyUntilSaturatedPolicyType},
                                            sticky_until_saturated_provider);
}

}  // namespace kvr::examples
