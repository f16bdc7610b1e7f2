// A compiled PCRE2 pattern (UTF, Unicode properties, JIT) for the pre-tokenizers' and
// normalizers' regexes: HuggingFace writes them for Oniguruma, whose look-around and \p{..}
// classes PCRE2 shares.
#pragma once

#include <cstddef>
#include <expected>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "selection/tokenizer/tokenizer_types.hpp"

namespace kvr::tokenizer {

/// A pattern compiled once, matched from any number of threads at once.
class Regex {
 public:
  /// Compiles `pattern`; the error quotes PCRE2's message and the offset it stopped at.
  static std::expected<Regex, TokenizerError> compile(std::string_view pattern);

  /// Calls `on_match(begin, end)` for each non-overlapping match in `text`, left to right;
  /// `text` must be valid UTF-8.
  void for_each_match(std::string_view text,
                      const std::function<void(std::size_t, std::size_t)>& on_match) const;

 private:
  struct Code;
  explicit Regex(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

}  // namespace kvr::tokenizer
