// A rogue client against `kvr node` as a real process (a real nats-server, `kvr mocker` workers on
// loopback): it routes long prompts and never reports. Its partition's caps stop it with explicit
// overload errors naming the cap, the node's resident memory stays under the bound the protocol
// guide documents, a client of another partition is served meanwhile until the node-wide cap, and
// the rogue's bookings free their share when they expire.
#include <fstream>

#include <gtest/gtest.h>
#include <stdlib.h>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::free_port;
using testing::http_get;
using testing::metric;
using testing::wait_until;

constexpr std::string_view kNamespace = "faults";
constexpr std::uint32_t kBlockSize = 16;
// The rogue's prompts: 100,000 blocks (1.6 M tokens, 800 KB of hashes on the wire).
constexpr std::size_t kLongPromptBlocks = 100'000;
// Its partition may book 30 of them (and 100 blocks more) and 100 bookings; the node 3.5 M blocks
// and 150 bookings.
constexpr std::uint64_t kPartitionBlocks = 3'000'100;
constexpr std::uint64_t kPartitionBookings = 100;
constexpr std::uint64_t kNodeBlocks = 3'500'000;
constexpr std::uint64_t kNodeBookings = 150;
// Long enough for the test's steps before the rogue's bookings expire, with margin for a machine
// that runs other suites beside this one (30 routes of 100,000 blocks take seconds under ASan).
constexpr int kBookingTtlSecs = 30;
// The bound docs/protocol.md gives per open booking: 1 KB plus 48 bytes per booked block.
constexpr double kBytesPerBooking = 1024;
constexpr double kBytesPerBlock = 48;

// The resident set of a process, in bytes.
double resident_bytes(pid_t pid) { return static_cast<double>(testing::resident_kib(pid)) * 1024; }

