#include "discovery/block_hash.hpp"

#include <array>
#include <bit>

#include <xxhash.h>

namespace kvr::discovery {
namespace {

constexpr std::uint64_t kBaseSeed = 0x6B76722D626C6B31ULL;      // "kvr-blk1"
constexpr std::uint64_t kTextBaseSeed = 0x6B76722D74787431ULL;  // "kvr-txt1"

std::uint64_t namespace_seed(std::string_view cache_namespace, std::uint64_t base) {
  return cache_namespace.empty()
             ? base
             : XXH3_64bits_withSeed(cache_namespace.data(), cache_namespace.size(), base);
}

}  // namespace

BlockHasher::BlockHasher(std::uint32_t block_size, std::string_view cache_namespace)
    : block_size_(block_size), seed_(namespace_seed(cache_namespace, kBaseSeed)) {}

LocalBlockHash BlockHasher::local_hash(std::span<const std::uint32_t> block_tokens) const {
  static_assert(std::endian::native == std::endian::little,
                "the hashing rule is defined over little-endian token bytes");
  return XXH3_64bits_withSeed(block_tokens.data(), block_tokens.size_bytes(), seed_);
}

BlockHash BlockHasher::chain(std::optional<BlockHash> parent, LocalBlockHash local) {
  const std::array<std::uint64_t, 2> pair{parent.value_or(0), local};
  return XXH3_64bits(pair.data(), sizeof(pair));
}

std::vector<BlockHash> BlockHasher::sequence_hashes(std::span<const std::uint32_t> tokens) const {
  std::vector<BlockHash> hashes;
  hashes.reserve(tokens.size() / block_size_);
  append_sequence_hashes(tokens, hashes);
  return hashes;
}

void BlockHasher::append_sequence_hashes(std::span<const std::uint32_t> tokens,
                                         std::vector<BlockHash>& out) const {
  std::optional<BlockHash> parent;
  for (std::size_t start = 0; start + block_size_ <= tokens.size(); start += block_size_) {
    const BlockHash hash = chain(parent, local_hash(tokens.subspan(start, block_size_)));
    out.push_back(hash);
    parent = hash;
  }
}

TextBlockHasher::TextBlockHasher(std::uint32_t block_size, std::string_view cache_namespace)
    : block_bytes_(std::size_t{block_size} * kTextBytesPerToken),
      seed_(namespace_seed(cache_namespace, kTextBaseSeed)) {}

void TextBlockHasher::append_sequence_hashes(std::string_view text,
                                             std::vector<BlockHash>& out) const {
  std::optional<BlockHash> parent;
  for (std::size_t start = 0; start + block_bytes_ <= text.size(); start += block_bytes_) {
    const BlockHash hash =
        BlockHasher::chain(parent, XXH3_64bits_withSeed(text.data() + start, block_bytes_, seed_));
    out.push_back(hash);
    parent = hash;
  }
}

}  // namespace kvr::discovery
