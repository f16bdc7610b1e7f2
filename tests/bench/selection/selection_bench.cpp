// Selection with the built-in default policy (kv-cost) over fleets of 2 to 10,000 workers, at
// temperature 0 and 0.7: time per selection and heap allocations per warm selection; kv-cost
// against predicted-ttft at 32 and 1,024 workers (BM_BuiltinPolicySelection). And the
// example catalog's cache-headroom policy compiled in versus loaded from a plugin built from the
// same sources (BM_ExamplePolicySelection): what loading a policy at run time costs.
//
// Fleet: prompt 2,048 tokens at block size 16; worker i holds (i mod 32)·64 cached tokens,
// 16·i active prefill tokens, i mod 127 decode blocks and i mod 17 active requests.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "policies/cache_headroom_policy.hpp"
#include "policies/example_catalog.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/plugin_registry.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "selection/sdk/plugin_loader.hpp"
#include "selection/selection_host.hpp"
#include "tests/testing/fake_worker_signals.hpp"

namespace {

std::atomic<std::size_t> g_allocations{0};

}  // namespace

// Counts every heap allocation of the process; the benchmark reads it around warm selections.
void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* memory = std::malloc(size)) return memory;  // NOLINT(cppcoreguidelines-no-malloc)
  throw std::bad_alloc{};
}
void operator delete(void* memory) noexcept { std::free(memory); }               // NOLINT
void operator delete(void* memory, std::size_t) noexcept { std::free(memory); }  // NOLINT

