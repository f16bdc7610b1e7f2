#include "deploy/bridge/kv_translator.hpp"

#include <numeric>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"

namespace kvr::bridge {
namespace {

constexpr WorkerId kWorker = 42;
constexpr Incarnation kIncarnation = 7;
constexpr std::uint32_t kBlockSize = 4;

std::vector<std::uint32_t> tokens(std::uint32_t first, std::uint32_t count) {
  std::vector<std::uint32_t> out(count);
  std::iota(out.begin(), out.end(), first);
  return out;
}

std::vector<BlockHash> kvr_hashes(const std::vector<std::uint32_t>& prompt,
                                  std::string_view cache_namespace = {}) {
  return discovery::BlockHasher{kBlockSize, cache_namespace}.sequence_hashes(prompt);
}

KvTranslator make_translator(std::uint32_t ranks = 1, std::uint64_t capacity = 1000) {
  auto translator = KvTranslator::create(TranslatorOptions{.worker_id = kWorker,
                                                           .incarnation = kIncarnation,
                                                           .block_size = kBlockSize,
                                                           .data_parallel_size = ranks,
                                                           .capacity_blocks = capacity});
  EXPECT_TRUE(translator) << translator.error();
  return std::move(*translator);
}

EngineBlockStored stored(std::vector<EngineBlockHash> hashes, std::optional<EngineBlockHash> parent,
                         std::vector<std::uint32_t> token_ids, std::string medium = "GPU") {
  return EngineBlockStored{.block_hashes = std::move(hashes),
                           .parent_block_hash = parent,
                           .token_ids = std::move(token_ids),
                           .block_size = kBlockSize,
                           .medium = std::move(medium)};
}

EngineKvEventBatch batch_of(std::vector<EngineKvEvent> events) {
  return EngineKvEventBatch{.events = std::move(events)};
}

TEST(KvTranslatorTest, RecomputesKvrHashesFromTheTokens) {
  KvTranslator translator = make_translator();
  auto batch = translator.translate(0, batch_of({stored({901, 902}, std::nullopt, tokens(0, 8))}));
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->worker, (WorkerWithDpRank{kWorker, 0}));
  EXPECT_EQ(batch->incarnation, kIncarnation);
  EXPECT_EQ(batch->event_id, 1U);
  ASSERT_EQ(batch->events.size(), 1U);
  EXPECT_EQ(std::get<KvStoredEvent>(batch->events[0]),
            (KvStoredEvent{.parent_hash = std::nullopt,
                           .block_hashes = kvr_hashes(tokens(0, 8)),
                           .tier = StorageTier::Device}));
  EXPECT_EQ(translator.kvr_hash_of(0, 902), kvr_hashes(tokens(0, 8))[1]);
}

TEST(KvTranslatorTest, ContinuesAChainFromTheParentsKvrHash) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4))})));
  auto batch = translator.translate(0, batch_of({stored({902, 903}, 901, tokens(4, 8))}));
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->event_id, 2U);
  const auto whole = kvr_hashes(tokens(0, 12));
  EXPECT_EQ(std::get<KvStoredEvent>(batch->events[0]),
            (KvStoredEvent{.parent_hash = whole[0],
                           .block_hashes = {whole[1], whole[2]},
                           .tier = StorageTier::Device}));
}

TEST(KvTranslatorTest, HashesALoraChainInItsCacheNamespace) {
  KvTranslator translator = make_translator();
  EngineBlockStored named = stored({1}, std::nullopt, tokens(0, 4));
  named.lora_name = "adapter-a";
  named.lora_id = 3;
  EngineBlockStored numbered = stored({2}, std::nullopt, tokens(0, 4));
  numbered.lora_id = 3;
  auto batch = translator.translate(0, batch_of({named, numbered}));
  ASSERT_TRUE(batch);
  ASSERT_EQ(batch->events.size(), 2U);
  EXPECT_EQ(std::get<KvStoredEvent>(batch->events[0]).block_hashes,
            kvr_hashes(tokens(0, 4), "adapter-a"));
  EXPECT_EQ(std::get<KvStoredEvent>(batch->events[1]).block_hashes, kvr_hashes(tokens(0, 4), "3"));
  EXPECT_NE(kvr_hashes(tokens(0, 4), "3"), kvr_hashes(tokens(0, 4)));
}

