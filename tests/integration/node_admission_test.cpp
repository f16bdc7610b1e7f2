// `kvr node` with a request classifier, as real processes: a nats-server on loopback, `kvr mocker`
// workers and `kvr node --router-policy-config` naming `max-in-flight` with a budget of 2. Ten
// concurrent generate requests all complete, and never more than two are at the workers at once.
// With `token-bucket` in reject mode, a tenant over its budget gets explicit rate-limited decisions
// while another tenant within its own budget is served. With `--router-queue-threshold`, requests
// wait in the node's queue while every worker is prefilling, and all complete.
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::free_port;
using testing::NatsRecorder;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "adm";
constexpr std::uint32_t kBlockSize = 16;

class NodeAdmissionTest : public testing::KvrClusterTest {
 protected:
  NodeAdmissionTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
    }
    streams_.clear();
  }

  std::unique_ptr<ChunkStream>& open_stream() {
    streams_.push_back(std::make_unique<ChunkStream>());
    EXPECT_TRUE(streams_.back()->open(*client_));
    return streams_.back();
  }

  // Starts `workers` simulated workers with ids from `id_base`, at the modelled GPU's speed.
  void start_fleet(int workers, WorkerId id_base) {
    auto mocker = kvr_->start_mocker({.workers = workers,
                                      .worker_id_base = id_base,
                                      .block_size = kBlockSize,
                                      .num_gpu_blocks = 2048,
                                      .time_scale = "1",
                                      .liveness_ttl_ms = 600,
                                      .load_interval_ms = 50},
                                     "mocker.log");
    ASSERT_TRUE(mocker);
    mocker_ = std::move(*mocker);
  }

  std::optional<ChildProcess> mocker_;
  std::optional<ChildProcess> node_;
  std::vector<std::unique_ptr<ChunkStream>> streams_;
};

TEST_F(NodeAdmissionTest, MaxInFlightTwoKeepsAtMostTwoAtTheWorkersAndCompletesAll) {
  constexpr int kRequests = 10;
  constexpr std::uint32_t kOutputTokens = 24;
  const std::set<WorkerId> workers{100, 101, 102, 103};
  ASSERT_NO_FATAL_FAILURE(start_fleet(static_cast<int>(workers.size()), 100));
  const auto config = directory_.path() / "router.yaml";
  {
    std::ofstream yaml{config};
    yaml << "request_classifier:\n"
            "  type: max-in-flight\n"
            "  parameters: {max_in_flight: 2}\n";
  }
  const std::uint16_t metrics_port = free_port();
  node_ = kvr_->start_node({.block_size = kBlockSize,
                            .metrics_port = metrics_port,
                            .extra = {"--router-policy-config", config.string()}});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << node_->log();
  // Route-mode probes (each reported completed) pass through the classifier too.
  int probes = 0;
  for (WorkerId worker : workers) {
    ASSERT_TRUE(testing::wait_until_routable(
        *client_, kNamespace, worker, [&] { return "probe-" + std::to_string(++probes); }, 20s));
  }

  // The observable: every message on the server, in the order it delivers them to one
  // subscription. A request is "at a worker" from the node's dispatch (a GenerateRequest on the
  // worker's generate subject) until the worker's own final chunk (on the node's stream inbox,
  // which the dispatch names). The classifier frees a slot only once the node has received that
  // final chunk, so the next dispatch is published after the server already delivered the chunk
  // to this subscription: the order seen here is causal, and the running count is exact.
  NatsRecorder everything;
  ASSERT_TRUE(everything.listen(*client_, ">"));
  NatsRecorder decisions;
  const std::string reply = client_->new_inbox();
  ASSERT_TRUE(decisions.listen(*client_, reply));

  std::vector<ChunkStream*> streams;
  for (int i = 0; i < kRequests; ++i) {
    ChunkStream* stream = open_stream().get();
    streams.push_back(stream);
    v1::GenerateRequest request;
    auto* route = request.mutable_route();
    route->set_request_id("adm-" + std::to_string(i));
    route->set_model("mock-model");
    for (std::uint32_t token : prompt(64, 100 + i)) route->mutable_tokens()->add_ids(token);
    request.set_max_output_tokens(kOutputTokens);
    request.set_stream_subject(stream->subject());
    ASSERT_TRUE(client_->publish_request(subjects::router_generate(kNamespace), reply,
                                         request.SerializeAsString()));
  }
  ASSERT_TRUE(wait_until(
      [&] {
        for (ChunkStream* stream : streams) {
          if (!stream->finished()) return false;
        }
        return true;
      },
      90s));
  for (ChunkStream* stream : streams) {
    const auto chunks = stream->chunks();
    ASSERT_EQ(chunks.size(), kOutputTokens) << chunks.back().DebugString();
    EXPECT_EQ(chunks.back().finish_reason(), "length");
  }
  ASSERT_TRUE(decisions.wait_for(kRequests, 10s));
  for (const auto& decision : decisions.decoded<v1::RouteDecision>()) {
    EXPECT_TRUE(decision.has_success()) << decision.DebugString();
  }

  std::map<std::string, WorkerId> node_streams;  // the node's stream inbox subjects → worker
  int at_workers = 0;
  int most_at_workers = 0;
  int dispatches = 0;
  int worker_finals = 0;
  for (const auto& message : everything.messages()) {
    bool dispatch = false;
    for (WorkerId worker : workers) {
      if (message.subject == subjects::worker_generate(kNamespace, worker)) {
        v1::GenerateRequest dispatched;
        ASSERT_TRUE(dispatched.ParseFromString(message.data));
        node_streams.emplace(dispatched.stream_subject(), worker);
        dispatch = true;
      }
    }
    if (dispatch) {
      ++dispatches;
      most_at_workers = std::max(most_at_workers, ++at_workers);
      continue;
    }
    if (!node_streams.contains(message.subject)) continue;
    v1::GenerateChunk chunk;
    ASSERT_TRUE(chunk.ParseFromString(message.data));
    if (chunk.finished()) {
      ++worker_finals;
      --at_workers;
    }
  }
  EXPECT_EQ(dispatches, kRequests);  // no retries: each request reached one worker once
  EXPECT_EQ(worker_finals, kRequests);
  EXPECT_EQ(at_workers, 0);
  EXPECT_EQ(most_at_workers, 2);  // the budget was used, and never exceeded
  EXPECT_TRUE(node_->running());
}

