// `kvr mocker --speak vllm`'s OpenAI-compatible side, in process: the mock tokenizer and its chat
// template; /tokenize, /detokenize and the render endpoints agreeing with each other and with the
// token ids the engine serves and publishes KV events for; chat completions, one answer and
// streamed; cached prompt tokens in the usage; text prompts on /v1/completions; the render
// endpoints switched off; vLLM's errors for an unknown model and bad bodies; LoRA adapters (listed,
// served under their names, cached apart, named in KV events, checked by the command line);
// disaggregated serving's kv_transfer_params (a prefill hop's answer, a decode hop's transfer,
// malformed parameters, the transfer flags).
#include <array>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "deploy/bridge/kv_event_decoder.hpp"
#include "deploy/bridge/kv_translator.hpp"
#include "deploy/mocker/mock_tokenizer.hpp"
#include "deploy/mocker/vllm_engine_server.hpp"
#include "deploy/worker/vllm_kv_frames.hpp"
#include "discovery/block_hash.hpp"
#include "tests/testing/child_process.hpp"
#include "tests/testing/kvr_binary.hpp"
#include "tests/testing/loopback_http.hpp"
#include "tests/testing/process_run.hpp"

namespace kvr::mocker {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

constexpr std::uint32_t kBlockSize = 16;
constexpr std::uint32_t kGpuBlocks = 2048;

std::vector<std::uint32_t> bytes_of(std::string_view text) {
  std::vector<std::uint32_t> ids;
  for (char byte : text) ids.push_back(kByteBase + static_cast<unsigned char>(byte));
  return ids;
}

std::vector<std::uint32_t> concat(std::initializer_list<std::vector<std::uint32_t>> parts) {
  std::vector<std::uint32_t> all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

// The `data:` payloads of an event stream, in order.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> events;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t end = body.find("\n\n", at);
    const std::string event = body.substr(at, end == std::string::npos ? end : end - at);
    EXPECT_TRUE(event.starts_with("data: ")) << event;
    if (event.starts_with("data: ")) events.push_back(event.substr(6));
    if (end == std::string::npos) break;
    at = end + 2;
  }
  return events;
}

TEST(MockTokenizerTest, TextIsOneTokenPerByteAfterBos) {
  const std::string text = "h\xC3\xA9llo";  // "héllo": é is two UTF-8 bytes
  const auto ids = encode_text(text, true);
  EXPECT_EQ(ids, concat({{kBosToken},
                         {kByteBase + 'h', kByteBase + 0xC3, kByteBase + 0xA9},
                         bytes_of("llo")}));
  EXPECT_EQ(encode_text(text, false), bytes_of(text));
  EXPECT_EQ(decode_tokens(ids), text);
}

TEST(MockTokenizerTest, SpecialTokensDecodeToNothingAndWordsToReadableText) {
  const std::vector<std::uint32_t> ids = {kBosToken,        kMessageStartToken,  kByteBase + 'a',
                                          kMessageEndToken, kFirstWordToken + 5, 40'000};
  EXPECT_EQ(decode_tokens(ids), fmt::format("a t{} t40000", kFirstWordToken + 5));
  EXPECT_EQ(token_text(kByteBase - 1), "");
}

TEST(MockTokenizerTest, ChatTemplateFramesEveryMessage) {
  const std::vector<ChatMessage> messages = {{"system", "be brief"}, {"user", "hi"}};
  const auto without = render_chat(messages, false);
  EXPECT_EQ(without, concat({{kBosToken, kMessageStartToken},
                             bytes_of("system\nbe brief"),
                             {kMessageEndToken, kMessageStartToken},
                             bytes_of("user\nhi"),
                             {kMessageEndToken}}));
  EXPECT_EQ(render_chat(messages, true),
            concat({without, {kMessageStartToken}, bytes_of("assistant\n")}));
  EXPECT_EQ(decode_tokens(without), "system\nbe briefuser\nhi");
}

class MockerOpenAiTest : public ::testing::Test {
 protected:
  void SetUp() override { start(true); }

  void start(bool render_endpoints, std::vector<std::string> lora_adapters = {}) {
    server_.reset();
    VllmEngineOptions options;
    options.model = "mock-model";
    options.lora_adapters = std::move(lora_adapters);
    options.http_port = 0;
    options.kv_events_port = testing::free_port();
    options.replay_port = testing::free_port();
    options.http_threads = 8;
    options.render_endpoints = render_endpoints;
    options.engine.block_size = kBlockSize;
    options.engine.num_gpu_blocks = kGpuBlocks;
    auto started = VllmEngineServer::start(options);
    ASSERT_TRUE(started) << started.error();
    server_ = std::move(*started);
    replay_port_ = options.replay_port;
    client_.emplace(server_->url());
    client_->set_read_timeout(30, 0);
  }

  // POSTs `body`; the status and the answer as text.
  std::pair<int, std::string> post_text(const std::string& path, const std::string& body) {
    const auto result = client_->Post(path, body, "application/json");
    if (!result) {
      ADD_FAILURE() << "POST " << path << ": " << httplib::to_string(result.error());
      return {0, ""};
    }
    return {result->status, result->body};
  }

  // POSTs `body`; the status and the answer as JSON (discarded when it is none).
  std::pair<int, json> post(const std::string& path, const json& body) {
    auto [status, text] = post_text(path, body.dump());
    return {status, json::parse(text, nullptr, false)};
  }

  std::string metrics() {
    const auto result = client_->Get("/metrics");
    return result ? result->body : "";
  }

  // Every BlockStored event the engine has published so far, read from its replay socket.
  std::vector<bridge::EngineBlockStored> stored_blocks() {
    zmq::context_t context{1};
    zmq::socket_t dealer{context, zmq::socket_type::dealer};
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvtimeo, 10'000);
    dealer.connect(fmt::format("tcp://127.0.0.1:{}", replay_port_));
    EXPECT_TRUE(worker::send_replay_request(dealer, 0));
    std::vector<bridge::EngineBlockStored> stored;
    while (true) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(dealer, std::back_inserter(frames))) {
        ADD_FAILURE() << "the replay socket did not answer";
        return stored;
      }
      const auto answer = worker::read_replay_answer(frames);
      if (!answer) {
        ADD_FAILURE() << "an unreadable replay answer";
        return stored;
      }
      if (answer->end()) return stored;
      const auto batch = bridge::decode_kv_event_batch(answer->payload->to_string_view());
      if (!batch) {
        ADD_FAILURE() << batch.error().message();
        continue;
      }
      for (const auto& event : batch->events) {
        if (const auto* block = std::get_if<bridge::EngineBlockStored>(&event)) {
          stored.push_back(*block);
        }
      }
    }
  }

  std::unique_ptr<VllmEngineServer> server_;
  std::optional<httplib::Client> client_;
  std::uint16_t replay_port_ = 0;
};