TEST(KvTranslatorTest, TranslatesRemovalsThroughTheHashMap) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901, 902}, std::nullopt, tokens(0, 8))})));
  auto batch = translator.translate(
      0, batch_of({EngineBlockRemoved{.block_hashes = {902, 555}, .medium = "GPU"}}));
  ASSERT_TRUE(batch);
  EXPECT_EQ(
      std::get<KvRemovedEvent>(batch->events[0]),
      (KvRemovedEvent{.block_hashes = {kvr_hashes(tokens(0, 8))[1]}, .tier = StorageTier::Device}));
  EXPECT_EQ(translator.stats().unknown_removed_blocks, 1U);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 1U);
  EXPECT_FALSE(translator.kvr_hash_of(0, 902));
}

TEST(KvTranslatorTest, ARemovalOfOnlyUnknownHashesUsesNoEventId) {
  KvTranslator translator = make_translator();
  EXPECT_FALSE(translator.translate(0, batch_of({EngineBlockRemoved{.block_hashes = {1, 2}}})));
  EXPECT_EQ(translator.stats().unknown_removed_blocks, 2U);
  auto batch = translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4))}));
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->event_id, 1U);
}

TEST(KvTranslatorTest, MapsMediaToTiersAndCountsUnknownOnes) {
  EXPECT_EQ(tier_of_medium(""), StorageTier::Device);
  EXPECT_EQ(tier_of_medium("GPU"), StorageTier::Device);
  EXPECT_EQ(tier_of_medium("cpu"), StorageTier::Host);
  EXPECT_EQ(tier_of_medium("DISK"), StorageTier::Disk);
  EXPECT_EQ(tier_of_medium("NVME_OF"), std::nullopt);

  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4))})));
  auto batch =
      translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4), "CPU"),
                                        stored({902}, std::nullopt, tokens(8, 4), "SSD")}));
  ASSERT_TRUE(batch);
  ASSERT_EQ(batch->events.size(), 1U);
  EXPECT_EQ(std::get<KvStoredEvent>(batch->events[0]).tier, StorageTier::Host);
  EXPECT_EQ(translator.stats().unknown_media, 1U);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Host), 1U);

  // Removing the host copy keeps the device one, and the engine hash stays known.
  ASSERT_TRUE(translator.translate(
      0, batch_of({EngineBlockRemoved{.block_hashes = {901}, .medium = "CPU"}})));
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Host), 0U);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 1U);
  EXPECT_TRUE(translator.kvr_hash_of(0, 901));
}

TEST(KvTranslatorTest, SkipsAChainWithAnUnknownParent) {
  KvTranslator translator = make_translator();
  EXPECT_FALSE(translator.translate(0, batch_of({stored({902}, 901, tokens(4, 4))})));
  EXPECT_EQ(translator.stats().unknown_parents, 1U);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 0U);
}

TEST(KvTranslatorTest, SkipsAChainWhoseTokensDoNotFillItsBlocks) {
  KvTranslator translator = make_translator();
  EngineBlockStored other_size = stored({1}, std::nullopt, tokens(0, 8));
  other_size.block_size = 8;
  EXPECT_FALSE(translator.translate(0, batch_of({stored({1, 2}, std::nullopt, tokens(0, 7)),
                                                 other_size, stored({}, std::nullopt, {})})));
  EXPECT_EQ(translator.stats().bad_stored_events, 3U);
}

TEST(KvTranslatorTest, ForwardsAnEngineClearAndForgetsTheRank) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4))})));
  auto batch = translator.translate(0, batch_of({EngineAllBlocksCleared{}}));
  ASSERT_TRUE(batch);
  EXPECT_TRUE(std::holds_alternative<KvClearedEvent>(batch->events[0]));
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 0U);
  EXPECT_FALSE(translator.kvr_hash_of(0, 901));
}

TEST(KvTranslatorTest, ClearRankEmitsAClearedWithTheNextEventId) {
  KvTranslator translator = make_translator(2);
  ASSERT_TRUE(translator.translate(1, batch_of({stored({901}, std::nullopt, tokens(0, 4))})));
  auto cleared = translator.clear_rank(1);
  ASSERT_TRUE(cleared);
  EXPECT_EQ(cleared->worker.dp_rank, 1U);
  EXPECT_EQ(cleared->event_id, 2U);
  EXPECT_EQ(cleared->events, std::vector<KvEvent>{KvClearedEvent{}});
  auto dump = translator.dump(1);
  ASSERT_TRUE(dump);
  EXPECT_TRUE(dump->stored.empty());
  EXPECT_EQ(dump->last_event_id, 2U);
  EXPECT_EQ(translator.stats().ranks_cleared, 1U);
  EXPECT_FALSE(translator.clear_rank(2));
}

