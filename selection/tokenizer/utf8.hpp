// UTF-8 helpers the tokenizer needs on its hot paths: validation, stepping over characters, and
// the lossy repair HuggingFace's decoders apply to bytes that do not form text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvr::tokenizer {

/// The byte length of the UTF-8 character whose first byte is `lead` (1 for a stray byte).
inline std::size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

/// Decodes the character at `at` of valid UTF-8 text and advances `at` past it.
std::uint32_t next_code_point(std::string_view text, std::size_t& at);

/// Appends `code_point` as UTF-8.
void append_utf8(std::string& out, std::uint32_t code_point);

/// The byte offset of the first invalid UTF-8 sequence in `text`, or `text.size()` when valid.
std::size_t first_invalid_utf8(std::string_view text);

/// `bytes` as text, each maximal invalid subsequence replaced by U+FFFD (Rust's
/// `String::from_utf8_lossy`, which HuggingFace's decoders use).
std::string utf8_lossy(std::string_view bytes);

/// Unicode White_Space, as Rust's `char::is_whitespace`.
bool is_unicode_whitespace(std::uint32_t code_point);

/// A letter, number or underscore: what ends a word for `single_word` added tokens.
bool is_word_character(std::uint32_t code_point);

}  // namespace kvr::tokenizer
