// A plugin (built in the tree, loaded by `kvr node --plugin`) whose policy type `unbuildable`
// passes its provider at startup but whose factory throws for every partition: the fault that
// `kvr node --check-config` must report before any traffic (cli_options_test.cpp).
#include <expected>
#include <stdexcept>

#include <kvr/plugin.hpp>

namespace {

using namespace kvr::plugins::worker_selection;

std::expected<WorkerSelectionPolicyFactory, WorkerSelectionPolicyProviderError> unbuildable(
    const WorkerSelectionPolicyParameters&) {
  return [](const RouterConfig&, WorkerType, const RoutingPartition&) -> WorkerSelectionPolicy {
    throw std::runtime_error("no GPU budget configured");
  };
}

std::expected<void, kvr::plugins::RegistryError> register_unbuildable(
    kvr::plugins::RouterPluginRegistry& registry) {
  return registry.register_worker_selection("unbuildable", &unbuildable);
}

}  // namespace

KVR_PLUGIN_CATALOG(register_unbuildable)
