// A model's tokenizer and chat templates together: what an engine does to an OpenAI request's
// prompt before it runs, done in the router. Used by the front door's `native` mode,
// `kvr tokenize` and `kvr mocker --tokenizer`.
#pragma once

#include <cstdint>
#include <expected>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "selection/chat_template/chat_template.hpp"
#include "selection/tokenizer/request_json.hpp"
#include "selection/tokenizer/tokenizer.hpp"

namespace kvr::tokenizer {

/// A chat rendered by the model's template, and its ids.
struct RenderedChat {
  std::string text;
  TokenIds ids;
};

/// What a special token's spelling inside a chat message's content is encoded as.
enum class ContentSpecialTokens : std::uint8_t {
  /// That special token, as vLLM and SGLang encode a rendered chat by default: a user who writes
  /// `<|im_start|>` in a message writes the token.
  special,
  /// The text it spells (HuggingFace's split_special_tokens, for message content only): the
  /// template's own special tokens stay tokens.
  text,
};

/// A model's tokenizer.json and tokenizer_config.json (its chat templates and special tokens).
class PromptTokenizer {
 public:
  /// Loads `path`: a folder holding tokenizer.json and, for chats, tokenizer_config.json, or a
  /// tokenizer.json (completions prompts only). Errors name the file and what is wrong in it.
  static std::expected<std::shared_ptr<const PromptTokenizer>, TokenizerError> load(
      const std::filesystem::path& path, const TokenizerOptions& options = {},
      ContentSpecialTokens content_special_tokens = ContentSpecialTokens::special);

  const Tokenizer& tokenizer() const { return tokenizer_; }
  bool has_chat_template() const { return chat_templates_.has_template(); }

  /// A completions prompt's ids, with the post-processor's special tokens (as engines encode it).
  /// More than `max_ids` ids stop the encoding: an error with `over_id_limit` set.
  std::expected<TokenIds, TokenizerError> encode_prompt(std::string_view prompt,
                                                        std::size_t max_ids = kNoIdLimit) const;

  /// A chat rendered by the template, then encoded without added special tokens (the template
  /// writes them), as vLLM and SGLang do. More than `max_ids` ids stop the encoding: an error
  /// with `over_id_limit` set.
  std::expected<RenderedChat, TokenizerError> encode_chat(const chat_template::ChatRequest& chat,
                                                          std::size_t max_ids = kNoIdLimit) const;

  /// The chat of an OpenAI chat-completions body as an engine hands it to the template:
  /// `add_generation_prompt` defaults to true, text-only content parts are joined with
  /// newlines, tool-call arguments given as JSON strings become objects, and
  /// `chat_template_kwargs` join the context. An error names the field at fault; a body nested
  /// deeper than `max_depth` levels (at most kMaxJsonDepthCeiling), tool-call arguments given as
  /// strings included, is refused before anything of it is copied.
  static std::expected<chat_template::ChatRequest, TokenizerError> chat_from_openai(
      const nlohmann::ordered_json& body, int max_depth = kDefaultMaxJsonDepth);

 private:
  PromptTokenizer(Tokenizer tokenizer, chat_template::ChatTemplateConfig chat_templates,
                  ContentSpecialTokens content_special_tokens)
      : tokenizer_(std::move(tokenizer)),
        chat_templates_(std::move(chat_templates)),
        content_special_tokens_(content_special_tokens) {}

  /// encode_chat with special-token spellings in message content encoded as text.
  std::expected<RenderedChat, TokenizerError> encode_chat_spelling_content(
      const chat_template::ChatRequest& chat, std::size_t max_ids) const;

  Tokenizer tokenizer_;
  chat_template::ChatTemplateConfig chat_templates_;
  ContentSpecialTokens content_special_tokens_;
};

}  // namespace kvr::tokenizer
