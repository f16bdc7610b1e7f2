// Long random event streams, good and bad, applied to the KV indexer and to a simple reference
// model: every event gets the same verdict, lookups give the same answers, the invariants hold,
// and a dump loaded into a fresh index answers the same.
#include <map>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "discovery/indexer/kv_indexer.hpp"
#include "tests/unit/discovery/reference_kv_index.hpp"

namespace kvr::discovery {
namespace {

using testing::ReferenceKvIndex;
using Answer = std::map<WorkerWithDpRank, std::array<std::uint32_t, 3>>;

IndexerConfig test_config() {
  IndexerConfig config;
  config.capacity_margin = 0.25;
  config.capacity_slack_blocks = 0;
  config.offload_capacity_factor = 2.0;
  return config;
}

// Prompts over a four-letter alphabet share prefixes often, so chains meet in the tree.
std::vector<std::vector<BlockHash>> make_prompts(std::mt19937_64& rng, std::size_t count) {
  std::vector<std::vector<BlockHash>> prompts;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t length = 1 + rng() % (i % 5 == 0 ? 22 : 10);
    std::vector<BlockHash> prompt;
    std::optional<BlockHash> parent;
    for (std::size_t j = 0; j < length; ++j) {
      parent = BlockHasher::chain(parent, rng() % 4);
      prompt.push_back(*parent);
    }
    prompts.push_back(std::move(prompt));
  }
  return prompts;
}

Answer answer_of(const MatchResult& result) {
  Answer answer;
  for (const WorkerMatch& match : result.matches()) {
    answer[match.worker] = {match.device_blocks, match.host_blocks, match.disk_blocks};
  }
  return answer;
}

class KvIndexerPropertyTest : public ::testing::TestWithParam<std::uint64_t> {
 protected:
  StorageTier random_tier() {
    const auto roll = rng_() % 10;
    return roll < 6 ? StorageTier::Device : roll < 8 ? StorageTier::Host : StorageTier::Disk;
  }

  const std::vector<BlockHash>& random_prompt() { return prompts_[rng_() % prompts_.size()]; }

  BlockHash random_known_hash() {
    const auto& prompt = random_prompt();
    return prompt[rng_() % prompt.size()];
  }

  KvEvent random_event(WorkerWithDpRank worker) {
    const auto roll = rng_() % 100;
    if (roll < 50) {
      // A chain continuing what the rank holds: the common, valid case.
      const auto& prompt = random_prompt();
      std::size_t held = 0;
      while (held < prompt.size() && reference_.holds(worker, prompt[held])) ++held;
      const std::size_t start = rng_() % (held + 1);
      if (start >= prompt.size()) return KvStoredEvent{std::nullopt, {}, StorageTier::Device};
      const std::size_t end = start + 1 + rng_() % (prompt.size() - start);
      KvStoredEvent stored;
      if (start > 0) stored.parent_hash = prompt[start - 1];
      stored.block_hashes.assign(prompt.begin() + static_cast<std::ptrdiff_t>(start),
                                 prompt.begin() + static_cast<std::ptrdiff_t>(end));
      stored.tier = random_tier();
      return stored;
    }
    if (roll < 58) {
      // Arbitrary parent and blocks: unknown parents, mismatches, duplicates.
      KvStoredEvent stored;
      if (rng_() % 2) stored.parent_hash = random_known_hash();
      const std::size_t length = 1 + rng_() % 4;
      for (std::size_t i = 0; i < length; ++i) {
        stored.block_hashes.push_back(rng_() % 3 == 0 ? rng_() : random_known_hash());
      }
      if (rng_() % 3 == 0) stored.block_hashes.push_back(stored.block_hashes.front());
      stored.tier = random_tier();
      return stored;
    }
    if (roll < 96) {
      KvRemovedEvent removed;
      const auto& blocks = reference_.ranks().at(worker).blocks;
      const std::size_t count = 1 + rng_() % 3;
      for (std::size_t i = 0; i < count; ++i) {
        if (!blocks.empty() && rng_() % 5 != 0) {
          auto it = blocks.begin();
          std::advance(it, static_cast<std::ptrdiff_t>(rng_() % blocks.size()));
          removed.block_hashes.push_back(it->first);
          removed.tier = static_cast<StorageTier>(std::countr_zero(it->second));
        } else {
          removed.block_hashes.push_back(random_known_hash());
        }
      }
      if (rng_() % 4 == 0) removed.tier = random_tier();
      return removed;
    }
    return KvClearedEvent{};
  }

  void expect_same_answers(const KvIndexer& index, const std::string& when) {
    MatchResult result;
    for (const auto& prompt : prompts_) {
      index.find_matches(prompt, result);
      ASSERT_EQ(answer_of(result), reference_.find_matches(prompt)) << when;
    }
    // Sequences that do not follow the tree's links take the index's explicit path.
    for (int i = 0; i < 10; ++i) {
      std::vector<BlockHash> mixed;
      const std::size_t length = 1 + rng_() % 6;
      for (std::size_t j = 0; j < length; ++j) mixed.push_back(random_known_hash());
      index.find_matches(mixed, result);
      ASSERT_EQ(answer_of(result), reference_.find_matches(mixed)) << when << " (mixed)";
    }
  }

