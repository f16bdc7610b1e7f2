// KV indexer micro-benchmarks: find_matches latency by prompt length and fleet size, event
// application throughput and memory per (block, rank) residency. Build Release to quote numbers.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>

#include "discovery/block_hash.hpp"
#include "discovery/indexer/kv_indexer.hpp"

namespace kvr::discovery {
namespace {

std::uint64_t splitmix(std::uint64_t value) {
  value += 0x9E3779B97F4A7C15ULL;
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ULL;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBULL;
  return value ^ (value >> 31);
}

std::vector<BlockHash> extend(std::vector<BlockHash> prefix, std::size_t length,
                              std::uint64_t salt) {
  std::optional<BlockHash> parent;
  if (!prefix.empty()) parent = prefix.back();
  while (prefix.size() < length) {
    parent = BlockHasher::chain(parent, splitmix(salt * 1'000'003 + prefix.size()));
    prefix.push_back(*parent);
  }
  return prefix;
}

void report_percentiles(benchmark::State& state, std::vector<double>& samples_ns) {
  std::sort(samples_ns.begin(), samples_ns.end());
  auto at = [&](double q) {
    return samples_ns[static_cast<std::size_t>(q * static_cast<double>(samples_ns.size() - 1))];
  };
  state.counters["p50_ns"] = at(0.50);
  state.counters["p99_ns"] = at(0.99);
}

// A fleet where every rank holds a shared system prefix (a quarter of the prompt) and two private
// conversations extending it. The query is one rank's conversation: every rank matches the
// prefix, one matches all of it. Arguments: prompt blocks, ranks, and 1 to let every rank hold
// the whole query (the worst case: the answer lists every rank).
void BM_FindMatches(benchmark::State& state) {
  const auto blocks = static_cast<std::size_t>(state.range(0));
  const auto ranks = static_cast<std::size_t>(state.range(1));
  const bool all_hold_all = state.range(2) != 0;
  KvIndexer index;
  const auto system_prefix = extend({}, blocks / 4, 1);
  std::vector<std::vector<BlockHash>> queries;
  for (std::size_t r = 0; r < ranks; ++r) {
    const WorkerWithDpRank worker{r + 1, 0};
    (void)index.add_worker(worker, {4 * blocks + 64, 1, false});
    for (std::uint64_t conversation = 0; conversation < 2; ++conversation) {
      const auto prompt = all_hold_all ? extend(system_prefix, blocks, 7)
                                       : extend(system_prefix, blocks, 100 + r * 2 + conversation);
      (void)index.apply_event(worker, KvStoredEvent{std::nullopt, prompt, StorageTier::Device});
      if (queries.size() < 64) queries.push_back(prompt);
    }
  }
  MatchResult result;
  std::vector<double> samples;
  samples.reserve(1 << 20);
  std::size_t next = 0;
  for (auto _ : state) {
    const auto& query = queries[next++ % queries.size()];
    const auto begin = std::chrono::steady_clock::now();
    index.find_matches(query, result);
    const auto end = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(result.longest_match());
    if (samples.size() < samples.capacity()) {
      samples.push_back(std::chrono::duration<double, std::nano>(end - begin).count());
    }
  }
  report_percentiles(state, samples);
  state.counters["matches"] = static_cast<double>(result.matches().size());
}
BENCHMARK(BM_FindMatches)
    ->ArgNames({"blocks", "ranks", "all_hold_all"})
    ->ArgsProduct({{32, 128, 1024}, {100, 1000}, {0}})
    ->Args({32, 1000, 1})
    ->Args({128, 1000, 1})
    ->Unit(benchmark::kMicrosecond);

// Steady-state event application on one core: each iteration stores a 32-block chain that
// continues a prefix shared by all ranks, and removes (leaf first) the chain stored `window`
// iterations earlier. Counts stored + removed blocks. Memory per residency is measured at the end.
void BM_ApplyEvents(benchmark::State& state) {
  constexpr std::size_t kChain = 32;
  const auto ranks = static_cast<std::size_t>(state.range(0));
  const std::size_t window = ranks * 64;  // 64 live chains per rank: 2,048 blocks each
  KvIndexer index;
  const auto shared = extend({}, 8, 3);
  for (std::size_t r = 0; r < ranks; ++r) {
    const WorkerWithDpRank worker{r + 1, 0};
    (void)index.add_worker(worker, {4096, 1, false});
    (void)index.apply_event(worker, KvStoredEvent{std::nullopt, shared, StorageTier::Device});
  }
  auto chain_for = [&](std::uint64_t i, std::vector<BlockHash>& out) {
    out.clear();
    std::optional<BlockHash> parent = shared.back();
    for (std::size_t b = 0; b < kChain; ++b) {
      parent = BlockHasher::chain(parent, splitmix(i * 64 + b));
      out.push_back(*parent);
    }
  };
  KvEventBatch store_batch;
  store_batch.events.push_back(KvStoredEvent{shared.back(), {}, StorageTier::Device});
  KvEventBatch remove_batch;
  remove_batch.events.push_back(KvRemovedEvent{{}, StorageTier::Device});
  std::vector<EventId> next_id(ranks, 2);
  std::uint64_t i = 0;
  std::uint64_t blocks = 0;
  auto step = [&] {
    const std::size_t rank = i % ranks;
    store_batch.worker = {rank + 1, 0};
    store_batch.incarnation = 1;
    store_batch.event_id = next_id[rank]++;
    chain_for(i, std::get<KvStoredEvent>(store_batch.events[0]).block_hashes);
    (void)index.apply(store_batch);
    blocks += kChain;
    if (i >= window) {
      const std::uint64_t old = i - window;
      const std::size_t old_rank = old % ranks;
      auto& hashes = std::get<KvRemovedEvent>(remove_batch.events[0]).block_hashes;
      chain_for(old, hashes);
      std::reverse(hashes.begin(), hashes.end());
      remove_batch.worker = {old_rank + 1, 0};
      remove_batch.incarnation = 1;
      remove_batch.event_id = next_id[old_rank]++;
      (void)index.apply(remove_batch);
      blocks += kChain;
    }
    ++i;
  };
  // Fill to steady state before timing.
  while (i < window) step();
  blocks = 0;
  for (auto _ : state) step();
  state.counters["blocks_per_s"] =
      benchmark::Counter(static_cast<double>(blocks), benchmark::Counter::kIsRate);
  state.counters["bytes_per_residency"] =
      static_cast<double>(index.memory_bytes()) / static_cast<double>(index.residency_count());
  state.counters["residencies"] = static_cast<double>(index.residency_count());
  state.counters["errors"] =
      static_cast<double>(index.stats().error_count(IndexError::unknown_block) +
                          index.stats().error_count(IndexError::unknown_parent));
}
BENCHMARK(BM_ApplyEvents)->ArgName("ranks")->Arg(100)->Arg(1000)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvr::discovery

BENCHMARK_MAIN();
