// Caps on open bookings: per partition, per node and per client (both shared by the node's
// selectors), on bookings and on booked prompt blocks. A route beyond a cap is refused as
// overloaded before selection, naming the cap; released, expired and removed bookings give their
// share back, and so does a selector that goes away.
#include <gtest/gtest.h>

#include "discovery/block_hash.hpp"
#include "selection/config/router_policy_config.hpp"
#include "selection/partition/selector_state.hpp"
#include "selection/policies/builtin_policies.hpp"
#include "tests/testing/worker_registration.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;

constexpr std::uint32_t kBlockSize = 16;
const TimePoint kStart{std::chrono::seconds(1000)};
constexpr auto kBookingTtl = 30s;

std::vector<BlockHash> blocks(std::size_t length, std::uint64_t seed) {
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;
  for (std::size_t i = 0; i < length; ++i) {
    parent = discovery::BlockHasher::chain(parent, seed * 100'000 + i);
    hashes.push_back(*parent);
  }
  return hashes;
}

class BookingCapsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto registered = selection::register_builtin_policies(registry_);
    ASSERT_TRUE(registered) << registered.error().message();
    auto plugins = registry_.resolve_plugins(selection::RouterPolicyConfig{});
    ASSERT_TRUE(plugins) << plugins.error().message();
    plugins_ = std::make_unique<plugins::RouterPlugins>(std::move(*plugins));
  }

  // A partition of `model` with one worker (id `worker`), under `partition_caps` and, when
  // given, the node totals shared with the other partitions.
  std::unique_ptr<SelectorState> partition(std::string model, WorkerId worker,
                                           BookingCaps partition_caps,
                                           std::shared_ptr<NodeBookingTotals> node = nullptr,
                                           std::shared_ptr<ClientBookingTotals> clients = nullptr) {
    SelectorOptions options;
    options.partition.model = model;
    options.router.block_size = kBlockSize;
    options.booking_ttl = kBookingTtl;
    options.partition_caps = partition_caps;
    options.node_totals = std::move(node);
    options.client_totals = std::move(clients);
    options.on_cap_refusal = [this](BookingCapKind kind) { refusals_.push_back(kind); };
    auto state = std::make_unique<SelectorState>(std::move(options), *plugins_);
    auto added = state->register_worker(
        testing::worker_registration(worker, model, kBlockSize, 60s), kStart);
    EXPECT_TRUE(added) << added.error().message();
    EXPECT_TRUE(state->update_load({worker, 0}, discovery::ConfirmedLoad{}));
    return state;
  }

  // `client`: the scope the request arrives in (as the NATS bridge or the ingress sets it).
  static std::expected<RouteOutcome, RouteFailure> route(SelectorState& state,
                                                         const std::string& request_id,
                                                         std::size_t block_count,
                                                         TimePoint now = kStart,
                                                         std::string_view client = {}) {
    RouteRequest input;
    input.selection.request_id = request_id;
    scope_request_id(input, client);
    input.selection.prompt_tokens = block_count * kBlockSize;
    input.selection.block_hashes = blocks(block_count, std::hash<std::string>{}(request_id) % 997);
    return state.route(input, now);
  }

  // The route is refused as overloaded by `kind`, its message naming the cap.
  void expect_refused(const std::expected<RouteOutcome, RouteFailure>& routed, BookingCapKind kind,
                      std::string_view named) {
    ASSERT_FALSE(routed) << "routed beyond the cap";
    EXPECT_EQ(routed.error().code, Error::overloaded);
    EXPECT_NE(routed.error().message.find(named), std::string::npos) << routed.error().message;
    ASSERT_FALSE(refusals_.empty());
    EXPECT_EQ(refusals_.back(), kind);
  }

  plugins::RouterPluginRegistry registry_;
  std::unique_ptr<plugins::RouterPlugins> plugins_;
  std::vector<BookingCapKind> refusals_;
};

