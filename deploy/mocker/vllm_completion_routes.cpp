#include "deploy/mocker/vllm_completion_routes.hpp"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "deploy/mocker/mock_tokenizer.hpp"

namespace kvr::mocker {
namespace {

using simulation::EngineRequestId;

// The two response formats one engine request can be served in.
enum class CompletionApi : std::uint8_t { completions, chat };

nlohmann::json openai_finish_reason(const GeneratedToken& token) {
  if (!token.last) return nullptr;
  return token.stopped ? "stop" : "length";
}

nlohmann::json openai_stop_reason(const GeneratedToken& token) {
  return token.stopped ? nlohmann::json(token.id) : nlohmann::json();
}

nlohmann::json openai_usage(std::uint64_t prompt, std::uint64_t completion, std::uint64_t cached) {
  return {{"prompt_tokens", prompt},
          {"total_tokens", prompt + completion},
          {"completion_tokens", completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

// One `data: {json}\n\n` event of a completions stream.
std::string completion_event(const std::string& id, const std::string& model, std::int64_t created,
                             const GeneratedToken& token, bool return_token_ids,
                             const std::optional<nlohmann::json>& usage) {
  nlohmann::json choice = {{"index", 0},
                           {"text", token_text(token.id)},
                           {"logprobs", nullptr},
                           {"finish_reason", openai_finish_reason(token)},
                           {"stop_reason", openai_stop_reason(token)}};
  if (return_token_ids) choice["token_ids"] = {token.id};
  const nlohmann::json event = {{"id", id},
                                {"object", "text_completion"},
                                {"created", created},
                                {"model", model},
                                {"choices", {choice}},
                                {"usage", usage ? *usage : nlohmann::json()}};
  return "data: " + event.dump() + "\n\n";
}

// One `data: {json}\n\n` event of a chat stream: the delta of one token, or (no token) the
// first event's assistant role; usage only where continuous usage was asked for.
std::string chat_event(const std::string& id, const std::string& model, std::int64_t created,
                       const GeneratedToken* token, bool return_token_ids,
                       const std::optional<nlohmann::json>& usage) {
  nlohmann::json choice = {{"index", 0}, {"logprobs", nullptr}};
  if (token) {
    choice["delta"] = {{"content", token_text(token->id)}};
    choice["finish_reason"] = openai_finish_reason(*token);
    choice["stop_reason"] = openai_stop_reason(*token);
    if (return_token_ids) choice["token_ids"] = {token->id};
  } else {
    choice["delta"] = {{"role", "assistant"}, {"content", ""}};
    choice["finish_reason"] = nullptr;
  }
  nlohmann::json event = {{"id", id},
                          {"object", "chat.completion.chunk"},
                          {"created", created},
                          {"model", model},
                          {"choices", {choice}}};
  if (usage) event["usage"] = *usage;
  return "data: " + event.dump() + "\n\n";
}

// Serves an admitted request: one JSON answer, or an event stream ending `data: [DONE]`, in the
// completions or the chat format.
void respond(VllmRouteContext& context, CompletionApi api, AdmittedRequest admitted,
             std::string model, std::uint64_t prompt_tokens, const Generation& generation,
             httplib::Response& response) {
  const EngineRequestId id = admitted.id;
  std::shared_ptr<ResponseChannel> channel = std::move(admitted.channel);
  const bool chat = api == CompletionApi::chat;
  const std::string response_id = fmt::format("{}-{:016x}", chat ? "chatcmpl" : "cmpl", id);
  const auto created = static_cast<std::int64_t>(unix_seconds());
  if (!generation.stream) {
    std::vector<std::uint32_t> ids;
    std::string text;
    std::uint64_t cached = 0;
    GeneratedToken final_token;
    while (true) {
      auto token = wait_for_token(*channel);
      if (!token) {
        send_error(response, {503, "the engine is shutting down", "ServiceUnavailableError"});
        return;
      }
      ids.push_back(token->token.id);
      text += token_text(token->token.id);
      cached = token->cached_tokens;
      final_token = token->token;
      if (token->token.last) break;
    }
    nlohmann::json choice = {{"index", 0}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
    }
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = openai_finish_reason(final_token);
    choice["stop_reason"] = openai_stop_reason(final_token);
    if (generation.return_token_ids) choice["token_ids"] = ids;
    nlohmann::json kv_transfer_params;
    {
      std::lock_guard lock{channel->mutex};
      kv_transfer_params = channel->kv_transfer_params;
    }
    response.set_content(nlohmann::json{{"id", response_id},
                                        {"object", chat ? "chat.completion" : "text_completion"},
                                        {"created", created},
                                        {"model", model},
                                        {"choices", {choice}},
                                        {"usage", openai_usage(prompt_tokens, ids.size(), cached)},
                                        {"kv_transfer_params", std::move(kv_transfer_params)}}
                             .dump(),
                         "application/json");
    return;
  }
  // vLLM's stream responses have no kv_transfer_params field, so a streamed prefill hop's
  // parameters are not sent (vLLM's proxies send the prefill hop with stream=false).
  auto generated = std::make_shared<std::uint64_t>(0);
  response.set_chunked_content_provider(
      "text/event-stream",
      [chat, channel, response_id, model, created, generation, prompt_tokens, generated](
          std::size_t, httplib::DataSink& sink) {
        auto token = wait_for_token(*channel);
        if (!token) return false;
        const bool first = *generated == 0;
        ++*generated;
        auto usage = [&](std::uint64_t completion) -> std::optional<nlohmann::json> {
          if (!generation.continuous_usage) return std::nullopt;
          return openai_usage(prompt_tokens, completion, token->cached_tokens);
        };
        std::string out;
        if (chat) {
          // vLLM opens a chat stream with the role once the first token is out.
          if (first) out += chat_event(response_id, model, created, nullptr, false, usage(0));
          out += chat_event(response_id, model, created, &token->token, generation.return_token_ids,
                            usage(*generated));
        } else {
          out += completion_event(response_id, model, created, token->token,
                                  generation.return_token_ids, usage(*generated));
        }
        if (token->token.last) {
          if (generation.include_usage) {
            out += "data: " +
                   nlohmann::json{
                       {"id", response_id},
                       {"object", chat ? "chat.completion.chunk" : "text_completion"},
                       {"created", created},
                       {"model", model},
                       {"choices", nlohmann::json::array()},
                       {"usage", openai_usage(prompt_tokens, *generated, token->cached_tokens)}}
                       .dump() +
                   "\n\n";
          }
          out += "data: [DONE]\n\n";
        }
        if (!sink.write(out.data(), out.size())) return false;
        if (token->token.last) sink.done();
        return true;
      },
      [&engine = context.engine(), id](bool success) {
        // The client went away (or a write failed): the engine aborts, as vLLM does.
        if (!success) engine.abort(id);
      });
}

void serve_completion(VllmRouteContext& context, const httplib::Request& http_request,
                      httplib::Response& response) {
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  auto prompts = read_prompts(context.options(), body->json);
  if (!prompts) return send_error(response, prompts.error());
  if (prompts->size() != 1) {
    return send_error(response, bad_request("kvr mocker serves one prompt per request"));
  }
  const auto generation = read_generation(body->json, false);
  if (!generation) return send_error(response, generation.error());
  const std::uint64_t prompt_tokens = prompts->front().size();
  auto admitted = context.submit(std::move(prompts->front()), body->lora, *generation);
  if (!admitted) return send_error(response, admitted.error());
  respond(context, CompletionApi::completions, std::move(*admitted), context.model_name(body->lora),
          prompt_tokens, *generation, response);
}

void serve_chat(VllmRouteContext& context, const httplib::Request& http_request,
                httplib::Response& response) {
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  auto prompt = read_chat_prompt(context.options(), *body);
  if (!prompt) return send_error(response, prompt.error());
  const auto generation = read_generation(body->json, true);
  if (!generation) return send_error(response, generation.error());
  const std::uint64_t prompt_tokens = prompt->size();
  auto admitted = context.submit(std::move(*prompt), body->lora, *generation);
  if (!admitted) return send_error(response, admitted.error());
  respond(context, CompletionApi::chat, std::move(*admitted), context.model_name(body->lora),
          prompt_tokens, *generation, response);
}

}  // namespace

void add_vllm_completion_routes(httplib::Server& http, VllmRouteContext& context) {
  http.Post("/v1/completions",
            [&context](const httplib::Request& request, httplib::Response& response) {
              serve_completion(context, request, response);
            });
  http.Post("/v1/chat/completions",
            [&context](const httplib::Request& request, httplib::Response& response) {
              serve_chat(context, request, response);
            });
}

}  // namespace kvr::mocker
