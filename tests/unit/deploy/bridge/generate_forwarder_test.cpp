// The generate forwarder against a stand-in engine: an HTTP server on 127.0.0.1 answering
// POST /v1/completions with OpenAI's completions streaming format as vLLM writes it
// (`data: {json}\n\n` events, the finish reason on the last choice, a usage-only event, then
// `data: [DONE]\n\n`), and the ways an engine fails. For disaggregated serving it answers as a
// vLLM with NixlConnector does: a request with `"do_remote_decode": true` gets one non-streaming
// CompletionResponse whose top-level `kv_transfer_params` says where the KV blocks wait.
#include "deploy/bridge/generate_forwarder.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>
#include <unistd.h>

#include "deploy/bridge/engine_bridge.hpp"

namespace kvr::bridge {
namespace {

using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kDeadline = 10s;
constexpr WorkerId kWorker = 42;

// One vLLM completions stream event with one token.
std::string token_event(std::uint32_t token, std::optional<std::string> finish_reason,
                        std::optional<std::uint32_t> cached) {
  nlohmann::json usage = nullptr;
  if (cached) {
    usage = {{"prompt_tokens", 64},
             {"completion_tokens", 1},
             {"total_tokens", 65},
             {"prompt_tokens_details", {{"cached_tokens", *cached}}}};
  }
  const nlohmann::json event = {
      {"id", "cmpl-7f3a"},
      {"object", "text_completion"},
      {"created", 1'700'000'000},
      {"model", "mock-model"},
      {"choices",
       {{{"index", 0},
         {"text", " t" + std::to_string(token)},
         {"logprobs", nullptr},
         {"finish_reason", finish_reason ? nlohmann::json(*finish_reason) : nlohmann::json()},
         {"stop_reason", nullptr},
         {"token_ids", {token}}}}},
      {"usage", usage}};
  return "data: " + event.dump() + "\n\n";
}

std::string usage_event() {
  return R"(data: {"id":"cmpl-7f3a","object":"text_completion","created":1700000000,)"
         R"("model":"mock-model","choices":[],"usage":{"prompt_tokens":64,"total_tokens":67,)"
         R"("completion_tokens":3,"prompt_tokens_details":{"cached_tokens":48}}})"
         "\n\n";
}

// The parameters a vLLM prefill worker with NixlConnector answers with (the connector's
// request_finished for a length-capped do_remote_decode request).
const nlohmann::json kPrefillParams = {{"do_remote_prefill", true},
                                       {"do_remote_decode", false},
                                       {"remote_block_ids", {{7, 8, 9, 10}}},
                                       {"remote_engine_id", "a1b2-prefill-engine"},
                                       {"remote_request_id", "cmpl-req-1-0"},
                                       {"remote_host", "10.0.0.7"},
                                       {"remote_port", 5600},
                                       {"tp_size", 1}};

// What the router sends on a prefill hop.
constexpr std::string_view kRemoteDecodeParams =
    R"({"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,)"
    R"("remote_block_ids":null,"remote_host":null,"remote_port":null})";

// vLLM's non-streaming CompletionResponse for a one-token prefill, with return_token_ids (which
// also echoes the prompt's ids) and prompt token details; `params` null when the connector gave
// none.
std::string prefill_answer(std::string_view finish_reason, const nlohmann::json& params) {
  const nlohmann::json answer = {{"id", "cmpl-req-1"},
                                 {"object", "text_completion"},
                                 {"created", 1'700'000'000},
                                 {"model", "mock-model"},
                                 {"choices",
                                  {{{"index", 0},
                                    {"text", " t21"},
                                    {"logprobs", nullptr},
                                    {"finish_reason", finish_reason},
                                    {"stop_reason", nullptr},
                                    {"token_ids", {21}},
                                    {"prompt_logprobs", nullptr},
                                    {"prompt_token_ids", {1000, 1001, 1002}}}}},
                                 {"service_tier", nullptr},
                                 {"system_fingerprint", nullptr},
                                 {"usage",
                                  {{"prompt_tokens", 64},
                                   {"total_tokens", 65},
                                   {"completion_tokens", 1},
                                   {"prompt_tokens_details", {{"cached_tokens", 32}}}}},
                                 {"kv_transfer_params", params}};
  return answer.dump();
}

// The stand-in engine. `behaviour` picks the answer to /v1/completions.
class StandInEngine {
 public:
  enum class Behaviour : std::uint8_t {
    three_tokens,     // 3 tokens, finish "length", usage, [DONE]
    bad_request,      // HTTP 400 with an OpenAI error body
    error_in_stream,  // 1 token, then an error event
    ends_early,       // 1 token, then the stream closes
    streams_forever,  // 1 token, then tokens until the client goes away
    disaggregated,    // "stream": false: prefill_answer (settable), as vLLM checks the body;
                      // streaming: as three_tokens
    holds_answer,     // "stream": false: holds the answer until release(), then a prefill answer
  };

  explicit StandInEngine(Behaviour behaviour) : behaviour_(behaviour) {
    server_.Post("/v1/completions", [this](const httplib::Request& request,
                                           httplib::Response& response) {
      {
        std::lock_guard lock{mutex_};
        bodies_.push_back(request.body);
        request_ids_.push_back(request.get_header_value("X-Request-Id"));
        changed_.notify_all();
      }
      const auto body = nlohmann::json::parse(request.body, nullptr, false);
      const bool streams = body.is_object() && body.value("stream", false);
      if (behaviour_ == Behaviour::holds_answer && !streams) {
        std::unique_lock lock{mutex_};
        changed_.wait(lock, [&] { return release_; });
        response.set_content(prefill_answer("length", kPrefillParams), "application/json");
        return;
      }
      if (behaviour_ == Behaviour::disaggregated && !streams) {
        // The checks vLLM's CompletionRequest and SamplingParams make that a prefill hop's body
        // could fail.
        const char* refusal = nullptr;
        if (body.contains("stream_options")) {
          refusal = "Stream options can only be defined when `stream=True`.";
        } else if (body.value("min_tokens", 0) > body.value("max_tokens", 16)) {
          refusal = "min_tokens must be less than or equal to max_tokens";
        }
        if (refusal != nullptr) {
          response.status = 400;
          response.set_content(nlohmann::json{{"object", "error"},
                                              {"message", refusal},
                                              {"type", "BadRequestError"},
                                              {"code", 400}}
                                   .dump(),
                               "application/json");
          return;
        }
        std::lock_guard lock{mutex_};
        response.set_content(prefill_answer_, "application/json");
        return;
      }
      switch (behaviour_) {
        case Behaviour::bad_request:
          response.status = 400;
          response.set_content(
              R"({"object":"error","message":"This model's maximum context length is 4096 tokens.",)"
              R"("type":"BadRequestError","param":null,"code":400})",
              "application/json");
          return;
        case Behaviour::three_tokens:
        case Behaviour::disaggregated:
        case Behaviour::holds_answer:
          response.set_chunked_content_provider(
              "text/event-stream", [](std::size_t, httplib::DataSink& sink) {
                // Split mid-event, as TCP may deliver it.
                const std::string all =
                    token_event(11, std::nullopt, 48) + token_event(12, std::nullopt, 48) +
                    token_event(13, "length", 48) + usage_event() + "data: [DONE]\n\n";
                const std::size_t half = all.size() / 2 + 3;
                sink.write(all.data(), half);
                sink.write(all.data() + half, all.size() - half);
                sink.done();
                return true;
              });
          return;
        case Behaviour::error_in_stream:
          response.set_chunked_content_provider(
              "text/event-stream", [](std::size_t, httplib::DataSink& sink) {
                const std::string all =
                    token_event(11, std::nullopt, 0) +
                    R"(data: {"error": {"object": "error", "message": "engine core died", )"
                    R"("type": "InternalServerError", "code": 500}})"
                    "\n\n";
                sink.write(all.data(), all.size());
                sink.done();
                return true;
              });
          return;
        case Behaviour::ends_early:
          response.set_chunked_content_provider(
              "text/event-stream", [](std::size_t, httplib::DataSink& sink) {
                const std::string all = token_event(11, std::nullopt, 0);
                sink.write(all.data(), all.size());
                sink.done();
                return true;
              });
          return;
        case Behaviour::streams_forever:
          response.set_chunked_content_provider(
              "text/event-stream",
              [this](std::size_t, httplib::DataSink& sink) {
                const std::string first = token_event(11, std::nullopt, 0);
                if (!sink.write(first.data(), first.size())) return false;
                // Hold the next token until the test has seen the cancel, then write until the
                // closed connection makes a write fail (the engine's abort).
                {
                  std::unique_lock lock{mutex_};
                  changed_.wait(lock, [&] { return release_; });
                }
                for (std::uint32_t token = 12; token < 100'000; ++token) {
                  const std::string next = token_event(token, std::nullopt, 0);
                  if (!sink.write(next.data(), next.size())) return false;
                }
                sink.done();
                return true;
              },
              [this](bool success) {
                std::lock_guard lock{mutex_};
                aborted_ = !success;
                ended_ = true;
                changed_.notify_all();
              });
          return;
      }
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread{[this] { server_.listen_after_bind(); }};
    // httplib's stop() does nothing until the listen loop runs: wait for it.
    // (bounded: a loop that ends at once never shows as running)
    for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
         !server_.is_running() && std::chrono::steady_clock::now() < until;) {
      std::this_thread::yield();
    }
  }

  ~StandInEngine() {
    release();
    server_.stop();
    thread_.join();
  }

  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  std::vector<std::string> bodies() {
    std::lock_guard lock{mutex_};
    return bodies_;
  }
  std::vector<std::string> request_ids() {
    std::lock_guard lock{mutex_};
    return request_ids_;
  }

  // Waits until `count` requests arrived; false at the deadline.
  bool wait_requests(std::size_t count) {
    std::unique_lock lock{mutex_};
    return changed_.wait_for(lock, kDeadline, [&] { return bodies_.size() >= count; });
  }

  // The whole answer to a non-streaming request (Behaviour::disaggregated).
  void set_prefill_answer(std::string answer) {
    std::lock_guard lock{mutex_};
    prefill_answer_ = std::move(answer);
  }

  void release() {
    std::lock_guard lock{mutex_};
    release_ = true;
    changed_.notify_all();
  }

  // Waits until the forever stream ended; true when it ended because the client went away.
  bool wait_aborted() {
    std::unique_lock lock{mutex_};
    changed_.wait_for(lock, kDeadline, [&] { return ended_; });
    return ended_ && aborted_;
  }

 private:
  Behaviour behaviour_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> bodies_;
  std::vector<std::string> request_ids_;
  std::string prefill_answer_ = prefill_answer("length", kPrefillParams);
  bool release_ = false;
  bool ended_ = false;
  bool aborted_ = false;
};

// The chunks the forwarder published, waited for with deadlines.
struct Chunks {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::pair<std::string, v1::GenerateChunk>> published;

  GenerateForwarder::Publish publisher() {
    return [this](const std::string& subject, const v1::GenerateChunk& chunk) {
      std::lock_guard lock{mutex};
      published.emplace_back(subject, chunk);
      changed.notify_all();
    };
  }

  // Waits for a finished chunk (or `count` chunks) and returns every chunk so far.
  std::vector<v1::GenerateChunk> wait(std::size_t count = 0) {
    std::unique_lock lock{mutex};
    changed.wait_for(lock, kDeadline, [&] {
      if (count > 0) return published.size() >= count;
      return !published.empty() && published.back().second.finished();
    });
    std::vector<v1::GenerateChunk> out;
    for (const auto& [subject, chunk] : published) {
      EXPECT_EQ(subject, "inbox.stream.1");
      out.push_back(chunk);
    }
    return out;
  }
};

v1::GenerateRequest make_request(std::uint32_t prompt_tokens = 64, std::uint32_t max_tokens = 3) {
  v1::GenerateRequest request;
  request.mutable_route()->set_request_id("req-1");
  request.mutable_route()->set_model("mock-model");
  for (std::uint32_t i = 0; i < prompt_tokens; ++i) {
    request.mutable_route()->mutable_tokens()->add_ids(1000 + i);
  }
  request.set_max_output_tokens(max_tokens);
  request.set_stream_subject("inbox.stream.1");
  return request;
}

std::unique_ptr<GenerateForwarder> start_forwarder(const std::string& url, Chunks& chunks) {
  auto forwarder = GenerateForwarder::start(
      GenerateForwarderOptions{.engine_url = url, .worker_id = kWorker, .concurrency = 2},
      chunks.publisher());
  EXPECT_TRUE(forwarder) << forwarder.error();
  (*forwarder)->set_model("mock-model");
  return std::move(*forwarder);
}

TEST(CompletionEvent, ReadsTokensFinishReasonAndCachedTokensOfAVllmEvent) {
  const std::string line = token_event(13, "length", 48);
  const CompletionEvent event =
      parse_completion_event(std::string_view{line}.substr(6, line.size() - 8));
  EXPECT_FALSE(event.done);
  EXPECT_FALSE(event.error);
  EXPECT_TRUE(event.has_choice);
  EXPECT_EQ(event.token_ids, std::vector<std::uint32_t>{13});
  EXPECT_EQ(event.finish_reason, "length");
  EXPECT_EQ(event.cached_prompt_tokens, 48U);
}

TEST(CompletionEvent, ReadsDoneUsageOnlyAndErrorEvents) {
  EXPECT_TRUE(parse_completion_event("[DONE]").done);
  const std::string usage = usage_event();
  const CompletionEvent only_usage =
      parse_completion_event(std::string_view{usage}.substr(6, usage.size() - 8));
  EXPECT_FALSE(only_usage.has_choice);
  EXPECT_EQ(only_usage.cached_prompt_tokens, 48U);
  const CompletionEvent error =
      parse_completion_event(R"({"error":{"message":"engine core died","code":500}})");
  EXPECT_EQ(error.error, "engine core died");
  EXPECT_TRUE(parse_completion_event("{not json").error.has_value());
  EXPECT_TRUE(parse_completion_event("[1, 2]").error.has_value());
  // A token id that is not an unsigned 32-bit number is unreadable, not a crash.
  EXPECT_TRUE(parse_completion_event(R"({"choices":[{"token_ids":[-1]}]})").error.has_value());
}

TEST(SseReader, SplitsEventsArrivingInAnyPieces) {
  const std::string stream =
      "data: {\"a\":1}\n\n: a comment\n\nevent: x\ndata: first\ndata: second\n\r\ndata:[DONE]\n\n";
  for (std::size_t piece : {std::size_t{1}, std::size_t{3}, stream.size()}) {
    SseReader reader;
    std::vector<std::string> events;
    for (std::size_t at = 0; at < stream.size(); at += piece) {
      ASSERT_TRUE(reader.feed(std::string_view{stream}.substr(at, piece), [&](std::string_view e) {
        events.emplace_back(e);
        return true;
      }));
    }
    EXPECT_EQ(events, (std::vector<std::string>{"{\"a\":1}", "first\nsecond", "[DONE]"}))
        << "piece " << piece;
  }
}

TEST(SseReader, RefusesAnEventBeyondItsBound) {
  SseReader reader{64};
  EXPECT_FALSE(
      reader.feed("data: " + std::string(100, 'x'), [](std::string_view) { return true; }));
  SseReader endless{64};
  EXPECT_FALSE(endless.feed(std::string(100, 'x'), [](std::string_view) { return true; }));
}

TEST(CompletionCall, SendsTokenIdsStreamingAndMaxTokens) {
  v1::GenerateRequest request = make_request(4, 7);
  auto call = completion_call(request, "served");
  ASSERT_TRUE(call) << call.error();
  EXPECT_TRUE(call->stream);
  const auto json = nlohmann::json::parse(call->body);
  EXPECT_EQ(json["model"], "served");
  EXPECT_EQ(json["prompt"], nlohmann::json({1000, 1001, 1002, 1003}));
  EXPECT_EQ(json["max_tokens"], 7);
  EXPECT_EQ(json["stream"], true);
  EXPECT_EQ(json["stream_options"]["include_usage"], true);
  EXPECT_EQ(json["stream_options"]["continuous_usage_stats"], true);
  EXPECT_EQ(json["return_token_ids"], true);

  // A cache namespace is the LoRA adapter's name, which the engines take as the model.
  request.mutable_route()->set_cache_namespace("sql-lora");
  EXPECT_EQ(nlohmann::json::parse(completion_call(request, "served")->body)["model"], "sql-lora");
  // max_output_tokens 0 falls back to the route's expected output.
  request.set_max_output_tokens(0);
  request.mutable_route()->set_expected_output_tokens(9);
  EXPECT_EQ(nlohmann::json::parse(completion_call(request, "served")->body)["max_tokens"], 9);
  request.mutable_route()->clear_expected_output_tokens();
  EXPECT_FALSE(completion_call(request, "served"));
  // Block hashes cannot be sent to an engine.
  request.set_max_output_tokens(3);
  request.mutable_route()->mutable_block_hashes()->add_hashes(1);
  EXPECT_FALSE(completion_call(request, "served"));
}

TEST(CompletionCall, SendsOnlyTheSamplingParametersThatAreSet) {
  v1::GenerateRequest request = make_request(4, 7);
  // No sampling message: none of its fields, so the engine's defaults apply.
  auto plain = nlohmann::json::parse(completion_call(request, "served")->body);
  for (const char* field :
       {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
        "include_stop_str_in_output", "skip_special_tokens"}) {
    EXPECT_FALSE(plain.contains(field)) << field;
  }
  // Set ones go under vLLM's names; a zero that is set is sent (temperature 0 means greedy).
  v1::SamplingParams& sampling = *request.mutable_sampling();
  sampling.set_temperature(0.0F);
  sampling.set_top_p(0.5F);
  sampling.set_top_k(40);
  sampling.set_seed(-3);
  sampling.add_stop("\n\n");
  sampling.add_stop_token_ids(2);
  sampling.add_stop_token_ids(7);
  sampling.set_repetition_penalty(1.25F);
  sampling.set_ignore_eos(false);
  sampling.set_min_tokens(3);
  const auto json = nlohmann::json::parse(completion_call(request, "served")->body);
  EXPECT_EQ(json["temperature"], 0.0);
  EXPECT_EQ(json["top_p"], 0.5);
  EXPECT_EQ(json["top_k"], 40);
  EXPECT_EQ(json["seed"], -3);
  EXPECT_EQ(json["stop"], nlohmann::json({"\n\n"}));
  EXPECT_EQ(json["stop_token_ids"], nlohmann::json({2, 7}));
  EXPECT_EQ(json["repetition_penalty"], 1.25);
  EXPECT_EQ(json["ignore_eos"], false);
  EXPECT_EQ(json["min_tokens"], 3);
  for (const char* field : {"min_p", "presence_penalty", "frequency_penalty",
                            "include_stop_str_in_output", "skip_special_tokens"}) {
    EXPECT_FALSE(json.contains(field)) << field;
  }
  // The rest of the body is unchanged.
  EXPECT_EQ(json["max_tokens"], 7);
  EXPECT_EQ(json["stream"], true);
}

TEST(GenerateForwarder, TheEngineReceivesTheRequestsSamplingParameters) {
  StandInEngine engine{StandInEngine::Behaviour::three_tokens};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request();
  request.mutable_sampling()->set_temperature(0.25F);
  request.mutable_sampling()->set_frequency_penalty(-0.5F);
  request.mutable_sampling()->add_stop_token_ids(13);
  request.mutable_sampling()->set_ignore_eos(true);
  forwarder->submit(std::move(request));
  ASSERT_EQ(chunks.wait().size(), 3U);
  ASSERT_EQ(engine.bodies().size(), 1U);
  const auto body = nlohmann::json::parse(engine.bodies()[0]);
  EXPECT_EQ(body["temperature"], 0.25);
  EXPECT_EQ(body["frequency_penalty"], -0.5);
  EXPECT_EQ(body["stop_token_ids"], nlohmann::json({13}));
  EXPECT_EQ(body["ignore_eos"], true);
  EXPECT_FALSE(body.contains("top_p"));
}

TEST(GenerateForwarder, StreamsTheEnginesTokensAsChunks) {
  StandInEngine engine{StandInEngine::Behaviour::three_tokens};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request());
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 3U);
  for (std::uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(published[i].request_id(), "req-1");
    EXPECT_EQ(published[i].index(), i);
    EXPECT_EQ(published[i].worker_id(), kWorker);
    ASSERT_EQ(published[i].token_ids_size(), 1);
    EXPECT_EQ(published[i].token_ids(0), 11 + i);
    EXPECT_EQ(published[i].finished(), i == 2);
    EXPECT_FALSE(published[i].has_error());
  }
  EXPECT_EQ(published[0].cached_prompt_tokens(), 48U);
  EXPECT_EQ(published[2].finish_reason(), "length");
  ASSERT_EQ(engine.bodies().size(), 1U);
  const auto body = nlohmann::json::parse(engine.bodies()[0]);
  EXPECT_EQ(body["prompt"].size(), 64U);
  EXPECT_EQ(body["max_tokens"], 3);
  EXPECT_EQ(engine.request_ids(), std::vector<std::string>{"req-1"});
  forwarder.reset();
  EXPECT_EQ(chunks.wait().size(), 3U) << "nothing after the finished chunk";
}

TEST(GenerateForwarder, AnHttpErrorBecomesAnErrorChunkWithTheEnginesMessage) {
  StandInEngine engine{StandInEngine::Behaviour::bad_request};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request());
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].index(), 0U);
  EXPECT_TRUE(published[0].finished());
  EXPECT_EQ(published[0].finish_reason(), "error");
  EXPECT_EQ(published[0].error().code(), v1::ROUTE_ERROR_WORKER_FAILED);
  EXPECT_NE(published[0].error().message().find("HTTP 400"), std::string::npos);
  EXPECT_NE(published[0].error().message().find("maximum context length"), std::string::npos);
  EXPECT_EQ(forwarder->stats().failed, 1U);
}

