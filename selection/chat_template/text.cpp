// UTF-8 text helpers and Python's str methods for the chat-template interpreter.
#include "selection/chat_template/text.hpp"

#include <algorithm>

namespace kvr::chat_template::detail {
namespace {

bool is_continuation(unsigned char byte) { return (byte & 0xC0U) == 0x80U; }

bool is_ascii_letter(unsigned char byte) {
  return (byte >= 'a' && byte <= 'z') || (byte >= 'A' && byte <= 'Z');
}

char upper_char(char c) { return (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c; }
char lower_char(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

// The code points of `chars`, for strip's membership test.
std::vector<char32_t> code_points_of(std::string_view chars) {
  std::vector<char32_t> result;
  for (std::size_t pos = 0; pos < chars.size();) {
    const CodePoint cp = decode_utf8(chars, pos);
    result.push_back(cp.value);
    pos += cp.size;
  }
  return result;
}

// The start of the code point that ends right before `end`.
std::size_t previous_code_point(std::string_view text, std::size_t end) {
  std::size_t pos = end - 1;
  while (pos > 0 && is_continuation(static_cast<unsigned char>(text[pos])) && end - pos < 4) {
    --pos;
  }
  // A stray continuation byte run that does not decode to one code point is walked bytewise.
  if (decode_utf8(text, pos).size != end - pos) {
    return end - 1;
  }
  return pos;
}

}  // namespace

CodePoint decode_utf8(std::string_view text, std::size_t pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80U) {
    return {lead, 1};
  }
  std::size_t size = 0;
  char32_t value = 0;
  if ((lead & 0xE0U) == 0xC0U) {
    size = 2;
    value = lead & 0x1FU;
  } else if ((lead & 0xF0U) == 0xE0U) {
    size = 3;
    value = lead & 0x0FU;
  } else if ((lead & 0xF8U) == 0xF0U) {
    size = 4;
    value = lead & 0x07U;
  } else {
    return {lead, 1};
  }
  if (pos + size > text.size()) {
    return {lead, 1};
  }
  for (std::size_t i = 1; i < size; ++i) {
    const auto byte = static_cast<unsigned char>(text[pos + i]);
    if (!is_continuation(byte)) {
      return {lead, 1};
    }
    value = (value << 6U) | (byte & 0x3FU);
  }
  return {value, size};
}

void append_utf8(std::string& out, char32_t code_point) {
  if (code_point < 0x80U) {
    out.push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800U) {
    out.push_back(static_cast<char>(0xC0U | (code_point >> 6U)));
    out.push_back(static_cast<char>(0x80U | (code_point & 0x3FU)));
  } else if (code_point < 0x10000U) {
    out.push_back(static_cast<char>(0xE0U | (code_point >> 12U)));
    out.push_back(static_cast<char>(0x80U | ((code_point >> 6U) & 0x3FU)));
    out.push_back(static_cast<char>(0x80U | (code_point & 0x3FU)));
  } else {
    out.push_back(static_cast<char>(0xF0U | (code_point >> 18U)));
    out.push_back(static_cast<char>(0x80U | ((code_point >> 12U) & 0x3FU)));
    out.push_back(static_cast<char>(0x80U | ((code_point >> 6U) & 0x3FU)));
    out.push_back(static_cast<char>(0x80U | (code_point & 0x3FU)));
  }
}

bool is_ascii(std::string_view text) {
  return std::all_of(text.begin(), text.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80U; });
}

std::size_t code_point_count(std::string_view text) {
  std::size_t count = 0;
  for (std::size_t pos = 0; pos < text.size(); pos += decode_utf8(text, pos).size) {
    ++count;
  }
  return count;
}

std::vector<std::size_t> code_point_offsets(std::string_view text) {
  std::vector<std::size_t> offsets;
  offsets.reserve(text.size() + 1);
  for (std::size_t pos = 0; pos < text.size(); pos += decode_utf8(text, pos).size) {
    offsets.push_back(pos);
  }
  offsets.push_back(text.size());
  return offsets;
}

std::size_t js_whitespace_at(std::string_view text, std::size_t pos) {
  if (pos >= text.size()) {
    return 0;
  }
  const auto byte = static_cast<unsigned char>(text[pos]);
  if (byte < 0x80U) {
    return (byte == ' ' || (byte >= 9 && byte <= 13)) ? 1 : 0;
  }
  const CodePoint cp = decode_utf8(text, pos);
  const char32_t v = cp.value;
  const bool space = v == 0xA0 || v == 0x1680 || (v >= 0x2000 && v <= 0x200A) || v == 0x2028 ||
                     v == 0x2029 || v == 0x202F || v == 0x205F || v == 0x3000 || v == 0xFEFF;
  return space ? cp.size : 0;
}

bool is_python_space(char32_t v) {
  return (v >= 9 && v <= 13) || (v >= 0x1C && v <= 0x20) || v == 0x85 || v == 0xA0 || v == 0x1680 ||
         (v >= 0x2000 && v <= 0x200A) || v == 0x2028 || v == 0x2029 || v == 0x202F || v == 0x205F ||
         v == 0x3000;
}

std::string_view python_strip(std::string_view text, std::optional<std::string_view> chars,
                              bool left, bool right) {
  if (chars && is_ascii(*chars)) {
    // A byte outside ASCII starts a code point that cannot be in an ASCII set: bytes suffice.
    std::size_t begin = 0;
    std::size_t end = text.size();
    while (left && begin < end && chars->find(text[begin]) != std::string_view::npos) {
      ++begin;
    }
    while (right && end > begin && chars->find(text[end - 1]) != std::string_view::npos) {
      --end;
    }
    return text.substr(begin, end - begin);
  }
  std::vector<char32_t> set;
  if (chars) {
    set = code_points_of(*chars);
  }
  const auto removable = [&](char32_t v) {
    return chars ? std::find(set.begin(), set.end(), v) != set.end() : is_python_space(v);
  };
  std::size_t begin = 0;
  std::size_t end = text.size();
  if (left) {
    while (begin < end) {
      const CodePoint cp = decode_utf8(text, begin);
      if (!removable(cp.value)) {
        break;
      }
      begin += cp.size;
    }
  }
  if (right) {
    while (end > begin) {
      const std::size_t start = previous_code_point(text, end);
      if (!removable(decode_utf8(text, start).value)) {
        break;
      }
      end = start;
    }
  }
  return text.substr(begin, end - begin);
}

std::vector<std::string_view> python_split(std::string_view text,
                                           std::optional<std::string_view> sep,
                                           std::int64_t maxsplit) {
  std::vector<std::string_view> parts;
  if (sep) {
    std::size_t start = 0;
    while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
      const std::size_t found = text.find(*sep, start);
      if (found == std::string_view::npos) {
        break;
      }
      parts.push_back(text.substr(start, found - start));
      start = found + sep->size();
    }
    parts.push_back(text.substr(start));
    return parts;
  }
  std::size_t pos = 0;
  while (true) {
    while (pos < text.size()) {
      const CodePoint cp = decode_utf8(text, pos);
      if (!is_python_space(cp.value)) {
        break;
      }
      pos += cp.size;
    }
    if (pos >= text.size()) {
      break;
    }
    if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) >= maxsplit) {
      parts.push_back(text.substr(pos));
      break;
    }
    const std::size_t start = pos;
    while (pos < text.size()) {
      const CodePoint cp = decode_utf8(text, pos);
      if (is_python_space(cp.value)) {
        break;
      }
      pos += cp.size;
    }
    parts.push_back(text.substr(start, pos - start));
  }
  return parts;
}

