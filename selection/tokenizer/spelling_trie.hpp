// The fewest vocabulary entries a text can be cut into: a lower bound on the ids a BPE encoding
// of it has, found in one pass without merging. Tokenizer uses it to refuse a huge pre-tokenized
// piece (megabytes of letters without a space) that would pass an id limit, without the BPE run
// whose time grows faster than the piece.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::tokenizer {

/// A vocabulary's spellings as a trie, for cutting a text into the fewest of them.
class SpellingTrie {
 public:
  /// Indexes `spellings`: the text each vocabulary entry covers (raw bytes for a byte-level
  /// vocabulary); empty ones are left out.
  explicit SpellingTrie(std::span<const std::string> spellings);

  /// Whether every cut of `text` into spellings and single UTF-8 characters (which stand for
  /// byte-fallback and unknown tokens) has more than `limit` parts. Stops as soon as that is
  /// certain, or as soon as a cut of `limit` parts or fewer is found for the whole text.
  bool needs_more_than(std::string_view text, std::size_t limit) const;

  /// The fewest parts of such a cut of `text`; for tests.
  std::size_t fewest_parts(std::string_view text) const;

 private:
  // Children of a node are the nodes [first_child, first_child + children), by ascending byte.
  struct Node {
    std::uint32_t first_child = 0;
    std::uint16_t children = 0;
    bool terminal = false;
  };
  // Calls `reach(length)` for each spelling that begins `text`.
  template <class Reach>
  void each_spelling_at(std::string_view text, Reach&& reach) const;
  // The fewest parts, stopped at the first position that proves more than `limit` (returning
  // limit + 1 then).
  std::size_t fewest_parts_up_to(std::string_view text, std::size_t limit) const;

  std::vector<Node> nodes_;
  std::vector<std::uint8_t> label_;  // the byte leading into each node
  std::size_t longest_ = 4;          // the longest step: a spelling, or a 4-byte character
};

}  // namespace kvr::tokenizer
