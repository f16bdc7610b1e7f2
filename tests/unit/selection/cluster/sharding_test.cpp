// Sharded partitions: which shard owns a worker (balance, determinism, movement when the fleet
// changes) and which shard a request goes to (its prefix, session or pin, bounded-load spills,
// allow-lists, prompts without a block).
#include "selection/cluster/sharding.hpp"

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace kvr::cluster {
namespace {

std::vector<ShardedWorker> fleet_of(std::size_t count, WorkerId first = 1, std::uint8_t group = 0) {
  std::vector<ShardedWorker> workers;
  for (std::size_t i = 0; i < count; ++i) workers.push_back({first + i, group});
  return workers;
}

ShardMap map_of(std::uint32_t shards, std::span<const ShardedWorker> workers) {
  ShardMap map{shards};
  (void)map.assign(workers);
  return map;
}

// A prompt of `blocks` chained hashes whose first `shared` blocks come from `prefix_seed` and the
// rest from `tail_seed`.
std::vector<BlockHash> prompt(std::uint64_t prefix_seed, std::size_t shared,
                              std::uint64_t tail_seed, std::size_t blocks) {
  std::vector<BlockHash> hashes;
  BlockHash chain = 0;
  for (std::size_t i = 0; i < blocks; ++i) {
    const std::uint64_t local = (i < shared ? prefix_seed : tail_seed) * 1'000'003 + i;
    chain = chain * 0x100000001B3ULL ^ local;
    hashes.push_back(chain);
  }
  return hashes;
}

TEST(ShardingConfigTest, AConfigThatCannotBeUsedNamesItsField) {
  EXPECT_FALSE(validate(ShardingConfig{}).has_value());
  EXPECT_NE(validate(ShardingConfig{.shards = 0})->find("shards"), std::string::npos);
  EXPECT_NE(validate(ShardingConfig{.shards = 4, .prefix_tokens = 0})->find("prefix_tokens"),
            std::string::npos);
  EXPECT_NE(validate(ShardingConfig{.shards = 4, .miss_cost = -1})->find("miss_cost"),
            std::string::npos);
  EXPECT_NE(validate(ShardingConfig{.shards = 4, .load_interval_ms = 0})->find("load_interval_ms"),
            std::string::npos);
}

TEST(ShardingConfigTest, AnUnshardedModelKeepsItsPartitionKey) {
  EXPECT_EQ(shard_key("m/default", 0, 1), "m/default");
  EXPECT_EQ(shard_key("m/default", 3, 4), "m/default#3");
}

TEST(ShardMapTest, EachShardOwnsAnEqualShareOfTheWorkers) {
  for (const std::uint32_t shards : {2U, 4U, 8U}) {
    const auto workers = fleet_of(16);
    const ShardMap map = map_of(shards, workers);
    for (std::uint32_t shard = 0; shard < shards; ++shard) {
      EXPECT_EQ(map.workers_in(shard), 16 / shards) << shards << " shards, shard " << shard;
    }
    for (const auto& worker : workers) EXPECT_TRUE(map.shard_of(worker.id).has_value());
  }
}

TEST(ShardMapTest, PrefillAndDecodeWorkersAreSpreadSeparately) {
  auto workers = fleet_of(4, 1, /*group=*/1);
  const auto decode = fleet_of(12, 100, /*group=*/2);
  workers.insert(workers.end(), decode.begin(), decode.end());
  const ShardMap map = map_of(4, workers);
  std::map<std::uint32_t, int> prefill_per_shard;
  for (const auto& worker : workers) {
    if (worker.group == 1) ++prefill_per_shard[*map.shard_of(worker.id)];
  }
  EXPECT_EQ(prefill_per_shard.size(), 4U);
  for (std::uint32_t shard = 0; shard < 4; ++shard) EXPECT_EQ(map.workers_in(shard), 4U);
}

TEST(ShardMapTest, TheAssignmentDependsOnlyOnTheSetOfWorkers) {
  auto workers = fleet_of(20);
  const ShardMap ordered = map_of(4, workers);
  std::ranges::reverse(workers);
  std::mt19937 random{7};
  std::ranges::shuffle(workers, random);
  const ShardMap shuffled = map_of(4, workers);
  for (const auto& worker : workers)
    EXPECT_EQ(ordered.shard_of(worker.id), shuffled.shard_of(worker.id));
}

TEST(ShardMapTest, AWorkerJoiningOrLeavingMovesFewOthers) {
  // Over many fleets, one worker joining or leaving a fleet of 16 on 4 shards moves at most a few
  // of the others, about two on average (a reshuffle would move about three quarters of them).
  std::mt19937_64 random{11};
  std::size_t most_moved = 0;
  std::size_t total_moved = 0;
  constexpr int kFleets = 200;
  for (int trial = 0; trial < kFleets; ++trial) {
    std::vector<ShardedWorker> workers;
    for (int i = 0; i < 16; ++i) workers.push_back({random(), 0});
    ShardMap map{4};
    EXPECT_TRUE(map.assign(workers).empty());
    workers.push_back({random(), 0});
    const std::size_t joined = map.assign(workers).size();
    workers.erase(workers.begin() + static_cast<std::ptrdiff_t>(random() % workers.size()));
    const std::size_t left = map.assign(workers).size();
    most_moved = std::max({most_moved, joined, left});
    total_moved += joined + left;
  }
  EXPECT_LE(most_moved, 5U);
  EXPECT_LT(static_cast<double>(total_moved) / (2 * kFleets), 2.5);
  EXPECT_EQ(ShardMap{4}.shard_of(1), std::nullopt);
}

// Publishes `tokens` of work ahead of every worker of every shard.
void publish_even(ShardBalancer& balancer, const ShardMap& map, std::uint64_t tokens) {
  for (std::uint32_t shard = 0; shard < map.shards(); ++shard) {
    balancer.set_load(shard, std::vector<std::uint64_t>(map.workers_in(shard), tokens));
  }
}

TEST(ShardChoiceTest, RequestsSharingAPrefixMeetOnOneShardAndConversationsSpread) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4, .prefix_tokens = 256};
  ShardBalancer balancer{4};
  std::map<std::uint32_t, int> per_shard;
  for (std::uint64_t conversation = 0; conversation < 400; ++conversation) {
    // Turns of one conversation: the same first 4 blocks (256 tokens of 64), different tails.
    const auto first = prompt(conversation, 6, conversation, 6);
    const auto later = prompt(conversation, 6, conversation + 10'000, 20);
    publish_even(balancer, map, 0);
    const ShardChoice a = balancer.choose(
        map, config, {.block_hashes = first, .block_size = 64, .prompt_tokens = 384});
    const ShardChoice b = balancer.choose(
        map, config, {.block_hashes = later, .block_size = 64, .prompt_tokens = 1280});
    EXPECT_EQ(a.shard, b.shard);
    EXPECT_EQ(a.reason, ShardReason::prefix);
    EXPECT_FALSE(a.spilled());
    ++per_shard[a.shard];
  }
  ASSERT_EQ(per_shard.size(), 4U);
  for (const auto& [shard, count] : per_shard) {
    EXPECT_GT(count, 60) << shard;
    EXPECT_LT(count, 140) << shard;
  }
}

TEST(ShardChoiceTest, ARequestSpillsOnlyWhenAnotherShardIsFasterDespiteTheCacheMiss) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4, .prefix_tokens = 128, .miss_cost = 2.0};
  const auto hashes = prompt(5, 4, 5, 4);
  const ShardRequest request{.block_hashes = hashes, .block_size = 64, .prompt_tokens = 1000};
  ShardBalancer balancer{4};
  publish_even(balancer, map, 0);
  const ShardChoice idle = balancer.choose(map, config, request);
  const std::uint32_t home = idle.home;
  EXPECT_EQ(idle.shard, home);

  // The home shard's least loaded worker is 2000 tokens behind the others: exactly the cost of
  // computing the 1000-token prompt twice over, so the request stays.
  publish_even(balancer, map, 5000);
  balancer.set_load(home, std::vector<std::uint64_t>(4, 7000));
  EXPECT_EQ(balancer.choose(map, config, request).shard, home);
  // One token more and another shard is the faster way: the first after home in the prefix's
  // order, which every request of the prefix then tries first.
  publish_even(balancer, map, 5000);
  balancer.set_load(home, {7001, 9000, 9000, 9000});
  const ShardChoice spilled = balancer.choose(map, config, request);
  EXPECT_TRUE(spilled.spilled());
  EXPECT_EQ(spilled.home, home);
  publish_even(balancer, map, 5000);
  balancer.set_load(home, {7001, 9000, 9000, 9000});
  EXPECT_EQ(balancer.choose(map, config, request).shard, spilled.shard);
}

