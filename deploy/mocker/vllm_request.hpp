// A request to the HTTP routes of `kvr mocker --speak vllm`, read as vLLM reads it: the JSON body
// and the model it names, its prompt (text, token ids or chat messages), its sampling and
// generation parameters, and vLLM's error answer. Used by every route group (vllm_*_routes.hpp).
#pragma once

#include <cstdint>
#include <expected>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deploy/mocker/kv_transfer_params.hpp"
#include "deploy/mocker/vllm_engine_loop.hpp"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace kvr::mocker {

struct VllmEngineOptions;

/// A request the HTTP side refuses: its status and vLLM's error type.
struct HttpError {
  int status = 400;
  std::string message;
  std::string type;
};

/// A 400 BadRequestError.
HttpError bad_request(std::string message);

/// Answers with vLLM's ErrorResponse {"error": {message, type, param, code}}.
void send_error(httplib::Response& response, const HttpError& error);

/// A boolean field of `object`: `fallback` when absent or null, an error when not a boolean.
std::expected<bool, HttpError> read_bool(const nlohmann::json& object, const char* field,
                                         bool fallback);

/// A request's JSON body and the model it names: 0 the served model (also when it names none), i
/// the i-th LoRA adapter.
struct RequestBody {
  nlohmann::json json;
  std::uint32_t lora = 0;
  /// The body with its keys in the client's order, as a real tokenizer's chat template must see
  /// them (parsed only when the engine has one).
  nlohmann::ordered_json ordered;
};

/// The body as a JSON object naming the served model, one of its adapters, or none (404 for
/// another model).
std::expected<RequestBody, HttpError> read_body(const VllmEngineOptions& options,
                                                const httplib::Request& http_request);

/// What a body asks of the engine besides its prompt.
struct Generation {
  KvTransferRequest kv_transfer;
  std::uint32_t max_tokens = 16;
  Sampling sampling;
  bool stream = false;
  bool include_usage = false;     ///< stream_options.include_usage: a last event with the usage
  bool continuous_usage = false;  ///< stream_options.continuous_usage_stats: usage in every event
  bool return_token_ids = false;  ///< vLLM's extension: each choice carries its token ids
};

/// The sampling parameters of a completions or chat body, checked for their types as vLLM checks
/// them; seed, stop_token_ids and min_tokens are honoured, the others accepted and ignored.
std::expected<Sampling, std::string> read_sampling(const nlohmann::json& body);

/// What a completions (`chat` false) or chat body asks of the engine besides the prompt. Chat
/// reads max_completion_tokens before max_tokens; both default to 16.
std::expected<Generation, HttpError> read_generation(const nlohmann::json& body, bool chat);

/// A text prompt's ids (after BOS when `add_bos`): the model's tokenizer when one is given, else
/// the mock tokenizer.
std::expected<std::vector<std::uint32_t>, HttpError> encode_prompt_text(
    const VllmEngineOptions& options, const std::string& text, bool add_bos);

/// The prompts of a completions body, each as the engine's token ids: a text (tokenized, after
/// BOS unless add_special_tokens is false), a list of ids (as they are), or a list of either.
std::expected<std::vector<std::vector<std::uint32_t>>, HttpError> read_prompts(
    const VllmEngineOptions& options, const nlohmann::json& body);

/// The chat template's token ids for a body's messages (add_generation_prompt defaults to true;
/// add_special_tokens, false by default as in vLLM's chat requests, puts a second BOS first).
/// Only text content is accepted.
std::expected<std::vector<std::uint32_t>, HttpError> read_chat_prompt(
    const VllmEngineOptions& options, const RequestBody& request);

}  // namespace kvr::mocker
