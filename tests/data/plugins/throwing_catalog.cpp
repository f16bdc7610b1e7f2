// A plugin whose catalog throws while registering.
#include <stdexcept>

#include <kvr/plugin.hpp>

namespace {

std::expected<void, kvr::plugins::RegistryError> register_nothing(
    kvr::plugins::RouterPluginRegistry&) {
  throw std::runtime_error("the catalog could not read its model file");
}

}  // namespace

KVR_PLUGIN_CATALOG(register_nothing)
