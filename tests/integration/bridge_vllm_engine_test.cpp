// `kvr bridge` in front of `kvr mocker --speak vllm` engines, all real processes with a real
// nats-server and `kvr node`: the engines speak only vLLM's formats (HTTP completions streaming,
// Prometheus metrics, msgpack KV events on ZMQ with a replay socket), the bridges make them kvr
// workers. Shown: prompts with shared prefixes are routed to the engine holding them, with the
// node's overlap equal to what the engine reports as cached; generate streams complete through
// node, bridge and HTTP, and a cancel reaches the engine; a killed engine leaves routing within
// the liveness TTL; a sequence gap is filled from the replay socket, and without one the rank is
// cleared.
#include <csignal>

#include <gtest/gtest.h>

#include "kvr/v1/routing.pb.h"
#include "messages/nats/nats_client.hpp"
#include "messages/subjects.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/nats_recorder.hpp"
#include "tests/testing/vllm_engines.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using testing::ChildProcess;
using testing::ChunkStream;
using testing::EnginePair;
using testing::free_port;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "vllm-bridge";
constexpr WorkerId kFirstWorker = 500;
constexpr std::uint32_t kBlockSize = 16;
constexpr int kLivenessTtlMs = 1500;
// Fits the engines' 2048 blocks with its prompt, and outlasts any test at time scale 1.
constexpr std::uint32_t kLongGeneration = 20'000;

struct Generated {
  v1::RouteDecision decision;
  std::vector<v1::GenerateChunk> chunks;
};

