// The partition lease keeper: driven step by step over simulated time against a fake key-value
// bucket with the compare-and-set and TTL behaviour of JetStream's, it never lets two nodes own a
// partition at once (including a node paused past its deadline), takes over from dead members,
// hands over on join without a long gap, and stops owning at once when a renewal fails.
#include "selection/cluster/partition_lease_keeper.hpp"

#include <algorithm>
#include <functional>
#include <memory>

#include <gtest/gtest.h>

namespace kvr::cluster {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kTtl{3000};
constexpr milliseconds kRenewInterval{1000};
constexpr milliseconds kRenewDeadline{2000};
constexpr milliseconds kTick{50};

PartitionLeaseOptions options() {
  PartitionLeaseOptions result;
  result.ttl = kTtl;
  result.renew_interval = kRenewInterval;
  result.renew_deadline = kRenewDeadline;
  return result;
}

// A key-value bucket as JetStream keeps one: bucket-wide revisions, create only when absent,
// update only over the current revision, values age out a TTL after they were written.
class FakeBucket {
 public:
  explicit FakeBucket(milliseconds ttl) : ttl_(ttl) {}

  std::optional<std::uint64_t> create(const std::string& key, const std::string& value,
                                      Clock::time_point now) {
    expire(now);
    if (entries_.contains(key)) return std::nullopt;
    return write(key, value, now);
  }
  std::optional<std::uint64_t> update(const std::string& key, const std::string& value,
                                      std::uint64_t expected, Clock::time_point now) {
    expire(now);
    const auto it = entries_.find(key);
    if (it == entries_.end() || it->second.revision != expected) return std::nullopt;
    return write(key, value, now);
  }
  std::uint64_t put(const std::string& key, const std::string& value, Clock::time_point now) {
    expire(now);
    return write(key, value, now);
  }
  void erase(const std::string& key) { entries_.erase(key); }
  // The lease stored under the partition's key, when there is one.
  std::optional<LeaseRecord> lease_of(const std::string& partition, Clock::time_point now) {
    expire(now);
    const auto it = entries_.find(lease_key(partition));
    if (it == entries_.end()) return std::nullopt;
    auto value = decode_lease(it->second.value);
    if (!value) return std::nullopt;
    return LeaseRecord{*value, it->second.revision};
  }
  // Every live key with its value and revision.
  std::vector<std::tuple<std::string, std::string, std::uint64_t>> read(Clock::time_point now) {
    expire(now);
    std::vector<std::tuple<std::string, std::string, std::uint64_t>> result;
    for (const auto& [key, entry] : entries_) result.emplace_back(key, entry.value, entry.revision);
    return result;
  }

 private:
  struct Entry {
    std::string value;
    std::uint64_t revision = 0;
    Clock::time_point written_at;
  };
  void expire(Clock::time_point now) {
    std::erase_if(entries_,
                  [&](const auto& entry) { return now - entry.second.written_at >= ttl_; });
  }
  std::uint64_t write(const std::string& key, const std::string& value, Clock::time_point now) {
    entries_[key] = Entry{value, ++sequence_, now};
    return sequence_;
  }
  milliseconds ttl_;
  std::uint64_t sequence_ = 0;
  std::map<std::string, Entry> entries_;
};

// The shared state: the two buckets, the partitions every node knows and the time.
struct World {
  Clock::time_point origin{std::chrono::hours(1)};
  Clock::time_point now = origin;
  FakeBucket members{kTtl};
  FakeBucket partitions_bucket{kTtl};
  std::vector<std::string> partitions;

  World() {
    for (int i = 0; i < 12; ++i)
      partitions.push_back(partition_key("model-" + std::to_string(i), "default"));
  }

