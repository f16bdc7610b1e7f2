// The native tokenizer's components on small tokenizer.json files written here, each with ids
// worked out by hand: BPE merge order, byte fallback, unknown tokens, added tokens and their
// flags, pre-tokenizer behaviours, post-processors, decoders, and load errors.
#include "selection/tokenizer/tokenizer.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "selection/tokenizer/regex.hpp"

namespace kvr::tokenizer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A byte-level BPE over the alphabet "abc" plus space (spelt Ġ) with merges a+b, ab+c, Ġ+a.
nlohmann::json byte_level_file() {
  return nlohmann::json::parse(R"({
    "normalizer": null,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": " ?[a-z]+| +"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
    "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "added_tokens": [
      {"id": 20, "content": "<|start|>", "single_word": false, "lstrip": false, "rstrip": false,
       "normalized": false, "special": true}],
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,
      "byte_fallback": false, "ignore_merges": false,
      "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "ab": 4, "abc": 5, "Ġa": 6, "Ã": 7, "©": 8, "Ã©": 9},
      "merges": ["a b", "ab c", "Ġ a", "Ã ©"]}
  })");
}

Tokenizer load(const nlohmann::json& file, TokenizerOptions options = {}) {
  auto tokenizer = Tokenizer::from_json(file.dump(), options);
  EXPECT_TRUE(tokenizer.has_value()) << (tokenizer ? "" : tokenizer.error().message);
  return std::move(*tokenizer);
}

TokenIds encode(const Tokenizer& tokenizer, std::string_view text, bool add_special = false) {
  auto ids = tokenizer.encode(text, add_special);
  EXPECT_TRUE(ids.has_value()) << (ids ? "" : ids.error().message);
  return ids ? *ids : TokenIds{};
}

TEST(TokenizerTest, MergesInRankOrder) {
  const Tokenizer tokenizer = load(byte_level_file());
  EXPECT_THAT(encode(tokenizer, "abc"), ElementsAre(5));
  EXPECT_THAT(encode(tokenizer, "cab"), ElementsAre(2, 4));
  // In " ab", a+b outranks Ġ+a; in " ac" only Ġ+a merges.
  EXPECT_THAT(encode(tokenizer, "c ab"), ElementsAre(2, 3, 4));
  EXPECT_THAT(encode(tokenizer, "c ac"), ElementsAre(2, 6, 2));
}

TEST(TokenizerTest, ByteLevelVocabularyEncodesRawUtf8Bytes) {
  const Tokenizer tokenizer = load(byte_level_file());
  // "é" is C3 A9, spelt Ã© in the byte alphabet.
  EXPECT_THAT(encode(tokenizer, "\xC3\xA9"), ElementsAre(9));
  EXPECT_EQ(tokenizer.decode(TokenIds{9}, false), "\xC3\xA9");
}

TEST(TokenizerTest, LongPiecesMergeLikeShortOnes) {
  const Tokenizer tokenizer = load(byte_level_file());
  // 40 repetitions exceed the linear-scan limit and take the heap path.
  std::string text;
  TokenIds expected;
  for (int i = 0; i < 40; ++i) {
    text += "abc";
    expected.push_back(5);
  }
  EXPECT_EQ(encode(tokenizer, text), expected);
}

TEST(TokenizerTest, AddedTokensAreMatchedBeforeTheModel) {
  const Tokenizer tokenizer = load(byte_level_file());
  EXPECT_THAT(encode(tokenizer, "ab<|start|>c"), ElementsAre(4, 20, 2));
  EXPECT_TRUE(tokenizer.is_special(20));
  EXPECT_EQ(tokenizer.decode(TokenIds{4, 20, 2}, false), "ab<|start|>c");
  EXPECT_EQ(tokenizer.decode(TokenIds{4, 20, 2}, true), "abc");
}

