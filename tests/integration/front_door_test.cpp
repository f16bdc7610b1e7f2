// The node's OpenAI-compatible HTTP API end to end, all real processes: nats-server, `kvr node
// --http-port`, and `kvr bridge`s in front of `kvr mocker --speak vllm` engines (vLLM's HTTP API,
// render and tokenize endpoints, KV events). Shown: models and health follow the live workers;
// chat and completions are rendered by an engine, routed, forwarded and answered (whole and
// streamed); a repeated long prompt lands on the engine that caches it; every error is an OpenAI
// error object with its status; a client that goes away cancels the engine's request and releases
// the booking; a killed engine fails only its own streams, and a request routed to it is retried
// on another engine. Workers without an HTTP URL (`kvr mocker`) are served through the node's
// generate API with the model's tokenizer, or refused with a reason.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/kvr_cluster_test.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"
#include "tests/testing/tokenizer_data.hpp"
#include "tests/testing/vllm_engines.hpp"

namespace kvr {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::EnginePair;
using testing::free_port;
using testing::wait_until;

constexpr std::string_view kNamespace = "front-door";
constexpr WorkerId kFirstWorker = 700;
constexpr std::uint32_t kBlockSize = 16;

// One HTTP answer, read whole.
struct Answer {
  int status = 0;
  httplib::Headers headers;
  std::string body;
  Json json() const { return Json::parse(body, nullptr, false); }
  std::string header(const std::string& name) const {
    const auto found = headers.find(name);
    return found == headers.end() ? std::string{} : found->second;
  }
};

// The `data:` payloads of a Server-Sent Events body.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> events;
  std::size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const std::size_t end = body.find("\n\n", at);
    if (end == std::string::npos) break;
    events.push_back(body.substr(at + 6, end - at - 6));
    at = end + 2;
  }
  return events;
}

// A streamed completion read on a thread of its own: the answer's worker and body as they come.
class BackgroundStream {
 public:
  BackgroundStream(std::uint16_t port, const Json& request)
      : thread_{[this, port, body = request.dump()] {
          httplib::Client http{"127.0.0.1", port};
          http.set_read_timeout(30s);
          httplib::Request post;
          post.method = "POST";
          post.path = "/v1/completions";
          post.body = body;
          post.set_header("Content-Type", "application/json");
          post.response_handler = [this](const httplib::Response& response) {
            std::lock_guard lock{mutex_};
            worker_ = response.get_header_value("x-kvr-worker-id");
            headers_ = true;
            return true;
          };
          post.content_receiver = [this](const char* data, std::size_t size, std::uint64_t,
                                         std::uint64_t) {
            std::lock_guard lock{mutex_};
            body_.append(data, size);
            return true;
          };
          (void)http.send(post);
          done_ = true;
        }} {}
  ~BackgroundStream() { join(); }

  bool headers() const { return headers_; }
  bool done() const { return done_; }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  std::string worker() const {
    std::lock_guard lock{mutex_};
    return worker_;
  }
  std::string body() const {
    std::lock_guard lock{mutex_};
    return body_;
  }

 private:
  mutable std::mutex mutex_;
  std::string worker_;
  std::string body_;
  std::atomic<bool> headers_{false};
  std::atomic<bool> done_{false};
  std::thread thread_;  // last: it starts once the rest exists
};

// A long system prompt: its blocks are what a repeated request finds cached.
Json long_chat(const std::string& topic, std::string_view extra = {}) {
  std::string system;
  for (int i = 0; i < 40; ++i) system += "You are a careful assistant for " + topic + ". ";
  return Json{{"model", "mock-model"},
              {"max_tokens", 4},
              {"messages",
               {{{"role", "system"}, {"content", system}},
                {{"role", "user"}, {"content", "Tell me about " + topic + std::string{extra}}}}}};
}

// A streamed completion that runs far longer than any test (its receiver is set by the caller).
httplib::Request long_streamed_completion() {
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/completions";
  request.body =
      Json{{"model", "mock-model"}, {"prompt", {1, 2, 3}}, {"max_tokens", 20000}, {"stream", true}}
          .dump();
  request.set_header("Content-Type", "application/json");
  return request;
}

class FrontDoorTest : public testing::KvrClusterTest {
 protected:
  FrontDoorTest() : KvrClusterTest(kvr::testing::kvr_binary(), std::string{kNamespace}) {}

  void TearDown() override {
    if (HasFailure()) {
      if (node_) std::cerr << "---- node log\n" << node_->log();
      if (mocker_) std::cerr << "---- mocker log\n" << mocker_->log();
      std::cerr << testing::engine_pair_logs(pairs_);
    }
  }

  EnginePair& start_pair(WorkerId worker, const std::string& time_scale = "20",
                         std::uint64_t num_gpu_blocks = 2048,
                         const std::string& load_interval_ms = "50") {
    auto pair = testing::start_engine_pair(*kvr_, {.worker = worker,
                                                   .block_size = kBlockSize,
                                                   .num_gpu_blocks = num_gpu_blocks,
                                                   .time_scale = time_scale,
                                                   .load_interval_ms = load_interval_ms});
    EXPECT_TRUE(pair) << pair.error();
    if (!pair) pair = std::make_unique<EnginePair>();
    pairs_.push_back(std::move(*pair));
    return *pairs_.back();
  }

