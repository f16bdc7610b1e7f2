// KV indexer behaviour: prefix matching by tier, event ids and gaps, each bad event's error and
// its leaving the index consistent, capacity bounds, cascades, dumps.
#include "discovery/indexer/kv_indexer.hpp"

#include <vector>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"

namespace kvr::discovery {
namespace {

constexpr WorkerWithDpRank kWorkerA{11, 0};
constexpr WorkerWithDpRank kWorkerB{22, 0};
constexpr WorkerWithDpRank kWorkerB1{22, 1};

std::vector<BlockHash> chain_of(std::size_t length, std::uint64_t salt = 0) {
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < length; ++i) {
    parent = BlockHasher::chain(parent, salt * 1000 + i);
    hashes.push_back(*parent);
  }
  return hashes;
}

KvStoredEvent stored(std::span<const BlockHash> blocks, std::optional<BlockHash> parent = {},
                     StorageTier tier = StorageTier::Device) {
  return KvStoredEvent{parent, {blocks.begin(), blocks.end()}, tier};
}

class KvIndexerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(index_.add_worker(kWorkerA, {100, 1, false}));
    ASSERT_TRUE(index_.add_worker(kWorkerB, {100, 1, false}));
    ASSERT_TRUE(index_.add_worker(kWorkerB1, {100, 1, false}));
  }

  std::uint32_t matched(WorkerWithDpRank worker, std::span<const BlockHash> blocks) {
    index_.find_matches(blocks, result_);
    for (const WorkerMatch& match : result_.matches()) {
      if (match.worker == worker) return match.matched_blocks();
    }
    return 0;
  }

  void expect_consistent() {
    const auto consistent = index_.check_consistency();
    EXPECT_TRUE(consistent) << consistent.error();
  }

  KvIndexer index_;
  MatchResult result_;
  std::vector<BlockHash> prompt_ = chain_of(8);
};

TEST_F(KvIndexerTest, FindsTheLongestHeldPrefixPerRank) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(std::span(prompt_).first(6))));
  ASSERT_TRUE(index_.apply_event(kWorkerB1, stored(std::span(prompt_).first(2))));
  index_.find_matches(prompt_, result_);
  EXPECT_EQ(result_.matches().size(), 2U);
  EXPECT_EQ(result_.longest_match(), 6U);
  EXPECT_EQ(matched(kWorkerA, prompt_), 6U);
  EXPECT_EQ(matched(kWorkerB1, prompt_), 2U);
  EXPECT_EQ(matched(kWorkerB, prompt_), 0U);
}

TEST_F(KvIndexerTest, CountsEachMatchedBlockOnItsCheapestTier) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(std::span(prompt_).first(2))));
  ASSERT_TRUE(index_.apply_event(
      kWorkerA, stored(std::span(prompt_).subspan(2, 2), prompt_[1], StorageTier::Host)));
  ASSERT_TRUE(index_.apply_event(
      kWorkerA, stored(std::span(prompt_).subspan(1, 4), prompt_[0], StorageTier::Disk)));
  index_.find_matches(prompt_, result_);
  ASSERT_EQ(result_.matches().size(), 1U);
  const WorkerMatch& match = result_.matches()[0];
  EXPECT_EQ(match.device_blocks, 2U);
  EXPECT_EQ(match.host_blocks, 2U);
  EXPECT_EQ(match.disk_blocks, 1U);
  ASSERT_NE(result_.find(match.slot), nullptr);
  EXPECT_EQ(result_.find(match.slot)->worker, kWorkerA);
}

TEST_F(KvIndexerTest, PromptNotFollowingTheTreeStillMatchesHeldBlocks) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  const std::vector<BlockHash> skipping{prompt_[0], prompt_[2], prompt_[3]};
  EXPECT_EQ(matched(kWorkerA, skipping), 3U);
  const std::vector<BlockHash> starting_inside{prompt_[4], prompt_[5]};
  EXPECT_EQ(matched(kWorkerA, starting_inside), 2U);
}

TEST_F(KvIndexerTest, TracksEventIdsAndReportsGaps) {
  KvEventBatch batch{kWorkerA, 1, 1, {stored(std::span(prompt_).first(1))}};
  const auto first = index_.apply(batch);
  ASSERT_TRUE(first);
  EXPECT_FALSE(first->gap);
  batch.event_id = 5;
  batch.events = {stored(std::span(prompt_).subspan(1, 1), prompt_[0])};
  const auto gapped = index_.apply(batch);
  ASSERT_TRUE(gapped);
  EXPECT_EQ(gapped->gap, (EventGap{2, 5}));
  EXPECT_EQ(gapped->applied_events, 1U);
  EXPECT_EQ(index_.last_event_id(kWorkerA), 5U);
  EXPECT_EQ(index_.stats().event_id_gaps, 1U);
}

