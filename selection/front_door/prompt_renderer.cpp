#include "selection/front_door/prompt_renderer.hpp"

#include <unordered_set>

#include <boost/asio/execution_context.hpp>
#include <boost/asio/post.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "selection/front_door/engine_call.hpp"

namespace kvr::front_door {
namespace {

namespace net = boost::asio;
using Json = nlohmann::json;

constexpr std::string_view kRenderCalls = "kvr_http_render_calls_total";
constexpr std::string_view kParity = "kvr_tokenizer_parity";
constexpr std::string_view kNativeRenders = "kvr_native_renders_total";
constexpr std::string_view kRenderQueue = "kvr_native_render_queue";
constexpr std::string_view kRendersRefused = "kvr_native_renders_refused_total";
constexpr std::string_view kRenderSeconds = "kvr_native_render_seconds";
// A parity check that could not finish (no engine answered) is tried again after this.
constexpr std::chrono::seconds kParityRetry{10};

// What the parity check asks an engine to render: special-token text, many scripts, whitespace
// and code, a multi-turn chat with a system prompt, and a chat with tools and a tool call.
struct Probe {
  bool chat;
  nlohmann::ordered_json body;
};

const std::vector<Probe>& parity_probes() {
  static const std::vector<Probe> probes = [] {
    using Ordered = nlohmann::ordered_json;
    std::vector<Probe> list;
    list.push_back({false, Ordered{{"prompt",
                                    "Hello <|im_start|>user\n<s>[INST] </s><|endoftext|> "
                                    "<｜begin▁of▁sentence｜> done."}}});
    list.push_back(
        {false,
         Ordered{{"prompt",
                  "Grüße, 世界！Привет, мир. مرحبا بالعالم नमस्ते 안녕하세요 "
                  "こんにちは e\u0301 ﬁ ①２ 👩‍👩‍👧 👍🏽 🇫🇷"}}});
    list.push_back({false, Ordered{{"prompt",
                                    "def area(r):\n\treturn 3.14159 * r ** 2  # m²\r\n\n\n"
                                    "    x = [1, 22, 333, 4444]   \n"}}});
    list.push_back(
        {true,
         Ordered{{"messages",
                  Ordered::array(
                      {Ordered{{"role", "system"}, {"content", "You are a terse assistant."}},
                       Ordered{{"role", "user"}, {"content", "What is 2+2?"}},
                       Ordered{{"role", "assistant"}, {"content", "4."}},
                       Ordered{{"role", "user"}, {"content", "And in Chinese? 用中文回答。"}}})},
                 {"add_generation_prompt", true}}});
    const Ordered tools = Ordered::array(
        {Ordered{{"type", "function"},
                 {"function",
                  Ordered{{"name", "get_weather"},
                          {"description", "The weather in a city."},
                          {"parameters",
                           Ordered{{"type", "object"},
                                   {"properties", Ordered{{"city", Ordered{{"type", "string"}}}}},
                                   {"required", Ordered::array({"city"})}}}}}}});
    list.push_back(
        {true,
         Ordered{
             {"messages",
              Ordered::array(
                  {Ordered{{"role", "user"}, {"content", "Weather in Paris?"}},
                   Ordered{{"role", "assistant"},
                           {"content", ""},
                           {"tool_calls",
                            Ordered::array({Ordered{
                                {"id", "call12345"},
                                {"type", "function"},
                                {"function", Ordered{{"name", "get_weather"},
                                                     {"arguments", "{\"city\": \"Paris\"}"}}}}})}},
                   Ordered{{"role", "tool"},
                           {"tool_call_id", "call12345"},
                           {"content", "18 °C, clear"}}})},
             {"tools", tools},
             {"add_generation_prompt", true}}});
    return list;
  }();
  return probes;
}

// An engine's error message from its error object, else its body.
std::string engine_reason(const std::string& body) {
  const Json parsed = Json::parse(body, nullptr, false);
  if (parsed.is_object()) {
    const Json& error = parsed.contains("error") ? parsed["error"] : parsed;
    if (error.is_object() && error.contains("message") && error["message"].is_string()) {
      // It may quote the client's request (a model's name, say).
      return quote_for_error(error["message"].get_ref<const std::string&>(), 512);
    }
  }
  return quote_for_error(body, 512);
}

class PendingAnswer;

// The answers of one io_context's renders still on the pool.
struct AnswerGateState {
  std::mutex mutex;
  bool open = true;
  std::unordered_set<PendingAnswer*> pending;
};

// A service of the caller's io_context that closes when the io_context is destroyed, before any
// of its other services: the answers still pending are dropped there, while the sockets their
// callbacks hold (a client's connection) can still be closed, and a render that ends later finds
// no one to answer. Without it, a render outliving the io_context would post into freed memory.
class AnswerGate final : public net::execution_context::service {
 public:
  static inline net::execution_context::id id;

