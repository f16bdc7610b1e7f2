#include "selection/tokenizer/pre_tokenizer.hpp"

#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "selection/tokenizer/byte_level.hpp"
#include "selection/tokenizer/regex.hpp"
#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
// Named after the kind, as tokenizer.json groups them: the kinds share component names
// (Sequence, Strip, ...), and a unity build compiles their files together.
namespace pre_tokenizers {
namespace {

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

std::optional<SplitBehavior> split_behavior_from(const std::string& name) {
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return std::nullopt;
}

struct Span {
  std::size_t begin;
  std::size_t end;
  bool is_match;
};

// Cuts `piece` at `matches` (sorted, disjoint) as HuggingFace's SplitDelimiterBehavior does and
// appends the non-empty results to `out`.
void cut(const std::string& piece, const std::vector<std::pair<std::size_t, std::size_t>>& matches,
         bool invert, SplitBehavior behavior, std::vector<std::string>& out) {
  std::vector<Span> spans;
  spans.reserve(matches.size() * 2 + 1);
  std::size_t at = 0;
  for (const auto& [begin, end] : matches) {
    if (begin > at) spans.push_back({at, begin, invert});
    spans.push_back({begin, end, !invert});
    at = end;
  }
  if (at < piece.size()) spans.push_back({at, piece.size(), invert});

  std::vector<Span> kept;
  kept.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      kept = std::move(spans);
      break;
    case SplitBehavior::kRemoved:
      for (const Span& span : spans) {
        if (!span.is_match) kept.push_back(span);
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& span : spans) {
        if (span.is_match && !previous_match && !kept.empty()) {
          kept.back().end = span.end;
        } else {
          kept.push_back(span);
        }
        previous_match = span.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto span = spans.rbegin(); span != spans.rend(); ++span) {
        if (span->is_match && !previous_match && !kept.empty()) {
          kept.back().begin = span->begin;
        } else {
          kept.push_back(*span);
        }
        previous_match = span->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Span& span : spans) {
        if (span.is_match == previous_match && !kept.empty()) {
          kept.back().end = span.end;
        } else {
          kept.push_back(span);
        }
        previous_match = span.is_match;
      }
      break;
  }
  for (const Span& span : kept) {
    if (span.end > span.begin) out.emplace_back(piece, span.begin, span.end - span.begin);
  }
}

// Finds the delimiters of a Split: a regex, or a literal string.
class Delimiter {
 public:
  explicit Delimiter(Regex regex) : regex_(std::move(regex)) {}
  explicit Delimiter(std::string literal) : literal_(std::move(literal)) {}

  void find(const std::string& piece,
            std::vector<std::pair<std::size_t, std::size_t>>& matches) const {
    matches.clear();
    if (regex_) {
      regex_->for_each_match(
          piece, [&](std::size_t begin, std::size_t end) { matches.emplace_back(begin, end); });
      return;
    }
    if (literal_.empty()) return;
    for (std::size_t at = piece.find(literal_); at != std::string::npos;
         at = piece.find(literal_, at + literal_.size())) {
      matches.emplace_back(at, at + literal_.size());
    }
  }

