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

namespace kvr::discovery {
namespace {

std::vector<BlockHash> text_hashes(std::string_view text, std::string_view cache_namespace = {}) {
  std::vector<BlockHash> hashes;
  TextBlockHasher(4, cache_namespace).append_sequence_hashes(text, hashes);
  return hashes;
}

TEST(TextBlockHasherTest, HashesFullBlocksOfBlockSizeTimesBytesPerToken) {
  EXPECT_EQ(TextBlockHasher(4).block_bytes(), 4U * kTextBytesPerToken);
  EXPECT_TRUE(text_hashes(std::string(15, 'a')).empty());
  EXPECT_EQ(text_hashes(std::string(16, 'a')).size(), 1U);
  EXPECT_EQ(text_hashes(std::string(47, 'a')).size(), 2U);
}

TEST(TextBlockHasherTest, SharedTextPrefixGivesSharedHashesThenDiverges) {
  const std::string shared(32, 's');
  const auto first = text_hashes(shared + std::string(16, 'x'));
  const auto second = text_hashes(shared + std::string(16, 'y'));
  ASSERT_EQ(first.size(), 3U);
  ASSERT_EQ(second.size(), 3U);
  EXPECT_EQ(first[0], second[0]);
  EXPECT_EQ(first[1], second[1]);
  EXPECT_NE(first[2], second[2]);
  // Chained: a change early on changes every later block.
  const auto changed = text_hashes("t" + std::string(31, 's') + std::string(16, 'x'));
  EXPECT_NE(changed[1], first[1]);
  EXPECT_NE(changed[2], first[2]);
}

TEST(TextBlockHasherTest, TextKeysDifferFromTokenKeysOfTheSameBytes) {
  // Four tokens whose little-endian bytes equal a 16-byte text block.
  const std::vector<std::uint32_t> tokens{0x61616161, 0x61616161, 0x61616161, 0x61616161};
  EXPECT_NE(text_hashes(std::string(16, 'a')), BlockHasher(4).sequence_hashes(tokens));
}

TEST(TextBlockHasherTest, CacheNamespaceSeparatesEqualText) {
  const std::string text(32, 'n');
  EXPECT_NE(text_hashes(text), text_hashes(text, "adapter-a"));
  EXPECT_NE(text_hashes(text, "adapter-a"), text_hashes(text, "adapter-b"));
}

TEST(TextBlockHasherTest, EstimatedTokensRoundUpAndAreNeverZero) {
  EXPECT_EQ(estimated_prompt_tokens(0), 1U);
  EXPECT_EQ(estimated_prompt_tokens(1), 1U);
  EXPECT_EQ(estimated_prompt_tokens(kTextBytesPerToken), 1U);
  EXPECT_EQ(estimated_prompt_tokens(kTextBytesPerToken + 1), 2U);
}

}  // namespace
}  // namespace kvr::discovery