TEST_F(BookingCapsTest, PartitionBookingCapRefusesTheNextRouteUntilALeaseIsReleased) {
  auto state = partition("llama", 1, BookingCaps{.max_bookings = 2});
  ASSERT_TRUE(route(*state, "a", 4));
  ASSERT_TRUE(route(*state, "b", 4));
  expect_refused(route(*state, "c", 4), BookingCapKind::partition_bookings,
                 "partition open-booking cap reached: 2 bookings open, at most 2");
  // A refused route books nothing.
  EXPECT_EQ(state->partition_workers().load().open_bookings(), 2U);
  // A first token keeps the booking open; the release frees its share.
  ASSERT_TRUE(state->first_token("a"));
  expect_refused(route(*state, "c", 4), BookingCapKind::partition_bookings, "open-booking cap");
  ASSERT_TRUE(state->release("a", discovery::BookingEnd::completed));
  EXPECT_TRUE(route(*state, "c", 4));
}

TEST_F(BookingCapsTest, PartitionBlockCapCountsEveryOpenBookingsPromptBlocks) {
  auto state = partition("llama", 1, BookingCaps{.max_blocks = 10});
  ASSERT_TRUE(route(*state, "a", 6));
  EXPECT_EQ(state->partition_workers().load().booked_prompt_blocks(), 6U);
  expect_refused(route(*state, "b", 5), BookingCapKind::partition_blocks,
                 "partition booked-blocks cap reached: 6 blocks booked, a request of 5 would pass "
                 "the cap of 10");
  // What still fits is served.
  ASSERT_TRUE(route(*state, "c", 4));
  EXPECT_EQ(state->partition_workers().load().booked_prompt_blocks(), 10U);
  // A request larger than the whole cap is refused even when nothing is booked.
  ASSERT_TRUE(state->release("a", discovery::BookingEnd::cancelled));
  ASSERT_TRUE(state->release("c", discovery::BookingEnd::completed));
  EXPECT_EQ(state->partition_workers().load().booked_prompt_blocks(), 0U);
  expect_refused(route(*state, "d", 11), BookingCapKind::partition_blocks, "cap of 10");
  EXPECT_TRUE(route(*state, "d", 10));
}

TEST_F(BookingCapsTest, NodeBookingCapHoldsAcrossPartitions) {
  auto node = std::make_shared<NodeBookingTotals>(BookingCaps{.max_bookings = 3});
  auto llama = partition("llama", 1, {}, node);
  auto mistral = partition("mistral", 2, {}, node);
  ASSERT_TRUE(route(*llama, "a", 2));
  ASSERT_TRUE(route(*llama, "b", 2));
  ASSERT_TRUE(route(*mistral, "c", 2));
  EXPECT_EQ(node->bookings.load(), 3U);
  expect_refused(route(*mistral, "d", 2), BookingCapKind::node_bookings,
                 "node open-booking cap reached: 3 bookings open, at most 3 (the node)");
  expect_refused(route(*llama, "d", 2), BookingCapKind::node_bookings, "node open-booking cap");
  // A booking released in one partition makes room in the other.
  ASSERT_TRUE(llama->release("a", discovery::BookingEnd::completed));
  EXPECT_EQ(node->bookings.load(), 2U);
  EXPECT_TRUE(route(*mistral, "d", 2));
}

TEST_F(BookingCapsTest, NodeBlockCapHoldsAcrossPartitions) {
  auto node = std::make_shared<NodeBookingTotals>(BookingCaps{.max_blocks = 100});
  auto llama = partition("llama", 1, {}, node);
  auto mistral = partition("mistral", 2, {}, node);
  ASSERT_TRUE(route(*llama, "a", 60));
  ASSERT_TRUE(route(*mistral, "b", 30));
  EXPECT_EQ(node->blocks.load(), 90U);
  expect_refused(route(*mistral, "c", 11), BookingCapKind::node_blocks,
                 "node booked-blocks cap reached: 90 blocks booked");
  ASSERT_TRUE(route(*mistral, "c", 10));
  ASSERT_TRUE(llama->release("a", discovery::BookingEnd::failed));
  EXPECT_EQ(node->blocks.load(), 40U);
  EXPECT_TRUE(route(*llama, "d", 60));
}

