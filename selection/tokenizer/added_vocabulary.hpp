// A tokenizer's added tokens (special tokens such as <|im_start|>, and others): found in the
// input before the model runs, with HuggingFace's lstrip, rstrip, single_word and normalized.
#pragma once

#include <bitset>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <absl/container/flat_hash_map.h>

#include "selection/tokenizer/string_map.hpp"
#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  TokenId id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

/// A piece of input: text still to encode, or an added token found in it.
struct Segment {
  std::string_view text;
  std::optional<TokenId> token;
};

/// Finds added tokens, leftmost first and longest at a position (as HuggingFace's Aho-Corasick
/// with leftmost-longest matching).
class AddedTokenMatcher {
 public:
  /// A matcher over `tokens` (empty contents are ignored).
  explicit AddedTokenMatcher(const std::vector<const AddedToken*>& tokens);

  /// Cuts `text` into segments; matches' stripped whitespace belongs to no segment.
  void split(std::string_view text, std::vector<Segment>& segments) const;

  bool empty() const { return tokens_.empty(); }

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, std::int32_t> children;
    std::int32_t token = -1;
  };
  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
  std::bitset<256> first_bytes_;
};

/// Every added token of a tokenizer, with the two matchers HuggingFace runs: tokens matched
/// in the raw input, and tokens matched after normalization.
class AddedVocabulary {
 public:
  AddedVocabulary() = default;
  explicit AddedVocabulary(std::vector<AddedToken> tokens);
  AddedVocabulary(AddedVocabulary&&) noexcept = default;
  AddedVocabulary& operator=(AddedVocabulary&&) noexcept = default;

  const AddedTokenMatcher& raw_matcher() const { return *raw_; }
  const AddedTokenMatcher& normalized_matcher() const { return *normalized_; }

  /// The added token with `id`, if any.
  const AddedToken* find(TokenId id) const;
  /// The added token spelt `content`, if any.
  const AddedToken* find(std::string_view content) const;

 private:
  std::vector<AddedToken> tokens_;
  absl::flat_hash_map<TokenId, std::size_t> index_of_id_;
  StringMap<std::size_t> index_of_content_;
  std::optional<AddedTokenMatcher> raw_;
  std::optional<AddedTokenMatcher> normalized_;
};

}  // namespace kvr::tokenizer
