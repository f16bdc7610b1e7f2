#include "example_catalog.hpp"

#include <string>

#include "cache_headroom_policy.hpp"

namespace kvr::examples {

std::expected<void, plugins::RegistryError> register_example_catalog(
    plugins::RouterPluginRegistry& registry) {
  return registry.register_worker_selection(std::string{kCacheHeadroomPolicyType},
                                            cache_headroom_provider);
}

}  // namespace kvr::examples