  std::vector<MemberRecord> read_members() {
    std::vector<MemberRecord> result;
    for (const auto& [key, value, revision] : members.read(now)) {
      if (auto member = decode_member(value)) result.push_back(*member);
    }
    return result;
  }
  LeaseTable read_table() {
    LeaseTable table;
    for (const auto& [key, value, revision] : partitions_bucket.read(now)) {
      const auto kind = parse_partitions_key(key);
      if (!kind) continue;
      if (kind->is_ready) {
        if (auto ready = decode_ready(value)) table.ready[kind->partition] = *ready;
      } else if (auto lease = decode_lease(value)) {
        table.leases[kind->partition] = LeaseRecord{*lease, revision};
      }
    }
    return table;
  }
};

// One router node: announces itself, reads both buckets and runs its keeper's actions every
// `period` (from `offset`), warming a partition up in `prepare_time`.
class SimNode {
 public:
  enum class State { running, paused, dead };

  SimNode(std::string node_id, std::uint64_t incarnation, milliseconds offset,
          milliseconds period = kRenewInterval)
      : keeper(node_id, incarnation, options()),
        record{node_id, incarnation, "127.0.0.1:1", 1.0, 0},
        offset_(offset),
        period_(period) {}

  bool due(const World& world) const {
    const auto since = world.now - world.origin - offset_;
    return state == State::running && since >= milliseconds(0) &&
           since % period_ == milliseconds(0);
  }

  // One step. With `hold_results`, the KV calls reach the bucket but their answers stay
  // undelivered (the process stops right after sending). With `stale`, the step decides from
  // the buckets as last read instead of reading them again.
  void tick(World& world, bool hold_results = false, bool stale = false) {
    world.members.put(member_key(record.node_id), encode(record), world.now);
    if (!stale) {
      last_members_ = world.read_members();
      last_table_ = world.read_table();
    }
    for (auto it = prepare_done_.begin(); it != prepare_done_.end();) {
      if (it->second <= world.now) {
        keeper.mark_prepared(it->first);
        it = prepare_done_.erase(it);
      } else {
        ++it;
      }
    }
    run(world, keeper.step(world.now, last_members_, world.partitions, last_table_), hold_results);
  }

  void run(World& world, const std::vector<LeaseAction>& actions, bool hold_results = false) {
    for (const auto& action : actions) {
      std::function<void()> deliver;
      if (const auto* acquire = std::get_if<AcquireLease>(&action)) {
        const auto key = lease_key(acquire->partition);
        const auto revision =
            acquire->over_revision
                ? world.partitions_bucket.update(key, encode(acquire->value),
                                                 *acquire->over_revision, world.now)
                : world.partitions_bucket.create(key, encode(acquire->value), world.now);
        deliver = [this, partition = acquire->partition, revision] {
          keeper.on_acquired(partition, revision);
        };
      } else if (const auto* renew = std::get_if<RenewLease>(&action)) {
        const auto revision = world.partitions_bucket.update(
            lease_key(renew->partition), encode(renew->value), renew->revision, world.now);
        deliver = [this, partition = renew->partition, revision] {
          keeper.on_renewed(partition, revision);
        };
      } else if (const auto* release = std::get_if<ReleaseLease>(&action)) {
        world.partitions_bucket.update(lease_key(release->partition), encode(release->value),
                                       release->revision, world.now);
        ++releases;
        deliver = [this, partition = release->partition] { keeper.on_released(partition); };
      } else if (const auto* prepare = std::get_if<PreparePartition>(&action)) {
        prepare_done_[prepare->partition] = world.now + prepare_time;
        prepared.insert(prepare->partition);
      } else if (const auto* announce = std::get_if<AnnounceReady>(&action)) {
        world.partitions_bucket.put(ready_key(announce->partition), encode(announce->value),
                                    world.now);
      } else if (const auto* withdraw = std::get_if<WithdrawReady>(&action)) {
        world.partitions_bucket.erase(ready_key(withdraw->partition));
      } else if (const auto* abandon = std::get_if<AbandonPartition>(&action)) {
        prepare_done_.erase(abandon->partition);
      }
      if (!deliver) continue;
      if (hold_results) {
        undelivered_.push_back(std::move(deliver));
      } else {
        deliver();
      }
    }
  }

  void deliver_held_results() {
    for (auto& deliver : undelivered_) deliver();
    undelivered_.clear();
  }

  // A graceful stop: the member record goes first, so the others see this node gone and take
  // the released leases at once.
  void shut_down(World& world) {
    world.members.erase(member_key(record.node_id));
    run(world, keeper.release_all());
    state = State::dead;
  }