class BridgeVllmEngineTest : public testing::KvrClusterTest {
 protected:
  BridgeVllmEngineTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      std::cerr << testing::engine_pair_logs(pairs_);
    }
  }

  // Starts an engine (with `engine_args`, its clock `time_scale` times the modelled GPU's) and
  // its bridge (with a replay endpoint unless `replay` is false, probing /health every
  // `health_interval_ms`); waits until the engine answers /health.
  EnginePair& start_pair(WorkerId worker, std::vector<std::string> engine_args = {},
                         bool replay = true, const std::string& time_scale = "20",
                         const std::string& health_interval_ms = "50",
                         const std::string& load_interval_ms = "50") {
    auto pair = testing::start_engine_pair(*kvr_, {.worker = worker,
                                                   .block_size = kBlockSize,
                                                   .time_scale = time_scale,
                                                   .replay = replay,
                                                   .health_interval_ms = health_interval_ms,
                                                   .load_interval_ms = load_interval_ms,
                                                   .liveness_ttl_ms = kLivenessTtlMs,
                                                   .engine_args = std::move(engine_args)});
    EXPECT_TRUE(pair) << pair.error();
    if (!pair) pair = std::make_unique<EnginePair>();
    pairs_.push_back(std::move(*pair));
    return *pairs_.back();
  }

  void start_node() {
    metrics_port_ = free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize, .metrics_port = metrics_port_});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  std::string next_id() { return "req-" + std::to_string(++request_counter_); }

  // A route-mode decision for `tokens`, pinned to `pinned` when given. Its booking is released
  // (reported completed) before the next request, and likewise a decision that comes too late:
  // readiness probes leave no load behind, however many a slow machine needs, so they cannot
  // change which worker kv-cost prefers for the requests under test.
  std::optional<v1::RouteDecision> route(const std::vector<std::uint32_t>& tokens,
                                         std::optional<WorkerId> pinned = std::nullopt) {
    if (!router_.is_open()) {
      EXPECT_TRUE(router_.open(*client_, kNamespace));
    }
    v1::RouteRequest request;
    request.set_request_id(next_id());
    request.set_model("mock-model");
    if (pinned) request.mutable_pinned_worker()->set_worker_id(*pinned);
    for (std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
    return router_.route(request, 2s);
  }

  // Whether the node routes `tokens` to `worker` with `blocks` blocks of device overlap.
  bool routes_with_overlap(const std::vector<std::uint32_t>& tokens, WorkerId worker,
                           std::uint32_t blocks) {
    const auto decision = route(tokens);
    return decision && decision->has_success() && decision->success().worker_id() == worker &&
           decision->success().device_overlap_blocks() == blocks;
  }

  // Sends a generate request through the node; the stream stays open in `streams_`.
  std::pair<ChunkStream*, v1::RouteDecision> start_generate(
      const std::vector<std::uint32_t>& tokens, std::uint32_t max_tokens,
      std::optional<WorkerId> pinned = std::nullopt, const std::string& id = {}) {
    streams_.push_back(std::make_unique<ChunkStream>());
    ChunkStream* stream = streams_.back().get();
    EXPECT_TRUE(stream->open(*client_));
    v1::GenerateRequest request;
    request.mutable_route()->set_request_id(id.empty() ? next_id() : id);
    request.mutable_route()->set_model("mock-model");
    for (std::uint32_t token : tokens) request.mutable_route()->mutable_tokens()->add_ids(token);
    if (pinned) request.mutable_route()->mutable_pinned_worker()->set_worker_id(*pinned);
    request.set_max_output_tokens(max_tokens);
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

  // A generate request run to its last chunk.
  Generated generate(const std::vector<std::uint32_t>& tokens, std::uint32_t max_tokens,
                     std::optional<WorkerId> pinned = std::nullopt) {
    auto [stream, decision] = start_generate(tokens, max_tokens, pinned);
    EXPECT_TRUE(wait_until([&] { return stream->finished(); }, 15s));
    return Generated{decision, stream->chunks()};
  }

  // Until the bridge of `worker` forwards KV events: pinned generations of fresh prompts until
  // the node sees one on the worker. (A SUB socket misses what was published before it joined;
  // the next batch's sequence gap then replays it, or a later batch lands.)
  bool wait_for_kv_events(WorkerId worker, std::uint32_t first_token) {
    std::uint32_t attempt = 0;
    return wait_until(
        [&] {
          const auto tokens = prompt(64, first_token + 1000 * attempt++);
          const Generated done = generate(tokens, 1, worker);
          return !done.chunks.empty() && !done.chunks.back().has_error() &&
                 wait_until([&] { return routes_with_overlap(tokens, worker, 4); }, 2s);
        },
        20s);
  }

  // Kills the engine of `pair` and starts it again on the same ports; waits for its /health.
  void restart_engine(EnginePair& pair) {
    pair.engine->signal(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return !pair.engine->running(); }, 10s));
    pair.engine = kvr_->start({"mocker"}, pair.engine_args,
                              "engine-" + std::to_string(pair.worker) + "-restarted.log");
    ASSERT_TRUE(pair.engine);
    ASSERT_TRUE(wait_until(
        [&] { return testing::http_get(pair.http_port, "/health").starts_with("HTTP/1.1 200"); },
        20s))
        << pair.engine->log();
  }

  double engine_metric(const EnginePair& pair, const std::string& name) {
    return testing::metric(testing::http_get(pair.http_port, "/metrics"), name);
  }

  double bridge_metric(const EnginePair& pair, const std::string& name) {
    return testing::metric(testing::http_get(pair.bridge_metrics_port, "/metrics"), name);
  }

  std::vector<std::unique_ptr<EnginePair>> pairs_;
  std::vector<std::unique_ptr<ChunkStream>> streams_;
  testing::ReportingRouter router_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
  int request_counter_ = 0;
};

