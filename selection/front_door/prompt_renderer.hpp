// A request's routing key, by its model's tokenizer mode. `engine`: the prompt's token ids as the
// engine itself makes them (its chat template, special tokens and tokenizer), so that they hash to
// the blocks the engine reports in its KV events. Asks one engine of the model, in turn: vLLM's
// /v1/chat/completions/render or /v1/completions/render, and /tokenize where those are missing
// (remembered per engine); a failed engine is replaced by another once. `estimate`: the prompt's
// text, with no call. `native`: kvr's own tokenizer and chat template for the model, once a parity
// check (a fixed probe set rendered by one engine of the model and compared id by id) agrees;
// until then, and for good when it disagrees, the model is served as in `engine`.
// A completions prompt of token ids needs no call in any mode. A model without engines (its
// workers registered no HTTP URL) is tokenized by its native tokenizer, whatever its mode.
// Only included by the front door's .cpp files.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <boost/asio/any_io_executor.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/config/model_config.hpp"
#include "selection/front_door/fleet_directory.hpp"
#include "selection/front_door/native_tokenizers.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/request_routing.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"

namespace kvr::front_door {

using RenderResult = std::expected<RoutingKey, HttpError>;

class PromptRenderer {
 public:
  PromptRenderer(selection::TokenizerModes modes, std::size_t max_in_flight,
                 std::chrono::milliseconds timeout,
                 std::shared_ptr<metrics::MetricsRegistry> metrics,
                 std::shared_ptr<const NativeTokenizers> native = nullptr);

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

  /// Starts the parity check of every native-mode model of `directory` that has engines and was
  /// not checked yet, so that it runs when a model's first engine registers; the front doors
  /// call it every second on `executor`.
  void check_new_models(const FleetDirectory& directory,
                        const boost::asio::any_io_executor& executor);

  /// The tokenizer the node loaded for `model` (the name the client used); null when none.
  std::shared_ptr<const tokenizer::PromptTokenizer> native_tokenizer(std::string_view model) const;

  /// Calls made so far (render and tokenize), for tests and benchmarks.
  std::uint64_t calls() const { return calls_.load(); }

  struct Attempt;
  struct ParityCheck;

 private:
  enum class Parity : std::uint8_t { unchecked, checking, agrees, differs };
  /// Whether `model` is served natively now; starts its parity check on the first request.
  bool native_ready(const std::string& model, const std::vector<std::string>& engine_urls,
                    const boost::asio::any_io_executor& executor);
  RenderResult render_natively(const tokenizer::PromptTokenizer& tokenizer,
                               const GenerationRequest& request, std::string_view body) const;
  void check_next_probe(std::shared_ptr<ParityCheck> check);
  void finish_parity(const std::string& model, Parity outcome, const std::string& detail);
  void attempt(std::shared_ptr<Attempt> attempt);
  void call(std::shared_ptr<Attempt> attempt, bool tokenize);
  bool lacks_render(const std::string& url) const;
  void mark_lacks_render(const std::string& url);

  selection::TokenizerModes modes_;
  std::shared_ptr<const NativeTokenizers> native_;
  /// Per model in the native mode; a check that could not finish is retried after a pause.
  std::map<std::string, Parity, std::less<>> parity_;
  std::map<std::string, std::chrono::steady_clock::time_point, std::less<>> parity_retry_after_;
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