class BookingCapTest : public testing::KvrClusterTest {
 protected:
  BookingCapTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void SetUp() override {
    KvrClusterTest::SetUp();
    if (HasFatalFailure()) return;
    for (const auto& [model, id] : {std::pair{"rogue-model", 1}, std::pair{"other-model", 2}}) {
      auto mocker = kvr_->start_mocker({.workers = 1,
                                        .worker_id_base = static_cast<WorkerId>(id),
                                        .block_size = kBlockSize,
                                        .num_gpu_blocks = 4096,
                                        .liveness_ttl_ms = 10'000,
                                        .extra = {"--model", model}},
                                       std::string{model} + ".log");
      ASSERT_TRUE(mocker);
      mockers_.push_back(std::move(*mocker));
    }
    // The node-wide block cap in its environment form; the rest as flags.
    ASSERT_EQ(setenv("KVR_ROUTER_MAX_BOOKED_BLOCKS", std::to_string(kNodeBlocks).c_str(), 1), 0);
    // Under AddressSanitizer, freed memory waits in a quarantine (256 MB by default) before
    // reuse: the node's resident set would measure the sanitizer's quarantine, not what the
    // bookings hold. A small one keeps the measurement about live memory.
    const char* asan = getenv("ASAN_OPTIONS");
    const std::string saved_asan = asan != nullptr ? asan : "";
    ASSERT_EQ(setenv("ASAN_OPTIONS",
                     (saved_asan.empty() ? std::string{} : saved_asan + ":")
                         .append("quarantine_size_mb=4")
                         .c_str(),
                     1),
              0);
    metrics_port_ = free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize,
                              .metrics_port = metrics_port_,
                              .booking_ttl_secs = std::to_string(booking_ttl_secs()),
                              .extra = cap_flags()});
    unsetenv("KVR_ROUTER_MAX_BOOKED_BLOCKS");
    if (saved_asan.empty()) {
      unsetenv("ASAN_OPTIONS");
    } else {
      setenv("ASAN_OPTIONS", saved_asan.c_str(), 1);
    }
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
    // Each client on a connection of its own: request ids are scoped to it.
    for (auto* client : {&rogue_, &other_}) {
      auto connected = nats::NatsClient::connect({.url = server_->url()});
      ASSERT_TRUE(connected) << connected.error();
      *client = std::move(*connected);
    }
    ASSERT_TRUE(
        wait_until([&] { return route(*other_, "other-model", "probe-o", 1).has_success(); }, 20s));
    ASSERT_TRUE(
        wait_until([&] { return route(*rogue_, "rogue-model", "probe-r", 1).has_success(); }, 20s));
    report_completed(*other_, "probe-o");
    report_completed(*rogue_, "probe-r");
    ASSERT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 10s));
  }

  void TearDown() override {
    if (HasFailure() && node_) std::cerr << "---- node log\n" << node_->log();
  }

  // How long an unreported booking lives.
  virtual int booking_ttl_secs() const { return kBookingTtlSecs; }

  // The caps the node starts with, besides the node-wide block cap (in the environment).
  virtual std::vector<std::string> cap_flags() const {
    // Without per-client caps: this fixture's rogue meets the partition's and the node's.
    return {"--router-max-open-bookings",
            std::to_string(kNodeBookings),
            "--router-partition-max-open-bookings",
            std::to_string(kPartitionBookings),
            "--router-partition-max-booked-blocks",
            std::to_string(kPartitionBlocks),
            "--router-max-open-bookings-per-client",
            "0",
            "--router-max-booked-blocks-per-client",
            "0"};
  }

  // Routes a prompt of `blocks` distinct blocks; remembers the booking of a success.
  v1::RouteDecision route(nats::NatsClient& client, const std::string& model,
                          const std::string& request_id, std::size_t blocks) {
    v1::RouteRequest request;
    request.set_request_id(request_id);
    request.set_model(model);
    auto* hashes = request.mutable_block_hashes();
    hashes->set_prompt_tokens(static_cast<std::uint32_t>(blocks * kBlockSize));
    // Distinct per request: no two bookings share a block.
    const std::uint64_t seed = (++requests_) << 32;
    for (std::size_t i = 0; i < blocks; ++i) hashes->add_hashes(seed + i + 1);
    v1::RouteDecision decision;
    auto reply =
        client.request(subjects::router_route(kNamespace), request.SerializeAsString(), 10s);
    if (!reply || !decision.ParseFromString(reply->data)) {
      ADD_FAILURE() << "no decision for " << request_id;
      return decision;
    }
    if (decision.has_success()) bookings_[request_id] = decision.success().booking_id();
    return decision;
  }

  void report_completed(nats::NatsClient& client, const std::string& request_id) {
    v1::LifecycleReport report;
    report.set_booking_id(bookings_.at(request_id));
    report.set_event(v1::LIFECYCLE_EVENT_COMPLETED);
    auto ack = client.request(subjects::router_report(kNamespace), report.SerializeAsString(), 5s);
    ASSERT_TRUE(ack) << ack.error();
  }

  // Routes until the node refuses; returns how many were served and the refusal. A route the node
  // could not decide in time (a loaded machine, a 100,000-block prompt under ASan) is no refusal:
  // it is tried again with a fresh id, a few times (its late booking is rolled back).
  std::pair<std::size_t, v1::RouteDecision> route_until_refused(nats::NatsClient& client,
                                                                const std::string& model,
                                                                const std::string& prefix,
                                                                std::size_t blocks,
                                                                std::size_t at_most) {
    constexpr int kAttempts = 4;
    for (std::size_t served = 0; served <= at_most; ++served) {
      v1::RouteDecision decision;
      for (int attempt = 0; attempt < kAttempts; ++attempt) {
        decision = route(client, model,
                         prefix + std::to_string(served) + "-" + std::to_string(attempt), blocks);
        if (!decision.has_error() || decision.error().code() != v1::ROUTE_ERROR_TIMEOUT) break;
      }
      if (!decision.has_success()) return {served, decision};
      served_ids_[prefix].push_back(decision.request_id());
    }
    return {at_most + 1, {}};
  }

  double node_metric(const std::string& prefix) {
    return metric(http_get(metrics_port_, "/metrics"), prefix);
  }

  std::vector<testing::ChildProcess> mockers_;
  std::optional<testing::ChildProcess> node_;
  std::unique_ptr<nats::NatsClient> rogue_;
  std::unique_ptr<nats::NatsClient> other_;
  std::map<std::string, std::string> bookings_;
  // The ids served by route_until_refused, by prefix, in order.
  std::map<std::string, std::vector<std::string>> served_ids_;
  std::uint64_t requests_ = 0;
  std::uint16_t metrics_port_ = 0;
};

void expect_overloaded(const v1::RouteDecision& decision, std::string_view cap) {
  ASSERT_TRUE(decision.has_error()) << "served beyond the cap";
  EXPECT_EQ(decision.error().code(), v1::ROUTE_ERROR_OVERLOADED) << decision.error().message();
  EXPECT_NE(decision.error().message().find(cap), std::string::npos) << decision.error().message();
}

