// `kvr bridge` as a real process in front of stand-in engines that speak what vLLM speaks: an
// HTTP server with /health, /v1/models and a Prometheus /metrics with vLLM's metric names, and a
// ZMQ PUB socket sending msgpack KV event batches in vLLM's three-frame messages. With a real
// nats-server and `kvr node`: the bridges register with what the engines report, publish their
// load, forward KV events translated to kvr's hashes so the node routes a prompt to the engine
// holding it, and leave routing when their engine stops answering /health. An engine that does
// not publish vllm:cache_config_info is registered without a KV capacity (with --block-size), and
// without a block size the bridge says why, rate-limited, and does not register.
#include <atomic>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <msgpack.hpp>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "deploy/worker/vllm_kv_frames.hpp"
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
using testing::free_port;
using testing::prompt;
using testing::wait_until;

constexpr std::string_view kNamespace = "bridge";
constexpr WorkerId kFirstWorker = 300;
constexpr std::uint32_t kBlockSize = 16;

using worker::encode_sequence;

// One engine stand-in: HTTP on a free port and a ZMQ PUB socket, both on loopback. Without
// `cache_config` its /metrics has no vllm:cache_config_info (neither block size nor capacity).
class StandInEngine {
 public:
  explicit StandInEngine(zmq::context_t& context, bool cache_config = true)
      : pub_(context, zmq::socket_type::pub) {
    pub_.set(zmq::sockopt::linger, 0);
    pub_.bind("tcp://127.0.0.1:*");
    kv_endpoint_ = pub_.get(zmq::sockopt::last_endpoint);
    server_.Get("/health", [this](const httplib::Request&, httplib::Response& response) {
      response.status = healthy_.load() ? 200 : 503;
    });
    server_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& response) {
      ++models_requests_;
      response.set_content(
          R"({"object":"list","data":[{"id":"mock-model","object":"model","max_model_len":4096}]})",
          "application/json");
    });
    server_.Get("/metrics", [cache_config](const httplib::Request&, httplib::Response& response) {
      std::string text =
          "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
          "# TYPE vllm:num_requests_running gauge\n"
          "vllm:num_requests_running{engine=\"0\",model_name=\"mock-model\"} 2.0\n"
          "vllm:num_requests_waiting{engine=\"0\",model_name=\"mock-model\"} 3.0\n"
          "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"mock-model\"} 0.25\n";
      if (cache_config) {
        text +=
            "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\","
            "num_gpu_blocks=\"512\",prefix_caching_hash_algo=\"sha256\"} 1.0\n";
      }
      response.set_content(text, "text/plain; version=0.0.4");
    });
    // OpenAI's completions streaming as vLLM writes it: one event per token (its id in token_ids,
    // with return_token_ids), the finish reason on the last, a usage-only event, then [DONE].
    server_.Post("/v1/completions", [this](const httplib::Request& request,
                                           httplib::Response& response) {
      const auto body = nlohmann::json::parse(request.body, nullptr, false);
      if (body.is_discarded() || !body.value("stream", false) || !body["prompt"].is_array()) {
        response.status = 400;
        response.set_content(R"({"object":"error","message":"bad request","code":400})",
                             "application/json");
        return;
      }
      ++completions_;
      const int max_tokens = body.value("max_tokens", 16);
      const std::size_t prompt_tokens = body["prompt"].size();
      response.set_chunked_content_provider(
          "text/event-stream", [max_tokens, prompt_tokens](std::size_t, httplib::DataSink& sink) {
            for (int i = 0; i < max_tokens; ++i) {
              const bool last = i + 1 == max_tokens;
              const nlohmann::json event = {
                  {"id", "cmpl-1"},
                  {"object", "text_completion"},
                  {"created", 1'700'000'000},
                  {"model", "mock-model"},
                  {"choices",
                   {{{"index", 0},
                     {"text", " t"},
                     {"logprobs", nullptr},
                     {"finish_reason", last ? nlohmann::json("length") : nlohmann::json()},
                     {"stop_reason", nullptr},
                     {"token_ids", {500 + i}}}}},
                  {"usage",
                   {{"prompt_tokens", prompt_tokens},
                    {"completion_tokens", i + 1},
                    {"total_tokens", prompt_tokens + static_cast<std::size_t>(i) + 1},
                    {"prompt_tokens_details", {{"cached_tokens", 32}}}}}};
              const std::string line = "data: " + event.dump() + "\n\n";
              if (!sink.write(line.data(), line.size())) return false;
            }
            const std::string done = "data: [DONE]\n\n";
            sink.write(done.data(), done.size());
            sink.done();
            return true;
          });
    });
    http_port_ = static_cast<std::uint16_t>(server_.bind_to_any_port("127.0.0.1"));
    thread_ = std::thread{[this] { server_.listen_after_bind(); }};
    // httplib's stop() does nothing until the listen loop runs: wait for it.
    // (bounded: a loop that ends at once never shows as running)
    for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
         !server_.is_running() && std::chrono::steady_clock::now() < until;) {
      std::this_thread::yield();
    }
  }
  ~StandInEngine() {
    server_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(http_port_); }
  const std::string& kv_endpoint() const { return kv_endpoint_; }
  void set_healthy(bool healthy) { healthy_ = healthy; }
  int completions() const { return completions_.load(); }
  // /v1/models answers: the bridge asks at each attempt to register.
  int models_requests() const { return models_requests_.load(); }

  // Publishes, as vLLM's array-encoded batch, that the engine stored every full block of
  // `tokens` as one chain, with engine hashes of its own (not kvr's).
  void publish_stored(std::uint64_t sequence, const std::vector<std::uint32_t>& tokens) {
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> packer{buffer};
    const std::size_t blocks = tokens.size() / kBlockSize;
    std::vector<std::int64_t> hashes;
    for (std::size_t i = 0; i < blocks; ++i) hashes.push_back(-1000 - static_cast<int>(i));
    packer.pack_array(3);
    packer.pack_double(1.0);
    packer.pack_array(1);
    packer.pack_array(7);
    packer.pack(std::string{"BlockStored"});
    packer.pack(hashes);
    packer.pack_nil();
    packer.pack(std::vector<std::uint32_t>(tokens.begin(), tokens.begin() + blocks * kBlockSize));
    packer.pack(kBlockSize);
    packer.pack_nil();
    packer.pack(std::string{"GPU"});
    packer.pack(0);
    worker::send_kv_event(pub_, "", sequence, {buffer.data(), buffer.size()});
  }

  // Publishes, as vLLM's array-encoded batch, that the engine removed a block of hash `hash`.
  void publish_removed(std::uint64_t sequence, std::int64_t hash) {
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> packer{buffer};
    packer.pack_array(3);
    packer.pack_double(2.0);
    packer.pack_array(1);
    packer.pack_array(3);
    packer.pack(std::string{"BlockRemoved"});
    packer.pack(std::vector<std::int64_t>{hash});
    packer.pack(std::string{"GPU"});
    packer.pack(0);
    publish_raw({"", encode_sequence(sequence), std::string{buffer.data(), buffer.size()}});
  }

  // Sends `frames` as one multipart message, whatever they hold.
  void publish_raw(const std::vector<std::string>& frames) {
    std::vector<zmq::const_buffer> buffers;
    for (const auto& frame : frames) buffers.push_back(zmq::buffer(frame));
    zmq::send_multipart(pub_, buffers);
  }

 private:
  zmq::socket_t pub_;
  std::string kv_endpoint_;
  httplib::Server server_;
  std::uint16_t http_port_ = 0;
  std::atomic<bool> healthy_{true};
  std::atomic<int> completions_{0};
  std::atomic<int> models_requests_{0};
  std::thread thread_;
};