TEST_F(KvIndexerTest, RejectsDuplicateAndOutOfOrderEventIdsWithoutApplying) {
  ASSERT_TRUE(index_.apply(KvEventBatch{kWorkerA, 1, 3, {stored(std::span(prompt_).first(1))}}));
  const KvEventBatch again{kWorkerA, 1, 3, {KvClearedEvent{}}};
  EXPECT_EQ(index_.apply(again).error(), IndexError::duplicate_event_id);
  const KvEventBatch older{kWorkerA, 1, 2, {KvClearedEvent{}}};
  EXPECT_EQ(index_.apply(older).error(), IndexError::out_of_order_event_id);
  EXPECT_EQ(matched(kWorkerA, prompt_), 1U);
  EXPECT_EQ(index_.stats().error_count(IndexError::duplicate_event_id), 1U);
  EXPECT_EQ(index_.stats().error_count(IndexError::out_of_order_event_id), 1U);
}

TEST_F(KvIndexerTest, RejectsUnknownWorkerAndOtherIncarnation) {
  EXPECT_EQ(index_.apply(KvEventBatch{{99, 0}, 1, 1, {}}).error(), IndexError::unknown_worker);
  EXPECT_EQ(index_.apply(KvEventBatch{kWorkerA, 2, 1, {}}).error(),
            IndexError::incarnation_mismatch);
  EXPECT_EQ(index_.apply_event({11, 7}, KvClearedEvent{}).error(), IndexError::unknown_worker);
  EXPECT_EQ(index_.stats().error_count(IndexError::unknown_worker), 2U);
}

TEST_F(KvIndexerTest, RejectsStoredWithUnknownParent) {
  ASSERT_TRUE(index_.apply_event(kWorkerB, stored(std::span(prompt_).first(1))));
  // Worker A does not hold the parent even though worker B does.
  EXPECT_EQ(
      index_.apply_event(kWorkerA, stored(std::span(prompt_).subspan(1, 2), prompt_[0])).error(),
      IndexError::unknown_parent);
  EXPECT_EQ(matched(kWorkerA, prompt_), 0U);
  EXPECT_EQ(index_.node_count(), 1U);
  expect_consistent();
}

TEST_F(KvIndexerTest, RejectsStoredThatRelinksAKnownBlock) {
  ASSERT_TRUE(index_.apply_event(kWorkerB, stored(std::span(prompt_).first(3))));
  // prompt_[2] is known under prompt_[1]; worker A claims it is a first block.
  const std::vector<BlockHash> relinked{prompt_[2]};
  EXPECT_EQ(index_.apply_event(kWorkerA, stored(relinked)).error(), IndexError::parent_mismatch);
  EXPECT_EQ(index_.residency_count(), 3U);
  expect_consistent();
}

TEST_F(KvIndexerTest, RejectsStoredNamingANewBlockTwiceAndCreatesNothing) {
  const std::vector<BlockHash> repeated{prompt_[0], prompt_[1], prompt_[0]};
  EXPECT_EQ(index_.apply_event(kWorkerA, stored(repeated)).error(), IndexError::duplicate_block);
  EXPECT_EQ(index_.node_count(), 0U);
  EXPECT_EQ(index_.stats().error_count(IndexError::duplicate_block), 1U);
  expect_consistent();
}

TEST_F(KvIndexerTest, RejectsChainLongerThanCapacityAndBoundsEachRank) {
  IndexerConfig config;
  config.capacity_margin = 0.5;
  config.capacity_slack_blocks = 0;
  KvIndexer small(config);
  ASSERT_TRUE(small.add_worker(kWorkerA, {4, 1, false}));
  const auto long_prompt = chain_of(5, 1);
  EXPECT_EQ(small.apply_event(kWorkerA, stored(long_prompt)).error(), IndexError::chain_too_long);
  // Two chains of four fit in capacity 4 × 1.5 = 6 only partly: the second is refused whole.
  ASSERT_TRUE(small.apply_event(kWorkerA, stored(chain_of(4, 2))));
  EXPECT_EQ(small.apply_event(kWorkerA, stored(chain_of(4, 3))).error(),
            IndexError::capacity_exceeded);
  EXPECT_EQ(small.blocks_held(kWorkerA, StorageTier::Device), 4U);
  EXPECT_TRUE(small.check_consistency());
}