TEST(GenerateForwarder, AnErrorEventInTheStreamEndsItWithAnErrorChunk) {
  StandInEngine engine{StandInEngine::Behaviour::error_in_stream};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request());
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[0].token_ids(0), 11U);
  EXPECT_EQ(published[1].index(), 1U);
  EXPECT_EQ(published[1].finish_reason(), "error");
  EXPECT_NE(published[1].error().message().find("engine core died"), std::string::npos);
}

TEST(GenerateForwarder, AStreamEndingWithoutAFinishReasonIsAnError) {
  StandInEngine engine{StandInEngine::Behaviour::ends_early};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request());
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[1].finish_reason(), "error");
  EXPECT_NE(published[1].error().message().find("without a finish reason"), std::string::npos);
}

TEST(GenerateForwarder, AnUnreachableEngineGivesAnErrorChunk) {
  // A port that was just free: bound, never listened on, closed.
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(probe, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  socklen_t length = sizeof address;
  ASSERT_EQ(::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(probe);
  const std::string url = "http://127.0.0.1:" + std::to_string(ntohs(address.sin_port));
  Chunks chunks;
  auto forwarder = start_forwarder(url, chunks);
  forwarder->submit(make_request());
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].finish_reason(), "error");
  EXPECT_NE(published[0].error().message().find("engine request failed"), std::string::npos);
}

