// Fault: a flood of malformed messages on every subject a `kvr node` subscribes to (300,000 per
// subject from a raw NATS client), while another client keeps routing. The node must keep
// answering every route, account for every flooded message (counted as bad, or dropped by the
// NATS client when a subscription fell behind, both on /metrics), and keep its picture of the
// fleet. Real nats-server, `kvr node` and `kvr mocker` processes on loopback; the flood and the
// route loop are bounded in count and time. Route latency during the flood is printed, not
// asserted (the Release figure is in docs/reliability.md).
#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::metric;

constexpr std::string_view kNamespace = "flood";
constexpr WorkerId kFirstWorker = 100;
constexpr std::uint32_t kBlockSize = 16;
constexpr int kMessagesPerSubject = 300'000;

// Bytes no protobuf parser accepts (field 31 with the invalid wire type 7 first), then noise: every
// flooded message is malformed on whichever subject it lands.
std::string malformed_payload(std::mt19937& random) {
  std::string payload(1 + random() % 48, '\0');
  payload[0] = '\xff';
  for (std::size_t i = 1; i < payload.size(); ++i) payload[i] = static_cast<char>(random());
  return payload;
}

double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

class MalformedFloodTest : public testing::KvrClusterTest {
 protected:
  MalformedFloodTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log (tail)\n" << tail(node_->log());
      if (mocker_) std::cerr << "---- mocker log (tail)\n" << tail(mocker_->log());
    }
  }

  static std::string tail(const std::string& log) {
    return log.size() > 4000 ? log.substr(log.size() - 4000) : log;
  }

  std::string metrics_text() { return testing::http_get(metrics_port_, "/metrics"); }

  std::optional<testing::ChildProcess> mocker_;
  std::optional<testing::ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
};