TEST_F(KvIndexerTest, RemovingUnknownBlocksRemovesTheKnownOnesAndReportsTheRest) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  const KvRemovedEvent removed{{prompt_[7], 12345, prompt_[6]}, StorageTier::Device};
  EXPECT_EQ(index_.apply_event(kWorkerA, removed).error(), IndexError::unknown_block);
  EXPECT_EQ(matched(kWorkerA, prompt_), 6U);
  // Held, but not on that tier.
  const KvRemovedEvent wrong_tier{{prompt_[5]}, StorageTier::Host};
  EXPECT_EQ(index_.apply_event(kWorkerA, wrong_tier).error(), IndexError::unknown_block);
  EXPECT_EQ(matched(kWorkerA, prompt_), 6U);
  expect_consistent();
}

TEST_F(KvIndexerTest, RemovingAMiddleBlockDropsTheRanksDescendants) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerB, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerA, KvRemovedEvent{{prompt_[3]}, StorageTier::Device}));
  EXPECT_EQ(matched(kWorkerA, prompt_), 3U);
  EXPECT_EQ(matched(kWorkerB, prompt_), 8U);
  EXPECT_EQ(index_.tiers_held(kWorkerA, prompt_[5]), 0U);
  EXPECT_EQ(index_.blocks_held(kWorkerA, StorageTier::Device), 3U);
  expect_consistent();
}

TEST_F(KvIndexerTest, BlocksAnEarlierRemovalDroppedReadAsUnknown) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerB, stored(prompt_)));
  // Removing prompt_[2] drops A's descendants too, which B still holds; then prompt_[2] again.
  const KvRemovedEvent shared{{prompt_[2], prompt_[5], prompt_[7], prompt_[2]},
                              StorageTier::Device};
  EXPECT_EQ(index_.apply_event(kWorkerA, shared).error(), IndexError::unknown_block);
  EXPECT_EQ(matched(kWorkerA, prompt_), 2U);
  EXPECT_EQ(matched(kWorkerB, prompt_), 8U);
  EXPECT_EQ(index_.blocks_held(kWorkerA, StorageTier::Device), 2U);
  // Only B held these: removing prompt_[1] frees the nodes below it, listed after it.
  const KvRemovedEvent own{{prompt_[1], prompt_[4], prompt_[1]}, StorageTier::Device};
  EXPECT_EQ(index_.apply_event(kWorkerB, own).error(), IndexError::unknown_block);
  EXPECT_EQ(matched(kWorkerB, prompt_), 1U);
  EXPECT_EQ(index_.node_count(), 2U);
  EXPECT_EQ(index_.stats().blocks_removed, 6U + 7U);
  expect_consistent();
}

TEST_F(KvIndexerTest, BlockOnAnotherTierSurvivesRemovalFromOne) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(
      kWorkerA, stored(std::span(prompt_).subspan(2, 1), prompt_[1], StorageTier::Host)));
  ASSERT_TRUE(index_.apply_event(kWorkerA, KvRemovedEvent{{prompt_[2]}, StorageTier::Device}));
  EXPECT_EQ(matched(kWorkerA, prompt_), 8U);
  index_.find_matches(prompt_, result_);
  EXPECT_EQ(result_.matches()[0].host_blocks, 1U);
  expect_consistent();
}

TEST_F(KvIndexerTest, ClearedAndRemoveWorkerDropEverythingOfTheRank) {
  ASSERT_TRUE(index_.apply_event(kWorkerB, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerB1, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  ASSERT_TRUE(index_.apply_event(kWorkerA, KvClearedEvent{}));
  EXPECT_EQ(matched(kWorkerA, prompt_), 0U);
  EXPECT_EQ(index_.remove_worker(22), 2U);
  EXPECT_EQ(index_.node_count(), 0U);
  EXPECT_FALSE(index_.slot_of(kWorkerB));
  EXPECT_EQ(index_.apply_event(kWorkerB, KvClearedEvent{}).error(), IndexError::unknown_worker);
  expect_consistent();
}

TEST_F(KvIndexerTest, DumpLoadsIntoAnEqualIndex) {
  ASSERT_TRUE(index_.apply(KvEventBatch{kWorkerA, 1, 9, {stored(prompt_)}}));
  ASSERT_TRUE(index_.apply_event(
      kWorkerA, stored(std::span(prompt_).subspan(3, 2), prompt_[2], StorageTier::Disk)));
  const auto dump = index_.dump(kWorkerA);
  ASSERT_TRUE(dump);
  EXPECT_EQ(dump->last_event_id, 9U);
  KvIndexer restored;
  ASSERT_TRUE(restored.add_worker(kWorkerA, {100, 1, false}));
  const auto loaded = restored.load_dump(*dump);
  ASSERT_TRUE(loaded);
  EXPECT_EQ(loaded->rejected_events, 0U);
  for (const BlockHash hash : prompt_) {
    EXPECT_EQ(restored.tiers_held(kWorkerA, hash), index_.tiers_held(kWorkerA, hash));
  }
  // Events continue after the dump's last id.
  EXPECT_TRUE(restored.apply(KvEventBatch{kWorkerA, 1, 10, {}}).value().gap == std::nullopt);
}

TEST_F(KvIndexerTest, LoadingADumpReplacesTheRanksContents) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(chain_of(3, 5))));
  const KvDump dump{kWorkerA, 1, 4, {stored(std::span(prompt_).first(2))}};
  ASSERT_TRUE(index_.load_dump(dump));
  EXPECT_EQ(matched(kWorkerA, chain_of(3, 5)), 0U);
  EXPECT_EQ(matched(kWorkerA, prompt_), 2U);
  EXPECT_EQ(index_.last_event_id(kWorkerA), 4U);
  EXPECT_EQ(index_.load_dump(KvDump{kWorkerA, 2, 4, {}}).error(), IndexError::incarnation_mismatch);
  expect_consistent();
}