TEST(TokenizerTest, AddedTokenFlagsStripAndRequireWholeWords) {
  auto file = byte_level_file();
  file["added_tokens"].push_back({{"id", 21},
                                  {"content", "<m>"},
                                  {"single_word", false},
                                  {"lstrip", true},
                                  {"rstrip", true},
                                  {"normalized", false},
                                  {"special", false}});
  file["added_tokens"].push_back({{"id", 22},
                                  {"content", "cab"},
                                  {"single_word", true},
                                  {"lstrip", false},
                                  {"rstrip", false},
                                  {"normalized", false},
                                  {"special", false}});
  const Tokenizer tokenizer = load(file);
  // lstrip and rstrip swallow the spaces around <m>.
  EXPECT_THAT(encode(tokenizer, "a  <m>  b"), ElementsAre(0, 21, 1));
  // "cab" alone is the added token; inside "acab" it is not a word and the model encodes it.
  EXPECT_THAT(encode(tokenizer, "cab"), ElementsAre(22));
  EXPECT_THAT(encode(tokenizer, "acab"), ElementsAre(0, 2, 4));
  EXPECT_FALSE(tokenizer.is_special(21));
}

TEST(TokenizerTest, TemplateProcessingAddsBosOnlyWhenAsked) {
  auto file = byte_level_file();
  file["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [], "special_tokens": {"<|start|>": {"id": "<|start|>", "ids": [20], "tokens": ["<|start|>"]}}})");
  const Tokenizer tokenizer = load(file);
  EXPECT_THAT(encode(tokenizer, "abc", true), ElementsAre(20, 5));
  EXPECT_THAT(encode(tokenizer, "abc", false), ElementsAre(5));
}

// A SentencePiece-style BPE: Metaspace, byte fallback, an unknown token.
nlohmann::json sentencepiece_file() {
  return nlohmann::json::parse(R"({
    "normalizer": null,
    "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
    "post_processor": null,
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
      "rstrip": false, "normalized": false, "special": true},
      {"id": 1, "content": "<s>", "single_word": false, "lstrip": false,
      "rstrip": false, "normalized": false, "special": true}],
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true,
      "byte_fallback": true,
      "vocab": {"<unk>": 0, "<s>": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "▁": 5, "h": 6,
                "i": 7, "▁h": 8, "▁hi": 9},
      "merges": ["▁ h", "▁h i"]}
  })");
}

TEST(TokenizerTest, MetaspacePrependsOnlyAtTheStartOfTheInput) {
  const Tokenizer tokenizer = load(sentencepiece_file());
  EXPECT_THAT(encode(tokenizer, "hi hi"), ElementsAre(9, 9));
  // After <s> the text no longer starts the input: no ▁ is prepended.
  EXPECT_THAT(encode(tokenizer, "<s>hi"), ElementsAre(1, 6, 7));
}

TEST(TokenizerTest, ByteFallbackSpellsUnknownCharactersInBytes) {
  const Tokenizer tokenizer = load(sentencepiece_file());
  // € is E2 82 AC; every byte has a <0xNN> token.
  EXPECT_THAT(encode(tokenizer, "hi€"), ElementsAre(9, 2, 3, 4));
  EXPECT_EQ(tokenizer.decode(TokenIds{9, 2, 3, 4}, false), "hi€");
  // A byte run that is not UTF-8 decodes to one replacement character per byte.
  EXPECT_EQ(tokenizer.decode(TokenIds{9, 2, 3}, false), "hi\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(TokenizerTest, UnknownCharactersFuseIntoOneUnknownToken) {
  auto file = sentencepiece_file();
  file["model"]["byte_fallback"] = false;
  const Tokenizer tokenizer = load(file);
  EXPECT_THAT(encode(tokenizer, "hi€€"), ElementsAre(9, 0));
}

TEST(TokenizerTest, SplitBehavioursCutAsHuggingFaceDoes) {
  const auto ids_with_behavior = [](const std::string& behavior, bool invert) {
    auto file = byte_level_file();
    file["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Split"},
                                                 {"pattern", {{"String", "c"}}},
                                                 {"behavior", behavior},
                                                 {"invert", invert}};
    return encode(load(file), "abcab");
  };
  EXPECT_THAT(ids_with_behavior("Isolated", false), ElementsAre(4, 2, 4));
  EXPECT_THAT(ids_with_behavior("Removed", false), ElementsAre(4, 4));
  EXPECT_THAT(ids_with_behavior("MergedWithPrevious", false), ElementsAre(5, 4));
  EXPECT_THAT(ids_with_behavior("MergedWithNext", false), ElementsAre(4, 2, 4));
  // Inverted, the pieces between the c's are the delimiters: "Removed" keeps only "c".
  EXPECT_THAT(ids_with_behavior("Removed", true), ElementsAre(2));
}

