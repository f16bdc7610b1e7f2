#include "deploy/mocker/vllm_render_routes.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "deploy/mocker/mock_tokenizer.hpp"
#include "deploy/mocker/vllm_engine_server.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"

namespace kvr::mocker {
namespace {

// One prompt as vLLM's render endpoints give it: the request /inference/v1/generate would take.
nlohmann::json rendered(const VllmRouteContext& context, std::string request_id,
                        const std::vector<std::uint32_t>& tokens, const RequestBody& request,
                        const Generation& generation) {
  const nlohmann::json& body = request.json;
  nlohmann::json sampling = {
      {"max_tokens", generation.max_tokens},
      {"min_tokens", generation.sampling.min_tokens},
      {"seed", generation.sampling.seed ? nlohmann::json(*generation.sampling.seed) : nullptr}};
  std::vector<std::uint32_t> stop_ids(generation.sampling.stop_token_ids.begin(),
                                      generation.sampling.stop_token_ids.end());
  std::ranges::sort(stop_ids);
  sampling["stop_token_ids"] = stop_ids;
  for (const char* field :
       {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"}) {
    if (const auto found = body.find(field); found != body.end() && !found->is_null()) {
      sampling[field] = *found;
    }
  }
  if (const auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
    sampling["stop"] = stop->is_string() ? nlohmann::json::array({*stop}) : *stop;
  }
  return {{"request_id", std::move(request_id)},
          {"token_ids", tokens},
          {"features", nullptr},
          {"sampling_params", std::move(sampling)},
          {"model", context.model_name(request.lora)},
          {"stream", generation.stream}};
}

void serve_chat_render(VllmRouteContext& context, const httplib::Request& http_request,
                       httplib::Response& response) {
  ++context.render_calls().chat_render;
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  const auto prompt = read_chat_prompt(context.options(), *body);
  if (!prompt) return send_error(response, prompt.error());
  const auto generation = read_generation(body->json, true);
  if (!generation) return send_error(response, generation.error());
  response.set_content(
      rendered(context, fmt::format("chatcmpl-render-{:016x}", context.next_render_id()), *prompt,
               *body, *generation)
          .dump(),
      "application/json");
}

void serve_completion_render(VllmRouteContext& context, const httplib::Request& http_request,
                             httplib::Response& response) {
  ++context.render_calls().completions_render;
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  const auto prompts = read_prompts(context.options(), body->json);
  if (!prompts) return send_error(response, prompts.error());
  const auto generation = read_generation(body->json, false);
  if (!generation) return send_error(response, generation.error());
  const std::uint64_t render_id = context.next_render_id();
  nlohmann::json answer = nlohmann::json::array();
  for (std::size_t i = 0; i < prompts->size(); ++i) {
    answer.push_back(rendered(context, fmt::format("cmpl-render-{:016x}-{}", render_id, i),
                              (*prompts)[i], *body, *generation));
  }
  response.set_content(answer.dump(), "application/json");
}

// vLLM's /tokenize: a text prompt (add_special_tokens defaults to true) or chat messages
// (through the chat template; add_special_tokens defaults to false).
void serve_tokenize(VllmRouteContext& context, const httplib::Request& http_request,
                    httplib::Response& response) {
  ++context.render_calls().tokenize;
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  std::vector<std::uint32_t> ids;
  if (body->json.contains("messages")) {
    auto prompt = read_chat_prompt(context.options(), *body);
    if (!prompt) return send_error(response, prompt.error());
    ids = std::move(*prompt);
  } else {
    const auto prompt = body->json.find("prompt");
    if (prompt == body->json.end() || !prompt->is_string()) {
      return send_error(response, bad_request("prompt must be a text (or give messages)"));
    }
    const auto add_bos = read_bool(body->json, "add_special_tokens", true);
    if (!add_bos) return send_error(response, add_bos.error());
    auto encoded =
        encode_prompt_text(context.options(), prompt->get_ref<const std::string&>(), *add_bos);
    if (!encoded) return send_error(response, encoded.error());
    ids = std::move(*encoded);
  }
  const auto return_strs = read_bool(body->json, "return_token_strs", false);
  if (!return_strs) return send_error(response, return_strs.error());
  nlohmann::json token_strs;
  if (*return_strs) {
    token_strs = nlohmann::json::array();
    for (std::uint32_t id : ids) token_strs.push_back(token_text(id));
  }
  response.set_content(nlohmann::json{{"count", ids.size()},
                                      {"max_model_len", context.max_model_len()},
                                      {"tokens", ids},
                                      {"token_strs", std::move(token_strs)}}
                           .dump(),
                       "application/json");
}

void serve_detokenize(const VllmRouteContext& context, const httplib::Request& http_request,
                      httplib::Response& response) {
  const auto body = read_body(context.options(), http_request);
  if (!body) return send_error(response, body.error());
  const auto tokens = body->json.find("tokens");
  const auto refuse = [&] {
    send_error(response, bad_request("tokens must be a list of unsigned 32-bit ids"));
  };
  if (tokens == body->json.end() || !tokens->is_array()) return refuse();
  std::vector<std::uint32_t> ids;
  ids.reserve(tokens->size());
  for (const auto& token : *tokens) {
    if (!token.is_number_unsigned() || token.get<std::uint64_t>() > UINT32_MAX) return refuse();
    ids.push_back(token.get<std::uint32_t>());
  }
  response.set_content(
      nlohmann::json{{"prompt", context.options().tokenizer
                                    ? context.options().tokenizer->tokenizer().decode(ids, false)
                                    : decode_tokens(ids)}}
          .dump(),
      "application/json");
}
}  // namespace

void add_vllm_render_routes(httplib::Server& http, VllmRouteContext& context) {
  http.Post("/tokenize", [&context](const httplib::Request& request, httplib::Response& response) {
    serve_tokenize(context, request, response);
  });
  http.Post("/detokenize",
            [&context](const httplib::Request& request, httplib::Response& response) {
              serve_detokenize(context, request, response);
            });
  // Without them (--no-render-endpoints) a front door must fall back to /tokenize.
  if (!context.options().render_endpoints) return;
  http.Post("/v1/completions/render",
            [&context](const httplib::Request& request, httplib::Response& response) {
              serve_completion_render(context, request, response);
            });
  http.Post("/v1/chat/completions/render",
            [&context](const httplib::Request& request, httplib::Response& response) {
              serve_chat_render(context, request, response);
            });
}

}  // namespace kvr::mocker
