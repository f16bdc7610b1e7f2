// A hash map keyed by std::string that std::string_view looks up without a copy (Debian's
// abseil has its own string_view, so its default string hash is not transparent to ours).
#pragma once

#include <string>
#include <string_view>

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>
#include <absl/strings/string_view.h>

namespace kvr::tokenizer {

struct StringKeyHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view key) const {
    return absl::Hash<absl::string_view>{}(absl::string_view{key.data(), key.size()});
  }
};

struct StringKeyEqual {
  using is_transparent = void;
  bool operator()(std::string_view left, std::string_view right) const { return left == right; }
};

/// std::string keys, found by std::string_view.
template <typename Value>
using StringMap = absl::flat_hash_map<std::string, Value, StringKeyHash, StringKeyEqual>;

}  // namespace kvr::tokenizer