TEST(TokenizerTest, NfcNormalizerComposesBeforeTheModel) {
  auto file = byte_level_file();
  file["normalizer"] = {{"type", "NFC"}};
  const Tokenizer tokenizer = load(file);
  // e + U+0301 composes to é (C3 A9); the decomposed form would be other bytes.
  EXPECT_THAT(encode(tokenizer, "\x65\xCC\x81"), ElementsAre(9));
}

TEST(TokenizerTest, InvalidUtf8IsAnErrorNamingTheOffset) {
  const Tokenizer tokenizer = load(byte_level_file());
  const auto ids = tokenizer.encode("ab\xC3", false);
  ASSERT_FALSE(ids.has_value());
  EXPECT_THAT(ids.error().message, HasSubstr("byte offset 2"));
}

TEST(TokenizerTest, UnsupportedComponentsAreNamedAtLoad) {
  auto file = byte_level_file();
  file["normalizer"] = {{"type", "BertNormalizer"}};
  auto tokenizer = Tokenizer::from_json(file.dump());
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_THAT(tokenizer.error().message, HasSubstr("BertNormalizer"));

  file = byte_level_file();
  file["model"]["type"] = "WordPiece";
  tokenizer = Tokenizer::from_json(file.dump());
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_THAT(tokenizer.error().message, HasSubstr("WordPiece"));

  file = byte_level_file();
  file["model"]["merges"].push_back("a z");
  tokenizer = Tokenizer::from_json(file.dump());
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_THAT(tokenizer.error().message, HasSubstr("outside the vocabulary"));
}

TEST(TokenizerTest, MissingFileIsAnErrorNamingIt) {
  const auto tokenizer = Tokenizer::load("/nonexistent/kvr/tokenizer.json");
  ASSERT_FALSE(tokenizer.has_value());
  EXPECT_THAT(tokenizer.error().message, HasSubstr("/nonexistent/kvr/tokenizer.json"));
}

TEST(TokenizerTest, SegmentCacheGivesTheSameIds) {
  TokenizerOptions cached;
  cached.segment_cache_min_bytes = 1;
  TokenizerOptions uncached;
  uncached.segment_cache_bytes = 0;
  const Tokenizer with_cache = load(byte_level_file(), cached);
  const Tokenizer without_cache = load(byte_level_file(), uncached);
  const std::string text = "<|start|>abc cab<|start|> ab abc<|start|>abc cab";
  const TokenIds expected = encode(without_cache, text);
  EXPECT_EQ(encode(with_cache, text), expected);
  EXPECT_EQ(encode(with_cache, text), expected);  // now from the cache
}

// "abc abc abc" is five ids: abc, Ġ, abc, Ġ, abc.
TEST(TokenizerTest, TextOfExactlyTheIdLimitIsEncoded) {
  const Tokenizer tokenizer = load(byte_level_file());
  const auto ids = tokenizer.encode("abc abc abc", false, 5);
  ASSERT_TRUE(ids.has_value()) << ids.error().message;
  EXPECT_THAT(*ids, ElementsAre(5, 3, 5, 3, 5));
}

TEST(TokenizerTest, TextOneIdOverTheLimitIsAnOverLimitError) {
  const Tokenizer tokenizer = load(byte_level_file());
  const auto ids = tokenizer.encode("abc abc abc", false, 4);
  ASSERT_FALSE(ids.has_value());
  EXPECT_TRUE(ids.error().over_id_limit);
  EXPECT_THAT(ids.error().message, HasSubstr("more than 4 tokens"));
}

TEST(TokenizerTest, AddedTokensCountTowardsTheIdLimit) {
  const Tokenizer tokenizer = load(byte_level_file());
  EXPECT_TRUE(tokenizer.encode("<|start|><|start|>", false, 2).has_value());
  const auto ids = tokenizer.encode("<|start|><|start|><|start|>", false, 2);
  ASSERT_FALSE(ids.has_value());
  EXPECT_TRUE(ids.error().over_id_limit);
}

