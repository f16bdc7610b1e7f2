// kvr's native tokenizer on arbitrary bytes, with the bundled tokenizers (KVR_TOKENIZERS_DIR) of
// four kinds: qwen3 (byte-level BPE after NFC), yi (SentencePiece-style BPE with byte fallback),
// mistral-nemo (byte-level, a template post-processor, a thousand special tokens) and deepseek-v3
// (byte-level, normalized added tokens). A prompt's text comes from the client; ids to decode come
// from an engine's stream.
// The input: its first byte picks the tokenizer (its value modulo 4) and the flags (4:
// add_special_tokens, 8: skip_special_tokens); the rest is the text to encode, and, read as
// little-endian 3-byte numbers, the ids to decode.
// Properties: text that is not UTF-8 is refused, and only such text; ids are in the vocabulary;
// the post-processor only adds ids around the text's; decoding the text's ids gives the text back
// (NFC-normalised for qwen3, with U+2581 read as a space for yi, whose normalizer writes spaces
// so); a second encode (the segment cache) gives the same ids; decoded text is UTF-8, and the
// incremental decoder's chunks add up to the whole decode when that has no U+FFFD.
#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "selection/tokenizer/normalizer.hpp"
#include "selection/tokenizer/tokenizer.hpp"
#include "selection/tokenizer/utf8.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {
namespace {

using tokenizer::TokenId;
using tokenizer::TokenIds;

// What decode(encode(text)) gives back for each tokenizer.
enum class RoundTrip : std::uint8_t { exact, nfc, metaspace_as_space };

struct Family {
  std::string_view name;
  RoundTrip round_trip;
};

constexpr std::array<Family, 4> kFamilies = {{{"qwen3", RoundTrip::nfc},
                                              {"yi", RoundTrip::metaspace_as_space},
                                              {"mistral-nemo", RoundTrip::exact},
                                              {"deepseek-v3", RoundTrip::exact}}};

const tokenizer::Tokenizer& tokenizer_of(std::size_t family) {
  // Loaded when first asked for, and never destroyed: they are large, and exit need not free them.
  static std::array<std::unique_ptr<tokenizer::Tokenizer>, kFamilies.size()> loaded;
  if (!loaded[family]) {
    // A small segment cache: it is exercised, and the process stays small.
    auto made = tokenizer::Tokenizer::load(
        std::string{KVR_FUZZ_TOKENIZERS_DIR} + "/" + std::string{kFamilies[family].name},
        {.segment_cache_bytes = std::size_t{1} << 20});
    KVR_FUZZ_CHECK(made.has_value());
    loaded[family] = std::make_unique<tokenizer::Tokenizer>(std::move(*made));
  }
  return *loaded[family];
}

std::string nfc(std::string text) {
  static const auto normalizer = [] {
    auto made = tokenizer::make_normalizer(nlohmann::json{{"type", "NFC"}});
    KVR_FUZZ_CHECK(made.has_value() && *made != nullptr);
    return std::move(*made);
  }();
  normalizer->normalize(text);
  return text;
}

std::string metaspace_as_space(std::string_view text) {
  constexpr std::string_view kMetaspace = "\u2581";
  std::string out;
  for (std::size_t at = 0; at < text.size();) {
    if (text.substr(at).starts_with(kMetaspace)) {
      out.push_back(' ');
      at += kMetaspace.size();
    } else {
      out.push_back(text[at++]);
    }
  }
  return out;
}

bool is_utf8(std::string_view text) { return tokenizer::first_invalid_utf8(text) == text.size(); }

void check_encode(const tokenizer::Tokenizer& tokenizer, RoundTrip round_trip,
                  std::string_view text, bool add_special_tokens) {
  const auto ids = tokenizer.encode(text, add_special_tokens);
  KVR_FUZZ_CHECK(ids.has_value() == is_utf8(text));
  if (!ids) {
    KVR_FUZZ_CHECK(!ids.error().message.empty());
    return;
  }
  for (const TokenId id : *ids) KVR_FUZZ_CHECK(id < tokenizer.vocab_size());
  const auto plain = tokenizer.encode(text, false);
  KVR_FUZZ_CHECK(plain.has_value());
  KVR_FUZZ_CHECK(!std::ranges::search(*ids, *plain).empty() || plain->empty());
  KVR_FUZZ_CHECK(*tokenizer.encode(text, false) == *plain);
  const std::string decoded = tokenizer.decode(*plain, false);
  switch (round_trip) {
    case RoundTrip::exact:
      KVR_FUZZ_CHECK(decoded == text);
      break;
    case RoundTrip::nfc:
      KVR_FUZZ_CHECK(decoded == nfc(std::string{text}));
      break;
    case RoundTrip::metaspace_as_space:
      KVR_FUZZ_CHECK(decoded == metaspace_as_space(text));
      break;
  }
}

void check_decode(const tokenizer::Tokenizer& tokenizer, const TokenIds& ids,
                  bool skip_special_tokens) {
  const std::string text = tokenizer.decode(ids, skip_special_tokens);
  KVR_FUZZ_CHECK(is_utf8(text));
  tokenizer::IncrementalDecoder incremental{tokenizer, skip_special_tokens};
  std::string streamed;
  for (const TokenId id : ids) streamed += incremental.push(id);
  streamed += incremental.finish();
  KVR_FUZZ_CHECK(is_utf8(streamed));
  if (text.find("\uFFFD") == std::string::npos) KVR_FUZZ_CHECK(streamed == text);
}

}  // namespace

void tokenizer_bytes(Input input) {
  if (input.empty()) return;
  const std::size_t family = input[0] % kFamilies.size();
  const bool add_special_tokens = (input[0] & 4) != 0;
  const bool skip_special_tokens = (input[0] & 8) != 0;
  const tokenizer::Tokenizer& tokenizer = tokenizer_of(family);
  const Input rest = input.subspan(1);
  check_encode(tokenizer, kFamilies[family].round_trip, as_text(rest), add_special_tokens);
  TokenIds ids;
  // A few ids past the vocabulary too: an engine may send them.
  const std::size_t id_bound = tokenizer.vocab_size() + 16;
  for (std::size_t at = 0; at + 3 <= rest.size(); at += 3) {
    const std::uint32_t value = rest[at] | (rest[at + 1] << 8) | (rest[at + 2] << 16);
    ids.push_back(static_cast<TokenId>(value % id_bound));
  }
  check_decode(tokenizer, ids, skip_special_tokens);
}

}  // namespace kvr::fuzz