 private:
  std::optional<Regex> regex_;
  std::string literal_;
};

// Applies `cut_piece(piece, out)` to every piece.
template <typename CutPiece>
void cut_each(PreTokenized& text, CutPiece&& cut_piece) {
  std::vector<std::string> cut_pieces;
  cut_pieces.reserve(text.pieces.size() * 2);
  for (std::string& piece : text.pieces) cut_piece(piece, cut_pieces);
  text.pieces = std::move(cut_pieces);
}

class Split final : public PreTokenizer {
 public:
  Split(Delimiter delimiter, SplitBehavior behavior, bool invert)
      : delimiter_(std::move(delimiter)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(PreTokenized& text) const override {
    std::vector<std::pair<std::size_t, std::size_t>> matches;
    cut_each(text, [&](std::string& piece, std::vector<std::string>& out) {
      delimiter_.find(piece, matches);
      if (matches.empty() && !invert_) {
        out.push_back(std::move(piece));
        return;
      }
      cut(piece, matches, invert_, behavior_, out);
    });
  }

 private:
  Delimiter delimiter_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevel final : public PreTokenizer {
 public:
  ByteLevel(bool add_prefix_space, std::optional<Regex> gpt2_split)
      : add_prefix_space_(add_prefix_space), gpt2_split_(std::move(gpt2_split)) {}
  bool byte_level() const override { return true; }
  void pre_tokenize(PreTokenized& text) const override {
    if (add_prefix_space_) {
      for (std::string& piece : text.pieces) {
        if (piece.empty() || piece.front() != ' ') piece.insert(0, " ");
      }
    }
    if (!gpt2_split_) return;
    std::vector<std::pair<std::size_t, std::size_t>> matches;
    cut_each(text, [&](std::string& piece, std::vector<std::string>& out) {
      matches.clear();
      gpt2_split_->for_each_match(
          piece, [&](std::size_t begin, std::size_t end) { matches.emplace_back(begin, end); });
      cut(piece, matches, false, SplitBehavior::kIsolated, out);
    });
  }

 private:
  bool add_prefix_space_;
  std::optional<Regex> gpt2_split_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class Metaspace final : public PreTokenizer {
 public:
  Metaspace(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void pre_tokenize(PreTokenized& text) const override {
    bool first_piece = true;
    std::vector<std::pair<std::size_t, std::size_t>> matches;
    cut_each(text, [&](std::string& piece, std::vector<std::string>& out) {
      std::string replaced;
      replaced.reserve(piece.size() + replacement_.size());
      for (const char c : piece) {
        if (c == ' ') {
          replaced.append(replacement_);
        } else {
          replaced.push_back(c);
        }
      }
      const bool starts_with_replacement = replaced.starts_with(replacement_);
      if (!starts_with_replacement &&
          (scheme_ == PrependScheme::kAlways ||
           (scheme_ == PrependScheme::kFirst && first_piece && text.at_input_start))) {
        replaced.insert(0, replacement_);
      }
      first_piece = false;
      if (!split_) {
        out.push_back(std::move(replaced));
        return;
      }
      matches.clear();
      for (std::size_t at = replaced.find(replacement_); at != std::string::npos;
           at = replaced.find(replacement_, at + replacement_.size())) {
        matches.emplace_back(at, at + replacement_.size());
      }
      cut(replaced, matches, false, SplitBehavior::kMergedWithNext, out);
    });
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class Sequence final : public PreTokenizer {
 public:
  explicit Sequence(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(PreTokenized& text) const override {
    for (const auto& step : steps_) step->pre_tokenize(text);
  }
  bool byte_level() const override {
    for (const auto& step : steps_) {
      if (step->byte_level()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

std::expected<std::unique_ptr<PreTokenizer>, TokenizerError> regex_split(std::string_view pattern,
                                                                         SplitBehavior behavior,
                                                                         bool invert) {
  auto regex = Regex::compile(pattern);
  if (!regex) return std::unexpected(regex.error());
  return std::make_unique<Split>(Delimiter{std::move(*regex)}, behavior, invert);
}

TokenizerError field_error(const std::string& type, const std::string& what) {
  return TokenizerError{fmt::format("pre_tokenizer {}: {}", type, what)};
}

}  // namespace
}  // namespace pre_tokenizers

std::expected<std::unique_ptr<PreTokenizer>, TokenizerError> make_pre_tokenizer(
    const nlohmann::json& spec) {
  if (spec.is_null()) return nullptr;
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    return std::unexpected(TokenizerError{"pre_tokenizer: an object with a \"type\" is expected"});
  }
  const std::string type = spec["type"].get<std::string>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const auto& step_spec : spec.value("pretokenizers", nlohmann::json::array())) {
      auto step = make_pre_tokenizer(step_spec);
      if (!step) return std::unexpected(step.error());
      if (*step) steps.push_back(std::move(*step));
    }
    return std::make_unique<pre_tokenizers::Sequence>(std::move(steps));
  }
  if (type == "Split") {
    const auto behavior =
        pre_tokenizers::split_behavior_from(spec.value("behavior", std::string{}));
    if (!behavior) {
      return std::unexpected(pre_tokenizers::field_error(
          type, fmt::format("behavior \"{}\" is not one of Removed, Isolated, MergedWithPrevious, "
                            "MergedWithNext, Contiguous",
                            spec.value("behavior", std::string{}))));
    }
    const bool invert = spec.value("invert", false);
    const auto& pattern = spec.contains("pattern") ? spec["pattern"] : nlohmann::json{};
    if (pattern.contains("Regex")) {
      auto split =
          pre_tokenizers::regex_split(pattern["Regex"].get<std::string>(), *behavior, invert);
      if (!split) return std::unexpected(pre_tokenizers::field_error(type, split.error().message));
      return split;
    }
    if (pattern.contains("String")) {
      return std::make_unique<pre_tokenizers::Split>(
          pre_tokenizers::Delimiter{pattern["String"].get<std::string>()}, *behavior, invert);
    }
    return std::unexpected(pre_tokenizers::field_error(type, "pattern needs String or Regex"));
  }
  if (type == "ByteLevel") {
    std::optional<Regex> gpt2_split;
    if (spec.value("use_regex", true)) {
      auto regex = Regex::compile(kGpt2SplitPattern);
      if (!regex) return std::unexpected(pre_tokenizers::field_error(type, regex.error().message));
      gpt2_split = std::move(*regex);
    }
    return std::make_unique<pre_tokenizers::ByteLevel>(spec.value("add_prefix_space", true),
                                                       std::move(gpt2_split));
  }
  if (type == "Metaspace") {
    const std::string scheme_name = spec.value("prepend_scheme", std::string{"always"});
    pre_tokenizers::PrependScheme scheme = pre_tokenizers::PrependScheme::kAlways;
    if (scheme_name == "first") {
      scheme = pre_tokenizers::PrependScheme::kFirst;
    } else if (scheme_name == "never") {
      scheme = pre_tokenizers::PrependScheme::kNever;
    } else if (scheme_name != "always") {
      return std::unexpected(
          pre_tokenizers::field_error(type, "prepend_scheme must be always, first or never"));
    }
    // Older files spell the scheme as add_prefix_space.
    if (!spec.contains("prepend_scheme") && !spec.value("add_prefix_space", true)) {
      scheme = pre_tokenizers::PrependScheme::kNever;
    }
    return std::make_unique<pre_tokenizers::Metaspace>(
        spec.value("replacement", std::string{"\u2581"}), scheme, spec.value("split", true));
  }
  if (type == "Whitespace")
    return pre_tokenizers::regex_split(R"(\w+|[^\w\s]+)", pre_tokenizers::SplitBehavior::kRemoved,
                                       true);
  if (type == "WhitespaceSplit")
    return pre_tokenizers::regex_split(R"(\s+)", pre_tokenizers::SplitBehavior::kRemoved, false);
  if (type == "Digits") {
    return pre_tokenizers::regex_split(R"(\p{N})",
                                       spec.value("individual_digits", false)
                                           ? pre_tokenizers::SplitBehavior::kIsolated
                                           : pre_tokenizers::SplitBehavior::kContiguous,
                                       false);
  }
  if (type == "Punctuation") {
    const auto behavior =
        pre_tokenizers::split_behavior_from(spec.value("behavior", std::string{"Isolated"}));
    if (!behavior) return std::unexpected(pre_tokenizers::field_error(type, "unknown behavior"));
    return pre_tokenizers::regex_split(R"([\p{P}!-/:-@\[-`{-~])", *behavior, false);
  }
  return std::unexpected(TokenizerError{
      fmt::format("pre_tokenizer type \"{}\" is not supported (supported: "
                  "pre_tokenizers::Sequence, pre_tokenizers::Split, pre_tokenizers::ByteLevel, "
                  "Metaspace, Whitespace, WhitespaceSplit, Digits, Punctuation)",
                  type)});
}

}  // namespace kvr::tokenizer