TEST_F(MalformedFloodTest, EveryRouteIsAnsweredAndEveryBadMessageAccountedFor) {
  mocker_ = kvr_->start_mocker({.workers = 2,
                                .worker_id_base = kFirstWorker,
                                .block_size = kBlockSize,
                                .num_gpu_blocks = 4096,
                                .time_scale = "20",
                                .liveness_ttl_ms = 3000,
                                .load_interval_ms = 100});
  ASSERT_TRUE(mocker_);
  metrics_port_ = testing::free_port();
  node_ = kvr_->start_node({.block_size = kBlockSize, .metrics_port = metrics_port_});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  int request_counter = 0;
  const auto next_id = [&] { return "route-" + std::to_string(++request_counter); };
  ASSERT_TRUE(testing::wait_until_routable(*client_, kNamespace, std::nullopt, next_id, 20s));

  // Each flooded subject and the subscription that counts it (KV events arrive on a wildcard).
  const std::vector<std::pair<std::string, std::string>> flooded{
      {subjects::worker_register(kNamespace), subjects::worker_register(kNamespace)},
      {subjects::worker_heartbeat(kNamespace), subjects::worker_heartbeat(kNamespace)},
      {subjects::worker_deregister(kNamespace), subjects::worker_deregister(kNamespace)},
      {subjects::worker_load(kNamespace), subjects::worker_load(kNamespace)},
      {subjects::kv_events(kNamespace, kFirstWorker), subjects::kv_events_all(kNamespace)},
      {subjects::router_route(kNamespace), subjects::router_route(kNamespace)},
      {subjects::router_report(kNamespace), subjects::router_report(kNamespace)}};

  // The routing client: one request at a time on a shared prefix, each reported completed. A
  // route sent while its own subject is flooded waits behind up to kWindow bad messages, which a
  // sanitizer build on a busy machine decodes in seconds: the test asks that every route is
  // answered (speed is the benchmarks' business), so it waits long for each.
  constexpr auto kRouteAnswerTimeout = 20s;
  std::atomic<bool> flooding{true};
  std::mutex results_mutex;
  std::vector<double> latencies_ms;
  std::vector<std::string> failures;
  std::thread router{[&] {
    const auto tokens = testing::prompt(64, 1);
    const auto deadline = Clock::now() + 240s;
    int sent_routes = 0;
    while (flooding.load() && Clock::now() < deadline) {
      v1::RouteRequest request;
      request.set_request_id("flood-route-" + std::to_string(++sent_routes));
      request.set_model("mock-model");
      for (std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
      const auto sent = Clock::now();
      auto decision = testing::request_route(*client_, kNamespace, request, kRouteAnswerTimeout);
      const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - sent).count();
      std::unique_lock lock{results_mutex};
      if (!decision) {
        failures.push_back(request.request_id() + ": no answer within 20 s");
      } else if (!decision->has_success()) {
        failures.push_back(decision->DebugString());
      } else {
        latencies_ms.push_back(elapsed);
        lock.unlock();
        (void)testing::report_lifecycle(*client_, kNamespace, decision->success().booking_id(),
                                        v1::LIFECYCLE_EVENT_COMPLETED);
      }
    }
  }};
  // Stops the routing client on every way out of the test, failed assertions included.
  const auto stop_router = [&](std::thread* thread) {
    flooding = false;
    thread->join();
  };
  std::unique_ptr<std::thread, decltype(stop_router)> router_guard{&router, stop_router};

  // Counted as bad, and dropped by the NATS client for a subscription that fell behind.
  const auto accounted = [&](const std::string& text, const std::string& subscription) {
    const std::string label = "{subject=\"" + subscription + "\"";
    return std::pair{metric(text, "kvr_bad_messages_total" + label),
                     metric(text, "kvr_nats_dropped_messages_total" + label)};
  };

  // The flood, one subject at a time from its own connection, as fast as the node takes it: at
  // most kWindow messages ahead of what the node has counted. (A flood faster than that would
  // overflow the subscription's pending queue in the NATS client, which then drops messages,
  // legitimate ones among them; the window keeps the test about the node, not the queue.)
  constexpr int kBurst = 5'000;
  constexpr int kWindow = 20'000;
  nats::NatsOptions flooder_options;
  flooder_options.url = server_->url();
  flooder_options.name = "kvr-test-flooder";
  auto flooder = nats::NatsClient::connect(flooder_options);
  ASSERT_TRUE(flooder) << flooder.error();
  std::mt19937 random{15};
  const auto flood_started = Clock::now();
  std::vector<std::size_t> phase_ends;
  for (const auto& [subject, counted_as] : flooded) {
    for (int sent = 0; sent < kMessagesPerSubject;) {
      for (int i = 0; i < kBurst; ++i, ++sent) {
        ASSERT_TRUE((*flooder)->publish(subject, malformed_payload(random)));
      }
      ASSERT_TRUE((*flooder)->flush(10s));
      ASSERT_TRUE(testing::wait_until(
          [&] {
            const auto [bad, dropped] = accounted(metrics_text(), counted_as);
            return bad + dropped >= sent - kWindow;
          },
          30s))
          << counted_as << " fell behind:\n"
          << metrics_text();
    }
    std::lock_guard lock{results_mutex};
    phase_ends.push_back(latencies_ms.size());
  }
  const double publish_seconds =
      std::chrono::duration<double>(Clock::now() - flood_started).count();

  // Every flooded message is counted as bad, and nothing else is (the mocker's messages are
  // well-formed); within the window no subscription fell behind far enough to drop any.
  const bool all_accounted = testing::wait_until(
      [&] {
        const std::string text = metrics_text();
        return std::ranges::all_of(flooded, [&](const auto& entry) {
          const auto [bad, dropped] = accounted(text, entry.second);
          return bad + dropped >= kMessagesPerSubject;
        });
      },
      120s);
  router_guard.reset();
  const std::string text = metrics_text();
  ASSERT_TRUE(all_accounted) << text;
  std::size_t phase_begin = 0;
  for (std::size_t phase = 0; phase < flooded.size(); ++phase) {
    const std::string& subscription = flooded[phase].second;
    const auto [bad, dropped] = accounted(text, subscription);
    EXPECT_EQ(bad, kMessagesPerSubject) << subscription;
    EXPECT_EQ(dropped, 0) << subscription;
    const std::vector<double> during(latencies_ms.begin() + phase_begin,
                                     latencies_ms.begin() + phase_ends[phase]);
    std::cout << subscription << ": " << bad << " bad, " << dropped << " dropped; " << during.size()
              << " routes meanwhile, p99 " << percentile(during, 0.99) << " ms\n";
    phase_begin = phase_ends[phase];
  }

  EXPECT_TRUE(failures.empty()) << failures.size()
                                << " routes failed, the first: " << failures.front();
  ASSERT_FALSE(latencies_ms.empty());
  std::cout << latencies_ms.size() << " routes during a flood of " << flooded.size() << " x "
            << kMessagesPerSubject << " messages in " << publish_seconds << " s: p50 "
            << percentile(latencies_ms, 0.5) << " ms, p99 " << percentile(latencies_ms, 0.99)
            << " ms, max " << percentile(latencies_ms, 1.0) << " ms\n";
  RecordProperty("route_p99_ms", std::to_string(percentile(latencies_ms, 0.99)));

  // The node kept its picture of the fleet and still routes.
  EXPECT_TRUE(node_->running());
  EXPECT_EQ(metric(text, "kvr_workers"), 2) << text;
  EXPECT_EQ(metric(text, "kvr_workers_expired_total"), 0) << text;
  v1::RouteRequest again;
  again.set_request_id("after-flood");
  again.set_model("mock-model");
  for (std::uint32_t token : testing::prompt(64, 1)) again.mutable_tokens()->add_ids(token);
  auto decision = testing::request_route(*client_, kNamespace, again);
  ASSERT_TRUE(decision && decision->has_success());
}

}  // namespace
}  // namespace kvr
