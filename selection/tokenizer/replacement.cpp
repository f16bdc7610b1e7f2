#include "selection/tokenizer/replacement.hpp"

#include <nlohmann/json.hpp>

namespace kvr::tokenizer {

std::expected<Replacement, TokenizerError> Replacement::from_json(const nlohmann::json& spec) {
  Replacement replacement;
  const auto pattern = spec.find("pattern");
  if (pattern != spec.end() && pattern->contains("Regex")) {
    auto compiled = Regex::compile((*pattern)["Regex"].get<std::string>());
    if (!compiled) return std::unexpected(TokenizerError{"Replace: " + compiled.error().message});
    replacement.regex_ = std::move(*compiled);
  } else if (pattern != spec.end() && pattern->contains("String")) {
    replacement.literal_ = (*pattern)["String"].get<std::string>();
  } else {
    return std::unexpected(TokenizerError{"Replace: pattern needs String or Regex"});
  }
  const auto content = spec.find("content");
  if (content != spec.end() && content->is_string()) {
    replacement.content_ = content->get<std::string>();
  }
  return replacement;
}

void Replacement::apply(std::string& text) const {
  std::string replaced;
  std::size_t copied = 0;
  bool matched = false;
  const auto replace = [&](std::size_t begin, std::size_t end) {
    replaced.append(text, copied, begin - copied);
    replaced.append(content_);
    copied = end;
    matched = true;
  };
  if (regex_) {
    regex_->for_each_match(text, replace);
  } else if (!literal_.empty()) {
    for (std::size_t at = text.find(literal_); at != std::string::npos;
         at = text.find(literal_, at + literal_.size())) {
      replace(at, at + literal_.size());
    }
  }
  if (!matched) return;
  replaced.append(text, copied);
  text = std::move(replaced);
}

}  // namespace kvr::tokenizer
