// The values every part of the native tokenizer shares: token ids and the load/encode error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvr::tokenizer {

/// A token id of a model's vocabulary (HuggingFace tokenizers use 32-bit ids).
using TokenId = std::uint32_t;

/// A sequence of token ids.
using TokenIds = std::vector<TokenId>;

/// Why a tokenizer could not be loaded or could not encode an input; the message names the
/// component, field or position at fault.
struct TokenizerError {
  std::string message;
  /// Encoding stopped because the ids ran past the caller's limit: the input may be well formed,
  /// only too long.
  bool over_id_limit = false;
};

}  // namespace kvr::tokenizer
