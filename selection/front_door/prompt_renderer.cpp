#include "selection/front_door/prompt_renderer.hpp"

#include <fmt/format.h>

#include "selection/front_door/engine_call.hpp"

namespace kvr::front_door {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kRenderCalls = "kvr_http_render_calls_total";

// vLLM's /tokenize body for the request: its messages (with the chat fields that change the
// rendering) or its first prompt.
// Built only for engines without render endpoints, from the body parse_generation_request
// checked already.
std::string tokenize_body(bool chat, const std::string& client_body) {
  const Json request = Json::parse(client_body, nullptr, false);
  Json body{{"model", request.value("model", Json())}};
  if (chat) {
    for (const char* field : {"messages", "add_generation_prompt", "continue_final_message",
                              "chat_template", "chat_template_kwargs", "tools"}) {
      if (const auto found = request.find(field); found != request.end()) body[field] = *found;
    }
  } else {
    const Json& prompt = request["prompt"];
    body["prompt"] = prompt.is_array() ? prompt[0] : prompt;
  }
  return body.dump();
}

// An engine's error message from its error object, else its body.
std::string engine_reason(const std::string& body) {
  const Json parsed = Json::parse(body, nullptr, false);
  if (parsed.is_object()) {
    const Json& error = parsed.contains("error") ? parsed["error"] : parsed;
    if (error.is_object() && error.contains("message") && error["message"].is_string()) {
      return error["message"].get<std::string>();
    }
  }
  return body.substr(0, 512);
}

std::optional<std::vector<std::uint32_t>> read_ids(const Json& ids) {
  if (!ids.is_array() || ids.empty()) return std::nullopt;
  std::vector<std::uint32_t> tokens;
  tokens.reserve(ids.size());
  for (const Json& id : ids) {
    if (!id.is_number_unsigned() || id.get<std::uint64_t>() > UINT32_MAX) return std::nullopt;
    tokens.push_back(id.get<std::uint32_t>());
  }
  return tokens;
}

// The token ids in a render answer (one object for chat, an array for completions) or a
// tokenize answer.
std::optional<std::vector<std::uint32_t>> answer_ids(const std::string& body, bool tokenize) {
  const Json parsed = Json::parse(body, nullptr, false);
  if (tokenize) return parsed.is_object() ? read_ids(parsed.value("tokens", Json())) : std::nullopt;
  const Json& first = parsed.is_array() && !parsed.empty() ? parsed[0] : parsed;
  return first.is_object() ? read_ids(first.value("token_ids", Json())) : std::nullopt;
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

PromptRenderer::PromptRenderer(selection::TokenizerModes modes, std::size_t max_in_flight,
                               std::chrono::milliseconds timeout,
                               std::shared_ptr<metrics::MetricsRegistry> metrics)
    : modes_(std::move(modes)),
      max_in_flight_(max_in_flight),
      timeout_(timeout),
      metrics_(std::move(metrics)) {
  metrics_->describe(std::string{kRenderCalls}, metrics::MetricType::Counter,
                     "Render and tokenize calls to engines, by endpoint and outcome (ok, "
                     "refused: the engine rejected the request, failed: no usable answer)");
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

void PromptRenderer::render(boost::asio::any_io_executor executor, GenerationRequest& request,
                            std::string_view body, std::vector<std::string> engine_urls,
                            std::function<void(RenderResult)> done) {
  // A completions prompt of token ids needs no engine.
  if (!request.prompt_token_ids.empty()) {
    return done(RoutingKey{.tokens = std::move(request.prompt_token_ids)});
  }
  if (modes_.for_model(request.model) == selection::TokenizerMode::estimate) {
    if (request.prompt_text.empty()) {
      return done(
          std::unexpected(bad_request("prompt: an empty prompt cannot be routed", "prompt")));
    }
    return done(RoutingKey{.text = std::move(request.prompt_text)});
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
    attempt->tokenize_body = tokenize_body(attempt->chat, attempt->render_body);
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
          if (auto ids = answer_ids(answer.body, tokenize)) {
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

}  // namespace kvr::front_door
