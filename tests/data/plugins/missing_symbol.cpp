// A plugin that needs a function no kvr binary provides (as one built against another kvr's
// SDK would): kvr must refuse it at load, before any request, naming the symbol.
#include <kvr/plugin.hpp>

extern "C" int kvr_function_this_kvr_lacks();

namespace {

std::expected<void, kvr::plugins::RegistryError> register_with_missing_symbol(
    kvr::plugins::RouterPluginRegistry&) {
  if (kvr_function_this_kvr_lacks() != 0) {
    return std::unexpected(kvr::plugins::RegistryError{"unreachable"});
  }
  return {};
}

}  // namespace

KVR_PLUGIN_CATALOG(register_with_missing_symbol)
