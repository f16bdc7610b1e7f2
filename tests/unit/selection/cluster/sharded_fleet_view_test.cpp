// A node's view of its sharded models' fleets, driven on a manual clock: where a worker's
// messages go (its shard), liveness (heartbeats, expiry, a shard served here, the NATS link) and
// the reassignment of shards when the fleet changes (joins, expiry, removal, a change of model).
#include "selection/cluster/sharded_fleet_view.hpp"

#include <algorithm>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "messages/clock.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr::cluster {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kShards = 4;
constexpr auto kTtl = 1s;

discovery::WorkerRegistration registration(WorkerId id, std::string model = "m") {
  return testing::worker_registration(id, std::move(model), 16, kTtl);
}

PartitionKey shard(std::uint32_t index, std::string model = "m") {
  return {std::move(model), shard_group("default", index)};
}

bool serves_nothing(const PartitionKey&) { return false; }

std::vector<WorkerId> left_workers(const ShardedFleetChanges& changes) {
  std::vector<WorkerId> workers;
  for (const ShardLeave& leave : changes.left) workers.push_back(leave.worker);
  return workers;
}

// The workers that moved between shards (not those that joined or registered again), by id.
std::map<WorkerId, std::pair<PartitionKey, PartitionKey>> moves_between_shards(
    const ShardedFleetChanges& changes) {
  std::map<WorkerId, std::pair<PartitionKey, PartitionKey>> moves;
  for (const ShardMove& move : changes.moved) {
    if (move.from) moves[move.registration.worker_id] = {*move.from, move.to};
  }
  return moves;
}

// The workers of shard 0, by id: 8 workers over 4 shards put 2 in each.
std::vector<WorkerId> shard_mates(const std::map<WorkerId, PartitionKey>& shards) {
  std::vector<WorkerId> mates;
  for (const auto& [id, key] : shards) {
    if (key == shard(0)) mates.push_back(id);
  }
  return mates;
}

class ShardedFleetViewTest : public ::testing::Test {
 protected:
  ShardedFleetViewTest() : view_({{"m", ShardingConfig{.shards = kShards}}}, 10s) {}

  ShardedFleetChanges join(WorkerId id, std::string model = "m") {
    return view_.register_worker(registration(id, std::move(model)), clock_.now());
  }

  // Workers 1 .. count of model "m".
  void join_all(WorkerId count) {
    for (WorkerId id = 1; id <= count; ++id) join(id);
  }

  // Each known worker's shard now.
  std::map<WorkerId, PartitionKey> shards_of(WorkerId count) const {
    std::map<WorkerId, PartitionKey> shards;
    for (WorkerId id = 1; id <= count; ++id) {
      if (const PartitionKey* key = view_.shard_of(id)) shards[id] = *key;
    }
    return shards;
  }

  // The moves from the shards in `before` to those of the view now, of the workers in both.
  std::map<WorkerId, std::pair<PartitionKey, PartitionKey>> moved_since(
      const std::map<WorkerId, PartitionKey>& before) const {
    std::map<WorkerId, std::pair<PartitionKey, PartitionKey>> moves;
    for (const auto& [id, was] : before) {
      const PartitionKey* now = view_.shard_of(id);
      if (now != nullptr && *now != was) moves[id] = {was, *now};
    }
    return moves;
  }

  // `changes` give the model's new fleet of `workers` workers, and exactly the moves between
  // shards that its workers made since `before`.
  void expect_resharded(const ShardedFleetChanges& changes,
                        const std::map<WorkerId, PartitionKey>& before, std::size_t workers) const {
    ASSERT_EQ(changes.fleets.size(), 1U);
    EXPECT_EQ(changes.fleets[0].workers.size(), workers);
    const auto expected = moved_since(before);
    ASSERT_FALSE(expected.empty()) << "pick a fleet change that moves a worker";
    EXPECT_EQ(moves_between_shards(changes), expected);
  }

  ManualClock clock_;
  ShardedFleetView view_;
};

TEST_F(ShardedFleetViewTest, AWorkersLoadGoesToTheShardItsModelsShardMapAssignsIt) {
  join_all(8);
  ShardMap expected{kShards};
  std::vector<ShardedWorker> fleet;
  for (WorkerId id = 1; id <= 8; ++id) fleet.push_back({id, 0});
  (void)expected.assign(fleet);
  for (WorkerId id = 1; id <= 8; ++id) {
    ASSERT_NE(view_.shard_of(id), nullptr) << id;
    EXPECT_EQ(*view_.shard_of(id), shard(*expected.shard_of(id))) << id;
  }
}

