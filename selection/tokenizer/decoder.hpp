// The decoders of a tokenizer.json ("decoder"): token spellings back to text (byte-level,
// SentencePiece's ▁ and byte fallback, fuse, strip, replace).
#pragma once

#include <expected>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// One decoding step over the token spellings (or a sequence of steps).
class Decoder {
 public:
  virtual ~Decoder() = default;
  /// Rewrites the spellings; the text is their concatenation afterwards.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
  /// Whether this step is (or contains) ByteLevel.
  virtual bool byte_level() const { return false; }
};

/// The decoder a tokenizer.json describes, or null; an unsupported type is an error naming it.
std::expected<std::unique_ptr<Decoder>, TokenizerError> make_decoder(const nlohmann::json& spec);

}  // namespace kvr::tokenizer
