#include "selection/tokenizer/tokenizer.hpp"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <mutex>
#include <tuple>
#include <vector>

#include <absl/container/flat_hash_map.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <simdjson.h>

#include "selection/tokenizer/added_vocabulary.hpp"
#include "selection/tokenizer/bpe_model.hpp"
#include "selection/tokenizer/byte_level.hpp"
#include "selection/tokenizer/decoder.hpp"
#include "selection/tokenizer/normalizer.hpp"
#include "selection/tokenizer/post_processor.hpp"
#include "selection/tokenizer/pre_tokenizer.hpp"
#include "selection/tokenizer/spelling_trie.hpp"
#include "selection/tokenizer/string_map.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

// Pieces at least this long that could pass the id limit alone are first cut into the fewest
// spellings (SpellingTrie): far cheaper than BPE on them, whose time grows faster than the piece.
constexpr std::size_t kBoundedPieceBytes = 1024;

// Ids of segment text by content. Two generations approximate LRU at the cost of one map
// swap: when the current one fills half the budget it becomes the previous one, and entries
// found in the previous one move back.
class SegmentCache {
 public:
  explicit SegmentCache(std::size_t budget_bytes) : budget_bytes_(budget_bytes) {}

  bool append_cached(std::string_view text, TokenIds& ids) {
    const std::lock_guard lock{mutex_};
    auto found = current_.find(text);
    if (found == current_.end()) {
      const auto old = previous_.find(text);
      if (old == previous_.end()) return false;
      TokenIds kept = std::move(old->second);
      previous_.erase(old);
      found = store_locked(std::string{text}, std::move(kept));
    }
    ids.insert(ids.end(), found->second.begin(), found->second.end());
    return true;
  }

  void insert(std::string_view text, std::span<const TokenId> ids) {
    const std::lock_guard lock{mutex_};
    if (!current_.contains(text)) store_locked(std::string{text}, TokenIds(ids.begin(), ids.end()));
  }

 private:
  using Map = StringMap<TokenIds>;
  Map::iterator store_locked(std::string text, TokenIds ids) {
    const std::size_t cost = text.size() + ids.size() * sizeof(TokenId) + 64;
    if (current_bytes_ + cost > budget_bytes_ / 2) {
      previous_ = std::move(current_);
      current_ = Map{};
      current_bytes_ = 0;
    }
    current_bytes_ += cost;
    return current_.emplace(std::move(text), std::move(ids)).first;
  }

  std::mutex mutex_;
  std::size_t budget_bytes_;
  std::size_t current_bytes_ = 0;
  Map current_;
  Map previous_;
};

nlohmann::json section(simdjson::dom::element root, const char* key) {
  simdjson::dom::element value;
  if (root[key].get(value) != simdjson::SUCCESS) return nullptr;
  return nlohmann::json::parse(simdjson::minify(value));
}

std::expected<std::vector<AddedToken>, TokenizerError> added_tokens_of(
    simdjson::dom::element root) {
  std::vector<AddedToken> tokens;
  simdjson::dom::array entries;
  if (root["added_tokens"].get_array().get(entries) != simdjson::SUCCESS) return tokens;
  for (const auto entry : entries) {
    AddedToken token;
    std::uint64_t id = 0;
    std::string_view content;
    if (entry["id"].get_uint64().get(id) != simdjson::SUCCESS ||
        entry["content"].get_string().get(content) != simdjson::SUCCESS) {
      return std::unexpected(
          TokenizerError{"added_tokens: every entry needs an \"id\" and a \"content\""});
    }
    token.id = static_cast<TokenId>(id);
    token.content = std::string{content};
    const auto flag = [&](const char* key) {
      bool value = false;
      return entry[key].get_bool().get(value) == simdjson::SUCCESS && value;
    };
    token.single_word = flag("single_word");
    token.lstrip = flag("lstrip");
    token.rstrip = flag("rstrip");
    token.normalized = flag("normalized");
    token.special = flag("special");
    tokens.push_back(std::move(token));
  }
  return tokens;
}

