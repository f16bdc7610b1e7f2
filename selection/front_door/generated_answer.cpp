#include "selection/front_door/generated_answer.hpp"

#include <nlohmann/json.hpp>

namespace kvr::front_door {
namespace {

using Json = nlohmann::json;

// The worker's reason, as OpenAI names it: an end-of-sequence token or a stop string is "stop".
std::string openai_finish_reason(const std::string& reason) {
  if (reason.empty() || reason == "eos") return "stop";
  return reason;
}

}  // namespace

GeneratedAnswer::GeneratedAnswer(const GenerationRequest& request,
                                 const tokenizer::Tokenizer& tokenizer, std::string id,
                                 std::uint64_t prompt_tokens, std::int64_t created)
    : endpoint_(request.endpoint),
      model_(request.model),
      stream_(request.stream),
      include_usage_(request.include_usage),
      id_((request.endpoint == Endpoint::chat_completions ? "chatcmpl-" : "cmpl-") + std::move(id)),
      created_(created),
      // As vLLM does, special tokens stay out of the text unless the request asks for them.
      decoder_(tokenizer, !request.sampling.has_skip_special_tokens() ||
                              request.sampling.skip_special_tokens()),
      prompt_tokens_(prompt_tokens) {}

std::optional<HttpError> GeneratedAnswer::failure(const v1::GenerateChunk& chunk) const {
  if (chunk.has_error() && chunk.error().code() != v1::ROUTE_ERROR_UNSPECIFIED) {
    return error_for_route(chunk.error());
  }
  if (chunk.finish_reason() == "error") {
    return HttpError{
        .status = 502, .message = "the worker failed the request", .code = "worker_failed"};
  }
  return std::nullopt;
}

std::string GeneratedAnswer::take(const v1::GenerateChunk& chunk) {
  if (finished()) return {};
  cached_tokens_ = std::max<std::uint64_t>(cached_tokens_, chunk.cached_prompt_tokens());
  std::string text;
  for (const std::uint32_t id : chunk.token_ids()) text += decoder_.push(id);
  completion_tokens_ += static_cast<std::uint64_t>(chunk.token_ids_size());
  if (chunk.finished()) {
    text += decoder_.finish();
    finish_reason_ = openai_finish_reason(chunk.finish_reason());
  }
  if (!stream_) {
    text_ += text;
    return {};
  }
  std::string events;
  if (endpoint_ == Endpoint::chat_completions && !role_sent_) {
    role_sent_ = true;
    events += event({}, nullptr);
  }
  if (!text.empty()) events += event(text, nullptr);
  if (finished()) {
    events += event({}, finish_reason_->c_str());
    if (include_usage_) {
      Json usage_event = envelope(
          endpoint_ == Endpoint::chat_completions ? "chat.completion.chunk" : "text_completion",
          Json::array());
      usage_event["usage"] = usage();
      events += "data: " + usage_event.dump() + "\n\n";
    }
    events += "data: [DONE]\n\n";
  }
  return events;
}

// The fields every answer and event shares around its choices.
Json GeneratedAnswer::envelope(const char* object, Json choices) const {
  return Json{{"id", id_},
              {"object", object},
              {"created", created_},
              {"model", model_},
              {"choices", std::move(choices)}};
}

// One streamed event: the chat's first (the assistant's role), a piece of text, or the last (its
// finish reason).
std::string GeneratedAnswer::event(std::string_view text, const char* finish_reason) const {
  Json choice{{"index", 0},
              {"logprobs", nullptr},
              {"finish_reason", finish_reason == nullptr ? Json(nullptr) : Json(finish_reason)}};
  const bool chat = endpoint_ == Endpoint::chat_completions;
  if (chat) {
    Json delta = Json::object();
    if (finish_reason == nullptr) {
      if (text.empty()) delta["role"] = "assistant";
      delta["content"] = std::string{text};
    }
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string{text};
  }
  const Json data = envelope(chat ? "chat.completion.chunk" : "text_completion",
                             Json::array({std::move(choice)}));
  // Invalid UTF-8 cannot come out of the decoder (it repairs as U+FFFD), but a dump must not
  // throw whatever the worker sent.
  return "data: " + data.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n";
}

Json GeneratedAnswer::usage() const {
  return Json{{"prompt_tokens", prompt_tokens_},
              {"completion_tokens", completion_tokens_},
              {"total_tokens", prompt_tokens_ + completion_tokens_},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens_}}}};
}

std::string GeneratedAnswer::whole() const {
  Json choice{{"index", 0},
              {"logprobs", nullptr},
              {"finish_reason", finish_reason_ ? Json(*finish_reason_) : Json(nullptr)}};
  const bool chat = endpoint_ == Endpoint::chat_completions;
  if (chat) {
    choice["message"] = Json{{"role", "assistant"}, {"content", text_}};
  } else {
    choice["text"] = text_;
  }
  Json answer =
      envelope(chat ? "chat.completion" : "text_completion", Json::array({std::move(choice)}));
  answer["usage"] = usage();
  return answer.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace kvr::front_door
