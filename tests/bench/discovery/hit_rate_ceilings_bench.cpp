// What the hit-rate ceilings cost a node per routed request (docs/performance.md): the bundled
// Mooncake conversation trace, expanded at an engine block size, through one partition's
// ceilings with the node's default workload cache and a fleet of 16 workers' KV. The counters
// give the ceilings' rates, so that a run also shows what the bounded workload cache loses
// against an infinite one.
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>

#include "deploy/simulation/mooncake_trace.hpp"
#include "messages/metrics/hit_rate_ceilings.hpp"

namespace kvr::metrics {
namespace {

struct ExpandedTrace {
  std::vector<simulation::TraceRequest> requests;
  std::vector<std::vector<BlockHash>> hashes;
};

const ExpandedTrace& trace_at(std::uint32_t block_size) {
  static std::vector<std::pair<std::uint32_t, ExpandedTrace>> cache;
  for (const auto& [size, trace] : cache) {
    if (size == block_size) return trace;
  }
  ExpandedTrace expanded;
  if (auto loaded = simulation::load_mooncake_trace(KVR_MOONCAKE_TRACE_PATH)) {
    expanded.requests = std::move(*loaded);
    for (const auto& request : expanded.requests) {
      expanded.hashes.push_back(simulation::expand_to_block_hashes(request, block_size));
    }
  }
  return cache.emplace_back(block_size, std::move(expanded)).second;
}

void BM_HitRateCeilings(benchmark::State& state) {
  const auto block_size = static_cast<std::uint32_t>(state.range(0));
  const ExpandedTrace& trace = trace_at(block_size);
  if (trace.requests.empty()) {
    state.SkipWithError("cannot read " KVR_MOONCAKE_TRACE_PATH);
    return;
  }
  // 16 workers of 16384 blocks of 16 tokens, whatever the block size.
  const std::uint64_t fleet_blocks = 16 * 16384 * 16 / block_size;
  std::uint64_t prompt = 0;
  std::uint64_t workload = 0;
  std::uint64_t capacity = 0;
  std::uint64_t requests = 0;
  std::size_t tracked = 0;
  for (auto _ : state) {
    HitRateCeilings ceilings{
        {.workload_tokens = kDefaultWorkloadTokens, .resolution_tokens = kNodeResolutionTokens}};
    prompt = workload = capacity = 0;
    for (std::size_t i = 0; i < trace.requests.size(); ++i) {
      const auto cached = ceilings.record(trace.hashes[i], trace.requests[i].input_length,
                                          block_size, fleet_blocks);
      prompt += trace.requests[i].input_length;
      workload += cached.workload_tokens;
      capacity += cached.capacity_tokens;
    }
    requests += trace.requests.size();
    tracked = ceilings.tracked_blocks();
  }
  const auto total = static_cast<double>(prompt);
  state.SetItemsProcessed(static_cast<std::int64_t>(requests));
  state.counters["workload"] = static_cast<double>(workload) / total;
  state.counters["capacity"] = static_cast<double>(capacity) / total;
  // The exact ceilings, to compare with.
  state.counters["exact_workload"] =
      simulation::infinite_cache_hit_rate(trace.requests, trace.hashes, block_size);
  state.counters["exact_capacity"] =
      simulation::capacity_bound_hit_rate(trace.requests, trace.hashes, block_size, fleet_blocks);
  state.counters["tracked_blocks"] = static_cast<double>(tracked);
}
BENCHMARK(BM_HitRateCeilings)->Arg(16)->Arg(64)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::metrics