TEST_F(NodeAdmissionTest, TokenBucketRejectsTheTenantOverItsBudgetAndServesTheOther) {
  // Each prompt costs kPromptTokens; a bucket holds exactly kBurstPrompts of them. The refill is
  // so slow (a thousandth of a token per second) that no refill can admit another prompt during
  // the test however slow the machine: the outcome is fixed by counting, not by timing.
  constexpr std::uint32_t kPromptTokens = 64;
  constexpr int kBurstPrompts = 4;
  constexpr int kHeavyRequests = 12;
  constexpr int kLightEvery = 4;  // light sends one request per four of heavy's: 3 in all
  constexpr int kLightRequests = kHeavyRequests / kLightEvery;
  static_assert(kLightRequests <= kBurstPrompts);
  ASSERT_NO_FATAL_FAILURE(start_fleet(2, 200));
  const auto config = directory_.path() / "router.yaml";
  {
    std::ofstream yaml{config};
    yaml << "request_classifier:\n"
            "  type: token-bucket\n"
            "  parameters: {rate_tokens_per_s: 0.001, burst_tokens: "
         << kPromptTokens * kBurstPrompts << ", mode: reject}\n";
  }
  const std::uint16_t metrics_port = free_port();
  node_ = kvr_->start_node({.block_size = kBlockSize,
                            .metrics_port = metrics_port,
                            .extra = {"--router-policy-config", config.string()}});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << node_->log();
  // Until the workers are routable, each probe names a tenant of its own, so the probes (which
  // pass through the classifier too, however many a slow start takes) never drain a bucket.
  int probes = 0;
  testing::ReportingRouter probe_router;
  ASSERT_TRUE(probe_router.open(*client_, kNamespace));
  ASSERT_TRUE(wait_until(
      [&] {
        v1::RouteRequest request;
        request.set_request_id("probe-" + std::to_string(++probes));
        request.set_tenant(request.request_id());
        request.set_model("mock-model");
        for (std::uint32_t token : prompt(32, 1)) request.mutable_tokens()->add_ids(token);
        // Its booking released, a late decision's too: probes leave no load behind.
        const auto decision = probe_router.route(request, 2s);
        return decision && decision->has_success();
      },
      20s));

  int request_number = 0;
  const auto route = [&](const std::string& tenant) -> std::optional<v1::RouteDecision> {
    v1::RouteRequest request;
    request.set_request_id(tenant + "-" + std::to_string(request_number));
    request.set_model("mock-model");
    request.set_tenant(tenant);
    for (std::uint32_t token : prompt(kPromptTokens, 300 + request_number)) {
      request.mutable_tokens()->add_ids(token);
    }
    ++request_number;
    auto decision = testing::request_route(*client_, kNamespace, request);
    if (decision && decision->has_success()) {
      (void)testing::report_lifecycle(*client_, kNamespace, decision->success().booking_id(),
                                      v1::LIFECYCLE_EVENT_COMPLETED);
    }
    return decision;
  };

  int heavy_admitted = 0;
  int heavy_limited = 0;
  int light_admitted = 0;
  for (int i = 0; i < kHeavyRequests; ++i) {
    const auto heavy = route("heavy");
    ASSERT_TRUE(heavy) << "heavy request " << i << " got no decision";
    if (heavy->has_success()) {
      ++heavy_admitted;
    } else {
      ASSERT_TRUE(heavy->has_error()) << heavy->DebugString();
      EXPECT_EQ(heavy->error().code(), v1::ROUTE_ERROR_RATE_LIMITED) << heavy->DebugString();
      EXPECT_FALSE(heavy->error().message().empty());
      ++heavy_limited;
    }
    if (i % kLightEvery == 0) {
      const auto light = route("light");
      ASSERT_TRUE(light) << "light request after heavy " << i << " got no decision";
      EXPECT_TRUE(light->has_success()) << light->DebugString();
      if (light->has_success()) ++light_admitted;
    }
  }
  EXPECT_GT(heavy_limited, 0);
  EXPECT_EQ(heavy_admitted, kBurstPrompts);
  EXPECT_EQ(heavy_limited, kHeavyRequests - kBurstPrompts);
  EXPECT_EQ(light_admitted, kLightRequests);

  // `kvr route` shows heavy's next request as an answered refusal, with its own exit code.
  std::string tokens;
  for (std::uint32_t token : prompt(kPromptTokens, 900)) {
    tokens += (tokens.empty() ? "" : ",") + std::to_string(token);
  }
  const auto refused = testing::run_process(
      {kvr::testing::kvr_binary(), "route", "--nats", server_->url(), "--namespace",
       std::string{kNamespace}, "--tenant", "heavy", "--tokens", tokens},
      directory_.path() / "route.log", 20s);
  EXPECT_EQ(refused.exit_code, 3) << refused.output;
  EXPECT_NE(refused.output.find("rejected by admission: ROUTE_ERROR_RATE_LIMITED"),
            std::string::npos)
      << refused.output;
  EXPECT_TRUE(node_->running());
}

