// Per-model settings of the router-policy YAML's `models` section: how the front doors (the
// OpenAI HTTP API and the endpoint picker) get a prompt's routing key for each model, and when a
// model served by prefill and decode workers sends a request through the prefill hop.
// Installed with the plugin SDK; the contract: docs/plugin-api.md.
//
//   models:
//     llama-3.1-8b:
//       tokenizer_mode: estimate    # engine, estimate or native (the default: --tokenizer-mode)
//       content_special_tokens: text  # native mode: `<|im_start|>` in a message is text, not
//                                     # the token (default: special, as vLLM)
//       disaggregation:
//         min_uncached_tokens: 512  # fewer to compute on the best decode worker: decode alone
//         prefill_queue_check: true # decode alone when the prefill pool is the slower way
//         transfer_valid_ms: 30000  # a decode retry reuses the prefill's KV while this young
#pragma once

#include <chrono>
#include <cstdint>
#include <expected>
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

/// A disaggregation setting out of range: the key under `disaggregation` and what is wrong.
struct DisaggregationConfigError {
  std::string key;
  std::string message;
};

/// How a generate request of a model served by prefill and decode workers is split
/// (docs/disaggregation.md). The defaults are what a model without the section runs.
struct DisaggregationConfig {
  /// Conditional disaggregation: a request with fewer prompt tokens than this left to compute on
  /// the best decode worker (its prefix cached there, or a short prompt) skips the prefill hop and
  /// runs on that decode worker alone. 0: every request takes the hop.
  std::uint64_t min_uncached_tokens = 0;
  /// Also skip the hop when the prefill pool is the slower way: the least prefill work queued on
  /// an eligible prefill worker (its queue plus the request's uncached tokens there) exceeds what
  /// the best decode worker would compute for it locally (its queue plus the request's own).
  bool prefill_queue_check = false;
  /// A decode worker that fails before its first token is replaced with the same transfer
  /// parameters while the prefill answered less than this long ago and its worker is still in
  /// the fleet (the engine holds the KV for a while: vLLM's NIXL abort timeout); else the request
  /// is prefilled again.
  std::chrono::milliseconds transfer_valid{30'000};

  /// Checks ranges; the error names the key.
  std::expected<void, DisaggregationConfigError> validate() const;
};

/// One entry of `models`.
struct ModelConfig {
  /// Unset: the node's default (--tokenizer-mode).
  std::optional<TokenizerMode> tokenizer_mode;
  /// Unset: DisaggregationConfig's defaults.
  std::optional<DisaggregationConfig> disaggregation;
  /// `content_special_tokens: text`: in the native mode, special tokens spelled in a chat
  /// message's content are encoded as text rather than as the tokens (`special`, the default, as
  /// vLLM and SGLang encode them). On kvr's generate path these ids are what the model runs.
  bool content_special_tokens_as_text = false;
};

/// The disaggregation settings of `model` in `models` (the defaults when it has none).
DisaggregationConfig disaggregation_of(
    const std::map<std::string, ModelConfig, std::less<>>& models, std::string_view model);

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
