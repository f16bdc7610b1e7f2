// The front door's plain values: the fleet directory's liveness (registrations, heartbeats,
// deregistrations, a NATS outage held), OpenAI request parsing and its errors, the HTTP status of
// each route error, and the parts of an engine's URL.
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "messages/http_url.hpp"
#include "selection/front_door/fleet_directory.hpp"
#include "selection/front_door/openai_api.hpp"

namespace kvr::front_door {
namespace {

using namespace std::chrono_literals;

discovery::WorkerRegistration registration(WorkerId id, std::string model, std::string url = {}) {
  discovery::WorkerRegistration worker;
  worker.worker_id = id;
  worker.incarnation = 1;
  worker.model = std::move(model);
  worker.block_size = 16;
  worker.liveness_ttl = 1000ms;
  worker.http_url = std::move(url);
  return worker;
}

TEST(FleetDirectoryTest, AWorkerIsLiveUntilItsLivenessRunsOutAndHeartbeatsRenewIt) {
  auto clock = std::make_shared<ManualClock>();
  FleetDirectory directory{clock};
  EXPECT_FALSE(directory.any_live());
  directory.registered(registration(7, "m", "http://127.0.0.1:8000"));
  directory.registered(registration(8, "a"));
  EXPECT_EQ(directory.models(), (std::vector<std::string>{"a", "m"}));
  ASSERT_EQ(directory.workers("m").size(), 1u);
  EXPECT_EQ(directory.workers("m")[0].http_url, "http://127.0.0.1:8000");
  EXPECT_EQ(directory.workers("m")[0].block_size, 16u);
  clock->advance(900ms);
  directory.heartbeat({.worker_id = 7, .incarnation = 1});
  // Another incarnation's heartbeat renews nothing.
  directory.heartbeat({.worker_id = 8, .incarnation = 2});
  clock->advance(200ms);
  EXPECT_EQ(directory.models(), (std::vector<std::string>{"m"}));
  clock->advance(1000ms);
  EXPECT_TRUE(directory.models().empty());
  EXPECT_FALSE(directory.any_live());
}

TEST(FleetDirectoryTest, AnAdapterTargetsItsBaseModelAmongTheWorkersThatServeIt) {
  auto clock = std::make_shared<ManualClock>();
  FleetDirectory directory{clock};
  auto with_adapters = registration(7, "m", "http://127.0.0.1:8000");
  with_adapters.lora_adapters = {"sql", "chat"};
  directory.registered(with_adapters);
  directory.registered(registration(8, "m", "http://127.0.0.1:8001"));
  EXPECT_EQ(directory.adapters(), (std::vector<ServedAdapter>{{.name = "chat", .model = "m"},
                                                              {.name = "sql", .model = "m"}}));

  const ModelTarget base = directory.target("m");
  EXPECT_EQ(base.model, "m");
  EXPECT_TRUE(base.adapter.empty());
  EXPECT_EQ(base.workers.size(), 2u);

  const ModelTarget adapter = directory.target("sql");
  EXPECT_EQ(adapter.model, "m");
  EXPECT_EQ(adapter.adapter, "sql");
  ASSERT_EQ(adapter.workers.size(), 1u);
  EXPECT_EQ(adapter.workers[0].worker_id, 7u);

  EXPECT_TRUE(directory.target("unknown").workers.empty());
  // The adapter leaves with the last worker that served it.
  clock->advance(1100ms);
  EXPECT_TRUE(directory.target("sql").workers.empty());
  EXPECT_TRUE(directory.adapters().empty());
}

TEST(FleetDirectoryTest, ADeregisteredWorkerLeavesAtOnce) {
  FleetDirectory directory{std::make_shared<ManualClock>()};
  directory.registered(registration(7, "m"));
  directory.deregistered({.worker_id = 7, .incarnation = 2});  // not this incarnation
  EXPECT_EQ(directory.workers("m").size(), 1u);
  directory.deregistered({.worker_id = 7, .incarnation = 1});
  EXPECT_TRUE(directory.workers("m").empty());
}

TEST(FleetDirectoryTest, ANatsOutageHoldsLivenessAndTheReconnectGrantsOneTtl) {
  auto clock = std::make_shared<ManualClock>();
  FleetDirectory directory{clock};
  directory.registered(registration(7, "m"));
  directory.nats_link(false);
  clock->advance(10s);
  EXPECT_TRUE(directory.any_live());
  directory.nats_link(true);
  clock->advance(900ms);
  EXPECT_TRUE(directory.any_live());
  clock->advance(200ms);
  EXPECT_FALSE(directory.any_live());
}

TEST(OpenAiApiTest, AChatRequestIsReadWithItsRoutingFields) {
  const auto request = parse_generation_request(
      Endpoint::chat_completions,
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
          "max_completion_tokens":12,"user":"alice","stream_options":{"include_usage":true}})");
  ASSERT_TRUE(request) << request.error().message;
  EXPECT_EQ(request->model, "m");
  EXPECT_TRUE(request->stream);
  EXPECT_EQ(request->max_tokens, 12u);
  EXPECT_EQ(request->user, "alice");
}

TEST(OpenAiApiTest, EachMalformedFieldIsA400NamingIt) {
  const auto param_of = [](Endpoint endpoint, std::string_view body) {
    const auto request = parse_generation_request(endpoint, body);
    EXPECT_FALSE(request) << body;
    if (request) return std::string{"(accepted)"};
    EXPECT_EQ(request.error().status, 400u);
    EXPECT_EQ(request.error().type, "invalid_request_error");
    return request.error().param;
  };
  const Endpoint chat = Endpoint::chat_completions;
  const Endpoint completions = Endpoint::completions;
  EXPECT_EQ(param_of(chat, "{"), "");
  EXPECT_EQ(param_of(chat, "[1]"), "");
  EXPECT_EQ(param_of(chat, R"({"messages":[{"role":"user"}]})"), "model");
  EXPECT_EQ(param_of(chat, R"({"model":"","messages":[{"role":"user"}]})"), "model");
  EXPECT_EQ(param_of(chat, R"({"model":"m","messages":[]})"), "messages");
  EXPECT_EQ(param_of(chat, R"({"model":"m","messages":[{"content":"x"}]})"), "messages");
  EXPECT_EQ(param_of(completions, R"({"model":"m"})"), "prompt");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":[1,"x"]})"), "prompt");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","stream":1})"), "stream");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","max_tokens":0})"), "max_tokens");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","user":5})"), "user");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","stream_options":true})"),
            "stream_options");
  EXPECT_EQ(
      param_of(completions, R"({"model":"m","prompt":"x","stream_options":{"include_usage":1}})"),
      "stream_options");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","temperature":"hot"})"),
            "temperature");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","seed":1.5})"), "seed");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","stop":[1]})"), "stop");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","stop_token_ids":[-1]})"),
            "stop_token_ids");
  EXPECT_EQ(param_of(completions, R"({"model":"m","prompt":"x","ignore_eos":"yes"})"),
            "ignore_eos");
  // Every prompt form OpenAI allows is accepted.
  for (const char* prompt : {R"("x")", R"(["a","b"])", "[1,2,3]", "[[1,2],[3]]"}) {
    EXPECT_TRUE(parse_generation_request(completions,
                                         std::string{R"({"model":"m","prompt":)"} + prompt + "}"))
        << prompt;
  }
}

