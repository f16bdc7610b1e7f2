// OpenAI answers made from kvr's generate stream (workers without an HTTP URL): the chunks' token
// ids decoded by the bundled Qwen3 tokenizer into a chat completion or a completion, streamed as
// Server-Sent Events or gathered, with usage; a chunk that reports an error becomes the client's
// error.
#include "selection/front_door/generated_answer.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/tokenizer_data.hpp"

namespace kvr::front_door {
namespace {

using Json = nlohmann::json;

class GeneratedAnswerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loaded = tokenizer::Tokenizer::load(
        std::filesystem::path{testing::bundled_tokenizers_dir()} / "qwen3");
    ASSERT_TRUE(loaded) << loaded.error().message;
    tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*loaded));
  }

  tokenizer::TokenIds ids(std::string_view text) const {
    auto encoded = tokenizer_->encode(text, false);
    EXPECT_TRUE(encoded);
    return encoded ? *encoded : tokenizer::TokenIds{};
  }

  static GenerationRequest request(Endpoint endpoint, bool stream, bool include_usage = false) {
    GenerationRequest request;
    request.endpoint = endpoint;
    request.model = "m";
    request.stream = stream;
    request.include_usage = include_usage;
    return request;
  }

  static v1::GenerateChunk chunk(std::uint32_t index, const tokenizer::TokenIds& tokens,
                                 bool finished = false, std::string reason = {}) {
    v1::GenerateChunk chunk;
    chunk.set_request_id("r");
    chunk.set_index(index);
    for (const auto id : tokens) chunk.add_token_ids(id);
    if (index == 0) chunk.set_cached_prompt_tokens(32);
    chunk.set_finished(finished);
    chunk.set_finish_reason(std::move(reason));
    return chunk;
  }

  // The JSON payloads of a run of Server-Sent Events, and whether it ended with [DONE].
  static std::vector<Json> events(const std::string& text, bool* done = nullptr) {
    std::vector<Json> out;
    std::size_t at = 0;
    while ((at = text.find("data: ", at)) != std::string::npos) {
      const std::size_t end = text.find("\n\n", at);
      const std::string data = text.substr(at + 6, end - at - 6);
      if (data == "[DONE]") {
        if (done != nullptr) *done = true;
      } else {
        out.push_back(Json::parse(data));
      }
      at = end;
    }
    return out;
  }

  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
};

TEST_F(GeneratedAnswerTest, AGatheredChatAnswerDecodesEveryChunkWithUsage) {
  GeneratedAnswer answer{request(Endpoint::chat_completions, false), *tokenizer_, "r1", 100, 7};
  // "你好" split so that a chunk ends inside a character: nothing is lost or mangled.
  const auto hello = ids("Hello, 你好 world");
  ASSERT_GE(hello.size(), 3U);
  const tokenizer::TokenIds first(hello.begin(), hello.begin() + 2);
  const tokenizer::TokenIds rest(hello.begin() + 2, hello.end());
  EXPECT_EQ(answer.take(chunk(0, first)), "");
  EXPECT_FALSE(answer.finished());
  EXPECT_EQ(answer.take(chunk(1, rest, true, "length")), "");
  ASSERT_TRUE(answer.finished());
  const Json whole = Json::parse(answer.whole());
  EXPECT_EQ(whole["id"], "chatcmpl-r1");
  EXPECT_EQ(whole["object"], "chat.completion");
  EXPECT_EQ(whole["created"], 7);
  EXPECT_EQ(whole["model"], "m");
  EXPECT_EQ(whole["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(whole["choices"][0]["message"]["content"], "Hello, 你好 world");
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole["usage"]["prompt_tokens"], 100);
  EXPECT_EQ(whole["usage"]["completion_tokens"], hello.size());
  EXPECT_EQ(whole["usage"]["total_tokens"], 100 + hello.size());
  EXPECT_EQ(whole["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
}

TEST_F(GeneratedAnswerTest, AStreamedChatSendsTheRoleThenTextThenTheReasonUsageAndDone) {
  GeneratedAnswer answer{request(Endpoint::chat_completions, true, true), *tokenizer_, "r2", 10, 7};
  const auto first = events(answer.take(chunk(0, ids("Hi"))));
  ASSERT_EQ(first.size(), 2U);
  EXPECT_EQ(first[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(first[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first[0]["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(first[1]["choices"][0]["delta"]["content"], "Hi");
  bool done = false;
  const auto last = events(answer.take(chunk(1, ids(" there"), true, "eos")), &done);
  EXPECT_TRUE(done);
  ASSERT_EQ(last.size(), 3U);
  EXPECT_EQ(last[0]["choices"][0]["delta"]["content"], " there");
  EXPECT_EQ(last[1]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(last[2]["choices"].empty());
  EXPECT_EQ(last[2]["usage"]["completion_tokens"], 2);
  EXPECT_EQ(last[2]["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
  // Nothing after the end.
  EXPECT_EQ(answer.take(chunk(2, ids("x"))), "");
}

TEST_F(GeneratedAnswerTest, AStreamedCompletionCarriesTextWithoutUsageUnlessAsked) {
  GeneratedAnswer answer{request(Endpoint::completions, true), *tokenizer_, "r3", 10, 7};
  bool done = false;
  const auto all = events(answer.take(chunk(0, ids("one two"), true, "length")), &done);
  EXPECT_TRUE(done);
  ASSERT_EQ(all.size(), 2U);
  EXPECT_EQ(all[0]["id"], "cmpl-r3");
  EXPECT_EQ(all[0]["object"], "text_completion");
  EXPECT_EQ(all[0]["choices"][0]["text"], "one two");
  EXPECT_EQ(all[1]["choices"][0]["finish_reason"], "length");
}

TEST_F(GeneratedAnswerTest, SpecialTokensStayOutOfTheTextUnlessAskedFor) {
  const auto end = ids("<|im_end|>");
  ASSERT_EQ(end.size(), 1U);
  tokenizer::TokenIds tokens = ids("done");
  tokens.push_back(end[0]);
  GeneratedAnswer skipped{request(Endpoint::completions, false), *tokenizer_, "r4", 1, 7};
  skipped.take(chunk(0, tokens, true, "stop"));
  EXPECT_EQ(Json::parse(skipped.whole())["choices"][0]["text"], "done");
  auto keep = request(Endpoint::completions, false);
  keep.sampling.set_skip_special_tokens(false);
  GeneratedAnswer kept{keep, *tokenizer_, "r5", 1, 7};
  kept.take(chunk(0, tokens, true, "stop"));
  EXPECT_EQ(Json::parse(kept.whole())["choices"][0]["text"], "done<|im_end|>");
}

TEST_F(GeneratedAnswerTest, AChunkThatReportsAnErrorIsTheClientsError) {
  GeneratedAnswer answer{request(Endpoint::chat_completions, true), *tokenizer_, "r6", 1, 7};
  v1::GenerateChunk failed = chunk(0, {}, true, "error");
  failed.mutable_error()->set_code(v1::ROUTE_ERROR_TIMEOUT);
  failed.mutable_error()->set_message("no first token within 300 ms");
  const auto error = answer.failure(failed);
  ASSERT_TRUE(error);
  EXPECT_EQ(error->status, 504U);
  EXPECT_EQ(error->message, "no first token within 300 ms");
  EXPECT_FALSE(answer.failure(chunk(0, ids("ok"))));
}

}  // namespace
}  // namespace kvr::front_door
