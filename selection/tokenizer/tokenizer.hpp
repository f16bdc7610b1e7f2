// kvr's native tokenizer: a HuggingFace tokenizer.json (BPE, byte-level or SentencePiece-style)
// loaded once and shared by the front door, `kvr tokenize` and the parity check. Encoding is
// const and safe from any number of threads.
#pragma once

#include <cstddef>
#include <expected>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// No limit on the ids an encoding makes.
inline constexpr std::size_t kNoIdLimit = std::numeric_limits<std::size_t>::max();

/// Bytes [begin, end) of a text.
struct ByteRange {
  std::size_t begin = 0;
  std::size_t end = 0;
};

/// How a tokenizer caches: the ids of text between added tokens (a chat turn, a system prompt)
/// are kept by content, so a long conversation's next turn costs only its new text.
struct TokenizerOptions {
  /// Bytes of segment text (plus ids) kept; 0 turns the cache off.
  std::size_t segment_cache_bytes = 64u << 20;
  /// Segments shorter than this are encoded every time (cheaper than a lookup).
  std::size_t segment_cache_min_bytes = 128;
};

/// A loaded tokenizer.
class Tokenizer {
 public:
  /// Loads `path`: a tokenizer.json, or a folder holding one and, optionally, the model's
  /// tokenizer_config.json, whose add_bos_token and add_eos_token replace the post-processor as
  /// transformers (and so vLLM and SGLang) does. An unsupported component or a malformed file is
  /// an error naming the file and the component.
  static std::expected<Tokenizer, TokenizerError> load(const std::filesystem::path& path,
                                                       const TokenizerOptions& options = {});

  /// Builds a tokenizer from the text of a tokenizer.json and, when not empty, of its
  /// tokenizer_config.json.
  static std::expected<Tokenizer, TokenizerError> from_json(std::string_view tokenizer_json,
                                                            const TokenizerOptions& options = {},
                                                            std::string_view tokenizer_config = {});

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// The ids of `text`; with `add_special_tokens`, the post-processor's tokens too (an engine's
  /// completions path), without them as a rendered chat is encoded. Added tokens in the text
  /// are matched. Text that is not UTF-8 is an error naming the byte offset. Encoding stops once
  /// the ids are more than `max_ids` (checked after each pre-tokenized piece, so one piece is
  /// always encoded whole): the error then has `over_id_limit` set.
  std::expected<TokenIds, TokenizerError> encode(std::string_view text, bool add_special_tokens,
                                                 std::size_t max_ids = kNoIdLimit) const;

  /// As encode, except that a special added token overlapping one of `literal` (byte ranges of
  /// `text`, in order) is encoded as the text it spells, with the whitespace it would strip:
  /// HuggingFace's split_special_tokens, for those ranges only.
  std::expected<TokenIds, TokenizerError> encode(std::string_view text, bool add_special_tokens,
                                                 std::size_t max_ids,
                                                 std::span<const ByteRange> literal) const;

  /// Where special added tokens are spelled in `text` (in order; no whitespace they would strip).
  std::vector<ByteRange> find_special_tokens(std::string_view text) const;

  /// The text of `ids`; with `skip_special_tokens`, special added tokens are left out. Bytes
  /// that do not form UTF-8 (a character cut between ids) become U+FFFD.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens) const;

  /// Whether `id` is a special added token.
  bool is_special(TokenId id) const;

  /// One more than the largest id.
  std::size_t vocab_size() const;

 private:
  struct Parts;
  explicit Tokenizer(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

/// Turns a stream of ids into text chunk by chunk, holding back bytes until they form whole
/// characters (a character split across ids is never emitted in halves).
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
      : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

  /// The text `id` completes (often empty while a character is incomplete).
  std::string push(TokenId id);

  /// Whatever is held back at the end of the stream, repaired as U+FFFD.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  TokenIds ids_;
  std::size_t prefix_offset_ = 0;
  std::size_t read_offset_ = 0;
};

}  // namespace kvr::tokenizer