// Token ids are read eight digits at a time when written plainly, element by element otherwise:
// either way a request gets the same ids, or the same 400.
TEST(OpenAiApiTest, TokenIdPromptsAreReadExactlyHoweverTheyAreWritten) {
  const auto ids_of = [](const std::string& prompt) -> std::optional<std::vector<std::uint32_t>> {
    const auto request = parse_generation_request(
        Endpoint::completions, R"({"model":"m","prompt":)" + prompt + R"(,"max_tokens":5})");
    if (!request) {
      EXPECT_EQ(request.error().param, "prompt") << prompt;
      return std::nullopt;
    }
    // The fields around the prompt are read as well, however the prompt was.
    EXPECT_EQ(request->model, "m");
    EXPECT_EQ(request->max_tokens, std::optional<std::uint32_t>{5});
    return request->prompt_token_ids;
  };
  using Ids = std::vector<std::uint32_t>;
  EXPECT_EQ(ids_of("[0]"), Ids{0});
  EXPECT_EQ(ids_of("[ 1 ,22,\n333\t, 4444 ]"), (Ids{1, 22, 333, 4444}));
  EXPECT_EQ(ids_of("[12345678,123456789,1234567890]"), (Ids{12345678, 123456789, 1234567890}));
  EXPECT_EQ(ids_of("[4294967295]"), Ids{4294967295U}) << "the largest 32-bit id";
  EXPECT_EQ(ids_of("[[7,8],[9]]"), (Ids{7, 8})) << "the first list is routed";
  const auto invalid_after = parse_generation_request(
      Endpoint::completions, R"({"model":"m","prompt":[1,2],"max_tokens":})");
  EXPECT_FALSE(invalid_after) << "what follows a prompt read ahead is still checked";
  for (const char* refused : {"[4294967296]", "[12345678901]", "[01]", "[-1]", "[1.0]", "[1e3]",
                              "[1,]", "[,1]", "[]", "[1 2]", "[1,\"x\"]", "[true]"}) {
    EXPECT_EQ(ids_of(refused), std::nullopt) << refused;
  }
  // A long prompt of ids of every length, written as a client would.
  std::mt19937_64 random{7};
  Ids written;
  std::string prompt = "[";
  for (int i = 0; i < 20'000; ++i) {
    const auto digits = 1 + random() % 10;
    std::uint64_t id = random() % 10'000'000'000ULL;
    while (id >= 10 && std::to_string(id).size() > digits) id /= 10;
    if (id > UINT32_MAX) id = UINT32_MAX;
    written.push_back(static_cast<std::uint32_t>(id));
    if (i != 0) prompt += i % 3 == 0 ? ", " : ",";
    prompt += std::to_string(id);
  }
  prompt += "]";
  EXPECT_EQ(ids_of(prompt), written);
}

