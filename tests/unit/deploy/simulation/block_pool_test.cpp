#include "deploy/simulation/block_pool.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvr::simulation {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

KvEvent stored(std::optional<BlockHash> parent, std::vector<BlockHash> hashes) {
  return KvStoredEvent{parent, std::move(hashes), StorageTier::Device};
}

KvEvent removed(std::vector<BlockHash> hashes) {
  return KvRemovedEvent{std::move(hashes), StorageTier::Device};
}

// Allocates a block, commits it under hash (chained to parent) and releases it, leaving it cached.
void cache_block(BlockPool& pool, BlockHash hash, std::optional<BlockHash> parent) {
  const BlockIndex block = *pool.allocate();
  ASSERT_TRUE(pool.commit(block, hash, parent));
  pool.release(block);
}

TEST(BlockPoolTest, HandsOutFreeBlocksBeforeEvictingCachedOnes) {
  BlockPool pool(3);
  cache_block(pool, 10, std::nullopt);
  (void)pool.take_events();
  EXPECT_EQ(pool.free_blocks(), 2U);
  EXPECT_EQ(pool.cached_blocks(), 1U);

  ASSERT_TRUE(pool.allocate().has_value());
  ASSERT_TRUE(pool.allocate().has_value());
  EXPECT_TRUE(pool.contains(10));
  EXPECT_THAT(pool.take_events(), IsEmpty());

  ASSERT_TRUE(pool.allocate().has_value());
  EXPECT_FALSE(pool.contains(10));
  EXPECT_THAT(pool.take_events(), ElementsAre(removed({10})));
  EXPECT_EQ(pool.active_blocks(), 3U);
  EXPECT_FALSE(pool.allocate().has_value());
}

TEST(BlockPoolTest, EvictsLeastRecentlyReleasedFirstAndMergesRemovals) {
  BlockPool pool(3);
  std::vector<BlockIndex> blocks;
  for (BlockHash hash : {1, 2, 3}) {
    blocks.push_back(*pool.allocate());
    pool.commit(blocks.back(), hash, std::nullopt);
  }
  pool.release(blocks[1]);
  pool.release(blocks[2]);
  pool.release(blocks[0]);
  EXPECT_THAT(pool.eviction_order(), ElementsAre(2, 3, 1));
  (void)pool.take_events();

  ASSERT_TRUE(pool.allocate().has_value());
  ASSERT_TRUE(pool.allocate().has_value());
  EXPECT_THAT(pool.take_events(), ElementsAre(removed({2, 3})));
  EXPECT_THAT(pool.eviction_order(), ElementsAre(1));
}

TEST(BlockPoolTest, AcquiringCachedBlockProtectsItFromEviction) {
  BlockPool pool(2);
  cache_block(pool, 7, std::nullopt);
  cache_block(pool, 8, 7);
  EXPECT_THAT(pool.eviction_order(), ElementsAre(7, 8));

  pool.acquire(7);
  EXPECT_EQ(pool.active_blocks(), 1U);
  EXPECT_THAT(pool.eviction_order(), ElementsAre(8));
  EXPECT_EQ(pool.available_blocks(), 1U);
}

TEST(BlockPoolTest, MatchesLongestPresentPrefixAndCountsUnreferenced) {
  BlockPool pool(4);
  cache_block(pool, 1, std::nullopt);
  const BlockIndex held = *pool.allocate();
  pool.commit(held, 2, 1);
  cache_block(pool, 4, 3);

  const std::vector<BlockHash> prompt{1, 2, 3, 4};
  const PrefixMatch match = pool.match_prefix(prompt);
  EXPECT_EQ(match.blocks, 2U);
  EXPECT_EQ(match.unreferenced, 1U);
}

TEST(BlockPoolTest, CommitOfPresentHashLeavesBlockAnonymous) {
  BlockPool pool(2);
  const BlockIndex first = *pool.allocate();
  const BlockIndex second = *pool.allocate();
  EXPECT_TRUE(pool.commit(first, 5, std::nullopt));
  EXPECT_FALSE(pool.commit(second, 5, std::nullopt));
  EXPECT_THAT(pool.take_events(), ElementsAre(stored(std::nullopt, {5})));

  // The anonymous copy goes back to the free list, not to the cache.
  pool.release(second);
  EXPECT_EQ(pool.free_blocks(), 1U);
  EXPECT_EQ(pool.cached_blocks(), 0U);
}

TEST(BlockPoolTest, StoredEventsMergeAlongAChainOnly) {
  BlockPool pool(4);
  pool.commit(*pool.allocate(), 1, std::nullopt);
  pool.commit(*pool.allocate(), 2, 1);
  pool.commit(*pool.allocate(), 3, 2);
  pool.commit(*pool.allocate(), 9, 1);
  EXPECT_THAT(pool.take_events(), ElementsAre(stored(std::nullopt, {1, 2, 3}), stored(1, {9})));
  EXPECT_THAT(pool.take_events(), IsEmpty());
}

TEST(BlockPoolTest, ClearFreesEverythingAndQueuesCleared) {
  BlockPool pool(2);
  cache_block(pool, 1, std::nullopt);
  (void)pool.allocate();
  (void)pool.take_events();

  pool.clear();
  EXPECT_THAT(pool.take_events(), ElementsAre(KvEvent{KvClearedEvent{}}));
  EXPECT_EQ(pool.free_blocks(), 2U);
  EXPECT_EQ(pool.active_blocks(), 0U);
  EXPECT_FALSE(pool.contains(1));
  EXPECT_THAT(pool.dump(), IsEmpty());
}