TEST(KvTranslatorTest, DumpsTheRanksPictureParentsFirst) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901}, std::nullopt, tokens(0, 4))})));
  ASSERT_TRUE(translator.translate(0, batch_of({stored({902}, 901, tokens(4, 4))})));
  ASSERT_TRUE(translator.translate(0, batch_of({stored({903}, std::nullopt, tokens(50, 4))})));
  auto dump = translator.dump(0);
  ASSERT_TRUE(dump);
  EXPECT_EQ(dump->worker, (WorkerWithDpRank{kWorker, 0}));
  EXPECT_EQ(dump->incarnation, kIncarnation);
  EXPECT_EQ(dump->last_event_id, 3U);
  // Loading the dump into a fresh index gives the same blocks.
  discovery::KvIndexer index;
  ASSERT_TRUE(
      index.add_worker({kWorker, 0}, {.capacity_blocks = 1000, .incarnation = kIncarnation}));
  ASSERT_TRUE(index.load_dump(*dump));
  const auto whole = kvr_hashes(tokens(0, 8));
  EXPECT_NE(index.tiers_held({kWorker, 0}, whole[1]), 0U);
  EXPECT_NE(index.tiers_held({kWorker, 0}, kvr_hashes(tokens(50, 4))[0]), 0U);
  EXPECT_EQ(index.blocks_held({kWorker, 0}, StorageTier::Device), 3U);
  EXPECT_EQ(index.last_event_id({kWorker, 0}), 3U);
}

TEST(KvTranslatorTest, CountsTheRemovalOfABlockEvictedWithItsAncestor) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({901, 902}, std::nullopt, tokens(0, 8))})));
  // Evicting the first block takes its descendant with it, as in the router's index.
  ASSERT_TRUE(translator.translate(0, batch_of({EngineBlockRemoved{.block_hashes = {901}}})));
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 0U);
  EXPECT_FALSE(translator.translate(0, batch_of({EngineBlockRemoved{.block_hashes = {902}}})));
  EXPECT_EQ(translator.stats().unknown_removed_blocks, 1U);
  // And a chain continuing the evicted block cannot be placed.
  EXPECT_FALSE(translator.translate(0, batch_of({stored({903}, 902, tokens(8, 4))})));
  EXPECT_EQ(translator.stats().unknown_parents, 1U);
}

TEST(KvTranslatorTest, ForwardsARemovalListingAParentBeforeItsChildAsThePictureAppliedIt) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(
      translator.translate(0, batch_of({stored({901, 902, 903}, std::nullopt, tokens(0, 12))})));
  // One event evicts the chain head first: the head takes the rest along, so the forwarded
  // event names only the head, and a router applying it is left where the picture is.
  auto batch = translator.translate(
      0, batch_of({EngineBlockRemoved{.block_hashes = {901, 902, 903}, .medium = "GPU"}}));
  ASSERT_TRUE(batch);
  ASSERT_EQ(batch->events.size(), 1U);
  EXPECT_EQ(std::get<KvRemovedEvent>(batch->events[0]),
            (KvRemovedEvent{.block_hashes = {kvr_hashes(tokens(0, 12))[0]},
                            .tier = StorageTier::Device}));
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 0U);
  EXPECT_EQ(translator.stats().refused_events, 0U);
  EXPECT_EQ(translator.stats().blocks_removed, 1U);
  EXPECT_EQ(translator.stats().unknown_removed_blocks, 2U);
  // The chain can be stored again under the same engine hashes.
  EXPECT_TRUE(
      translator.translate(0, batch_of({stored({901, 902, 903}, std::nullopt, tokens(0, 12))})));
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 3U);
}

TEST(KvTranslatorTest, RefusesWhatTheRanksCapacityCannotHold) {
  KvTranslator translator = make_translator(1, 2);
  EXPECT_FALSE(translator.translate(0, batch_of({stored({1, 2, 3}, std::nullopt, tokens(0, 12))})));
  EXPECT_EQ(translator.stats().refused_events, 1U);
}

TEST(KvTranslatorTest, KeepsEventIdsPerRankAndDropsUnknownRanks) {
  KvTranslator translator = make_translator(2);
  auto first = translator.translate(0, batch_of({stored({1}, std::nullopt, tokens(0, 4))}));
  auto second = translator.translate(1, batch_of({stored({1}, std::nullopt, tokens(0, 4))}));
  auto third = translator.translate(1, batch_of({EngineBlockRemoved{.block_hashes = {1}}}));
  ASSERT_TRUE(first && second && third);
  EXPECT_EQ(first->event_id, 1U);
  EXPECT_EQ(second->event_id, 1U);
  EXPECT_EQ(third->event_id, 2U);
  EXPECT_FALSE(translator.translate(2, batch_of({EngineAllBlocksCleared{}})));
  EXPECT_EQ(translator.stats().bad_rank_batches, 1U);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 1U);
}