  explicit AnswerGate(net::execution_context& context) : service(context) {}

  const std::shared_ptr<AnswerGateState>& state() const { return state_; }

 private:
  void shutdown() override;

  std::shared_ptr<AnswerGateState> state_ = std::make_shared<AnswerGateState>();
};

// A pooled render's way back: `done`, to run on the caller's executor. The executor tracks
// work, so the io_context's run() does not return while the render is pending.
class PendingAnswer {
 public:
  PendingAnswer(const net::any_io_executor& executor, std::function<void(RenderResult)> done)
      : gate_(net::use_service<AnswerGate>(net::query(executor, net::execution::context)).state()),
        executor_(net::prefer(executor, net::execution::outstanding_work.tracked)),
        done_(std::move(done)) {
    const std::lock_guard lock{gate_->mutex};
    if (gate_->open) {
      gate_->pending.insert(this);
      pending_ = true;
    } else {
      release_locked();
    }
  }
  PendingAnswer(const PendingAnswer&) = delete;
  PendingAnswer& operator=(const PendingAnswer&) = delete;

  ~PendingAnswer() {
    const std::lock_guard lock{gate_->mutex};
    release_locked();
  }

  // Whether no one waits for the answer any more (the io_context is gone).
  bool abandoned() const {
    const std::lock_guard lock{gate_->mutex};
    return !pending_;
  }

  // Posts `done(result)` to the caller's executor, unless its io_context is gone.
  void deliver(RenderResult result) {
    const std::lock_guard lock{gate_->mutex};
    if (!pending_) return;
    net::post(executor_, [done = std::move(done_), result = std::move(result)]() mutable {
      done(std::move(result));
    });
    // Under the lock: the io_context (whose work count this is) cannot be going meanwhile.
    release_locked();
  }

  // Runs `done(result)` now, on this thread (a render refused before it was queued).
  void answer_now(RenderResult result) {
    std::function<void(RenderResult)> done;
    {
      const std::lock_guard lock{gate_->mutex};
      if (!pending_) return;
      done = std::move(done_);
      release_locked();
    }
    done(std::move(result));
  }

 private:
  friend class AnswerGate;

  // Forgets the caller: its callback and its executor's work count go now.
  void release_locked() {
    if (pending_) gate_->pending.erase(this);
    pending_ = false;
    executor_ = net::any_io_executor{};
    done_ = nullptr;
  }

  std::shared_ptr<AnswerGateState> gate_;
  // Under gate_->mutex.
  bool pending_ = false;
  net::any_io_executor executor_;
  std::function<void(RenderResult)> done_;
};

void AnswerGate::shutdown() {
  const std::lock_guard lock{state_->mutex};
  state_->open = false;
  // Each release erases its answer from the set.
  while (!state_->pending.empty()) (*state_->pending.begin())->release_locked();
}

HttpError render_refused(RenderPoolRefusal refusal, const RenderPoolOptions& options) {
  return HttpError{
      .status = 503,
      .message = refusal == RenderPoolRefusal::queue_full
                     ? fmt::format("{} prompts are waiting to be tokenized already; try again",
                                   options.max_queued)
                     : fmt::format("{} prompts of this client are waiting to be tokenized "
                                   "already; try again",
                                   options.max_queued_per_client),
      .code = "service_unavailable",
      .retry_after = std::chrono::seconds{1}};
}

}  // namespace

struct PromptRenderer::Attempt {
  boost::asio::any_io_executor executor;
  bool chat = true;
  std::string render_body;
  std::string tokenize_body;
  std::vector<std::string> engines;
  std::size_t next = 0;
  std::size_t tries = 0;
  std::string last_failure;
  std::function<void(RenderResult)> done;
  PromptRenderer* owner = nullptr;

