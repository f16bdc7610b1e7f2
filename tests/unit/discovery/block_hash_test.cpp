#include "discovery/block_hash.hpp"

#include <numeric>

#include <gtest/gtest.h>

namespace kvr::discovery {
namespace {

std::vector<std::uint32_t> iota_tokens(std::size_t count, std::uint32_t first = 0) {
  std::vector<std::uint32_t> tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

TEST(BlockHasherTest, HashesOnlyFullBlocks) {
  const BlockHasher hasher{16};
  EXPECT_EQ(hasher.sequence_hashes(iota_tokens(15)).size(), 0U);
  EXPECT_EQ(hasher.sequence_hashes(iota_tokens(16)).size(), 1U);
  EXPECT_EQ(hasher.sequence_hashes(iota_tokens(47)).size(), 2U);
}

TEST(BlockHasherTest, SequenceHashCoversTheWholePrefix) {
  const BlockHasher hasher{4};
  auto a = iota_tokens(8);
  auto b = a;
  b[0] = 99;  // differs only in the first block
  const auto hashes_a = hasher.sequence_hashes(a);
  const auto hashes_b = hasher.sequence_hashes(b);
  ASSERT_EQ(hashes_a.size(), 2U);
  // Second blocks hold equal tokens, yet their sequence hashes differ through the prefix.
  EXPECT_EQ(hasher.local_hash(std::span(a).subspan(4, 4)),
            hasher.local_hash(std::span(b).subspan(4, 4)));
  EXPECT_NE(hashes_a[1], hashes_b[1]);
}

TEST(BlockHasherTest, EqualPrefixesGiveEqualHashes) {
  const BlockHasher hasher{4};
  auto a = iota_tokens(12);
  auto b = iota_tokens(8);
  b.push_back(1000);  // a partial third block does not matter
  const auto hashes_a = hasher.sequence_hashes(a);
  const auto hashes_b = hasher.sequence_hashes(b);
  EXPECT_EQ(hashes_a[0], hashes_b[0]);
  EXPECT_EQ(hashes_a[1], hashes_b[1]);
}

TEST(BlockHasherTest, ChainMatchesSequenceHashes) {
  const BlockHasher hasher{4};
  const auto tokens = iota_tokens(8, 7);
  const auto hashes = hasher.sequence_hashes(tokens);
  const auto first =
      BlockHasher::chain(std::nullopt, hasher.local_hash(std::span(tokens).first(4)));
  EXPECT_EQ(hashes[0], first);
  EXPECT_EQ(hashes[1], BlockHasher::chain(first, hasher.local_hash(std::span(tokens).subspan(4))));
}

TEST(BlockHasherTest, CacheNamespaceSeparatesEqualPrompts) {
  const auto tokens = iota_tokens(8);
  EXPECT_NE(BlockHasher(4).sequence_hashes(tokens),
            BlockHasher(4, "lora-a").sequence_hashes(tokens));
  EXPECT_NE(BlockHasher(4, "lora-a").sequence_hashes(tokens),
            BlockHasher(4, "lora-b").sequence_hashes(tokens));
  EXPECT_EQ(BlockHasher(4, "lora-a").sequence_hashes(tokens),
            BlockHasher(4, "lora-a").sequence_hashes(tokens));
}

TEST(BlockHasherTest, BlocksForTokensRoundsUp) {
  EXPECT_EQ(blocks_for_tokens(0, 16), 0U);
  EXPECT_EQ(blocks_for_tokens(1, 16), 1U);
  EXPECT_EQ(blocks_for_tokens(32, 16), 2U);
  EXPECT_EQ(blocks_for_tokens(33, 16), 3U);
}

}  // namespace
}  // namespace kvr::discovery