  std::size_t owned_count(const World& world) const { return keeper.owned(world.now).size(); }

  PartitionLeaseKeeper keeper;
  MemberRecord record;
  State state = State::running;
  milliseconds prepare_time{300};
  std::set<std::string> prepared;  ///< partitions it was ever asked to prepare
  int releases = 0;

 private:
  milliseconds offset_;
  milliseconds period_;
  std::vector<MemberRecord> last_members_;
  LeaseTable last_table_;
  std::map<std::string, Clock::time_point> prepare_done_;
  std::vector<std::function<void()>> undelivered_;
};

// Runs the nodes over simulated time and checks, at every instant, that no partition has two
// owners and that an owner's epoch is the lease's current revision in the bucket; records the
// longest time each partition went without an owner once it had one.
class ClusterRun {
 public:
  explicit ClusterRun(World& world) : world_(world) {}

  void add(SimNode& node) { nodes_.push_back(&node); }

  // Advances to `until` (since the origin), calling `at` before the nodes tick at each instant.
  void run_until(milliseconds until, const std::function<void()>& at = {}) {
    while (world_.now - world_.origin < until) {
      world_.now += kTick;
      if (at) at();
      for (SimNode* node : nodes_) {
        if (node->due(world_)) node->tick(world_);
      }
      check();
    }
  }

  std::string owner_of(const std::string& partition) const {
    for (const SimNode* node : nodes_) {
      if (node->keeper.epoch_of(partition, world_.now)) return node->record.node_id;
    }
    return {};
  }

  milliseconds longest_gap() const { return longest_gap_; }
  bool all_owned() const {
    return std::ranges::all_of(world_.partitions,
                               [&](const std::string& p) { return !owner_of(p).empty(); });
  }

 private:
  void check() {
    for (const auto& partition : world_.partitions) {
      int owners = 0;
      for (const SimNode* node : nodes_) {
        // Paused and dead nodes count too: what they would do if they ran at this instant.
        const auto epoch = node->keeper.epoch_of(partition, world_.now);
        if (!epoch) continue;
        ++owners;
        // Nobody else has written the lease since the owner's epoch: the key is there, it
        // names the owner, at the epoch or at a renewal of it whose answer is still out.
        const auto lease = world_.partitions_bucket.lease_of(partition, world_.now);
        ASSERT_TRUE(lease.has_value()) << node->record.node_id << " owns " << partition
                                       << " without a lease at " << at_ms() << " ms";
        EXPECT_GE(lease->revision, *epoch) << partition;
        EXPECT_EQ(lease->value, (LeaseValue{node->record.node_id, node->record.incarnation, false}))
            << node->record.node_id << " owns " << partition << " written by another at " << at_ms()
            << " ms";
      }
      ASSERT_LE(owners, 1) << partition << " has two owners at " << at_ms() << " ms";
      auto& gap = gaps_[partition];
      if (owners == 1) {
        if (gap.unowned_since) {
          longest_gap_ =
              std::max(longest_gap_,
                       std::chrono::duration_cast<milliseconds>(world_.now - *gap.unowned_since));
        }
        gap.was_owned = true;
        gap.unowned_since.reset();
      } else if (gap.was_owned && !gap.unowned_since) {
        gap.unowned_since = world_.now;
      }
    }
  }

  long long at_ms() const {
    return std::chrono::duration_cast<milliseconds>(world_.now - world_.origin).count();
  }

