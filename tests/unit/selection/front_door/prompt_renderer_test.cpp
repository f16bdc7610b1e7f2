// The native renders of PromptRenderer with the bundled qwen3 tokenizer (KVR_TOKENIZERS_DIR), for
// a model without engines: prompts over the token limit refused with a 400 naming it, small
// bodies rendered at once and larger ones on the pool (answered on the caller's executor), the
// pool's refusals as 503s, and what happens to renders still waiting when the pool or the
// caller's io_context ends. A blocking task submitted to a shared pool holds its only thread, so
// every wait is forced, never timed.
#include "selection/front_door/prompt_renderer.hpp"

#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <boost/asio/io_context.hpp>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "selection/wire/route_messages.hpp"
#include "tests/unit/selection/front_door/render_pool_blocker.hpp"

namespace kvr::front_door {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<const NativeTokenizers> qwen3() {
  static const auto tokenizers = [] {
    auto loaded = tokenizer::PromptTokenizer::load(std::string{KVR_TOKENIZERS_DIR} + "/qwen3");
    EXPECT_TRUE(loaded.has_value()) << (loaded ? "" : loaded.error().message);
    auto map = std::make_shared<NativeTokenizers>();
    map->emplace("qwen3", std::move(*loaded));
    return map;
  }();
  return tokenizers;
}

std::string completion_body(const std::string& prompt) {
  return nlohmann::json{{"model", "qwen3"}, {"prompt", prompt}}.dump();
}

std::string chat_body(const std::string& content) {
  return nlohmann::json{
      {"model", "qwen3"},
      {"messages", nlohmann::json::array({{{"role", "user"}, {"content", content}}})}}
      .dump();
}

using render_tests::Blocker;

class PromptRendererTest : public ::testing::Test {
 protected:
  std::unique_ptr<PromptRenderer> make_renderer(NativeRenderOptions options,
                                                std::shared_ptr<RenderPool> pool = nullptr) {
    return std::make_unique<PromptRenderer>(selection::TokenizerModes{}, 8, std::chrono::seconds{5},
                                            metrics_, qwen3(), options, std::move(pool));
  }

  // Starts a render of `body` (no engines: the native tokenizer); the result, once there, lands
  // in the returned slot.
  std::shared_ptr<std::optional<RenderResult>> start(PromptRenderer& renderer, Endpoint endpoint,
                                                     const std::string& body,
                                                     std::string_view client = {}) {
    auto request = parse_generation_request(endpoint, body);
    EXPECT_TRUE(request.has_value()) << (request ? "" : request.error().message);
    auto slot = std::make_shared<std::optional<RenderResult>>();
    renderer.render(
        io_.get_executor(), *request, body, {},
        [slot](RenderResult result) { *slot = std::move(result); }, client);
    return slot;
  }

  // A render carried to its end: the io_context runs until its answer has run.
  RenderResult render(PromptRenderer& renderer, Endpoint endpoint, const std::string& body) {
    auto slot = start(renderer, endpoint, body);
    io_.restart();
    io_.run();
    EXPECT_TRUE(slot->has_value());
    return std::move(**slot);
  }

  std::size_t token_count(const std::string& prompt) {
    auto ids = qwen3()->at("qwen3")->encode_prompt(prompt);
    EXPECT_TRUE(ids.has_value());
    return ids->size();
  }

  std::shared_ptr<metrics::MetricsRegistry> metrics_ = std::make_shared<metrics::MetricsRegistry>();
  boost::asio::io_context io_;
};

TEST_F(PromptRendererTest, TheTokenLimitIsTheRoutesLimit) {
  EXPECT_EQ(NativeRenderOptions{}.max_prompt_tokens, RouteDecodeLimits{}.max_prompt_tokens);
}

TEST_F(PromptRendererTest, RefusesAPromptOverTheTokenLimitNamingTheLimit) {
  const std::string prompt = "one two three four five six seven eight";
  const std::size_t tokens = token_count(prompt);
  const auto renderer = make_renderer({.max_prompt_tokens = tokens - 1});
  const RenderResult result = render(*renderer, Endpoint::completions, completion_body(prompt));
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().status, 400u);
  EXPECT_EQ(
      result.error().message,
      fmt::format("the prompt has more than {} tokens, the longest the router takes", tokens - 1));
  EXPECT_EQ(result.error().param, "prompt");
  EXPECT_EQ(
      metrics_->value("kvr_native_renders_total", {{"model", "qwen3"}, {"outcome", "refused"}}), 1);
}

