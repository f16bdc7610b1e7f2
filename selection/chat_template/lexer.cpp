// The chat-template lexer: HuggingFace's whitespace rules, then tokens.
#include "selection/chat_template/lexer.hpp"

#include <cstddef>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "selection/chat_template/template_error.hpp"
#include "selection/chat_template/text.hpp"

namespace kvr::chat_template::detail {
namespace {

// Template text with the original line of each byte, so that errors name the line the author
// wrote even after the whitespace rules removed newlines.
struct Source {
  std::string text;
  std::vector<int> lines;

  void push(char c, int line) {
    text.push_back(c);
    lines.push_back(line);
  }
};

Source number_lines(std::string_view source) {
  Source result;
  result.text.reserve(source.size());
  result.lines.reserve(source.size());
  int line = 1;
  for (const char c : source) {
    result.push(c, line);
    if (c == '\n') {
      ++line;
    }
  }
  return result;
}

// Whether a JavaScript multi-line `^` matches at `pos`: the start, or after a line terminator
// (\n, \r, U+2028, U+2029).
bool at_line_start(std::string_view text, std::size_t pos) {
  if (pos == 0) {
    return true;
  }
  const char previous = text[pos - 1];
  if (previous == '\n' || previous == '\r') {
    return true;
  }
  return pos >= 3 && text.substr(pos - 3, 2) == "\xE2\x80" &&
         (text[pos - 1] == '\xA8' || text[pos - 1] == '\xA9');
}

// lstrip_blocks: spaces and tabs from a line's start up to `{%`, `{#` or `{-` are removed.
Source strip_block_indentation(const Source& in) {
  Source out;
  out.text.reserve(in.text.size());
  out.lines.reserve(in.lines.size());
  const std::string_view text = in.text;
  for (std::size_t i = 0; i < text.size();) {
    if (at_line_start(text, i)) {
      std::size_t j = i;
      while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) {
        ++j;
      }
      if (j > i && j + 1 < text.size() && text[j] == '{' &&
          (text[j + 1] == '#' || text[j + 1] == '%' || text[j + 1] == '-')) {
        i = j;
      }
    }
    out.push(text[i], in.lines[i]);
    ++i;
  }
  return out;
}

// trim_blocks: the newline right after `%}`, `#}` (or `-}`) is removed.
Source trim_block_newlines(const Source& in) {
  Source out;
  out.text.reserve(in.text.size());
  out.lines.reserve(in.lines.size());
  const std::string_view text = in.text;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n' && i >= 2 && text[i - 1] == '}' &&
        (text[i - 2] == '#' || text[i - 2] == '%' || text[i - 2] == '-')) {
      continue;
    }
    out.push(text[i], in.lines[i]);
  }
  return out;
}

std::size_t skip_js_whitespace(std::string_view text, std::size_t pos) {
  for (std::size_t size = js_whitespace_at(text, pos); size > 0;
       size = js_whitespace_at(text, pos)) {
    pos += size;
  }
  return pos;
}

// The size of the JavaScript whitespace character that ends right before `end`, 0 if none.
std::size_t js_whitespace_before(std::string_view text, std::size_t end, std::size_t floor) {
  for (std::size_t size = 1; size <= 3 && size <= end - floor; ++size) {
    if (js_whitespace_at(text, end - size) == size) {
      return size;
    }
  }
  return 0;
}

