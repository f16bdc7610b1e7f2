// Per-model settings of the router-policy YAML's `models` section: how the front doors (the
// OpenAI HTTP API and the endpoint picker) get a prompt's routing key for each model.
// Installed with the plugin SDK; the contract: docs/plugin-api.md.
//
//   models:
//     llama-3.1-8b:
//       tokenizer_mode: estimate    # engine, estimate or native (the default: --tokenizer-mode)
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace kvr::selection {

/// How a front door gets the routing key of a request whose prompt is not token ids.
enum class TokenizerMode : std::uint8_t {
  /// One engine of the model renders the request into token ids (vLLM's render endpoints, else
  /// /tokenize): the ids match the engine's KV events, so the KV index applies.
  engine,
  /// No tokenizer: the prompt's text is hashed in byte blocks, matched against the partition's
  /// own index of the text it routed (PromptKeys::text_blocks).
  estimate,
  /// kvr's own tokenizer and chat templates (the model's tokenizer files, `tokenizers:` or
  /// --tokenizer), once a check against an engine's rendering agrees; `engine` until then and
  /// whenever it disagrees.
  native,
};

/// "engine", "estimate" or "native"; nullopt for another name.
std::optional<TokenizerMode> tokenizer_mode_from(std::string_view name);
std::string_view as_str(TokenizerMode mode);
/// The names tokenizer_mode_from accepts, for error messages ("engine, estimate").
std::string_view tokenizer_mode_names();

/// One entry of `models`.
struct ModelConfig {
  /// Unset: the node's default (--tokenizer-mode).
  std::optional<TokenizerMode> tokenizer_mode;
};

/// The tokenizer mode of each model: a default and the models that override it.
struct TokenizerModes {
  TokenizerMode default_mode = TokenizerMode::engine;
  std::map<std::string, TokenizerMode, std::less<>> per_model;

  TokenizerMode for_model(std::string_view model) const {
    const auto found = per_model.find(model);
    return found == per_model.end() ? default_mode : found->second;
  }
  /// True when some model may use `mode`.
  bool uses(TokenizerMode mode) const {
    if (default_mode == mode) return true;
    for (const auto& [model, model_mode] : per_model) {
      if (model_mode == mode) return true;
    }
    return false;
  }
};

/// `default_mode`, overridden by the models of `models` that set a mode.
TokenizerModes tokenizer_modes(TokenizerMode default_mode,
                               const std::map<std::string, ModelConfig, std::less<>>& models);

}  // namespace kvr::selection
