// HuggingFace's `Replace` step, which the normalizers and the decoders share: every match of a
// literal string or a regex replaced by a fixed content.
#pragma once

#include <expected>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "selection/tokenizer/regex.hpp"
#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

class Replacement {
 public:
  /// Reads `{"pattern": {"String": ...} or {"Regex": ...}, "content": ...}`.
  static std::expected<Replacement, TokenizerError> from_json(const nlohmann::json& spec);

  /// Rewrites `text` with every match replaced.
  void apply(std::string& text) const;

 private:
  std::string literal_;
  std::optional<Regex> regex_;
  std::string content_;
};

}  // namespace kvr::tokenizer
