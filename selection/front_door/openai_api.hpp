// The OpenAI-compatible API of the front door, as plain values: what a client's request body says
// that routing needs (the body itself is forwarded to the engine untouched, so the engine does its
// own templating and sampling), the errors a client gets in OpenAI's error object, and how a
// route error maps to an HTTP status.
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvr/v1/routing.pb.h"
#include "selection/tokenizer/request_json.hpp"

namespace kvr::front_door {

/// An error as an HTTP client gets it: a status and OpenAI's error object
/// {"error": {"message", "type", "param", "code"}}.
struct HttpError {
  unsigned status = 500;
  std::string message;
  /// OpenAI's `type`: invalid_request_error, rate_limit_exceeded, server_error.
  std::string type = "server_error";
  /// OpenAI's `code` (null when empty): model_not_found, request_too_large, ...
  std::string code;
  /// The request field at fault (null when empty).
  std::string param;
  /// Sent as Retry-After when set.
  std::optional<std::chrono::seconds> retry_after;

  /// The error object, serialised.
  std::string body() const;
};

HttpError bad_request(std::string message, std::string param = {});

/// The most bytes of a client's input an error message quotes.
inline constexpr std::size_t kMaxQuotedBytes = 256;

/// `text` as an error message may quote it: whole when short, else its first `max_bytes` bytes
/// (cut where a UTF-8 character starts) and "…". A client's input (a model name, a key) can run to
/// megabytes, which its error must not echo.
std::string quote_for_error(std::string_view text, std::size_t max_bytes = kMaxQuotedBytes);

/// The two generation endpoints.
enum class Endpoint : std::uint8_t { chat_completions, completions };

/// "/v1/chat/completions" or "/v1/completions".
std::string_view path_of(Endpoint endpoint);

/// What routing reads from a client's request body (the body itself is forwarded as it came).
struct GenerationRequest {
  Endpoint endpoint = Endpoint::chat_completions;
  std::string model;
  bool stream = false;
  /// max_tokens (or max_completion_tokens), when given: the expected output length.
  std::optional<std::uint32_t> max_tokens;
  /// OpenAI's `user`: the tenant unless x-kvr-tenant names one.
  std::string user;
  /// A completions prompt given as token ids (the first, for a batch of prompts); empty for text
  /// and chat, which an engine renders.
  std::vector<std::uint32_t> prompt_token_ids;
  /// The prompt's text, when asked for (the `estimate` tokenizer mode) and the prompt is not
  /// token ids: each chat message as "<role>: <text parts>\n" (a part without text as its JSON),
  /// or the completions prompt (the first, for a batch of prompts).
  std::string prompt_text;
  /// stream_options.include_usage: a streamed answer ends with a usage event.
  bool include_usage = false;
  /// OpenAI's `n`, the choices asked for, when given; 0 when it is not a positive integer (an
  /// engine judges it; kvr's generate API, which answers one choice, refuses it).
  std::optional<std::uint64_t> choices;
  /// The sampling parameters the body names (temperature, top_p, top_k, min_p, seed, stop,
  /// stop_token_ids, presence/frequency/repetition_penalty, ignore_eos, min_tokens,
  /// skip_special_tokens), for workers served through kvr's generate API.
  v1::SamplingParams sampling;
};

/// Whether parse_generation_request keeps the prompt's text.
enum class PromptTextUse : std::uint8_t { skip, keep };

/// Parses and checks a request body (simdjson's on-demand parser: prompts run to megabytes of
/// token ids): a JSON object with a non-empty string `model`, `messages` (chat: a non-empty array
/// of objects with a string `role`) or `prompt` (completions: a string, an array of strings, an
/// array of token ids or an array of such arrays), and well-typed `stream`, `max_tokens`,
/// `max_completion_tokens`, `user` and `stream_options`. The whole body is checked first, without
/// recursion, as the strictest reader of it (nlohmann's, the native tokenizer's) would read it:
/// valid JSON with every \u escape a whole UTF-16 character, nested no deeper than
/// `max_json_depth` levels (the body itself the first; at most tokenizer::kMaxJsonDepthCeiling),
/// tool-call arguments given as JSON strings included. The error names the field (400).
std::expected<GenerationRequest, HttpError> parse_generation_request(
    Endpoint endpoint, std::string_view body, PromptTextUse text_use = PromptTextUse::skip,
    int max_json_depth = tokenizer::kDefaultMaxJsonDepth);

/// The HTTP error a client gets for a route error: invalid request 400; rejected or rate-limited
/// by admission 429; overloaded, no routable worker, unavailable or owner lost 503; policy failure
/// 500; timeout or due time expired 504; worker failed 502.
HttpError error_for_route(const v1::RouteError& error);

/// vLLM's /tokenize body for a client's request body: its model and messages (with the chat
/// fields that change the rendering), or its first prompt; for engines without render endpoints.
std::string tokenize_request_body(bool chat, const std::string& client_body);

/// The token ids of an engine's render answer (an object for chat, an array for completions) or
/// of its /tokenize answer; nullopt when it carries none.
std::optional<std::vector<std::uint32_t>> rendered_token_ids(const std::string& body,
                                                             bool tokenize);

/// The prompt's token counts an engine reports in `usage`.
struct AnswerUsage {
  std::uint64_t prompt_tokens = 0;
  /// usage.prompt_tokens_details.cached_tokens; 0 when the engine leaves it out.
  std::uint64_t cached_tokens = 0;
};

/// The last `usage` object of an OpenAI answer: a whole JSON answer, or the end of a streamed one
/// (its final usage event, sent when the request asked for stream_options.include_usage);
/// nullopt when there is none (or it is null).
std::optional<AnswerUsage> answer_usage(std::string_view answer);

}  // namespace kvr::front_door
