// The normalizers of a tokenizer.json ("normalizer"): Unicode normal forms, lowercasing,
// replacement, prepending, stripping and their sequences, applied to text outside added tokens.
#pragma once

#include <expected>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// One normalizer (or a sequence of them) applied in place.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Rewrites `text` (valid UTF-8 in, valid UTF-8 out).
  virtual void normalize(std::string& text) const = 0;
};

/// The normalizer a tokenizer.json describes, or null for `"normalizer": null`; an unsupported
/// type is an error naming it.
std::expected<std::unique_ptr<Normalizer>, TokenizerError> make_normalizer(
    const nlohmann::json& spec);

}  // namespace kvr::tokenizer
