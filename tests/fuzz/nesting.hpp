// A directive that lets a small fuzz input stand for a deeply nested one (a chat body whose tool
// parameters nest 40,000 levels, a template of nested expressions), so that the harnesses of text
// formats reach their depth limits without seeds of hundreds of kilobytes, and libFuzzer mutates
// the depth as a number.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <string>
#include <string_view>

namespace kvr::fuzz {

/// The most levels a directive expands to.
inline constexpr std::size_t kMaxNestingLevels = 100'000;
/// The most bytes a directive's expansion adds (its levels are cut to fit).
inline constexpr std::size_t kMaxNestingBytes = std::size_t{640} << 10;

/// `text` with its nesting directive applied: a text whose first line is
/// "%nest <levels>\t<open>\t<core>\t<close>" stands for its other lines with the first "%%"
/// replaced by <open> repeated <levels> times, <core>, then <close> as many times (appended when
/// there is no "%%"). A text without a well-formed directive is returned as it is.
inline std::string expand_nesting(std::string_view text) {
  constexpr std::string_view kDirective = "%nest ";
  if (!text.starts_with(kDirective)) return std::string{text};
  const std::size_t line_end = text.find('\n');
  if (line_end == std::string_view::npos) return std::string{text};
  std::string_view line = text.substr(kDirective.size(), line_end - kDirective.size());
  const std::string_view rest = text.substr(line_end + 1);
  std::size_t levels = 0;
  const auto [levels_end, error] = std::from_chars(line.data(), line.data() + line.size(), levels);
  if (error != std::errc{} || levels_end == line.data() + line.size() || *levels_end != '\t') {
    return std::string{text};
  }
  line.remove_prefix(static_cast<std::size_t>(levels_end - line.data()) + 1);
  const std::size_t first_tab = line.find('\t');
  const std::size_t second_tab =
      first_tab == std::string_view::npos ? first_tab : line.find('\t', first_tab + 1);
  if (second_tab == std::string_view::npos) return std::string{text};
  const std::string_view open = line.substr(0, first_tab);
  const std::string_view core = line.substr(first_tab + 1, second_tab - first_tab - 1);
  const std::string_view close = line.substr(second_tab + 1);
  levels = std::min(levels, kMaxNestingLevels);
  if (const std::size_t per_level = open.size() + close.size(); per_level > 0) {
    levels = std::min(levels, kMaxNestingBytes / per_level);
  }
  std::string nested;
  nested.reserve(levels * (open.size() + close.size()) + core.size());
  for (std::size_t level = 0; level < levels; ++level) nested += open;
  nested += core;
  for (std::size_t level = 0; level < levels; ++level) nested += close;
  const std::size_t at = rest.find("%%");
  if (at == std::string_view::npos) return std::string{rest} + nested;
  std::string expanded{rest.substr(0, at)};
  expanded += nested;
  expanded += rest.substr(at + 2);
  return expanded;
}

}  // namespace kvr::fuzz