TEST_F(ShardedFleetViewTest, AnUnknownWorkersLoadHasNoShard) {
  join_all(2);
  EXPECT_EQ(view_.shard_of(9), nullptr);
}

TEST_F(ShardedFleetViewTest, ARegistrationEndsWithTheWorkerJoiningItsShard) {
  const ShardedFleetChanges changes = join(1);
  ASSERT_FALSE(changes.moved.empty());
  EXPECT_EQ(changes.moved.back().registration, registration(1));
  EXPECT_FALSE(changes.moved.back().from);
  EXPECT_EQ(changes.moved.back().to, *view_.shard_of(1));
}

TEST_F(ShardedFleetViewTest, AnUnshardedModelsRegistrationChangesNothing) {
  const ShardedFleetChanges changes = join(1, "unsharded");
  EXPECT_TRUE(changes.moved.empty());
  EXPECT_TRUE(changes.fleets.empty());
  EXPECT_EQ(view_.registration(1), nullptr);
}

TEST_F(ShardedFleetViewTest, AWorkerSilentForLongerThanItsTtlExpires) {
  join_all(2);
  clock_.advance(kTtl);
  EXPECT_TRUE(view_.expire(clock_.now(), serves_nothing).left.empty());
  clock_.advance(1ms);
  EXPECT_EQ(left_workers(view_.expire(clock_.now(), serves_nothing)),
            (std::vector<WorkerId>{1, 2}));
  EXPECT_EQ(view_.registration(1), nullptr);
  EXPECT_EQ(view_.shard_of(2), nullptr);
}

TEST_F(ShardedFleetViewTest, AHeartbeatRenewsAWorkersLiveness) {
  join_all(2);
  clock_.advance(600ms);
  view_.heartbeat(1, clock_.now());
  clock_.advance(600ms);
  EXPECT_EQ(left_workers(view_.expire(clock_.now(), serves_nothing)), std::vector<WorkerId>{2});
  EXPECT_NE(view_.registration(1), nullptr);
}

TEST_F(ShardedFleetViewTest, AWorkerWithoutATtlLivesForTheDefaultTtl) {
  discovery::WorkerRegistration worker = registration(1);
  worker.liveness_ttl = 0ms;
  (void)view_.register_worker(worker, clock_.now());
  clock_.advance(10s);
  EXPECT_TRUE(view_.expire(clock_.now(), serves_nothing).left.empty());
  clock_.advance(1ms);
  EXPECT_EQ(left_workers(view_.expire(clock_.now(), serves_nothing)), std::vector<WorkerId>{1});
}

TEST_F(ShardedFleetViewTest, AWorkerOfAShardServedHereIsLeftToItsSelector) {
  join(1);
  const PartitionKey served = *view_.shard_of(1);
  clock_.advance(2 * kTtl);
  const auto serves = [&served](const PartitionKey& key) { return key == served; };
  EXPECT_TRUE(view_.expire(clock_.now(), serves).left.empty());
  EXPECT_NE(view_.registration(1), nullptr);
}

TEST_F(ShardedFleetViewTest, NothingExpiresWhileTheLinkIsDown) {
  join(1);
  view_.set_link(false, clock_.now());
  clock_.advance(2 * kTtl);
  EXPECT_TRUE(view_.expire(clock_.now(), serves_nothing).left.empty());
}

TEST_F(ShardedFleetViewTest, ALinkThatComesBackGivesEveryWorkerOneTtlFromThen) {
  join(1);
  view_.set_link(false, clock_.now());
  clock_.advance(2 * kTtl);
  view_.set_link(true, clock_.now());
  clock_.advance(kTtl);
  EXPECT_TRUE(view_.expire(clock_.now(), serves_nothing).left.empty());
  clock_.advance(1ms);
  EXPECT_EQ(left_workers(view_.expire(clock_.now(), serves_nothing)), std::vector<WorkerId>{1});
}

