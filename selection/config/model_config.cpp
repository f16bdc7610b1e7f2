#include "selection/config/model_config.hpp"

namespace kvr::selection {

std::optional<TokenizerMode> tokenizer_mode_from(std::string_view name) {
  if (name == "engine") return TokenizerMode::engine;
  if (name == "estimate") return TokenizerMode::estimate;
  if (name == "native") return TokenizerMode::native;
  return std::nullopt;
}

std::string_view as_str(TokenizerMode mode) {
  switch (mode) {
    case TokenizerMode::engine:
      return "engine";
    case TokenizerMode::estimate:
      return "estimate";
    case TokenizerMode::native:
      return "native";
  }
  return "engine";
}

std::string_view tokenizer_mode_names() { return "engine, estimate, native"; }

TokenizerModes tokenizer_modes(TokenizerMode default_mode,
                               const std::map<std::string, ModelConfig, std::less<>>& models) {
  TokenizerModes modes{.default_mode = default_mode};
  for (const auto& [model, config] : models) {
    if (config.tokenizer_mode) modes.per_model.emplace(model, *config.tokenizer_mode);
  }
  return modes;
}

}  // namespace kvr::selection