TEST(ShardChoiceTest, RequestsSentSincePublishingCountAgainstTheirShard) {
  // Four idle workers per shard: each request of one hot prefix adds twice its prompt to its
  // home shard's least loaded worker, so after two rounds over the four the next spills, well
  // before the shard publishes its load again.
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4, .prefix_tokens = 128, .miss_cost = 2.0};
  const auto hashes = prompt(9, 4, 9, 4);
  const ShardRequest request{.block_hashes = hashes, .block_size = 64, .prompt_tokens = 1000};
  ShardBalancer balancer{4};
  publish_even(balancer, map, 0);
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(balancer.choose(map, config, request).spilled()) << i;
  EXPECT_EQ(balancer.least_worker_tokens(balancer.choose(map, config, request).home), 4000U);
  EXPECT_TRUE(balancer.choose(map, config, request).spilled());
  // Published again (the requests finished): home once more.
  publish_even(balancer, map, 0);
  EXPECT_FALSE(balancer.choose(map, config, request).spilled());
}

TEST(ShardChoiceTest, APinGoesToThePinnedWorkersShardHoweverBusy) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4};
  const auto hashes = prompt(1, 20, 1, 20);
  ShardBalancer balancer{4};
  for (const auto& worker : workers) {
    publish_even(balancer, map, 0);
    const std::uint32_t shard = *map.shard_of(worker.id);
    balancer.set_load(shard, std::vector<std::uint64_t>(4, 1'000'000));
    const ShardChoice choice = balancer.choose(map, config,
                                               {.block_hashes = hashes,
                                                .block_size = 64,
                                                .prompt_tokens = 1280,
                                                .pinned_worker = worker.id});
    EXPECT_EQ(choice.shard, shard);
    EXPECT_EQ(choice.reason, ShardReason::pinned);
    EXPECT_FALSE(choice.spilled());
  }
}

