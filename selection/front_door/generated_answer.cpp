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
      const Json usage_event{
          {"id", id_},
          {"object",
           endpoint_ == Endpoint::chat_completions ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", model_},
          {"choices", Json::array()},
          {"usage", usage()}};
      events += "data: " + usage_event.dump() + "\n\n";
    }
    events += "data: [DONE]\n\n";
  }
  return events;
}

// One streamed event: the chat's first (the assistant's role), a piece of text, or the last (its
// finish reason).
std::string GeneratedAnswer::event(std::string_view text, const char* finish_reason) const {
  const Json reason = finish_reason == nullptr ? Json(nullptr) : Json(finish_reason);
  Json choice;
  Json data;
  if (endpoint_ == Endpoint::chat_completions) {
    Json delta = Json::object();
    if (finish_reason == nullptr) {
      if (text.empty()) delta["role"] = "assistant";
      delta["content"] = std::string{text};
    }
    choice = Json{{"index", 0},
                  {"delta", std::move(delta)},
                  {"logprobs", nullptr},
                  {"finish_reason", reason}};
    data = Json{{"id", id_},
                {"object", "chat.completion.chunk"},
                {"created", created_},
                {"model", model_},
                {"choices", Json::array({std::move(choice)})}};
  } else {
    choice = Json{{"index", 0},
                  {"text", std::string{text}},
                  {"logprobs", nullptr},
                  {"finish_reason", reason}};
    data = Json{{"id", id_},
                {"object", "text_completion"},
                {"created", created_},
                {"model", model_},
                {"choices", Json::array({std::move(choice)})}};
  }
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
  const Json reason = finish_reason_ ? Json(*finish_reason_) : Json(nullptr);
  Json choice;
  const char* object = "text_completion";
  if (endpoint_ == Endpoint::chat_completions) {
    object = "chat.completion";
    choice = Json{{"index", 0},
                  {"message", {{"role", "assistant"}, {"content", text_}}},
                  {"logprobs", nullptr},
                  {"finish_reason", reason}};
  } else {
    choice = Json{{"index", 0}, {"text", text_}, {"logprobs", nullptr}, {"finish_reason", reason}};
  }
  const Json answer{{"id", id_},
                    {"object", object},
                    {"created", created_},
                    {"model", model_},
                    {"choices", Json::array({std::move(choice)})},
                    {"usage", usage()}};
  return answer.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace kvr::front_door