class BridgeTest : public testing::KvrClusterTest {
 protected:
  BridgeTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      for (auto& bridge : bridges_) std::cerr << "---- bridge log\n" << bridge.log();
    }
  }

  void start_bridge(const StandInEngine& engine, WorkerId id,
                    std::optional<std::uint16_t> metrics_port = std::nullopt,
                    const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"--engine",
                                     "vllm",
                                     "--engine-url",
                                     engine.url(),
                                     "--kv-events",
                                     engine.kv_endpoint(),
                                     "--worker-id",
                                     std::to_string(id),
                                     "--liveness-ttl-ms",
                                     "600",
                                     "--load-interval-ms",
                                     "50",
                                     "--health-interval-ms",
                                     "50"};
    if (metrics_port) {
      args.push_back("--metrics-port");
      args.push_back(std::to_string(*metrics_port));
    }
    args.insert(args.end(), extra.begin(), extra.end());
    auto bridge = kvr_->start({"bridge"}, args, "bridge-" + std::to_string(id) + ".log");
    ASSERT_TRUE(bridge);
    bridges_.push_back(std::move(*bridge));
  }

  void start_node() {
    metrics_port_ = free_port();
    node_ = kvr_->start_node({.block_size = kBlockSize, .metrics_port = metrics_port_});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  std::string next_id() { return "req-" + std::to_string(++request_counter_); }

  // The first registration of `worker` the recorder has seen.
  static std::optional<v1::WorkerRegistration> registration_of(
      const testing::NatsRecorder& registrations, WorkerId worker) {
    for (const auto& message : registrations.messages()) {
      v1::WorkerRegistration registration;
      if (registration.ParseFromString(message.data) && registration.worker_id() == worker) {
        return registration;
      }
    }
    return std::nullopt;
  }

  // The first load report of `worker` among `loads`.
  static std::optional<v1::LoadMetrics> load_of(const testing::NatsRecorder& loads,
                                                WorkerId worker) {
    for (const auto& message : loads.messages()) {
      v1::LoadMetrics load;
      if (load.ParseFromString(message.data) && load.worker_id() == worker) return load;
    }
    return std::nullopt;
  }

  // How often `text` occurs in `log`.
  static std::size_t occurrences(const std::string& log, std::string_view text) {
    std::size_t count = 0;
    for (auto at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++count;
    return count;
  }

  std::optional<v1::RouteDecision> route(const std::vector<std::uint32_t>& tokens) {
    v1::RouteRequest request;
    request.set_request_id(next_id());
    request.set_model("mock-model");
    for (std::uint32_t token : tokens) request.mutable_tokens()->add_ids(token);
    // Each booking released (a late decision's too), so that probing leaves no load behind.
    if (!router_.is_open()) {
      EXPECT_TRUE(router_.open(*client_, kNamespace));
    }
    return router_.route(request, 2s);
  }

  testing::ReportingRouter router_;
  zmq::context_t context_;
  std::vector<ChildProcess> bridges_;
  std::optional<ChildProcess> node_;
  std::uint16_t metrics_port_ = 0;
  int request_counter_ = 0;
};

TEST_F(BridgeTest, RegistersPublishesLoadAndRoutesToTheEngineHoldingThePrefix) {
  StandInEngine first{context_};
  StandInEngine second{context_};
  testing::NatsRecorder registrations;
  ASSERT_TRUE(registrations.listen(*client_, subjects::worker_register(kNamespace)));
  testing::NatsRecorder loads;
  ASSERT_TRUE(loads.listen(*client_, subjects::every_load(kNamespace)));
  start_bridge(first, kFirstWorker);
  start_bridge(second, kFirstWorker + 1);

  // Registered with what the engine reported: model, block size and capacity from its metrics.
  v1::WorkerRegistration registration;
  ASSERT_TRUE(wait_until(
      [&] {
        for (const auto& message : registrations.messages()) {
          if (registration.ParseFromString(message.data) &&
              registration.worker_id() == kFirstWorker + 1) {
            return true;
          }
        }
        return false;
      },
      10s));
  EXPECT_EQ(registration.model(), "mock-model");
  EXPECT_EQ(registration.block_size(), kBlockSize);
  EXPECT_EQ(registration.total_kv_blocks(), 512U);
  EXPECT_TRUE(registration.publishes_kv_events());
  EXPECT_EQ(registration.dump_subject(), subjects::worker_dump(kNamespace, kFirstWorker + 1));

  // Load from vLLM's gauges: running 2 + waiting 3, 25 % of 512 blocks in use.
  std::optional<v1::LoadMetrics> load;
  ASSERT_TRUE(wait_until([&] { return (load = load_of(loads, kFirstWorker)).has_value(); }, 10s));
  ASSERT_EQ(load->ranks_size(), 1);
  EXPECT_EQ(load->ranks(0).active_requests(), 5U);
  EXPECT_EQ(load->ranks(0).waiting_requests(), 3U);
  EXPECT_EQ(load->ranks(0).kv_blocks_used(), 128U);

  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, std::nullopt, [&] { return next_id(); }, 20s))
      << node_->log();

  // The second engine stores a 128-token prompt; the node routes that prompt to it by overlap.
  // Sequence 0 is sent until the bridge has it (a SUB misses what a PUB sent before it joined);
  // the repeats are stale to the bridge.
  const auto tokens = prompt(128, 70'000);
  std::optional<v1::RouteDecision> decision;
  ASSERT_TRUE(wait_until(
      [&] {
        second.publish_stored(0, tokens);
        decision = route(tokens);
        return decision && decision->has_success() &&
               decision->success().device_overlap_blocks() >= 8;
      },
      15s))
      << node_->log();
  EXPECT_EQ(decision->success().worker_id(), kFirstWorker + 1);
  EXPECT_EQ(decision->success().device_overlap_blocks(), 8U);

  // The second engine stops answering /health: its bridge deregisters and the node routes the
  // prompt elsewhere; when it answers again it is registered anew.
  second.set_healthy(false);
  ASSERT_TRUE(wait_until(
      [&] {
        decision = route(tokens);
        return decision && decision->has_success() &&
               decision->success().worker_id() == kFirstWorker;
      },
      10s));
  EXPECT_EQ(decision->success().device_overlap_blocks(), 0U);
  second.set_healthy(true);
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker + 1, [&] { return next_id(); }, 10s));
}

