// The fewest spellings a text is cut into (SpellingTrie) on small vocabularies worked out by
// hand, and, for two bundled tokenizer families (KVR_TOKENIZERS_DIR), that the bound it gives the
// encoder never refuses a text whose BPE ids are within the limit: long pieces of letters, CJK,
// digits, spaces and emoji encode at a limit of exactly their ids and are refused one below.
#include "selection/tokenizer/spelling_trie.hpp"

#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "selection/tokenizer/tokenizer.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

SpellingTrie trie(std::vector<std::string> spellings) { return SpellingTrie{spellings}; }

TEST(SpellingTrieTest, CutsIntoTheFewestSpellings) {
  const SpellingTrie spellings = trie({"a", "b", "c", "ab", "bc", "abc"});
  EXPECT_EQ(spellings.fewest_parts("abcab"), 2u);   // abc + ab
  EXPECT_EQ(spellings.fewest_parts("ababab"), 3u);  // ab + ab + ab
  EXPECT_EQ(spellings.fewest_parts("cbcabc"), 3u);  // c + bc + abc
  EXPECT_EQ(spellings.fewest_parts(""), 0u);
}

TEST(SpellingTrieTest, ACharacterWithoutASpellingIsOnePart) {
  // é is two bytes, € three: each is one unknown or byte-fallback token at least.
  const SpellingTrie spellings = trie({"a"});
  EXPECT_EQ(spellings.fewest_parts("a\xC3\xA9\xE2\x82\xAC"
                                   "a"),
            4u);
}

TEST(SpellingTrieTest, ASpellingMayEndInsideACharacter) {
  // Byte-level vocabularies spell parts of characters: the first two bytes of € and its last.
  const SpellingTrie spellings = trie({"\xE2\x82", "\xAC"});
  EXPECT_EQ(spellings.fewest_parts("\xE2\x82\xAC\xE2\x82\xAC"), 2u);  // each € a whole part
}

TEST(SpellingTrieTest, NeedsMoreThanIsExactAtTheLimit) {
  const SpellingTrie spellings = trie({"a", "b", "ab"});
  std::string text;
  for (int i = 0; i < 50000; ++i) text += "ab";
  EXPECT_TRUE(spellings.needs_more_than(text, 49999));
  EXPECT_FALSE(spellings.needs_more_than(text, 50000));
  EXPECT_TRUE(spellings.needs_more_than(text, 10));  // certain long before the end
}

// Long pieces of one kind each, the same every run.
std::vector<std::string> long_pieces() {
  std::mt19937 random{42};
  const auto pick = [&](int low, int high) {
    return std::uniform_int_distribution<int>{low, high}(random);
  };
  std::vector<std::string> texts(5);
  for (int i = 0; i < 6000; ++i) texts[0].push_back(static_cast<char>(pick('a', 'z')));
  for (int i = 0; i < 2000; ++i)
    append_utf8(texts[1], static_cast<std::uint32_t>(pick(0x4E00, 0x9FA5)));
  for (int i = 0; i < 3000; ++i) texts[2].push_back(static_cast<char>(pick('0', '9')));
  texts[3] = "x" + std::string(3000, ' ') + "y";
  for (int i = 0; i < 1500; ++i)
    append_utf8(texts[4], static_cast<std::uint32_t>(pick(0x1F600, 0x1F64F)));
  // The same pieces run together with words between them, as a prompt would.
  std::string mixed;
  for (const std::string& text : texts) mixed += text + " and then ";
  texts.push_back(mixed);
  return texts;
}

class SpellingBoundTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpellingBoundTest, TextsEncodeAtALimitOfExactlyTheirIds) {
  const char* dir = KVR_TOKENIZERS_DIR;
  if (std::string_view{dir}.empty()) GTEST_SKIP() << "KVR_TOKENIZERS_DIR is not set";
  auto tokenizer = Tokenizer::load(std::filesystem::path{dir} / GetParam());
  ASSERT_TRUE(tokenizer.has_value()) << tokenizer.error().message;
  const auto texts = long_pieces();
  for (std::size_t index = 0; index < texts.size(); ++index) {
    const auto all = tokenizer->encode(texts[index], false);
    ASSERT_TRUE(all.has_value()) << index;
    const auto at_limit = tokenizer->encode(texts[index], false, all->size());
    ASSERT_TRUE(at_limit.has_value()) << "text " << index << ": " << at_limit.error().message;
    EXPECT_EQ(*at_limit, *all) << index;
    const auto below = tokenizer->encode(texts[index], false, all->size() - 1);
    ASSERT_FALSE(below.has_value()) << index;
    EXPECT_TRUE(below.error().over_id_limit) << index;
  }
}

// A byte-level vocabulary and a SentencePiece-style one (Metaspace, byte fallback): each load
// takes seconds in a sanitizer build, and the others are byte-level too.
INSTANTIATE_TEST_SUITE_P(BundledFamilies, SpellingBoundTest, ::testing::Values("qwen3", "yi"),
                         [](const auto& family) {
                           std::string name = family.param;
                           std::erase(name, '-');
                           return name;
                         });

}  // namespace
}  // namespace kvr::tokenizer
