#include "messages/metrics/hit_rate_ceilings.hpp"

#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace kvr::metrics {
namespace {

constexpr std::uint32_t kBlockSize = 4;

TEST(HitRateCeilingsTest, ExactlyCountsTheLongestCachedPrefixButNeverTheLastToken) {
  HitRateCeilings ceilings;
  // 12 tokens: 3 full blocks, of which the last holds the token the engine always computes.
  auto first = ceilings.record(std::vector<BlockHash>{1, 2, 3}, 12, kBlockSize, 100);
  EXPECT_EQ(first.workload_tokens, 0);
  EXPECT_EQ(first.capacity_tokens, 0);
  auto again = ceilings.record(std::vector<BlockHash>{1, 2, 3}, 12, kBlockSize, 100);
  EXPECT_EQ(again.workload_tokens, 8);
  EXPECT_EQ(again.capacity_tokens, 8);
  // A longer prompt reuses all three, then misses its fourth block.
  auto longer = ceilings.record(std::vector<BlockHash>{1, 2, 3, 4}, 17, kBlockSize, 100);
  EXPECT_EQ(longer.workload_tokens, 12);
}

TEST(HitRateCeilingsTest, AMissEndsThePrefix) {
  HitRateCeilings ceilings;
  ceilings.record(std::vector<BlockHash>{1, 2, 3}, 13, kBlockSize, 100);
  const auto other_head = ceilings.record(std::vector<BlockHash>{9, 2, 3}, 13, kBlockSize, 100);
  EXPECT_EQ(other_head.workload_tokens, 0);
  EXPECT_EQ(other_head.capacity_tokens, 0);
}

TEST(HitRateCeilingsTest, TheCapacityBoundCacheEvictsAPromptsTailFirst) {
  HitRateCeilings ceilings;
  ceilings.record(std::vector<BlockHash>{1, 2, 3}, 13, kBlockSize, 3);
  // A fourth block evicts the least recently used: the first prompt's tail.
  ceilings.record(std::vector<BlockHash>{4}, 5, kBlockSize, 3);
  const auto again = ceilings.record(std::vector<BlockHash>{1, 2, 3}, 13, kBlockSize, 3);
  EXPECT_EQ(again.workload_tokens, 12);
  EXPECT_EQ(again.capacity_tokens, 8);
}

TEST(HitRateCeilingsTest, AFleetWithoutKvCachesNothingAndAShrinkingFleetEvicts) {
  HitRateCeilings ceilings;
  ceilings.record(std::vector<BlockHash>{1, 2}, 9, kBlockSize, 0);
  auto none = ceilings.record(std::vector<BlockHash>{1, 2}, 9, kBlockSize, 0);
  EXPECT_EQ(none.workload_tokens, 8);
  EXPECT_EQ(none.capacity_tokens, 0);

  ceilings.record(std::vector<BlockHash>{1, 2}, 9, kBlockSize, 10);
  // The fleet lost all but one block's worth of KV: only the most recent (the prompt's head)
  // stays.
  const auto shrunk = ceilings.record(std::vector<BlockHash>{1, 2}, 9, kBlockSize, 1);
  EXPECT_EQ(shrunk.capacity_tokens, 4);
}

TEST(HitRateCeilingsTest, ANodesWorkloadCacheIsBoundedButNeverSmallerThanTheFleets) {
  HitRateCeilings ceilings{{.workload_tokens = 100 * kBlockSize}};
  BlockHash next = 1;
  for (int request = 0; request < 200; ++request) {
    std::vector<BlockHash> blocks;
    for (int i = 0; i < 50; ++i) blocks.push_back(next++);
    ceilings.record(blocks, 50 * kBlockSize, kBlockSize, 10);
  }
  EXPECT_EQ(ceilings.tracked_blocks(), 100U + 10U);
  // The fleet grew past the bound: the workload cache follows it.
  for (int request = 0; request < 10; ++request) {
    std::vector<BlockHash> blocks;
    for (int i = 0; i < 50; ++i) blocks.push_back(next++);
    ceilings.record(blocks, 50 * kBlockSize, kBlockSize, 300);
  }
  EXPECT_EQ(ceilings.tracked_blocks(), 300U + 300U);
  // A prompt 250 blocks back is still in both.
  std::vector<BlockHash> old;
  for (BlockHash i = next - 250; i < next - 200; ++i) old.push_back(i);
  const auto cached = ceilings.record(old, 50 * kBlockSize, kBlockSize, 300);
  EXPECT_EQ(cached.workload_tokens, 49 * kBlockSize);
  EXPECT_EQ(cached.capacity_tokens, 49 * kBlockSize);
}

TEST(HitRateCeilingsTest, ANodeTracksOneBlockPerStrideAndEstimatesWithinIt) {
  // 16 tokens at 4 per block: runs of 4 blocks tracked by their first (positions 0, 4, 8, ...).
  HitRateCeilings ceilings{{.resolution_tokens = 16}};
  std::vector<BlockHash> first;
  for (BlockHash i = 1; i <= 17; ++i) first.push_back(i);
  ceilings.record(first, 17 * kBlockSize + 1, kBlockSize, 1000);
  EXPECT_EQ(ceilings.tracked_blocks(), 2U * 5U);
  // A continuation proves every run, the last one (a single block) by its last block: exact.
  std::vector<BlockHash> longer = first;
  longer.push_back(18);
  EXPECT_EQ(ceilings.record(longer, 18 * kBlockSize + 1, kBlockSize, 1000).workload_tokens,
            17 * kBlockSize);
  // Ten blocks shared: the runs at 0 and 4 are proven by the one at 8, whose last block differs:
  // the prompt leaves it after its first block and before its last, so it holds 9 to 11 blocks,
  // estimated at 10 (exactly: 10).
  std::vector<BlockHash> branch(first.begin(), first.begin() + 10);
  for (BlockHash i = 100; branch.size() < 17; ++i) branch.push_back(i);
  const auto cached = ceilings.record(branch, 17 * kBlockSize + 1, kBlockSize, 1000);
  EXPECT_EQ(cached.workload_tokens, 10 * kBlockSize);
  EXPECT_EQ(cached.capacity_tokens, 10 * kBlockSize);
  // A prompt whose first block is new is known uncached.
  branch[0] = 999;
  EXPECT_EQ(ceilings.record(branch, 17 * kBlockSize + 1, kBlockSize, 1000).workload_tokens, 0U);
}

TEST(HitRateCeilingsTest, AnEvictedRunTailEndsThePrefixWhereItsHeldBlocksEnd) {
  HitRateCeilings ceilings{{.resolution_tokens = 16}};
  std::vector<BlockHash> first;
  for (BlockHash i = 1; i <= 8; ++i) first.push_back(i);
  ceilings.record(first, 8 * kBlockSize + 1, kBlockSize, 8);
  // Three new blocks push out the oldest: the tail of the run at 4 (blocks 6 to 8).
  ceilings.record(std::vector<BlockHash>{50, 51, 52}, 3 * kBlockSize + 1, kBlockSize, 8);
  const auto cached = ceilings.record(first, 8 * kBlockSize + 1, kBlockSize, 8);
  EXPECT_EQ(cached.workload_tokens, 8 * kBlockSize);
  EXPECT_EQ(cached.capacity_tokens, 5 * kBlockSize);
}

// Conversations over a few system prompts of different lengths, turns interleaved at random:
// each request is its conversation's history plus new blocks of its own; one turn in four of a
// long conversation regenerates an earlier answer (a branch inside the history).
std::vector<std::vector<BlockHash>> conversations(std::uint32_t seed) {
  std::mt19937_64 random{seed};
  constexpr int kConversations = 600;
  constexpr int kTurns = 6;
  std::vector<std::size_t> system_lengths;
  for (int s = 0; s < 10; ++s) system_lengths.push_back(3 + random() % 20);
  std::vector<std::vector<BlockHash>> histories(kConversations);
  std::vector<int> turns_left(kConversations, kTurns);
  std::vector<int> open;
  for (int c = 0; c < kConversations; ++c) {
    const auto system = random() % 10;
    for (BlockHash i = 0; i < system_lengths[system]; ++i) {
      histories[c].push_back(system * 100 + i);
    }
    open.push_back(c);
  }
  std::vector<std::vector<BlockHash>> requests;
  BlockHash next = 1'000'000;
  while (!open.empty()) {
    const std::size_t pick = random() % open.size();
    const int c = open[pick];
    auto& history = histories[c];
    if (history.size() > 30 && random() % 4 == 0)
      history.resize(history.size() - 1 - random() % 20);
    const auto new_blocks = 2 + random() % 30;
    for (std::size_t i = 0; i < new_blocks; ++i) history.push_back(next++);
    requests.push_back(history);
    if (--turns_left[c] == 0) {
      open[pick] = open.back();
      open.pop_back();
    }
  }
  return requests;
}

// The branches are the hard case: a run that two branches share is one entry, so the capacity
// cache holds a little more than an engine's would.
TEST(HitRateCeilingsTest, TheNodesResolutionKeepsTheRatesWithinTwoPointsOfTheExactOnes) {
  for (const std::uint32_t seed : {1U, 2U, 3U}) {
    const auto requests = conversations(seed);
    HitRateCeilings exact;
    // Runs of 8 blocks, as a node tracks 16-token blocks.
    HitRateCeilings strided{{.resolution_tokens = 8 * kBlockSize}};
    double prompt = 0;
    double exact_workload = 0;
    double exact_capacity = 0;
    double strided_workload = 0;
    double strided_capacity = 0;
    for (const auto& blocks : requests) {
      // A partial last block, as most prompts have.
      const std::uint64_t tokens = blocks.size() * kBlockSize + 1;
      const auto a = exact.record(blocks, tokens, kBlockSize, 20'000);
      const auto b = strided.record(blocks, tokens, kBlockSize, 20'000);
      prompt += static_cast<double>(tokens);
      exact_workload += static_cast<double>(a.workload_tokens);
      exact_capacity += static_cast<double>(a.capacity_tokens);
      strided_workload += static_cast<double>(b.workload_tokens);
      strided_capacity += static_cast<double>(b.capacity_tokens);
    }
    EXPECT_GT(exact_workload, exact_capacity + 0.05 * prompt) << "the fleet's memory costs hits";
    EXPECT_NEAR(strided_workload / prompt, exact_workload / prompt, 0.01) << "seed " << seed;
    EXPECT_NEAR(strided_capacity / prompt, exact_capacity / prompt, 0.025) << "seed " << seed;
  }
}

}  // namespace
}  // namespace kvr::metrics
