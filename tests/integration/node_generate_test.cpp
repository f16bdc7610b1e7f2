// `kvr node` in generate (proxy) mode as a real process, with real `kvr mocker` workers and a real
// nats-server on loopback: chunks relayed in order and bookings released (observed on /metrics),
// client cancellation, a worker killed before its first token (the request completes on another
// worker), and session affinity in soft mode (the reference's A → B → B walkthrough with
// `soft-affinity-load-guard`) and hard mode.
#include <fstream>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <signal.h>

#include "kvr/v1/routing.pb.h"
#include "kvr/v1/worker.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::free_port;
using testing::http_get;
using testing::metric;
using testing::NatsRecorder;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "gen";
constexpr std::uint32_t kBlockSize = 16;
// Output tokens of a generation that outlasts a test (minutes at --time-scale 1) and still fits
// the mockers' 2048 blocks of KV cache.
constexpr std::uint32_t kLongGeneration = 20'000;

class NodeGenerateTest : public testing::KvrClusterTest {
 protected:
  NodeGenerateTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      for (auto& [name, mocker] : mockers_) std::cerr << "---- " << name << "\n" << mocker.log();
    }
    streams_.clear();
  }

  // Starts a mocker with `workers` workers numbered from `base`; `time_scale` below 1 slows it.
  ChildProcess& start_mocker(const std::string& name, WorkerId base, int workers,
                             const std::string& time_scale) {
    auto mocker = kvr_->start_mocker({.workers = workers,
                                      .worker_id_base = base,
                                      .block_size = kBlockSize,
                                      .num_gpu_blocks = 2048,
                                      .time_scale = time_scale,
                                      .liveness_ttl_ms = 600,
                                      .load_interval_ms = 50},
                                     name + ".log");
    EXPECT_TRUE(mocker);
    return mockers_.emplace(name, std::move(*mocker)).first->second;
  }

  void start_node(std::vector<std::string> extra = {}) {
    metrics_port_ = free_port();
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  // Waits until the node routes to `worker` (a route-mode probe, reported completed).
  bool wait_for_worker(WorkerId worker) {
    return testing::wait_until_routable(
        *client_, kNamespace, worker, [&] { return "probe-" + std::to_string(++probes_); }, 20s);
  }

  // Sends a generate request; returns its stream and the node's first RouteDecision.
  std::pair<ChunkStream*, v1::RouteDecision> generate(const std::string& request_id,
                                                      const std::vector<std::uint32_t>& tokens,
                                                      std::uint32_t max_output_tokens,
                                                      const std::string& session = {}) {
    streams_.push_back(std::make_unique<ChunkStream>());
    ChunkStream* stream = streams_.back().get();
    EXPECT_TRUE(stream->open(*client_));
    v1::GenerateRequest request;
    auto* route = request.mutable_route();
    route->set_request_id(request_id);
    route->set_model("mock-model");
    for (std::uint32_t token : tokens) route->mutable_tokens()->add_ids(token);
    if (!session.empty()) route->mutable_session()->set_session_id(session);
    request.set_max_output_tokens(max_output_tokens);
    request.set_stream_subject(stream->subject());
    v1::RouteDecision decision;
    auto reply =
        client_->request(subjects::router_generate(kNamespace), request.SerializeAsString(), 5s);
    EXPECT_TRUE(reply) << reply.error();
    if (reply) {
      EXPECT_TRUE(decision.ParseFromString(reply->data));
    }
    return {stream, decision};
  }

  void cancel(const std::string& request_id) {
    v1::GenerateCancel cancel;
    cancel.set_request_id(request_id);
    ASSERT_TRUE(
        client_->publish(subjects::router_generate_cancel(kNamespace), cancel.SerializeAsString()));
  }

  double node_metric(const std::string& prefix) {
    return metric(http_get(metrics_port_, "/metrics"), prefix);
  }

  bool bookings_drain() {
    return wait_until([&] { return node_metric("kvr_bookings_open") == 0; }, 10s);
  }

  // Waits until every worker in `workers` reported two load reports in a row with no active
  // request, so that the node's view of their load has drained too.
  bool wait_for_idle_load(const std::set<WorkerId>& workers) {
    NatsRecorder loads;
    if (!loads.listen(*client_, subjects::every_load(kNamespace))) return false;
    return wait_until(
        [&] {
          // Consecutive idle reports per worker, counted from the last busy one.
          std::map<WorkerId, int> idle_reports;
          for (const auto& load : loads.decoded<v1::LoadMetrics>()) {
            std::uint32_t active = 0;
            for (const auto& rank : load.ranks()) active += rank.active_requests();
            idle_reports[load.worker_id()] = active == 0 ? idle_reports[load.worker_id()] + 1 : 0;
          }
          for (WorkerId worker : workers) {
            if (idle_reports[worker] < 2) return false;
          }
          return true;
        },
        10s);
  }

  std::map<std::string, ChildProcess> mockers_;
  std::optional<ChildProcess> node_;
  std::vector<std::unique_ptr<ChunkStream>> streams_;
  std::uint16_t metrics_port_ = 0;
  int probes_ = 0;
};