const json kChat = {{"model", "mock-model"},
                    {"messages",
                     {{{"role", "system"}, {"content", "You answer briefly."}},
                      {{"role", "user"}, {"content", "What is a KV cache?"}}}},
                    {"max_tokens", 4}};

// Three full blocks and a partial one, over no other test's tokens.
std::vector<std::uint32_t> testing_prompt() {
  std::vector<std::uint32_t> ids(3 * kBlockSize + 5);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = 9000 + static_cast<std::uint32_t>(i);
  return ids;
}

std::vector<std::uint32_t> chat_ids() {
  return render_chat(
      std::vector<ChatMessage>{{"system", "You answer briefly."}, {"user", "What is a KV cache?"}},
      true);
}

TEST_F(MockerOpenAiTest, TokenizeAndChatRenderGiveTheTemplateIds) {
  const auto [render_status, rendered] = post("/v1/chat/completions/render", kChat);
  ASSERT_EQ(render_status, 200) << rendered;
  ASSERT_TRUE(rendered.is_object()) << rendered;
  EXPECT_EQ(rendered.at("token_ids").get<std::vector<std::uint32_t>>(), chat_ids());
  EXPECT_TRUE(rendered.at("features").is_null());
  EXPECT_EQ(rendered.at("model"), "mock-model");
  EXPECT_EQ(rendered.at("stream"), false);
  EXPECT_EQ(rendered.at("sampling_params").at("max_tokens"), 4);
  EXPECT_TRUE(rendered.at("request_id").get<std::string>().starts_with("chatcmpl-"));

  json tokenize = kChat;
  tokenize.erase("max_tokens");
  const auto [status, tokens] = post("/tokenize", tokenize);
  ASSERT_EQ(status, 200) << tokens;
  EXPECT_EQ(tokens.at("tokens"), rendered.at("token_ids"));
  EXPECT_EQ(tokens.at("count"), chat_ids().size());
  EXPECT_EQ(tokens.at("max_model_len"), kBlockSize * kGpuBlocks);
  EXPECT_TRUE(tokens.at("token_strs").is_null());

  // Content as text parts is the same text; without a generation prompt the assistant's opening
  // is left out.
  json parts = tokenize;
  parts["messages"][1]["content"] = {{{"type", "text"}, {"text", "What is a "}},
                                     {{"type", "text"}, {"text", "KV cache?"}}};
  parts["add_generation_prompt"] = false;
  const auto [parts_status, parts_tokens] = post("/tokenize", parts);
  ASSERT_EQ(parts_status, 200) << parts_tokens;
  const auto without_prompt = parts_tokens.at("tokens").get<std::vector<std::uint32_t>>();
  const std::size_t opening = 1 + std::string_view{"assistant\n"}.size();
  ASSERT_EQ(without_prompt.size() + opening, chat_ids().size());
  EXPECT_TRUE(std::equal(without_prompt.begin(), without_prompt.end(), chat_ids().begin()));

  const auto [detok_status, detok] = post("/detokenize", {{"tokens", rendered.at("token_ids")}});
  ASSERT_EQ(detok_status, 200) << detok;
  EXPECT_EQ(detok.at("prompt"), "system\nYou answer briefly.user\nWhat is a KV cache?assistant\n");
}

