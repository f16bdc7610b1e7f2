// Disaggregated serving through a real `kvr node` in generate mode, with real `kvr mocker --role
// prefill` and `--role decode` workers on a real nats-server: the prefill hop lands on the prefill
// worker holding the prompt, the client gets one whole stream from a decode worker, both bookings
// end; a later turn is prefilled where the earlier one left its cache; conditional
// disaggregation sends a short prompt straight to a decode worker; and each failure is produced
// on purpose: a prefill worker killed (replaced), every prefill worker slower than the first-token
// timeout (an explicit error), a decode worker killed before its first token (replaced with the
// same transfer parameters, or prefilled again once its prefill worker is gone too).
#include <fstream>
#include <set>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include "kvr/v1/routing.pb.h"
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
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "pd";
constexpr std::uint32_t kBlockSize = 16;

class NodeDisaggregatedTest : public testing::KvrClusterTest {
 protected:
  NodeDisaggregatedTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      for (auto& [name, mocker] : mockers_) std::cerr << "---- " << name << "\n" << mocker.log();
    }
    streams_.clear();
  }

  // Starts one worker `id` of `role`; `time_scale` below 1 slows its engine, `extra` adds flags.
  ChildProcess& start_worker(WorkerId id, std::string_view role,
                             const std::string& time_scale = "1",
                             std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--role", std::string{role}});
    auto mocker = kvr_->start_mocker({.workers = 1,
                                      .worker_id_base = id,
                                      .block_size = kBlockSize,
                                      .num_gpu_blocks = 2048,
                                      .time_scale = time_scale,
                                      .liveness_ttl_ms = 600,
                                      .load_interval_ms = 50,
                                      .extra = std::move(extra)},
                                     "worker-" + std::to_string(id) + ".log");
    EXPECT_TRUE(mocker);
    return mockers_.emplace(id, std::move(*mocker)).first->second;
  }

  // `yaml`: the router-policy YAML, when not empty; `extra`: more flags.
  void start_node(const std::string& yaml = {}, std::vector<std::string> extra = {}) {
    if (!yaml.empty()) {
      const auto path = directory_.path() / "policy.yaml";
      std::ofstream{path} << yaml;
      extra.insert(extra.end(), {"--router-policy-config", path.string()});
    }
    metrics_port_ = free_port();
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  // A route-mode probe of `role` restricted to `worker`; `query_only`: nothing is booked.
  std::optional<v1::RouteDecision> probe(WorkerId worker, v1::WorkerRole role,
                                         const std::vector<std::uint32_t>& tokens,
                                         bool query_only) {
    v1::RouteRequest request;
    request.set_request_id("probe-" + std::to_string(++probes_));
    request.set_model("mock-model");
    request.set_worker_role(role);
    request.set_query_only(query_only);
    request.add_allowed_workers(worker);
    for (const std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
    return testing::request_route(*client_, kNamespace, request.SerializeAsString(), 1s);
  }

  // Waits until the node knows `worker` in `role` (a query: nothing booked).
  bool wait_for_worker(WorkerId worker, v1::WorkerRole role) {
    return wait_until(
        [&] {
          const auto decision = probe(worker, role, prompt(32, 1), true);
          return decision && decision->has_success() && decision->success().worker_id() == worker;
        },
        20s);
  }

  std::pair<ChunkStream*, v1::RouteDecision> generate(const std::string& request_id,
                                                      const std::vector<std::uint32_t>& tokens,
                                                      std::uint32_t max_output_tokens) {
    streams_.push_back(std::make_unique<ChunkStream>());
    ChunkStream* stream = streams_.back().get();
    EXPECT_TRUE(stream->open(*client_));
    v1::GenerateRequest request;
    auto* route = request.mutable_route();
    route->set_request_id(request_id);
    route->set_model("mock-model");
    for (const std::uint32_t token : tokens) route->mutable_tokens()->add_ids(token);
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

  double node_metric(const std::string& prefix) {
    return metric(http_get(metrics_port_, "/metrics"), prefix);
  }
  double decisions(std::string_view reason) {
    return node_metric(fmt::format(
        "kvr_disaggregation_decisions_total{{partition=\"mock-model/default\",reason=\"{}\"}}",
        reason));
  }
  bool bookings_drain() {
    return wait_until([&] { return node_metric("kvr_bookings_open") == 0; }, 10s);
  }

  // The stream's chunks are one whole generation of `tokens` by one worker, which it returns.
  WorkerId expect_whole_stream(const ChunkStream& stream, std::size_t tokens) {
    const auto chunks = stream.chunks();
    EXPECT_EQ(chunks.size(), tokens);
    if (chunks.empty()) return 0;
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      EXPECT_EQ(chunks[i].index(), i);
      EXPECT_EQ(chunks[i].worker_id(), chunks.front().worker_id());
      EXPECT_FALSE(chunks[i].has_error()) << chunks[i].error().message();
      EXPECT_EQ(chunks[i].finished(), i + 1 == chunks.size());
      EXPECT_TRUE(chunks[i].kv_transfer_params().empty()) << "the prefill's answer stays inside";
    }
    EXPECT_EQ(chunks.back().finish_reason(), "length");
    return chunks.front().worker_id();
  }

  std::map<WorkerId, ChildProcess> mockers_;
  std::optional<ChildProcess> node_;
  std::vector<std::unique_ptr<ChunkStream>> streams_;
  std::uint16_t metrics_port_ = 0;
  int probes_ = 0;
};

TEST_F(NodeDisaggregatedTest, APrefillHopThenADecodeHopMakeOneStreamAndEndBothBookings) {
  start_worker(100, "prefill");
  start_worker(101, "prefill");
  start_worker(200, "decode");
  start_worker(201, "decode");
  start_node();
  for (const WorkerId worker : {100, 101}) {
    ASSERT_TRUE(wait_for_worker(worker, v1::WORKER_ROLE_PREFILL));
  }
  for (const WorkerId worker : {200, 201}) {
    ASSERT_TRUE(wait_for_worker(worker, v1::WORKER_ROLE_DECODE));
  }

  const auto first_turn = prompt(256, 7);
  auto [stream, decision] = generate("turn-1", first_turn, 6);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  const WorkerId prefill_worker = decision.success().worker_id();
  EXPECT_TRUE(prefill_worker == 100 || prefill_worker == 101) << prefill_worker;
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
  const WorkerId decode_worker = expect_whole_stream(*stream, 6);
  EXPECT_TRUE(decode_worker == 200 || decode_worker == 201) << decode_worker;
  EXPECT_TRUE(bookings_drain());
  EXPECT_EQ(decisions("disaggregated"), 1);
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 1);
  EXPECT_EQ(node_metric("kvr_decode_handoff_seconds_count"), 1);
  EXPECT_EQ(node_metric("kvr_generate_outcomes_total{outcome=\"completed\""), 1);

  // The next turn repeats the first: once the prefill worker's KV events reached the node, it is
  // the prefill worker that holds the prefix.
  auto next_turn = first_turn;
  for (std::uint32_t token = 0; token < 64; ++token) next_turn.push_back(5000 + token);
  ASSERT_TRUE(wait_until(
      [&] {
        const auto held = probe(prefill_worker, v1::WORKER_ROLE_PREFILL, next_turn, true);
        return held && held->has_success() && held->success().device_overlap_blocks() >= 16;
      },
      10s));
  auto [next_stream, next_decision] = generate("turn-2", next_turn, 4);
  ASSERT_TRUE(next_decision.has_success());
  EXPECT_EQ(next_decision.success().worker_id(), prefill_worker);
  ASSERT_TRUE(wait_until([&] { return next_stream->finished(); }, 10s));
  const WorkerId next_decode_worker = expect_whole_stream(*next_stream, 4);
  EXPECT_TRUE(next_decode_worker == 200 || next_decode_worker == 201) << next_decode_worker;
  EXPECT_TRUE(bookings_drain());
  EXPECT_EQ(decisions("disaggregated"), 2);
  EXPECT_EQ(node_metric("kvr_generate_retries_total"), 0);
}