TEST_F(NodeGenerateTest, RelaysEveryChunkInOrderReleasesTheBookingAndCancels) {
  start_mocker("mocker", 100, 2, "1");
  start_node();
  ASSERT_TRUE(wait_for_worker(100));
  ASSERT_TRUE(wait_for_worker(101));
  ASSERT_TRUE(bookings_drain());

  auto [stream, decision] = generate("gen-1", prompt(64, 1), 6);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  EXPECT_TRUE(decision.success().booking_id().empty());  // the node manages the booking
  const WorkerId worker = decision.success().worker_id();
  EXPECT_TRUE(worker == 100 || worker == 101) << worker;
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
  const auto chunks = stream->chunks();
  ASSERT_EQ(chunks.size(), 6U);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].index(), i);
    EXPECT_EQ(chunks[i].request_id(), "gen-1");
    EXPECT_EQ(chunks[i].worker_id(), worker);
    EXPECT_EQ(chunks[i].token_ids_size(), 1);
    EXPECT_EQ(chunks[i].finished(), i + 1 == chunks.size());
    EXPECT_FALSE(chunks[i].has_error());
  }
  EXPECT_EQ(chunks.back().finish_reason(), "length");
  EXPECT_TRUE(bookings_drain());
  EXPECT_EQ(node_metric("kvr_generate_outcomes_total{outcome=\"completed\""), 1);

  // A long generation, cancelled by the client once it streams.
  auto [long_stream, long_decision] = generate("gen-long", prompt(64, 5000), kLongGeneration);
  ASSERT_TRUE(long_decision.has_success());
  ASSERT_TRUE(wait_until([&] { return long_stream->size() >= 2; }, 10s));
  EXPECT_EQ(node_metric("kvr_bookings_open"), 1);
  cancel("gen-long");
  ASSERT_TRUE(wait_until([&] { return long_stream->finished(); }, 10s));
  const auto cancelled = long_stream->chunks();
  EXPECT_EQ(cancelled.back().finish_reason(), "cancelled");
  for (std::size_t i = 0; i < cancelled.size(); ++i) EXPECT_EQ(cancelled[i].index(), i);
  EXPECT_TRUE(bookings_drain());
  EXPECT_EQ(node_metric("kvr_generate_in_flight"), 0);

  // An invalid request gets an explicit error, on the reply and on its stream.
  auto [bad_stream, bad_decision] = generate("gen-bad", prompt(64, 1), 0);
  ASSERT_TRUE(bad_decision.has_error());
  EXPECT_EQ(bad_decision.error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  ASSERT_TRUE(wait_until([&] { return bad_stream->finished(); }, 5s));
  EXPECT_EQ(bad_stream->chunks().back().finish_reason(), "error");
  EXPECT_TRUE(node_->running());
}

