// The chat-template lexer: the source with HuggingFace's whitespace rules applied (trim_blocks,
// lstrip_blocks, one trailing newline dropped, {% generation %} tags removed), cut into tokens the
// way @huggingface/jinja cuts it. Used by the parser only.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kvr::chat_template::detail {

/// What a Token is.
enum class TokenKind {
  kText,             // template text between tags
  kComment,          // {# ... #}, kept so that whitespace control sees what precedes it
  kOpenStatement,    // {%
  kCloseStatement,   // %}
  kOpenExpression,   // {{
  kCloseExpression,  // }}
  kNumber,           // 12, 1.5, -3 (a sign in unary position is part of the number)
  kString,           // a string literal, escapes resolved
  kName,             // identifiers and keywords
  kOpenParen,
  kCloseParen,
  kOpenBracket,
  kCloseBracket,
  kOpenBrace,
  kCloseBrace,
  kComma,
  kDot,
  kColon,
  kPipe,
  kAssign,    // =
  kOperator,  // + - ~ * / // % ** == != < > <= >=
  kUnary,     // + or - in unary position, not followed by a number
};

/// One token: its kind, its text (a string literal's value, escapes resolved) and its line.
struct Token {
  TokenKind kind;
  std::string text;
  int line;  // 1-based line of the token's start in the original source
};

/// The tokens of `source`; throws TemplateFailure on a malformed template (unterminated
/// comment or string, unexpected character).
std::vector<Token> tokenize(std::string_view source);

}  // namespace kvr::chat_template::detail
