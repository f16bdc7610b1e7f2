#include "selection/cluster/cluster_status.hpp"

#include <gtest/gtest.h>

namespace kvr::cluster {
namespace {

MemberRecord member(std::string node_id, std::uint64_t incarnation) {
  return MemberRecord{.node_id = std::move(node_id), .incarnation = incarnation};
}

PartitionStatus leased(std::string partition, std::string owner, std::uint64_t incarnation,
                       bool handed_over = false) {
  PartitionStatus status;
  status.partition = std::move(partition);
  status.lease = LeaseValue{.owner_node_id = std::move(owner),
                            .owner_incarnation = incarnation,
                            .handed_over = handed_over};
  status.epoch = 7;
  return status;
}

TEST(ClusterStatusStateTest, ALiveMembersLeaseIsOwned) {
  const ClusterStatus status{.members = {member("a", 1)}, .partitions = {leased("m/", "a", 1)}};
  EXPECT_EQ(state_of(status, status.partitions[0]), LeaseState::owned);
}

TEST(ClusterStatusStateTest, ALeaseOfAnEarlierIncarnationIsExpiring) {
  // The node restarted: same id, new incarnation; the old lease ages out.
  const ClusterStatus status{.members = {member("a", 2)}, .partitions = {leased("m/", "a", 1)}};
  EXPECT_EQ(state_of(status, status.partitions[0]), LeaseState::expiring);
}

TEST(ClusterStatusStateTest, HandedOverReleasedAndUnleasedAreToldApart) {
  PartitionStatus readiness_only;
  readiness_only.partition = "m/";
  readiness_only.ready = ReadyValue{.node_id = "b", .incarnation = 3};
  const ClusterStatus status{
      .members = {member("a", 1), member("b", 3)},
      .partitions = {leased("m/x", "b", 3, true), leased("m/y", "", 0), readiness_only}};
  EXPECT_EQ(state_of(status, status.partitions[0]), LeaseState::handing_over);
  EXPECT_EQ(state_of(status, status.partitions[1]), LeaseState::released);
  EXPECT_EQ(state_of(status, status.partitions[2]), LeaseState::unleased);
  EXPECT_EQ(as_str(LeaseState::handing_over), "handing-over");
}

TEST(ClusterStatusStateTest, AnOwnedPartitionPlacedElsewhereIsAPendingHandover) {
  PartitionStatus moving = leased("m/x", "a", 1);
  moving.desired_owner = "b";
  PartitionStatus staying = leased("m/y", "a", 1);
  staying.desired_owner = "a";
  const ClusterStatus status{.members = {member("a", 1), member("b", 1)},
                             .partitions = {moving, staying}};
  EXPECT_TRUE(handover_pending(moving, state_of(status, moving)));
  EXPECT_FALSE(handover_pending(staying, state_of(status, staying)));
  const StatusSummary summary = summarise(status);
  EXPECT_EQ(summary.owned, 2);
  EXPECT_EQ(summary.handovers_pending, 1);
}

TEST(ClusterStatusStateTest, AnExpiringLeaseIsNeitherOwnedNorAPendingHandover) {
  PartitionStatus orphan = leased("m/x", "gone", 1);
  orphan.desired_owner = "a";
  const ClusterStatus status{.members = {member("a", 1)}, .partitions = {orphan}};
  EXPECT_FALSE(handover_pending(orphan, state_of(status, orphan)));
  EXPECT_EQ(summarise(status).owned, 0);
}

}  // namespace
}  // namespace kvr::cluster
