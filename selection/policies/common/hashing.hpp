// Stable 64-bit hashing for the built-in policies: seeds derived from partition names and the
// points of bounded-load-hash's ring. Same result on every platform and build, unlike std::hash.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvr::selection::policies {

/// The splitmix64 finaliser: a bijective mix of all 64 bits.
constexpr std::uint64_t mix64(std::uint64_t value) {
  value += 0x9E3779B97F4A7C15ULL;
  value = (value ^ (value >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  value = (value ^ (value >> 27U)) * 0x94D049BB133111EBULL;
  return value ^ (value >> 31U);
}

/// Folds `value` into `state`; order-sensitive.
constexpr std::uint64_t hash_combine(std::uint64_t state, std::uint64_t value) {
  return mix64(state ^ mix64(value));
}

/// FNV-1a over the bytes of `text`, then mixed.
constexpr std::uint64_t hash_text(std::string_view text) {
  std::uint64_t hash = 0xCBF29CE484222325ULL;
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001B3ULL;
  }
  return mix64(hash);
}

}  // namespace kvr::selection::policies