TEST_F(MockerOpenAiTest, CompletionsRenderGivesOneObjectPerPrompt) {
  const auto [status, rendered] =
      post("/v1/completions/render", {{"prompt", {"ab", "c"}}, {"max_tokens", 3}, {"seed", 7}});
  ASSERT_EQ(status, 200) << rendered;
  ASSERT_TRUE(rendered.is_array()) << rendered;
  ASSERT_EQ(rendered.size(), 2U);
  EXPECT_EQ(rendered[0].at("token_ids").get<std::vector<std::uint32_t>>(),
            concat({{kBosToken}, bytes_of("ab")}));
  EXPECT_EQ(rendered[1].at("token_ids").get<std::vector<std::uint32_t>>(),
            concat({{kBosToken}, bytes_of("c")}));
  EXPECT_NE(rendered[0].at("request_id"), rendered[1].at("request_id"));
  EXPECT_EQ(rendered[0].at("sampling_params").at("seed"), 7);

  const auto [ids_status, ids] =
      post("/v1/completions/render", {{"prompt", {5, 6, 7}}, {"add_special_tokens", false}});
  ASSERT_EQ(ids_status, 200) << ids;
  ASSERT_EQ(ids.size(), 1U);
  EXPECT_EQ(ids[0].at("token_ids"), json({5, 6, 7}));

  const auto [plain_status, plain] =
      post("/v1/completions/render", {{"prompt", "ab"}, {"add_special_tokens", false}});
  ASSERT_EQ(plain_status, 200) << plain;
  EXPECT_EQ(plain[0].at("token_ids").get<std::vector<std::uint32_t>>(), bytes_of("ab"));
}

TEST_F(MockerOpenAiTest, ChatCompletionAnswersWithOneMessage) {
  json body = kChat;
  body["return_token_ids"] = true;
  const auto [status, answer] = post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << answer;
  EXPECT_TRUE(answer.at("id").get<std::string>().starts_with("chatcmpl-"));
  EXPECT_EQ(answer.at("object"), "chat.completion");
  EXPECT_EQ(answer.at("model"), "mock-model");
  EXPECT_TRUE(answer.at("created").is_number_integer());
  ASSERT_EQ(answer.at("choices").size(), 1U);
  const json& choice = answer.at("choices")[0];
  EXPECT_EQ(choice.at("index"), 0);
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  EXPECT_EQ(choice.at("finish_reason"), "length");
  EXPECT_TRUE(choice.at("logprobs").is_null());
  const auto generated = choice.at("token_ids").get<std::vector<std::uint32_t>>();
  ASSERT_EQ(generated.size(), 4U);
  for (std::uint32_t id : generated) EXPECT_GE(id, kFirstWordToken);
  EXPECT_EQ(choice.at("message").at("content"), decode_tokens(generated));
  const json& usage = answer.at("usage");
  EXPECT_EQ(usage.at("prompt_tokens"), chat_ids().size());
  EXPECT_EQ(usage.at("completion_tokens"), 4);
  EXPECT_EQ(usage.at("total_tokens"), chat_ids().size() + 4);
  EXPECT_EQ(usage.at("prompt_tokens_details").at("cached_tokens"), 0);

  // max_completion_tokens, the current name, wins over max_tokens.
  body["max_completion_tokens"] = 2;
  const auto [again_status, again] = post("/v1/chat/completions", body);
  ASSERT_EQ(again_status, 200) << again;
  EXPECT_EQ(again.at("usage").at("completion_tokens"), 2);
}