// SIGTERM drains: the node takes no new request (no other node serves here, so a route gets no
// answer), lets a stream in flight run to its last chunk, ends one that outlasts the drain
// timeout with an explicit error, and exits 0.
TEST_F(NodeGenerateTest, ASigtermDrainsTheStreamsInFlightAndTakesNoNewRequest) {
  start_mocker("mocker", 400, 1, "1");
  start_node({"--drain-timeout-ms", "6000"});
  ASSERT_TRUE(wait_for_worker(400));
  auto [finishing, first] = generate("finishing", prompt(32, 1), 200);
  auto [outlasting, second] = generate("outlasting", prompt(32, 1000), kLongGeneration);
  ASSERT_TRUE(first.has_success()) << first.DebugString();
  ASSERT_TRUE(second.has_success()) << second.DebugString();
  ASSERT_TRUE(wait_until([&] { return finishing->size() > 0 && outlasting->size() > 0; }, 10s));
  ASSERT_FALSE(finishing->finished()) << "the test needs it in flight at the signal";

  node_->signal(SIGTERM);
  v1::RouteRequest probe;
  probe.set_model("mock-model");
  for (const std::uint32_t token : prompt(32, 5000)) probe.mutable_tokens()->add_ids(token);
  int probes = 0;
  EXPECT_TRUE(wait_until(
      [&] {
        probe.set_request_id("after-sigterm-" + std::to_string(++probes));
        return !testing::request_route(*client_, kNamespace, probe, 200ms);
      },
      5s))
      << "still taking requests";
  ASSERT_TRUE(wait_until([&] { return finishing->finished(); }, 10s));
  EXPECT_EQ(finishing->chunks().back().finish_reason(), "length");
  EXPECT_EQ(finishing->size(), 200U);
  EXPECT_EQ(node_->wait(20s), 0) << node_->log();
  ASSERT_TRUE(wait_until([&] { return outlasting->finished(); }, 5s));
  const v1::GenerateChunk end = outlasting->chunks().back();
  EXPECT_EQ(end.finish_reason(), "error");
  EXPECT_EQ(end.error().code(), v1::ROUTE_ERROR_UNAVAILABLE) << end.error().message();
  EXPECT_EQ(node_->log().find("NATS connection lost"), std::string::npos)
      << "a clean stop is no outage:\n"
      << node_->log();
}

TEST_F(NodeGenerateTest, AWorkerKilledBeforeTheFirstTokenIsReplacedAndItsBookingReleased) {
  // Worker 300 computes prefill 200 times slower than real time: seconds for a long prompt.
  ChildProcess& slow = start_mocker("slow", 300, 1, "0.005");
  start_node();
  ASSERT_TRUE(wait_for_worker(300));
  ASSERT_TRUE(bookings_drain());

  auto [stream, decision] = generate("victim", prompt(4096, 1), 4);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_EQ(decision.success().worker_id(), 300U);
  start_mocker("fast", 400, 1, "1");
  ASSERT_TRUE(wait_for_worker(400));
  ASSERT_EQ(stream->size(), 0U) << "the slow worker answered before it could be killed";
  EXPECT_EQ(node_metric("kvr_bookings_open"), 1);

  slow.signal(SIGKILL);
  ASSERT_TRUE(slow.wait(5s));
  // The node notices within the worker's 600 ms liveness TTL, retries on worker 400.
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 20s));
  const auto chunks = stream->chunks();
  ASSERT_EQ(chunks.size(), 4U);
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].index(), i);
    EXPECT_EQ(chunks[i].worker_id(), 400U);
    EXPECT_FALSE(chunks[i].has_error());
  }
  EXPECT_EQ(chunks.back().finish_reason(), "length");
  EXPECT_EQ(node_metric("kvr_generate_retries_total"), 1);
  EXPECT_TRUE(bookings_drain());
}