TEST_F(NodeAdmissionTest, TheQueueHoldsRequestsWhileEveryWorkerPrefillsAndCompletesAll) {
  constexpr int kRequests = 10;
  constexpr std::uint32_t kOutputTokens = 16;
  const std::set<WorkerId> workers{300, 301};
  // One load report at start and none after (a minute apart): the node's picture of each
  // worker's prefill is its own bookings only, so "busy" is exact: a worker is busy from its
  // dispatch until its first chunk reaches the node.
  auto mocker = kvr_->start_mocker({.workers = static_cast<int>(workers.size()),
                                    .worker_id_base = 300,
                                    .block_size = kBlockSize,
                                    .num_gpu_blocks = 2048,
                                    .time_scale = "1",
                                    .liveness_ttl_ms = 600,
                                    .load_interval_ms = 60'000},
                                   "mocker.log");
  ASSERT_TRUE(mocker);
  mocker_ = std::move(*mocker);
  const std::uint16_t metrics_port = free_port();
  // Busy above a ten-thousandth of the max batched tokens: any prefill at all.
  node_ = kvr_->start_node({.block_size = kBlockSize,
                            .metrics_port = metrics_port,
                            .extra = {"--router-queue-threshold", "0.0001"}});
  ASSERT_TRUE(node_);
  ASSERT_TRUE(testing::wait_until_healthy(metrics_port, 20s)) << node_->log();
  int probes = 0;
  for (WorkerId worker : workers) {
    ASSERT_TRUE(testing::wait_until_routable(
        *client_, kNamespace, worker, [&] { return "probe-" + std::to_string(++probes); }, 20s));
  }

  NatsRecorder everything;
  ASSERT_TRUE(everything.listen(*client_, ">"));
  NatsRecorder decisions;
  const std::string reply = client_->new_inbox();
  ASSERT_TRUE(decisions.listen(*client_, reply));
  std::vector<ChunkStream*> streams;
  for (int i = 0; i < kRequests; ++i) {
    ChunkStream* stream = open_stream().get();
    streams.push_back(stream);
    v1::GenerateRequest request;
    auto* route = request.mutable_route();
    route->set_request_id("queued-" + std::to_string(i));
    route->set_model("mock-model");
    for (std::uint32_t token : prompt(256, 500 + i)) route->mutable_tokens()->add_ids(token);
    request.set_max_output_tokens(kOutputTokens);
    request.set_stream_subject(stream->subject());
    ASSERT_TRUE(client_->publish_request(subjects::router_generate(kNamespace), reply,
                                         request.SerializeAsString()));
  }
  ASSERT_TRUE(wait_until(
      [&] {
        for (ChunkStream* stream : streams) {
          if (!stream->finished()) return false;
        }
        return true;
      },
      90s));
  for (ChunkStream* stream : streams) {
    const auto chunks = stream->chunks();
    ASSERT_EQ(chunks.size(), kOutputTokens) << chunks.back().DebugString();
    EXPECT_EQ(chunks.back().finish_reason(), "length");
  }
  ASSERT_TRUE(decisions.wait_for(kRequests, 10s));
  for (const auto& decision : decisions.decoded<v1::RouteDecision>()) {
    EXPECT_TRUE(decision.has_success()) << decision.DebugString();
  }

  // Per worker, requests between their dispatch and their first chunk, in the server's order
  // (causal, as in the max-in-flight test: a dispatch from the queue follows the first chunk
  // that freed its worker).
  std::map<std::string, WorkerId> node_streams;
  std::map<WorkerId, int> prefilling;
  std::set<std::string> first_seen;
  int most_prefilling = 0;
  for (const auto& message : everything.messages()) {
    for (WorkerId worker : workers) {
      if (message.subject == subjects::worker_generate(kNamespace, worker)) {
        v1::GenerateRequest dispatched;
        ASSERT_TRUE(dispatched.ParseFromString(message.data));
        node_streams.emplace(dispatched.stream_subject(), worker);
        most_prefilling = std::max(most_prefilling, ++prefilling[worker]);
      }
    }
    const auto stream = node_streams.find(message.subject);
    if (stream == node_streams.end() || !first_seen.insert(message.subject).second) continue;
    --prefilling[stream->second];
  }
  EXPECT_EQ(node_streams.size(), static_cast<std::size_t>(kRequests));
  EXPECT_EQ(most_prefilling, 1);  // a worker never got a second request while prefilling one
  // Published in one burst, most requests found both workers prefilling and waited.
  const std::string metrics = testing::http_get(metrics_port, "/metrics");
  const std::string dispatched_series =
      "kvr_queue_outcomes_total{partition=\"mock-model/default\",class=\"default\","
      "outcome=\"dispatched\"} ";
  const auto dispatched = metrics.find(dispatched_series);
  ASSERT_NE(dispatched, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(dispatched + dispatched_series.size())), 1) << metrics;
  EXPECT_NE(metrics.find("kvr_queue_depth{partition=\"mock-model/default\",class=\"default\"} 0\n"),
            std::string::npos)
      << metrics;
  EXPECT_TRUE(node_->running());
}

}  // namespace
}  // namespace kvr