TEST_F(MockerOpenAiTest, ChatCompletionStreamsRoleThenContentThenUsage) {
  json body = kChat;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  const auto [status, text] = post_text("/v1/chat/completions", body.dump());
  ASSERT_EQ(status, 200) << text;
  const auto events = sse_data(text);
  // Role, four tokens, usage, [DONE].
  ASSERT_EQ(events.size(), 7U) << text;
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<json> chunks;
  for (std::size_t i = 0; i + 1 < events.size(); ++i) {
    chunks.push_back(json::parse(events[i], nullptr, false));
    ASSERT_TRUE(chunks.back().is_object()) << events[i];
    EXPECT_EQ(chunks.back().at("object"), "chat.completion.chunk");
    EXPECT_EQ(chunks.back().at("id"), chunks.front().at("id"));
    EXPECT_EQ(chunks.back().at("model"), "mock-model");
  }
  const json& role = chunks[0].at("choices")[0];
  EXPECT_EQ(role.at("delta"), json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(role.at("finish_reason").is_null());
  std::string content;
  for (std::size_t i = 1; i <= 4; ++i) {
    const json& choice = chunks[i].at("choices")[0];
    EXPECT_EQ(choice.at("index"), 0);
    EXPECT_FALSE(choice.at("delta").contains("role"));
    const std::string piece = choice.at("delta").at("content");
    EXPECT_TRUE(piece.starts_with(" t")) << piece;
    content += piece;
    if (i < 4) {
      EXPECT_TRUE(choice.at("finish_reason").is_null());
    } else {
      EXPECT_EQ(choice.at("finish_reason"), "length");
    }
    EXPECT_FALSE(chunks[i].contains("usage"));
  }
  EXPECT_FALSE(content.empty());
  EXPECT_TRUE(chunks[5].at("choices").empty());
  EXPECT_EQ(chunks[5].at("usage").at("prompt_tokens"), chat_ids().size());
  EXPECT_EQ(chunks[5].at("usage").at("completion_tokens"), 4);
  EXPECT_EQ(chunks[5].at("usage").at("prompt_tokens_details").at("cached_tokens"), 0);
}

TEST_F(MockerOpenAiTest, RepeatedLongChatPromptIsServedFromThePrefixCache) {
  json body = kChat;
  body["messages"][1]["content"] = std::string(300, 'k');
  const auto [first_status, first] = post("/v1/chat/completions", body);
  ASSERT_EQ(first_status, 200) << first;
  EXPECT_EQ(first.at("usage").at("prompt_tokens_details").at("cached_tokens"), 0);
  const std::uint64_t prompt_tokens = first.at("usage").at("prompt_tokens");

  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}, {"continuous_usage_stats", true}};
  const auto [second_status, text] = post_text("/v1/chat/completions", body.dump());
  ASSERT_EQ(second_status, 200) << text;
  const auto events = sse_data(text);
  ASSERT_GE(events.size(), 2U);
  const json usage = json::parse(events[events.size() - 2]).at("usage");
  const std::uint64_t cached = usage.at("prompt_tokens_details").at("cached_tokens");
  EXPECT_GT(cached, 0U);
  EXPECT_LT(cached, prompt_tokens);
  EXPECT_EQ(cached % kBlockSize, 0U);
  // Continuous usage: the role chunk too reports it, with nothing generated yet.
  const json role_usage = json::parse(events.front()).at("usage");
  EXPECT_EQ(role_usage.at("completion_tokens"), 0);
  EXPECT_EQ(role_usage.at("prompt_tokens_details").at("cached_tokens"), cached);
  EXPECT_EQ(testing::metric(metrics(), "vllm:prefix_cache_hits_total"),
            static_cast<double>(cached));
}

TEST_F(MockerOpenAiTest, KvEventsCarryTheRenderedTokenIds) {
  json body = kChat;
  body["messages"][1]["content"] = std::string(100, 'e');
  const auto [render_status, rendered] = post("/v1/chat/completions/render", body);
  ASSERT_EQ(render_status, 200) << rendered;
  const auto ids = rendered.at("token_ids").get<std::vector<std::uint32_t>>();
  const auto [status, answer] = post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << answer;

  std::vector<std::uint32_t> stored_tokens;
  for (const auto& block : stored_blocks()) {
    EXPECT_EQ(block.block_size, kBlockSize);
    stored_tokens.insert(stored_tokens.end(), block.token_ids.begin(), block.token_ids.end());
  }
  const std::size_t full_blocks = ids.size() / kBlockSize;
  ASSERT_GT(full_blocks, 0U);
  EXPECT_EQ(stored_tokens,
            std::vector<std::uint32_t>(ids.begin(), ids.begin() + full_blocks * kBlockSize));
}

TEST_F(MockerOpenAiTest, TextPromptCompletionIsTokenizedByBytes) {
  const auto [status, answer] =
      post("/v1/completions", {{"prompt", "hello world"}, {"max_tokens", 3}});
  ASSERT_EQ(status, 200) << answer;
  EXPECT_EQ(answer.at("object"), "text_completion");
  EXPECT_EQ(answer.at("usage").at("prompt_tokens"), 1 + 11);
  EXPECT_EQ(answer.at("usage").at("completion_tokens"), 3);
  EXPECT_EQ(answer.at("usage").at("prompt_tokens_details").at("cached_tokens"), 0);
  const std::string text = answer.at("choices")[0].at("text");
  EXPECT_EQ(std::count(text.begin(), text.end(), 't'), 3) << text;

  const auto [one_status, one] =
      post("/v1/completions",
           {{"prompt", {"hello world"}}, {"max_tokens", 1}, {"add_special_tokens", false}});
  ASSERT_EQ(one_status, 200) << one;
  EXPECT_EQ(one.at("usage").at("prompt_tokens"), 11);

  const auto [two_status, two] = post("/v1/completions", {{"prompt", {"a", "b"}}});
  EXPECT_EQ(two_status, 400) << two;
}

TEST_F(MockerOpenAiTest, RenderAndTokenizeCallsAreCounted) {
  const std::string counter = "kvr_mock_render_requests_total";
  EXPECT_EQ(testing::metric(metrics(), counter), 0.0);
  EXPECT_EQ(post("/v1/chat/completions/render", kChat).first, 200);
  EXPECT_EQ(post("/v1/completions/render", {{"prompt", "x"}}).first, 200);
  EXPECT_EQ(post("/tokenize", {{"prompt", "x"}}).first, 200);
  EXPECT_EQ(post("/tokenize", {{"prompt", "y"}}).first, 200);
  EXPECT_EQ(post("/v1/chat/completions", kChat).first, 200);
  const std::string text = metrics();
  EXPECT_EQ(testing::metric(text, counter), 4.0);
  EXPECT_EQ(testing::metric(text, counter + "{endpoint=\"/tokenize\""), 2.0);
  EXPECT_EQ(testing::metric(text, counter + "{endpoint=\"/v1/chat/completions/render\""), 1.0);
}

