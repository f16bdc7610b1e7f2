#include "selection/tokenizer/prompt_tokenizer.hpp"

#include <algorithm>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

namespace kvr::tokenizer {
namespace {

using Json = nlohmann::ordered_json;

// `chat` rendered by `templates`; a template's error names its line.
std::expected<std::string, TokenizerError> render(
    const chat_template::ChatTemplateConfig& templates, const chat_template::ChatRequest& chat) {
  auto text = templates.render_chat(chat);
  if (!text) {
    return std::unexpected(TokenizerError{
        fmt::format("chat template (line {}): {}", text.error().line, text.error().message)});
  }
  return std::move(*text);
}

// A message's content as string-format templates expect it: text parts joined with newlines.
// Parts that are not text (images, audio) have no text to render and stop the conversion.
std::expected<Json, TokenizerError> string_content(const Json& content, std::size_t index) {
  if (!content.is_array()) return content;
  std::string text;
  bool first = true;
  for (const Json& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      return std::unexpected(TokenizerError{fmt::format(
          "messages[{}].content: only text parts can be rendered by the native tokenizer", index)});
    }
    if (!first) text.push_back('\n');
    text += part["text"].get<std::string>();
    first = false;
  }
  return Json(text);
}

// Parses tool-call arguments given as a JSON string, `allowed` levels deep at most: the value
// (discarded when the text is not JSON, which leaves the string as it is), or nullopt when it
// nests deeper. The parse is nlohmann's, which does not recurse.
std::optional<Json> parse_arguments(const std::string& text, int allowed) {
  bool too_deep = false;
  Json parsed = Json::parse(
      text,
      [&](int depth, Json::parse_event_t event, Json&) {
        // `depth` counts the containers around the one that starts.
        if ((event == Json::parse_event_t::object_start ||
             event == Json::parse_event_t::array_start) &&
            depth >= allowed) {
          too_deep = true;
        }
        return !too_deep;
      },
      false);
  if (too_deep) return std::nullopt;
  return parsed;
}

}  // namespace

std::expected<std::shared_ptr<const PromptTokenizer>, TokenizerError> PromptTokenizer::load(
    const std::filesystem::path& path, const TokenizerOptions& options,
    ContentSpecialTokens content_special_tokens) {
  auto tokenizer = Tokenizer::load(path, options);
  if (!tokenizer) return std::unexpected(tokenizer.error());
  std::error_code error;
  const std::filesystem::path folder =
      std::filesystem::is_directory(path, error) ? path : path.parent_path();
  const std::filesystem::path config_file = folder / "tokenizer_config.json";
  chat_template::ChatTemplateConfig templates;
  if (std::filesystem::exists(config_file, error)) {
    std::ifstream in{config_file, std::ios::binary};
    const std::string text{std::istreambuf_iterator<char>{in}, std::istreambuf_iterator<char>{}};
    const Json config = Json::parse(text, nullptr, false);
    if (!config.is_object()) {
      return std::unexpected(
          TokenizerError{fmt::format("{}: not a JSON object", config_file.string())});
    }
    auto loaded = chat_template::ChatTemplateConfig::from_tokenizer_config(config);
    if (!loaded) {
      return std::unexpected(
          TokenizerError{fmt::format("{}: chat template line {}: {}", config_file.string(),
                                     loaded.error().line, loaded.error().message)});
    }
    templates = std::move(*loaded);
  }
  return std::shared_ptr<const PromptTokenizer>(
      new PromptTokenizer(std::move(*tokenizer), std::move(templates), content_special_tokens));
}

std::expected<TokenIds, TokenizerError> PromptTokenizer::encode_prompt(std::string_view prompt,
                                                                       std::size_t max_ids) const {
  return tokenizer_.encode(prompt, true, max_ids);
}

std::expected<RenderedChat, TokenizerError> PromptTokenizer::encode_chat(
    const chat_template::ChatRequest& chat, std::size_t max_ids) const {
  if (content_special_tokens_ == ContentSpecialTokens::text) {
    return encode_chat_spelling_content(chat, max_ids);
  }
  auto text = render(chat_templates_, chat);
  if (!text) return std::unexpected(text.error());
  auto ids = tokenizer_.encode(*text, false, max_ids);
  if (!ids) return std::unexpected(ids.error());
  return RenderedChat{.text = std::move(*text), .ids = std::move(*ids)};
}

