// A request's routing key, by its model's tokenizer mode. `engine`: the prompt's token ids as the
// engine itself makes them (its chat template, special tokens and tokenizer), so that they hash to
// the blocks the engine reports in its KV events. Asks one engine of the model, in turn: vLLM's
// /v1/chat/completions/render or /v1/completions/render, and /tokenize where those are missing
// (remembered per engine); a failed engine is replaced by another once. `estimate`: the prompt's
// text, with no call. A completions prompt of token ids needs no call in either mode.
// Only included by the front door's .cpp files.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <boost/asio/any_io_executor.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/config/model_config.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/request_routing.hpp"

namespace kvr::front_door {

using RenderResult = std::expected<RoutingKey, HttpError>;

class PromptRenderer {
 public:
  PromptRenderer(selection::TokenizerModes modes, std::size_t max_in_flight,
                 std::chrono::milliseconds timeout,
                 std::shared_ptr<metrics::MetricsRegistry> metrics);

  /// Whether requests must be parsed with their prompt's text (some model uses `estimate`).
  PromptTextUse text_use() const;

  /// The routing key of `request` (its first prompt, for a batch; `body` is the request's body as
  /// the client sent it): its token ids, its text in the `estimate` mode, else the ids one of
  /// `engine_urls` renders; `done` runs once, on `executor` after an engine call, else at once.
  /// The error: 400 with the engine's reason when it refuses the request, 503 when no engine
  /// could render or too many renders are in flight.
  void render(boost::asio::any_io_executor executor, GenerationRequest& request,
              std::string_view body, std::vector<std::string> engine_urls,
              std::function<void(RenderResult)> done);

  /// Calls made so far (render and tokenize), for tests and benchmarks.
  std::uint64_t calls() const { return calls_.load(); }

  struct Attempt;

 private:
  void attempt(std::shared_ptr<Attempt> attempt);
  void call(std::shared_ptr<Attempt> attempt, bool tokenize);
  bool lacks_render(const std::string& url) const;
  void mark_lacks_render(const std::string& url);

  selection::TokenizerModes modes_;
  std::size_t max_in_flight_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<metrics::MetricsRegistry> metrics_;
  std::atomic<std::size_t> in_flight_{0};
  std::atomic<std::uint64_t> next_engine_{0};
  std::atomic<std::uint64_t> calls_{0};
  mutable std::mutex mutex_;
  /// Engines that answered 404 to render (older vLLM, SGLang): asked /tokenize directly.
  std::set<std::string> without_render_;
};

}  // namespace kvr::front_door
