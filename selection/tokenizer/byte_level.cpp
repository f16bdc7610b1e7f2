#include "selection/tokenizer/byte_level.hpp"

#include <array>
#include <cstdint>

#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

// Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 and up,
// in byte order, so that no byte maps to whitespace or a control character.
struct ByteLevelAlphabet {
  std::array<std::string, 256> char_of_byte;
  std::array<std::int16_t, 0x200> byte_of_code_point;

  ByteLevelAlphabet() {
    byte_of_code_point.fill(-1);
    std::uint32_t next_shifted = 0x100;
    for (std::uint32_t byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) ||
                             (byte >= 0xAE && byte <= 0xFF);
      const std::uint32_t code_point = printable ? byte : next_shifted++;
      append_utf8(char_of_byte[byte], code_point);
      byte_of_code_point[code_point] = static_cast<std::int16_t>(byte);
    }
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet instance;
  return instance;
}

}  // namespace

std::string_view byte_level_char(unsigned char byte) { return alphabet().char_of_byte[byte]; }

std::optional<std::string> bytes_from_byte_level(std::string_view spelling) {
  const auto& table = alphabet().byte_of_code_point;
  std::string bytes;
  bytes.reserve(spelling.size());
  for (std::size_t at = 0; at < spelling.size();) {
    const auto lead = static_cast<unsigned char>(spelling[at]);
    std::uint32_t code_point = 0;
    if (lead < 0x80) {
      code_point = lead;
      at += 1;
    } else if ((lead & 0xE0) == 0xC0 && at + 1 < spelling.size()) {
      code_point = ((lead & 0x1Fu) << 6) | (static_cast<unsigned char>(spelling[at + 1]) & 0x3Fu);
      at += 2;
    } else {
      return std::nullopt;  // every character of the alphabet is below U+0800
    }
    if (code_point >= table.size() || table[code_point] < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(table[code_point]));
  }
  return bytes;
}

}  // namespace kvr::tokenizer