TEST_F(PromptRendererTest, RendersAPromptOfExactlyTheTokenLimit) {
  const std::string prompt = "one two three four five six seven eight";
  const std::size_t tokens = token_count(prompt);
  const auto renderer = make_renderer({.max_prompt_tokens = tokens});
  const RenderResult result = render(*renderer, Endpoint::completions, completion_body(prompt));
  ASSERT_TRUE(result.has_value()) << result.error().message;
  EXPECT_EQ(result->tokens.size(), tokens);
}

TEST_F(PromptRendererTest, RefusesAChatOverTheTokenLimitNamingTheLimit) {
  const std::string body = chat_body("hello there, how are you?");
  const std::size_t tokens =
      render(*make_renderer({}), Endpoint::chat_completions, body).value().tokens.size();
  const auto renderer = make_renderer({.max_prompt_tokens = tokens - 1});
  const RenderResult result = render(*renderer, Endpoint::chat_completions, body);
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().status, 400u);
  EXPECT_EQ(
      result.error().message,
      fmt::format("the prompt has more than {} tokens, the longest the router takes", tokens - 1));
  EXPECT_EQ(result.error().param, "messages");
}

TEST_F(PromptRendererTest, RendersSmallBodiesAtOnce) {
  const auto renderer = make_renderer({.inline_below_bytes = 4096});
  const auto slot = start(*renderer, Endpoint::completions, completion_body("hello there"));
  // No run of the io_context: the answer came before render returned.
  ASSERT_TRUE(slot->has_value());
  EXPECT_TRUE(slot->value().has_value());
}

TEST_F(PromptRendererTest, RendersLargerBodiesOnThePoolAndAnswersOnTheExecutor) {
  const auto renderer = make_renderer({.inline_below_bytes = 0});
  std::optional<std::thread::id> answered_on;
  std::optional<RenderResult> result;
  const std::string body = completion_body("hello there");
  auto request = parse_generation_request(Endpoint::completions, body);
  ASSERT_TRUE(request.has_value());
  renderer->render(io_.get_executor(), *request, body, {}, [&](RenderResult key) {
    answered_on = std::this_thread::get_id();
    result = std::move(key);
  });
  EXPECT_FALSE(result.has_value());  // only the io_context runs the answer
  io_.run();  // returns once the answer ran: the pending render counts as the io_context's work
  ASSERT_TRUE(result.has_value());
  EXPECT_TRUE(result->has_value());
  EXPECT_EQ(answered_on, std::this_thread::get_id());
  EXPECT_THAT(metrics_->render(), HasSubstr("kvr_native_render_seconds_count 1"));
}

TEST_F(PromptRendererTest, RefusesWithServiceUnavailableWhenTheClientsQueueIsFull) {
  const auto pool = make_native_render_pool(
      {.threads = 1, .max_queued = 10, .max_queued_per_client = 1}, metrics_);
  const auto renderer = make_renderer({.inline_below_bytes = 0}, pool);
  Blocker blocker;
  ASSERT_TRUE(pool->submit("", blocker.task()));
  blocker.wait_started();
  const std::string body = completion_body("hello there");
  const auto waiting = start(*renderer, Endpoint::completions, body, "10.0.0.1");
  const auto refused = start(*renderer, Endpoint::completions, body, "10.0.0.1");
  // Refused at once; another client's render still waits its turn.
  ASSERT_TRUE(refused->has_value());
  ASSERT_FALSE(refused->value().has_value());
  EXPECT_EQ(refused->value().error().status, 503u);
  EXPECT_EQ(refused->value().error().code, "service_unavailable");
  EXPECT_EQ(metrics_->value("kvr_native_renders_refused_total", {{"reason", "client_queue_full"}}),
            1);
  const auto other_client = start(*renderer, Endpoint::completions, body, "10.0.0.2");
  EXPECT_EQ(metrics_->value("kvr_native_render_queue"), 2);
  blocker.release();
  io_.run();
  ASSERT_TRUE(waiting->has_value());
  EXPECT_TRUE(waiting->value().has_value());
  ASSERT_TRUE(other_client->has_value());
  EXPECT_TRUE(other_client->value().has_value());
  EXPECT_EQ(metrics_->value("kvr_native_render_queue"), 0);
}