TEST(GenerateForwarder, RefusesRequestsItCannotSend) {
  StandInEngine engine{StandInEngine::Behaviour::three_tokens};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request();
  request.set_dp_rank(1);
  forwarder->submit(request);
  auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_EQ(published[0].error().message(), "dp_rank out of range");
  EXPECT_TRUE(engine.bodies().empty());
}

TEST(GenerateForwarder, ACancelClosesTheHttpStreamAndEndsWithCancelled) {
  StandInEngine engine{StandInEngine::Behaviour::streams_forever};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request(64, 100'000));
  ASSERT_EQ(chunks.wait(1).size(), 1U);
  forwarder->cancel("req-1");
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[1].index(), 1U);
  EXPECT_TRUE(published[1].finished());
  EXPECT_EQ(published[1].finish_reason(), "cancelled");
  EXPECT_FALSE(published[1].has_error());
  // The engine's next writes fail: it sees the client gone, which is how it aborts.
  engine.release();
  EXPECT_TRUE(engine.wait_aborted());
  EXPECT_EQ(forwarder->stats().cancelled, 1U);
  // A cancel of a finished request is ignored.
  forwarder->cancel("req-1");
  EXPECT_EQ(chunks.wait().size(), 2U);
}

TEST(GenerateForwarder, ShutdownEndsOpenStreamsWithAnError) {
  StandInEngine engine{StandInEngine::Behaviour::streams_forever};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  forwarder->submit(make_request(64, 100'000));
  ASSERT_EQ(chunks.wait(1).size(), 1U);
  forwarder.reset();
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[1].finish_reason(), "error");
  EXPECT_NE(published[1].error().message().find("shut down"), std::string::npos);
}

TEST(CompletionEvent, ReadsTheKvTransferParamsOfANonStreamingAnswer) {
  const CompletionEvent answer = parse_completion_event(prefill_answer("length", kPrefillParams));
  EXPECT_FALSE(answer.error);
  EXPECT_EQ(answer.token_ids, std::vector<std::uint32_t>{21});
  EXPECT_EQ(answer.finish_reason, "length");
  EXPECT_EQ(answer.cached_prompt_tokens, 32U);
  ASSERT_TRUE(answer.kv_transfer_params);
  EXPECT_EQ(nlohmann::json::parse(*answer.kv_transfer_params), kPrefillParams);
  // vLLM writes null when the connector gave none.
  EXPECT_FALSE(parse_completion_event(prefill_answer("stop", nullptr)).kv_transfer_params);
  // A value nested past the bound is unreadable, not a stack overflow.
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  EXPECT_TRUE(parse_completion_event(R"({"kv_transfer_params":{"x":)" + deep + "}}").error);
}

TEST(CompletionCall, PutsTheDecodeHopsKvTransferParamsAtTheTopLevelAndStreams) {
  v1::GenerateRequest request = make_request(4, 7);
  request.set_kv_transfer_params(kPrefillParams.dump());
  request.mutable_sampling()->set_min_tokens(3);
  auto call = completion_call(request, "served");
  ASSERT_TRUE(call) << call.error();
  EXPECT_TRUE(call->stream);
  const auto json = nlohmann::json::parse(call->body);
  EXPECT_EQ(json["kv_transfer_params"], kPrefillParams);
  EXPECT_EQ(json["stream"], true);
  EXPECT_TRUE(json.contains("stream_options"));
  EXPECT_EQ(json["max_tokens"], 7);
  EXPECT_EQ(json["min_tokens"], 3);
}

TEST(CompletionCall, SendsThePrefillHopWithoutStreamingAsVllmsProxyDoes) {
  v1::GenerateRequest request = make_request(4, 1);
  request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
  request.mutable_sampling()->set_min_tokens(5);
  request.mutable_sampling()->set_temperature(0.5F);
  auto call = completion_call(request, "served");
  ASSERT_TRUE(call) << call.error();
  EXPECT_FALSE(call->stream);
  const auto json = nlohmann::json::parse(call->body);
  EXPECT_EQ(json["kv_transfer_params"], nlohmann::json::parse(kRemoteDecodeParams));
  EXPECT_EQ(json["stream"], false);
  // vLLM refuses stream_options without streaming, and min_tokens above max_tokens.
  EXPECT_FALSE(json.contains("stream_options"));
  EXPECT_FALSE(json.contains("min_tokens"));
  EXPECT_EQ(json["max_tokens"], 1);
  EXPECT_EQ(json["temperature"], 0.5);
  EXPECT_EQ(json["return_token_ids"], true);
  // Only a boolean true asks for a remote decode.
  request.set_kv_transfer_params(R"({"do_remote_decode":"yes"})");
  EXPECT_TRUE(completion_call(request, "served")->stream);
}

TEST(CompletionCall, RefusesKvTransferParamsThatAreNotAJsonObject) {
  v1::GenerateRequest request = make_request(4, 1);
  for (const std::string& params :
       {std::string{R"({"do_remote_decode": tru)"}, std::string{"[1, 2]"}, std::string{"null"},
        std::string{"\"text\""},
        R"({"a":)" + std::string(1000, '[') + std::string(1000, ']') + "}"}) {
    request.set_kv_transfer_params(params);
    const auto call = completion_call(request, "served");
    ASSERT_FALSE(call) << params;
    EXPECT_TRUE(call.error().starts_with("kv_transfer_params: ")) << call.error();
  }
}

TEST(GenerateForwarder, APrefillHopsLastChunkCarriesTheEnginesKvTransferParams) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request(64, 1);
  request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
  request.mutable_sampling()->set_min_tokens(4);
  forwarder->submit(std::move(request));
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[0].index(), 0U);
  ASSERT_EQ(published[0].token_ids_size(), 1);
  EXPECT_EQ(published[0].token_ids(0), 21U);
  EXPECT_EQ(published[0].cached_prompt_tokens(), 32U);
  EXPECT_FALSE(published[0].finished());
  EXPECT_TRUE(published[0].kv_transfer_params().empty());
  EXPECT_EQ(published[1].index(), 1U);
  EXPECT_TRUE(published[1].finished());
  EXPECT_EQ(published[1].finish_reason(), "length");
  EXPECT_FALSE(published[1].has_error());
  EXPECT_EQ(published[1].worker_id(), kWorker);
  EXPECT_EQ(nlohmann::json::parse(published[1].kv_transfer_params()), kPrefillParams);
  ASSERT_EQ(engine.bodies().size(), 1U);
  const auto body = nlohmann::json::parse(engine.bodies()[0]);
  EXPECT_EQ(body["kv_transfer_params"], nlohmann::json::parse(kRemoteDecodeParams));
  EXPECT_EQ(body["stream"], false);
  EXPECT_EQ(engine.request_ids(), std::vector<std::string>{"req-1"});
  EXPECT_EQ(forwarder->stats().completed, 1U);
}