TEST_F(NodeGenerateTest, SoftAffinityMovesAnOverloadedSessionAndThenStaysOnItsNewWorker) {
  start_mocker("mocker-a", 100, 1, "1");
  start_mocker("mocker-b", 200, 1, "1");
  const auto config = directory_.path() / "router.yaml";
  {
    std::ofstream yaml{config};
    yaml << "worker_selection:\n"
            "  aggregated: guard\n"
            "  instances:\n"
            "    - name: guard\n"
            "      type: soft-affinity-load-guard\n"
            "      parameters: {max_active_requests: 0, margin: 1}\n";
  }
  start_node({"--router-policy-config", config.string(), "--router-session-affinity-mode", "soft",
              "--router-session-affinity-ttl-secs", "60"});
  ASSERT_TRUE(wait_for_worker(100));
  ASSERT_TRUE(wait_for_worker(200));
  ASSERT_TRUE(bookings_drain());
  ASSERT_TRUE(wait_for_idle_load({100, 200}));

  // 1: the session's first request binds it to A once it streams, and stays open there.
  auto [first, first_decision] = generate("turn-1", prompt(64, 1), kLongGeneration, "session-s");
  ASSERT_TRUE(first_decision.has_success());
  const WorkerId a = first_decision.success().worker_id();
  const WorkerId b = a == 100 ? 200 : 100;
  ASSERT_TRUE(wait_until([&] { return first->size() >= 1; }, 10s));
  ASSERT_FALSE(first->chunks().front().finished()) << first->chunks().front().DebugString();
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_session_bindings") == 1; }, 5s));

  // 2: A is above max_active_requests and B is lighter by the margin: the session moves to B.
  auto [second, second_decision] = generate("turn-2", prompt(96, 1), 4, "session-s");
  ASSERT_TRUE(second_decision.has_success());
  EXPECT_EQ(second_decision.success().worker_id(), b);
  ASSERT_TRUE(wait_until([&] { return second->finished(); }, 10s));
  EXPECT_EQ(second->chunks().back().worker_id(), b);

  // The load drains: the first request is cancelled.
  cancel("turn-1");
  ASSERT_TRUE(wait_until([&] { return first->finished(); }, 10s));
  ASSERT_TRUE(bookings_drain());
  ASSERT_TRUE(wait_for_idle_load({100, 200}));

  // 3: the binding now names B, which is not overloaded: the session stays on B.
  auto [third, third_decision] = generate("turn-3", prompt(128, 1), 4, "session-s");
  ASSERT_TRUE(third_decision.has_success());
  EXPECT_EQ(third_decision.success().worker_id(), b);
  ASSERT_TRUE(wait_until([&] { return third->finished(); }, 10s));
  EXPECT_GE(node_metric("kvr_session_rebinds_total"), 1);
  EXPECT_TRUE(bookings_drain());
}

TEST_F(NodeGenerateTest, HardAffinitySendsEveryRequestOfABoundSessionToItsWorker) {
  start_mocker("mocker", 100, 2, "1");
  start_node(
      {"--router-session-affinity-mode", "hard", "--router-session-affinity-ttl-secs", "60"});
  ASSERT_TRUE(wait_for_worker(100));
  ASSERT_TRUE(wait_for_worker(101));

  auto [first, first_decision] = generate("hard-0", prompt(64, 1), 2, "session-h");
  ASSERT_TRUE(first_decision.has_success());
  const WorkerId bound = first_decision.success().worker_id();
  ASSERT_TRUE(wait_until([&] { return first->finished(); }, 10s));
  for (int i = 1; i <= 8; ++i) {
    // Unrelated prompts: only the binding keeps them together.
    auto [stream, decision] =
        generate("hard-" + std::to_string(i), prompt(64, 10'000U * i), 2, "session-h");
    ASSERT_TRUE(decision.has_success());
    EXPECT_EQ(decision.success().worker_id(), bound) << "request " << i;
    ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
    EXPECT_EQ(stream->chunks().back().worker_id(), bound);
  }
  // Another session binds on its own.
  auto [other, other_decision] = generate("other-0", prompt(64, 90'000), 2, "session-k");
  ASSERT_TRUE(other_decision.has_success());
  ASSERT_TRUE(wait_until([&] { return other->finished(); }, 10s));
  EXPECT_EQ(node_metric("kvr_session_bindings"), 2);
  EXPECT_TRUE(bookings_drain());
}

}  // namespace
}  // namespace kvr