TEST_F(MockerOpenAiTest, WithoutRenderEndpointsRenderIs404AndTokenizeStillServes) {
  start(false);
  EXPECT_EQ(post("/v1/chat/completions/render", kChat).first, 404);
  EXPECT_EQ(post("/v1/completions/render", {{"prompt", "x"}}).first, 404);
  json tokenize = kChat;
  tokenize.erase("max_tokens");
  const auto [status, tokens] = post("/tokenize", tokenize);
  ASSERT_EQ(status, 200) << tokens;
  EXPECT_EQ(tokens.at("tokens").get<std::vector<std::uint32_t>>(), chat_ids());
  EXPECT_EQ(post("/v1/chat/completions", kChat).first, 200);
}

TEST_F(MockerOpenAiTest, UnknownModelIs404WithVllmsErrorObject) {
  json chat = kChat;
  chat["model"] = "other-model";
  for (const char* path : {"/v1/chat/completions", "/v1/chat/completions/render", "/tokenize",
                           "/v1/completions", "/v1/completions/render"}) {
    json body = chat;
    if (std::string_view{path}.find("chat") == std::string_view::npos) {
      body = {{"model", "other-model"}, {"prompt", "x"}};
    }
    const auto [status, answer] = post(path, body);
    EXPECT_EQ(status, 404) << path;
    ASSERT_TRUE(answer.is_object()) << path;
    const json& error = answer.at("error");
    EXPECT_EQ(error.at("type"), "NotFoundError") << path;
    EXPECT_EQ(error.at("code"), 404) << path;
    EXPECT_TRUE(error.at("param").is_null()) << path;
    EXPECT_NE(error.at("message").get<std::string>().find("other-model"), std::string::npos);
  }
}

TEST_F(MockerOpenAiTest, BadChatBodiesAre400) {
  json image = kChat;
  image["messages"][1]["content"] = {{{"type", "image_url"}, {"image_url", {{"url", "x"}}}}};
  json empty = kChat;
  empty["messages"] = json::array();
  json no_role = kChat;
  no_role["messages"][0].erase("role");
  json bad_stream = kChat;
  bad_stream["stream"] = "yes";
  for (const json& body : {image, empty, no_role, bad_stream}) {
    for (const char* path : {"/v1/chat/completions", "/v1/chat/completions/render"}) {
      const auto [status, answer] = post(path, body);
      EXPECT_EQ(status, 400) << path << " " << body;
      EXPECT_EQ(answer.at("error").at("type"), "BadRequestError") << answer;
    }
  }
  EXPECT_EQ(post_text("/v1/chat/completions", "{not json").first, 400);
  EXPECT_EQ(post("/detokenize", {{"tokens", {1, -2}}}).first, 400);
}

