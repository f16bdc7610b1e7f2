// Block hashing: turns prompt tokens into the chained block hashes that the KV indexer, the
// simulated engine and every worker agree on. Used by routing clients, replay and the mocker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "messages/ids.hpp"

namespace kvr::discovery {

/// Hash of one block's tokens alone (not chained).
using LocalBlockHash = std::uint64_t;

/// Hashes token blocks with XXH3-64. The rule, which workers must follow to publish matching
/// events: local = XXH3_64(little-endian uint32 tokens of the block, seed), where seed is a fixed
/// base, or XXH3_64(cache namespace bytes, base) when a namespace (e.g. a LoRA name) is given;
/// sequence[0] = XXH3_64({0, local[0]}), sequence[i] = XXH3_64({sequence[i-1], local[i]}), each
/// pair as two little-endian uint64. Only full blocks are hashed.
class BlockHasher {
 public:
  /// `block_size` must be positive; `cache_namespace` separates otherwise equal prompts.
  explicit BlockHasher(std::uint32_t block_size, std::string_view cache_namespace = {});

  std::uint32_t block_size() const { return block_size_; }
  std::uint64_t seed() const { return seed_; }

  /// Hash of one block's tokens.
  LocalBlockHash local_hash(std::span<const std::uint32_t> block_tokens) const;

  /// The sequence hash of a block given its parent's sequence hash (none for a first block).
  static BlockHash chain(std::optional<BlockHash> parent, LocalBlockHash local);

  /// Sequence hashes of every full block of `tokens`.
  std::vector<BlockHash> sequence_hashes(std::span<const std::uint32_t> tokens) const;

  /// Appends the sequence hashes of every full block of `tokens` to `out` (no other allocation).
  void append_sequence_hashes(std::span<const std::uint32_t> tokens,
                              std::vector<BlockHash>& out) const;

 private:
  std::uint32_t block_size_;
  std::uint64_t seed_;
};

/// The `estimate` tokenizer mode's stand-in for a token: this many bytes of UTF-8 prompt text
/// (about right for English under the common BPE vocabularies). A text block of block_size such
/// "tokens" then stands for about one KV block, so overlaps and loads keep their units.
inline constexpr std::uint32_t kTextBytesPerToken = 4;

/// The estimated token count of `text_bytes` bytes of prompt text (at least 1).
constexpr std::size_t estimated_prompt_tokens(std::size_t text_bytes) {
  return text_bytes == 0 ? 1 : (text_bytes + kTextBytesPerToken - 1) / kTextBytesPerToken;
}

/// Hashes a prompt's text in fixed-size byte blocks, chained as BlockHasher chains token blocks,
/// but from a seed of its own: text-block keys live in a router-side index of routing decisions
/// and are never compared with the block hashes of engine KV events.
class TextBlockHasher {
 public:
  /// Blocks of block_size * kTextBytesPerToken bytes; `block_size` must be positive.
  explicit TextBlockHasher(std::uint32_t block_size, std::string_view cache_namespace = {});

  std::size_t block_bytes() const { return block_bytes_; }

  /// Appends the sequence hashes of every full block of `text` to `out`.
  void append_sequence_hashes(std::string_view text, std::vector<BlockHash>& out) const;

 private:
  std::size_t block_bytes_;
  std::uint64_t seed_;
};

/// Number of blocks that cover `tokens` tokens, counting a partial last block.
constexpr std::size_t blocks_for_tokens(std::size_t tokens, std::size_t block_size) {
  return block_size == 0 ? 0 : (tokens + block_size - 1) / block_size;
}

}  // namespace kvr::discovery
