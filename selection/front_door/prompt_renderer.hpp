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
// Native renders of all but small bodies run on a RenderPool (off the I/O threads, each client in
// turn), and stop at the longest prompt the router takes.
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
#include "selection/front_door/render_pool.hpp"
#include "selection/front_door/request_routing.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"

namespace kvr::front_door {

using RenderResult = std::expected<RoutingKey, HttpError>;

/// How kvr's native tokenizer renders prompts.
struct NativeRenderOptions {
  /// The render threads and their queue limits (per client: a client connection's address, or
  /// an Envoy stream's peer), when the renderer makes its own pool.
  RenderPoolOptions pool;
  /// Bodies shorter than this are rendered at once on the caller's (I/O) thread: about half a
  /// millisecond there at most (some 110 ns a byte with Qwen3's template and tokenizer), which
  /// spares them the hand-over to a render thread (0.1 ms and more) and any wait behind long
  /// renders (kvr_native_render_bench).
  std::size_t inline_below_bytes = 4096;
  /// The most token ids a prompt may have: the route's own limit
  /// (RouteDecodeLimits::max_prompt_tokens); encoding stops past it and the client gets a 400.
  std::size_t max_prompt_tokens = std::size_t{1} << 21;
};

/// A pool for native renders whose waiting tasks count in `metrics`' kvr_native_render_queue
/// (the pools of a process add up there); one can serve both front doors of a node.
std::shared_ptr<RenderPool> make_native_render_pool(
    const RenderPoolOptions& options, std::shared_ptr<metrics::MetricsRegistry> metrics);

class PromptRenderer {
 public:
  /// `pool`: the threads native renders run on, shared with other renderers; null: a pool of its
  /// own, made from `native_render.pool`.
  PromptRenderer(selection::TokenizerModes modes, std::size_t max_in_flight,
                 std::chrono::milliseconds timeout,
                 std::shared_ptr<metrics::MetricsRegistry> metrics,
                 std::shared_ptr<const NativeTokenizers> native = nullptr,
                 NativeRenderOptions native_render = {},
                 std::shared_ptr<RenderPool> pool = nullptr);

  /// Whether requests must be parsed with their prompt's text (some model uses `estimate`).
  PromptTextUse text_use() const;

  /// The routing key of `request` (its first prompt, for a batch; `body` is the request's body as
  /// the client sent it): its token ids, its text in the `estimate` mode, the ids kvr's native
  /// tokenizer makes, else the ids one of `engine_urls` renders; `done` runs once, on `executor`
  /// after an engine call or a render on the pool, else at once. `client` names the client (its
  /// address) whose turn a pooled render waits for. The error: 400 with the engine's reason when
  /// it refuses the request, or naming the limit when the prompt has more than
  /// max_prompt_tokens tokens; 503 when no engine could render, too many renders are in flight
  /// or too many wait for a render thread (the client's or all).
  void render(boost::asio::any_io_executor executor, GenerationRequest& request,
              std::string_view body, std::vector<std::string> engine_urls,
              std::function<void(RenderResult)> done, std::string_view client = {});

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
  struct NativeCore;

 private:
  enum class Parity : std::uint8_t { unchecked, checking, agrees, differs };
  /// Whether `model` is served natively now; starts its parity check on the first request.
  bool native_ready(const std::string& model, const std::vector<std::string>& engine_urls,
                    const boost::asio::any_io_executor& executor);
  /// A native render: at once when `body` is small, else on the pool and answered on `executor`.
  void render_natively(boost::asio::any_io_executor executor,
                       std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer,
                       const GenerationRequest& request, std::string_view body,
                       std::string_view client, std::function<void(RenderResult)> done);
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
  /// What a native render needs, held by the renders on the pool (which may outlive this).
  std::shared_ptr<const NativeCore> native_core_;
  std::size_t inline_below_bytes_;
  metrics::ValueHandle refused_queue_full_;
  metrics::ValueHandle refused_client_queue_full_;
  /// Last: when this holds the only reference, the pool is destroyed first.
  std::shared_ptr<RenderPool> pool_;
};

}  // namespace kvr::front_door