// transformers' {% generation %} / {% endgeneration %} tags (assistant-mask markers) render
// nothing; they are removed with the whitespace their `-` markers strip.
Source remove_generation_tags(const Source& in) {
  const std::string_view text = in.text;
  if (text.find("generation") == std::string_view::npos) {
    return in;
  }
  Source out;
  std::size_t copied = 0;
  const auto copy = [&](std::size_t from, std::size_t to) {
    for (std::size_t k = from; k < to; ++k) {
      out.push(text[k], in.lines[k]);
    }
  };
  for (std::size_t i = text.find("{%"); i != std::string_view::npos; i = text.find("{%", i)) {
    std::size_t k = i + 2;
    const bool strip_before = k < text.size() && text[k] == '-';
    if (strip_before) {
      ++k;
    }
    k = skip_js_whitespace(text, k);
    if (text.substr(k).starts_with("endgeneration")) {
      k += 13;
    } else if (text.substr(k).starts_with("generation")) {
      k += 10;
    } else {
      i += 2;
      continue;
    }
    k = skip_js_whitespace(text, k);
    const bool strip_after = k < text.size() && text[k] == '-';
    if (strip_after) {
      ++k;
    }
    if (!text.substr(k).starts_with("%}")) {
      i += 2;
      continue;
    }
    k += 2;
    const std::size_t after_start = k;
    const std::size_t after_end = skip_js_whitespace(text, k);
    std::size_t end = i;
    while (strip_before && end > copied) {
      const std::size_t size = js_whitespace_before(text, end, copied);
      if (size == 0) {
        break;
      }
      end -= size;
    }
    copy(copied, end);
    if (!strip_after) {
      copy(after_start, after_end);
    }
    copied = after_end;
    i = after_end;
  }
  copy(copied, text.size());
  return out;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

bool is_word(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c) || c == '_';
}

struct Symbol {
  std::string_view text;
  TokenKind kind;
};

// Longest sequences first where one is a prefix of another, as @huggingface/jinja orders them.
constexpr Symbol kSymbols[] = {
    {"{%", TokenKind::kOpenStatement},  {"%}", TokenKind::kCloseStatement},
    {"{{", TokenKind::kOpenExpression}, {"}}", TokenKind::kCloseExpression},
    {"(", TokenKind::kOpenParen},       {")", TokenKind::kCloseParen},
    {"{", TokenKind::kOpenBrace},       {"}", TokenKind::kCloseBrace},
    {"[", TokenKind::kOpenBracket},     {"]", TokenKind::kCloseBracket},
    {",", TokenKind::kComma},           {".", TokenKind::kDot},
    {":", TokenKind::kColon},           {"|", TokenKind::kPipe},
    {"<=", TokenKind::kOperator},       {">=", TokenKind::kOperator},
    {"==", TokenKind::kOperator},       {"!=", TokenKind::kOperator},
    {"<", TokenKind::kOperator},        {">", TokenKind::kOperator},
    {"+", TokenKind::kOperator},        {"-", TokenKind::kOperator},
    {"~", TokenKind::kOperator},        {"**", TokenKind::kOperator},
    {"*", TokenKind::kOperator},        {"//", TokenKind::kOperator},
    {"/", TokenKind::kOperator},        {"%", TokenKind::kOperator},
    {"=", TokenKind::kAssign},
};

int hex_value(char c) {
  if (is_digit(c)) {
    return c - '0';
  }
  if (c >= 'a' && c <= 'f') {
    return c - 'a' + 10;
  }
  if (c >= 'A' && c <= 'F') {
    return c - 'A' + 10;
  }
  return -1;
}