  struct Gap {
    bool was_owned = false;
    std::optional<Clock::time_point> unowned_since;
  };
  World& world_;
  std::vector<SimNode*> nodes_;
  std::map<std::string, Gap> gaps_;
  milliseconds longest_gap_{0};
};

TEST(PartitionLeaseKeeperTest, TwoKeepersNeverBothOwnAPartitionAndAPausedOneIsFencedBeforeActing) {
  World world;
  SimNode a{"node-a", 1, milliseconds(0)};
  SimNode b{"node-b", 1, milliseconds(300)};
  ClusterRun run{world};
  run.add(a);
  run.add(b);
  run.run_until(milliseconds(6000));
  ASSERT_TRUE(run.all_owned());
  ASSERT_GT(a.owned_count(world), 0u);
  ASSERT_GT(b.owned_count(world), 0u);

  // b stops right after sending its renewals (as under SIGSTOP): they land, their answers wait.
  run.run_until(milliseconds(6300) - kTick);
  world.now += kTick;
  ASSERT_TRUE(b.due(world));
  const std::size_t b_owned = b.owned_count(world);
  b.tick(world, /*hold_results=*/true);
  b.state = SimNode::State::paused;
  ASSERT_GT(b_owned, 0u);

  // Ten seconds later a owns everything: b's leases aged out and were created again.
  run.run_until(milliseconds(16300));
  EXPECT_TRUE(run.all_owned());
  EXPECT_EQ(a.owned_count(world), world.partitions.size());

  // b resumes. It is fenced before it does anything, and the late answers (successes, but sent
  // ten seconds ago) do not bring its ownership back.
  EXPECT_TRUE(b.keeper.owned(world.now).empty());
  b.deliver_held_results();
  EXPECT_TRUE(b.keeper.owned(world.now).empty());
  // Its first step decides from the buckets as read before the pause: the compare-and-sets it
  // tries over those old revisions fail.
  b.state = SimNode::State::running;
  b.tick(world, /*hold_results=*/false, /*stale=*/true);
  EXPECT_TRUE(b.keeper.owned(world.now).empty());

  // It rejoins: partitions are handed back to it, one owner each all along.
  run.run_until(milliseconds(30000));
  EXPECT_TRUE(run.all_owned());
  EXPECT_GT(b.owned_count(world), 0u);
  EXPECT_EQ(a.owned_count(world) + b.owned_count(world), world.partitions.size());
}

TEST(PartitionLeaseKeeperTest, DeadMembersPartitionsAreTakenOverOnceTheirLeasesAgeOut) {
  World world;
  SimNode a{"node-a", 1, milliseconds(0)};
  SimNode b{"node-b", 1, milliseconds(250)};
  SimNode c{"node-c", 1, milliseconds(600)};
  ClusterRun run{world};
  run.add(a);
  run.add(b);
  run.add(c);
  run.run_until(milliseconds(8000));
  ASSERT_TRUE(run.all_owned());
  std::vector<std::string> c_partitions;
  for (const auto& owned : c.keeper.owned(world.now)) c_partitions.push_back(owned.partition);
  ASSERT_FALSE(c_partitions.empty());

  // c is killed just after its step at 7600 ms: its last renewals went out then.
  const auto killed_at = milliseconds(8000);
  c.state = SimNode::State::dead;
  std::map<std::string, milliseconds> taken_at;
  run.run_until(milliseconds(20000), [&] {
    for (const auto& partition : c_partitions) {
      const auto owner = run.owner_of(partition);
      if (!owner.empty() && owner != "node-c" && !taken_at.contains(partition)) {
        taken_at[partition] = std::chrono::duration_cast<milliseconds>(world.now - world.origin);
      }
    }
  });
  EXPECT_TRUE(run.all_owned());
  EXPECT_EQ(a.owned_count(world) + b.owned_count(world), world.partitions.size());
  ASSERT_EQ(taken_at.size(), c_partitions.size());
  for (const auto& [partition, at] : taken_at) {
    // The TTL after c's last renewal (7600 ms), plus at most one step of the taker.
    EXPECT_GE(at, milliseconds(7600) + kTtl) << partition;
    EXPECT_LE(at, killed_at + kTtl + kRenewInterval) << partition;
  }
}

TEST(PartitionLeaseKeeperTest, JoinHandsOverWithoutAGapLongerThanOneRenewInterval) {
  World world;
  SimNode a{"node-a", 1, milliseconds(0)};
  SimNode b{"node-b", 1, milliseconds(350)};
  SimNode c{"node-c", 1, milliseconds(700)};
  c.state = SimNode::State::dead;  // not started yet
  ClusterRun run{world};
  run.add(a);
  run.add(b);
  run.add(c);
  run.run_until(milliseconds(6000));
  ASSERT_TRUE(run.all_owned());
  ASSERT_EQ(c.owned_count(world), 0u);

  c.state = SimNode::State::running;
  run.run_until(milliseconds(20000));
  EXPECT_TRUE(run.all_owned());
  // Only handovers left partitions unowned, each for at most one step of the successor.
  EXPECT_LE(run.longest_gap(), kRenewInterval);
  EXPECT_GT(run.longest_gap(), milliseconds(0));

  // The owners are the placement's, and every partition c took it had warmed up first.
  const std::vector<PlacementMember> members{{"node-a", 1}, {"node-b", 1}, {"node-c", 1}};
  const auto expected = assign(world.partitions, members);
  for (const auto& partition : world.partitions) {
    EXPECT_EQ(run.owner_of(partition), expected.at(partition)) << partition;
  }
  const auto c_owned = c.keeper.owned(world.now);
  ASSERT_FALSE(c_owned.empty());
  for (const auto& owned : c_owned) EXPECT_TRUE(c.prepared.contains(owned.partition));
  // c took them by handover (released to it), not by waiting for leases to age out.
  EXPECT_GE(static_cast<std::size_t>(a.releases + b.releases), c_owned.size());
}

TEST(PartitionLeaseKeeperTest, GracefulShutdownHandsLeasesOverAtOnce) {
  World world;
  SimNode a{"node-a", 1, milliseconds(0)};
  SimNode b{"node-b", 1, milliseconds(500)};
  ClusterRun run{world};
  run.add(a);
  run.add(b);
  run.run_until(milliseconds(6000));
  ASSERT_GT(a.owned_count(world), 0u);

  a.shut_down(world);
  EXPECT_TRUE(a.keeper.owned(world.now).empty());
  // b's next step (500 ms later) takes them: well before the TTL would have freed them.
  run.run_until(milliseconds(6600));
  EXPECT_EQ(b.owned_count(world), world.partitions.size());
}

TEST(PartitionLeaseKeeperTest, RenewalFailureStopsOwningAtOnce) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 1, options()};
  const std::vector<MemberRecord> members{{"node-a", 1, "", 1.0, 0}};
  const std::vector<std::string> partitions{"m/default"};

  auto actions = keeper.step(start, members, partitions, LeaseTable{});
  ASSERT_EQ(actions.size(), 1u);
  const auto* acquire = std::get_if<AcquireLease>(&actions[0]);
  ASSERT_NE(acquire, nullptr);
  EXPECT_FALSE(acquire->over_revision.has_value());
  keeper.on_acquired("m/default", 5);
  EXPECT_EQ(keeper.epoch_of("m/default", start), 5u);

  LeaseTable table;
  table.leases["m/default"] = LeaseRecord{LeaseValue{"node-a", 1, false}, 5};
  const auto renew_at = start + kRenewInterval;
  actions = keeper.step(renew_at, members, partitions, table);
  ASSERT_EQ(actions.size(), 1u);
  const auto* renew = std::get_if<RenewLease>(&actions[0]);
  ASSERT_NE(renew, nullptr);
  EXPECT_EQ(renew->revision, 5u);
  // Still owned while the renewal is out: its deadline has not come.
  EXPECT_EQ(keeper.epoch_of("m/default", renew_at), 5u);
  keeper.on_renewed("m/default", std::nullopt);
  EXPECT_FALSE(keeper.epoch_of("m/default", renew_at).has_value());
  EXPECT_TRUE(keeper.owned(renew_at).empty());
}