std::vector<std::string_view> python_rsplit(std::string_view text,
                                            std::optional<std::string_view> sep,
                                            std::int64_t maxsplit) {
  std::vector<std::string_view> parts;
  if (sep) {
    std::size_t end = text.size();
    while (maxsplit < 0 || static_cast<std::int64_t>(parts.size()) < maxsplit) {
      if (end < sep->size()) {
        break;
      }
      const std::size_t found = text.rfind(*sep, end - sep->size());
      if (found == std::string_view::npos) {
        break;
      }
      parts.push_back(text.substr(found + sep->size(), end - found - sep->size()));
      end = found;
    }
    parts.push_back(text.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  std::size_t end = text.size();
  while (true) {
    while (end > 0) {
      const std::size_t start = previous_code_point(text, end);
      if (!is_python_space(decode_utf8(text, start).value)) {
        break;
      }
      end = start;
    }
    if (end == 0) {
      break;
    }
    if (maxsplit >= 0 && static_cast<std::int64_t>(parts.size()) >= maxsplit) {
      parts.push_back(text.substr(0, end));
      break;
    }
    std::size_t start = end;
    while (start > 0) {
      const std::size_t previous = previous_code_point(text, start);
      if (is_python_space(decode_utf8(text, previous).value)) {
        break;
      }
      start = previous;
    }
    parts.push_back(text.substr(start, end - start));
    end = start;
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

std::string python_replace(std::string_view text, std::string_view old_text,
                           std::string_view new_text, std::int64_t count) {
  std::string out;
  out.reserve(text.size());
  std::int64_t done = 0;
  const auto may_replace = [&] { return count < 0 || done < count; };
  if (old_text.empty()) {
    // Python inserts `new_text` before every code point and at the end.
    std::size_t pos = 0;
    while (pos < text.size()) {
      if (may_replace()) {
        out.append(new_text);
        ++done;
      }
      const std::size_t size = decode_utf8(text, pos).size;
      out.append(text.substr(pos, size));
      pos += size;
    }
    if (may_replace()) {
      out.append(new_text);
    }
    return out;
  }
  std::size_t start = 0;
  while (may_replace()) {
    const std::size_t found = text.find(old_text, start);
    if (found == std::string_view::npos) {
      break;
    }
    out.append(text.substr(start, found - start));
    out.append(new_text);
    start = found + old_text.size();
    ++done;
  }
  out.append(text.substr(start));
  return out;
}

std::int64_t python_find(std::string_view text, std::string_view sub, bool from_right) {
  const std::size_t found = from_right ? text.rfind(sub) : text.find(sub);
  if (found == std::string_view::npos) {
    return -1;
  }
  return static_cast<std::int64_t>(code_point_count(text.substr(0, found)));
}

std::int64_t python_count(std::string_view text, std::string_view sub) {
  if (sub.empty()) {
    return static_cast<std::int64_t>(code_point_count(text)) + 1;
  }
  std::int64_t count = 0;
  for (std::size_t pos = text.find(sub); pos != std::string_view::npos;
       pos = text.find(sub, pos + sub.size())) {
    ++count;
  }
  return count;
}

std::string ascii_upper(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), upper_char);
  return out;
}

std::string ascii_lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), lower_char);
  return out;
}