TEST_F(BridgeVllmEngineTest, RoutesSharedPrefixesToTheEngineHoldingThemAndStreamsThroughHttp) {
  // The placements below follow from KV events and the node's own bookings alone. A /metrics
  // scrape taken while a seed ran but applied after its booking was released would count the
  // finished request again until the next scrape (docs/protocol.md, LoadMetrics), and
  // tilt a follow-up away from its holder: the bridges scrape once, at registration.
  EnginePair& first = start_pair(kFirstWorker, {}, true, "20", "50", "60000");
  EnginePair& second = start_pair(kFirstWorker + 1, {}, true, "20", "50", "60000");
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker + 1, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(wait_for_kv_events(first.worker, 1'000'000));
  ASSERT_TRUE(wait_for_kv_events(second.worker, 2'000'000));
  const double hits_before = engine_metric(first, "vllm:prefix_cache_hits_total") +
                             engine_metric(second, "vllm:prefix_cache_hits_total");

  // Four prefix families: a 128-token seed (8 blocks), then two follow-ups extending it.
  std::uint64_t cached_by_engines = 0;
  std::uint64_t overlap_tokens_by_node = 0;
  for (std::uint32_t family = 0; family < 4; ++family) {
    const auto seed = prompt(128, 10'000 * (family + 1));
    const Generated seeded = generate(seed, 4);
    ASSERT_TRUE(seeded.decision.has_success()) << seeded.decision.DebugString();
    // The stream came through node, bridge and the engine's SSE: 4 chunks of one token each.
    ASSERT_EQ(seeded.chunks.size(), 4U);
    for (std::uint32_t i = 0; i < 4; ++i) {
      EXPECT_EQ(seeded.chunks[i].index(), i);
      EXPECT_EQ(seeded.chunks[i].token_ids_size(), 1);
      EXPECT_FALSE(seeded.chunks[i].has_error()) << seeded.chunks[i].error().message();
    }
    EXPECT_EQ(seeded.chunks.back().finish_reason(), "length");
    const WorkerId holder = seeded.decision.success().worker_id();
    EXPECT_EQ(seeded.chunks[0].worker_id(), holder);
    // The decision names the holder's engine as its bridge registered it (--engine-url).
    const EnginePair& holding = holder == first.worker ? first : second;
    EXPECT_EQ(seeded.decision.success().worker_http_url(),
              "http://127.0.0.1:" + std::to_string(holding.http_port));
    cached_by_engines += seeded.chunks[0].cached_prompt_tokens();
    overlap_tokens_by_node += seeded.decision.success().device_overlap_blocks() * kBlockSize;
    // The engine's BlockStored events, translated by the bridge, reach the node.
    ASSERT_TRUE(wait_until([&] { return routes_with_overlap(seed, holder, 8); }, 10s))
        << "family " << family;

    for (std::uint32_t extension = 1; extension <= 2; ++extension) {
      auto follow_up = seed;
      const auto more = prompt(32 * extension, 500'000 + 10'000 * family + 1000 * extension);
      follow_up.insert(follow_up.end(), more.begin(), more.end());
      const Generated followed = generate(follow_up, 2);
      ASSERT_TRUE(followed.decision.has_success());
      EXPECT_EQ(followed.decision.success().worker_id(), holder) << "family " << family;
      ASSERT_FALSE(followed.chunks.empty());
      EXPECT_FALSE(followed.chunks.back().has_error());
      // What the node counted as overlap is what the engine served from its cache.
      EXPECT_EQ(followed.decision.success().device_overlap_blocks() * kBlockSize,
                followed.chunks[0].cached_prompt_tokens())
          << "family " << family << " extension " << extension;
      EXPECT_EQ(followed.chunks[0].cached_prompt_tokens(), 128U);
      cached_by_engines += followed.chunks[0].cached_prompt_tokens();
      overlap_tokens_by_node += followed.decision.success().device_overlap_blocks() * kBlockSize;
    }
  }
  EXPECT_EQ(overlap_tokens_by_node, cached_by_engines);
  EXPECT_EQ(cached_by_engines, 8U * 128U);
  // The engines' own counters agree with what their streams reported.
  const double hits_after = engine_metric(first, "vllm:prefix_cache_hits_total") +
                            engine_metric(second, "vllm:prefix_cache_hits_total");
  EXPECT_EQ(hits_after - hits_before, static_cast<double>(cached_by_engines));
}

TEST_F(BridgeVllmEngineTest, ACancelThroughTheNodeAbortsTheEnginesRequest) {
  // At the modelled GPU's speed (about 6 ms a token) 20,000 tokens take two minutes.
  EnginePair& pair = start_pair(kFirstWorker, {}, true, "1");
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  auto [stream, decision] = start_generate(prompt(64, 1), kLongGeneration, std::nullopt, "long-1");
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_TRUE(wait_until([&] { return stream->size() >= 2; }, 10s));
  EXPECT_EQ(engine_metric(pair, "vllm:num_requests_running"), 1);
  v1::GenerateCancel cancel;
  cancel.set_request_id("long-1");
  ASSERT_TRUE(
      client_->publish(subjects::router_generate_cancel(kNamespace), cancel.SerializeAsString()));
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
  EXPECT_EQ(stream->chunks().back().finish_reason(), "cancelled");
  // The bridge closed the HTTP stream; the engine aborted the request.
  EXPECT_TRUE(
      wait_until([&] { return engine_metric(pair, "vllm:num_requests_running") == 0; }, 10s));
  EXPECT_LT(engine_metric(pair, "vllm:generation_tokens_total"), kLongGeneration);
}

TEST_F(BridgeVllmEngineTest, AKilledEngineLeavesRoutingWithinTheLivenessTtl) {
  EnginePair& first = start_pair(kFirstWorker);
  EnginePair& second = start_pair(kFirstWorker + 1, {}, true, "1");
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker + 1, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(wait_for_kv_events(second.worker, 3'000'000));

  // The node prefers the second engine for a prompt it holds.
  const auto tokens = prompt(64, 3'000'000);
  ASSERT_TRUE(routes_with_overlap(tokens, second.worker, 4));
  // A stream in flight on the engine that dies ends with an error, not silence.
  auto [stream, decision] =
      start_generate(prompt(64, 40'000), kLongGeneration, second.worker, "doomed");
  ASSERT_TRUE(decision.has_success());
  ASSERT_TRUE(wait_until([&] { return stream->size() >= 1; }, 10s));

  second.engine->signal(SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  // Gone from routing: a request pinned to it is refused, the prompt it held goes elsewhere.
  ASSERT_TRUE(wait_until(
      [&] {
        const auto pinned = route(tokens, second.worker);
        return pinned && pinned->has_error();
      },
      10s));
  const auto elapsed = std::chrono::steady_clock::now() - killed_at;
  EXPECT_LT(elapsed, std::chrono::milliseconds(kLivenessTtlMs));
  const auto elsewhere = route(tokens);
  ASSERT_TRUE(elsewhere && elsewhere->has_success());
  EXPECT_EQ(elsewhere->success().worker_id(), first.worker);
  ASSERT_TRUE(wait_until([&] { return stream->finished(); }, 10s));
  EXPECT_EQ(stream->chunks().back().finish_reason(), "error");
  // Nothing routes to the dead engine any more.
  for (int i = 0; i < 5; ++i) {
    const auto decided = route(prompt(64, 60'000 + 100 * static_cast<std::uint32_t>(i)));
    ASSERT_TRUE(decided && decided->has_success());
    EXPECT_EQ(decided->success().worker_id(), first.worker);
  }
}

TEST_F(BridgeVllmEngineTest, ASequenceGapIsFilledFromTheReplaySocket) {
  // Every second batch is never sent live: only the replay socket has it.
  EnginePair& pair = start_pair(kFirstWorker, {"--kv-events-skip-every", "2"});
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(wait_for_kv_events(pair.worker, 4'000'000));
  std::vector<std::vector<std::uint32_t>> prompts;
  for (std::uint32_t i = 0; i < 6; ++i) {
    prompts.push_back(prompt(96, 100'000 + 1000 * i));
    const Generated done = generate(prompts.back(), 1);
    ASSERT_FALSE(done.chunks.empty());
    EXPECT_FALSE(done.chunks.back().has_error());
  }
  // Each generation stored its prompt as one batch; at least two of the first five were only
  // replayed (the sixth may wait for a later batch to reveal its gap). All five are known.
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(wait_until([&] { return routes_with_overlap(prompts[i], pair.worker, 6); }, 10s))
        << "prompt " << i;
  }
  // The bridge's own metrics: gaps, filled by replays; nothing cleared. (One replay may fill
  // several skipped batches when it runs late, so the counts are not one per skipped batch.)
  EXPECT_GE(bridge_metric(pair, "kvr_bridge_sequence_gaps_total"), 1);
  EXPECT_GE(bridge_metric(pair, "kvr_bridge_replays_total{outcome=\"filled\""), 1);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_replays_total{outcome=\"failed\""), 0);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_ranks_cleared_total"), 0);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_malformed_payloads_total"), 0);
}

TEST_F(BridgeVllmEngineTest, AGapWithoutReplayClearsTheRank) {
  EnginePair& pair = start_pair(kFirstWorker, {"--kv-events-skip-every", "2"}, false);
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(wait_for_kv_events(pair.worker, 5'000'000));
  // Generate fresh prompts until one is known (its batch was sent live); the next batch is then
  // skipped and the one after reveals the gap: with nothing to replay from, the bridge clears
  // the rank, so the known prompt is forgotten.
  std::vector<std::uint32_t> known;
  std::uint32_t next = 0;
  ASSERT_TRUE(wait_until(
      [&] {
        known = prompt(96, 200'000 + 1000 * next++);
        generate(known, 1);
        return wait_until([&] { return routes_with_overlap(known, pair.worker, 6); }, 2s);
      },
      20s));
  std::vector<std::uint32_t> latest;
  ASSERT_TRUE(wait_until(
      [&] {
        latest = prompt(96, 400'000 + 1000 * next++);
        generate(latest, 1);
        return routes_with_overlap(known, pair.worker, 0);
      },
      20s));
  EXPECT_TRUE(pair.bridge->log().find("cannot replay; cleared") != std::string::npos)
      << pair.bridge->log();
  EXPECT_GE(bridge_metric(pair, "kvr_bridge_replays_total{outcome=\"failed\""), 1);
  EXPECT_GE(bridge_metric(pair, "kvr_bridge_ranks_cleared_total"), 1);
}

TEST_F(BridgeVllmEngineTest, AnEngineRestartedBetweenHealthProbesBecomesANewIncarnation) {
  // The bridge asks /health once, at its start: only the engine's KV event numbering and its
  // process_start_time_seconds can show the restart.
  EnginePair& pair = start_pair(kFirstWorker, {}, true, "20", "60000");
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  ASSERT_TRUE(wait_for_kv_events(pair.worker, 6'000'000));
  // A few more batches, so the old engine's last sequence number is well above 0.
  std::vector<std::vector<std::uint32_t>> old_prompts;
  for (std::uint32_t i = 0; i < 3; ++i) {
    old_prompts.push_back(prompt(96, 600'000 + 1000 * i));
    ASSERT_FALSE(generate(old_prompts.back(), 1, pair.worker).chunks.empty());
    ASSERT_TRUE(
        wait_until([&] { return routes_with_overlap(old_prompts.back(), pair.worker, 6); }, 10s));
  }
  ASSERT_EQ(bridge_metric(pair, "kvr_bridge_registrations_total"), 1);

  restart_engine(pair);
  // One restart, whichever signal comes first (the load scrape every 50 ms reads the new start
  // time; the new engine's first KV batch numbers from 0). A request routed to the old
  // incarnation until then would fail when it is deregistered, so the test waits for it.
  const auto restarts = [&] {
    return bridge_metric(pair, "kvr_bridge_engine_restarts_total{signal=\"zmq_sequence\"") +
           bridge_metric(pair, "kvr_bridge_engine_restarts_total{signal=\"start_time\"");
  };
  ASSERT_TRUE(wait_until([&] { return restarts() == 1; }, 10s)) << pair.bridge->log();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 10s));
  // The first request of the new engine: its BlockStored batch is the new engine's sequence 0.
  const auto fresh = prompt(96, 700'000);
  const Generated done = generate(fresh, 1, pair.worker);
  ASSERT_FALSE(done.chunks.empty());
  EXPECT_FALSE(done.chunks.back().has_error()) << done.chunks.back().error().message();
  EXPECT_EQ(done.chunks[0].cached_prompt_tokens(), 0U) << "the new engine starts empty";
  // The node drops the old incarnation's picture and learns the new engine's first batch: live,
  // or (when it went out before the SUB socket reconnected) replayed once a later batch shows
  // the gap.
  std::uint32_t nudge = 0;
  EXPECT_TRUE(wait_until(
      [&] {
        generate(prompt(64, 750'000 + 1000 * nudge++), 1, pair.worker);
        return wait_until([&] { return routes_with_overlap(fresh, pair.worker, 6); }, 2s);
      },
      20s));
  for (const auto& old : old_prompts) {
    EXPECT_TRUE(wait_until([&] { return routes_with_overlap(old, pair.worker, 0); }, 10s));
  }
  // Still one restart (the other signal was the same one); a new registration, no health
  // failure.
  EXPECT_EQ(restarts(), 1);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_registrations_total"), 2);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_registered"), 1);
  EXPECT_NE(pair.bridge->log().find("restarted between health probes"), std::string::npos)
      << pair.bridge->log();
  EXPECT_EQ(pair.bridge->log().find("stopped answering /health"), std::string::npos);
  // Still exactly one restart after further traffic (the other signal is not a second one).
  const auto later = prompt(96, 800'000);
  ASSERT_FALSE(generate(later, 1, pair.worker).chunks.empty());
  EXPECT_TRUE(wait_until([&] { return routes_with_overlap(later, pair.worker, 6); }, 10s));
  EXPECT_EQ(restarts(), 1);
  EXPECT_EQ(bridge_metric(pair, "kvr_bridge_registrations_total"), 2);
}

TEST_F(BridgeVllmEngineTest, SamplingParametersReachTheEngineThroughNodeAndBridge) {
  start_pair(kFirstWorker);
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s));
  // A seeded generation of 8 tokens; the engine's tokens follow the seed.
  auto seeded = [&](std::optional<std::uint32_t> stop_token) {
    streams_.push_back(std::make_unique<ChunkStream>());
    ChunkStream* stream = streams_.back().get();
    EXPECT_TRUE(stream->open(*client_));
    v1::GenerateRequest request;
    request.mutable_route()->set_request_id(next_id());
    request.mutable_route()->set_model("mock-model");
    for (std::uint32_t token :
         prompt(64, 900'000 + 100 * static_cast<std::uint32_t>(request_counter_))) {
      request.mutable_route()->mutable_tokens()->add_ids(token);
    }
    request.set_max_output_tokens(8);
    request.set_stream_subject(stream->subject());
    v1::SamplingParams& sampling = *request.mutable_sampling();
    sampling.set_seed(42);
    sampling.set_temperature(0.0F);
    sampling.set_ignore_eos(true);
    if (stop_token) sampling.add_stop_token_ids(*stop_token);
    auto reply =
        client_->request(subjects::router_generate(kNamespace), request.SerializeAsString(), 5s);
    EXPECT_TRUE(reply) << reply.error();
    EXPECT_TRUE(wait_until([&] { return stream->finished(); }, 15s));
    std::vector<std::uint32_t> tokens;
    for (const auto& chunk : stream->chunks()) {
      for (std::uint32_t token : chunk.token_ids()) tokens.push_back(token);
    }
    return std::pair{tokens, stream->chunks().back().finish_reason()};
  };
  const auto [first, first_reason] = seeded(std::nullopt);
  ASSERT_EQ(first.size(), 8U);
  EXPECT_EQ(first_reason, "length");
  // The same seed on another prompt: the same tokens. A stop token at the fourth one ends the
  // stream there with "stop".
  const std::uint32_t stop = first[3];
  std::size_t stop_at = 0;
  while (first[stop_at] != stop) ++stop_at;
  const auto [second, second_reason] = seeded(stop);
  EXPECT_EQ(second_reason, "stop");
  EXPECT_EQ(second, std::vector<std::uint32_t>(
                        first.begin(), first.begin() + static_cast<std::ptrdiff_t>(stop_at) + 1));
}

}  // namespace
}  // namespace kvr