TEST(GenerateForwarder, TheDecodeHopSendsThePrefillsParamsAndStreams) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request();
  request.set_kv_transfer_params(kPrefillParams.dump());
  forwarder->submit(std::move(request));
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 3U);
  EXPECT_EQ(published[2].finish_reason(), "length");
  for (const auto& chunk : published) EXPECT_TRUE(chunk.kv_transfer_params().empty());
  ASSERT_EQ(engine.bodies().size(), 1U);
  const auto body = nlohmann::json::parse(engine.bodies()[0]);
  EXPECT_EQ(body["kv_transfer_params"], kPrefillParams);
  EXPECT_EQ(body["stream"], true);
}

TEST(GenerateForwarder, APrefillAnswerWithoutKvTransferParamsIsPassedOnUnchanged) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  // The one token was a stop token: vLLM's connector gives no parameters then.
  engine.set_prefill_answer(prefill_answer("stop", nullptr));
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request(64, 1);
  request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
  forwarder->submit(std::move(request));
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 2U);
  EXPECT_EQ(published[0].token_ids(0), 21U);
  EXPECT_EQ(published[1].finish_reason(), "stop");
  EXPECT_FALSE(published[1].has_error());
  EXPECT_TRUE(published[1].kv_transfer_params().empty());
}

TEST(GenerateForwarder, AnUnreadablePrefillAnswerEndsWithAnErrorChunk) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  // Cut short, and whole but without a finish reason.
  const std::vector<std::string> answers = {std::string{R"({"choices": [{"token_ids": [21])"},
                                            std::string{R"({"choices": [{"token_ids": [21]}]})"}};
  for (std::size_t i = 0; i < answers.size(); ++i) {
    engine.set_prefill_answer(answers[i]);
    v1::GenerateRequest request = make_request(64, 1);
    request.mutable_route()->set_request_id("req-" + std::to_string(i));
    request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
    forwarder->submit(std::move(request));
    // One error chunk per answer, nothing else.
    const auto published = chunks.wait(i + 1);
    ASSERT_EQ(published.size(), i + 1) << answers[i];
    EXPECT_EQ(published[i].request_id(), "req-" + std::to_string(i));
    EXPECT_EQ(published[i].index(), 0U);
    EXPECT_EQ(published[i].finish_reason(), "error");
    EXPECT_EQ(published[i].error().code(), v1::ROUTE_ERROR_WORKER_FAILED);
    EXPECT_TRUE(published[i].kv_transfer_params().empty());
  }
  EXPECT_EQ(forwarder->stats().failed, 2U);
}