namespace kvr {
namespace {

constexpr std::uint32_t kBlockSize = 16;
constexpr std::size_t kPromptTokens = 2048;

testing::FakeWorkerSignals make_fleet(std::size_t workers) {
  std::vector<testing::FakeWorker> fleet;
  fleet.reserve(workers);
  for (std::size_t i = 0; i < workers; ++i) {
    testing::FakeWorker worker;
    worker.worker = {static_cast<WorkerId>(i + 1), 0};
    const double cached_blocks = static_cast<double>((i % 32) * 64 / kBlockSize);
    worker.cache = selection::WorkerCacheInput{cached_blocks, 0, 0};
    worker.active_prefill_tokens = 16 * i;
    worker.load = selection::WorkerLoadInput::Values{
        .active_requests = i % 17,
        .active_prefill_tokens = 16 * i,
        .decode_cost_blocks = static_cast<double>(i % 127),
        .total_kv_blocks = 16384,
    };
    fleet.push_back(std::move(worker));
  }
  return testing::FakeWorkerSignals{std::move(fleet)};
}

// Warm selections of `policy` over `workers` workers, timed; allocations and time per worker as
// counters.
void run_selections(benchmark::State& state,
                    plugins::worker_selection::WorkerSelectionPolicy& policy,
                    const plugins::worker_selection::RoutingPartition& partition,
                    std::size_t workers) {
  auto signals = make_fleet(workers);
  std::vector<BlockHash> hashes(kPromptTokens / kBlockSize);
  for (std::size_t i = 0; i < hashes.size(); ++i) hashes[i] = i + 1;
  const selection::SelectionRequest request{
      .request_id = "bench", .prompt_tokens = kPromptTokens, .block_hashes = hashes};
  // Warm the host's scratch buffers; a warm selection is the steady state of a router.
  for (int i = 0; i < 3; ++i) (void)selection::select_worker(policy, request, partition, signals);

  const std::size_t allocations_before = g_allocations.load();
  std::size_t selections = 0;
  for (auto _ : state) {
    auto result = selection::select_worker(policy, request, partition, signals);
    benchmark::DoNotOptimize(result);
    ++selections;
  }
  const std::size_t allocations = g_allocations.load() - allocations_before;
  state.counters["allocs_per_selection"] =
      static_cast<double>(allocations) / static_cast<double>(std::max<std::size_t>(selections, 1));
  state.counters["ns_per_worker"] =
      benchmark::Counter(static_cast<double>(workers) * static_cast<double>(selections),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// The aggregated policy `config` selects from `registry`, built for the benchmark's partition.
std::optional<plugins::worker_selection::WorkerSelectionPolicy> build_policy(
    benchmark::State& state, plugins::RouterPluginRegistry& registry,
    const selection::RouterPolicyConfig& policies,
    const plugins::worker_selection::RouterConfig& config,
    const plugins::worker_selection::RoutingPartition& partition) {
  auto plugins = registry.resolve_plugins(policies);
  if (!plugins) {
    state.SkipWithError(std::string{plugins.error().message()}.c_str());
    return std::nullopt;
  }
  return plugins->selection_for(WorkerType::Aggregated)
      .factory(config, WorkerType::Aggregated, partition);
}

void BM_DefaultPolicySelection(benchmark::State& state) {
  const auto workers = static_cast<std::size_t>(state.range(0));
  const double temperature = static_cast<double>(state.range(1)) / 10.0;

  plugins::RouterPluginRegistry registry;
  if (!selection::register_builtin_policies(registry)) {
    state.SkipWithError("cannot register the built-in policies");
    return;
  }
  plugins::worker_selection::RouterConfig config;
  config.block_size = kBlockSize;
  config.temperature = temperature;
  config.seed = 42;
  const plugins::worker_selection::RoutingPartition partition{.model = "bench"};
  auto policy = build_policy(state, registry, selection::RouterPolicyConfig{}, config, partition);
  if (!policy) return;
  run_selections(state, *policy, partition, workers);
  state.SetLabel("T=" + std::to_string(temperature).substr(0, 3));
}

// One built-in policy by type name (0: kv-cost, 1: predicted-ttft) over the same fleet, side by
// side. predicted-ttft is measured as it runs after learning: one first token observed on every
// worker first, so that each carries its own factor.
void BM_BuiltinPolicySelection(benchmark::State& state) {
  const auto workers = static_cast<std::size_t>(state.range(0));
  const std::string type = state.range(1) == 0 ? "kv-cost" : "predicted-ttft";

  plugins::RouterPluginRegistry registry;
  if (!selection::register_builtin_policies(registry)) {
    state.SkipWithError("cannot register the built-in policies");
    return;
  }
  selection::RouterPolicyConfig policies;
  policies.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] = type;
  plugins::worker_selection::RouterConfig config;
  config.block_size = kBlockSize;
  const plugins::worker_selection::RoutingPartition partition{.model = "bench"};
  auto policy = build_policy(state, registry, policies, config, partition);
  if (!policy) return;
  selection::SelectionHost& host = selection::SelectionHost::of(*policy);
  const std::chrono::steady_clock::time_point start{};
  for (std::size_t i = 0; i < workers; ++i) {
    const std::string id = "warm-" + std::to_string(i);
    host.notify_routed({.request_id = id,
                        .worker = {static_cast<WorkerId>(i + 1), 0},
                        .prompt_tokens = kPromptTokens,
                        .block_size = kBlockSize,
                        .cache = selection::WorkerCacheInput{},
                        .load = selection::WorkerLoadInput{selection::WorkerLoadInput::Values{
                            .active_prefill_tokens = 16 * i}},
                        .routed_at = start});
    (void)host.notify_first_token(id, start + std::chrono::milliseconds{40 + i % 50});
  }
  run_selections(state, *policy, partition, workers);
  state.SetLabel(type);
}

// cache-headroom, registered by the compiled-in catalog (plugin 0) or by the plugin (plugin 1).
void BM_ExamplePolicySelection(benchmark::State& state) {
  const auto workers = static_cast<std::size_t>(state.range(0));
  const bool from_plugin = state.range(1) == 1;

  plugins::RouterPluginRegistry registry;
  if (!selection::register_builtin_policies(registry)) {  // the other roles' default
    state.SkipWithError("cannot register the built-in policies");
    return;
  }
  if (from_plugin) {
    const std::vector<std::string> paths{KVR_BENCH_EXAMPLE_PLUGIN};
    if (auto loaded = plugins::load_plugins(paths, registry); !loaded) {
      state.SkipWithError(loaded.error().c_str());
      return;
    }
  } else if (auto registered = examples::register_example_catalog(registry); !registered) {
    state.SkipWithError(std::string{registered.error().message()}.c_str());
    return;
  }
  selection::RouterPolicyConfig policies;
  policies.worker_selection[static_cast<std::size_t>(WorkerType::Aggregated)] =
      std::string{examples::kCacheHeadroomPolicyType};
  plugins::worker_selection::RouterConfig config;
  config.block_size = kBlockSize;
  const plugins::worker_selection::RoutingPartition partition{.model = "bench"};
  auto policy = build_policy(state, registry, policies, config, partition);
  if (!policy) return;
  run_selections(state, *policy, partition, workers);
  state.SetLabel(from_plugin ? "plugin" : "compiled-in");
}

BENCHMARK(BM_DefaultPolicySelection)
    ->ArgNames({"workers", "temperature_x10"})
    ->ArgsProduct({{2, 32, 1024, 10000}, {0, 7}})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_BuiltinPolicySelection)
    ->ArgNames({"workers", "policy"})
    ->ArgsProduct({{32, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(BM_ExamplePolicySelection)
    ->ArgNames({"workers", "plugin"})
    ->ArgsProduct({{32, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvr

BENCHMARK_MAIN();
