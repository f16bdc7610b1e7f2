// UTF-8 text helpers for the chat-template interpreter: code points, whitespace as Python and
// JavaScript see it, and Python's str methods (strip, split, replace, find, case changes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvr::chat_template::detail {

/// The code point at `pos` of `text` and its length in bytes; a malformed byte is read as itself
/// (one byte), so that any input can be walked.
struct CodePoint {
  char32_t value = 0;
  std::size_t size = 1;
};
CodePoint decode_utf8(std::string_view text, std::size_t pos);

/// Appends `code_point` to `out` in UTF-8.
void append_utf8(std::string& out, char32_t code_point);

/// The number of code points of `text` (Python's len of a str).
std::size_t code_point_count(std::string_view text);

/// The byte offset of every code point of `text`, followed by text.size().
std::vector<std::size_t> code_point_offsets(std::string_view text);

/// Whether `text` holds only ASCII bytes (then bytes and code points coincide).
bool is_ascii(std::string_view text);

/// Whitespace as JavaScript's /\s/ sees it at `pos` (what @huggingface/jinja's whitespace control
/// strips); the number of bytes it spans, 0 when there is none.
std::size_t js_whitespace_at(std::string_view text, std::size_t pos);

/// Python's str.isspace for one code point.
bool is_python_space(char32_t code_point);

/// Python's str.strip/lstrip/rstrip: `chars` is the set of code points to remove, whitespace when
/// absent. The result is a view into `text`.
std::string_view python_strip(std::string_view text, std::optional<std::string_view> chars,
                              bool left, bool right);

/// Python's str.split(sep, maxsplit) (views into `text`); sep must not be empty.
std::vector<std::string_view> python_split(std::string_view text,
                                           std::optional<std::string_view> sep,
                                           std::int64_t maxsplit);

/// Python's str.rsplit(sep, maxsplit) (views into `text`); sep must not be empty.
std::vector<std::string_view> python_rsplit(std::string_view text,
                                            std::optional<std::string_view> sep,
                                            std::int64_t maxsplit);

/// Python's str.replace(old, new, count); a negative count replaces every occurrence.
std::string python_replace(std::string_view text, std::string_view old_text,
                           std::string_view new_text, std::int64_t count);

/// Python's str.find / str.rfind, in code points; -1 when absent.
std::int64_t python_find(std::string_view text, std::string_view sub, bool from_right);

/// Python's str.count: non-overlapping occurrences (code points + 1 for an empty `sub`).
std::int64_t python_count(std::string_view text, std::string_view sub);

/// Upper case of the ASCII letters (other code points are kept).
std::string ascii_upper(std::string_view text);
/// Lower case of the ASCII letters (other code points are kept).
std::string ascii_lower(std::string_view text);

/// Python's str.capitalize: the first character upper case, the rest lower case.
std::string python_capitalize(std::string_view text);

/// Python's str.title: upper case after a non-letter, lower case after a letter.
std::string python_title(std::string_view text);

/// Jinja2's title filter: each word (split at whitespace, '-', '(', '{', '[', '<') capitalized.
std::string jinja_title(std::string_view text);

/// Jinja2's escape filter: & < > " ' as HTML entities.
std::string html_escape(std::string_view text);

/// Jinja2's wordcount filter: the number of runs of word characters.
std::int64_t word_count(std::string_view text);

/// Python's str.islower for ASCII letters: at least one, and none upper case.
bool is_all_lower(std::string_view text);
/// Python's str.isupper for ASCII letters: at least one, and none lower case.
bool is_all_upper(std::string_view text);

}  // namespace kvr::chat_template::detail