TEST_F(BookingCapTest, ARogueClientIsStoppedAtItsCapsWhileOthersAreServed) {
  const double resident_before = resident_bytes(node_->pid());
  ASSERT_GT(resident_before, 0);

  // Long prompts, never reported: the partition's block cap stops them after 30. What the node
  // holds is counted on the node: a route answered `timeout` on a loaded machine may still have
  // been booked (and holds its booking until the booking TTL, as an unreported one does).
  const auto [long_served, long_refusal] = route_until_refused(
      *rogue_, "rogue-model", "long-", kLongPromptBlocks, kPartitionBlocks / kLongPromptBlocks);
  expect_overloaded(long_refusal, "partition booked-blocks cap reached");
  const std::size_t long_booked = static_cast<std::size_t>(
      node_metric("kvr_booked_blocks{partition=\"rogue-model/default\"}") / kLongPromptBlocks);
  EXPECT_EQ(long_booked, kPartitionBlocks / kLongPromptBlocks);
  EXPECT_LE(long_served, long_booked);

  // Under the documented bound for what it holds (ASan's shadow memory adds an eighth; the
  // allocator's and the heap's own slack 32 MB).
  const double resident_at_cap = resident_bytes(node_->pid());
  const double bound = static_cast<double>(long_booked) *
                       (kBytesPerBooking + kBytesPerBlock * static_cast<double>(kLongPromptBlocks));
  EXPECT_LT(resident_at_cap - resident_before, bound * 1.125 + 32e6)
      << "RSS " << resident_before / 1e6 << " MB -> " << resident_at_cap / 1e6 << " MB";
  std::cout << "node RSS " << resident_before / 1e6 << " MB before, " << resident_at_cap / 1e6
            << " MB with " << long_booked << " bookings of " << kLongPromptBlocks << " blocks ("
            << (resident_at_cap - resident_before) / static_cast<double>(long_booked) / 1e6
            << " MB a booking)\n";

  // Short prompts: the partition's booking cap stops them at 100 open bookings.
  const auto [short_served, short_refusal] =
      route_until_refused(*rogue_, "rogue-model", "short-", 1, kPartitionBookings);
  EXPECT_EQ(node_metric("kvr_bookings_open{partition=\"rogue-model/default\"}"),
            static_cast<double>(kPartitionBookings));
  EXPECT_LE(long_served + short_served, kPartitionBookings);
  expect_overloaded(short_refusal, "partition open-booking cap reached");

  // Another client, another partition: served meanwhile, until the node's booking cap.
  const auto [other_served, other_refusal] =
      route_until_refused(*other_, "other-model", "other-", 4, kNodeBookings);
  EXPECT_EQ(other_served, kNodeBookings - kPartitionBookings);
  expect_overloaded(other_refusal, "node open-booking cap reached");
  // Its reports free its share: served again.
  for (std::size_t i = 0; i < 10; ++i) report_completed(*other_, served_ids_["other-"].at(i));
  EXPECT_TRUE(wait_until(
      [&] { return route(*other_, "other-model", "other-again", 4).has_success(); }, 5s));

  EXPECT_GE(node_metric("kvr_booking_cap_refusals_total{scope=\"partition\",cap=\"blocks\"}"), 1);
  EXPECT_GE(node_metric("kvr_booking_cap_refusals_total{scope=\"partition\",cap=\"bookings\"}"), 1);
  EXPECT_GE(node_metric("kvr_booking_cap_refusals_total{scope=\"node\",cap=\"bookings\"}"), 1);
  EXPECT_GE(node_metric("kvr_route_errors_total{code=\"overloaded\"}"), 3);

  // The rogue's bookings expire unreported (at the booking TTL): its partition serves again.
  EXPECT_TRUE(wait_until(
      [&] { return node_metric("kvr_booked_blocks{partition=\"rogue-model/default\"}") == 0; },
      std::chrono::seconds(2 * kBookingTtlSecs)));
  // (Retried with fresh ids: a loaded machine may time a 100,000-block route out.)
  int attempt = 0;
  v1::RouteDecision after_expiry;
  EXPECT_TRUE(wait_until(
      [&] {
        after_expiry = route(*rogue_, "rogue-model", "after-expiry-" + std::to_string(++attempt),
                             kLongPromptBlocks);
        return after_expiry.has_success();
      },
      10s))
      << after_expiry.DebugString();
  // And the memory the expired bookings held is reused, not added to.
  EXPECT_LT(resident_bytes(node_->pid()), resident_at_cap + 32e6);
  EXPECT_TRUE(node_->running());
}

// Fair caps: a rogue client that never reports, on the same partition as an honest one, stops at
// its own caps (10 long prompts by blocks, then 60 bookings in all) while the node and the
// partition have room, and the honest client is served every request meanwhile.
class ClientCapTest : public BookingCapTest {
 protected:
  std::vector<std::string> cap_flags() const override {
    return {"--router-max-open-bookings",
            std::to_string(kNodeBookings),
            "--router-max-open-bookings-per-client",
            std::to_string(kClientBookings),
            "--router-max-booked-blocks-per-client",
            std::to_string(kClientBlocks)};
  }
  static constexpr std::uint64_t kClientBookings = 60;
  static constexpr std::uint64_t kClientBlocks = 10 * kLongPromptBlocks + 100;
};