TEST_F(NodeDisaggregatedTest, ConditionalDisaggregationSendsAShortPromptStraightToDecode) {
  start_worker(100, "prefill");
  start_worker(200, "decode");
  start_node("models:\n  mock-model:\n    disaggregation: {min_uncached_tokens: 200}\n");
  ASSERT_TRUE(wait_for_worker(100, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(200, v1::WORKER_ROLE_DECODE));

  auto [short_stream, short_decision] = generate("short", prompt(64, 1), 3);
  ASSERT_TRUE(short_decision.has_success());
  EXPECT_EQ(short_decision.success().worker_id(), 200U) << "served by the decode worker alone";
  ASSERT_TRUE(wait_until([&] { return short_stream->finished(); }, 10s));
  EXPECT_EQ(expect_whole_stream(*short_stream, 3), 200U);

  auto [long_stream, long_decision] = generate("long", prompt(512, 1000), 3);
  ASSERT_TRUE(long_decision.has_success());
  EXPECT_EQ(long_decision.success().worker_id(), 100U) << "the prefill hop";
  ASSERT_TRUE(wait_until([&] { return long_stream->finished(); }, 10s));
  EXPECT_EQ(expect_whole_stream(*long_stream, 3), 200U);

  EXPECT_EQ(decisions("short_prompt"), 1);
  EXPECT_EQ(decisions("disaggregated"), 1);
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 1);
  EXPECT_TRUE(bookings_drain());
}