TEST(KvTranslatorTest, ResetStartsANewIncarnationFromEventIdOne) {
  KvTranslator translator = make_translator();
  ASSERT_TRUE(translator.translate(0, batch_of({stored({1}, std::nullopt, tokens(0, 4))})));
  translator.reset(99);
  EXPECT_EQ(translator.blocks_held(0, StorageTier::Device), 0U);
  auto batch = translator.translate(0, batch_of({stored({1}, std::nullopt, tokens(0, 4))}));
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->incarnation, 99U);
  EXPECT_EQ(batch->event_id, 1U);
}

TEST(KvTranslatorTest, RejectsInvalidOptions) {
  EXPECT_FALSE(KvTranslator::create({.worker_id = 0, .capacity_blocks = 1}));
  EXPECT_FALSE(KvTranslator::create({.worker_id = 1, .block_size = 0, .capacity_blocks = 1}));
  EXPECT_FALSE(
      KvTranslator::create({.worker_id = 1, .data_parallel_size = 0, .capacity_blocks = 1}));
  EXPECT_FALSE(KvTranslator::create({.worker_id = 1, .capacity_blocks = 0}));
  EXPECT_TRUE(KvTranslator::create({.worker_id = 1})) << "no capacity: the engine did not say";
}

// Without a capacity a rank's picture is bounded as the router bounds such a rank (by the largest
// capacity a registration may announce), not by a capacity the engine never gave.
TEST(KvTranslatorTest, WithoutACapacityAChainLongerThanAnyGivenOneIsForwarded) {
  const std::uint32_t blocks = 2000;
  const auto long_chain = [&] {
    std::vector<EngineBlockHash> hashes(blocks);
    std::iota(hashes.begin(), hashes.end(), EngineBlockHash{1});
    return batch_of({stored(std::move(hashes), std::nullopt, tokens(0, blocks * kBlockSize))});
  };
  KvTranslator bounded = make_translator(1, 1000);
  EXPECT_FALSE(bounded.translate(0, long_chain()));
  EXPECT_EQ(bounded.stats().refused_events, 1U);

  auto unknown = KvTranslator::create(TranslatorOptions{
      .worker_id = kWorker, .incarnation = kIncarnation, .block_size = kBlockSize});
  ASSERT_TRUE(unknown) << unknown.error();
  ASSERT_TRUE(unknown->translate(0, long_chain()));
  EXPECT_EQ(unknown->blocks_held(0, StorageTier::Device), blocks);
}

TEST(SequenceTrackerTest, ClassifiesNextStaleAndGaps) {
  SequenceTracker tracker{2};
  using Verdict = SequenceTracker::Verdict;
  EXPECT_EQ(tracker.check(0, 0).verdict, Verdict::next);
  tracker.accept(0, 0);
  EXPECT_EQ(tracker.check(0, 1).verdict, Verdict::next);
  EXPECT_EQ(tracker.check(0, 0).verdict, Verdict::stale);
  const auto gap = tracker.check(0, 5);
  EXPECT_EQ(gap.verdict, Verdict::gap);
  EXPECT_EQ(gap.first_missing, 1U);
  tracker.accept(0, 5);
  EXPECT_EQ(tracker.expected(0), 6U);
  // Ranks are independent; a rank's first message after 0 is a gap from 0.
  EXPECT_FALSE(tracker.expected(1));
  const auto late_start = tracker.check(1, 3);
  EXPECT_EQ(late_start.verdict, Verdict::gap);
  EXPECT_EQ(late_start.first_missing, 0U);
  EXPECT_EQ(tracker.check(2, 0).verdict, Verdict::stale);
}

TEST(KvTranslatorTest, NamesTheCacheNamespaceOfAChain) {
  EngineBlockStored chain;
  EXPECT_EQ(cache_namespace_of(chain), "");
  chain.lora_id = 0;
  EXPECT_EQ(cache_namespace_of(chain), "");
  chain.lora_id = 12;
  EXPECT_EQ(cache_namespace_of(chain), "12");
  chain.lora_name = "sql-adapter";
  EXPECT_EQ(cache_namespace_of(chain), "sql-adapter");
}

}  // namespace
}  // namespace kvr::bridge