TEST_F(MockerOpenAiTest, ClientLeavingAChatStreamAbortsTheRequest) {
  json body = kChat;
  body["stream"] = true;
  body["max_tokens"] = 20'000;  // minutes at the modelled GPU's pace
  httplib::Request request;
  request.method = "POST";
  request.path = "/v1/chat/completions";
  request.set_header("Content-Type", "application/json");
  request.body = body.dump();
  std::string received;
  request.content_receiver = [&](const char* data, std::size_t size, std::uint64_t, std::uint64_t) {
    received.append(data, size);
    return received.find("\"content\":\" t") == std::string::npos;  // leave at the first token
  };
  client_->send(request);
  EXPECT_NE(received.find("\"role\":\"assistant\""), std::string::npos) << received;
  EXPECT_TRUE(testing::wait_until(
      [&] {
        const std::string text = metrics();
        return text.find("vllm:num_requests_running{") != std::string::npos &&
               testing::metric(text, "vllm:num_requests_running") == 0.0;
      },
      10s))
      << metrics();
  EXPECT_LT(testing::metric(metrics(), "vllm:generation_tokens_total"), 20'000.0);
}

// ---- LoRA adapters ----------------------------------------------------------------------------

const std::vector<std::string> kAdapters = {"sql-lora", "chat-lora"};

TEST_F(MockerOpenAiTest, ModelsListTheLoraAdaptersAfterTheBaseModel) {
  start(true, kAdapters);
  const auto result = client_->Get("/v1/models");
  ASSERT_TRUE(result);
  ASSERT_EQ(result->status, 200) << result->body;
  const json models = json::parse(result->body, nullptr, false);
  ASSERT_TRUE(models.is_object()) << result->body;
  EXPECT_EQ(models.at("object"), "list");
  const json& data = models.at("data");
  ASSERT_EQ(data.size(), 3U) << data;
  const json& base = data[0];
  EXPECT_EQ(base.at("id"), "mock-model");
  EXPECT_EQ(base.at("root"), "mock-model");
  EXPECT_TRUE(base.at("parent").is_null());
  for (std::size_t i = 0; i < kAdapters.size(); ++i) {
    const json& adapter = data[i + 1];
    EXPECT_EQ(adapter.at("id"), kAdapters[i]);
    EXPECT_EQ(adapter.at("object"), "model");
    EXPECT_EQ(adapter.at("owned_by"), "vllm");
    EXPECT_EQ(adapter.at("root"), "/adapters/" + kAdapters[i]);
    EXPECT_EQ(adapter.at("parent"), "mock-model");
    EXPECT_EQ(adapter.at("created"), base.at("created"));
    EXPECT_EQ(adapter.at("max_model_len"), kBlockSize * kGpuBlocks);
  }
}

TEST_F(MockerOpenAiTest, AnAdapterIsServedUnderItsNameAndAnotherNameStays404) {
  start(true, kAdapters);
  json chat = kChat;
  chat["model"] = "sql-lora";
  const auto [status, answer] = post("/v1/chat/completions", chat);
  ASSERT_EQ(status, 200) << answer;
  EXPECT_EQ(answer.at("model"), "sql-lora");
  EXPECT_EQ(answer.at("usage").at("completion_tokens"), 4);

  json streamed = chat;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const auto [stream_status, text] = post_text("/v1/chat/completions", streamed.dump());
  ASSERT_EQ(stream_status, 200) << text;
  const auto events = sse_data(text);
  ASSERT_GE(events.size(), 2U) << text;
  for (std::size_t i = 0; i + 1 < events.size(); ++i) {
    EXPECT_EQ(json::parse(events[i]).at("model"), "sql-lora") << events[i];
  }

  const json completion = {{"model", "chat-lora"}, {"prompt", "x"}, {"max_tokens", 2}};
  const auto [completion_status, completed] = post("/v1/completions", completion);
  ASSERT_EQ(completion_status, 200) << completed;
  EXPECT_EQ(completed.at("model"), "chat-lora");
  const auto [render_status, rendered] = post("/v1/chat/completions/render", chat);
  ASSERT_EQ(render_status, 200) << rendered;
  EXPECT_EQ(rendered.at("model"), "sql-lora");
  EXPECT_EQ(rendered.at("token_ids").get<std::vector<std::uint32_t>>(), chat_ids());
  const auto [completion_render_status, completion_rendered] =
      post("/v1/completions/render", completion);
  ASSERT_EQ(completion_render_status, 200) << completion_rendered;
  EXPECT_EQ(completion_rendered[0].at("model"), "chat-lora");
  EXPECT_EQ(post("/tokenize", {{"model", "chat-lora"}, {"prompt", "x"}}).first, 200);

  chat["model"] = "no-such-lora";
  const auto [unknown_status, unknown] = post("/v1/chat/completions", chat);
  EXPECT_EQ(unknown_status, 404) << unknown;
  EXPECT_EQ(unknown.at("error").at("type"), "NotFoundError");
  EXPECT_EQ(post("/tokenize", {{"model", "no-such-lora"}, {"prompt", "x"}}).first, 404);
}

TEST_F(MockerOpenAiTest, AnAdaptersPrefixCacheIsApartFromTheBaseModels) {
  start(true, kAdapters);
  json body = kChat;
  body["messages"][1]["content"] = std::string(300, 'l');
  const auto cached_tokens = [&](const std::string& model) -> std::uint64_t {
    body["model"] = model;
    const auto [status, answer] = post("/v1/chat/completions", body);
    EXPECT_EQ(status, 200) << answer;
    EXPECT_EQ(answer.value("model", ""), model);
    return answer.at("usage").at("prompt_tokens_details").at("cached_tokens");
  };
  EXPECT_EQ(cached_tokens("mock-model"), 0U);
  // The base model's blocks are cached now, but an adapter's hashes are its own.
  EXPECT_EQ(cached_tokens("sql-lora"), 0U);
  const std::uint64_t repeat = cached_tokens("sql-lora");
  EXPECT_GT(repeat, 0U);
  EXPECT_EQ(repeat % kBlockSize, 0U);
  EXPECT_EQ(cached_tokens("chat-lora"), 0U);
}

TEST_F(MockerOpenAiTest, KvEventsOfAnAdapterCarryItsLoraIdAndName) {
  start(true, kAdapters);
  json base = kChat;
  base["messages"][1]["content"] = std::string(60, 'b');
  ASSERT_EQ(post("/v1/chat/completions", base).first, 200);
  json body = kChat;
  body["model"] = "chat-lora";
  body["messages"][1]["content"] = std::string(100, 'e');
  const auto [render_status, rendered] = post("/v1/chat/completions/render", body);
  ASSERT_EQ(render_status, 200) << rendered;
  const auto ids = rendered.at("token_ids").get<std::vector<std::uint32_t>>();
  const auto [status, answer] = post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << answer;

  bridge::EngineKvEventBatch adapter_events;
  std::vector<std::uint32_t> adapter_tokens;
  std::size_t base_blocks = 0;
  for (const auto& block : stored_blocks()) {
    EXPECT_EQ(block.block_size, kBlockSize);
    if (!block.lora_name) {
      // The base model's blocks stay as they were: no LoRA at all.
      EXPECT_FALSE(block.lora_id.has_value());
      base_blocks += block.block_hashes.size();
      continue;
    }
    EXPECT_EQ(*block.lora_name, "chat-lora");
    EXPECT_EQ(block.lora_id, 2);  // its 1-based position among the adapters
    EXPECT_EQ(bridge::cache_namespace_of(block), "chat-lora");
    adapter_tokens.insert(adapter_tokens.end(), block.token_ids.begin(), block.token_ids.end());
    adapter_events.events.emplace_back(block);
  }
  EXPECT_GT(base_blocks, 0U);
  const std::size_t full_blocks = ids.size() / kBlockSize;
  ASSERT_GT(full_blocks, 0U);
  const std::vector<std::uint32_t> full(ids.begin(), ids.begin() + full_blocks * kBlockSize);
  EXPECT_EQ(adapter_tokens, full);

  // A bridge turns them into kvr's hashes in the adapter's namespace.
  auto translator = bridge::KvTranslator::create(
      {.worker_id = 1, .block_size = kBlockSize, .capacity_blocks = kGpuBlocks});
  ASSERT_TRUE(translator) << translator.error();
  const auto translated = translator->translate(0, adapter_events);
  ASSERT_TRUE(translated);
  std::vector<BlockHash> kvr_hashes;
  for (const auto& event : translated->events) {
    const auto* stored = std::get_if<KvStoredEvent>(&event);
    ASSERT_NE(stored, nullptr);
    kvr_hashes.insert(kvr_hashes.end(), stored->block_hashes.begin(), stored->block_hashes.end());
  }
  EXPECT_EQ(kvr_hashes, discovery::BlockHasher(kBlockSize, "chat-lora").sequence_hashes(full));
}

// The parameters vLLM's disaggregated proxy sends with a prefill hop.
const json kPrefillHop = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                          {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                          {"remote_host", nullptr},      {"remote_port", nullptr}};

TEST_F(MockerOpenAiTest, PrefillHopMakesOneTokenAndAnswersWithTheDecodeHopsParameters) {
  json body = kChat;
  body["max_tokens"] = 8;
  body["kv_transfer_params"] = kPrefillHop;
  const auto [status, answer] = post("/v1/chat/completions", body);
  ASSERT_EQ(status, 200) << answer;
  EXPECT_EQ(answer.at("choices")[0].at("finish_reason"), "length");
  EXPECT_EQ(answer.at("usage").at("completion_tokens"), 1);
  const json& params = answer.at("kv_transfer_params");
  ASSERT_TRUE(params.is_object()) << answer;
  EXPECT_EQ(params.at("do_remote_prefill"), true);
  EXPECT_EQ(params.at("do_remote_decode"), false);
  // One id per block of the prompt, the partial last one included.
  const std::size_t prompt_blocks = (chat_ids().size() + kBlockSize - 1) / kBlockSize;
  EXPECT_EQ(params.at("remote_block_ids").size(), prompt_blocks);
  EXPECT_TRUE(params.at("remote_engine_id").is_string());
  EXPECT_TRUE(params.at("remote_request_id").is_string());
  EXPECT_EQ(params.at("remote_host"), "127.0.0.1");
  EXPECT_TRUE(params.at("remote_port").is_number_integer());
  EXPECT_EQ(params.at("tp_size"), 1);

  // An ordinary answer has them null, as vLLM's.
  const auto [plain_status, plain] = post("/v1/chat/completions", kChat);
  ASSERT_EQ(plain_status, 200) << plain;
  ASSERT_TRUE(plain.contains("kv_transfer_params"));
  EXPECT_TRUE(plain.at("kv_transfer_params").is_null());
}

TEST_F(MockerOpenAiTest, DecodeHopServesTheWholeOutputCountingTheTransferredPromptAsCached) {
  // The prefill engine apart, so that the decode engine holds nothing of the prompt.
  VllmEngineOptions options;
  options.http_port = 0;
  options.kv_events_port = testing::free_port();
  options.replay_port = 0;
  options.http_threads = 4;
  options.engine.block_size = kBlockSize;
  options.engine.num_gpu_blocks = kGpuBlocks;
  auto prefill_engine = VllmEngineServer::start(options);
  ASSERT_TRUE(prefill_engine) << prefill_engine.error();
  httplib::Client prefill_client{(*prefill_engine)->url()};
  prefill_client.set_read_timeout(30, 0);

  json body = {{"model", "mock-model"}, {"prompt", testing_prompt()}, {"max_tokens", 6}};
  json prefill_body = body;
  prefill_body["kv_transfer_params"] = kPrefillHop;
  const auto prefill =
      prefill_client.Post("/v1/completions", prefill_body.dump(), "application/json");
  ASSERT_TRUE(prefill);
  ASSERT_EQ(prefill->status, 200) << prefill->body;
  const json params = json::parse(prefill->body).at("kv_transfer_params");
  ASSERT_TRUE(params.is_object()) << prefill->body;

  body["kv_transfer_params"] = params;
  const auto [status, answer] = post("/v1/completions", body);
  ASSERT_EQ(status, 200) << answer;
  EXPECT_EQ(answer.at("usage").at("completion_tokens"), 6);
  EXPECT_EQ(answer.at("choices")[0].at("finish_reason"), "length");
  // Every prompt token but the last came by transfer; the last is computed for its logits.
  EXPECT_EQ(answer.at("usage").at("prompt_tokens_details").at("cached_tokens"),
            testing_prompt().size() - 1);
  EXPECT_TRUE(answer.at("kv_transfer_params").is_null());
  // The decode engine announced the transferred full blocks as stored, with their tokens.
  std::vector<std::uint32_t> stored_tokens;
  for (const auto& block : stored_blocks()) {
    stored_tokens.insert(stored_tokens.end(), block.token_ids.begin(), block.token_ids.end());
  }
  const auto prompt = testing_prompt();
  EXPECT_EQ(stored_tokens,
            std::vector<std::uint32_t>(prompt.begin(),
                                       prompt.begin() + (prompt.size() / kBlockSize) * kBlockSize));
}

TEST_F(MockerOpenAiTest, MalformedKvTransferParamsAre400NamingTheField) {
  const std::vector<std::pair<json, std::string>> bad = {
      {"yes", "kv_transfer_params"},
      {{{"do_remote_decode", 1}}, "kv_transfer_params.do_remote_decode"},
      {{{"do_remote_prefill", true}, {"remote_block_ids", "0,1"}},
       "kv_transfer_params.remote_block_ids"},
      {{{"do_remote_prefill", true}, {"remote_block_ids", {0, -1}}},
       "kv_transfer_params.remote_block_ids"},
      {{{"do_remote_prefill", true}, {"remote_port", "5600"}}, "kv_transfer_params.remote_port"}};
  for (const auto& [params, field] : bad) {
    for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
      json body = std::string_view{path} == "/v1/completions"
                      ? json{{"model", "mock-model"}, {"prompt", "hello"}}
                      : kChat;
      body["kv_transfer_params"] = params;
      const auto [status, answer] = post(path, body);
      EXPECT_EQ(status, 400) << path << " " << params;
      ASSERT_TRUE(answer.is_object()) << path;
      EXPECT_EQ(answer.at("error").at("type"), "BadRequestError") << answer;
      EXPECT_NE(answer.at("error").at("message").get<std::string>().find(field), std::string::npos)
          << answer;
    }
  }
}

