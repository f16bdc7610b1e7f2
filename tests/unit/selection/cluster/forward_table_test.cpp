// The forwarder's routing table: route requests by partition owner, generate requests, reports by
// lease prefix, waiting for views up to the limit, and view changes.
#include "selection/cluster/forward_table.hpp"

#include <ostream>

#include <gtest/gtest.h>

#include "selection/cluster/placement.hpp"

namespace kvr::cluster {

void PrintTo(const ForwardDecision& decision, std::ostream* out) {
  switch (decision.action) {
    case ForwardDecision::Action::serve_here:
      *out << "serve_here";
      return;
    case ForwardDecision::Action::await_view:
      *out << "await_view";
      return;
    case ForwardDecision::Action::forward:
      *out << "forward(" << decision.node_id << " at " << decision.address.value_or("<no address>")
           << ")";
      return;
  }
}

namespace {

constexpr std::uint64_t kSelfIncarnation = 0xa1;
constexpr std::uint64_t kPeerIncarnation = 0xb2;
constexpr std::uint64_t kThirdIncarnation = 0xc3;

const std::string kChat = partition_key("chat", "default");
const std::string kCode = partition_key("code", "default");

MemberRecord member(std::string node_id, std::uint64_t incarnation, std::string address) {
  return MemberRecord{std::move(node_id), incarnation, std::move(address), 1.0, 0};
}

// One cluster view as the table takes it.
struct View {
  std::vector<OwnedPartition> owned;
  std::map<std::string, PartitionOwner> elsewhere;
  std::vector<MemberRecord> members;
};

class ForwardTableTest : public ::testing::Test {
 protected:
  void apply(const View& view) { table_.apply(view.owned, view.elsewhere, view.members); }

  // This node (a) owns chat; b owns code; a and b are members.
  static View two_nodes() {
    View view;
    view.owned.push_back(OwnedPartition{kChat, 7, {}});
    view.elsewhere[kCode] = PartitionOwner{"b", "10.0.0.2:4001", 9};
    view.members = {member("a", kSelfIncarnation, "10.0.0.1:4001"),
                    member("b", kPeerIncarnation, "10.0.0.2:4001")};
    return view;
  }

  static std::string lease_of(std::uint64_t incarnation) {
    return booking_id_prefix(incarnation) + "-0000000000000001";
  }