TEST(PartitionLeaseKeeperTest, RenewalMovesTheEpochToTheNewRevision) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 1, options()};
  const std::vector<MemberRecord> members{{"node-a", 1, "", 1.0, 0}};
  const std::vector<std::string> partitions{"m/default"};
  keeper.step(start, members, partitions, LeaseTable{});
  keeper.on_acquired("m/default", 5);
  keeper.step(start + kRenewInterval, members, partitions, LeaseTable{});
  keeper.on_renewed("m/default", 9);
  EXPECT_EQ(
      keeper.owned(start + kRenewInterval),
      (std::vector<OwnedPartition>{{"m/default", 9, start + kRenewInterval + kRenewDeadline}}));
  // The deadline counts from when the renewal was sent.
  EXPECT_EQ(keeper.next_fence(), start + kRenewInterval + kRenewDeadline);
}

TEST(PartitionLeaseKeeperTest, SupersededRevisionInTheTableStopsOwningAtOnce) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 1, options()};
  const std::vector<MemberRecord> members{{"node-a", 1, "", 1.0, 0}, {"node-b", 1, "", 1.0, 0}};
  const std::vector<std::string> partitions{"m/default"};
  LeaseTable empty;
  auto actions = keeper.step(start, {members.data(), 1}, partitions, empty);
  ASSERT_EQ(actions.size(), 1u);
  keeper.on_acquired("m/default", 5);

  LeaseTable table;
  table.leases["m/default"] = LeaseRecord{LeaseValue{"node-b", 1, false}, 8};
  const auto now = start + milliseconds(100);
  keeper.step(now, members, partitions, table);
  EXPECT_FALSE(keeper.epoch_of("m/default", now).has_value());
}

