// The BPE model of a tokenizer.json: vocabulary and merge ranks, encoding one pre-tokenized
// piece at a time. Byte-level vocabularies are respelt in raw bytes at load.
#pragma once

#include <array>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <simdjson.h>

#include "selection/tokenizer/string_map.hpp"
#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// Byte-pair encoding over a vocabulary and ranked merges (HuggingFace's `BPE` model).
class BpeModel {
 public:
  /// Reads `"model"` of a tokenizer.json. `byte_level` respells the vocabulary from GPT-2's byte
  /// alphabet into raw bytes (the pre-tokenizer is ByteLevel).
  static std::expected<BpeModel, TokenizerError> load(simdjson::dom::element model,
                                                      bool byte_level);

  /// Appends the ids of one piece of pre-tokenized text.
  void encode_piece(std::string_view piece, TokenIds& ids) const;

  /// The id of a vocabulary entry spelt as the model sees it (raw bytes for byte-level models).
  std::optional<TokenId> id_of(std::string_view token) const;

  /// The spelling of `id` that decoders receive (raw bytes for byte-level entries), or nothing
  /// for an id outside the vocabulary.
  const std::string* token_of(TokenId id) const;

  /// One more than the largest id of the vocabulary.
  std::size_t id_bound() const { return token_of_id_.size(); }

  /// Whether each id a piece encodes to spells the text it covers, or stands for one character
  /// (byte fallback, an unknown token): then the fewest spellings a piece can be cut into bound
  /// its ids from below (SpellingTrie). Not with affixes, fused unknown tokens, or characters
  /// that would be dropped for want of any id.
  bool spellings_bound_ids() const;

 private:
  struct Merge {
    std::uint32_t rank;
    TokenId merged;
  };
  struct Symbol {
    TokenId id;
    std::int32_t previous;
    std::int32_t next;
  };

  static std::uint64_t pair_key(TokenId left, TokenId right) {
    return (std::uint64_t{left} << 32) | right;
  }
  const Merge* merge_of(TokenId left, TokenId right) const;
  void initial_symbols(std::string_view piece, std::vector<Symbol>& symbols) const;
  void merge_symbols(std::vector<Symbol>& symbols) const;

  StringMap<TokenId> id_of_token_;
  std::vector<std::string> token_of_id_;
  std::vector<bool> known_id_;
  absl::flat_hash_map<std::uint64_t, Merge> merges_;
  std::array<std::optional<TokenId>, 256> byte_token_{};
  std::optional<TokenId> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  bool byte_level_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
};

}  // namespace kvr::tokenizer
