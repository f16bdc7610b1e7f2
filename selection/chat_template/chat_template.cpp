// ChatTemplate and ChatTemplateConfig: the public face of the chat-template renderer, where the
// library's internal failures become TemplateErrors.
#include "selection/chat_template/chat_template.hpp"

#include <fmt/format.h>

#include "selection/chat_template/interpreter.hpp"
#include "selection/chat_template/parser.hpp"

namespace kvr::chat_template {
namespace {

using Json = nlohmann::ordered_json;

// transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order.
constexpr std::string_view kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                               "pad_token", "cls_token", "mask_token"};

// A special token as a string: a plain string, or an AddedToken's content.
std::optional<std::string> token_text(const Json& token) {
  if (token.is_string()) {
    return token.get<std::string>();
  }
  if (token.is_object()) {
    const auto content = token.find("content");
    if (content != token.end() && content->is_string()) {
      return content->get<std::string>();
    }
  }
  return std::nullopt;
}

TemplateError named_error(std::string_view name, TemplateError error) {
  error.message = fmt::format("chat template '{}': {}", name, error.message);
  return error;
}

}  // namespace

std::expected<ChatTemplate, TemplateError> ChatTemplate::parse(std::string_view source) {
  try {
    return ChatTemplate(detail::parse_program(source));
  } catch (detail::TemplateFailure& failure) {
    return std::unexpected(std::move(failure.error()));
  }
}

std::expected<std::string, TemplateError> ChatTemplate::render(
    const nlohmann::ordered_json& context, const RenderEnvironment& env) const {
  if (!context.is_object()) {
    return std::unexpected(TemplateError{"the render context must be a JSON object", 0});
  }
  std::vector<Binding> bindings;
  bindings.reserve(context.size());
  for (auto it = context.begin(); it != context.end(); ++it) {
    bindings.emplace_back(it.key(), &it.value());
  }
  return render_bindings(bindings, env);
}

std::expected<std::string, TemplateError> ChatTemplate::render_bindings(
    std::span<const Binding> bindings, const RenderEnvironment& env) const {
  try {
    return detail::render_program(*program_, bindings, env.now);
  } catch (detail::TemplateFailure& failure) {
    return std::unexpected(std::move(failure.error()));
  }
}

std::expected<ChatTemplateConfig, TemplateError> ChatTemplateConfig::from_tokenizer_config(
    const nlohmann::ordered_json& config) {
  if (!config.is_object()) {
    return std::unexpected(TemplateError{"tokenizer_config.json must hold a JSON object", 0});
  }
  ChatTemplateConfig result;
  for (const std::string_view name : kSpecialTokens) {
    const auto it = config.find(std::string(name));
    if (it == config.end()) {
      continue;
    }
    if (auto text = token_text(*it)) {
      result.special_tokens_[std::string(name)] = std::move(*text);
    }
  }
  if (const auto it = config.find("additional_special_tokens");
      it != config.end() && it->is_array()) {
    Json tokens = Json::array();
    for (const Json& token : *it) {
      if (auto text = token_text(token)) {
        tokens.push_back(std::move(*text));
      }
    }
    result.special_tokens_["additional_special_tokens"] = std::move(tokens);
  }

  const auto chat_template = config.find("chat_template");
  if (chat_template == config.end() || chat_template->is_null()) {
    return result;
  }
  if (chat_template->is_string()) {
    auto parsed = ChatTemplate::parse(chat_template->get_ref<const std::string&>());
    if (!parsed) {
      return std::unexpected(parsed.error());
    }
    result.default_template_ = std::move(*parsed);
    return result;
  }
  if (!chat_template->is_array()) {
    return std::unexpected(TemplateError{
        "chat_template must be a string or a list of {\"name\", \"template\"} objects", 0});
  }
  for (const Json& entry : *chat_template) {
    const auto name = entry.is_object() ? entry.find("name") : entry.end();
    const auto source = entry.is_object() ? entry.find("template") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string() || source == entry.end() ||
        !source->is_string()) {
      return std::unexpected(TemplateError{
          "each entry of a chat_template list needs a string \"name\" and \"template\"", 0});
    }
    const std::string& template_name = name->get_ref<const std::string&>();
    auto parsed = ChatTemplate::parse(source->get_ref<const std::string&>());
    if (!parsed) {
      return std::unexpected(named_error(template_name, parsed.error()));
    }
    if (template_name == "default") {
      result.default_template_ = *parsed;
    }
    result.named_.emplace_back(template_name, std::move(*parsed));
  }
  return result;
}

const ChatTemplate* ChatTemplateConfig::find_template(std::string_view name) const {
  for (const auto& [template_name, chat_template] : named_) {
    if (template_name == name) {
      return &chat_template;
    }
  }
  if (name == "default" && default_template_) {
    return &*default_template_;
  }
  return nullptr;
}

std::vector<std::string> ChatTemplateConfig::template_names() const {
  std::vector<std::string> names;
  names.reserve(named_.size());
  for (const auto& [name, chat_template] : named_) {
    names.push_back(name);
  }
  return names;
}

std::expected<std::string, TemplateError> ChatTemplateConfig::render_chat(
    const ChatRequest& request, const RenderEnvironment& env) const {
  if (!has_template()) {
    return std::unexpected(TemplateError{
        "the tokenizer config has no chat_template: this model cannot render chats", 0});
  }
  const ChatTemplate* chosen = nullptr;
  if (request.template_name) {
    chosen = find_template(*request.template_name);
    if (chosen == nullptr) {
      return std::unexpected(
          TemplateError{fmt::format("no chat template named '{}'", *request.template_name), 0});
    }
  } else {
    if (!request.tools.is_null()) {
      chosen = find_template("tool_use");
    }
    if (chosen == nullptr) {
      chosen = default_template_ ? &*default_template_ : nullptr;
    }
    if (chosen == nullptr) {
      return std::unexpected(TemplateError{
          "the tokenizer config has several chat templates and no \"default\" one; name one", 0});
    }
  }
  if (!request.messages.is_array()) {
    return std::unexpected(TemplateError{"messages must be a JSON array", 0});
  }
  if (!request.extra_kwargs.is_object()) {
    return std::unexpected(TemplateError{"extra template kwargs must be a JSON object", 0});
  }
  for (const std::string_view reserved :
       {"messages", "tools", "documents", "add_generation_prompt"}) {
    if (request.extra_kwargs.contains(std::string(reserved))) {
      return std::unexpected(TemplateError{
          fmt::format("extra template kwargs may not set '{}', the request's own field", reserved),
          0});
    }
  }
  const Json add_generation_prompt = request.add_generation_prompt;
  std::vector<ChatTemplate::Binding> bindings;
  bindings.reserve(4 + special_tokens_.size() + request.extra_kwargs.size());
  bindings.emplace_back("messages", &request.messages);
  bindings.emplace_back("tools", &request.tools);
  bindings.emplace_back("documents", &request.documents);
  bindings.emplace_back("add_generation_prompt", &add_generation_prompt);
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) {
    bindings.emplace_back(it.key(), &it.value());
  }
  for (auto it = request.extra_kwargs.begin(); it != request.extra_kwargs.end(); ++it) {
    bindings.emplace_back(it.key(), &it.value());
  }
  return chosen->render_bindings(bindings, env);
}

}  // namespace kvr::chat_template