class Lexer {
 public:
  explicit Lexer(Source source) : source_(std::move(source)), src_(source_.text) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      step();
    }
    return std::move(tokens_);
  }

 private:
  int line_at(std::size_t pos) const {
    if (source_.lines.empty()) {
      return 1;
    }
    return source_.lines[pos < source_.lines.size() ? pos : source_.lines.size() - 1];
  }

  [[noreturn]] void fail_at(std::size_t pos, std::string message) const {
    fail(std::move(message), line_at(pos));
  }

  char at(std::size_t pos) const { return pos < src_.size() ? src_[pos] : '\0'; }

  void push(TokenKind kind, std::string text, std::size_t start) {
    tokens_.push_back(Token{kind, std::move(text), line_at(start)});
  }

  bool last_is(std::initializer_list<TokenKind> kinds) const {
    if (tokens_.empty()) {
      return false;
    }
    for (const TokenKind kind : kinds) {
      if (tokens_.back().kind == kind) {
        return true;
      }
    }
    return false;
  }

  // `{%-`, `{{-`, `{#-`: the whitespace ending the preceding text goes.
  void strip_trailing_whitespace() {
    if (tokens_.empty() || tokens_.back().kind != TokenKind::kText) {
      return;
    }
    std::string& text = tokens_.back().text;
    std::size_t end = text.size();
    for (std::size_t size = js_whitespace_before(text, end, 0); size > 0;
         size = js_whitespace_before(text, end, 0)) {
      end -= size;
    }
    text.resize(end);
    if (text.empty()) {
      tokens_.pop_back();
    }
  }

  void step() {
    const bool after_tag =
        tokens_.empty() ||
        last_is({TokenKind::kCloseStatement, TokenKind::kCloseExpression, TokenKind::kComment});
    if (after_tag) {
      std::size_t end = pos_;
      while (true) {
        end = src_.find('{', end);
        if (end == std::string_view::npos) {
          end = src_.size();
          break;
        }
        const char next = at(end + 1);
        if (next == '%' || next == '{' || next == '#') {
          break;
        }
        ++end;
      }
      if (end > pos_) {
        push(TokenKind::kText, std::string(src_.substr(pos_, end - pos_)), pos_);
        pos_ = end;
        return;
      }
    }

    if (src_[pos_] == '{') {
      const char next = at(pos_ + 1);
      if (next == '#') {
        lex_comment();
        return;
      }
      if (at(pos_ + 2) == '-' && (next == '%' || next == '{')) {
        strip_trailing_whitespace();
        push(next == '%' ? TokenKind::kOpenStatement : TokenKind::kOpenExpression,
             next == '%' ? "{%" : "{{", pos_);
        if (next == '{') {
          brace_depth_ = 0;
        }
        pos_ += 3;
        return;
      }
    }

    pos_ = skip_js_whitespace(src_, pos_);
    if (pos_ >= src_.size()) {
      fail_at(pos_, "unexpected end of template inside a tag");
    }
    const char c = src_[pos_];

    if (c == '-' && at(pos_ + 2) == '}' && (at(pos_ + 1) == '%' || at(pos_ + 1) == '}')) {
      push(at(pos_ + 1) == '%' ? TokenKind::kCloseStatement : TokenKind::kCloseExpression,
           at(pos_ + 1) == '%' ? "%}" : "}}", pos_);
      pos_ = skip_js_whitespace(src_, pos_ + 3);
      return;
    }

    if ((c == '-' || c == '+') && !after_operand()) {
      if (tokens_.empty() || last_is({TokenKind::kText})) {
        fail_at(pos_, fmt::format("unexpected character '{}'", c));
      }
      const std::size_t start = pos_++;
      std::string number = consume_digits();
      if (!number.empty() && at(pos_) == '.' && is_digit(at(pos_ + 1))) {
        ++pos_;
        number += '.';
        number += consume_digits();
      }
      if (!number.empty()) {
        number += consume_exponent();
      }
      if (number.empty()) {
        push(TokenKind::kUnary, std::string(1, c), start);
      } else {
        push(TokenKind::kNumber, std::string(1, c) + number, start);
      }
      return;
    }

    for (const Symbol& symbol : kSymbols) {
      if (symbol.text == "}}" && brace_depth_ > 0) {
        continue;
      }
      if (src_.substr(pos_).starts_with(symbol.text)) {
        push(symbol.kind, std::string(symbol.text), pos_);
        if (symbol.kind == TokenKind::kOpenExpression) {
          brace_depth_ = 0;
        } else if (symbol.kind == TokenKind::kOpenBrace) {
          ++brace_depth_;
        } else if (symbol.kind == TokenKind::kCloseBrace) {
          --brace_depth_;
        }
        pos_ += symbol.text.size();
        return;
      }
    }

    if (c == '\'' || c == '"') {
      lex_string(c);
      return;
    }
    if (is_digit(c)) {
      const std::size_t start = pos_;
      const bool after_dot = last_is({TokenKind::kDot});
      std::string number = consume_digits();
      if (!after_dot && at(pos_) == '.' && is_digit(at(pos_ + 1))) {
        ++pos_;
        number += '.';
        number += consume_digits();
      }
      if (!after_dot) {
        number += consume_exponent();
      }
      push(TokenKind::kNumber, std::move(number), start);
      return;
    }
    if (is_word(c)) {
      const std::size_t start = pos_;
      while (pos_ < src_.size() && is_word(src_[pos_])) {
        ++pos_;
      }
      push(TokenKind::kName, std::string(src_.substr(start, pos_ - start)), start);
      return;
    }
    fail_at(pos_, fmt::format("unexpected character '{}'", c));
  }

  // A `-` or `+` after these is a binary operator; anywhere else, a sign.
  bool after_operand() const {
    return last_is({TokenKind::kName, TokenKind::kNumber, TokenKind::kString,
                    TokenKind::kCloseParen, TokenKind::kCloseBracket});
  }

  std::string consume_digits() {
    const std::size_t start = pos_;
    while (pos_ < src_.size() && is_digit(src_[pos_])) {
      ++pos_;
    }
    return std::string(src_.substr(start, pos_ - start));
  }

  // A float's exponent (1e5, 2.5E-3), as Jinja2 reads it.
  std::string consume_exponent() {
    if (at(pos_) != 'e' && at(pos_) != 'E') {
      return {};
    }
    const std::size_t sign = (at(pos_ + 1) == '+' || at(pos_ + 1) == '-') ? 1 : 0;
    if (!is_digit(at(pos_ + 1 + sign))) {
      return {};
    }
    std::string exponent(src_.substr(pos_, 1 + sign));
    pos_ += 1 + sign;
    exponent += consume_digits();
    return exponent;
  }

  void lex_comment() {
    const std::size_t start = pos_;
    pos_ += 2;
    const bool strip_before = at(pos_) == '-';
    if (strip_before) {
      ++pos_;
    }
    const std::size_t end = src_.find("#}", pos_);
    if (end == std::string_view::npos) {
      fail_at(start, "unterminated comment: missing '#}'");
    }
    std::string_view comment = src_.substr(pos_, end - pos_);
    const bool strip_after = comment.ends_with('-');
    if (strip_after) {
      comment.remove_suffix(1);
    }
    if (strip_before) {
      strip_trailing_whitespace();
    }
    push(TokenKind::kComment, std::string(comment), start);
    pos_ = end + 2;
    if (strip_after) {
      pos_ = skip_js_whitespace(src_, pos_);
    }
  }

  // Escapes as in Python string literals; an unknown escape keeps its backslash, as Python does.
  void lex_string(char quote) {
    const std::size_t start = pos_++;
    std::string value;
    while (true) {
      if (pos_ >= src_.size()) {
        fail_at(start, "unterminated string literal");
      }
      const char c = src_[pos_++];
      if (c == quote) {
        break;
      }
      if (c != '\\') {
        value.push_back(c);
        continue;
      }
      if (pos_ >= src_.size()) {
        fail_at(start, "unterminated string literal");
      }
      const char escaped = src_[pos_++];
      switch (escaped) {
        case 'n':
          value.push_back('\n');
          break;
        case 't':
          value.push_back('\t');
          break;
        case 'r':
          value.push_back('\r');
          break;
        case 'b':
          value.push_back('\b');
          break;
        case 'f':
          value.push_back('\f');
          break;
        case 'v':
          value.push_back('\v');
          break;
        case 'a':
          value.push_back('\a');
          break;
        case '0':
          value.push_back('\0');
          break;
        case '\\':
        case '\'':
        case '"':
          value.push_back(escaped);
          break;
        case '\n':
          break;
        case 'x':
        case 'u':
        case 'U': {
          const std::size_t digits = escaped == 'x' ? 2 : (escaped == 'u' ? 4 : 8);
          char32_t code_point = 0;
          for (std::size_t i = 0; i < digits; ++i) {
            const int digit = hex_value(at(pos_ + i));
            if (digit < 0) {
              fail_at(pos_,
                      fmt::format("invalid escape sequence \\{} in a string literal", escaped));
            }
            code_point = code_point * 16 + static_cast<char32_t>(digit);
          }
          pos_ += digits;
          append_utf8(value, code_point);
          break;
        }
        default:
          value.push_back('\\');
          value.push_back(escaped);
      }
    }
    push(TokenKind::kString, std::move(value), start);
  }

  Source source_;
  std::string_view src_;
  std::size_t pos_ = 0;
  int brace_depth_ = 0;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  Source numbered = number_lines(source);
  // Jinja2 drops a single trailing newline (keep_trailing_newline=False).
  if (!numbered.text.empty() && numbered.text.back() == '\n') {
    numbered.text.pop_back();
    numbered.lines.pop_back();
  }
  Source processed = remove_generation_tags(trim_block_newlines(strip_block_indentation(numbered)));
  return Lexer(std::move(processed)).run();
}

}  // namespace kvr::chat_template::detail