  void expect_same_residencies(const KvIndexer& index, const std::string& when) {
    for (const auto& [worker, rank] : reference_.ranks()) {
      for (const auto& prompt : prompts_) {
        for (const BlockHash hash : prompt) {
          ASSERT_EQ(index.tiers_held(worker, hash), reference_.tiers_held(worker, hash))
              << when << " worker " << worker.worker_id << "/" << worker.dp_rank;
        }
      }
    }
  }

  std::mt19937_64 rng_{GetParam()};
  std::vector<std::vector<BlockHash>> prompts_ = make_prompts(rng_, 40);
  ReferenceKvIndex reference_{test_config()};
};

TEST_P(KvIndexerPropertyTest, RandomEventStreamsMatchTheReferenceModel) {
  KvIndexer index(test_config());
  std::vector<WorkerWithDpRank> workers;
  std::map<WorkerWithDpRank, std::uint64_t> capacity;
  std::map<WorkerWithDpRank, EventId> next_id;
  for (WorkerId id = 1; id <= 5; ++id) {
    for (DpRank rank = 0; rank < (id % 2 == 0 ? 2U : 1U); ++rank) {
      const WorkerWithDpRank worker{id * 1000, rank};
      workers.push_back(worker);
      capacity[worker] = id == 1 ? 8 : 16 + 8 * id;
      ASSERT_TRUE(index.add_worker(worker, {capacity[worker], 7, false}));
      reference_.add_worker(worker, capacity[worker]);
      next_id[worker] = 1;
    }
  }

  std::map<IndexError, int> verdicts;
  for (int step = 0; step < 3000; ++step) {
    const WorkerWithDpRank worker = workers[rng_() % workers.size()];
    if (rng_() % 150 == 0) {
      // The rank goes away and comes back empty.
      ASSERT_TRUE(index.remove_rank(worker));
      reference_.remove_rank(worker);
      ASSERT_TRUE(index.add_worker(worker, {capacity[worker], 7, false}));
      reference_.add_worker(worker, capacity[worker]);
      next_id[worker] = 1;
      continue;
    }
    KvEventBatch batch{worker, 7, next_id[worker]++, {}};
    const std::size_t events = 1 + (rng_() % 4 == 0 ? rng_() % 3 : 0);
    std::optional<IndexError> expected_first;
    std::uint32_t expected_rejected = 0;
    for (std::size_t i = 0; i < events; ++i) {
      batch.events.push_back(random_event(worker));
      const auto verdict = reference_.apply(worker, batch.events.back());
      if (verdict) {
        ++expected_rejected;
        if (!expected_first) expected_first = verdict;
        ++verdicts[*verdict];
      }
    }
    const auto outcome = index.apply(batch);
    ASSERT_TRUE(outcome) << "step " << step;
    ASSERT_EQ(outcome->first_error, expected_first) << "step " << step;
    ASSERT_EQ(outcome->rejected_events, expected_rejected);
    ASSERT_FALSE(outcome->gap);
    if (rng_() % 20 == 0) {
      // A replayed batch is refused whole and changes nothing.
      ASSERT_EQ(index.apply(batch).error(), IndexError::duplicate_event_id);
    }
    const auto consistent = index.check_consistency();
    ASSERT_TRUE(consistent) << "step " << step << ": " << consistent.error();
    if (step % 50 == 0) {
      expect_same_answers(index, "step " + std::to_string(step));
      expect_same_residencies(index, "step " + std::to_string(step));
    }
  }
  expect_same_answers(index, "end");
  expect_same_residencies(index, "end");
  // The stream must have exercised the bad events, or the comparison proves little.
  for (const IndexError error :
       {IndexError::unknown_parent, IndexError::parent_mismatch, IndexError::duplicate_block,
        IndexError::capacity_exceeded, IndexError::chain_too_long, IndexError::unknown_block}) {
    EXPECT_GT(verdicts[error], 0) << as_str(error);
  }

  // Dump every rank, load into a fresh index: same answers, same residencies.
  KvIndexer restored(test_config());
  for (const WorkerWithDpRank worker : workers) {
    ASSERT_TRUE(restored.add_worker(worker, {capacity[worker], 7, false}));
  }
  for (const KvDump& dump : index.dump_all()) {
    const auto loaded = restored.load_dump(dump);
    ASSERT_TRUE(loaded);
    EXPECT_EQ(loaded->rejected_events, 0U);
    EXPECT_EQ(restored.last_event_id(dump.worker), index.last_event_id(dump.worker));
  }
  ASSERT_TRUE(restored.check_consistency());
  expect_same_answers(restored, "restored");
  expect_same_residencies(restored, "restored");
  EXPECT_EQ(restored.residency_count(), index.residency_count());
  EXPECT_EQ(restored.node_count(), index.node_count());
}

INSTANTIATE_TEST_SUITE_P(Seeds, KvIndexerPropertyTest, ::testing::Values(1, 2, 3, 4, 5, 6));

}  // namespace
}  // namespace kvr::discovery
