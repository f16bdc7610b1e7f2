// Trace benchmark: the Mooncake conversation trace (12,031 requests) against a fleet whose KV
// events come from per-worker caches filled by the requests routed to them: each worker's cache
// is the simulated engine's block pool (prefix reuse, LRU eviction of unreferenced blocks). Each
// request is one find_matches; the chosen worker's pool emits Removed (evictions) and Stored (new
// blocks) batches, applied for every replica of that worker. Only index calls are timed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>

#include "deploy/simulation/block_pool.hpp"
#include "deploy/simulation/mooncake_trace.hpp"
#include "discovery/indexer/kv_indexer.hpp"

namespace kvr::discovery {
namespace {

// Engine block size for the trace: the trace's own 512-token blocks.
constexpr std::uint32_t kEngineBlockSize = 512;
// Advertised capacity per worker, in 512-token blocks (65,536 tokens).
constexpr std::uint64_t kCapacityBlocks = 128;
constexpr std::size_t kBaseWorkers = 1000;

const std::vector<std::vector<BlockHash>>& trace_prompts() {
  static const std::vector<std::vector<BlockHash>> prompts = [] {
    std::vector<std::vector<BlockHash>> out;
    auto trace = simulation::load_mooncake_trace(KVR_MOONCAKE_TRACE_PATH);
    if (!trace) return out;
    for (const auto& request : *trace) {
      out.push_back(simulation::expand_to_block_hashes(request, kEngineBlockSize));
    }
    return out;
  }();
  return prompts;
}

// One worker's cache: the simulated engine's block pool of the advertised capacity.
class WorkerCache {
 public:
  WorkerCache() : pool_(kCapacityBlocks) {}

  // Serves `blocks` as an engine would (reuse the cached prefix, compute and store the rest,
  // release when done), fills `events` with what the pool announced, and returns the number of
  // leading blocks that were cached.
  std::size_t admit(const std::vector<BlockHash>& blocks, std::vector<KvEvent>& events) {
    const std::size_t length = std::min<std::size_t>(blocks.size(), kCapacityBlocks);
    const std::span<const BlockHash> prompt{blocks.data(), length};
    const std::size_t cached = pool_.match_prefix(prompt).blocks;
    held_.clear();
    for (std::size_t i = 0; i < cached; ++i) held_.push_back(pool_.acquire(prompt[i]));
    for (std::size_t i = cached; i < length; ++i) {
      const auto block = pool_.allocate();
      if (!block) break;
      pool_.commit(*block, prompt[i],
                   i > 0 ? std::optional<BlockHash>{prompt[i - 1]} : std::nullopt);
      held_.push_back(*block);
    }
    // Leaf first, so that a prompt's tail is evicted before its shared prefix.
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) pool_.release(*it);
    events = pool_.take_events();
    return cached;
  }

 private:
  simulation::BlockPool pool_;
  std::vector<simulation::BlockIndex> held_;
};

void BM_MooncakeTrace(benchmark::State& state) {
  const auto& prompts = trace_prompts();
  if (prompts.empty()) {
    state.SkipWithError("cannot read " KVR_MOONCAKE_TRACE_PATH);
    return;
  }
  const auto replicas = static_cast<std::size_t>(state.range(0)) / kBaseWorkers;
  std::vector<double> lookup_ns;
  double index_seconds = 0;
  std::uint64_t operations = 0;
  std::uint64_t requests = 0;
  std::uint64_t hit_blocks = 0;
  std::uint64_t prompt_blocks = 0;
  std::size_t residencies = 0;
  std::size_t memory = 0;
  std::uint64_t rejected = 0;
  for (auto _ : state) {
    KvIndexer index;
    std::vector<WorkerCache> caches(kBaseWorkers);
    std::vector<std::uint64_t> assigned(kBaseWorkers, 0);
    std::vector<EventId> next_id(kBaseWorkers * replicas, 1);
    for (std::size_t w = 0; w < kBaseWorkers * replicas; ++w) {
      (void)index.add_worker({w + 1, 0}, {kCapacityBlocks, 1, false});
    }
    MatchResult result;
    KvEventBatch batch;
    std::size_t round_robin = 0;
    lookup_ns.clear();
    lookup_ns.reserve(prompts.size());
    std::chrono::steady_clock::duration spent{};
    for (const auto& prompt : prompts) {
      auto begin = std::chrono::steady_clock::now();
      index.find_matches(prompt, result);
      auto end = std::chrono::steady_clock::now();
      spent += end - begin;
      lookup_ns.push_back(std::chrono::duration<double, std::nano>(end - begin).count());
      ++operations;
      // Route: most cached blocks, discounted by how many requests the worker already took;
      // the next round-robin worker competes with overlap 0 so cold prompts spread out.
      std::size_t chosen = round_robin++ % kBaseWorkers;
      double best = -static_cast<double>(assigned[chosen]);
      std::uint32_t chosen_overlap = 0;
      for (const WorkerMatch& match : result.matches()) {
        const std::size_t base = (match.worker.worker_id - 1) % kBaseWorkers;
        const double score = 4.0 * match.device_blocks - static_cast<double>(assigned[base]);
        if (score > best) {
          best = score;
          chosen = base;
          chosen_overlap = match.device_blocks;
        }
      }
      ++assigned[chosen];
      hit_blocks += chosen_overlap;
      prompt_blocks += prompt.size();
      caches[chosen].admit(prompt, batch.events);
      if (batch.events.empty()) continue;
      batch.incarnation = 1;
      for (std::size_t r = 0; r < replicas; ++r) {
        const std::size_t worker = chosen + r * kBaseWorkers;
        batch.worker = {worker + 1, 0};
        batch.event_id = next_id[worker]++;
        begin = std::chrono::steady_clock::now();
        const auto outcome = index.apply(batch);
        spent += std::chrono::steady_clock::now() - begin;
        if (outcome) rejected += outcome->rejected_events;
        ++operations;
      }
    }
    requests += prompts.size();
    index_seconds += std::chrono::duration<double>(spent).count();
    state.SetIterationTime(std::chrono::duration<double>(spent).count());
    residencies = index.residency_count();
    memory = index.memory_bytes();
  }
  std::sort(lookup_ns.begin(), lookup_ns.end());
  state.counters["ops_per_s"] = static_cast<double>(operations) / index_seconds;
  state.counters["requests_per_s"] = static_cast<double>(requests) / index_seconds;
  state.counters["lookup_p50_ns"] = lookup_ns[lookup_ns.size() / 2];
  state.counters["lookup_p99_ns"] = lookup_ns[lookup_ns.size() * 99 / 100];
  state.counters["hit_rate"] = static_cast<double>(hit_blocks) / static_cast<double>(prompt_blocks);
  state.counters["bytes_per_residency"] =
      static_cast<double>(memory) / static_cast<double>(std::max<std::size_t>(residencies, 1));
  state.counters["rejected_events"] = static_cast<double>(rejected);
}
BENCHMARK(BM_MooncakeTrace)
    ->ArgName("workers")
    ->Arg(1000)
    ->Arg(7000)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvr::discovery