// Message content goes through the template with each special token's spelling (and any
// U+E000, the marker's own first character) replaced by a marker: U+E000, the spelling's index,
// U+E001. The rendered text gets the spellings back, their ranges encoded as text. Whatever the
// template does with the content (trimming, splitting), a marker only stands for its spelling.
std::expected<RenderedChat, TokenizerError> PromptTokenizer::encode_chat_spelling_content(
    const chat_template::ChatRequest& chat, std::size_t max_ids) const {
  constexpr std::string_view kOpen = "\uE000";
  constexpr std::string_view kClose = "\uE001";
  std::vector<std::string> spellings;
  const auto escape = [&](const std::string& content) {
    std::vector<ByteRange> spans = tokenizer_.find_special_tokens(content);
    for (std::size_t at = content.find(kOpen); at != std::string::npos;
         at = content.find(kOpen, at + kOpen.size())) {
      spans.push_back({at, at + kOpen.size()});
    }
    std::sort(spans.begin(), spans.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    std::string escaped;
    std::size_t copied = 0;
    for (const ByteRange& span : spans) {
      if (span.begin < copied) continue;
      escaped.append(content, copied, span.begin - copied);
      escaped += fmt::format("{}{}{}", kOpen, spellings.size(), kClose);
      spellings.push_back(content.substr(span.begin, span.end - span.begin));
      copied = span.end;
    }
    escaped.append(content, copied);
    return escaped;
  };
  chat_template::ChatRequest escaped = chat;
  for (auto& message : escaped.messages) {
    if (!message.is_object()) continue;
    if (const auto content = message.find("content");
        content != message.end() && content->is_string()) {
      *content = escape(content->get<std::string>());
    }
  }
  auto rendered = render(chat_templates_, escaped);
  if (!rendered) return std::unexpected(rendered.error());
  std::string text;
  std::vector<ByteRange> literal;
  std::size_t copied = 0;
  for (std::size_t at = rendered->find(kOpen); at != std::string::npos;
       at = rendered->find(kOpen, at + 1)) {
    const std::size_t digits = at + kOpen.size();
    const std::size_t close = rendered->find(kClose, digits);
    if (close == std::string::npos || close == digits || close - digits > 9) continue;
    std::size_t index = 0;
    bool number = true;
    for (std::size_t i = digits; i < close; ++i) {
      const char digit = (*rendered)[i];
      number = number && digit >= '0' && digit <= '9';
      index = index * 10 + static_cast<std::size_t>(digit - '0');
    }
    if (!number || index >= spellings.size()) continue;
    text.append(*rendered, copied, at - copied);
    literal.push_back({text.size(), text.size() + spellings[index].size()});
    text += spellings[index];
    copied = close + kClose.size();
    at = close;
  }
  text.append(*rendered, copied);
  auto ids = tokenizer_.encode(text, false, max_ids, literal);
  if (!ids) return std::unexpected(ids.error());
  return RenderedChat{.text = std::move(text), .ids = std::move(*ids)};
}

std::expected<chat_template::ChatRequest, TokenizerError> PromptTokenizer::chat_from_openai(
    const Json& body, int max_depth) {
  max_depth = std::min(max_depth, kMaxJsonDepthCeiling);
  // Before anything is copied: nlohmann copies and prints recursively.
  if (const auto field = field_nested_too_deep(body, max_depth)) {
    return std::unexpected(TokenizerError{nested_too_deep_message(*field, max_depth)});
  }
  if (!body.is_object() || !body.contains("messages") || !body["messages"].is_array()) {
    return std::unexpected(TokenizerError{"messages: an array of messages is required"});
  }
  chat_template::ChatRequest chat;
  chat.messages = Json::array();
  std::size_t index = 0;
  for (const Json& message : body["messages"]) {
    if (!message.is_object()) {
      return std::unexpected(TokenizerError{fmt::format("messages[{}]: not an object", index)});
    }
    Json converted = message;
    if (const auto content = converted.find("content"); content != converted.end()) {
      auto text = string_content(*content, index);
      if (!text) return std::unexpected(text.error());
      *content = std::move(*text);
    }
    // Templates expect tool-call arguments as objects; OpenAI clients send JSON strings.
    if (const auto calls = converted.find("tool_calls");
        calls != converted.end() && calls->is_array()) {
      std::size_t call_index = 0;
      for (Json& call : *calls) {
        const std::size_t at = call_index++;
        if (!call.is_object() || !call.contains("function")) continue;
        Json& function = call["function"];
        if (function.is_object() && function.contains("arguments") &&
            function["arguments"].is_string()) {
          auto parsed = parse_arguments(function["arguments"].get_ref<const std::string&>(),
                                        max_depth - kToolCallArgumentsDepth);
          if (!parsed) {
            return std::unexpected(TokenizerError{nested_too_deep_message(
                fmt::format("messages[{}].tool_calls[{}].function.arguments", index, at),
                max_depth)});
          }
          if (!parsed->is_discarded()) function["arguments"] = std::move(*parsed);
        }
      }
    }
    chat.messages.push_back(std::move(converted));
    ++index;
  }
  if (const auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) return std::unexpected(TokenizerError{"tools: must be an array"});
    chat.tools = *tools;
  }
  if (const auto documents = body.find("documents");
      documents != body.end() && !documents->is_null()) {
    chat.documents = *documents;
  }
  if (const auto prompt = body.find("add_generation_prompt");
      prompt != body.end() && !prompt->is_null()) {
    if (!prompt->is_boolean()) {
      return std::unexpected(TokenizerError{"add_generation_prompt: must be a boolean"});
    }
    chat.add_generation_prompt = prompt->get<bool>();
  }
  if (const auto kwargs = body.find("chat_template_kwargs");
      kwargs != body.end() && !kwargs->is_null()) {
    if (!kwargs->is_object()) {
      return std::unexpected(TokenizerError{"chat_template_kwargs: must be an object"});
    }
    chat.extra_kwargs = *kwargs;
  }
  return chat;
}

}  // namespace kvr::tokenizer