TEST(MockerOpenAiCliTest, BadTransferFlagExitsWithTwoNamingTheFlag) {
  const std::string binary = kvr::testing::kvr_binary();
  testing::TemporaryDirectory directory;
  const std::vector<std::pair<std::string, std::string>> bad = {{"--transfer-latency-ms", "-1"},
                                                                {"--transfer-latency-ms", "inf"},
                                                                {"--transfer-ms-per-block", "nan"},
                                                                {"--transfer-ms-per-block", "x"}};
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const auto& [flag, value] = bad[i];
    for (const char* speak : {"kvr", "vllm"}) {
      const std::vector<std::string> argv = {binary,
                                             "mocker",
                                             "--speak",
                                             speak,
                                             "--http-port",
                                             "0",
                                             "--kv-events-port",
                                             std::to_string(testing::free_port()),
                                             "--kv-events-replay-port",
                                             "0",
                                             flag,
                                             value};
      const testing::ProcessRun run = testing::run_process(
          argv, directory.path() / fmt::format("kvr-{}-{}.log", speak, i), 60s);
      ASSERT_TRUE(run.exit_code.has_value()) << flag << " " << value << ": did not exit\n"
                                             << run.output;
      EXPECT_EQ(*run.exit_code, 2) << flag << " " << value << "\n" << run.output;
      EXPECT_NE(run.output.find(flag), std::string::npos) << run.output;
      // Refused for its value, not as an unknown flag.
      EXPECT_EQ(run.output.find("not expected"), std::string::npos) << run.output;
    }
  }
}