TEST(GenerateForwarder, MalformedKvTransferParamsGiveAnInvalidRequestErrorChunk) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request(64, 1);
  request.set_kv_transfer_params(R"({"do_remote_decode": tru)");
  forwarder->submit(std::move(request));
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].index(), 0U);
  EXPECT_TRUE(published[0].finished());
  EXPECT_EQ(published[0].finish_reason(), "error");
  EXPECT_EQ(published[0].error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_TRUE(published[0].error().message().starts_with("kv_transfer_params: not valid JSON"))
      << published[0].error().message();
  EXPECT_TRUE(engine.bodies().empty());
  EXPECT_EQ(forwarder->stats().refused, 1U);
}

TEST(GenerateForwarder, ACancelEndsAPrefillHopTheEngineHasNotAnswered) {
  StandInEngine engine{StandInEngine::Behaviour::holds_answer};
  Chunks chunks;
  auto forwarder = start_forwarder(engine.url(), chunks);
  v1::GenerateRequest request = make_request(64, 1);
  request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
  forwarder->submit(std::move(request));
  // Cancel once the engine holds the request, silent until it answers.
  ASSERT_TRUE(engine.wait_requests(1));
  forwarder->cancel("req-1");
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].finish_reason(), "cancelled");
  EXPECT_TRUE(published[0].kv_transfer_params().empty());
  EXPECT_EQ(forwarder->stats().cancelled, 1U);
}