TEST(PartitionLeaseKeeperTest, OwnershipEndsAtTheRenewDeadlineWhenRenewalsGoUnanswered) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 1, options()};
  const std::vector<MemberRecord> members{{"node-a", 1, "", 1.0, 0}};
  const std::vector<std::string> partitions{"m/default"};
  keeper.step(start, members, partitions, LeaseTable{});
  keeper.on_acquired("m/default", 3);
  // The renewal goes out and its answer never comes (NATS lost).
  const auto actions = keeper.step(start + kRenewInterval, members, partitions, LeaseTable{});
  ASSERT_EQ(actions.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<RenewLease>(actions[0]));
  EXPECT_EQ(keeper.next_fence(), start + kRenewDeadline);
  EXPECT_TRUE(keeper.epoch_of("m/default", start + kRenewDeadline - milliseconds(1)).has_value());
  EXPECT_FALSE(keeper.epoch_of("m/default", start + kRenewDeadline).has_value());
  // No second call while the first is outstanding.
  EXPECT_TRUE(keeper.step(start + kRenewDeadline, members, partitions, LeaseTable{}).empty());
}

TEST(PartitionLeaseKeeperTest, TakesNothingUntilItsOwnMemberRecordIsVisible) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 2, options()};
  const std::vector<std::string> partitions{"m/default", "n/default"};
  // No members, and then only the record of this node's previous incarnation.
  EXPECT_TRUE(keeper.step(start, {}, partitions, LeaseTable{}).empty());
  const std::vector<MemberRecord> previous{{"node-a", 1, "", 1.0, 0}};
  EXPECT_TRUE(keeper.step(start, previous, partitions, LeaseTable{}).empty());
}

TEST(PartitionLeaseKeeperTest, APreviousIncarnationsLeaseIsLeftToAgeOut) {
  const Clock::time_point start{std::chrono::hours(1)};
  PartitionLeaseKeeper keeper{"node-a", 2, options()};
  const std::vector<MemberRecord> members{{"node-a", 2, "", 1.0, 0}};
  const std::vector<std::string> partitions{"m/default"};
  LeaseTable table;
  // Written by node-a's previous process, which may still be running (paused) and renewing.
  table.leases["m/default"] = LeaseRecord{LeaseValue{"node-a", 1, false}, 4};
  for (const auto& action : keeper.step(start, members, partitions, table)) {
    EXPECT_FALSE(std::holds_alternative<AcquireLease>(action));
  }
}

TEST(PartitionLeaseKeeperTest, OptionsMustLeaveTheDeadlineBelowTheTtl) {
  EXPECT_FALSE(validate(options()).has_value());
  auto bad = options();
  bad.renew_deadline = kTtl;
  EXPECT_TRUE(validate(bad).has_value());
  bad = options();
  bad.renew_interval = kRenewDeadline;
  EXPECT_TRUE(validate(bad).has_value());
  bad = options();
  bad.renew_interval = milliseconds(0);
  EXPECT_TRUE(validate(bad).has_value());
  bad = options();
  bad.load_slack = -0.5;
  EXPECT_TRUE(validate(bad).has_value());
}

}  // namespace
}  // namespace kvr::cluster
