// GPT-2's byte-level alphabet: the 256 printable characters byte-level BPE vocabularies are spelt
// in. kvr converts such vocabularies to raw bytes once, at load, so encoding never maps text to
// the alphabet and decoding is a concatenation.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvr::tokenizer {

/// The character (as UTF-8) that stands for `byte` in the byte-level alphabet.
std::string_view byte_level_char(unsigned char byte);

/// The raw bytes a byte-level spelling stands for, or nothing when a character of it is outside
/// the alphabet (added tokens such as `<｜begin▁of▁sentence｜>` keep their own UTF-8).
std::optional<std::string> bytes_from_byte_level(std::string_view spelling);

/// The pre-tokenizer regex of GPT-2 that ByteLevel applies when `use_regex` is true.
inline constexpr std::string_view kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace kvr::tokenizer
