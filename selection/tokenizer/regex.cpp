#include "selection/tokenizer/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>

namespace kvr::tokenizer {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

namespace {

// Patterns like `\s+(?!\S)` backtrack over long whitespace runs: the JIT's default 32 KiB stack
// is too small for inputs of tens of thousands of characters. One stack per thread, grown on
// demand up to 8 MiB.
pcre2_jit_stack* thread_jit_stack() {
  struct Stack {
    pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
    ~Stack() { pcre2_jit_stack_free(stack); }
  };
  thread_local Stack stack;
  return stack.stack;
}

// A match context pointing the JIT at this thread's stack.
pcre2_match_context* thread_jit_context() {
  struct Context {
    pcre2_match_context* context = [] {
      pcre2_match_context* created = pcre2_match_context_create(nullptr);
      pcre2_jit_stack_assign(created, nullptr, thread_jit_stack());
      return created;
    }();
    ~Context() { pcre2_match_context_free(context); }
  };
  thread_local Context context;
  return context.context;
}

// Match data sized for one capture: the tokenizer needs only the whole match.
pcre2_match_data* thread_match_data() {
  struct Data {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    ~Data() { pcre2_match_data_free(data); }
  };
  thread_local Data data;
  return data.data;
}

}  // namespace

std::expected<Regex, TokenizerError> Regex::compile(std::string_view pattern) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error_code,
                                   &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof message);
    return std::unexpected(
        TokenizerError{fmt::format("regex `{}` does not compile at offset {}: {}", pattern,
                                   error_offset, reinterpret_cast<const char*>(message))});
  }
  auto compiled = std::make_shared<Code>();
  compiled->code = code;
  compiled->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return Regex{std::move(compiled)};
}

void Regex::for_each_match(std::string_view text,
                           const std::function<void(std::size_t, std::size_t)>& on_match) const {
  pcre2_match_data* match_data = thread_match_data();
  pcre2_match_context* context = code_->jit ? thread_jit_context() : nullptr;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE start = 0;
  while (start <= text.size()) {
    const int found = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), start, 0,
                                                   match_data, context)
                                 : pcre2_match(code_->code, subject, text.size(), start,
                                               PCRE2_NO_UTF_CHECK, match_data, context);
    if (found < 0) return;
    const PCRE2_SIZE* vector = pcre2_get_ovector_pointer(match_data);
    const std::size_t begin = vector[0];
    std::size_t end = vector[1];
    if (end == begin) {
      // An empty match: step over one character, as Rust's and Oniguruma's iterators do.
      if (begin >= text.size()) return;
      std::size_t next = begin + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      start = next;
      continue;
    }
    on_match(begin, end);
    start = end;
  }
}

}  // namespace kvr::tokenizer