TEST(TokenizerTest, PostProcessorTokensCountTowardsTheIdLimit) {
  auto file = byte_level_file();
  file["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [], "special_tokens": {"<|start|>": {"id": "<|start|>", "ids": [20], "tokens": ["<|start|>"]}}})");
  const Tokenizer tokenizer = load(file);
  EXPECT_TRUE(tokenizer.encode("abc", false, 1).has_value());
  const auto ids = tokenizer.encode("abc", true, 1);
  ASSERT_FALSE(ids.has_value());
  EXPECT_TRUE(ids.error().over_id_limit);
}

TEST(TokenizerTest, ErrorsOtherThanTheLimitAreNotOverLimit) {
  const Tokenizer tokenizer = load(byte_level_file());
  const auto ids = tokenizer.encode("ab\xC3", false, 1);
  ASSERT_FALSE(ids.has_value());
  EXPECT_FALSE(ids.error().over_id_limit);
}

TEST(TokenizerTest, SegmentCutAtTheIdLimitIsNotCached) {
  TokenizerOptions options;
  options.segment_cache_min_bytes = 1;
  const Tokenizer tokenizer = load(byte_level_file(), options);
  // The segment after the added token is cacheable; cut at the limit, it has only some ids.
  ASSERT_FALSE(tokenizer.encode("<|start|>abc abc abc", false, 3).has_value());
  EXPECT_THAT(encode(tokenizer, "<|start|>abc abc abc"), ElementsAre(20, 5, 3, 5, 3, 5));
}

TEST(RegexTest, CharactersNewerThanPcre2sTablesKeepTheirCategory) {
  // 🫨 (U+1FAE8, Unicode 15) is a symbol, and CJK Extension H's 𱍐 (U+31350) a letter, whatever
  // Unicode version the installed PCRE2 was built with.
  const auto symbols = Regex::compile(R"(\p{S}+)");
  ASSERT_TRUE(symbols.has_value()) << symbols.error().message;
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  symbols->for_each_match(
      "a\xF0\x9F\xAB\xA8"
      "b",
      [&](std::size_t begin, std::size_t end) { matches.emplace_back(begin, end); });
  EXPECT_THAT(matches, ElementsAre(std::pair<std::size_t, std::size_t>{1, 5}));
  const auto letters = Regex::compile(R"(\p{L}+)");
  ASSERT_TRUE(letters.has_value());
  matches.clear();
  letters->for_each_match("1\xF0\xB1\x8D\x90x2", [&](std::size_t begin, std::size_t end) {
    matches.emplace_back(begin, end);
  });
  EXPECT_THAT(matches, ElementsAre(std::pair<std::size_t, std::size_t>{1, 6}));
}

TEST(IncrementalDecoderTest, HoldsBackIncompleteCharacters) {
  const Tokenizer tokenizer = load(byte_level_file());
  IncrementalDecoder decoder{tokenizer, false};
  EXPECT_EQ(decoder.push(5), "abc");
  EXPECT_EQ(decoder.push(7), "");  // Ã: the first byte of é alone
  EXPECT_EQ(decoder.push(8), "\xC3\xA9");
  EXPECT_EQ(decoder.push(6), " a");
  EXPECT_EQ(decoder.push(7), "");
  EXPECT_EQ(decoder.finish(), "\xEF\xBF\xBD");
}

// Found by the tokenizer_bytes fuzz harness: "A" is emitted, then <0xE2> makes the byte run
// 41 E2, which is not UTF-8 and decodes to one U+FFFD per byte. The new text is both
// replacement characters, not the bytes of the second window past the first one's length.
TEST(IncrementalDecoderTest, NeverSplitsACharacterWhenALaterIdChangesEarlierText) {
  auto file = sentencepiece_file();
  file["model"]["vocab"]["<0x41>"] = 10;
  const Tokenizer tokenizer = load(file);
  IncrementalDecoder decoder{tokenizer, false};
  EXPECT_EQ(decoder.push(10), "A");
  EXPECT_EQ(decoder.push(2), "");
  EXPECT_EQ(decoder.finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

}  // namespace
}  // namespace kvr::tokenizer
