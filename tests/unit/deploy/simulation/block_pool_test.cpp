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

}  // namespace
}  // namespace kvr::simulation