TEST_F(PromptRendererTest, RefusesWithServiceUnavailableWhenThePoolsQueueIsFull) {
  const auto pool = make_native_render_pool(
      {.threads = 1, .max_queued = 1, .max_queued_per_client = 10}, metrics_);
  const auto renderer = make_renderer({.inline_below_bytes = 0}, pool);
  Blocker blocker;
  ASSERT_TRUE(pool->submit("", blocker.task()));
  blocker.wait_started();
  const std::string body = completion_body("hello there");
  const auto waiting = start(*renderer, Endpoint::completions, body, "10.0.0.1");
  const auto refused = start(*renderer, Endpoint::completions, body, "10.0.0.2");
  ASSERT_TRUE(refused->has_value());
  ASSERT_FALSE(refused->value().has_value());
  EXPECT_EQ(refused->value().error().status, 503u);
  EXPECT_EQ(metrics_->value("kvr_native_renders_refused_total", {{"reason", "queue_full"}}), 1);
  blocker.release();
  io_.run();
  ASSERT_TRUE(waiting->has_value());
  EXPECT_TRUE(waiting->value().has_value());
}

TEST_F(PromptRendererTest, RendersStillWaitingWhenThePoolEndsAreAnsweredServiceUnavailable) {
  auto pool = make_native_render_pool({.threads = 1}, metrics_);
  auto renderer = make_renderer({.inline_below_bytes = 0}, pool);
  Blocker blocker;
  ASSERT_TRUE(pool->submit("", blocker.task()));
  blocker.wait_started();
  const auto waiting = start(*renderer, Endpoint::completions, completion_body("hello"), "a");
  renderer.reset();
  // The pool's destructor cancels the waiting render, then waits for the blocker.
  std::thread destroyer{[pool = std::move(pool)]() mutable { pool.reset(); }};
  io_.run_one();  // the cancelled render's answer
  blocker.release();
  destroyer.join();
  ASSERT_TRUE(waiting->has_value());
  ASSERT_FALSE(waiting->value().has_value());
  EXPECT_EQ(waiting->value().error().status, 503u);
}

TEST_F(PromptRendererTest, AnswersPendingWhenTheCallersIoContextEndsAreDroppedWithIt) {
  const auto pool = make_native_render_pool({.threads = 1}, metrics_);
  const auto renderer = make_renderer({.inline_below_bytes = 0}, pool);
  Blocker blocker;
  ASSERT_TRUE(pool->submit("", blocker.task()));
  blocker.wait_started();
  std::optional<boost::asio::io_context> caller_io{std::in_place};
  // What a client's connection would be: held by the answer's callback.
  auto connection = std::make_shared<int>(0);
  const std::weak_ptr<int> watched = connection;
  bool answered = false;
  const std::string body = completion_body("hello");
  auto request = parse_generation_request(Endpoint::completions, body);
  ASSERT_TRUE(request.has_value());
  renderer->render(
      caller_io->get_executor(), *request, body, {},
      [connection = std::move(connection), &answered](RenderResult) { answered = true; });
  caller_io.reset();
  // Released with the io_context, not when the render ends later.
  EXPECT_TRUE(watched.expired());
  blocker.release();
  // The render, now without anyone to answer, leaves the queue (and is not rendered).
  std::promise<void> drained;
  ASSERT_TRUE(pool->submit("", [&](TaskStart) { drained.set_value(); }));
  drained.get_future().wait();
  EXPECT_FALSE(answered);
  EXPECT_EQ(metrics_->render().find("kvr_native_render_seconds_count 1"), std::string::npos);
}

}  // namespace
}  // namespace kvr::front_door