// A special token of tokenizer_config.json: a string, an AddedToken object, or null.
std::optional<std::string> config_token(const nlohmann::json& config, const char* key) {
  const auto found = config.find(key);
  if (found == config.end()) return std::nullopt;
  if (found->is_string()) return found->get<std::string>();
  if (found->is_object() && found->contains("content") && (*found)["content"].is_string()) {
    return (*found)["content"].get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

struct Tokenizer::Parts {
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::optional<BpeModel> model;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  AddedVocabulary added;
  // What decoders receive for each id: the model's spelling, or an added token's content.
  std::vector<std::string> spelling_of_id;
  std::vector<bool> special_id;
  TokenizerOptions options;
  std::unique_ptr<SegmentCache> cache;
  // The vocabulary's spellings, indexed at the first piece that needs them (most never do).
  mutable std::once_flag spelling_trie_once;
  mutable std::unique_ptr<SpellingTrie> spelling_trie;

  const SpellingTrie& spellings() const {
    std::call_once(spelling_trie_once, [this] {
      std::vector<std::string> spelt;
      spelt.reserve(model->id_bound());
      for (std::size_t id = 0; id < model->id_bound(); ++id) {
        if (const std::string* spelling = model->token_of(static_cast<TokenId>(id))) {
          spelt.push_back(*spelling);
        }
      }
      spelling_trie = std::make_unique<SpellingTrie>(spelt);
    });
    return *spelling_trie;
  }

  // Both append the ids of `text` and return false once the ids are more than `max_ids` (the
  // rest of the text left unencoded).
  bool encode_text(std::string_view text, bool at_input_start, std::size_t max_ids,
                   TokenIds& ids) const;
  bool encode_normalized(std::string_view text, bool at_input_start, std::size_t max_ids,
                         TokenIds& ids) const;
};

bool Tokenizer::Parts::encode_normalized(std::string_view text, bool at_input_start,
                                         std::size_t max_ids, TokenIds& ids) const {
  PreTokenized pre_tokenized;
  pre_tokenized.at_input_start = at_input_start;
  pre_tokenized.pieces.emplace_back(text);
  if (pre_tokenizer) pre_tokenizer->pre_tokenize(pre_tokenized);
  for (const std::string& piece : pre_tokenized.pieces) {
    // A piece longer than the ids still allowed may pass the limit alone (an id spells at least
    // a byte): when even its fewest spellings do, it is refused without BPE.
    if (piece.size() >= kBoundedPieceBytes && ids.size() <= max_ids &&
        piece.size() > max_ids - ids.size() && model->spellings_bound_ids() &&
        spellings().needs_more_than(piece, max_ids - ids.size())) {
      return false;
    }
    model->encode_piece(piece, ids);
    // One compare a piece: text past the limit costs no BPE work (its merges are the most of it).
    if (ids.size() > max_ids) return false;
  }
  return true;
}

bool Tokenizer::Parts::encode_text(std::string_view text, bool at_input_start, std::size_t max_ids,
                                   TokenIds& ids) const {
  const bool cacheable = cache && !at_input_start && text.size() >= options.segment_cache_min_bytes;
  if (cacheable && cache->append_cached(text, ids)) return ids.size() <= max_ids;
  const std::size_t first_id = ids.size();
  std::string normalized{text};
  if (normalizer) normalizer->normalize(normalized);
  if (added.normalized_matcher().empty()) {
    if (!encode_normalized(normalized, at_input_start, max_ids, ids)) return false;
  } else {
    std::vector<Segment> segments;
    added.normalized_matcher().split(normalized, segments);
    for (const Segment& segment : segments) {
      if (segment.token) {
        ids.push_back(*segment.token);
      } else if (!encode_normalized(segment.text,
                                    at_input_start && segment.text.data() == normalized.data(),
                                    max_ids, ids)) {
        return false;
      }
      if (ids.size() > max_ids) return false;
    }
  }
  // Only whole segments are cached: one cut at the limit has only some of its ids.
  if (cacheable) cache->insert(text, std::span{ids}.subspan(first_id));
  return true;
}

Tokenizer::Tokenizer(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::expected<Tokenizer, TokenizerError> Tokenizer::load(const std::filesystem::path& path,
                                                         const TokenizerOptions& options) {
  std::filesystem::path file = path;
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) file = path / "tokenizer.json";
  simdjson::padded_string text;
  if (simdjson::padded_string::load(file.string()).get(text) != simdjson::SUCCESS) {
    return std::unexpected(TokenizerError{fmt::format("{}: cannot be read", file.string())});
  }
  std::string config;
  if (std::ifstream in{file.parent_path() / "tokenizer_config.json", std::ios::binary}) {
    config.assign(std::istreambuf_iterator<char>{in}, std::istreambuf_iterator<char>{});
  }
  auto tokenizer = from_json(std::string_view{text}, options, config);
  if (!tokenizer) {
    return std::unexpected(
        TokenizerError{fmt::format("{}: {}", file.string(), tokenizer.error().message)});
  }
  return tokenizer;
}

std::expected<Tokenizer, TokenizerError> Tokenizer::from_json(std::string_view tokenizer_json,
                                                              const TokenizerOptions& options,
                                                              std::string_view tokenizer_config) {
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (const auto failure = parser.parse(tokenizer_json.data(), tokenizer_json.size()).get(root);
      failure != simdjson::SUCCESS) {
    return std::unexpected(
        TokenizerError{fmt::format("not valid JSON: {}", simdjson::error_message(failure))});
  }
  auto parts = std::make_unique<Parts>();
  parts->options = options;
  try {
    auto normalizer = make_normalizer(section(root, "normalizer"));
    if (!normalizer) return std::unexpected(normalizer.error());
    parts->normalizer = std::move(*normalizer);
    auto pre_tokenizer = make_pre_tokenizer(section(root, "pre_tokenizer"));
    if (!pre_tokenizer) return std::unexpected(pre_tokenizer.error());
    parts->pre_tokenizer = std::move(*pre_tokenizer);
    auto post_processor = make_post_processor(section(root, "post_processor"));
    if (!post_processor) return std::unexpected(post_processor.error());
    parts->post_processor = std::move(*post_processor);
    auto decoder = make_decoder(section(root, "decoder"));
    if (!decoder) return std::unexpected(decoder.error());
    parts->decoder = std::move(*decoder);
  } catch (const nlohmann::json::exception& failure) {
    return std::unexpected(TokenizerError{fmt::format("malformed component: {}", failure.what())});
  }
  const bool byte_level = parts->pre_tokenizer && parts->pre_tokenizer->byte_level();
  if (byte_level != (parts->decoder && parts->decoder->byte_level())) {
    return std::unexpected(TokenizerError{
        "a ByteLevel pre_tokenizer and a ByteLevel decoder come together; this file has one "
        "without the other, which kvr does not support"});
  }
  simdjson::dom::element model;
  if (root["model"].get(model) != simdjson::SUCCESS) {
    return std::unexpected(TokenizerError{"\"model\" is missing"});
  }
  auto bpe = BpeModel::load(model, byte_level);
  if (!bpe) return std::unexpected(bpe.error());
  parts->model = std::move(*bpe);
  auto added = added_tokens_of(root);
  if (!added) return std::unexpected(added.error());

  std::size_t id_bound = parts->model->id_bound();
  for (const AddedToken& token : *added) id_bound = std::max<std::size_t>(id_bound, token.id + 1);
  parts->spelling_of_id.resize(id_bound);
  parts->special_id.resize(id_bound, false);
  for (std::size_t id = 0; id < parts->model->id_bound(); ++id) {
    if (const std::string* spelling = parts->model->token_of(static_cast<TokenId>(id))) {
      parts->spelling_of_id[id] = *spelling;
    }
  }
  for (const AddedToken& token : *added) {
    std::string spelling = token.content;
    if (byte_level) {
      if (auto bytes = bytes_from_byte_level(spelling)) spelling = std::move(*bytes);
    }
    parts->spelling_of_id[token.id] = std::move(spelling);
    parts->special_id[token.id] = token.special;
  }
  parts->added = AddedVocabulary{std::move(*added)};
  if (!tokenizer_config.empty()) {
    const auto config = nlohmann::json::parse(tokenizer_config, nullptr, false);
    if (!config.is_object()) {
      return std::unexpected(TokenizerError{"tokenizer_config.json is not a JSON object"});
    }
    // transformers rebuilds the post-processor from these flags whenever the config names one
    // (or tokenizer.json has no post-processor): BOS, the sequence, EOS.
    if (config.contains("add_bos_token") || config.contains("add_eos_token") ||
        !parts->post_processor) {
      TokenIds bos;
      TokenIds eos;
      for (const auto& [flag, key, ids] : {std::tuple{"add_bos_token", "bos_token", &bos},
                                           std::tuple{"add_eos_token", "eos_token", &eos}}) {
        const auto content = config_token(config, key);
        if (!config.value(flag, false) || !content) continue;
        const AddedToken* token = parts->added.find(*content);
        const auto id = token != nullptr ? std::optional{token->id} : parts->model->id_of(*content);
        if (!id) {
          return std::unexpected(TokenizerError{fmt::format(
              "tokenizer_config.json: {} \"{}\" is not in the vocabulary", key, *content)});
        }
        ids->push_back(*id);
      }
      parts->post_processor = make_surrounding_post_processor(std::move(bos), std::move(eos));
    }
  }
  if (options.segment_cache_bytes > 0) {
    parts->cache = std::make_unique<SegmentCache>(options.segment_cache_bytes);
  }
  return Tokenizer{std::move(parts)};
}

// `segments` of `text` with every special token that overlaps a `literal` range turned into text:
// joined with the text around it (and the whitespace it stripped) into one segment.
namespace {
std::vector<Segment> spell_out(const Tokenizer& tokenizer, std::string_view text,
                               std::vector<Segment> segments, std::span<const ByteRange> literal) {
  std::vector<Segment> out;
  out.reserve(segments.size());
  std::size_t next_literal = 0;
  // The text segment being built: [run_begin, run_end) of `text`; none when run_begin == npos.
  std::size_t run_begin = std::string_view::npos;
  std::size_t run_end = 0;
  const auto close_run = [&] {
    if (run_begin == std::string_view::npos) return;
    out.push_back({text.substr(run_begin, run_end - run_begin), std::nullopt});
    run_begin = std::string_view::npos;
  };
  for (const Segment& segment : segments) {
    const auto begin = static_cast<std::size_t>(segment.text.data() - text.data());
    const std::size_t end = begin + segment.text.size();
    bool as_text = !segment.token;
    if (segment.token && tokenizer.is_special(*segment.token)) {
      while (next_literal < literal.size() && literal[next_literal].end <= begin) ++next_literal;
      as_text = next_literal < literal.size() && literal[next_literal].begin < end;
    }
    if (!as_text) {
      close_run();
      out.push_back(segment);
      continue;
    }
    if (run_begin == std::string_view::npos) run_begin = begin;
    run_end = end;
  }
  close_run();
  return out;
}
}  // namespace

std::expected<TokenIds, TokenizerError> Tokenizer::encode(std::string_view text,
                                                          bool add_special_tokens,
                                                          std::size_t max_ids) const {
  return encode(text, add_special_tokens, max_ids, {});
}

std::vector<ByteRange> Tokenizer::find_special_tokens(std::string_view text) const {
  std::vector<ByteRange> found;
  if (parts_->added.raw_matcher().empty()) return found;
  std::vector<Segment> segments;
  parts_->added.raw_matcher().split(text, segments);
  for (const Segment& segment : segments) {
    if (!segment.token || !is_special(*segment.token)) continue;
    const auto begin = static_cast<std::size_t>(segment.text.data() - text.data());
    found.push_back({begin, begin + segment.text.size()});
  }
  return found;
}

std::expected<TokenIds, TokenizerError> Tokenizer::encode(
    std::string_view text, bool add_special_tokens, std::size_t max_ids,
    std::span<const ByteRange> literal) const {
  if (const std::size_t invalid = first_invalid_utf8(text); invalid != text.size()) {
    return std::unexpected(
        TokenizerError{fmt::format("the text is not UTF-8 (byte offset {})", invalid)});
  }
  const auto over_limit = [&] {
    return std::unexpected(
        TokenizerError{.message = fmt::format("the text has more than {} tokens", max_ids),
                       .over_id_limit = true});
  };
  TokenIds ids;
  ids.reserve(std::min(text.size() / 3, max_ids) + 4);
  if (parts_->added.raw_matcher().empty()) {
    if (!parts_->encode_text(text, true, max_ids, ids)) return over_limit();
  } else {
    std::vector<Segment> segments;
    parts_->added.raw_matcher().split(text, segments);
    if (!literal.empty()) segments = spell_out(*this, text, std::move(segments), literal);
    for (const Segment& segment : segments) {
      if (segment.token) {
        ids.push_back(*segment.token);
      } else if (!parts_->encode_text(segment.text, segment.text.data() == text.data(), max_ids,
                                      ids)) {
        return over_limit();
      }
      if (ids.size() > max_ids) return over_limit();
    }
  }
  if (add_special_tokens && parts_->post_processor) parts_->post_processor->add_special_tokens(ids);
  if (ids.size() > max_ids) return over_limit();
  return ids;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::vector<std::string> spellings;
  spellings.reserve(ids.size());
  for (const TokenId id : ids) {
    if (id >= parts_->spelling_of_id.size()) continue;
    if (skip_special_tokens && parts_->special_id[id]) continue;
    spellings.push_back(parts_->spelling_of_id[id]);
  }
  if (!parts_->decoder) {
    // HuggingFace joins undecoded spellings with spaces.
    std::string joined;
    for (std::size_t index = 0; index < spellings.size(); ++index) {
      if (index > 0) joined.push_back(' ');
      joined.append(spellings[index]);
    }
    return utf8_lossy(joined);
  }
  parts_->decoder->decode_chain(spellings);
  std::string text;
  for (const std::string& spelling : spellings) text.append(spelling);
  return text;
}

bool Tokenizer::is_special(TokenId id) const {
  return id < parts_->special_id.size() && parts_->special_id[id];
}

std::size_t Tokenizer::vocab_size() const { return parts_->spelling_of_id.size(); }

namespace {

// What `after` (a window's text with the new ids) adds to `before` (its text without them).
// Usually `before` is a prefix of `after`. Not always: a later id can change how earlier ids
// decode (a byte-fallback run that stops being UTF-8 turns into one U+FFFD per byte), and what
// was emitted cannot be taken back. The text from the first difference on is new then, cut at a
// character's start, so that no chunk holds half a character.
std::string added_text(const std::string& before, const std::string& after) {
  if (after.starts_with(before)) return after.substr(before.size());
  std::size_t common = 0;
  while (common < before.size() && common < after.size() && before[common] == after[common]) {
    ++common;
  }
  while (common > 0 && (static_cast<unsigned char>(after[common]) & 0xC0) == 0x80) --common;
  return after.substr(common);
}

}  // namespace

std::string IncrementalDecoder::push(TokenId id) {
  ids_.push_back(id);
  // Decode a short window twice, without and with the new ids: what the longer one adds is
  // new text, unless it ends in a replacement character (a character still incomplete).
  const std::span<const TokenId> all{ids_};
  const std::string before = tokenizer_->decode(
      all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string after = tokenizer_->decode(all.subspan(prefix_offset_), skip_special_tokens_);
  if (after.size() <= before.size() || after.ends_with("\xEF\xBF\xBD")) return {};
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  return added_text(before, after);
}

std::string IncrementalDecoder::finish() {
  const std::span<const TokenId> all{ids_};
  const std::string before = tokenizer_->decode(
      all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string after = tokenizer_->decode(all.subspan(prefix_offset_), skip_special_tokens_);
  prefix_offset_ = read_offset_ = ids_.size();
  return after.size() > before.size() ? added_text(before, after) : std::string{};
}

}  // namespace kvr::tokenizer
