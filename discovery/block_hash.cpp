#include "discovery/block_hash.hpp"

#include <array>
#include <bit>

#include <xxhash.h>

namespace kvr::discovery {
namespace {

constexpr std::uint64_t kBaseSeed = 0x6B76722D626C6B31ULL;  // "kvr-blk1"

}  // namespace

BlockHasher::BlockHasher(std::uint32_t block_size, std::string_view cache_namespace)
    : block_size_(block_size),
      seed_(cache_namespace.empty()
                ? kBaseSeed
                : XXH3_64bits_withSeed(cache_namespace.data(), cache_namespace.size(), kBaseSeed)) {
}

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

}  // namespace kvr::discovery
