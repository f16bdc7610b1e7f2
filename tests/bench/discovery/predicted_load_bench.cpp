// Predicted-load micro-benchmark: the per-request work of a selector's load ledger with many open
// bookings, as when clients do not report and bookings wait to expire. Each
// iteration prepares a candidate prompt, projects it onto every rank, books it on one rank and
// releases the oldest booking, so the number of open bookings stays at the argument.
//
// Prompts are a document prefix (32 to 64 chained blocks, 512 documents) plus 4 blocks of their
// own, booked on random ranks: a popular document's blocks are then active on many ranks, which
// is what makes the ledger's holder lists long.
#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "discovery/block_hash.hpp"
#include "discovery/load/predicted_load.hpp"

namespace kvr::discovery {
namespace {

constexpr std::size_t kDocuments = 512;
constexpr std::size_t kDocumentBlocks = 64;
constexpr std::size_t kOwnBlocks = 4;
constexpr std::size_t kPrompts = 4096;

struct Workload {
  std::vector<std::vector<BlockHash>> prompts;

  explicit Workload(std::uint64_t seed) {
    std::mt19937_64 random{seed};
    std::vector<std::vector<BlockHash>> documents(kDocuments);
    for (auto& document : documents) {
      std::optional<BlockHash> parent;
      for (std::size_t b = 0; b < kDocumentBlocks; ++b) {
        parent = BlockHasher::chain(parent, random());
        document.push_back(*parent);
      }
    }
    std::uniform_int_distribution<std::size_t> pick_document{0, kDocuments - 1};
    std::uniform_int_distribution<std::size_t> pick_length{kDocumentBlocks / 2, kDocumentBlocks};
    prompts.resize(kPrompts);
    for (auto& prompt : prompts) {
      const auto& document = documents[pick_document(random)];
      prompt.assign(document.begin(),
                    document.begin() + static_cast<std::ptrdiff_t>(pick_length(random)));
      std::optional<BlockHash> parent = prompt.back();
      for (std::size_t i = 0; i < kOwnBlocks; ++i) {
        parent = BlockHasher::chain(parent, random());
        prompt.push_back(*parent);
      }
    }
  }
};

// Arguments: open bookings kept, ranks.
void BM_PredictedLoadRequest(benchmark::State& state) {
  const auto open = static_cast<std::size_t>(state.range(0));
  const auto ranks = static_cast<std::size_t>(state.range(1));
  const Workload workload{20261129};
  PredictedLoad load;
  for (std::size_t r = 0; r < ranks; ++r) (void)load.add_rank({r + 1, 0}, 16'384);
  std::mt19937_64 random{7};
  std::uniform_int_distribution<std::size_t> pick_rank{0, ranks - 1};
  const auto expires_at = std::chrono::steady_clock::now() + std::chrono::hours(1);
  std::deque<std::string> booked;
  std::uint64_t sequence = 0;
  auto book = [&](const std::vector<BlockHash>& prompt) {
    std::string id = fmt::format("request-{}", sequence++);
    (void)load.book(BookingRequest{id, {pick_rank(random) + 1, 0}, prompt, 512, expires_at});
    booked.push_back(std::move(id));
  };
  for (std::size_t i = 0; i < open; ++i) book(workload.prompts[i % kPrompts]);

  ProjectionScratch scratch;
  std::size_t next = open;
  std::uint64_t new_blocks = 0;
  for (auto _ : state) {
    const auto& prompt = workload.prompts[next++ % kPrompts];
    load.prepare(prompt, scratch);
    const CandidateRequest candidate{prompt.size(), 1024};
    for (std::size_t r = 0; r < ranks; ++r) {
      new_blocks += load.project({r + 1, 0}, candidate, scratch)->new_blocks;
    }
    book(prompt);
    if (booked.size() > open) {
      (void)load.release(booked.front(), BookingEnd::completed);
      booked.pop_front();
    }
  }
  benchmark::DoNotOptimize(new_blocks);
  state.counters["active_blocks"] = static_cast<double>(load.active_block_count());
}

BENCHMARK(BM_PredictedLoadRequest)
    ->ArgNames({"open", "ranks"})
    ->Args({0, 64})
    ->Args({1'000, 64})
    ->Args({20'000, 64})
    ->Args({20'000, 1'024})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvr::discovery