TEST_F(BridgeTest, CountsMalformedFramesPayloadsAndUnknownRemovalsOnItsMetrics) {
  StandInEngine engine{context_};
  const std::uint16_t bridge_metrics = free_port();
  start_bridge(engine, kFirstWorker, bridge_metrics);
  auto bridge_metric = [&](const std::string& name) {
    return testing::metric(testing::http_get(bridge_metrics, "/metrics"), name);
  };
  ASSERT_TRUE(wait_until([&] { return bridge_metric("kvr_bridge_registered") == 1; }, 10s));
  EXPECT_TRUE(testing::http_get(bridge_metrics, "/healthz").starts_with("HTTP/1.1 200"));

  // Sequence 0 is sent until the bridge has it (a SUB misses what a PUB sent before it joined).
  const auto tokens = prompt(64, 1);
  ASSERT_TRUE(wait_until(
      [&] {
        engine.publish_stored(0, tokens);
        return bridge_metric("kvr_bridge_blocks_stored_total") == 4;
      },
      10s));
  EXPECT_EQ(bridge_metric("kvr_bridge_kv_batches_published_total"), 1);
  // Two frames; an 8-byte sequence missing; a payload that is no msgpack batch; a removal of an
  // engine hash the bridge never saw. None is fatal: each is counted and dropped.
  engine.publish_raw({"", encode_sequence(1)});
  engine.publish_raw({"", "1234", "\x93"});
  engine.publish_raw({"", encode_sequence(1), "\xc1 not msgpack"});
  engine.publish_removed(2, 123'456'789);
  // The stored blocks are still routed by: a removal of an unknown hash removes nothing.
  engine.publish_removed(3, -1000);
  ASSERT_TRUE(
      wait_until([&] { return bridge_metric("kvr_bridge_blocks_removed_total") == 1; }, 10s));
  EXPECT_EQ(bridge_metric("kvr_bridge_malformed_frames_total"), 2);
  EXPECT_EQ(bridge_metric("kvr_bridge_malformed_payloads_total"), 1);
  EXPECT_EQ(bridge_metric("kvr_bridge_unknown_removed_blocks_total"), 1);
  EXPECT_EQ(bridge_metric("kvr_bridge_sequence_gaps_total"), 0);
  EXPECT_EQ(bridge_metric("kvr_bridge_kv_batches_published_total"), 2);

  engine.set_healthy(false);
  ASSERT_TRUE(wait_until([&] { return bridge_metric("kvr_bridge_registered") == 0; }, 10s));
  EXPECT_TRUE(testing::http_get(bridge_metrics, "/healthz").starts_with("HTTP/1.1 503"));
}

