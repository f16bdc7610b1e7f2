#include "selection/tokenizer/added_vocabulary.hpp"

#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

// The code point that ends just before `end`.
std::uint32_t code_point_before(std::string_view text, std::size_t end, std::size_t& begin) {
  begin = end - 1;
  while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  std::size_t at = begin;
  return next_code_point(text, at);
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(const std::vector<const AddedToken*>& tokens) {
  nodes_.emplace_back();
  for (const AddedToken* token : tokens) {
    if (token->content.empty()) continue;
    std::int32_t node = 0;
    for (const char c : token->content) {
      const auto byte = static_cast<unsigned char>(c);
      const auto found = nodes_[node].children.find(byte);
      if (found != nodes_[node].children.end()) {
        node = found->second;
      } else {
        const auto created = static_cast<std::int32_t>(nodes_.size());
        nodes_[node].children.emplace(byte, created);
        nodes_.emplace_back();
        node = created;
      }
    }
    if (nodes_[node].token == -1) {
      nodes_[node].token = static_cast<std::int32_t>(tokens_.size());
      tokens_.push_back(token);
    }
    first_bytes_.set(static_cast<unsigned char>(token->content.front()));
  }
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& segments) const {
  std::size_t segment_begin = 0;  // start of the text not yet emitted
  std::size_t at = 0;
  while (at < text.size()) {
    if (!first_bytes_.test(static_cast<unsigned char>(text[at]))) {
      ++at;
      continue;
    }
    // The longest token starting at `at`.
    std::int32_t node = 0;
    std::int32_t matched = -1;
    std::size_t matched_end = 0;
    for (std::size_t probe = at; probe < text.size(); ++probe) {
      const auto found = nodes_[node].children.find(static_cast<unsigned char>(text[probe]));
      if (found == nodes_[node].children.end()) break;
      node = found->second;
      if (nodes_[node].token != -1) {
        matched = nodes_[node].token;
        matched_end = probe + 1;
      }
    }
    if (matched == -1) {
      ++at;
      continue;
    }
    const AddedToken& token = *tokens_[matched];
    std::size_t match_begin = at;
    std::size_t match_end = matched_end;
    if (token.single_word) {
      std::size_t before_begin = 0;
      const bool word_before =
          match_begin > 0 && is_word_character(code_point_before(text, match_begin, before_begin));
      std::size_t after = match_end;
      const bool word_after =
          match_end < text.size() && is_word_character(next_code_point(text, after));
      if (word_before || word_after) {
        at = matched_end;
        continue;
      }
    }
    if (token.lstrip) {
      while (match_begin > segment_begin) {
        std::size_t previous = 0;
        if (!is_unicode_whitespace(code_point_before(text, match_begin, previous))) break;
        match_begin = previous;
      }
    }
    if (token.rstrip) {
      while (match_end < text.size()) {
        std::size_t next = match_end;
        if (!is_unicode_whitespace(next_code_point(text, next))) break;
        match_end = next;
      }
    }
    if (match_begin > segment_begin) {
      segments.push_back({text.substr(segment_begin, match_begin - segment_begin), std::nullopt});
    }
    segments.push_back({text.substr(at, matched_end - at), token.id});
    segment_begin = match_end;
    at = match_end;
  }
  if (segment_begin < text.size()) {
    segments.push_back({text.substr(segment_begin), std::nullopt});
  }
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  std::vector<const AddedToken*> raw;
  std::vector<const AddedToken*> normalized;
  for (std::size_t index = 0; index < tokens_.size(); ++index) {
    const AddedToken& token = tokens_[index];
    index_of_id_.try_emplace(token.id, index);
    index_of_content_.try_emplace(token.content, index);
    (token.normalized ? normalized : raw).push_back(&token);
  }
  raw_.emplace(raw);
  normalized_.emplace(normalized);
}

const AddedToken* AddedVocabulary::find(TokenId id) const {
  const auto found = index_of_id_.find(id);
  return found == index_of_id_.end() ? nullptr : &tokens_[found->second];
}

const AddedToken* AddedVocabulary::find(std::string_view content) const {
  const auto found = index_of_content_.find(content);
  return found == index_of_content_.end() ? nullptr : &tokens_[found->second];
}

}  // namespace kvr::tokenizer