  ForwardTable table_{"a", booking_id_prefix(kSelfIncarnation)};
};

TEST(BookingIdPrefixTest, IsTheIncarnationInSixteenLowerCaseHexDigits) {
  EXPECT_EQ(booking_id_prefix(0), "0000000000000000");
  EXPECT_EQ(booking_id_prefix(0xabcdef), "0000000000abcdef");
  EXPECT_EQ(booking_id_prefix(0xffffffffffffffffULL), "ffffffffffffffff");
}

TEST_F(ForwardTableTest, OwnPartitionIsServedHereWithoutWaiting) {
  apply(two_nodes());
  EXPECT_EQ(table_.route(kChat, 0), ForwardDecision::serve_here());
  EXPECT_EQ(table_.generate(kChat), ForwardDecision::serve_here());
  EXPECT_TRUE(table_.owns(kChat));
}

TEST_F(ForwardTableTest, OtherOwnersPartitionIsForwardedWithItsMemberAddress) {
  apply(two_nodes());
  const auto expected = ForwardDecision::forward("b", "10.0.0.2:4001");
  EXPECT_EQ(table_.route(kCode, 0), expected);
  // However long it waited: a known owner is always the answer.
  EXPECT_EQ(table_.route(kCode, kMaxViewWaits), expected);
  EXPECT_EQ(table_.generate(kCode), expected);
}

TEST_F(ForwardTableTest, OwnerWithoutMemberRecordIsForwardedWithoutAddress) {
  View view = two_nodes();
  view.members.pop_back();  // b's announcement lapsed, its lease has not
  apply(view);
  EXPECT_EQ(table_.route(kCode, 0), ForwardDecision::forward("b", std::nullopt));
  EXPECT_EQ(table_.address_of("b"), std::nullopt);
  EXPECT_EQ(table_.address_of("a"), "10.0.0.1:4001");
}

TEST_F(ForwardTableTest, UnknownOwnerWaitsForViewsThenIsServedHere) {
  apply(two_nodes());
  const std::string unknown = partition_key("new-model", "default");
  for (int waited = 0; waited < kMaxViewWaits; ++waited) {
    EXPECT_EQ(table_.route(unknown, waited), ForwardDecision::await_view()) << waited;
    EXPECT_TRUE(ForwardTable::may_await_view(waited)) << waited;
  }
  EXPECT_EQ(table_.route(unknown, kMaxViewWaits), ForwardDecision::serve_here());
  EXPECT_FALSE(ForwardTable::may_await_view(kMaxViewWaits));
  // A generate request never waits.
  EXPECT_EQ(table_.generate(unknown), ForwardDecision::serve_here());
}

TEST_F(ForwardTableTest, EmptyTableHoldsEveryRouteRequest) {
  EXPECT_EQ(table_.route(kChat, 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.generate(kChat), ForwardDecision::serve_here());
  EXPECT_TRUE(table_.owned().empty());
}

TEST_F(ForwardTableTest, StaleRecordNamingThisNodeIsNeverForwardedToItself) {
  View view = two_nodes();
  view.elsewhere[kCode].node_id = "a";  // a lease this node lost and has not re-owned
  apply(view);
  EXPECT_EQ(table_.route(kCode, 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.route(kCode, kMaxViewWaits), ForwardDecision::serve_here());
  EXPECT_EQ(table_.generate(kCode), ForwardDecision::serve_here());
}

TEST_F(ForwardTableTest, ReportIsRoutedByItsBookingIdPrefix) {
  apply(two_nodes());
  EXPECT_EQ(table_.report(lease_of(kSelfIncarnation), 0), ForwardDecision::serve_here());
  EXPECT_EQ(table_.report(lease_of(kPeerIncarnation), 0),
            ForwardDecision::forward("b", "10.0.0.2:4001"));
}

TEST_F(ForwardTableTest, OwnBookingIdPrefixIsServedHereBeforeAnyView) {
  EXPECT_EQ(table_.report(lease_of(kSelfIncarnation), 0), ForwardDecision::serve_here());
}

TEST_F(ForwardTableTest, ReportOfAnUnknownPrefixWaitsThenIsServedHere) {
  apply(two_nodes());
  // A node not in the view, and a prefix no incarnation has.
  for (const std::string& booking_id : {lease_of(kThirdIncarnation), std::string{"not-hex"}}) {
    for (int waited = 0; waited < kMaxViewWaits; ++waited) {
      EXPECT_EQ(table_.report(booking_id, waited), ForwardDecision::await_view()) << booking_id;
    }
    EXPECT_EQ(table_.report(booking_id, kMaxViewWaits), ForwardDecision::serve_here())
        << booking_id;
  }
  // Not a cluster lease id at all (no prefix): the same.
  EXPECT_EQ(table_.report("nodash", 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.report("nodash", kMaxViewWaits), ForwardDecision::serve_here());
}

TEST_F(ForwardTableTest, StalePrefixOfARestartedMemberWaitsAndItsNewOneIsForwarded) {
  apply(two_nodes());
  View restarted = two_nodes();
  restarted.members[1] = member("b", kThirdIncarnation, "10.0.0.2:4002");
  restarted.elsewhere[kCode].address = "10.0.0.2:4002";
  apply(restarted);
  EXPECT_EQ(table_.report(lease_of(kPeerIncarnation), 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.report(lease_of(kThirdIncarnation), 0),
            ForwardDecision::forward("b", "10.0.0.2:4002"));
  EXPECT_EQ(table_.route(kCode, 0), ForwardDecision::forward("b", "10.0.0.2:4002"));
}

TEST_F(ForwardTableTest, ReportOfAPrefixNamingThisNodeIsServedHere) {
  View view = two_nodes();
  // This node's member record with another incarnation than the table's own prefix.
  view.members[0].incarnation = kThirdIncarnation;
  apply(view);
  EXPECT_EQ(table_.report(lease_of(kThirdIncarnation), 0), ForwardDecision::serve_here());
  EXPECT_EQ(table_.report(lease_of(kSelfIncarnation), 0), ForwardDecision::serve_here());
}

TEST_F(ForwardTableTest, ViewChangeMovesAPartition) {
  apply(two_nodes());
  ASSERT_EQ(table_.route(kChat, 0), ForwardDecision::serve_here());
  ASSERT_EQ(table_.route(kCode, 0), ForwardDecision::forward("b", "10.0.0.2:4001"));

  // Handover: chat goes to b, code comes here.
  View moved;
  moved.owned.push_back(OwnedPartition{kCode, 10, {}});
  moved.elsewhere[kChat] = PartitionOwner{"b", "10.0.0.2:4001", 8};
  moved.members = two_nodes().members;
  apply(moved);
  EXPECT_EQ(table_.route(kChat, 0), ForwardDecision::forward("b", "10.0.0.2:4001"));
  EXPECT_EQ(table_.route(kCode, 0), ForwardDecision::serve_here());
  EXPECT_EQ(table_.owned(), std::set<std::string>{kCode});

  // b dies: its lease is gone before anyone owns chat again, so chat waits.
  View lost;
  lost.owned.push_back(OwnedPartition{kCode, 11, {}});
  lost.members = {member("a", kSelfIncarnation, "10.0.0.1:4001")};
  apply(lost);
  EXPECT_EQ(table_.route(kChat, 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.report(lease_of(kPeerIncarnation), 0), ForwardDecision::await_view());
  EXPECT_EQ(table_.address_of("b"), std::nullopt);
}

}  // namespace
}  // namespace kvr::cluster