TEST_F(BridgeTest, GenerateStreamsThroughTheBridgeFromTheEnginesCompletions) {
  StandInEngine engine{context_};
  start_bridge(engine, kFirstWorker);
  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s))
      << node_->log();

  testing::ChunkStream stream;
  ASSERT_TRUE(stream.open(*client_));
  v1::GenerateRequest request;
  request.mutable_route()->set_request_id("gen-1");
  request.mutable_route()->set_model("mock-model");
  for (std::uint32_t token : prompt(64, 1))
    request.mutable_route()->mutable_tokens()->add_ids(token);
  request.set_max_output_tokens(5);
  request.set_stream_subject(stream.subject());
  auto reply =
      client_->request(subjects::router_generate(kNamespace), request.SerializeAsString(), 5s);
  ASSERT_TRUE(reply) << reply.error();
  v1::RouteDecision decision;
  ASSERT_TRUE(decision.ParseFromString(reply->data));
  ASSERT_TRUE(decision.has_success()) << decision.DebugString();
  ASSERT_TRUE(wait_until([&] { return stream.finished(); }, 10s)) << node_->log();

  // The node relays the bridge's chunks unchanged: one per SSE event, the engine's token ids,
  // the cached tokens of the first, the finish reason of the last.
  const auto chunks = stream.chunks();
  ASSERT_EQ(chunks.size(), 5U);
  for (std::uint32_t i = 0; i < 5; ++i) {
    EXPECT_EQ(chunks[i].index(), i);
    EXPECT_EQ(chunks[i].worker_id(), kFirstWorker);
    ASSERT_EQ(chunks[i].token_ids_size(), 1);
    EXPECT_EQ(chunks[i].token_ids(0), 500 + i);
    EXPECT_FALSE(chunks[i].has_error());
  }
  EXPECT_EQ(chunks[0].cached_prompt_tokens(), 32U);
  EXPECT_TRUE(chunks[4].finished());
  EXPECT_EQ(chunks[4].finish_reason(), "length");
  EXPECT_EQ(engine.completions(), 1);
}