TEST_F(NodeDisaggregatedTest, APrefillWorkerKilledBeforeItsAnswerIsReplaced) {
  // Worker 300 prefills 200 times slower than real time: seconds for this prompt.
  ChildProcess& slow = start_worker(300, "prefill", "0.005");
  start_worker(200, "decode");
  start_node();
  ASSERT_TRUE(wait_for_worker(300, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(200, v1::WORKER_ROLE_DECODE));

  auto [stream, decision] = generate("victim", prompt(4096, 1), 4);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_EQ(decision.success().worker_id(), 300U);
  start_worker(301, "prefill");
  ASSERT_TRUE(wait_for_worker(301, v1::WORKER_ROLE_PREFILL));
  ASSERT_EQ(stream->size(), 0U) << "the slow prefill answered before it could be killed";

  slow.signal(SIGKILL);
  ASSERT_TRUE(slow.wait(5s));
  // The node notices within the worker's 600 ms liveness TTL and prefills on worker 301.
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 20s));
  EXPECT_EQ(expect_whole_stream(*stream, 4), 200U);
  EXPECT_EQ(node_metric("kvr_generate_retries_total"), 1);
  EXPECT_EQ(decisions("disaggregated"), 2) << "planned again without the failed worker";
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 1)
      << "one prefill answered";
  EXPECT_TRUE(bookings_drain());
}

