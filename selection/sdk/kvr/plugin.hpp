// The one header a kvr plugin includes: the whole public plugin API (docs/plugin-api.md) and the
// macro that exports a catalog from a shared library, so that `kvr node --plugin PATH` (and
// `kvr replay --plugin PATH`, or `plugins:` in the router-policy YAML) registers its types
// before the router-policy YAML is resolved.
//
//   #include <kvr/plugin.hpp>
//   std::expected<void, kvr::plugins::RegistryError> register_my_catalog(
//       kvr::plugins::RouterPluginRegistry& registry);
//   KVR_PLUGIN_CATALOG(register_my_catalog)
//
// A plugin links no kvr library: its calls into the API resolve against the `kvr` binary that
// loads it. So it must be built with the same compiler ABI and against the same kvr version and
// plugin API version as that binary; the macro stamps all three into the library, and kvr
// refuses a plugin whose stamp differs, naming what differs.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>
#include <expected>
#include <string_view>

#include "classifiers/plugin_parameters.hpp"
#include "classifiers/request_classifier.hpp"
#include "kvr/version.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/worker_selection.hpp"

namespace kvr::plugins {

/// The plugin API's version: raised whenever a change to the public headers breaks plugins built
/// against the previous ones.
inline constexpr int kPluginApiVersion = 1;

/// What a plugin was built for; kvr loads it only when every field matches its own.
struct PluginAbiStamp {
  const char* kvr_version;  ///< KVR_VERSION_STRING
  int api_version;          ///< kPluginApiVersion
  int gxx_abi_version;      ///< the Itanium C++ ABI revision (__GXX_ABI_VERSION)
  int cxx11_string_abi;     ///< libstdc++'s std::string ABI (_GLIBCXX_USE_CXX11_ABI)
};

/// The stamp of the code that includes this header.
constexpr PluginAbiStamp this_build_abi() {
  return PluginAbiStamp{KVR_VERSION_STRING, kPluginApiVersion,
#ifdef __GXX_ABI_VERSION
                        __GXX_ABI_VERSION,
#else
                        0,
#endif
#ifdef _GLIBCXX_USE_CXX11_ABI
                        _GLIBCXX_USE_CXX11_ABI
#else
                        0
#endif
  };
}

/// A catalog: registers a plugin's types (docs/policies.md).
using PluginCatalog = std::expected<void, RegistryError> (*)(RouterPluginRegistry&);

/// What kvr_plugin_register returns.
enum PluginRegisterResult : int { kPluginRegistered = 0, kPluginRefused = 1, kPluginThrew = 2 };

namespace detail {

// Runs `catalog` for the exported entry point: no exception crosses into the loader; a refusal
// or an exception leaves its message in `error` (truncated to `error_size`).
inline int run_catalog(PluginCatalog catalog, RouterPluginRegistry& registry, char* error,
                       std::size_t error_size) noexcept {
  const auto say = [&](std::string_view text) {
    if (error == nullptr || error_size == 0) return;
    const std::size_t length = text.size() < error_size - 1 ? text.size() : error_size - 1;
    std::memcpy(error, text.data(), length);
    error[length] = '\0';
  };
  try {
    auto registered = catalog(registry);
    if (registered) return kPluginRegistered;
    say(registered.error().message());
    return kPluginRefused;
  } catch (const std::exception& thrown) {
    say(thrown.what());
  } catch (...) {
    say("an exception that is not a std::exception");
  }
  return kPluginThrew;
}

}  // namespace detail
}  // namespace kvr::plugins

/// Exports `register_fn` (a PluginCatalog) and this build's ABI stamp from a plugin library. Use
/// it once per library, at namespace scope.
#define KVR_PLUGIN_CATALOG(register_fn)                                                         \
  extern "C" __attribute__((visibility("default"), used))                                       \
  const ::kvr::plugins::PluginAbiStamp kvr_plugin_abi_stamp = ::kvr::plugins::this_build_abi(); \
  extern "C" __attribute__((visibility("default"), used)) int kvr_plugin_register(              \
      ::kvr::plugins::RouterPluginRegistry* registry, char* error,                              \
      std::size_t error_size) noexcept {                                                        \
    return ::kvr::plugins::detail::run_catalog(&(register_fn), *registry, error, error_size);   \
  }