std::string python_capitalize(std::string_view text) {
  std::string out = ascii_lower(text);
  if (!out.empty()) {
    out[0] = upper_char(out[0]);
  }
  return out;
}

std::string python_title(std::string_view text) {
  std::string out(text);
  bool previous_cased = false;
  for (char& c : out) {
    const auto byte = static_cast<unsigned char>(c);
    if (is_ascii_letter(byte)) {
      c = previous_cased ? lower_char(c) : upper_char(c);
      previous_cased = true;
    } else {
      // Non-ASCII code points are taken as letters that have no ASCII case.
      previous_cased = byte >= 0x80U;
    }
  }
  return out;
}

std::string jinja_title(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  bool word_start = true;
  for (std::size_t pos = 0; pos < text.size();) {
    const CodePoint cp = decode_utf8(text, pos);
    const bool delimiter = cp.value == '-' || cp.value == '(' || cp.value == '{' ||
                           cp.value == '[' || cp.value == '<' || is_python_space(cp.value);
    if (delimiter) {
      out.append(text.substr(pos, cp.size));
      word_start = true;
    } else if (cp.size == 1) {
      out.push_back(word_start ? upper_char(text[pos]) : lower_char(text[pos]));
      word_start = false;
    } else {
      out.append(text.substr(pos, cp.size));
      word_start = false;
    }
    pos += cp.size;
  }
  return out;
}

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out.append("&amp;");
        break;
      case '<':
        out.append("&lt;");
        break;
      case '>':
        out.append("&gt;");
        break;
      case '"':
        out.append("&#34;");
        break;
      case '\'':
        out.append("&#39;");
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::int64_t word_count(std::string_view text) {
  std::int64_t count = 0;
  bool in_word = false;
  for (std::size_t pos = 0; pos < text.size();) {
    const CodePoint cp = decode_utf8(text, pos);
    const bool word_char = cp.value >= 0x80
                               ? !is_python_space(cp.value)
                               : (is_ascii_letter(static_cast<unsigned char>(cp.value)) ||
                                  (cp.value >= '0' && cp.value <= '9') || cp.value == '_');
    if (word_char && !in_word) {
      ++count;
    }
    in_word = word_char;
    pos += cp.size;
  }
  return count;
}

bool is_all_lower(std::string_view text) {
  bool cased = false;
  for (const char c : text) {
    if (c >= 'A' && c <= 'Z') {
      return false;
    }
    cased = cased || (c >= 'a' && c <= 'z');
  }
  return cased;
}

bool is_all_upper(std::string_view text) {
  bool cased = false;
  for (const char c : text) {
    if (c >= 'a' && c <= 'z') {
      return false;
    }
    cased = cased || (c >= 'A' && c <= 'Z');
  }
  return cased;
}

}  // namespace kvr::chat_template::detail