TEST_F(BookingCapsTest, ThePartitionCapAppliesBelowTheNodeCap) {
  auto node = std::make_shared<NodeBookingTotals>(BookingCaps{.max_bookings = 10});
  auto llama = partition("llama", 1, BookingCaps{.max_bookings = 1}, node);
  auto mistral = partition("mistral", 2, {}, node);
  ASSERT_TRUE(route(*llama, "a", 2));
  expect_refused(route(*llama, "b", 2), BookingCapKind::partition_bookings,
                 "partition 'llama' group 'default'");
  // The other partition is not held back by llama's cap.
  EXPECT_TRUE(route(*mistral, "b", 2));
}

TEST_F(BookingCapsTest, ExpiredBookingsFreeTheirShare) {
  auto node = std::make_shared<NodeBookingTotals>(BookingCaps{.max_bookings = 2, .max_blocks = 8});
  auto state = partition("llama", 1, {}, node);
  ASSERT_TRUE(route(*state, "a", 4));
  ASSERT_TRUE(route(*state, "b", 4));
  expect_refused(route(*state, "c", 1), BookingCapKind::node_bookings, "open-booking cap");
  // Never reported: the bookings expire at their booking TTL, on the per-request sweep ...
  EXPECT_EQ(state->expire_bookings(kStart + kBookingTtl, 1), 1U);
  EXPECT_EQ(node->bookings.load(), 1U);
  EXPECT_EQ(node->blocks.load(), 4U);
  // ... or on the timer's.
  std::vector<WorkerId> removed;
  state->expire(kStart + kBookingTtl, removed);
  EXPECT_EQ(node->bookings.load(), 0U);
  EXPECT_EQ(node->blocks.load(), 0U);
  EXPECT_TRUE(route(*state, "c", 8, kStart + kBookingTtl));
}

TEST_F(BookingCapsTest, ARemovedWorkerAndARetiredPartitionGiveTheirShareBack) {
  auto node = std::make_shared<NodeBookingTotals>(BookingCaps{.max_bookings = 5});
  auto llama = partition("llama", 1, {}, node);
  auto mistral = partition("mistral", 2, {}, node);
  ASSERT_TRUE(route(*llama, "a", 3));
  ASSERT_TRUE(route(*mistral, "b", 3));
  ASSERT_TRUE(route(*mistral, "c", 3));
  EXPECT_EQ(node->bookings.load(), 3U);
  ASSERT_TRUE(llama->deregister(1, 1));
  EXPECT_EQ(node->bookings.load(), 2U);
  mistral.reset();
  EXPECT_EQ(node->bookings.load(), 0U);
  EXPECT_EQ(node->blocks.load(), 0U);
}

TEST_F(BookingCapsTest, NoCapsMeansNoRefusal) {
  auto state = partition("llama", 1, {});
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(route(*state, "r" + std::to_string(i), 8));
  EXPECT_TRUE(refusals_.empty());
  EXPECT_EQ(state->partition_workers().load().booked_prompt_blocks(), 400U);
}

// ---- per client -------------------------------------------------------------------------------

constexpr std::string_view kRogue = "nats:_INBOX.rogue.";
constexpr std::string_view kHonest = "nats:_INBOX.honest.";

// A client at its booking cap is refused in every partition while another is served; its releases,
// in any partition, give its share back.
TEST_F(BookingCapsTest, AClientAtItsBookingCapIsRefusedWhileAnotherIsServed) {
  auto clients = std::make_shared<ClientBookingTotals>(BookingCaps{.max_bookings = 2});
  auto llama = partition("llama", 1, {}, nullptr, clients);
  auto mistral = partition("mistral", 2, {}, nullptr, clients);
  ASSERT_TRUE(route(*llama, "a", 2, kStart, kRogue));
  ASSERT_TRUE(route(*mistral, "b", 2, kStart, kRogue));
  expect_refused(route(*llama, "c", 2, kStart, kRogue), BookingCapKind::client_bookings,
                 "client open-booking cap reached: 2 bookings open, at most 2 (this client");
  expect_refused(route(*mistral, "c", 2, kStart, kRogue), BookingCapKind::client_bookings,
                 "client open-booking cap");
  // Another client, the same ids: served in both partitions.
  ASSERT_TRUE(route(*llama, "a", 2, kStart, kHonest));
  ASSERT_TRUE(route(*mistral, "c", 2, kStart, kHonest));
  EXPECT_EQ(clients->held(kRogue).bookings, 2U);
  EXPECT_EQ(clients->held(kHonest).bookings, 2U);
  // The rogue's release in one partition lets it book in the other.
  ASSERT_TRUE(llama->release("a@" + std::string{kRogue}, discovery::BookingEnd::completed));
  EXPECT_EQ(clients->held(kRogue).bookings, 1U);
  EXPECT_TRUE(route(*mistral, "c", 2, kStart, kRogue));
}