TEST(GenerateForwarder, AnSglangEngineRefusesKvTransferParams) {
  StandInEngine engine{StandInEngine::Behaviour::disaggregated};
  Chunks chunks;
  auto forwarder = GenerateForwarder::start(
      GenerateForwarderOptions{
          .engine_url = engine.url(), .engine = EngineKind::sglang, .worker_id = kWorker},
      chunks.publisher());
  ASSERT_TRUE(forwarder) << forwarder.error();
  v1::GenerateRequest request = make_request(64, 1);
  request.set_kv_transfer_params(std::string{kRemoteDecodeParams});
  (*forwarder)->submit(std::move(request));
  const auto published = chunks.wait();
  ASSERT_EQ(published.size(), 1U);
  EXPECT_EQ(published[0].error().code(), v1::ROUTE_ERROR_INVALID_REQUEST);
  EXPECT_TRUE(
      published[0].error().message().starts_with("kv_transfer_params: the engine is SGLang"));
  EXPECT_TRUE(engine.bodies().empty());
}

TEST(BridgeOptions, RefusesThePrefillAndDecodeRolesForAnSglangEngine) {
  BridgeOptions options;
  options.engine = EngineKind::sglang;
  for (WorkerType role : kAllWorkerTypes) {
    options.role = role;
    const bool disaggregated = role == WorkerType::Prefill || role == WorkerType::Decode;
    const auto valid = options.validate();
    EXPECT_EQ(valid.has_value(), !disaggregated) << as_str(role);
    if (!valid) {
      EXPECT_NE(valid.error().find("needs --engine vllm"), std::string::npos);
    }
  }
  options.engine = EngineKind::vllm;
  options.role = WorkerType::Prefill;
  EXPECT_TRUE(options.validate());
}

}  // namespace
}  // namespace kvr::bridge