TEST(OpenAiApiTest, UsageAndSamplingParametersAreKeptForTheGenerateApi) {
  const auto request = parse_generation_request(
      Endpoint::completions,
      R"({"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true},)"
      R"("temperature":0.5,"top_p":0.9,"top_k":40,"seed":7,"stop":"END","stop_token_ids":[2],)"
      R"("ignore_eos":true,"min_tokens":3,"skip_special_tokens":false,"logit_bias":{}})");
  ASSERT_TRUE(request) << request.error().message;
  EXPECT_TRUE(request->include_usage);
  const v1::SamplingParams& sampling = request->sampling;
  EXPECT_FLOAT_EQ(sampling.temperature(), 0.5F);
  EXPECT_FLOAT_EQ(sampling.top_p(), 0.9F);
  EXPECT_EQ(sampling.top_k(), 40);
  EXPECT_EQ(sampling.seed(), 7);
  ASSERT_EQ(sampling.stop_size(), 1);
  EXPECT_EQ(sampling.stop(0), "END");
  ASSERT_EQ(sampling.stop_token_ids_size(), 1);
  EXPECT_EQ(sampling.stop_token_ids(0), 2U);
  EXPECT_TRUE(sampling.ignore_eos());
  EXPECT_EQ(sampling.min_tokens(), 3U);
  EXPECT_FALSE(sampling.skip_special_tokens());
  // What the body does not name stays the engine's default.
  EXPECT_FALSE(sampling.has_min_p());
  EXPECT_FALSE(sampling.has_presence_penalty());
}

