#include "selection/tokenizer/bpe_model.hpp"

#include <algorithm>
#include <queue>

#include <fmt/format.h>

#include "selection/tokenizer/byte_level.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

// Pieces of up to this many symbols are merged by rescanning (cheaper than a heap when short).
constexpr std::size_t kLinearMergeLimit = 16;

TokenizerError model_error(const std::string& what) { return TokenizerError{"model: " + what}; }

std::string optional_string(simdjson::dom::element model, const char* key) {
  std::string_view value;
  if (model[key].get_string().get(value) == simdjson::SUCCESS) return std::string{value};
  return {};
}

bool optional_bool(simdjson::dom::element model, const char* key) {
  bool value = false;
  return model[key].get_bool().get(value) == simdjson::SUCCESS && value;
}

}  // namespace

std::expected<BpeModel, TokenizerError> BpeModel::load(simdjson::dom::element model,
                                                       bool byte_level) {
  std::string_view type;
  if (model["type"].get_string().get(type) == simdjson::SUCCESS && type != "BPE") {
    return std::unexpected(model_error(fmt::format(
        "type \"{}\" is not supported (kvr encodes BPE models: byte-level and SentencePiece-style)",
        type)));
  }
  double dropout = 0;
  if (model["dropout"].get_double().get(dropout) == simdjson::SUCCESS && dropout > 0) {
    return std::unexpected(
        model_error("BPE dropout is not supported: encoding must be repeatable"));
  }
  BpeModel bpe;
  bpe.byte_level_ = byte_level;
  bpe.fuse_unk_ = optional_bool(model, "fuse_unk");
  bpe.byte_fallback_ = optional_bool(model, "byte_fallback");
  bpe.ignore_merges_ = optional_bool(model, "ignore_merges");
  bpe.continuing_subword_prefix_ = optional_string(model, "continuing_subword_prefix");
  bpe.end_of_word_suffix_ = optional_string(model, "end_of_word_suffix");

  simdjson::dom::object vocab;
  if (model["vocab"].get_object().get(vocab) != simdjson::SUCCESS) {
    return std::unexpected(model_error("\"vocab\" must be an object of token to id"));
  }
  bpe.id_of_token_.reserve(vocab.size());
  for (const auto field : vocab) {
    std::uint64_t id = 0;
    if (field.value.get_uint64().get(id) != simdjson::SUCCESS || id > 0xFFFFFFFu) {
      return std::unexpected(
          model_error(fmt::format("vocab entry \"{}\" has no valid id", field.key)));
    }
    std::string spelling{field.key};
    if (byte_level) {
      if (auto bytes = bytes_from_byte_level(spelling)) spelling = std::move(*bytes);
    }
    if (id >= bpe.token_of_id_.size()) {
      bpe.token_of_id_.resize(id + 1);
      bpe.known_id_.resize(id + 1, false);
    }
    bpe.token_of_id_[id] = spelling;
    bpe.known_id_[id] = true;
    bpe.id_of_token_.emplace(std::move(spelling), static_cast<TokenId>(id));
  }

  const auto to_model_spelling = [&](std::string_view token) {
    std::string spelling{token};
    if (byte_level) {
      if (auto bytes = bytes_from_byte_level(spelling)) spelling = std::move(*bytes);
    }
    return spelling;
  };

  simdjson::dom::array merges;
  if (model["merges"].get_array().get(merges) == simdjson::SUCCESS) {
    bpe.merges_.reserve(merges.size());
    std::uint32_t rank = 0;
    for (const auto merge : merges) {
      std::string_view left;
      std::string_view right;
      std::string_view joined;
      simdjson::dom::array pair;
      if (merge.get_string().get(joined) == simdjson::SUCCESS) {
        const std::size_t space = joined.find(' ', 1);
        if (space == std::string_view::npos) {
          return std::unexpected(model_error(fmt::format("merge \"{}\" has no space", joined)));
        }
        left = joined.substr(0, space);
        right = joined.substr(space + 1);
      } else if (merge.get_array().get(pair) == simdjson::SUCCESS && pair.size() == 2 &&
                 pair.at(0).get_string().get(left) == simdjson::SUCCESS &&
                 pair.at(1).get_string().get(right) == simdjson::SUCCESS) {
      } else {
        return std::unexpected(
            model_error(fmt::format("merge {} is neither \"a b\" nor [\"a\", \"b\"]", rank)));
      }
      const std::string left_spelling = to_model_spelling(left);
      const std::string right_spelling = to_model_spelling(right);
      const auto left_id = bpe.id_of(left_spelling);
      const auto right_id = bpe.id_of(right_spelling);
      // Byte-level strips the continuing prefix from the right part's spelling before joining.
      std::string merged_spelling = left_spelling;
      merged_spelling.append(!bpe.continuing_subword_prefix_.empty() &&
                                     right_spelling.starts_with(bpe.continuing_subword_prefix_)
                                 ? right_spelling.substr(bpe.continuing_subword_prefix_.size())
                                 : right_spelling);
      const auto merged_id = bpe.id_of(merged_spelling);
      if (!left_id || !right_id || !merged_id) {
        return std::unexpected(model_error(fmt::format(
            "merge {} (\"{}\" + \"{}\") names a token outside the vocabulary", rank, left, right)));
      }
      bpe.merges_.try_emplace(pair_key(*left_id, *right_id), Merge{rank, *merged_id});
      ++rank;
    }
  } else {
    return std::unexpected(model_error("\"merges\" must be an array"));
  }

  for (unsigned byte = 0; byte < 256; ++byte) {
    if (byte_level) {
      bpe.byte_token_[byte] = bpe.id_of(std::string(1, static_cast<char>(byte)));
    } else if (bpe.byte_fallback_) {
      bpe.byte_token_[byte] = bpe.id_of(fmt::format("<0x{:02X}>", byte));
    }
  }
  const std::string unk = optional_string(model, "unk_token");
  if (!unk.empty()) {
    bpe.unk_id_ = bpe.id_of(unk);
    if (!bpe.unk_id_) {
      return std::unexpected(
          model_error(fmt::format("unk_token \"{}\" is not in the vocabulary", unk)));
    }
  }
  return bpe;
}

