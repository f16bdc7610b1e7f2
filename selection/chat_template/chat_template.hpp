// Chat templates as HuggingFace tokenizers ship them (tokenizer_config.json's `chat_template`):
// a renderer for the Jinja subset they use, with transformers' apply_chat_template semantics
// (trim_blocks, lstrip_blocks, raise_exception, strftime_now, tojson as json.dumps). Plain C++;
// used wherever a prompt's text must be made from an OpenAI-style chat.
#pragma once

#include <chrono>
#include <expected>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "selection/chat_template/template_error.hpp"

namespace kvr::chat_template {

namespace detail {
struct Program;
}  // namespace detail

// What the renderer walks recursively is bounded, so that no template and no render context can
// run a thread's stack out (an HTTP or gRPC thread renders clients' chats); past a bound, a parse
// or render fails with a TemplateError. A thread's stack of 8 MB holds each bound many times over,
// with AddressSanitizer's larger frames too (tests/unit/selection/chat_template/nesting_test.cpp).

/// The deepest a value may nest (a list or dict is one level, its items the next) for the walks
/// over it: tojson, printing a list or dict, ==, < and what use them. Requests nest far less: the
/// front doors refuse bodies nested deeper than their own limit (128 levels by default).
inline constexpr int kMaxValueDepth = 512;

/// The deepest a template's source may nest: blocks inside blocks, brackets and parentheses inside
/// each other, and operators, filters and attributes chained on one operand (`a - b - c`) all
/// count. Real chat templates nest a few tens of levels at most.
inline constexpr int kMaxTemplateNesting = 100;

/// The deepest a render may nest: statements and expressions being evaluated inside each other,
/// across macro calls (which also stop at 100 calls in each other).
inline constexpr int kMaxRenderNesting = 500;

/// Things a render may need from outside (injected so tests control time).
struct RenderEnvironment {
  /// The clock strftime_now reads (its local time).
  std::function<std::chrono::system_clock::time_point()> now = [] {
    return std::chrono::system_clock::now();
  };
};

/// A parsed template: parse once, render many times (render is const and thread-safe).
class ChatTemplate {
 public:
  /// Parses `source`; an unknown tag, filter or test fails here, naming it and its line.
  static std::expected<ChatTemplate, TemplateError> parse(std::string_view source);

  /// Renders with the variables of `context` (a JSON object; its values are read in place, not
  /// copied).
  std::expected<std::string, TemplateError> render(const nlohmann::ordered_json& context,
                                                   const RenderEnvironment& env = {}) const;

 private:
  friend class ChatTemplateConfig;
  using Binding = std::pair<std::string_view, const nlohmann::ordered_json*>;

  explicit ChatTemplate(std::shared_ptr<const detail::Program> program)
      : program_(std::move(program)) {}

  /// Renders with named variables; a later binding of a name replaces an earlier one.
  std::expected<std::string, TemplateError> render_bindings(std::span<const Binding> bindings,
                                                            const RenderEnvironment& env) const;

  std::shared_ptr<const detail::Program> program_;
};

/// One chat to render, as apply_chat_template takes it.
struct ChatRequest {
  /// The conversation: a JSON array of message objects (role, content, tool_calls, ...).
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  /// Tool schemas (a JSON array), or null: templates then see `tools` as none, as transformers
  /// passes it.
  nlohmann::ordered_json tools = nullptr;
  /// Documents for retrieval-augmented templates (a JSON array), or null.
  nlohmann::ordered_json documents = nullptr;
  /// Whether to end with the header of an assistant turn.
  bool add_generation_prompt = false;
  /// A named template of the config ("tool_use", ...); unset picks as transformers does.
  std::optional<std::string> template_name;
  /// Further template variables (enable_thinking, ...), a JSON object; they override the
  /// special tokens and may not set messages, tools, documents or add_generation_prompt.
  nlohmann::ordered_json extra_kwargs = nlohmann::ordered_json::object();
};

/// The chat templates (default and named) and special tokens of a tokenizer_config.json.
class ChatTemplateConfig {
 public:
  /// Reads `chat_template` (a string, a list of {"name", "template"}, or absent/null) and the
  /// special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
  /// mask_token as strings or {"content": ...} objects, or null; additional_special_tokens).
  /// Fails when a template does not parse (the message names the template).
  static std::expected<ChatTemplateConfig, TemplateError> from_tokenizer_config(
      const nlohmann::ordered_json& config);

  /// Renders a chat: messages, tools, documents, add_generation_prompt, the special tokens as
  /// transformers puts them in the context, then the request's extra kwargs. The template is
  /// the request's named one, else "tool_use" when the request has tools and the config has
  /// one, else the default; a config without templates fails with a clear error.
  std::expected<std::string, TemplateError> render_chat(const ChatRequest& request,
                                                        const RenderEnvironment& env = {}) const;

  /// Whether the config has any chat template.
  bool has_template() const { return default_template_.has_value() || !named_.empty(); }

  /// The template called `name` ("default" is the default template), or nullptr.
  const ChatTemplate* find_template(std::string_view name) const;

  /// The names of the named templates (a list-form chat_template), in the config's order.
  std::vector<std::string> template_names() const;

  /// The special tokens as the template sees them: name to string (or list of strings).
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  std::optional<ChatTemplate> default_template_;
  std::vector<std::pair<std::string, ChatTemplate>> named_;
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
};

}  // namespace kvr::chat_template
