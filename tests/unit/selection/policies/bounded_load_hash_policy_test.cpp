// bounded-load-hash: prefix keys map to stable workers, full workers are passed clockwise,
// removing a worker moves only its keys, and the key rules for short prompts.
#include "selection/policies/bounded_load_hash/bounded_load_hash_policy.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/selection/policies/policy_test_support.hpp"

namespace kvr::selection::policies {
namespace {

class BoundedLoadHashPolicyTest : public PolicyTest {
 protected:
  BoundedLoadHashPolicyTest() { signals_.set_workers(idle_fleet({1, 2, 3, 4, 5})); }

  static std::vector<testing::FakeWorker> idle_fleet(const std::vector<WorkerId>& ids) {
    std::vector<testing::FakeWorker> fleet;
    for (const WorkerId id : ids) fleet.push_back(loaded_worker(id, 0));
    return fleet;
  }

  WorkerSelectionPolicy policy(const BoundedLoadHashParameters& parameters = {}) {
    return make_bounded_load_hash_policy(parameters, config_, WorkerType::Aggregated, partition_);
  }

  // The worker chosen for a prompt with these block hashes.
  WorkerId pick_for(WorkerSelectionPolicy& policy, std::vector<BlockHash> hashes) {
    hashes_ = std::move(hashes);
    request_.block_hashes = hashes_;
    return pick(policy);
  }

  void set_active(WorkerId worker, std::size_t active_requests) {
    for (testing::FakeWorker& fake : signals_.mutable_workers()) {
      if (fake.worker.worker_id == worker) fake.load->active_requests = active_requests;
    }
    signals_.refresh();
  }

  std::uint64_t key_of(std::vector<BlockHash> hashes, std::size_t prompt_tokens,
                       std::size_t prefix_blocks) {
    hashes_ = std::move(hashes);
    request_.block_hashes = hashes_;
    request_.prompt_tokens = prompt_tokens;
    const WorkerSelectionContext context{request_, config_.block_size, WorkerType::Aggregated,
                                         partition_};
    return BoundedLoadHashPicker::request_key(context, prefix_blocks);
  }

  std::vector<BlockHash> hashes_;
};

TEST_F(BoundedLoadHashPolicyTest, SamePrefixGoesToTheSameWorkerAndPrefixesSpread) {
  auto hash = policy();
  std::set<WorkerId> used;
  for (BlockHash prefix = 1; prefix <= 40; ++prefix) {
    const WorkerId owner = pick_for(hash, {prefix, 2, 3, 4, 100});
    EXPECT_EQ(pick_for(hash, {prefix, 2, 3, 4, 200, 300}), owner) << "prefix " << prefix;
    used.insert(owner);
  }
  EXPECT_GE(used.size(), 4U);
}

TEST_F(BoundedLoadHashPolicyTest, OnlyPrefixBlocksFormTheKey) {
  auto hash = policy({.prefix_blocks = 2});
  const WorkerId owner = pick_for(hash, {7, 8, 1});
  for (BlockHash third = 2; third < 20; ++third) EXPECT_EQ(pick_for(hash, {7, 8, third}), owner);
}

TEST_F(BoundedLoadHashPolicyTest, FullOwnerIsPassedClockwiseAndLoadedOwnerKeepsItsKeys) {
  auto hash = policy();
  const WorkerId owner = pick_for(hash, {42, 43, 44, 45});
  // 1 active request of 5 workers: capacity ceil(1.25 · 2 / 5) = 1, so the owner (1 + 1 > 1) is
  // full and the request moves on to an idle worker.
  set_active(owner, 1);
  const WorkerId next = pick_for(hash, {42, 43, 44, 45});
  EXPECT_NE(next, owner);
  // Every worker with 1 active request: capacity ceil(1.25 · 6 / 5) = 2 and nobody is full.
  for (const WorkerId worker : {1U, 2U, 3U, 4U, 5U}) set_active(worker, 1);
  EXPECT_EQ(pick_for(hash, {42, 43, 44, 45}), owner);
}

TEST_F(BoundedLoadHashPolicyTest, RemovingAWorkerMovesOnlyItsKeys) {
  auto hash = policy();
  std::map<BlockHash, WorkerId> owners;
  for (BlockHash prefix = 1; prefix <= 200; ++prefix) owners[prefix] = pick_for(hash, {prefix});

  signals_.set_workers(idle_fleet({1, 2, 4, 5}));
  int moved = 0;
  for (const auto& [prefix, owner] : owners) {
    const WorkerId now = pick_for(hash, {prefix});
    if (owner == 3) {
      EXPECT_NE(now, 3U);
      ++moved;
    } else {
      EXPECT_EQ(now, owner) << "prefix " << prefix;
    }
  }
  EXPECT_GT(moved, 0);

  // Worker 3 returns and takes its keys back.
  signals_.set_workers(idle_fleet({5, 4, 3, 2, 1}));
  for (const auto& [prefix, owner] : owners) EXPECT_EQ(pick_for(hash, {prefix}), owner);
}

TEST_F(BoundedLoadHashPolicyTest, CandidateOrderDoesNotMatter) {
  auto hash = policy();
  std::map<BlockHash, WorkerId> owners;
  for (BlockHash prefix = 1; prefix <= 50; ++prefix) owners[prefix] = pick_for(hash, {prefix});
  signals_.set_workers(idle_fleet({4, 2, 5, 1, 3}));
  for (const auto& [prefix, owner] : owners) EXPECT_EQ(pick_for(hash, {prefix}), owner);
}

TEST_F(BoundedLoadHashPolicyTest, PromptWithFewerHashesThanThePrefixUsesWhatItHas) {
  EXPECT_EQ(key_of({1, 2}, 40, 4), key_of({1, 2}, 40, 2));
  EXPECT_EQ(key_of({1, 2, 3}, 56, 2), key_of({1, 2}, 40, 4));
  EXPECT_NE(key_of({1, 2, 3}, 56, 4), key_of({1, 2}, 40, 4));
}

TEST_F(BoundedLoadHashPolicyTest, PromptWithoutHashesIsKeyedByItsTokenCount) {
  EXPECT_EQ(key_of({}, 10, 4), key_of({}, 10, 4));
  EXPECT_NE(key_of({}, 10, 4), key_of({}, 11, 4));
  EXPECT_NE(key_of({}, 10, 4), key_of({10}, 10, 4));
}

TEST_F(BoundedLoadHashPolicyTest, ValidationNamesTheParameterAndItsRange) {
  const auto error_of = [](const BoundedLoadHashParameters& parameters) {
    auto valid = parameters.validate();
    return valid ? std::string{} : std::string{valid.error().message()};
  };
  EXPECT_EQ(error_of({}), "");
  const std::string prefix = error_of({.prefix_blocks = 0});
  EXPECT_NE(prefix.find("'prefix_blocks'"), std::string::npos) << prefix;
  EXPECT_NE(prefix.find("[1, 65536]"), std::string::npos) << prefix;
  EXPECT_NE(error_of({.load_factor = 0.9}).find("'load_factor'"), std::string::npos);
  EXPECT_NE(error_of({.virtual_nodes = 1001}).find("'virtual_nodes'"), std::string::npos);
}

}  // namespace
}  // namespace kvr::selection::policies