// A vLLM stand-in that publishes no vllm:cache_config_info, with --block-size but no
// --num-gpu-blocks: the bridge registers the worker without a capacity, says once what that
// disables, reports the load it knows, forwards KV events, and the node routes to it.
TEST_F(BridgeTest, AnEngineWithoutCacheConfigRegistersWithoutCapacityAndIsRouted) {
  StandInEngine engine{context_, /*cache_config=*/false};
  testing::NatsRecorder registrations;
  ASSERT_TRUE(registrations.listen(*client_, subjects::worker_register(kNamespace)));
  testing::NatsRecorder loads;
  ASSERT_TRUE(loads.listen(*client_, subjects::every_load(kNamespace)));
  start_bridge(engine, kFirstWorker, std::nullopt, {"--block-size", std::to_string(kBlockSize)});

  std::optional<v1::WorkerRegistration> registration;
  ASSERT_TRUE(wait_until(
      [&] { return (registration = registration_of(registrations, kFirstWorker)).has_value(); },
      10s))
      << bridges_.back().log();
  EXPECT_EQ(registration->block_size(), kBlockSize);
  EXPECT_EQ(registration->total_kv_blocks(), 0U) << "0: the engine did not say";
  // Load as far as the engine's gauges go: requests, and no KV blocks without a capacity.
  std::optional<v1::LoadMetrics> load;
  ASSERT_TRUE(wait_until([&] { return (load = load_of(loads, kFirstWorker)).has_value(); }, 10s));
  ASSERT_EQ(load->ranks_size(), 1);
  EXPECT_EQ(load->ranks(0).active_requests(), 5U);
  EXPECT_EQ(load->ranks(0).kv_blocks_used(), 0U);

  start_node();
  ASSERT_TRUE(testing::wait_until_routable(
      *client_, kNamespace, kFirstWorker, [&] { return next_id(); }, 20s))
      << node_->log();
  // KV events are forwarded as for any worker: the node routes the stored prompt by its overlap.
  const auto tokens = prompt(128, 80'000);
  std::optional<v1::RouteDecision> decision;
  ASSERT_TRUE(wait_until(
      [&] {
        engine.publish_stored(0, tokens);
        decision = route(tokens);
        return decision && decision->has_success() &&
               decision->success().device_overlap_blocks() == 8;
      },
      15s))
      << node_->log();
  EXPECT_EQ(decision->success().worker_id(), kFirstWorker);
  EXPECT_EQ(decision->success().worker_http_url(), engine.url());

  const std::string log = bridges_.back().log();
  EXPECT_EQ(occurrences(log, "is registered without one"), 1U) << log;
  EXPECT_NE(log.find("unknown KV blocks per rank"), std::string::npos) << log;
  EXPECT_EQ(log.find("reports no KV block size"), std::string::npos) << log;
}

// Without a block size (no vllm:cache_config_info, no --block-size) routers cannot hash prompts:
// the bridge does not register, and says why once per 5 s, not at every probe (every 50 ms).
TEST_F(BridgeTest, WithoutABlockSizeTheBridgeDoesNotRegisterAndSaysWhyRateLimited) {
  StandInEngine engine{context_, /*cache_config=*/false};
  testing::NatsRecorder registrations;
  ASSERT_TRUE(registrations.listen(*client_, subjects::worker_register(kNamespace)));
  const auto started = std::chrono::steady_clock::now();
  start_bridge(engine, kFirstWorker);
  ASSERT_TRUE(wait_until([&] { return engine.models_requests() >= 20; }, 20s));
  ASSERT_TRUE(wait_until(
      [&] { return occurrences(bridges_.back().log(), "reports no KV block size") >= 1; }, 10s))
      << bridges_.back().log();
  const auto elapsed = std::chrono::steady_clock::now() - started;
  const std::string log = bridges_.back().log();
  // At most one line per 5 s window since the start, however many probes asked.
  const auto windows = static_cast<std::size_t>(elapsed / 5s) + 1;
  EXPECT_LE(occurrences(log, "reports no KV block size"), windows) << log;
  EXPECT_NE(log.find("pass --block-size"), std::string::npos) << log;
  EXPECT_FALSE(registration_of(registrations, kFirstWorker)) << "registered without a block size";
}

}  // namespace
}  // namespace kvr
