// Streams always end: a `kvr node` serving 13 generate streams from a `kvr mocker` loses its
// nats-server (SIGKILL) for 5 s. Chunks published meanwhile are lost, so the node ends every
// stream in flight at once with an explicit error: its /metrics (served over HTTP, not NATS) show
// none in flight and every booking released within a second of the loss, while the server is
// still down. After the server's return the node serves a new stream to its end.
#include <algorithm>
#include <csignal>
#include <memory>
#include <thread>
#include <vector>

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
using testing::ChildProcess;
using testing::ChunkStream;
using testing::free_port;
using testing::metric;
using testing::wait_until;

constexpr std::string_view kNamespace = "stream-outage";
constexpr std::uint32_t kBlockSize = 16;
constexpr int kStreams = 13;
constexpr auto kOutage = 5s;

class StreamOutageTest : public testing::KvrClusterTest {
 protected:
  StreamOutageTest()
      : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace},
                       testing::reconnecting_client()) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
    }
  }

  double node_metric(const std::string& name) {
    return metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  // Starts a generate request of `max_tokens` output tokens; its stream stays in `streams_`.
  ChunkStream& start_stream(int index, std::uint32_t max_tokens) {
    streams_.push_back(std::make_unique<ChunkStream>());
    ChunkStream& stream = *streams_.back();
    EXPECT_TRUE(stream.open(*client_));
    v1::GenerateRequest request;
    request.mutable_route()->set_request_id("s" + std::to_string(index));
    request.mutable_route()->set_model("mock-model");
    for (const std::uint32_t token :
         testing::prompt(64, 1000U * static_cast<std::uint32_t>(index))) {
      request.mutable_route()->mutable_tokens()->add_ids(token);
    }
    request.set_max_output_tokens(max_tokens);
    request.set_stream_subject(stream.subject());
    // One-way: the stream's chunks say how it goes.
    EXPECT_TRUE(
        client_->publish(subjects::router_generate(kNamespace), request.SerializeAsString()));
    return stream;
  }

  std::optional<ChildProcess> node_;
  std::optional<ChildProcess> mocker_;
  std::uint16_t metrics_port_ = 0;
  std::vector<std::unique_ptr<ChunkStream>> streams_;
};

TEST_F(StreamOutageTest, EveryStreamInFlightEndsAtOnceWhenTheNodeLosesNats) {
  auto mocker = kvr_->start_mocker({.workers = 1,
                                    .worker_id_base = 1,
                                    .block_size = kBlockSize,
                                    .liveness_ttl_ms = 10'000,
                                    .nats_reconnect_wait_ms = 50});
  ASSERT_TRUE(mocker);
  mocker_ = std::move(*mocker);
  metrics_port_ = free_port();
  // A request sent while the worker was still reconnecting is dispatched into the void: a short
  // first-token timeout retries it soon.
  auto node = kvr_->start_node({.block_size = kBlockSize,
                                .metrics_port = metrics_port_,
                                .nats_reconnect_wait_ms = 50,
                                .extra = {"--router-first-token-timeout-ms", "2000"}});
  ASSERT_TRUE(node);
  node_ = std::move(*node);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") >= 1; }, 20s))
      << testing::http_get(metrics_port_, "/metrics");

  // 13 streams far longer than the test (their KV fits the worker): each is responding before the
  // outage.
  for (int i = 0; i < kStreams; ++i) start_stream(i, 20'000);
  ASSERT_TRUE(wait_until(
      [&] {
        return std::ranges::all_of(streams_, [](const auto& stream) { return stream->size() > 0; });
      },
      20s));
  ASSERT_EQ(node_metric("kvr_generate_in_flight"), kStreams)
      << streams_[0]->chunks().back().DebugString();

  server_->kill();
  const auto lost = std::chrono::steady_clock::now();
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_generate_in_flight") == 0; }, 5s))
      << "streams still in flight with the server down";
  const auto ended_after = std::chrono::steady_clock::now() - lost;
  EXPECT_LT(ended_after, 1s);
  EXPECT_EQ(node_metric("kvr_generate_nats_losses_total"), kStreams);
  EXPECT_EQ(node_metric("kvr_bookings_open{partition=\"mock-model/default\"}"), 0);
  EXPECT_EQ(node_metric("kvr_worker_failures_total"), 0) << "the worker is not to blame";
  std::printf("[ outage ] %d streams ended %.0f ms after the node lost NATS\n", kStreams,
              std::chrono::duration<double, std::milli>(ended_after).count());

  // The injected fault itself: the server stays down for the outage's length.
  std::this_thread::sleep_for(kOutage - ended_after);
  std::string error;
  ASSERT_TRUE(server_->restart(&error)) << error;
  EXPECT_TRUE(node_->running());

  // Served again: a new stream runs to its last chunk. (One sent while the node or the worker
  // was still reconnecting may be lost on the way and end with an error at its first-token
  // timeout: the next one is sent then.)
  const auto served = [&] {
    ChunkStream& stream = start_stream(kStreams + static_cast<int>(streams_.size()), 4);
    if (!wait_until([&] { return stream.finished(); }, 5s)) return false;
    return stream.chunks().back().finish_reason() == "length";
  };
  EXPECT_TRUE(wait_until(served, 30s));
  // Every stream sent after the loss ends.
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_generate_in_flight") == 0; }, 15s));
}

}  // namespace
}  // namespace kvr