  ~Attempt() { owner->in_flight_.fetch_sub(1); }
};

struct PromptRenderer::NativeCore {
  std::shared_ptr<metrics::MetricsRegistry> metrics;
  metrics::HistogramHandle render_seconds;
  std::size_t max_prompt_tokens = 0;

  // The ids of `body`'s prompt by `tokenizer`, its time observed.
  RenderResult render(const tokenizer::PromptTokenizer& tokenizer, Endpoint endpoint,
                      const std::string& model, std::string_view body) const;
  RenderResult render_untimed(const tokenizer::PromptTokenizer& tokenizer, Endpoint endpoint,
                              const std::string& model, std::string_view body) const;
};

std::shared_ptr<RenderPool> make_native_render_pool(
    const RenderPoolOptions& options, std::shared_ptr<metrics::MetricsRegistry> metrics) {
  const metrics::ValueHandle queue = metrics->gauge(kRenderQueue);
  return std::make_shared<RenderPool>(
      options, [queue, metrics = std::move(metrics)](int change) { queue.add(change); });
}

struct PromptRenderer::ParityCheck {
  std::string model;
  std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer;
  std::string engine_url;
  boost::asio::any_io_executor executor;
  std::size_t next_probe = 0;
  std::size_t compared = 0;
};

PromptRenderer::PromptRenderer(selection::TokenizerModes modes, std::size_t max_in_flight,
                               std::chrono::milliseconds timeout,
                               std::shared_ptr<metrics::MetricsRegistry> metrics,
                               std::shared_ptr<const NativeTokenizers> native,
                               NativeRenderOptions native_render, std::shared_ptr<RenderPool> pool)
    : modes_(std::move(modes)),
      native_(std::move(native)),
      max_in_flight_(max_in_flight),
      timeout_(timeout),
      metrics_(std::move(metrics)),
      inline_below_bytes_(native_render.inline_below_bytes),
      refused_queue_full_(metrics_->counter(kRendersRefused, {{"reason", "queue_full"}})),
      refused_client_queue_full_(
          metrics_->counter(kRendersRefused, {{"reason", "client_queue_full"}})),
      pool_(pool ? std::move(pool) : make_native_render_pool(native_render.pool, metrics_)) {
  metrics_->describe(std::string{kRenderCalls}, metrics::MetricType::Counter,
                     "Render and tokenize calls to engines, by endpoint and outcome (ok, "
                     "refused: the engine rejected the request, failed: no usable answer)");
  metrics_->describe(std::string{kParity}, metrics::MetricType::Gauge,
                     "1 when kvr's native tokenizer of the model agrees with an engine's "
                     "rendering of the parity probes (the model is served natively), 0 when it "
                     "disagrees (the model falls back to the engine mode)");
  metrics_->describe(std::string{kNativeRenders}, metrics::MetricType::Counter,
                     "Prompts made into token ids by kvr's native tokenizer, by model and "
                     "outcome (ok, refused)");
  metrics_->describe(std::string{kRenderQueue}, metrics::MetricType::Gauge,
                     "Native renders (prompts for kvr's own tokenizer) waiting for a render "
                     "thread");
  metrics_->describe(std::string{kRendersRefused}, metrics::MetricType::Counter,
                     "Native renders refused with 503 before they were queued, by reason "
                     "(queue_full: too many wait in all; client_queue_full: too many of the "
                     "same client wait)");
  metrics_->describe(std::string{kRenderSeconds}, metrics::MetricType::Histogram,
                     "Time kvr's native tokenizer took to render one prompt into token ids "
                     "(parse, chat template and encoding; not the wait for a render thread)",
                     {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1, 2.5, 5, 10, 30});
  native_core_ = std::make_shared<const NativeCore>(
      NativeCore{.metrics = metrics_,
                 // Resolved once described: a histogram's handle is a no-op before.
                 .render_seconds = metrics_->histogram(kRenderSeconds),
                 .max_prompt_tokens = native_render.max_prompt_tokens});
}

bool PromptRenderer::lacks_render(const std::string& url) const {
  std::lock_guard lock{mutex_};
  return without_render_.contains(url);
}

void PromptRenderer::mark_lacks_render(const std::string& url) {
  std::lock_guard lock{mutex_};
  without_render_.insert(url);
}

PromptTextUse PromptRenderer::text_use() const {
  return modes_.uses(selection::TokenizerMode::estimate) ? PromptTextUse::keep
                                                         : PromptTextUse::skip;
}

std::shared_ptr<const tokenizer::PromptTokenizer> PromptRenderer::native_tokenizer(
    std::string_view model) const {
  if (!native_) return nullptr;
  const auto found = native_->find(model);
  return found == native_->end() ? nullptr : found->second;
}

void PromptRenderer::render(boost::asio::any_io_executor executor, GenerationRequest& request,
                            std::string_view body, std::vector<std::string> engine_urls,
                            std::function<void(RenderResult)> done, std::string_view client) {
  // A completions prompt of token ids needs no engine.
  if (!request.prompt_token_ids.empty()) {
    return done(RoutingKey{.tokens = std::move(request.prompt_token_ids)});
  }
  // Workers without an engine to ask take kvr's token ids over its generate API: the model's
  // tokenizer is the only one, so there is no parity to check.
  if (engine_urls.empty()) {
    if (auto tokenizer = native_tokenizer(request.model)) {
      return render_natively(std::move(executor), std::move(tokenizer), request, body, client,
                             std::move(done));
    }
  }
  if (modes_.for_model(request.model) == selection::TokenizerMode::estimate) {
    if (request.prompt_text.empty()) {
      return done(
          std::unexpected(bad_request("prompt: an empty prompt cannot be routed", "prompt")));
    }
    return done(RoutingKey{.text = std::move(request.prompt_text)});
  }
  if (modes_.for_model(request.model) == selection::TokenizerMode::native &&
      native_ready(request.model, engine_urls, executor)) {
    return render_natively(std::move(executor), native_tokenizer(request.model), request, body,
                           client, std::move(done));
  }
  if (engine_urls.empty()) {
    return done(std::unexpected(HttpError{.status = 503,
                                          .message = "no engine of the model can render prompts",
                                          .code = "service_unavailable"}));
  }
  if (in_flight_.fetch_add(1) >= max_in_flight_) {
    in_flight_.fetch_sub(1);
    return done(std::unexpected(HttpError{
        .status = 503,
        .message = fmt::format("{} prompts are being rendered already; try again", max_in_flight_),
        .code = "service_unavailable"}));
  }
  auto attempt = std::make_shared<Attempt>();
  attempt->owner = this;  // from here the Attempt owns the in-flight slot
  attempt->executor = std::move(executor);
  attempt->chat = request.endpoint == Endpoint::chat_completions;
  attempt->render_body = body;
  attempt->next = next_engine_.fetch_add(1) % engine_urls.size();
  attempt->engines = std::move(engine_urls);
  attempt->done = std::move(done);
  this->attempt(std::move(attempt));
}

void PromptRenderer::attempt(std::shared_ptr<Attempt> attempt) {
  // Two engines at most: a second failure is the fleet's, not one engine's.
  if (attempt->tries == std::min<std::size_t>(2, attempt->engines.size())) {
    return attempt->done(std::unexpected(
        HttpError{.status = 503,
                  .message = "cannot render the prompt into token ids: " + attempt->last_failure,
                  .code = "service_unavailable"}));
  }
  ++attempt->tries;
  const std::string& url = attempt->engines[attempt->next % attempt->engines.size()];
  call(std::move(attempt), lacks_render(url));
}

void PromptRenderer::call(std::shared_ptr<Attempt> attempt, bool tokenize) {
  const std::string url = attempt->engines[attempt->next % attempt->engines.size()];
  const std::string path = tokenize        ? "/tokenize"
                           : attempt->chat ? "/v1/chat/completions/render"
                                           : "/v1/completions/render";
  if (tokenize && attempt->tokenize_body.empty()) {
    attempt->tokenize_body = tokenize_request_body(attempt->chat, attempt->render_body);
  }
  EngineCallRequest engine_request{.base_url = url,
                                   .path = path,
                                   .body = tokenize ? attempt->tokenize_body : attempt->render_body,
                                   .timeout = timeout_};
  calls_.fetch_add(1);
  auto executor = attempt->executor;
  call_engine(
      executor, std::move(engine_request),
      [this, attempt, url, path, tokenize](EngineAnswer answer) mutable {
        const auto count = [&](std::string_view outcome) {
          metrics_->add(kRenderCalls, {{"endpoint", path}, {"outcome", std::string{outcome}}});
        };
        if (answer.failure.empty() && answer.status == 404 && !tokenize) {
          count("missing");
          mark_lacks_render(url);
          return call(std::move(attempt), true);
        }
        if (answer.failure.empty() && answer.status >= 400 && answer.status < 500 &&
            answer.status != 404) {
          count("refused");
          return attempt->done(std::unexpected(bad_request(
              fmt::format("the engine refused the request: {}", engine_reason(answer.body)))));
        }
        if (answer.failure.empty() && answer.status == 200) {
          if (auto ids = rendered_token_ids(answer.body, tokenize)) {
            count("ok");
            return attempt->done(RoutingKey{.tokens = std::move(*ids)});
          }
          answer.failure = "its answer carries no token ids";
        }
        count("failed");
        attempt->last_failure = answer.failure.empty()
                                    ? fmt::format("{}{} answered {}", url, path, answer.status)
                                    : fmt::format("{}{}: {}", url, path, answer.failure);
        ++attempt->next;
        this->attempt(std::move(attempt));
      });
}

void PromptRenderer::check_new_models(const FleetDirectory& directory,
                                      const boost::asio::any_io_executor& executor) {
  if (!native_ || native_->empty()) return;
  for (const auto& [model, tokenizer] : *native_) {
    if (modes_.for_model(model) != selection::TokenizerMode::native) continue;
    {
      std::lock_guard lock{mutex_};
      if (const auto parity = parity_.find(model);
          parity != parity_.end() && parity->second != Parity::unchecked) {
        continue;
      }
    }
    std::vector<std::string> engine_urls;
    for (const auto& worker : directory.target(model).workers) {
      if (!worker.http_url.empty()) engine_urls.push_back(worker.http_url);
    }
    if (!engine_urls.empty()) native_ready(model, engine_urls, executor);
  }
}

bool PromptRenderer::native_ready(const std::string& model,
                                  const std::vector<std::string>& engine_urls,
                                  const boost::asio::any_io_executor& executor) {
  if (!native_) return false;
  const auto tokenizer = native_->find(model);
  if (tokenizer == native_->end()) return false;
  std::shared_ptr<ParityCheck> check;
  {
    std::lock_guard lock{mutex_};
    Parity& parity = parity_[model];
    if (parity == Parity::agrees) return true;
    if (parity != Parity::unchecked || engine_urls.empty()) return false;
    if (const auto retry = parity_retry_after_.find(model);
        retry != parity_retry_after_.end() && std::chrono::steady_clock::now() < retry->second) {
      return false;
    }
    parity = Parity::checking;
    check = std::make_shared<ParityCheck>();
  }
  check->model = model;
  check->tokenizer = tokenizer->second;
  check->engine_url = engine_urls[next_engine_.fetch_add(1) % engine_urls.size()];
  check->executor = executor;
  spdlog::info("tokenizer parity: checking kvr's tokenizer of model '{}' against {}", model,
               check->engine_url);
  check_next_probe(std::move(check));
  return false;  // this request is served in the engine mode
}

void PromptRenderer::render_natively(boost::asio::any_io_executor executor,
                                     std::shared_ptr<const tokenizer::PromptTokenizer> tokenizer,
                                     const GenerationRequest& request, std::string_view body,
                                     std::string_view client,
                                     std::function<void(RenderResult)> done) {
  if (body.size() < inline_below_bytes_) {
    return done(native_core_->render(*tokenizer, request.endpoint, request.model, body));
  }
  auto answer = std::make_shared<PendingAnswer>(executor, std::move(done));
  // The task owns copies (the caller's request and body may be gone before it runs) and the core
  // (a shared pool may outlive this renderer).
  auto queued =
      pool_->submit(client, [answer, core = native_core_, tokenizer = std::move(tokenizer),
                             endpoint = request.endpoint, model = request.model,
                             text = std::string{body}](TaskStart start) {
        if (start == TaskStart::cancelled) {
          return answer->deliver(std::unexpected(
              HttpError{.status = 503,
                        .message = "the router is stopping; the prompt was not tokenized",
                        .code = "service_unavailable"}));
        }
        // The caller's io_context is gone: nothing would read the ids.
        if (answer->abandoned()) return;
        answer->deliver(core->render(*tokenizer, endpoint, model, text));
      });
  if (!queued) {
    (queued.error() == RenderPoolRefusal::queue_full ? refused_queue_full_
                                                     : refused_client_queue_full_)
        .add();
    answer->answer_now(std::unexpected(render_refused(queued.error(), pool_->options())));
  }
}

RenderResult PromptRenderer::NativeCore::render(const tokenizer::PromptTokenizer& tokenizer,
                                                Endpoint endpoint, const std::string& model,
                                                std::string_view body) const {
  const auto start = std::chrono::steady_clock::now();
  RenderResult result = render_untimed(tokenizer, endpoint, model, body);
  render_seconds.observe(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return result;
}

RenderResult PromptRenderer::NativeCore::render_untimed(const tokenizer::PromptTokenizer& tokenizer,
                                                        Endpoint endpoint, const std::string& model,
                                                        std::string_view body) const {
  const auto refused = [&](const std::string& why) -> RenderResult {
    metrics->add(kNativeRenders, {{"model", model}, {"outcome", "refused"}});
    return std::unexpected(bad_request("cannot tokenize the prompt: " + why));
  };
  const auto too_long = [&](std::string param) -> RenderResult {
    metrics->add(kNativeRenders, {{"model", model}, {"outcome", "refused"}});
    return std::unexpected(
        bad_request(fmt::format("the prompt has more than {} tokens, the longest the router takes",
                                max_prompt_tokens),
                    std::move(param)));
  };
  std::expected<tokenizer::TokenIds, tokenizer::TokenizerError> ids;
  // Ordered: the template sees the client's keys in the client's order.
  nlohmann::ordered_json parsed;
  try {
    parsed = nlohmann::ordered_json::parse(body);
  } catch (const nlohmann::json::exception& error) {
    // parse_generation_request took the body, so this parser should too: say why it did not.
    return refused(fmt::format("invalid JSON: {}", quote_for_error(error.what())));
  }
  if (endpoint == Endpoint::chat_completions) {
    // The body's nesting was checked against the front door's limit (parse_generation_request):
    // here only the ceiling applies.
    auto chat =
        tokenizer::PromptTokenizer::chat_from_openai(parsed, tokenizer::kMaxJsonDepthCeiling);
    if (!chat) return refused(chat.error().message);
    auto rendered = tokenizer.encode_chat(*chat, max_prompt_tokens);
    if (!rendered) {
      return rendered.error().over_id_limit ? too_long("messages")
                                            : refused(rendered.error().message);
    }
    ids = std::move(rendered->ids);
  } else {
    const auto& prompt = parsed.contains("prompt") ? parsed["prompt"] : nlohmann::ordered_json{};
    const auto& first = prompt.is_array() && !prompt.empty() ? prompt[0] : prompt;
    if (!first.is_string()) return refused("prompt: a string is expected");
    ids = tokenizer.encode_prompt(first.get<std::string>(), max_prompt_tokens);
    if (!ids) return ids.error().over_id_limit ? too_long("prompt") : refused(ids.error().message);
  }
  if (ids->empty()) return refused("the prompt has no tokens");
  metrics->add(kNativeRenders, {{"model", model}, {"outcome", "ok"}});
  return RoutingKey{.tokens = std::move(*ids)};
}

void PromptRenderer::check_next_probe(std::shared_ptr<ParityCheck> check) {
  const auto& probes = parity_probes();
  // Probes the model's own template refuses (a strict role order, say) are skipped.
  while (check->next_probe < probes.size()) {
    const Probe& probe = probes[check->next_probe++];
    std::expected<tokenizer::TokenIds, tokenizer::TokenizerError> local;
    if (probe.chat) {
      if (!check->tokenizer->has_chat_template()) continue;
      auto chat = tokenizer::PromptTokenizer::chat_from_openai(probe.body);
      if (!chat) continue;
      auto rendered = check->tokenizer->encode_chat(*chat);
      if (!rendered) continue;
      local = std::move(rendered->ids);
    } else {
      local = check->tokenizer->encode_prompt(probe.body["prompt"].get<std::string>());
      if (!local) continue;
    }
    nlohmann::ordered_json body = probe.body;
    body["model"] = check->model;
    const std::string client_body = body.dump();
    const auto ask = std::make_shared<std::function<void(bool)>>();
    *ask = [this, check, ask, probe_chat = probe.chat, client_body,
            expected = std::move(*local)](bool tokenize) {
      const std::string path = tokenize     ? "/tokenize"
                               : probe_chat ? "/v1/chat/completions/render"
                                            : "/v1/completions/render";
      call_engine(
          check->executor,
          EngineCallRequest{
              .base_url = check->engine_url,
              .path = path,
              .body = tokenize ? tokenize_request_body(probe_chat, client_body) : client_body,
              .timeout = timeout_},
          [this, check, ask, tokenize, path, expected](EngineAnswer answer) {
            if (answer.failure.empty() && answer.status == 404 && !tokenize) return (*ask)(true);
            if (answer.failure.empty() && answer.status >= 400 && answer.status < 500) {
              *ask = nullptr;
              return check_next_probe(check);  // the engine refuses this probe too
            }
            const auto ids = answer.failure.empty() && answer.status == 200
                                 ? rendered_token_ids(answer.body, tokenize)
                                 : std::nullopt;
            *ask = nullptr;
            if (!ids) {
              return finish_parity(
                  check->model, Parity::unchecked,
                  fmt::format("{}{} gave no token ids ({})", check->engine_url, path,
                              answer.failure.empty() ? fmt::format("status {}", answer.status)
                                                     : answer.failure));
            }
            if (*ids != expected) {
              std::size_t at = 0;
              while (at < ids->size() && at < expected.size() && (*ids)[at] == expected[at]) ++at;
              const auto window = [&](const std::vector<std::uint32_t>& sequence) {
                const std::size_t end = std::min(sequence.size(), at + 4);
                return at < end ? check->tokenizer->tokenizer().decode(
                                      std::span{sequence}.subspan(at, end - at), false)
                                : std::string{"(end)"};
              };
              return finish_parity(
                  check->model, Parity::differs,
                  fmt::format("probe {} differs from {}{} at token {}: kvr \"{}\", engine \"{}\"",
                              check->next_probe, check->engine_url, path, at, window(expected),
                              window(*ids)));
            }
            ++check->compared;
            check_next_probe(check);
          });
    };
    (*ask)(false);
    return;
  }
  if (check->compared == 0) {
    return finish_parity(check->model, Parity::unchecked, "no probe could be compared");
  }
  finish_parity(check->model, Parity::agrees,
                fmt::format("{} probes equal to {}'s", check->compared, check->engine_url));
}

void PromptRenderer::finish_parity(const std::string& model, Parity outcome,
                                   const std::string& detail) {
  {
    std::lock_guard lock{mutex_};
    parity_[model] = outcome;
    if (outcome == Parity::unchecked) {
      parity_retry_after_[model] = std::chrono::steady_clock::now() + kParityRetry;
    }
  }
  switch (outcome) {
    case Parity::agrees:
      metrics_->set(kParity, {{"model", model}}, 1);
      spdlog::info("tokenizer parity: model '{}' agrees ({}); its prompts are tokenized natively",
                   model, detail);
      break;
    case Parity::differs:
      metrics_->set(kParity, {{"model", model}}, 0);
      spdlog::error(
          "TOKENIZER MISMATCH: kvr's tokenizer of model '{}' does not match its engines: {}. The "
          "model is served in the engine mode (its engines render every prompt); check that "
          "--tokenizer/tokenizers: names this model's tokenizer files",
          model, detail);
      break;
    default:
      spdlog::warn(
          "tokenizer parity: model '{}' could not be checked ({}); engine mode for now, "
          "checked again in {} s",
          model, detail, kParityRetry.count());
      break;
  }
}

}  // namespace kvr::front_door