TEST(BlockPoolTest, DumpEmitsChainsParentFirst) {
  BlockPool pool(5);
  cache_block(pool, 1, std::nullopt);
  cache_block(pool, 2, 1);
  cache_block(pool, 3, 2);
  cache_block(pool, 4, 2);
  cache_block(pool, 6, 5);  // its parent is not in the pool
  EXPECT_THAT(pool.dump(), ElementsAre(KvStoredEvent{std::nullopt, {1, 2, 3}, StorageTier::Device},
                                       KvStoredEvent{2, {4}, StorageTier::Device},
                                       KvStoredEvent{5, {6}, StorageTier::Device}));
}

// A pool of six blocks: 1 <- 2 <- 3 cached (released tail first), 7 held, two free.
void fill_mixed(BlockPool& pool) {
  std::vector<BlockIndex> chain;
  for (BlockHash hash : {1, 2, 3}) {
    chain.push_back(*pool.allocate());
    ASSERT_TRUE(
        pool.commit(chain.back(), hash, hash == 1 ? std::nullopt : std::optional(hash - 1)));
  }
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) pool.release(*it);
  ASSERT_TRUE(pool.commit(*pool.allocate(), 7, std::nullopt));
  (void)pool.take_events();
}

TEST(BlockPoolTest, AllocateRunTakesFreeThenEvictsAsSingleAllocationsWould) {
  BlockPool runs(6);
  BlockPool singles(6);
  fill_mixed(runs);
  fill_mixed(singles);
  std::vector<BlockIndex> from_run;
  EXPECT_EQ(runs.allocate_run(4, from_run), 4U);
  std::vector<BlockIndex> from_singles;
  for (int i = 0; i < 4; ++i) from_singles.push_back(*singles.allocate());
  EXPECT_EQ(from_run, from_singles);
  EXPECT_THAT(runs.take_events(), ElementsAre(removed({3, 2})));
  EXPECT_EQ(runs.eviction_order(), singles.eviction_order());
  EXPECT_EQ(runs.free_blocks(), 0U);

  // Only block 1 is left to evict: the run stops short instead of failing.
  EXPECT_EQ(runs.allocate_run(3, from_run), 1U);
  EXPECT_EQ(from_run.size(), 5U);
  EXPECT_EQ(runs.active_blocks(), 6U);
}

TEST(BlockPoolTest, CommitRunChainsLikeSingleCommitsAndSkipsPresentHashes) {
  BlockPool runs(8);
  BlockPool singles(8);
  for (BlockPool* pool : {&runs, &singles}) {
    // Hash 12 is already held by another block, so it stays anonymous in the run.
    ASSERT_TRUE(pool->commit(*pool->allocate(), 12, std::nullopt));
    (void)pool->take_events();
  }
  const std::vector<BlockHash> hashes{10, 11, 12, 13};
  std::vector<BlockIndex> blocks;
  ASSERT_EQ(runs.allocate_run(hashes.size(), blocks), hashes.size());
  runs.commit_run(blocks, hashes, 9);
  std::optional<BlockHash> parent = 9;
  for (const BlockHash hash : hashes) {
    singles.commit(*singles.allocate(), hash, parent);
    parent = hash;
  }
  const auto events = runs.take_events();
  EXPECT_THAT(events, ElementsAre(stored(9, {10, 11}), stored(12, {13})));
  EXPECT_EQ(events, singles.take_events());
  EXPECT_EQ(runs.dump(), singles.dump());
}

TEST(BlockPoolTest, MatchPrefixListsTheBlocksThatAcquireBlockTakes) {
  BlockPool pool(4);
  cache_block(pool, 1, std::nullopt);
  cache_block(pool, 2, 1);
  cache_block(pool, 9, std::nullopt);
  const std::vector<BlockHash> prompt{1, 2, 3};
  std::vector<BlockIndex> found{42};  // replaced, not appended to
  const PrefixMatch match = pool.match_prefix(prompt, found);
  EXPECT_EQ(match.blocks, 2U);
  EXPECT_EQ(match.unreferenced, 2U);
  ASSERT_EQ(found.size(), 2U);
  for (const BlockIndex block : found) pool.acquire_block(block);
  EXPECT_EQ(found[0], pool.acquire(1));
  EXPECT_EQ(pool.active_blocks(), 2U);
  EXPECT_THAT(pool.eviction_order(), ElementsAre(9));
}

TEST(BlockPoolTest, MovedPoolStillFindsItsBlocksByHash) {
  std::vector<BlockPool> pools;
  pools.emplace_back(4);
  cache_block(pools[0], 1, std::nullopt);
  pools.emplace_back(4);
  pools.emplace_back(4);  // reallocates, moving pools[0] and its hash index
  EXPECT_TRUE(pools[0].contains(1));
  cache_block(pools[0], 2, 1);
  EXPECT_EQ(pools[0].match_prefix(std::vector<BlockHash>{1, 2}).blocks, 2U);
  EXPECT_FALSE(pools[1].contains(1));
}

}  // namespace
}  // namespace kvr::simulation
