// Trace benchmark: the Mooncake conversation trace (12,031 requests) against a fleet whose KV
// events come from per-worker LRU caches filled by the requests routed to them. Each request is
// one find_matches; the chosen worker's cache emits Removed (evictions) and Stored (new blocks)
// batches, applied for every replica of that worker. Only index calls are timed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <list>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <benchmark/benchmark.h>

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

// One worker's cache: LRU over block hashes, most recent at the front.
class LruCache {
 public:
  // Touches `blocks` (leaf first, so a parent is never older than its children) and fills
  // `evicted` and the index of the first block that was not cached.
  std::size_t admit(const std::vector<BlockHash>& blocks, std::vector<BlockHash>& evicted) {
    const std::size_t length = std::min<std::size_t>(blocks.size(), kCapacityBlocks);
    std::size_t cached = 0;
    while (cached < length && position_.contains(blocks[cached])) ++cached;
    evicted.clear();
    for (std::size_t i = length; i-- > 0;) {
      auto it = position_.find(blocks[i]);
      if (it != position_.end()) {
        order_.splice(order_.begin(), order_, it->second);
      } else {
        order_.push_front(blocks[i]);
        position_[blocks[i]] = order_.begin();
      }
    }
    while (order_.size() > kCapacityBlocks) {
      evicted.push_back(order_.back());
      position_.erase(order_.back());
      order_.pop_back();
    }
    return cached;
  }

 private:
  std::list<BlockHash> order_;
  absl::flat_hash_map<BlockHash, std::list<BlockHash>::iterator> position_;
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
    std::vector<LruCache> caches(kBaseWorkers);
    std::vector<std::uint64_t> assigned(kBaseWorkers, 0);
    std::vector<EventId> next_id(kBaseWorkers * replicas, 1);
    for (std::size_t w = 0; w < kBaseWorkers * replicas; ++w) {
      (void)index.add_worker({w + 1, 0}, {kCapacityBlocks, 1, false});
    }
    MatchResult result;
    std::vector<BlockHash> evicted;
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
      const std::size_t cached = caches[chosen].admit(prompt, evicted);
      const std::size_t stored_end = std::min<std::size_t>(prompt.size(), kCapacityBlocks);
      batch.events.clear();
      if (!evicted.empty()) batch.events.push_back(KvRemovedEvent{evicted, StorageTier::Device});
      if (cached < stored_end) {
        KvStoredEvent stored;
        if (cached > 0) stored.parent_hash = prompt[cached - 1];
        stored.block_hashes.assign(prompt.begin() + static_cast<std::ptrdiff_t>(cached),
                                   prompt.begin() + static_cast<std::ptrdiff_t>(stored_end));
        batch.events.push_back(std::move(stored));
      }
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
