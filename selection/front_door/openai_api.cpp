#include "selection/front_door/openai_api.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace kvr::front_door {
namespace {

using Json = nlohmann::json;

Json null_if_empty(const std::string& value) { return value.empty() ? Json() : Json(value); }

// A field that may be absent or null, else must pass `valid`.
template <class Valid>
bool absent_or(const Json& body, const char* field, Valid valid) {
  const auto found = body.find(field);
  return found == body.end() || found->is_null() || valid(*found);
}

std::expected<void, HttpError> check_messages(const Json& body) {
  const auto messages = body.find("messages");
  if (messages == body.end() || !messages->is_array() || messages->empty()) {
    return std::unexpected(bad_request("messages: a non-empty array is required", "messages"));
  }
  for (std::size_t i = 0; i < messages->size(); ++i) {
    const Json& message = (*messages)[i];
    const auto role = message.is_object() ? message.find("role") : message.end();
    if (!message.is_object() || role == message.end() || !role->is_string()) {
      return std::unexpected(bad_request(
          fmt::format("messages[{}]: an object with a string role is required", i), "messages"));
    }
  }
  return {};
}

std::expected<void, HttpError> check_prompt(const Json& body) {
  const auto prompt = body.find("prompt");
  const auto fail = [] {
    return std::unexpected(bad_request(
        "prompt: a string, an array of strings or an array of token ids is required", "prompt"));
  };
  if (prompt == body.end()) return fail();
  if (prompt->is_string()) return {};
  if (!prompt->is_array() || prompt->empty()) return fail();
  const bool strings = std::all_of(prompt->begin(), prompt->end(),
                                   [](const Json& item) { return item.is_string(); });
  const bool token_ids = std::all_of(prompt->begin(), prompt->end(), [](const Json& item) {
    return item.is_number_unsigned() && item.get<std::uint64_t>() <= UINT32_MAX;
  });
  const bool token_lists = std::all_of(prompt->begin(), prompt->end(), [](const Json& item) {
    return item.is_array() && !item.empty() &&
           std::all_of(item.begin(), item.end(), [](const Json& id) {
             return id.is_number_unsigned() && id.get<std::uint64_t>() <= UINT32_MAX;
           });
  });
  if (strings || token_ids || token_lists) return {};
  return fail();
}

}  // namespace

std::string HttpError::body() const {
  return Json{{"error",
               {{"message", message},
                {"type", type},
                {"param", null_if_empty(param)},
                {"code", null_if_empty(code)}}}}
      .dump();
}

HttpError bad_request(std::string message, std::string param) {
  return HttpError{.status = 400,
                   .message = std::move(message),
                   .type = "invalid_request_error",
                   .param = std::move(param)};
}

std::string_view path_of(Endpoint endpoint) {
  return endpoint == Endpoint::chat_completions ? "/v1/chat/completions" : "/v1/completions";
}

std::expected<GenerationRequest, HttpError> parse_generation_request(Endpoint endpoint,
                                                                     std::string_view body) {
  GenerationRequest request;
  request.endpoint = endpoint;
  request.body = Json::parse(body, nullptr, false);
  if (request.body.is_discarded())
    return std::unexpected(bad_request("the body is not valid JSON"));
  if (!request.body.is_object())
    return std::unexpected(bad_request("the body is not a JSON object"));
  const Json& json = request.body;
  const auto model = json.find("model");
  if (model == json.end() || !model->is_string() || model->get_ref<const std::string&>().empty()) {
    return std::unexpected(bad_request("model: a non-empty string is required", "model"));
  }
  request.model = model->get<std::string>();
  auto content = endpoint == Endpoint::chat_completions ? check_messages(json) : check_prompt(json);
  if (!content) return std::unexpected(content.error());
  if (!absent_or(json, "stream", [](const Json& v) { return v.is_boolean(); })) {
    return std::unexpected(bad_request("stream: a boolean is required", "stream"));
  }
  if (const auto stream = json.find("stream"); stream != json.end() && stream->is_boolean()) {
    request.stream = stream->get<bool>();
  }
  for (const char* field : {"max_tokens", "max_completion_tokens"}) {
    const auto tokens = json.find(field);
    if (tokens == json.end() || tokens->is_null()) continue;
    if (!tokens->is_number_unsigned() || tokens->get<std::uint64_t>() == 0 ||
        tokens->get<std::uint64_t>() > UINT32_MAX) {
      return std::unexpected(
          bad_request(fmt::format("{}: a positive integer is required", field), field));
    }
    request.max_tokens = tokens->get<std::uint32_t>();
  }
  if (!absent_or(json, "user", [](const Json& v) { return v.is_string(); })) {
    return std::unexpected(bad_request("user: a string is required", "user"));
  }
  if (const auto user = json.find("user"); user != json.end() && user->is_string()) {
    request.user = user->get<std::string>();
  }
  if (!absent_or(json, "stream_options", [](const Json& v) { return v.is_object(); })) {
    return std::unexpected(bad_request("stream_options: an object is required", "stream_options"));
  }
  return request;
}

HttpError error_for_route(const v1::RouteError& error) {
  const auto server = [&](unsigned status, std::string code) {
    return HttpError{.status = status,
                     .message = error.message(),
                     .type = "server_error",
                     .code = std::move(code)};
  };
  switch (error.code()) {
    case v1::ROUTE_ERROR_INVALID_REQUEST:
      return bad_request(error.message());
    case v1::ROUTE_ERROR_REJECTED:
    case v1::ROUTE_ERROR_RATE_LIMITED:
      return HttpError{.status = 429,
                       .message = error.message(),
                       .type = "rate_limit_exceeded",
                       .code = "rate_limit_exceeded"};
    case v1::ROUTE_ERROR_TIMEOUT:
    case v1::ROUTE_ERROR_DUE_TIME_EXPIRED:
      return server(504, "timeout");
    case v1::ROUTE_ERROR_WORKER_FAILED:
      return server(502, "worker_failed");
    case v1::ROUTE_ERROR_POLICY_FAILED:
      return server(500, "policy_failed");
    default:  // overloaded, no workers, all filtered, unavailable, owner lost
      return server(503, "service_unavailable");
  }
}

}  // namespace kvr::front_door