TEST_F(ShardedFleetViewTest, ExpiredWorkersLeaveTheirModelWhoseShardsAreReassigned) {
  join_all(8);
  const auto before = shards_of(8);
  const std::vector<WorkerId> silent = shard_mates(before);
  ASSERT_EQ(silent.size(), 2U);
  clock_.advance(kTtl + 1ms);
  for (WorkerId id = 1; id <= 8; ++id) {
    if (std::ranges::find(silent, id) == silent.end()) view_.heartbeat(id, clock_.now());
  }
  const ShardedFleetChanges changes = view_.expire(clock_.now(), serves_nothing);

  EXPECT_EQ(left_workers(changes), silent);
  for (const ShardLeave& leave : changes.left) {
    EXPECT_EQ(leave.model, (PartitionKey{"m", "default"}));
  }
  // Their shard, left empty, takes a worker of another.
  expect_resharded(changes, before, 6);
}

TEST_F(ShardedFleetViewTest, AJoiningWorkerMovesExactlyTheWorkersWhoseShardChanged) {
  // Nine workers over four shards, then a tenth: the bounded-load assignment moves some.
  join_all(9);
  const auto before = shards_of(9);
  expect_resharded(join(10), before, 10);
}

TEST_F(ShardedFleetViewTest, ARenewedRegistrationReassignsNoShard) {
  join_all(4);
  const ShardedFleetChanges changes = join(3);
  EXPECT_TRUE(changes.fleets.empty());
  ASSERT_EQ(changes.moved.size(), 1U);
  EXPECT_FALSE(changes.moved[0].from);
}

TEST_F(ShardedFleetViewTest, RemovedWorkersReshardTheirModelOnce) {
  join_all(8);
  const auto before = shards_of(8);
  const std::vector<WorkerId> removed = shard_mates(before);
  ASSERT_EQ(removed.size(), 2U);
  const ShardedFleetChanges changes = view_.remove(removed);
  EXPECT_EQ(left_workers(changes), removed);
  expect_resharded(changes, before, 6);
}

TEST_F(ShardedFleetViewTest, AWorkerRegisteredForAnotherModelReshardsBoth) {
  ShardedFleetView view{{{"m", {.shards = kShards}}, {"n", {.shards = kShards}}}, 10s};
  (void)view.register_worker(registration(1, "m"), clock_.now());
  (void)view.register_worker(registration(2, "m"), clock_.now());
  const ShardedFleetChanges changes = view.register_worker(registration(1, "n"), clock_.now());
  std::set<PartitionKey> models;
  for (const ShardedFleet& fleet : changes.fleets) models.insert(fleet.model);
  EXPECT_EQ(models, (std::set<PartitionKey>{{"m", "default"}, {"n", "default"}}));
  EXPECT_EQ(view.shard_of(1)->first, "n");
}

TEST_F(ShardedFleetViewTest, AShardsRegistrationsAreThoseOfTheWorkersAssignedToIt) {
  join_all(8);
  for (std::uint32_t index = 0; index < kShards; ++index) {
    std::set<WorkerId> expected;
    for (const auto& [id, key] : shards_of(8)) {
      if (key == shard(index)) expected.insert(id);
    }
    std::set<WorkerId> listed;
    for (const auto& worker : view_.registrations_in(shard(index))) listed.insert(worker.worker_id);
    EXPECT_EQ(listed, expected) << index;
    EXPECT_FALSE(listed.empty()) << index;
  }
}

TEST_F(ShardedFleetViewTest, AModelWithOneShardIsNotSharded) {
  const ShardedFleetView view{{{"m", {.shards = 1}}, {"n", {.shards = 2}}}, 10s};
  EXPECT_EQ(view.sharding("m"), nullptr);
  EXPECT_EQ(view.sharding("other"), nullptr);
  ASSERT_NE(view.sharding("n"), nullptr);
  EXPECT_EQ(view.sharding("n")->shards, 2U);
}

TEST_F(ShardedFleetViewTest, FleetsListsEveryModelSeenAnEmptyOneIncluded) {
  join(1);
  (void)view_.remove(std::vector<WorkerId>{1});
  const std::vector<ShardedFleet> fleets = view_.fleets();
  ASSERT_EQ(fleets.size(), 1U);
  EXPECT_EQ(fleets[0].model, (PartitionKey{"m", "default"}));
  EXPECT_TRUE(fleets[0].workers.empty());
}

}  // namespace
}  // namespace kvr::cluster