TEST(MockerOpenAiCliTest, BadLoraAdapterExitsWithTwoNamingTheOption) {
  const std::string binary = kvr::testing::kvr_binary();
  testing::TemporaryDirectory directory;
  const std::vector<std::vector<std::string>> bad = {
      {"--lora-adapter", ""},
      {"--lora-adapter", "sql-lora", "--lora-adapter", "sql-lora"},
      {"--lora-adapter", "base-model"}};
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const std::vector<std::string>& adapters = bad[i];
    std::vector<std::string> argv = {binary,
                                     "mocker",
                                     "--speak",
                                     "vllm",
                                     "--model",
                                     "base-model",
                                     "--http-port",
                                     "0",
                                     "--kv-events-port",
                                     std::to_string(testing::free_port()),
                                     "--kv-events-replay-port",
                                     "0"};
    argv.insert(argv.end(), adapters.begin(), adapters.end());
    const testing::ProcessRun run =
        testing::run_process(argv, directory.path() / fmt::format("kvr-{}.log", i), 60s);
    const std::string given = fmt::format("{}", fmt::join(adapters, " "));
    ASSERT_TRUE(run.exit_code.has_value()) << given << ": did not exit\n" << run.output;
    EXPECT_EQ(*run.exit_code, 2) << given << "\n" << run.output;
    EXPECT_NE(run.output.find("--lora-adapter"), std::string::npos) << given << "\n" << run.output;
  }
}

}  // namespace
}  // namespace kvr::mocker