TEST(ShardChoiceTest, AnAllowListKeepsToShardsOwningAnAllowedWorker) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4, .prefix_tokens = 64};
  const std::vector<WorkerId> allowed{3, 9};
  const std::set<std::uint32_t> allowed_shards{*map.shard_of(3), *map.shard_of(9)};
  ShardBalancer balancer{4};
  publish_even(balancer, map, 0);
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    const auto hashes = prompt(seed, 2, seed, 2);
    const ShardChoice choice = balancer.choose(map, config,
                                               {.block_hashes = hashes,
                                                .block_size = 64,
                                                .prompt_tokens = 128,
                                                .allowed_workers = allowed});
    EXPECT_TRUE(allowed_shards.contains(choice.shard));
  }
}

TEST(ShardChoiceTest, ASessionGoesByItsIdWhateverItsPrompt) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(8, workers);
  const ShardingConfig config{.shards = 8};
  ShardBalancer balancer{8};
  const auto a = prompt(1, 30, 1, 30);
  const auto b = prompt(2, 30, 2, 30);
  std::set<std::uint32_t> seen;
  for (const auto& hashes : {a, b}) {
    publish_even(balancer, map, 0);
    const ShardChoice choice = balancer.choose(
        map, config,
        {.block_hashes = hashes, .block_size = 64, .prompt_tokens = 1920, .session_id = "chat-42"});
    EXPECT_EQ(choice.reason, ShardReason::session);
    seen.insert(choice.shard);
  }
  EXPECT_EQ(seen.size(), 1U);
}

TEST(ShardChoiceTest, APromptWithoutAFullBlockGoesToTheShardWithTheLeastLoadedWorker) {
  const auto workers = fleet_of(16);
  const ShardMap map = map_of(4, workers);
  const ShardingConfig config{.shards = 4};
  ShardBalancer balancer{4};
  balancer.set_load(0, {500, 900, 900, 900});
  balancer.set_load(1, {300, 100, 900, 900});
  balancer.set_load(2, {700, 700, 700, 700});
  balancer.set_load(3, {200, 900, 900, 900});
  const ShardChoice choice =
      balancer.choose(map, config, {.prompt_tokens = 20, .request_id = "short"});
  EXPECT_EQ(choice.shard, 1U);
  EXPECT_EQ(choice.reason, ShardReason::spread);
  EXPECT_FALSE(choice.spilled());
  EXPECT_EQ(balancer.least_worker_tokens(1), 140U);
}

TEST(ShardChoiceTest, AShardWithoutWorkersTakesNothing) {
  const auto workers = fleet_of(3);
  const ShardMap map = map_of(8, workers);
  std::set<std::uint32_t> with_workers;
  for (const auto& worker : workers) with_workers.insert(*map.shard_of(worker.id));
  ShardBalancer balancer{8};
  for (std::uint64_t seed = 0; seed < 100; ++seed) {
    const auto hashes = prompt(seed, 20, seed, 20);
    const ShardChoice choice =
        balancer.choose(map, ShardingConfig{.shards = 8},
                        {.block_hashes = hashes, .block_size = 64, .prompt_tokens = 1280});
    EXPECT_TRUE(with_workers.contains(choice.shard));
  }
}

TEST(ShardChoiceTest, AnUnshardedModelHasOneShard) {
  const auto workers = fleet_of(4);
  const ShardMap map = map_of(1, workers);
  const auto hashes = prompt(1, 8, 1, 8);
  ShardBalancer balancer{1};
  balancer.set_load(0, {1'000'000});
  EXPECT_EQ(balancer
                .choose(map, ShardingConfig{},
                        {.block_hashes = hashes, .block_size = 64, .prompt_tokens = 512})
                .shard,
            0U);
}

}  // namespace
}  // namespace kvr::cluster