  void start_node(std::vector<std::string> extra = {}) {
    metrics_port_ = free_port();
    http_port_ = free_port();
    extra.insert(extra.end(), {"--http-port", std::to_string(http_port_)});
    node_ = kvr_->start_node(
        {.block_size = kBlockSize, .metrics_port = metrics_port_, .extra = std::move(extra)});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::wait_until_healthy(metrics_port_, 20s)) << node_->log();
  }

  // Waits until the front door sees `workers` live workers' model (and /health says ready).
  void wait_until_ready() {
    ASSERT_TRUE(wait_until([&] { return get("/health").status == 200; }, 20s));
  }

  httplib::Client client() const {
    httplib::Client http{"127.0.0.1", http_port_};
    http.set_read_timeout(30s);
    return http;
  }

  Answer get(const std::string& path) const {
    auto http = client();
    const auto result = http.Get(path);
    if (!result) return {};
    return Answer{result->status, result->headers, result->body};
  }

  Answer post(const std::string& path, const std::string& body,
              const httplib::Headers& headers = {}) const {
    indexed_before_last_post_ = node_metric("kvr_index_blocks");
    auto http = client();
    const auto result = http.Post(path, headers, body, "application/json");
    if (!result) return {};
    return Answer{result->status, result->headers, result->body};
  }

  // Posts a chat until the node predicts cached tokens for it (the engine's KV events reached the
  // node), for at most 10 s; the last answer.
  Answer post_until_predicted_cached(const std::string& body) const {
    // Not before the last answer's blocks reach the index: a repeat sent earlier could be routed
    // to another worker, which would then cache the prompt too.
    const double indexed_before = indexed_before_last_post_;
    wait_until([&] { return node_metric("kvr_index_blocks") > indexed_before; }, 10s);
    Answer again;
    wait_until(
        [&] {
          again = post("/v1/chat/completions", body);
          return again.status == 200 && std::stoull(again.header("x-kvr-cached-tokens")) > 0;
        },
        10s);
    return again;
  }

  // A node with `tokenizer` for mock-model, and two `kvr mocker` workers (no HTTP URL).
  void start_node_with_mockers(const std::string& tokenizer) {
    start_node({"--tokenizer", "mock-model=" + tokenizer});
    mocker_ = kvr_->start_mocker({.workers = 2,
                                  .worker_id_base = kFirstWorker,
                                  .block_size = kBlockSize,
                                  .time_scale = "20"});
    ASSERT_TRUE(mocker_);
    wait_until_ready();
    ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  }

  // OpenAI's Node.js client lists the models, streams a chat and a completion, and finds a
  // repeated long prompt cached (tests/clients/openai/front_door_client.mjs).
  void run_official_client();

  double node_metric(const std::string& name) const {
    return testing::metric(testing::http_get(metrics_port_, "/metrics"), name);
  }

  double engine_metric(const EnginePair& pair, const std::string& name) const {
    return testing::metric(testing::http_get(pair.http_port, "/metrics"), name);
  }

  std::vector<std::unique_ptr<EnginePair>> pairs_;
  // The node's KV index size when the last post began (post_until_predicted_cached waits past it).
  mutable double indexed_before_last_post_ = 0;
  std::optional<testing::ChildProcess> node_;
  std::optional<testing::ChildProcess> mocker_;
  std::uint16_t metrics_port_ = 0;
  std::uint16_t http_port_ = 0;
};

TEST_F(FrontDoorTest, ModelsAndHealthFollowTheLiveWorkers) {
  start_node();
  EXPECT_EQ(get("/health").status, 503);
  EXPECT_EQ(get("/v1/models").json()["data"], Json::array());
  start_pair(kFirstWorker);
  wait_until_ready();
  const Json models = get("/v1/models").json();
  EXPECT_EQ(models["object"], "list");
  ASSERT_EQ(models["data"].size(), 1u);
  EXPECT_EQ(models["data"][0]["id"], "mock-model");
  EXPECT_EQ(models["data"][0]["object"], "model");
  // A deregistered worker leaves: its bridge stops cleanly.
  pairs_.front()->bridge->stop();
  EXPECT_TRUE(wait_until([&] { return get("/health").status == 503; }, 10s));
  EXPECT_EQ(get("/v1/models").json()["data"], Json::array());
}