TEST(OpenAiApiTest, ThePromptsTextIsKeptOnlyWhenAskedFor) {
  const std::string chat_body =
      R"({"messages":[{"role":"system","content":"Be brief."},)"
      R"({"role":"user","content":[{"type":"text","text":"What is "},)"
      R"({"type":"image_url","image_url":{"url":"http://x/a.png"}},{"type":"text","text":"this?"}]},)"
      R"({"role":"assistant","content":null,"tool_calls":[]}],"model":"m"})";
  const auto chat =
      parse_generation_request(Endpoint::chat_completions, chat_body, PromptTextUse::keep);
  ASSERT_TRUE(chat) << chat.error().message;
  EXPECT_EQ(chat->prompt_text,
            "system: Be brief.\nuser: What is "
            R"({"type":"image_url","image_url":{"url":"http://x/a.png"}})"
            "this?\nassistant: \n");
  const auto skipped = parse_generation_request(Endpoint::chat_completions, chat_body);
  ASSERT_TRUE(skipped);
  EXPECT_TRUE(skipped->prompt_text.empty());

  const auto completion = parse_generation_request(
      Endpoint::completions, R"({"model":"m","prompt":["first","second"]})", PromptTextUse::keep);
  ASSERT_TRUE(completion);
  EXPECT_EQ(completion->prompt_text, "first");
  // Token ids are the key themselves: no text.
  const auto ids = parse_generation_request(
      Endpoint::completions, R"({"model":"m","prompt":[5,6,7]})", PromptTextUse::keep);
  ASSERT_TRUE(ids);
  EXPECT_TRUE(ids->prompt_text.empty());
  EXPECT_EQ(ids->prompt_token_ids, (std::vector<std::uint32_t>{5, 6, 7}));

  const auto bad_content = parse_generation_request(
      Endpoint::chat_completions, R"({"model":"m","messages":[{"role":"user","content":7}]})",
      PromptTextUse::keep);
  ASSERT_FALSE(bad_content);
  EXPECT_EQ(bad_content.error().param, "messages");
}

TEST(OpenAiApiTest, TheErrorObjectHasOpenAisShape) {
  const HttpError error = bad_request("messages: required", "messages");
  const auto body = nlohmann::json::parse(error.body());
  EXPECT_EQ(body["error"]["message"], "messages: required");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "messages");
  EXPECT_TRUE(body["error"]["code"].is_null());
}

TEST(OpenAiApiTest, EachRouteErrorHasItsStatus) {
  const auto status_of = [](v1::RouteErrorCode code) {
    v1::RouteError error;
    error.set_code(code);
    return error_for_route(error).status;
  };
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_INVALID_REQUEST), 400u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_RATE_LIMITED), 429u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_REJECTED), 429u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_OVERLOADED), 503u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_NO_WORKERS), 503u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_ALL_FILTERED), 503u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_UNAVAILABLE), 503u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_OWNER_LOST), 503u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_POLICY_FAILED), 500u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_TIMEOUT), 504u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_DUE_TIME_EXPIRED), 504u);
  EXPECT_EQ(status_of(v1::ROUTE_ERROR_WORKER_FAILED), 502u);
}

TEST(OpenAiApiTest, AnswerUsageReadsTheLastUsageOfAWholeOrStreamedAnswer) {
  const auto whole =
      answer_usage(R"({"id":"x","choices":[{"text":"a \"usage\": {"}],"usage":{"prompt_tokens":40,)"
                   R"("completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}})");
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->prompt_tokens, 40u);
  EXPECT_EQ(whole->cached_tokens, 32u);
  // A stream's chunks say "usage": null until the final usage event.
  const auto streamed = answer_usage(
      "data: {\"choices\":[{\"delta\":{\"content\":\"}\"}}],\"usage\":null}\n\n"
      "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7}}\n\ndata: [DONE]\n\n");
  ASSERT_TRUE(streamed.has_value());
  EXPECT_EQ(streamed->prompt_tokens, 7u);
  EXPECT_EQ(streamed->cached_tokens, 0u);
  EXPECT_FALSE(answer_usage("data: {\"usage\":null}\n\ndata: [DONE]\n\n").has_value());
  EXPECT_FALSE(answer_usage(R"({"usage":{"prompt_tokens":3)").has_value());  // cut short
}

TEST(HttpUrlTest, AUrlSplitsIntoHostPortAndPath) {
  const auto plain = split_http_url("http://10.0.0.5:8000/");
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->https);
  EXPECT_EQ(plain->host, "10.0.0.5");
  EXPECT_EQ(plain->port, "8000");
  EXPECT_EQ(plain->path, "");
  const auto prefixed = split_http_url("https://[::1]/engines/a/");
  ASSERT_TRUE(prefixed);
  EXPECT_TRUE(prefixed->https);
  EXPECT_EQ(prefixed->host, "::1");
  EXPECT_EQ(prefixed->port, "443");
  EXPECT_EQ(prefixed->path, "/engines/a");
  EXPECT_EQ(split_http_url("http://engine")->port, "80");
  EXPECT_FALSE(split_http_url("ftp://engine"));
}

}  // namespace
}  // namespace kvr::front_door
