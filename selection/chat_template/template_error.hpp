// TemplateError, what a chat template's parse or render reports, and the failure the lexer, parser
// and interpreter throw inside the library (caught at ChatTemplate's boundary, never beyond it).
#pragma once

#include <exception>
#include <string>
#include <utility>

namespace kvr::chat_template {

/// Why a template failed to parse or render; line is 1-based in the template source (0 when
/// unknown).
struct TemplateError {
  std::string message;
  int line = 0;
};

namespace detail {

/// A parse or render failure on its way to the public API, which returns it as a TemplateError.
class TemplateFailure : public std::exception {
 public:
  TemplateFailure(std::string message, int line) : error_{std::move(message), line} {}

  const char* what() const noexcept override { return error_.message.c_str(); }
  /// The error, with its line (0 while not yet known).
  TemplateError& error() { return error_; }

 private:
  TemplateError error_;
};

/// Throws a TemplateFailure; line 0 lets the enclosing expression fill its own line in.
[[noreturn]] inline void fail(std::string message, int line = 0) {
  throw TemplateFailure(std::move(message), line);
}

}  // namespace detail
}  // namespace kvr::chat_template
