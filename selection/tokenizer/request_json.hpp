// How a client's request body is checked before anything reads it, and how errors name a field
// of it. Readers differ: simdjson's on-demand parser (the front doors) checks only what it reads,
// nlohmann's (the native tokenizer, `kvr mocker`, `kvr tokenize`) refuses anything that is not
// JSON, and nlohmann copies, compares and prints recursively, as the chat template walks values.
// So a body is first walked whole, without recursion: JSON as RFC 8259 and nlohmann have it,
// every \u escape part of a whole UTF-16 character, nested no deeper than a limit, tool-call
// arguments given as JSON strings included. A body one reader takes, the others take, and none
// recurses deeper than the limit on it. Used by the front doors (openai_api), the native tokenizer
// (PromptTokenizer::chat_from_openai), `kvr mocker` and `kvr tokenize`.
#pragma once

#include <cstddef>
#include <expected>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "selection/chat_template/chat_template.hpp"

namespace kvr::tokenizer {

/// How deep a request body may nest by default (a JSON object or array is one level, the body
/// itself the first): room for tool schemas, which nest some tens of levels, and far from what
/// would strain the stack of a thread that copies, prints or renders the body.
inline constexpr int kDefaultMaxJsonDepth = 128;

/// The deepest a body may ever be let nest, whatever a setting says: what the chat template
/// walks (chat_template::kMaxValueDepth).
inline constexpr int kMaxJsonDepthCeiling = chat_template::kMaxValueDepth;

/// Whether `max_depth` is a depth limit a front door may be given (1 to the ceiling); the error
/// names the `kvr node` flag.
std::expected<void, std::string> validate_max_json_depth(int max_depth);

/// Where tool-call arguments sit in a chat body (messages[i].tool_calls[j].function.arguments):
/// inside this many levels. Arguments given as a JSON string nest this much deeper once parsed.
inline constexpr int kToolCallArgumentsDepth = 6;

/// One step of a path into a request body: into an object's member or an array's item.
struct JsonPathStep {
  /// The member's key (unescaped), when the step enters an object.
  std::string_view key;
  /// The item's position, when the step enters an array.
  std::size_t index = 0;
  bool in_array = false;
};

/// The field of an OpenAI request body that `path` (from the body's root) lies in, as errors name
/// it: the path down to the first value whose content is the client's own, such as
/// `tools[0].function.parameters`, `messages[2].tool_calls[0].function.arguments`,
/// `messages[1].content` or `metadata`; empty for a body that is not an object. Long keys are cut.
std::string request_field(std::span<const JsonPathStep> path);

/// What is wrong with a request body's JSON.
struct RequestJsonFault {
  /// Nested deeper than the limit; otherwise not JSON, and `what` says why.
  bool too_deep = false;
  std::string what;
  /// The byte of the body where the walk found it.
  std::size_t offset = 0;
  /// The field it is in, as request_field names it (empty: the body as a whole).
  std::string field;
};

/// Walks `body` whole without recursion: the first fault, or nullopt when it is JSON (RFC 8259:
/// no trailing commas, comments, single quotes, NaN or leading zeros; UTF-8 is left to the
/// parsers, which check it) whose every \u escape is part of a whole UTF-16 character, nested at
/// most `max_depth` levels. Tool-call arguments given as a JSON string count as what they hold,
/// nested where they sit; arguments that are not JSON stay a string and pass.
std::optional<RequestJsonFault> check_request_json(std::string_view body, int max_depth);

/// A fault as a client reads it: "<field>: nested deeper than <max_depth> levels ..." or
/// "invalid JSON at byte <offset> (in <field>): <what>".
std::string request_json_message(const RequestJsonFault& fault, int max_depth);

/// The field (as request_field names it) of the first value in `body` nested deeper than
/// `max_depth` levels, the body itself being the first; nullopt when there is none. Walks without
/// recursion, so any depth is safe.
std::optional<std::string> field_nested_too_deep(const nlohmann::ordered_json& body, int max_depth);

/// What a body nested deeper than `max_depth` at `field` is refused with.
std::string nested_too_deep_message(std::string_view field, int max_depth);

}  // namespace kvr::tokenizer