TEST_F(KvIndexerTest, WarmLookupsReuseTheResultStorage) {
  ASSERT_TRUE(index_.apply_event(kWorkerA, stored(prompt_)));
  index_.find_matches(prompt_, result_);
  const WorkerMatch* storage = result_.matches().data();
  index_.find_matches(prompt_, result_);
  EXPECT_EQ(result_.matches().data(), storage);
  EXPECT_EQ(result_.matches().size(), 1U);
}

class ApproximateIndexTest : public ::testing::Test {
 protected:
  static IndexerConfig config() {
    IndexerConfig config;
    config.approximate_ttl = std::chrono::seconds(10);
    config.approximate_max_blocks = 6;
    return config;
  }
  KvIndexer index_{config()};
  MatchResult result_;
  std::chrono::steady_clock::time_point start_{};
};

TEST_F(ApproximateIndexTest, RoutedBlocksMatchUntilTheirTtlEnds) {
  ASSERT_TRUE(index_.add_worker(kWorkerA, {100, 0, true}));
  const auto prompt = chain_of(4);
  ASSERT_TRUE(index_.record_routing(kWorkerA, prompt, start_));
  index_.find_matches(prompt, result_);
  ASSERT_EQ(result_.matches().size(), 1U);
  EXPECT_EQ(result_.matches()[0].device_blocks, 4U);
  EXPECT_EQ(index_.expire(start_ + std::chrono::seconds(9)), 0U);
  EXPECT_EQ(index_.expire(start_ + std::chrono::seconds(10)), 4U);
  index_.find_matches(prompt, result_);
  EXPECT_TRUE(result_.matches().empty());
  EXPECT_TRUE(index_.check_consistency());
}

TEST_F(ApproximateIndexTest, RoutingAgainRefreshesTheSharedPrefix) {
  ASSERT_TRUE(index_.add_worker(kWorkerA, {100, 0, true}));
  const auto prompt = chain_of(4);
  ASSERT_TRUE(index_.record_routing(kWorkerA, prompt, start_));
  ASSERT_TRUE(index_.record_routing(kWorkerA, std::span(prompt).first(2),
                                    start_ + std::chrono::seconds(5)));
  index_.expire(start_ + std::chrono::seconds(12));
  index_.find_matches(prompt, result_);
  ASSERT_EQ(result_.matches().size(), 1U);
  EXPECT_EQ(result_.matches()[0].device_blocks, 2U);
  EXPECT_TRUE(index_.check_consistency());
}

TEST_F(ApproximateIndexTest, TotalSizeIsBoundedOldestFirst) {
  ASSERT_TRUE(index_.add_worker(kWorkerA, {100, 0, true}));
  ASSERT_TRUE(index_.add_worker(kWorkerB, {100, 0, true}));
  const auto first = chain_of(4, 1);
  const auto second = chain_of(4, 2);
  ASSERT_TRUE(index_.record_routing(kWorkerA, first, start_));
  ASSERT_TRUE(index_.record_routing(kWorkerB, second, start_ + std::chrono::seconds(1)));
  EXPECT_LE(index_.residency_count(), 6U);
  index_.find_matches(second, result_);
  ASSERT_EQ(result_.matches().size(), 1U);
  EXPECT_EQ(result_.matches()[0].device_blocks, 4U);
  index_.find_matches(first, result_);
  EXPECT_TRUE(result_.matches().empty());
  EXPECT_TRUE(index_.check_consistency());
}

}  // namespace
}  // namespace kvr::discovery