TEST_F(ClientCapTest, ARogueClientAtItsCapsLeavesTheNodeToAnHonestOne) {
  // Long prompts: the rogue's block cap stops it after ten (the node's would take 35).
  const auto [long_served, long_refusal] =
      route_until_refused(*rogue_, "rogue-model", "long-", kLongPromptBlocks, 20);
  expect_overloaded(long_refusal, "client booked-blocks cap reached");
  EXPECT_EQ(node_metric("kvr_booked_blocks{partition=\"rogue-model/default\"}"),
            static_cast<double>(10 * kLongPromptBlocks));
  // Short prompts: its booking cap stops it at 60 open bookings in all (the node's is 150).
  const auto [short_served, short_refusal] =
      route_until_refused(*rogue_, "rogue-model", "short-", 1, kClientBookings);
  expect_overloaded(short_refusal, "client open-booking cap reached");
  EXPECT_EQ(node_metric("kvr_bookings_open{partition=\"rogue-model/default\"}"),
            static_cast<double>(kClientBookings));

  // The honest client, same partition: 60 requests open at once (its own cap's worth), then 100
  // one at a time, each reported: every one served.
  std::size_t served = 0;
  std::vector<std::string> open;
  for (std::size_t i = 0; i < kClientBookings; ++i) {
    const std::string id = "honest-open-" + std::to_string(i);
    const auto decision = route(*other_, "rogue-model", id, 4);
    EXPECT_TRUE(decision.has_success()) << decision.DebugString();
    if (decision.has_success()) {
      ++served;
      open.push_back(id);
    }
  }
  for (const std::string& id : open) report_completed(*other_, id);
  for (std::size_t i = 0; i < 100; ++i) {
    const std::string id = "honest-" + std::to_string(i);
    const auto decision = route(*other_, "rogue-model", id, 4);
    EXPECT_TRUE(decision.has_success()) << decision.DebugString();
    if (!decision.has_success()) continue;
    ++served;
    report_completed(*other_, id);
  }
  EXPECT_EQ(served, kClientBookings + 100);
  std::cout << "rogue client held " << kClientBookings << " bookings (" << 10 * kLongPromptBlocks
            << " blocks) at its caps; honest client served " << served << " of "
            << kClientBookings + 100 << "\n";

  EXPECT_GE(node_metric("kvr_booking_cap_refusals_total{scope=\"client\",cap=\"blocks\"}"), 1);
  EXPECT_GE(node_metric("kvr_booking_cap_refusals_total{scope=\"client\",cap=\"bookings\"}"), 1);
  EXPECT_EQ(node_metric("kvr_booking_cap_refusals_total{scope=\"node\""), 0);
  EXPECT_TRUE(node_->running());
}

// What a booking of a short prompt costs: many of them, as a pipelined flood leaves open.
class ShortBookingsTest : public BookingCapTest {
 protected:
  std::vector<std::string> cap_flags() const override {
    return {"--router-max-open-bookings", std::to_string(kShortBookings + 10)};
  }
  // Every booking must still be open when the last of the 10,000 is routed, however slow the
  // machine: the test measures what open bookings hold, not when they expire.
  int booking_ttl_secs() const override { return 300; }
  static constexpr std::size_t kShortBookings = 10'000;
  static constexpr std::size_t kShortPromptBlocks = 8;
};

TEST_F(ShortBookingsTest, ManyShortBookingsStayUnderTheBound) {
  const double resident_before = resident_bytes(node_->pid());
  for (std::size_t i = 0; i < kShortBookings; ++i) {
    ASSERT_TRUE(route(*rogue_, "rogue-model", "flood-" + std::to_string(i), kShortPromptBlocks)
                    .has_success())
        << "booking " << i;
  }
  EXPECT_EQ(node_metric("kvr_route_bookings_open"), static_cast<double>(kShortBookings));
  const double resident_after = resident_bytes(node_->pid());
  const double bound =
      static_cast<double>(kShortBookings) *
      (kBytesPerBooking + kBytesPerBlock * static_cast<double>(kShortPromptBlocks));
  EXPECT_LT(resident_after - resident_before, bound * 1.125 + 32e6)
      << "RSS " << resident_before / 1e6 << " MB -> " << resident_after / 1e6 << " MB";
  std::cout << "node RSS " << resident_before / 1e6 << " MB before, " << resident_after / 1e6
            << " MB with " << kShortBookings << " bookings of " << kShortPromptBlocks << " blocks ("
            << (resident_after - resident_before) / static_cast<double>(kShortBookings)
            << " bytes a booking)\n";
}

}  // namespace
}  // namespace kvr