std::optional<TokenId> BpeModel::id_of(std::string_view token) const {
  const auto found = id_of_token_.find(token);
  if (found == id_of_token_.end()) return std::nullopt;
  return found->second;
}

const std::string* BpeModel::token_of(TokenId id) const {
  if (id >= token_of_id_.size() || !known_id_[id]) return nullptr;
  return &token_of_id_[id];
}

bool BpeModel::spellings_bound_ids() const {
  if (!continuing_subword_prefix_.empty() || !end_of_word_suffix_.empty()) return false;
  // A character without an id becomes byte tokens when every byte has one (byte-level, byte
  // fallback); else the unknown token, one per character unless fused, or nothing at all.
  if (std::ranges::all_of(byte_token_, [](const auto& token) { return token.has_value(); })) {
    return true;
  }
  return unk_id_ && !fuse_unk_;
}

const BpeModel::Merge* BpeModel::merge_of(TokenId left, TokenId right) const {
  const auto found = merges_.find(pair_key(left, right));
  return found == merges_.end() ? nullptr : &found->second;
}

void BpeModel::initial_symbols(std::string_view piece, std::vector<Symbol>& symbols) const {
  symbols.clear();
  const auto push = [&](TokenId id) {
    const auto index = static_cast<std::int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  };
  const bool affixes = !continuing_subword_prefix_.empty() || !end_of_word_suffix_.empty();
  if (byte_level_ && !affixes) {
    for (const char c : piece) {
      if (const auto id = byte_token_[static_cast<unsigned char>(c)]) {
        push(*id);
      } else if (unk_id_ && !(fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_)) {
        push(*unk_id_);
      }
    }
  } else {
    std::string spelling;
    for (std::size_t at = 0; at < piece.size();) {
      const std::size_t length =
          std::min(utf8_length(static_cast<unsigned char>(piece[at])), piece.size() - at);
      const std::string_view character = piece.substr(at, length);
      spelling.clear();
      if (at > 0) spelling.append(continuing_subword_prefix_);
      spelling.append(character);
      at += length;
      if (at == piece.size()) spelling.append(end_of_word_suffix_);
      if (const auto id = id_of(spelling)) {
        push(*id);
        continue;
      }
      if (byte_fallback_) {
        bool every_byte = true;
        for (const char c : character)
          every_byte &= byte_token_[static_cast<unsigned char>(c)].has_value();
        if (every_byte) {
          for (const char c : character) push(*byte_token_[static_cast<unsigned char>(c)]);
          continue;
        }
      }
      if (unk_id_ && !(fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_)) {
        push(*unk_id_);
      }
    }
  }
  if (!symbols.empty()) symbols.back().next = -1;
}

