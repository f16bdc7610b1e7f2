// A plugin as a future kvr's SDK would stamp it: the same entry points, another plugin API
// version. kvr must refuse it before calling into it.
#include <kvr/plugin.hpp>

extern "C" __attribute__((visibility("default")))
const kvr::plugins::PluginAbiStamp kvr_plugin_abi_stamp{
    KVR_VERSION_STRING, kvr::plugins::kPluginApiVersion + 1,
    kvr::plugins::this_build_abi().gxx_abi_version,
    kvr::plugins::this_build_abi().cxx11_string_abi};

extern "C" __attribute__((visibility("default"))) int kvr_plugin_register(
    kvr::plugins::RouterPluginRegistry*, char*, std::size_t) noexcept {
  return kvr::plugins::kPluginRegistered;
}