TEST_F(FrontDoorTest, ARepeatedLongChatPromptLandsOnTheEngineThatCachesIt) {
  start_node();
  start_pair(kFirstWorker);
  start_pair(kFirstWorker + 1);
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  const std::string body = long_chat("routers").dump();
  const Answer first = post("/v1/chat/completions", body);
  ASSERT_EQ(first.status, 200) << first.body;
  const Json first_json = first.json();
  EXPECT_EQ(first_json["object"], "chat.completion");
  EXPECT_EQ(first_json["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(first_json["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const std::string worker = first.header("x-kvr-worker-id");
  ASSERT_FALSE(worker.empty());
  EXPECT_FALSE(first.header("x-kvr-request-id").empty());
  // Once the engine's KV events reached the node, the same prompt goes back to it and hits.
  const Answer again = post_until_predicted_cached(body);
  ASSERT_EQ(again.status, 200) << again.body;
  ASSERT_GT(std::stoull(again.header("x-kvr-cached-tokens")), 0u) << again.body;
  EXPECT_EQ(again.header("x-kvr-worker-id"), worker);
  const std::uint64_t cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, 0u);
  // The node predicted what the engine found: whole blocks of the same tokens.
  EXPECT_EQ(std::stoull(again.header("x-kvr-cached-tokens")), cached);
  // Rendered by an engine once per request: the node's token ids are the engine's own.
  EXPECT_GE(node_metric("kvr_http_render_calls_total{endpoint=\"/v1/chat/completions/render\","
                        "outcome=\"ok\""),
            2);
}

TEST_F(FrontDoorTest, AnEstimateModeModelIsRoutedOnItsTextWithoutAskingAnEngine) {
  // The mode comes from the router-policy YAML's `models`, over the flag's default (engine).
  const auto config = directory_.path() / "policy.yaml";
  std::ofstream{config} << "models:\n  mock-model: {tokenizer_mode: estimate}\n";
  start_node({"--router-policy-config", config.string(), "--tokenizer-mode", "engine"});
  // The repeats' placements follow from the text index and the node's own bookings: a /metrics
  // scrape taken while a first request ran but applied after it ended would count it again
  // until the next scrape (docs/protocol.md, LoadMetrics), so the bridges scrape once.
  start_pair(kFirstWorker, "20", 2048, "60000");
  start_pair(kFirstWorker + 1, "20", 2048, "60000");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  const std::vector<std::string> topics{"routers", "caches", "engines", "tokens"};
  std::map<std::string, std::string> first_worker;
  for (const std::string& topic : topics) {
    const Answer first = post("/v1/chat/completions", long_chat(topic).dump());
    ASSERT_EQ(first.status, 200) << first.body;
    EXPECT_EQ(first.header("x-kvr-cached-tokens"), "0");
    first_worker[topic] = first.header("x-kvr-worker-id");
  }
  // Each repeat finds its text where the router sent it (no KV event is needed: the decision
  // itself filled the text index), and the engine there has the prompt cached.
  for (const std::string& topic : topics) {
    const Answer again = post("/v1/chat/completions", long_chat(topic, "?").dump());
    ASSERT_EQ(again.status, 200) << again.body;
    EXPECT_EQ(again.header("x-kvr-worker-id"), first_worker[topic]) << topic;
    EXPECT_GT(std::stoull(again.header("x-kvr-cached-tokens")), 0u) << topic;
    EXPECT_GT(again.json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<std::uint64_t>(),
              0u)
        << topic;
  }
  EXPECT_EQ(node_metric("kvr_http_render_calls_total"), 0);
}

// The bundled Qwen3 tokenizer (unpacked at configure), which both the node and the engines use
// in the native-mode tests; empty when the tests run without it.
std::string qwen3_tokenizer() {
  const char* dir = kvr::testing::bundled_tokenizers_dir();
  return dir == nullptr ? std::string{} : std::string{dir} + "/qwen3";
}

TEST_F(FrontDoorTest, TheNativeModeTokenizesInTheNodeOnceAnEngineAgrees) {
  const std::string tokenizer = qwen3_tokenizer();
  if (tokenizer.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  start_node({"--tokenizer-mode", "native", "--tokenizer", "mock-model=" + tokenizer});
  for (WorkerId worker : {kFirstWorker, kFirstWorker + 1}) {
    auto pair = testing::start_engine_pair(
        *kvr_,
        {.worker = worker, .block_size = kBlockSize, .engine_args = {"--tokenizer", tokenizer}});
    ASSERT_TRUE(pair) << pair.error();
    pairs_.push_back(std::move(*pair));
  }
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  // The parity check runs as the model's first engines register, before any request.
  ASSERT_TRUE(wait_until(
      [&] { return node_metric("kvr_tokenizer_parity{model=\"mock-model\"}") == 1; }, 20s))
      << node_->log();
  const double engine_renders = node_metric("kvr_http_render_calls_total");
  const std::string body = long_chat("natively tokenized routers").dump();
  const Answer first = post("/v1/chat/completions", body);
  ASSERT_EQ(first.status, 200) << first.body;
  const Answer again = post_until_predicted_cached(body);
  ASSERT_EQ(again.status, 200) << again.body;
  ASSERT_GT(std::stoull(again.header("x-kvr-cached-tokens")), 0u) << again.body;
  EXPECT_EQ(again.header("x-kvr-worker-id"), first.header("x-kvr-worker-id"));
  // The node's ids are the engine's: what it predicted cached is what the engine found.
  EXPECT_EQ(std::stoull(again.header("x-kvr-cached-tokens")),
            again.json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<std::uint64_t>());
  // The hit-rate ladder counts what the engines reported in usage.
  EXPECT_GT(node_metric("kvr_engine_cached_tokens_total{model=\"mock-model\"}"), 0);
  EXPECT_GT(node_metric("kvr_prompt_tokens_total{model=\"mock-model\"}"),
            node_metric("kvr_engine_cached_tokens_total{model=\"mock-model\"}"));
  // No engine rendered these prompts: the node tokenized them itself.
  EXPECT_EQ(node_metric("kvr_http_render_calls_total"), engine_renders);
  EXPECT_GE(node_metric("kvr_native_renders_total{model=\"mock-model\",outcome=\"ok\"}"), 2);
  const Answer completion =
      post("/v1/completions", Json{{"model", "mock-model"}, {"prompt", "Hello, world!"}}.dump());
  EXPECT_EQ(completion.status, 200) << completion.body;
}

// `kvr mocker` workers register no HTTP URL: the node tokenizes with the model's tokenizer, serves
// through its generate API over NATS, and decodes the chunks into OpenAI's answer.
TEST_F(FrontDoorTest, WorkersWithoutAnHttpUrlAreServedThroughTheGenerateApi) {
  const std::string tokenizer = qwen3_tokenizer();
  if (tokenizer.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  start_node_with_mockers(tokenizer);
  if (HasFatalFailure()) return;

  const std::string body = long_chat("generated answers").dump();
  const Answer first = post("/v1/chat/completions", body);
  ASSERT_EQ(first.status, 200) << first.body;
  const Json answer = first.json();
  EXPECT_EQ(answer["object"], "chat.completion");
  EXPECT_EQ(answer["model"], "mock-model");
  EXPECT_EQ(answer["choices"][0]["message"]["role"], "assistant");
  EXPECT_TRUE(answer["choices"][0]["message"]["content"].is_string());
  EXPECT_EQ(answer["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(answer["usage"]["completion_tokens"], 4);
  EXPECT_GT(answer["usage"]["prompt_tokens"].get<int>(), 300);  // the long system prompt
  EXPECT_FALSE(first.header("x-kvr-worker-id").empty());
  // The same prompt again reaches the worker that caches it, and the worker says so.
  const Answer again = post_until_predicted_cached(body);
  ASSERT_EQ(again.status, 200) << again.body;
  EXPECT_EQ(again.header("x-kvr-worker-id"), first.header("x-kvr-worker-id"));
  EXPECT_GT(again.json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 0)
      << again.body;

  // A streamed completion: text events, the finish reason, usage, [DONE].
  const Answer streamed =
      post("/v1/completions", Json{{"model", "mock-model"},
                                   {"prompt", "Once upon a time"},
                                   {"max_tokens", 6},
                                   {"stream", true},
                                   {"stream_options", {{"include_usage", true}}}}
                                  .dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_EQ(streamed.header("Content-Type"), "text/event-stream");
  const auto events = sse_data(streamed.body);
  ASSERT_GE(events.size(), 3u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  const Json usage = Json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6) << streamed.body;
  const Json last = Json::parse(events[events.size() - 3]);
  EXPECT_EQ(last["object"], "text_completion");
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");

  // A client that goes away mid-stream cancels the generation and its booking ends.
  {
    auto http = client();
    httplib::Request request = long_streamed_completion();
    std::atomic<bool> first_event{false};
    request.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) {
      first_event = true;
      return false;  // httplib closes the connection
    };
    (void)http.send(request);
    ASSERT_TRUE(first_event.load());
  }
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_generate_in_flight") == 0; }, 5s));
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_bookings_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_http_clients_gone_total"), 1);
}

// A model of prefill and decode engines behind bridges: the front door serves it through the
// node's generate API, which takes the prefill hop (the bridge sends vLLM's do_remote_decode
// without streaming and returns the engine's kv_transfer_params) and then the decode hop (the
// decode engine pulls the KV and streams).
TEST_F(FrontDoorTest, APrefillAndADecodeEngineBehindBridgesServeOneAnswer) {
  const std::string tokenizer = qwen3_tokenizer();
  if (tokenizer.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  start_node({"--tokenizer", "mock-model=" + tokenizer});
  const auto start_role = [&](WorkerId worker, const std::string& role) {
    auto pair = testing::start_engine_pair(
        *kvr_, {.worker = worker, .block_size = kBlockSize, .bridge_args = {"--role", role}});
    ASSERT_TRUE(pair) << pair.error();
    pairs_.push_back(std::move(*pair));
  };
  start_role(kFirstWorker, "prefill");
  start_role(kFirstWorker + 1, "decode");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));

  const Answer answer = post("/v1/chat/completions", long_chat("two hops").dump());
  ASSERT_EQ(answer.status, 200) << answer.body << testing::engine_pair_logs(pairs_);
  const Json json = answer.json();
  EXPECT_EQ(json["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(json["usage"]["completion_tokens"], 4);
  EXPECT_EQ(node_metric("kvr_disaggregation_decisions_total{partition=\"mock-model/default\","
                        "reason=\"disaggregated\"}"),
            1);
  EXPECT_EQ(node_metric("kvr_prefill_hop_seconds_count{model=\"mock-model\"}"), 1);
  // The prefill engine answered one token; the decode engine generated the answer.
  // (Each engine counts its tokens as its step ends, which may follow the answer by a moment.)
  EXPECT_TRUE(wait_until(
      [&] { return engine_metric(*pairs_[0], "vllm:generation_tokens_total") == 1; }, 5s));
  EXPECT_TRUE(wait_until(
      [&] { return engine_metric(*pairs_[1], "vllm:generation_tokens_total") == 4; }, 5s));
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_bookings_open") == 0; }, 5s));
}

TEST_F(FrontDoorTest, WorkersWithoutAnHttpUrlNeedATokenizerAndSaySo) {
  start_node();
  auto mocker = kvr_->start_mocker({.workers = 1, .block_size = kBlockSize});
  ASSERT_TRUE(mocker);
  wait_until_ready();
  const Answer refused = post("/v1/completions", R"({"model":"mock-model","prompt":[1,2,3]})");
  EXPECT_EQ(refused.status, 503) << refused.body;
  const Json error = refused.json()["error"];
  EXPECT_EQ(error["code"], "service_unavailable");
  EXPECT_NE(error["message"].get<std::string>().find("--tokenizer mock-model=DIR"),
            std::string::npos)
      << refused.body;
}

TEST_F(FrontDoorTest, ANativeTokenizerThatDisagreesWithTheEnginesFallsBackToTheEngineMode) {
  const std::string tokenizer = qwen3_tokenizer();
  if (tokenizer.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  // The engines keep the mock tokenizer: their ids are not Qwen3's.
  start_node({"--tokenizer-mode", "native", "--tokenizer", "mock-model=" + tokenizer});
  start_pair(kFirstWorker);
  start_pair(kFirstWorker + 1);
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  ASSERT_TRUE(wait_until(
      [&] {
        return node_->log().find("TOKENIZER MISMATCH") != std::string::npos &&
               testing::http_get(metrics_port_, "/metrics")
                       .find("kvr_tokenizer_parity{model=\"mock-model\"} 0") != std::string::npos;
      },
      20s))
      << node_->log();
  // Served as in the engine mode: rendered by the engines, and the repeat hits the cache.
  const std::string body = long_chat("engine-rendered routers").dump();
  const double renders_before = node_metric("kvr_http_render_calls_total");
  ASSERT_EQ(post("/v1/chat/completions", body).status, 200);
  const Answer again = post_until_predicted_cached(body);
  ASSERT_EQ(again.status, 200) << again.body;
  ASSERT_GT(std::stoull(again.header("x-kvr-cached-tokens")), 0u) << again.body;
  EXPECT_GT(node_metric("kvr_http_render_calls_total"), renders_before);
  EXPECT_EQ(node_metric("kvr_native_renders_total"), 0);
}

TEST_F(FrontDoorTest, ALoraAdapterIsRoutedInItsBaseModelToTheEnginesThatServeIt) {
  start_node();
  // Only the first engine serves the adapter; its bridge registers it from /v1/models.
  auto with_adapter =
      testing::start_engine_pair(*kvr_, {.worker = kFirstWorker,
                                         .block_size = kBlockSize,
                                         .engine_args = {"--lora-adapter", "sql-lora"}});
  ASSERT_TRUE(with_adapter) << with_adapter.error();
  pairs_.push_back(std::move(*with_adapter));
  start_pair(kFirstWorker + 1);
  wait_until_ready();
  ASSERT_TRUE(wait_until(
      [&] {
        const Json data = get("/v1/models").json()["data"];
        return data.size() == 2 && data[1]["id"] == "sql-lora";
      },
      10s));
  const Json models = get("/v1/models").json()["data"];
  EXPECT_EQ(models[0]["id"], "mock-model");
  EXPECT_EQ(models[1]["parent"], "mock-model");

  Json request = long_chat("queries");
  request["model"] = "sql-lora";
  const Answer first = post("/v1/chat/completions", request.dump());
  ASSERT_EQ(first.status, 200) << first.body;
  EXPECT_EQ(first.header("x-kvr-worker-id"), std::to_string(kFirstWorker));
  EXPECT_EQ(first.json()["model"], "sql-lora");
  // The adapter's blocks come back in its cache namespace: a repeat is predicted to hit, and does.
  const Answer again = post_until_predicted_cached(request.dump());
  ASSERT_EQ(again.status, 200) << again.body;
  ASSERT_GT(std::stoull(again.header("x-kvr-cached-tokens")), 0u) << again.body;
  EXPECT_EQ(again.header("x-kvr-worker-id"), std::to_string(kFirstWorker));
  EXPECT_EQ(std::stoull(again.header("x-kvr-cached-tokens")),
            again.json()["usage"]["prompt_tokens_details"]["cached_tokens"].get<std::uint64_t>());
  // The same prompt on the base model shares nothing with the adapter's cache.
  request["model"] = "mock-model";
  const Answer base = post("/v1/chat/completions", request.dump());
  ASSERT_EQ(base.status, 200) << base.body;
  EXPECT_EQ(base.header("x-kvr-cached-tokens"), "0");
  // A name no live worker serves, as model or adapter, is still unknown.
  request["model"] = "other-lora";
  EXPECT_EQ(post("/v1/chat/completions", request.dump()).status, 404);
}

TEST_F(FrontDoorTest, StreamsChatAndCompletionsWithUsage) {
  start_node();
  start_pair(kFirstWorker);
  wait_until_ready();
  Json chat = long_chat("streams");
  chat["stream"] = true;
  chat["stream_options"] = {{"include_usage", true}};
  const Answer streamed = post("/v1/chat/completions", chat.dump());
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_TRUE(streamed.header("Content-Type").starts_with("text/event-stream"));
  const auto events = sse_data(streamed.body);
  ASSERT_GE(events.size(), 3u) << streamed.body;
  EXPECT_EQ(events.back(), "[DONE]");
  const Json usage = Json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["choices"], Json::array());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 4);
  EXPECT_EQ(Json::parse(events.front())["object"], "chat.completion.chunk");

  const Json completion = {{"model", "mock-model"},
                           {"prompt", "Once upon a time, a router"},
                           {"max_tokens", 3},
                           {"stream", true}};
  const Answer text = post("/v1/completions", completion.dump());
  ASSERT_EQ(text.status, 200) << text.body;
  const auto text_events = sse_data(text.body);
  ASSERT_EQ(text_events.size(), 4u) << text.body;
  EXPECT_EQ(Json::parse(text_events[2])["choices"][0]["finish_reason"], "length");
  // Prompts of token ids need no render call.
  const double renders = node_metric("kvr_http_render_calls_total");
  const Answer ids =
      post("/v1/completions",
           Json{{"model", "mock-model"}, {"prompt", {5, 6, 7}}, {"max_tokens", 2}}.dump());
  ASSERT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(ids.json()["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(node_metric("kvr_http_render_calls_total"), renders);
  // Bookings end with their answers.
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

TEST_F(FrontDoorTest, EveryErrorIsAnOpenAiErrorObject) {
  start_node({"--http-max-body-bytes", "4096", "--router-max-open-bookings", "1"});
  start_pair(kFirstWorker, "0.2");
  wait_until_ready();
  const auto expect_error = [](const Answer& answer, int status, const std::string& code,
                               const std::string& param = {}) {
    EXPECT_EQ(answer.status, status) << answer.body;
    const Json error = answer.json()["error"];
    ASSERT_TRUE(error.is_object()) << answer.body;
    EXPECT_TRUE(error["message"].is_string());
    EXPECT_TRUE(error["type"].is_string());
    if (code.empty()) {
      EXPECT_TRUE(error["code"].is_null()) << answer.body;
    } else {
      EXPECT_EQ(error["code"], code) << answer.body;
    }
    if (!param.empty()) {
      EXPECT_EQ(error["param"], param) << answer.body;
    }
  };
  expect_error(post("/v1/chat/completions", "{not json"), 400, "");
  expect_error(post("/v1/chat/completions", R"({"model":"mock-model"})"), 400, "", "messages");
  expect_error(post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})"), 400,
               "", "model");
  expect_error(post("/v1/completions", R"({"model":"mock-model","prompt":"x","stream":"yes"})"),
               400, "", "stream");
  expect_error(post("/v1/completions", R"({"model":"mock-model","prompt":"x"})",
                    {{"x-kvr-priority", "high"}}),
               400, "", "x-kvr-priority");
  expect_error(post("/v1/completions", R"({"model":"no-such-model","prompt":"x"})"), 404,
               "model_not_found", "model");
  expect_error(post("/v1/completions", std::string(8192, ' ')), 413, "request_too_large");
  expect_error(post("/v1/embeddings", "{}"), 404, "unknown_url");
  expect_error(get("/v1/chat/completions"), 405, "");
  // The engine refuses what it cannot serve; its answer comes back as it is.
  const Answer refused =
      post("/v1/completions", R"({"model":"mock-model","prompt":[1,2],"temperature":"hot"})");
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_TRUE(refused.json()["error"]["message"].get<std::string>().find("temperature") !=
              std::string::npos)
      << refused.body;
  // One open booking at most: a second request while a stream runs is refused (503).
  auto streaming = client();
  std::atomic<bool> started{false};
  std::atomic<bool> stop{false};
  std::thread holder{[&] {
    httplib::Request request = long_streamed_completion();
    request.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) {
      started = true;
      return !stop.load();
    };
    (void)streaming.send(request);
  }};
  ASSERT_TRUE(wait_until([&] { return started.load(); }, 10s));
  expect_error(post("/v1/completions", R"({"model":"mock-model","prompt":[4,5,6]})"), 503,
               "service_unavailable");
  stop = true;
  holder.join();
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

TEST_F(FrontDoorTest, AdmissionRateLimitsAre429) {
  const auto config = directory_.path() / "policy.yaml";
  {
    std::ofstream yaml{config};
    yaml << "request_classifier:\n  type: token-bucket\n  parameters:\n"
            "    rate_tokens_per_s: 1\n    burst_tokens: 10\n    mode: reject\n";
  }
  start_node({"--router-policy-config", config.string()});
  start_pair(kFirstWorker);
  wait_until_ready();
  const std::string body = R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1})";
  EXPECT_EQ(post("/v1/completions", body, {{"x-kvr-tenant", "a"}}).status, 200);
  const Answer limited = post("/v1/completions", body, {{"x-kvr-tenant", "a"}});
  EXPECT_EQ(limited.status, 429) << limited.body;
  EXPECT_EQ(limited.json()["error"]["code"], "rate_limit_exceeded");
  // 8 tokens were taken from the 10, and 8 more refill at 1 token/s: the 6 missing take 6 s.
  EXPECT_EQ(limited.header("retry-after"), "6");
  // Another tenant has its own bucket; OpenAI's `user` names the tenant without the header.
  EXPECT_EQ(post("/v1/completions",
                 R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1,"user":"b"})")
                .status,
            200);
}

TEST_F(FrontDoorTest, AnEngineWithoutFirstByteInTimeIs504) {
  start_node({"--router-first-token-timeout-ms", "300"});
  // So slow that no first token comes within the timeout, on either engine.
  start_pair(kFirstWorker, "0.001");
  start_pair(kFirstWorker + 1, "0.001");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  const Answer timed_out = post(
      "/v1/completions", R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1})");
  EXPECT_EQ(timed_out.status, 504) << timed_out.body;
  EXPECT_EQ(timed_out.json()["error"]["code"], "timeout");
  // Tried on each engine once.
  EXPECT_EQ(node_metric("kvr_http_retries_total"), 1);
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

TEST_F(FrontDoorTest, TheRetriesOfAFailedEngineAreTheNodesSetting) {
  start_node({"--router-first-token-timeout-ms", "300", "--router-max-retries", "0"});
  start_pair(kFirstWorker, "0.001");
  start_pair(kFirstWorker + 1, "0.001");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  const Answer timed_out = post(
      "/v1/completions", R"({"model":"mock-model","prompt":[1,2,3,4,5,6,7,8],"max_tokens":1})");
  EXPECT_EQ(timed_out.status, 504) << timed_out.body;
  // No retry: the other engine was never tried.
  EXPECT_EQ(node_metric("kvr_http_retries_total"), 0);
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

TEST_F(FrontDoorTest, AClientThatGoesAwayCancelsTheEngineRequestAndReleasesTheBooking) {
  start_node();
  EnginePair& pair = start_pair(kFirstWorker, "1");
  wait_until_ready();
  std::atomic<bool> first_event{false};
  std::chrono::steady_clock::time_point gone;
  {
    auto http = client();
    httplib::Request request = long_streamed_completion();
    request.content_receiver = [&](const char*, std::size_t, std::uint64_t, std::uint64_t) {
      first_event = true;
      gone = std::chrono::steady_clock::now();
      return false;  // httplib closes the connection
    };
    (void)http.send(request);
  }
  ASSERT_TRUE(first_event.load());
  EXPECT_TRUE(
      wait_until([&] { return engine_metric(pair, "vllm:num_requests_running") == 0; }, 5s));
  const auto seen = std::chrono::steady_clock::now() - gone;
  std::cout << "the engine saw the client leave within "
            << std::chrono::duration_cast<std::chrono::milliseconds>(seen).count() << " ms\n";
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
  EXPECT_EQ(node_metric("kvr_http_clients_gone_total"), 1);
  EXPECT_EQ(node_metric("kvr_lifecycle_reports_total{event=\"aborted\",accepted=\"true\""), 1);
}

TEST_F(FrontDoorTest, AKilledEngineFailsOnlyItsOwnStreams) {
  start_node();
  start_pair(kFirstWorker, "1");
  start_pair(kFirstWorker + 1, "1");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  // Streams until each engine serves at least one (kv-cost spreads a busy fleet's load).
  std::vector<std::unique_ptr<BackgroundStream>> streams;
  std::set<std::string> workers;
  for (int i = 0; i < 8 && workers.size() < 2; ++i) {
    streams.push_back(std::make_unique<BackgroundStream>(
        http_port_, Json{{"model", "mock-model"},
                         {"prompt", testing::prompt(64, 1000 * (i + 1))},
                         {"max_tokens", i % 2 == 0 ? 3000 : 3001},
                         {"stream", true}}));
    ASSERT_TRUE(wait_until([&] { return streams.back()->headers(); }, 10s));
    workers.insert(streams.back()->worker());
  }
  ASSERT_EQ(workers.size(), 2u);
  EnginePair& killed = *pairs_.front();
  killed.engine->signal(SIGKILL);
  const std::string killed_id = std::to_string(killed.worker);
  for (auto& stream : streams) {
    if (stream->worker() != killed_id) continue;
    ASSERT_TRUE(wait_until([&] { return stream->done(); }, 10s));
    const std::string body = stream->body();
    const auto events = sse_data(body);
    ASSERT_GE(events.size(), 2u);
    EXPECT_EQ(events.back(), "[DONE]");
    EXPECT_TRUE(Json::parse(events[events.size() - 2]).contains("error")) << body;
  }
  // The other engine's streams go on.
  for (auto& stream : streams) {
    if (stream->worker() == killed_id) continue;
    EXPECT_FALSE(stream->done());
  }
  // A request the node still sends to the dead engine is retried on the other.
  for (int i = 0; i < 3; ++i) {
    const Answer answer =
        post("/v1/completions",
             Json{{"model", "mock-model"}, {"prompt", testing::prompt(64, 1000)}, {"max_tokens", 1}}
                 .dump());
    EXPECT_EQ(answer.status, 200) << answer.body;
    EXPECT_NE(answer.header("x-kvr-worker-id"), killed_id);
  }
  for (auto& pair : pairs_) {
    if (pair.get() != &killed) pair->engine->signal(SIGKILL);
  }
  for (auto& stream : streams) stream->join();
}

TEST_F(FrontDoorTest, AStreamIsCutOnlyWhenItsEngineStallsNotWhenItIsSlowAndSteady) {
  constexpr auto kStallTimeout = 400ms;
  start_node({"--router-stream-stall-timeout-ms", std::to_string(kStallTimeout.count())});
  start_pair(kFirstWorker, "1");
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 1; }, 10s));

  // Slow and steady: the answer takes longer than the stall timeout, but no gap does.
  const auto started = std::chrono::steady_clock::now();
  const Answer steady = post("/v1/completions", Json{{"model", "mock-model"},
                                                     {"prompt", testing::prompt(64, 1000)},
                                                     {"max_tokens", 200},
                                                     {"stream", true}}
                                                    .dump());
  const auto took = std::chrono::steady_clock::now() - started;
  ASSERT_GT(took, 2 * kStallTimeout) << "the engine was too fast for the check to mean anything";
  ASSERT_EQ(steady.status, 200) << steady.body;
  const auto steady_events = sse_data(steady.body);
  ASSERT_GE(steady_events.size(), 2u);
  EXPECT_FALSE(Json::parse(steady_events[steady_events.size() - 2]).contains("error"))
      << steady.body;
  // Server-Timing tells the node's part and the engine's to its first byte apart.
  const std::string timing = steady.header("server-timing");
  double node_ms = -1;
  double engine_ms = -1;
  ASSERT_EQ(std::sscanf(timing.c_str(), "kvr;dur=%lf, engine;dur=%lf", &node_ms, &engine_ms), 2)
      << timing;
  EXPECT_GE(node_ms, 0);
  EXPECT_GT(engine_ms, 0);
  const double took_ms = std::chrono::duration<double, std::milli>(took).count();
  EXPECT_LT(node_ms + engine_ms, took_ms);

  // A hung engine (stopped, its connection open): the stream ends with an error event.
  BackgroundStream hung{http_port_, Json{{"model", "mock-model"},
                                         {"prompt", testing::prompt(64, 2000)},
                                         {"max_tokens", 3000},
                                         {"stream", true}}};
  ASSERT_TRUE(wait_until([&] { return hung.headers(); }, 10s));
  EnginePair& engine = *pairs_.front();
  engine.engine->signal(SIGSTOP);
  hung.join();
  engine.engine->signal(SIGCONT);
  const std::string body = hung.body();
  const auto events = sse_data(body);
  ASSERT_GE(events.size(), 2u) << body;
  EXPECT_EQ(events.back(), "[DONE]");
  const Json error = Json::parse(events[events.size() - 2]);
  ASSERT_TRUE(error.contains("error")) << body;
  EXPECT_NE(error["error"]["message"].get<std::string>().find("stalled"), std::string::npos)
      << body;
  EXPECT_TRUE(wait_until([&] { return node_metric("kvr_route_bookings_open") == 0; }, 5s));
}

// The official OpenAI Node.js client (tests/clients/openai, installed by deploy/test.sh), as an
// application would use it against kvr.
TEST_F(FrontDoorTest, TheOfficialOpenAiClientListsStreamsAndHitsTheCache) {
  start_node();
  start_pair(kFirstWorker);
  start_pair(kFirstWorker + 1);
  wait_until_ready();
  run_official_client();
}

TEST_F(FrontDoorTest, TheOfficialOpenAiClientIsServedByWorkersWithoutAnHttpUrl) {
  const std::string tokenizer = qwen3_tokenizer();
  if (tokenizer.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  start_node_with_mockers(tokenizer);
  if (HasFatalFailure()) return;
  run_official_client();
}

void FrontDoorTest::run_official_client() {
  const std::filesystem::path client_dir = KVR_OPENAI_CLIENT_DIR;
  ASSERT_TRUE(std::filesystem::exists(client_dir / "node_modules" / "openai"))
      << "run `npm ci --prefix " << client_dir.string() << "` (deploy/test.sh does)";
  const auto run =
      testing::run_process({"node", (client_dir / "front_door_client.mjs").string(),
                            "http://127.0.0.1:" + std::to_string(http_port_) + "/v1", "mock-model"},
                           directory_.path() / "openai-client.log", 60s);
  std::cout << run.output;
  ASSERT_TRUE(run.exit_code);
  EXPECT_EQ(*run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("cache hit: "), std::string::npos);
}

// `kvr replay-live`'s OpenAI client through the front door, as the quickstart and the benchmark
// use it: every request answered, the engines' cached tokens read from their streamed usage, the
// client's connections kept alive (one per stream, not one per request) and the node's to the
// engines as well.
TEST_F(FrontDoorTest, ReplayLiveThroughTheFrontDoorKeepsItsConnectionsAliveAndReadsTheUsage) {
  start_node();
  // Room for the trace's longest prompts (87,169 tokens among the first 40).
  start_pair(kFirstWorker, "1000", 8192);
  start_pair(kFirstWorker + 1, "1000", 8192);
  wait_until_ready();
  ASSERT_TRUE(wait_until([&] { return node_metric("kvr_workers") == 2; }, 10s));
  const double accepted_before = node_metric("kvr_http_connections_accepted_total");
  const auto json_path = directory_.path() / "openai.json";
  constexpr int kRequests = 40;
  constexpr int kStreams = 4;
  auto process = kvr_->start(
      {"replay-live"},
      {"--quiet", "--openai-url", "http://127.0.0.1:" + std::to_string(http_port_) + "/v1",
       "--openai-api", "completions", "--limit", std::to_string(kRequests), "--speedup", "1e6",
       "--concurrency", std::to_string(kStreams), "--measure-from-send", "--warmup",
       std::to_string(kStreams), "--timeout", "60", "--json", json_path.string()},
      "replay.log");
  ASSERT_TRUE(process);
  const auto status = process->wait(120s);
  ASSERT_EQ(status, 0) << process->log();
  const Json report = Json::parse(testing::read_file(json_path), nullptr, false);
  ASSERT_FALSE(report.is_discarded()) << testing::read_file(json_path);
  const Json& policy = report["policies"][0];
  EXPECT_EQ(policy["completed"], kRequests) << policy.dump(2);
  EXPECT_EQ(policy["failed"], 0) << policy.dump(2);
  // The trace's conversations share prefixes and the node routes them to their cache: the
  // engines say so in `usage.prompt_tokens_details.cached_tokens`.
  EXPECT_GT(policy["hit_rate"].get<double>(), 0.0) << policy.dump(2);
  EXPECT_GT(policy["front_door_added_ms"]["p50"].get<double>(), 0.0) << policy.dump(2);
  EXPECT_LE(node_metric("kvr_http_connections_accepted_total") - accepted_before, kStreams);
  EXPECT_GT(node_metric("kvr_http_engine_connections_total"), 0);
  EXPECT_GE(testing::metric(testing::http_get(metrics_port_, "/metrics"),
                            "kvr_http_engine_connections_total{outcome=\"reused\"}"),
            kRequests / 2);
}

}  // namespace
}  // namespace kvr
