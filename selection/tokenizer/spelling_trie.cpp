#include "selection/tokenizer/spelling_trie.hpp"

#include <algorithm>
#include <bit>
#include <deque>
#include <limits>

#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

constexpr std::size_t kUnreached = std::numeric_limits<std::size_t>::max();
// How often (in positions) the cut so far is checked against the limit: rarely enough to cost
// nothing, often enough to stop within a few KiB of where the limit is certain.
constexpr std::size_t kCheckEvery = std::size_t{1} << 12;

}  // namespace

SpellingTrie::SpellingTrie(std::span<const std::string> spellings) {
  std::vector<std::string_view> words;
  words.reserve(spellings.size());
  for (const std::string& spelling : spellings) {
    if (!spelling.empty()) words.emplace_back(spelling);
  }
  // Bytewise order (char_traits compares as unsigned char): each node's words are a range, and
  // its children's ranges follow one another.
  std::ranges::sort(words);
  words.erase(std::ranges::unique(words).begin(), words.end());
  struct Pending {
    std::uint32_t node;
    std::size_t first;
    std::size_t last;
    std::size_t depth;
  };
  nodes_.emplace_back();
  label_.push_back(0);
  // Breadth first: a node's children are appended together, so they are contiguous.
  std::deque<Pending> pending{{.node = 0, .first = 0, .last = words.size(), .depth = 0}};
  while (!pending.empty()) {
    auto [node, first, last, depth] = pending.front();
    pending.pop_front();
    if (first < last && words[first].size() == depth) {
      nodes_[node].terminal = true;
      longest_ = std::max(longest_, depth);
      ++first;
    }
    nodes_[node].first_child = static_cast<std::uint32_t>(nodes_.size());
    while (first < last) {
      const char byte = words[first][depth];
      std::size_t end = first;
      while (end < last && words[end][depth] == byte) ++end;
      nodes_.emplace_back();
      label_.push_back(static_cast<std::uint8_t>(byte));
      pending.push_back({.node = static_cast<std::uint32_t>(nodes_.size() - 1),
                         .first = first,
                         .last = end,
                         .depth = depth + 1});
      ++nodes_[node].children;
      first = end;
    }
  }
}

template <class Reach>
void SpellingTrie::each_spelling_at(std::string_view text, Reach&& reach) const {
  std::uint32_t node = 0;
  for (std::size_t depth = 0; depth < text.size(); ++depth) {
    const Node& parent = nodes_[node];
    const std::uint8_t* first = label_.data() + parent.first_child;
    const std::uint8_t* last = first + parent.children;
    const auto byte = static_cast<std::uint8_t>(text[depth]);
    const std::uint8_t* found = std::lower_bound(first, last, byte);
    if (found == last || *found != byte) return;
    node = parent.first_child + static_cast<std::uint32_t>(found - first);
    if (nodes_[node].terminal) reach(depth + 1);
  }
}

std::size_t SpellingTrie::fewest_parts_up_to(std::string_view text, std::size_t limit) const {
  // parts[p & mask]: the fewest parts of a cut of text[0, p), for p within `longest_` before
  // and after the position being extended (a step is at most `longest_` bytes).
  const std::size_t mask = std::bit_ceil(2 * longest_ + 2) - 1;
  std::vector<std::size_t> parts(mask + 1, kUnreached);
  parts[0] = 0;
  for (std::size_t at = 0; at < text.size(); ++at) {
    // The farthest position a step from here reaches: its slot last held one long behind.
    parts[(at + longest_) & mask] = kUnreached;
    const std::size_t here = parts[at & mask];
    if (here == kUnreached) continue;  // inside a character no spelling ends in
    const auto reach = [&](std::size_t length) {
      std::size_t& there = parts[(at + length) & mask];
      there = std::min(there, here + 1);
    };
    reach(std::min(utf8_length(static_cast<unsigned char>(text[at])), text.size() - at));
    each_spelling_at(text.substr(at, longest_), reach);
    if ((at + 1) % kCheckEvery == 0) {
      // Every cut of the whole text has a part that starts at some p in (at - longest_, at] and
      // ends past `at`: it has at least parts[p] + 1 parts.
      std::size_t fewest = kUnreached;
      for (std::size_t back = 0; back < longest_ && back <= at; ++back) {
        fewest = std::min(fewest, parts[(at - back) & mask]);
      }
      if (fewest != kUnreached && fewest + 1 > limit) return limit + 1;
    }
  }
  return parts[text.size() & mask];
}

bool SpellingTrie::needs_more_than(std::string_view text, std::size_t limit) const {
  return fewest_parts_up_to(text, limit) > limit;
}

std::size_t SpellingTrie::fewest_parts(std::string_view text) const {
  return fewest_parts_up_to(text, kUnreached - 1);
}

}  // namespace kvr::tokenizer
