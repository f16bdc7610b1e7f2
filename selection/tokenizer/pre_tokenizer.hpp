// The pre-tokenizers of a tokenizer.json ("pre_tokenizer"): how normalized text is cut into the
// pieces the BPE model encodes one by one (regex splits, byte-level, metaspace, digits, ...).
#pragma once

#include <expected>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// The pieces of one segment of text (the text between two added tokens), cut step by step.
struct PreTokenized {
  std::vector<std::string> pieces;
  /// Whether the segment begins the whole input (Metaspace's `prepend_scheme: first`).
  bool at_input_start = false;
};

/// One pre-tokenizer (or a sequence of them).
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Cuts every piece further (or rewrites it); empty pieces are dropped.
  virtual void pre_tokenize(PreTokenized& text) const = 0;
  /// Whether this step is (or contains) ByteLevel: the model's vocabulary is spelt in GPT-2's
  /// byte alphabet.
  virtual bool byte_level() const { return false; }
};

/// The pre-tokenizer a tokenizer.json describes, or null for `"pre_tokenizer": null`; an
/// unsupported type or behaviour is an error naming it.
std::expected<std::unique_ptr<PreTokenizer>, TokenizerError> make_pre_tokenizer(
    const nlohmann::json& spec);

}  // namespace kvr::tokenizer