TEST_F(NodeDisaggregatedTest, PrefillWorkersThatNeverAnswerInTimeEndTheStreamWithAnError) {
  start_worker(300, "prefill", "0.001");
  start_worker(301, "prefill", "0.001");
  start_worker(200, "decode");
  start_node({}, {"--router-first-token-timeout-ms", "700"});
  ASSERT_TRUE(wait_for_worker(300, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(301, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(200, v1::WORKER_ROLE_DECODE));

  auto [stream, decision] = generate("too-slow", prompt(4096, 1), 4);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
  const auto chunks = stream->chunks();
  ASSERT_EQ(chunks.size(), 1U) << "no token of a prefill reaches the client";
  EXPECT_EQ(chunks[0].finish_reason(), "error");
  EXPECT_EQ(chunks[0].error().code(), v1::ROUTE_ERROR_WORKER_FAILED) << chunks[0].error().message();
  EXPECT_NE(chunks[0].error().message().find("prefill"), std::string::npos)
      << chunks[0].error().message();
  EXPECT_EQ(node_metric("kvr_generate_first_token_timeouts_total"), 2);
  EXPECT_EQ(node_metric("kvr_generate_retries_total"), 1);
  EXPECT_TRUE(bookings_drain()) << "both prefill bookings released";
  EXPECT_TRUE(node_->running());
}

TEST_F(NodeDisaggregatedTest, ADecodeWorkerKilledBeforeItsFirstTokenIsReplacedWithTheSameTransfer) {
  start_worker(100, "prefill");
  // Worker 200's transfer takes 20 s: it is still pulling when it is killed.
  ChildProcess& pulling = start_worker(200, "decode", "1", {"--transfer-latency-ms", "20000"});
  start_node();
  ASSERT_TRUE(wait_for_worker(100, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(200, v1::WORKER_ROLE_DECODE));

  auto [stream, decision] = generate("pulled", prompt(512, 1), 4);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_TRUE(
      wait_until([&] { return node_metric("kvr_decode_handoff_seconds_count") == 1; }, 10s));
  start_worker(201, "decode");
  ASSERT_TRUE(wait_for_worker(201, v1::WORKER_ROLE_DECODE));
  ASSERT_EQ(stream->size(), 0U);
  pulling.signal(SIGKILL);
  ASSERT_TRUE(pulling.wait(5s));

  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 20s));
  EXPECT_EQ(expect_whole_stream(*stream, 4), 201U);
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 1)
      << "not prefilled again: the transfer parameters were still valid";
  EXPECT_EQ(node_metric("kvr_decode_handoff_seconds_count"), 1)
      << "a handoff follows a prefill's answer; the replacement is a retry";
  EXPECT_EQ(node_metric("kvr_generate_retries_total"), 1);
  EXPECT_TRUE(bookings_drain());
}

TEST_F(NodeDisaggregatedTest, ADecodeRetryWhoseKvLeftWithItsPrefillWorkerIsPrefilledAgain) {
  ChildProcess& prefill = start_worker(100, "prefill");
  ChildProcess& pulling = start_worker(200, "decode", "1", {"--transfer-latency-ms", "20000"});
  start_node();
  ASSERT_TRUE(wait_for_worker(100, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(200, v1::WORKER_ROLE_DECODE));

  auto [stream, decision] = generate("refilled", prompt(512, 1), 4);
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  EXPECT_EQ(decision.success().worker_id(), 100U);
  ASSERT_TRUE(
      wait_until([&] { return node_metric("kvr_decode_handoff_seconds_count") == 1; }, 10s));
  start_worker(101, "prefill");
  start_worker(201, "decode");
  ASSERT_TRUE(wait_for_worker(101, v1::WORKER_ROLE_PREFILL));
  ASSERT_TRUE(wait_for_worker(201, v1::WORKER_ROLE_DECODE));
  prefill.signal(SIGKILL);
  ASSERT_TRUE(prefill.wait(5s));
  // The prefill worker's removal invalidates the transfer before the decode worker fails.
  ASSERT_TRUE(wait_until(
      [&] {
        const auto gone = probe(100, v1::WORKER_ROLE_PREFILL, prompt(32, 1), true);
        return gone && gone->has_error();
      },
      10s));
  pulling.signal(SIGKILL);
  ASSERT_TRUE(pulling.wait(5s));

  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 20s));
  EXPECT_EQ(expect_whole_stream(*stream, 4), 201U);
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 2)
      << "prefilled again, on worker 101";
  EXPECT_EQ(decisions("disaggregated"), 2);
  EXPECT_TRUE(bookings_drain());
}

}  // namespace
}  // namespace kvr