TEST_F(BookingCapsTest, AClientsBlockCapCountsItsPromptBlocksOverEveryPartition) {
  auto clients = std::make_shared<ClientBookingTotals>(BookingCaps{.max_blocks = 10});
  auto llama = partition("llama", 1, {}, nullptr, clients);
  auto mistral = partition("mistral", 2, {}, nullptr, clients);
  ASSERT_TRUE(route(*llama, "a", 6, kStart, kRogue));
  expect_refused(route(*mistral, "b", 5, kStart, kRogue), BookingCapKind::client_blocks,
                 "client booked-blocks cap reached: 6 blocks booked, a request of 5 would pass "
                 "the cap of 10");
  ASSERT_TRUE(route(*mistral, "b", 4, kStart, kRogue));
  EXPECT_EQ(clients->held(kRogue).blocks, 10U);
  EXPECT_TRUE(route(*mistral, "c", 10, kStart, kHonest));
}

// Expiry, a removed worker and a retired partition give a client's share back; the entry of a
// client that holds nothing is gone.
TEST_F(BookingCapsTest, EveryWayABookingEndsGivesTheClientsShareBack) {
  auto clients = std::make_shared<ClientBookingTotals>(BookingCaps{.max_bookings = 10});
  auto llama = partition("llama", 1, {}, nullptr, clients);
  auto mistral = partition("mistral", 2, {}, nullptr, clients);
  ASSERT_TRUE(route(*llama, "a", 3, kStart, kRogue));
  ASSERT_TRUE(route(*llama, "b", 3, kStart + 1s, kRogue));
  ASSERT_TRUE(route(*mistral, "c", 3, kStart, kRogue));
  ASSERT_TRUE(route(*mistral, "d", 3, kStart, kHonest));
  EXPECT_EQ(clients->held(kRogue).bookings, 3U);
  EXPECT_EQ(llama->expire_bookings(kStart + kBookingTtl, 10), 1U);
  EXPECT_EQ(clients->held(kRogue).bookings, 2U);
  EXPECT_EQ(clients->held(kRogue).blocks, 6U);
  ASSERT_TRUE(llama->deregister(1, 1));
  EXPECT_EQ(clients->held(kRogue).bookings, 1U);
  mistral.reset();
  EXPECT_EQ(clients->held(kRogue).bookings, 0U);
  EXPECT_EQ(clients->held(kHonest).bookings, 0U);
  EXPECT_EQ(clients->clients(), 0U);
}

// The node's own actors (the front door, the endpoint picker) and unscoped requests (generate
// mode) end their bookings themselves: no per-client cap applies to them.
TEST_F(BookingCapsTest, TheNodesOwnActorsAndUnscopedRequestsAreNotCappedPerClient) {
  auto clients = std::make_shared<ClientBookingTotals>(BookingCaps{.max_bookings = 1});
  auto llama = partition("llama", 1, {}, nullptr, clients);
  const std::string local = std::string{kLocalActorScope} + "42@node";
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(route(*llama, "gateway-" + std::to_string(i), 2, kStart, local));
    ASSERT_TRUE(route(*llama, "generate-" + std::to_string(i), 2, kStart));
  }
  EXPECT_EQ(clients->clients(), 0U);
  EXPECT_TRUE(refusals_.empty());
  // A remote actor client is capped.
  const std::string remote = std::string{kRemoteActorScope} + "42@elsewhere";
  ASSERT_TRUE(route(*llama, "x", 2, kStart, remote));
  expect_refused(route(*llama, "y", 2, kStart, remote), BookingCapKind::client_bookings,
                 "client open-booking cap");
}

}  // namespace
}  // namespace kvr