void BpeModel::merge_symbols(std::vector<Symbol>& symbols) const {
  if (symbols.size() < 2) return;
  if (symbols.size() <= kLinearMergeLimit) {
    // Rescan for the lowest-ranked adjacent pair (leftmost on ties) until none merges.
    while (true) {
      std::int32_t best = -1;
      const Merge* best_merge = nullptr;
      for (std::int32_t at = 0; at != -1 && symbols[at].next != -1; at = symbols[at].next) {
        const Merge* merge = merge_of(symbols[at].id, symbols[symbols[at].next].id);
        if (merge != nullptr && (best_merge == nullptr || merge->rank < best_merge->rank)) {
          best = at;
          best_merge = merge;
        }
      }
      if (best_merge == nullptr) return;
      const std::int32_t removed = symbols[best].next;
      symbols[best].id = best_merge->merged;
      symbols[best].next = symbols[removed].next;
      if (symbols[removed].next != -1) symbols[symbols[removed].next].previous = best;
    }
  }
  struct Candidate {
    std::uint32_t rank;
    std::int32_t position;
    TokenId left;
    TokenId right;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto offer = [&](std::int32_t at) {
    if (at == -1 || symbols[at].next == -1) return;
    const TokenId left = symbols[at].id;
    const TokenId right = symbols[symbols[at].next].id;
    if (const Merge* merge = merge_of(left, right)) queue.push({merge->rank, at, left, right});
  };
  std::vector<bool> removed(symbols.size(), false);
  for (std::int32_t at = 0; at != -1; at = symbols[at].next) offer(at);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const std::int32_t at = top.position;
    // Stale entries: the symbol was merged away or its pair changed since it was queued.
    if (removed[at] || symbols[at].next == -1 || symbols[at].id != top.left ||
        symbols[symbols[at].next].id != top.right) {
      continue;
    }
    const std::int32_t gone = symbols[at].next;
    symbols[at].id = merge_of(top.left, top.right)->merged;
    symbols[at].next = symbols[gone].next;
    if (symbols[gone].next != -1) symbols[symbols[gone].next].previous = at;
    removed[gone] = true;
    offer(symbols[at].previous);
    offer(at);
  }
}

void BpeModel::encode_piece(std::string_view piece, TokenIds& ids) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    if (const auto whole = id_of(piece)) {
      ids.push_back(*whole);
      return;
    }
  }
  thread_local std::vector<Symbol> symbols;
  initial_symbols(piece, symbols);
  merge_symbols(symbols);
  for (std::int32_t at = symbols.empty() ? -1 : 0; at != -1; at = symbols[at].next) {
    ids.push_back(symbols[at].id);
  }
}

}  // namespace kvr::tokenizer
