// An OpenAI answer made from kvr's generate stream, for workers the front door cannot forward to
// (they registered no HTTP URL and take token ids over NATS): each GenerateChunk's token ids are
// decoded incrementally by the model's tokenizer (never splitting a UTF-8 character) into a chat
// completion or a completion, streamed as Server-Sent Events or gathered into one answer, with
// OpenAI's usage (the prompt's cached tokens from the first chunk). Plain C++; the HTTP front
// door writes what it returns.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvr/v1/routing.pb.h"
#include "selection/front_door/openai_api.hpp"
#include "selection/tokenizer/tokenizer.hpp"

namespace kvr::front_door {

class GeneratedAnswer {
 public:
  /// `tokenizer` must outlive the answer. `id` names the answer ("chatcmpl-<id>", "cmpl-<id>");
  /// `created` is its Unix time.
  GeneratedAnswer(const GenerationRequest& request, const tokenizer::Tokenizer& tokenizer,
                  std::string id, std::uint64_t prompt_tokens, std::int64_t created);

  /// Takes the stream's next chunk; streaming, returns the Server-Sent Events it makes (empty
  /// when it carries no text yet), ending with the usage event (when asked for) and `[DONE]`
  /// after the last chunk. A chunk that reports an error is not taken: see failure().
  std::string take(const v1::GenerateChunk& chunk);

  /// The error a chunk reported (the worker failed, a timeout, a cancel), as the client gets it;
  /// empty while the stream is healthy.
  std::optional<HttpError> failure(const v1::GenerateChunk& chunk) const;

  bool finished() const { return finish_reason_.has_value(); }
  /// The whole answer as one JSON object, once finished (non-streamed requests).
  std::string whole() const;

 private:
  nlohmann::json envelope(const char* object, nlohmann::json choices) const;
  std::string event(std::string_view text, const char* finish_reason) const;
  nlohmann::json usage() const;

  Endpoint endpoint_;
  std::string model_;
  bool stream_;
  bool include_usage_;
  std::string id_;
  std::int64_t created_;
  tokenizer::IncrementalDecoder decoder_;
  std::uint64_t prompt_tokens_;
  std::uint64_t cached_tokens_ = 0;
  std::uint64_t completion_tokens_ = 0;
  bool role_sent_ = false;
  std::string text_;  // gathered, when not streamed
  std::optional<std::string> finish_reason_;
};

}  // namespace kvr::front_door
