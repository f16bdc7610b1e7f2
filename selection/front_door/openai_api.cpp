#include "selection/front_door/openai_api.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <simdjson.h>

namespace kvr::front_door {
namespace {

using Json = nlohmann::json;

Json null_if_empty(const std::string& value) { return value.empty() ? Json() : Json(value); }

namespace ondemand = simdjson::ondemand;

// A route error's message is cut to this many bytes (it quotes a model's name, say).
constexpr std::size_t kMaxRouteErrorBytes = 1024;

// A token id: an unsigned integer of 32 bits.
bool read_token_id(ondemand::value value, std::vector<std::uint32_t>& into) {
  std::uint64_t id = 0;
  if (value.get_uint64().get(id) || id > UINT32_MAX) return false;
  into.push_back(static_cast<std::uint32_t>(id));
  return true;
}

// Appends a message's content to `text`: a string as it is, an array of parts by their `text`
// (a part without one, an image say, by its JSON); null (an assistant's tool call) adds nothing.
bool append_content(ondemand::value content, std::string& text) {
  ondemand::json_type type;
  if (content.type().get(type)) return false;
  if (type == ondemand::json_type::null) return true;
  if (type == ondemand::json_type::string) {
    std::string_view part;
    if (content.get_string().get(part)) return false;
    text += part;
    return true;
  }
  ondemand::array parts;
  if (type != ondemand::json_type::array || content.get_array().get(parts)) return false;
  for (auto element : parts) {
    ondemand::object part;
    if (element.get_object().get(part)) return false;
    std::string_view part_text;
    if (!part.find_field_unordered("text").get_string().get(part_text)) {
      text += part_text;
      continue;
    }
    part.reset();
    std::string_view raw;
    if (part.raw_json().get(raw)) return false;
    text += raw;
  }
  return true;
}

// Checks the messages; with `text`, appends each as "<role>: <content>\n".
std::expected<void, HttpError> read_messages(ondemand::value value, std::string* text) {
  const auto fail = [](std::string message) {
    return std::unexpected(bad_request(std::move(message), "messages"));
  };
  ondemand::array messages;
  if (value.get_array().get(messages)) return fail("messages: a non-empty array is required");
  std::size_t count = 0;
  for (auto element : messages) {
    ondemand::object message;
    std::string_view role;
    if (element.get_object().get(message) ||
        message.find_field_unordered("role").get_string().get(role)) {
      return fail(fmt::format("messages[{}]: an object with a string role is required", count));
    }
    if (text != nullptr) {
      *text += role;
      *text += ": ";
      ondemand::value content;
      const auto found = message.find_field_unordered("content").get(content);
      if (found != simdjson::NO_SUCH_FIELD &&
          (found != simdjson::SUCCESS || !append_content(content, *text))) {
        return fail(fmt::format(
            "messages[{}].content: a string or an array of content parts is required", count));
      }
      *text += '\n';
    }
    ++count;
  }
  if (count == 0) return fail("messages: a non-empty array is required");
  return {};
}

// ---- token-id arrays ---------------------------------------------------------------------------
// A prompt of token ids is most of a request's bytes (an 80 KB body for 14,000 tokens), and
// reading it element by element through simdjson was the largest part of the node's own time to
// a first token. A plainly written array of ids is read ahead, eight digits at a time, and
// blanked before the body is read; anything else is read element by element, which decides what
// is valid.

bool is_json_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// The decimal digits at `p` (at most 8 are read; 8 bytes must be readable): their count and value.
int read_eight_digits(const char* p, std::uint64_t& value) {
  std::uint64_t chunk = 0;
  std::memcpy(&chunk, p, sizeof chunk);
  const std::uint64_t offsets = chunk - 0x3030303030303030ULL;
  // A byte is no digit when its offset from '0' is 10 or more (or wrapped below zero). A borrow or
  // carry only reaches the bytes after the first such byte, which are not read.
  const std::uint64_t not_digits =
      ((offsets + 0x7676767676767676ULL) | offsets) & 0x8080808080808080ULL;
  const int digits = not_digits == 0 ? 8 : std::countr_zero(not_digits) / 8;
  if (digits == 0) return 0;
  // The digits moved to the top bytes (the first the most significant), then combined pairwise.
  std::uint64_t v = offsets << (8 * (8 - digits));
  v = (v * 10 + (v >> 8)) & 0x00FF00FF00FF00FFULL;
  v = (v * 100 + (v >> 16)) & 0x0000FFFF0000FFFFULL;
  v = (v * 10000 + (v >> 32)) & 0x00000000FFFFFFFFULL;
  value = v;
  return digits;
}

// Reads the ids of the array at `begin` if it is a JSON array of unsigned integers of 32 bits
// written plainly ("[1, 22, 333]": no sign, fraction, exponent or leading zero, and not empty);
// returns the position after its ']', or null, appending nothing, for anything else. The text
// runs to `end`, followed by 8 readable bytes (simdjson's padding).
const char* read_plain_token_ids(const char* begin, const char* end,
                                 std::vector<std::uint32_t>& ids) {
  const std::size_t had = ids.size();
  const auto refuse = [&]() -> const char* {
    ids.resize(had);
    return nullptr;
  };
  const char* p = begin;
  const auto skip_space = [&] {
    while (p < end && is_json_space(*p)) ++p;
  };
  if (p == end || *p != '[') return nullptr;
  ++p;
  for (;;) {
    skip_space();
    if (p == end || !is_digit(*p) || (*p == '0' && p + 1 < end && is_digit(p[1]))) {
      return refuse();
    }
    std::uint64_t id = 0;
    const int digits = read_eight_digits(p, id);
    p += digits;
    if (digits == 8) {
      // Up to two more: ten digits can still be a 32-bit id.
      for (int more = 0; more < 2 && p < end && is_digit(*p); ++more) id = id * 10 + (*p++ - '0');
      if (p < end && is_digit(*p)) return refuse();
    }
    if (p > end || id > UINT32_MAX) return refuse();
    ids.push_back(static_cast<std::uint32_t>(id));
    skip_space();
    if (p < end && *p == ',') {
      ++p;
      continue;
    }
    if (p == end || *p != ']') return refuse();
    return p + 1;
  }
}

// The completion prompt's ids when they are written plainly, read ahead of the body's other
// fields, and the body without them (the array left empty), so that reading the body walks no
// index entry per id and per comma (most of simdjson's time on such a body). Nullopt for any
// other body.
struct PromptReadAhead {
  std::vector<std::uint32_t> ids;
  simdjson::padded_string rest;
  // Where the ids were cut out of the body: from this position of `rest`, so many bytes.
  std::size_t cut_at = 0;
  std::size_t cut_bytes = 0;
};
std::optional<PromptReadAhead> read_plain_prompt_ahead(ondemand::parser& parser,
                                                       const simdjson::padded_string& padded) {
  ondemand::document document;
  ondemand::object object;
  if (parser.iterate(padded).get(document) || document.get_object().get(object)) {
    return std::nullopt;
  }
  for (auto field : object) {
    std::string_view key;
    if (field.unescaped_key().get(key)) return std::nullopt;
    if (key != "prompt") continue;
    ondemand::value value;
    if (field.value().get(value)) return std::nullopt;
    const char* const begin = value.raw_json_token().data();
    PromptReadAhead ahead;
    ahead.ids.reserve(padded.size() / 4);
    const char* const after = read_plain_token_ids(begin, padded.data() + padded.size(), ahead.ids);
    if (after == nullptr) return std::nullopt;
    const std::string_view body{padded.data(), padded.size()};
    std::string rest;
    rest.reserve(body.size() - static_cast<std::size_t>(after - begin) + 2);
    rest.append(body.substr(0, static_cast<std::size_t>(begin - padded.data()) + 1));
    rest.append(body.substr(static_cast<std::size_t>(after - padded.data()) - 1));
    ahead.rest = simdjson::padded_string{rest};
    ahead.cut_at = static_cast<std::size_t>(begin - padded.data()) + 1;
    ahead.cut_bytes = static_cast<std::size_t>(after - begin) - 2;
    return ahead;
  }
  return std::nullopt;
}

// A string, strings, token ids, or lists of token ids; the ids (of the first list) go to `ids`,
// with `text` the (first) string to `text`.
std::expected<void, HttpError> read_prompt(ondemand::value value, std::vector<std::uint32_t>& ids,
                                           std::string* text) {
  const auto fail = [] {
    return std::unexpected(bad_request(
        "prompt: a string, an array of strings or an array of token ids is required", "prompt"));
  };
  ondemand::json_type type;
  if (value.type().get(type)) return fail();
  if (type == ondemand::json_type::string) {
    std::string_view prompt;
    if (value.get_string().get(prompt)) return fail();
    if (text != nullptr) *text = prompt;
    return {};
  }
  ondemand::array prompt;
  if (type != ondemand::json_type::array || value.get_array().get(prompt)) return fail();
  std::optional<ondemand::json_type> kind;
  std::size_t count = 0;
  for (auto element : prompt) {
    ondemand::value item;
    ondemand::json_type item_type;
    if (element.get(item) || item.type().get(item_type)) return fail();
    if (kind && *kind != item_type) return fail();
    kind = item_type;
    if (item_type == ondemand::json_type::number) {
      if (!read_token_id(item, ids)) return fail();
    } else if (item_type == ondemand::json_type::string) {
      std::string_view item_text;
      if (item.get_string().get(item_text)) return fail();
      if (text != nullptr && count == 0) *text = item_text;
    } else if (item_type == ondemand::json_type::array) {
      // Lists of token ids: the first is routed, the others only checked.
      std::vector<std::uint32_t> checked;
      std::vector<std::uint32_t>& into = count == 0 ? ids : checked;
      ondemand::array list;
      if (item.get_array().get(list)) return fail();
      std::size_t size = 0;
      for (auto id : list) {
        ondemand::value id_value;
        if (id.get(id_value) || !read_token_id(id_value, into)) return fail();
        ++size;
      }
      if (size == 0) return fail();
      checked.clear();
    } else {
      return fail();
    }
    ++count;
  }
  if (count == 0) return fail();
  return {};
}

}  // namespace

std::string HttpError::body() const {
  return Json{{"error",
               {{"message", message},
                {"type", type},
                {"param", null_if_empty(param)},
                {"code", null_if_empty(code)}}}}
      // A message may quote a client's bytes, which need not be UTF-8: never a throw.
      .dump(-1, ' ', false, Json::error_handler_t::replace);
}

HttpError bad_request(std::string message, std::string param) {
  return HttpError{.status = 400,
                   .message = std::move(message),
                   .type = "invalid_request_error",
                   .param = std::move(param)};
}

std::string quote_for_error(std::string_view text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string{text};
  std::size_t cut = max_bytes;
  // Not inside a UTF-8 sequence: back to the start of the character that does not fit.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0U) == 0x80U) --cut;
  std::string quoted{text.substr(0, cut)};
  quoted += "…";
  return quoted;
}

std::string_view path_of(Endpoint endpoint) {
  return endpoint == Endpoint::chat_completions ? "/v1/chat/completions" : "/v1/completions";
}

namespace {

// Reads `key` into `sampling` when it is a sampling parameter (anything else is left to the
// engine); the error names a parameter of the wrong type.
std::expected<void, HttpError> read_sampling_parameter(std::string_view key, ondemand::value& value,
                                                       v1::SamplingParams& sampling) {
  const auto wrong = [key](std::string_view what) {
    const std::string name{key};
    return std::unexpected(bad_request(fmt::format("{}: {} is required", name, what), name));
  };
  const auto number = [&](auto set) -> std::expected<void, HttpError> {
    double read = 0;
    if (value.get_double().get(read) || !std::isfinite(read)) return wrong("a number");
    set(read);
    return {};
  };
  const auto integer = [&](auto set) -> std::expected<void, HttpError> {
    std::int64_t read = 0;
    if (value.get_int64().get(read)) return wrong("an integer");
    set(read);
    return {};
  };
  const auto boolean = [&](auto set) -> std::expected<void, HttpError> {
    bool read = false;
    if (value.get_bool().get(read)) return wrong("a boolean");
    set(read);
    return {};
  };
  const auto to_float = [](double x) { return static_cast<float>(x); };
  if (key == "temperature") {
    return number([&](double x) { sampling.set_temperature(to_float(x)); });
  }
  if (key == "top_p") return number([&](double x) { sampling.set_top_p(to_float(x)); });
  if (key == "min_p") return number([&](double x) { sampling.set_min_p(to_float(x)); });
  if (key == "presence_penalty") {
    return number([&](double x) { sampling.set_presence_penalty(to_float(x)); });
  }
  if (key == "frequency_penalty") {
    return number([&](double x) { sampling.set_frequency_penalty(to_float(x)); });
  }
  if (key == "repetition_penalty") {
    return number([&](double x) { sampling.set_repetition_penalty(to_float(x)); });
  }
  if (key == "top_k") {
    return integer([&](std::int64_t x) {
      sampling.set_top_k(static_cast<std::int32_t>(std::clamp<std::int64_t>(x, -1, INT32_MAX)));
    });
  }
  if (key == "seed") return integer([&](std::int64_t x) { sampling.set_seed(x); });
  if (key == "min_tokens") {
    return integer([&](std::int64_t x) {
      sampling.set_min_tokens(
          static_cast<std::uint32_t>(std::clamp<std::int64_t>(x, 0, UINT32_MAX)));
    });
  }
  if (key == "ignore_eos") return boolean([&](bool x) { sampling.set_ignore_eos(x); });
  if (key == "skip_special_tokens") {
    return boolean([&](bool x) { sampling.set_skip_special_tokens(x); });
  }
  if (key == "stop") {
    std::string_view one;
    if (!value.get_string().get(one)) {
      sampling.add_stop(std::string{one});
      return {};
    }
    ondemand::array stops;
    if (value.get_array().get(stops)) return wrong("a string or an array of strings");
    for (auto stop : stops) {
      if (stop.get_string().get(one)) return wrong("a string or an array of strings");
      sampling.add_stop(std::string{one});
    }
    return {};
  }
  if (key == "stop_token_ids") {
    ondemand::array ids;
    if (value.get_array().get(ids)) return wrong("an array of token ids");
    for (auto id : ids) {
      std::uint64_t token = 0;
      if (id.get_uint64().get(token) || token > UINT32_MAX) return wrong("an array of token ids");
      sampling.add_stop_token_ids(static_cast<std::uint32_t>(token));
    }
    return {};
  }
  return {};
}

}  // namespace

std::expected<GenerationRequest, HttpError> parse_generation_request(Endpoint endpoint,
                                                                     std::string_view body,
                                                                     PromptTextUse text_use,
                                                                     int max_json_depth) {
  GenerationRequest request;
  request.endpoint = endpoint;
  // One parser per thread: it keeps its buffers between requests.
  thread_local ondemand::parser parser;
  const simdjson::padded_string padded{body};
  std::optional<PromptReadAhead> ahead;
  if (endpoint == Endpoint::completions) ahead = read_plain_prompt_ahead(parser, padded);
  // The ids read ahead are checked already: what is left of the body is walked.
  const std::string_view checked =
      ahead ? std::string_view{ahead->rest.data(), ahead->rest.size()} : body;
  max_json_depth = std::min(max_json_depth, tokenizer::kMaxJsonDepthCeiling);
  if (auto fault = tokenizer::check_request_json(checked, max_json_depth)) {
    // Bytes are counted in the body as the client sent it.
    if (ahead && fault->offset >= ahead->cut_at) fault->offset += ahead->cut_bytes;
    return std::unexpected(
        bad_request(tokenizer::request_json_message(*fault, max_json_depth), fault->field));
  }
  ondemand::document document;
  ondemand::object object;
  if (const auto error = parser.iterate(ahead ? ahead->rest : padded).get(document)) {
    return std::unexpected(
        bad_request(fmt::format("invalid JSON: {}", simdjson::error_message(error))));
  }
  if (document.get_object().get(object)) {
    return std::unexpected(bad_request("the body is not a JSON object"));
  }
  bool has_model = false;
  bool has_content = false;
  const std::string_view content_field =
      endpoint == Endpoint::chat_completions ? "messages" : "prompt";
  for (auto field : object) {
    std::string_view key;
    ondemand::value value;
    if (field.unescaped_key().get(key) || field.value().get(value)) {
      return std::unexpected(bad_request("the body is not valid JSON"));
    }
    bool null = false;
    if (value.is_null().get(null))
      return std::unexpected(bad_request("the body is not valid JSON"));
    if (key == "model") {
      std::string_view model;
      if (value.get_string().get(model) || model.empty()) {
        return std::unexpected(bad_request("model: a non-empty string is required", "model"));
      }
      request.model = model;
      has_model = true;
    } else if (key == content_field && ahead && !ahead->ids.empty()) {
      // Read ahead (never empty); the array is empty in what is read now.
      request.prompt_token_ids = std::exchange(ahead->ids, {});
      has_content = true;
    } else if (key == content_field) {
      std::string* text = text_use == PromptTextUse::keep ? &request.prompt_text : nullptr;
      auto read = endpoint == Endpoint::chat_completions
                      ? read_messages(value, text)
                      : read_prompt(value, request.prompt_token_ids, text);
      if (!read) return std::unexpected(read.error());
      has_content = true;
    } else if (null) {
      continue;
    } else if (key == "stream") {
      if (value.get_bool().get(request.stream)) {
        return std::unexpected(bad_request("stream: a boolean is required", "stream"));
      }
    } else if (key == "max_tokens" || key == "max_completion_tokens") {
      std::uint64_t tokens = 0;
      if (value.get_uint64().get(tokens) || tokens == 0 || tokens > UINT32_MAX) {
        const std::string name{key};
        return std::unexpected(bad_request(
            fmt::format("{}: a positive integer no larger than {} is required", name, UINT32_MAX),
            name));
      }
      request.max_tokens = static_cast<std::uint32_t>(tokens);
    } else if (key == "n") {
      std::uint64_t choices = 0;
      request.choices = value.get_uint64().get(choices) ? 0 : choices;
    } else if (key == "user") {
      std::string_view user;
      if (value.get_string().get(user)) {
        return std::unexpected(bad_request("user: a string is required", "user"));
      }
      request.user = user;
    } else if (key == "stream_options") {
      ondemand::object options;
      if (value.get_object().get(options)) {
        return std::unexpected(
            bad_request("stream_options: an object is required", "stream_options"));
      }
      for (auto option : options) {
        std::string_view name;
        ondemand::value setting;
        if (option.unescaped_key().get(name) || option.value().get(setting)) {
          return std::unexpected(bad_request("the body is not valid JSON"));
        }
        if (name == "include_usage" && setting.get_bool().get(request.include_usage)) {
          return std::unexpected(
              bad_request("stream_options.include_usage: a boolean is required", "stream_options"));
        }
      }
    } else if (auto sampled = read_sampling_parameter(key, value, request.sampling); !sampled) {
      return std::unexpected(sampled.error());
    }
  }
  if (!has_model) {
    return std::unexpected(bad_request("model: a non-empty string is required", "model"));
  }
  if (!has_content) {
    return std::unexpected(
        endpoint == Endpoint::chat_completions
            ? bad_request("messages: a non-empty array is required", "messages")
            : bad_request(
                  "prompt: a string, an array of strings or an array of token ids is required",
                  "prompt"));
  }
  return request;
}

HttpError error_for_route(const v1::RouteError& error) {
  // A route error can name the request's model or routing group, which the client chose.
  const std::string message = quote_for_error(error.message(), kMaxRouteErrorBytes);
  const auto server = [&](unsigned status, std::string code) {
    return HttpError{
        .status = status, .message = message, .type = "server_error", .code = std::move(code)};
  };
  switch (error.code()) {
    case v1::ROUTE_ERROR_INVALID_REQUEST:
      return bad_request(message);
    case v1::ROUTE_ERROR_REJECTED:
    case v1::ROUTE_ERROR_RATE_LIMITED: {
      HttpError limited{.status = 429,
                        .message = message,
                        .type = "rate_limit_exceeded",
                        .code = "rate_limit_exceeded"};
      // Retry-After is in whole seconds: rounded up, so a client that waits it is admitted.
      if (error.has_retry_after_ms()) {
        limited.retry_after = std::chrono::seconds{(error.retry_after_ms() + 999) / 1000};
      }
      return limited;
    }
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

std::optional<AnswerUsage> answer_usage(std::string_view answer) {
  const std::size_t key = answer.rfind("\"usage\"");
  if (key == std::string_view::npos) return std::nullopt;
  std::size_t at = answer.find_first_not_of(" \t\r\n:", key + 7);
  if (at == std::string_view::npos || answer[at] != '{') return std::nullopt;
  // The object's extent: braces outside strings.
  const std::size_t begin = at;
  int depth = 0;
  bool in_string = false;
  for (; at < answer.size(); ++at) {
    const char c = answer[at];
    if (in_string) {
      if (c == '\\') {
        ++at;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      ++depth;
    } else if (c == '}' && --depth == 0) {
      break;
    }
  }
  if (depth != 0 || at >= answer.size()) return std::nullopt;
  const nlohmann::json usage =
      nlohmann::json::parse(answer.substr(begin, at + 1 - begin), nullptr, false);
  if (!usage.is_object() || !usage.contains("prompt_tokens") ||
      !usage["prompt_tokens"].is_number_unsigned()) {
    return std::nullopt;
  }
  AnswerUsage result{.prompt_tokens = usage["prompt_tokens"].get<std::uint64_t>()};
  const auto details = usage.find("prompt_tokens_details");
  if (details != usage.end() && details->is_object() && details->contains("cached_tokens") &&
      (*details)["cached_tokens"].is_number_unsigned()) {
    result.cached_tokens = (*details)["cached_tokens"].get<std::uint64_t>();
  }
  return result;
}

std::string tokenize_request_body(bool chat, const std::string& client_body) {
  // Ordered: a chat template sees the keys (of tools, say) in the client's order.
  using Ordered = nlohmann::ordered_json;
  const Ordered request = Ordered::parse(client_body, nullptr, false);
  Ordered body{{"model", request.value("model", Ordered())}};
  if (chat) {
    for (const char* field : {"messages", "add_generation_prompt", "continue_final_message",
                              "chat_template", "chat_template_kwargs", "tools"}) {
      if (const auto found = request.find(field); found != request.end()) body[field] = *found;
    }
  } else {
    const Ordered& prompt = request["prompt"];
    body["prompt"] = prompt.is_array() ? prompt[0] : prompt;
  }
  return body.dump();
}

namespace {

// An array of 32-bit token ids, or nullopt.
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

}  // namespace

std::optional<std::vector<std::uint32_t>> rendered_token_ids(const std::string& body,
                                                             bool tokenize) {
  const Json parsed = Json::parse(body, nullptr, false);
  if (tokenize) return parsed.is_object() ? read_ids(parsed.value("tokens", Json())) : std::nullopt;
  const Json& first = parsed.is_array() && !parsed.empty() ? parsed[0] : parsed;
  return first.is_object() ? read_ids(first.value("token_ids", Json())) : std::nullopt;
}

}  // namespace kvr::front_door
