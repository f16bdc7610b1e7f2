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

std::expected<void, DisaggregationConfigError> DisaggregationConfig::validate() const {
  // A prompt is at most 2^21 tokens: a larger threshold would silently mean "never disaggregate".
  if (min_uncached_tokens > (std::uint64_t{1} << 21)) {
    return std::unexpected(DisaggregationConfigError{
        "min_uncached_tokens", "must be at most 2097152 (the longest prompt)"});
  }
  if (transfer_valid < std::chrono::milliseconds{1} || transfer_valid > std::chrono::hours{1}) {
    return std::unexpected(
        DisaggregationConfigError{"transfer_valid_ms", "must be between 1 and 3600000 ms"});
  }
  return {};
}

DisaggregationConfig disaggregation_of(
    const std::map<std::string, ModelConfig, std::less<>>& models, std::string_view model) {
  const auto found = models.find(model);
  if (found == models.end() || !found->second.disaggregation) return {};
  return *found->second.disaggregation;
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
