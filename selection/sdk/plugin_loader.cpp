#include "selection/sdk/plugin_loader.hpp"

#include <array>
#include <cstring>
#include <filesystem>
#include <vector>

#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kvr/plugin.hpp"

namespace kvr::plugins {
namespace {

using RegisterEntry = int (*)(RouterPluginRegistry*, char*, std::size_t);

std::string loader_error() {
  const char* reason = dlerror();
  return reason != nullptr ? std::string{reason} : std::string{"unknown reason"};
}

// The fields of `theirs` that differ from this kvr's, in words; empty when none does.
std::string abi_difference(const PluginAbiStamp& theirs) {
  const PluginAbiStamp ours = this_build_abi();
  std::vector<std::string> differences;
  const std::string_view their_version =
      theirs.kvr_version != nullptr ? std::string_view{theirs.kvr_version} : std::string_view{};
  if (their_version != ours.kvr_version) {
    differences.push_back(
        fmt::format("built for kvr {}, this is kvr {}", their_version, ours.kvr_version));
  }
  if (theirs.api_version != ours.api_version) {
    differences.push_back(fmt::format("plugin API version {}, this kvr speaks {}",
                                      theirs.api_version, ours.api_version));
  }
  if (theirs.gxx_abi_version != ours.gxx_abi_version) {
    differences.push_back(
        fmt::format("C++ ABI {}, this kvr uses {}", theirs.gxx_abi_version, ours.gxx_abi_version));
  }
  if (theirs.cxx11_string_abi != ours.cxx11_string_abi) {
    differences.push_back(fmt::format("libstdc++ string ABI {}, this kvr uses {}",
                                      theirs.cxx11_string_abi, ours.cxx11_string_abi));
  }
  return fmt::format("{}", fmt::join(differences, "; "));
}

}  // namespace

std::expected<void, std::string> load_plugin(const std::string& path,
                                             RouterPluginRegistry& registry) {
  const auto fail = [&](std::string_view cause) {
    return std::unexpected(fmt::format("plugin {}: {}", path, cause));
  };
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return fail("no such file");
  }
  // RTLD_NOW: a symbol the plugin needs and kvr lacks is found now, not on a request path.
  // RTLD_LOCAL: two plugins' own symbols never interpose on each other.
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) return fail("cannot load: " + loader_error());
  const auto* stamp = static_cast<const PluginAbiStamp*>(dlsym(library, "kvr_plugin_abi_stamp"));
  if (stamp == nullptr) {
    return fail(
        "not a kvr plugin: it exports no kvr_plugin_abi_stamp (build it with "
        "KVR_PLUGIN_CATALOG from <kvr/plugin.hpp>)");
  }
  if (std::string difference = abi_difference(*stamp); !difference.empty()) {
    return fail("built for another ABI: " + difference + "; rebuild it against this kvr's SDK");
  }
  // POSIX guarantees that an object pointer from dlsym converts to a function pointer.
  auto* entry = reinterpret_cast<RegisterEntry>(dlsym(library, "kvr_plugin_register"));
  if (entry == nullptr) {
    return fail(
        "not a kvr plugin: it exports no kvr_plugin_register (build it with "
        "KVR_PLUGIN_CATALOG from <kvr/plugin.hpp>)");
  }
  std::array<char, 1024> message{};
  switch (entry(&registry, message.data(), message.size())) {
    case kPluginRegistered:
      return {};
    case kPluginRefused:
      return fail(fmt::format("its registration was refused: {}", message.data()));
    default:
      return fail(fmt::format("its registration threw: {}", message.data()));
  }
}

std::expected<void, std::string> load_plugins(std::span<const std::string> paths,
                                              RouterPluginRegistry& registry) {
  for (const std::string& path : paths) {
    if (auto loaded = load_plugin(path, registry); !loaded) return loaded;
  }
  return {};
}

}  // namespace kvr::plugins
