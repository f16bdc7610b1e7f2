#include "selection/tokenizer/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <array>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <pcre2.h>
#include <utf8proc.h>

#include "selection/tokenizer/utf8.hpp"

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

// Debian 12's PCRE2 carries older Unicode tables than utf8proc (14.0 against 15.0): characters
// assigned since are \p{Cn} to PCRE2, and a pre-tokenizer regex would cut them otherwise than
// HuggingFace's tokenizers do. Before matching, each such character is replaced by one PCRE2
// knows with the same general category and UTF-8 length: the categories are what the
// tokenizers' patterns ask for, and equal lengths keep every match offset valid in the original.
class UnicodeGaps {
 public:
  static const UnicodeGaps& instance() {
    static const UnicodeGaps gaps;
    return gaps;
  }

  /// Whether `text` has a character PCRE2 does not know; then `patched` is `text` with each
  /// replaced by its stand-in.
  bool patch(std::string_view text, std::string& patched) const {
    if (unknown_.empty()) return false;
    bool found = false;
    for (std::size_t at = 0; at < text.size();) {
      if (static_cast<unsigned char>(text[at]) < 0x80) {
        ++at;
        continue;
      }
      const std::size_t start = at;
      const std::uint32_t code_point = next_code_point(text, at);
      if (code_point >= kCodePoints || !unknown_[code_point]) continue;
      if (!found) {
        patched.assign(text);
        found = true;
      }
      std::string stand_in;
      append_utf8(stand_in, stand_in_of(code_point, at - start));
      if (stand_in.size() == at - start) patched.replace(start, at - start, stand_in);
    }
    return found;
  }

 private:
  static constexpr std::uint32_t kCodePoints = 0x110000;

  UnicodeGaps() {
    char pcre_version[64] = {};
    pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, pcre_version);
    if (std::strcmp(pcre_version, utf8proc_unicode_version()) == 0) return;
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    const std::string_view pattern = R"(^\p{Cn}$)";
    pcre2_code* unassigned =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
    if (unassigned == nullptr) return;
    pcre2_match_data* match = pcre2_match_data_create(1, nullptr);
    std::vector<bool> unknown(kCodePoints, false);
    bool any = false;
    std::string encoded;
    for (std::uint32_t code_point = 0x80; code_point < kCodePoints; ++code_point) {
      if (code_point >= 0xD800 && code_point <= 0xDFFF) continue;
      const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(code_point));
      if (category == UTF8PROC_CATEGORY_CN || category == UTF8PROC_CATEGORY_CO) continue;
      encoded.clear();
      append_utf8(encoded, code_point);
      const bool pcre_unassigned =
          pcre2_match(unassigned, reinterpret_cast<PCRE2_SPTR>(encoded.data()), encoded.size(), 0,
                      0, match, nullptr) >= 0;
      const std::size_t slot = static_cast<std::size_t>(category) * 5 + encoded.size();
      if (pcre_unassigned) {
        unknown[code_point] = true;
        any = true;
      } else if (slot < stand_ins_.size() && stand_ins_[slot] == 0) {
        stand_ins_[slot] = code_point;
      }
    }
    pcre2_match_data_free(match);
    pcre2_code_free(unassigned);
    if (any) unknown_ = std::move(unknown);
  }

  std::uint32_t stand_in_of(std::uint32_t code_point, std::size_t length) const {
    const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(code_point));
    const std::size_t slot = static_cast<std::size_t>(category) * 5 + length;
    return slot < stand_ins_.size() && stand_ins_[slot] != 0 ? stand_ins_[slot] : code_point;
  }

  std::vector<bool> unknown_;
  // The first known character of each (general category, UTF-8 length).
  std::array<std::uint32_t, 32 * 5> stand_ins_{};
};

}  // namespace

std::expected<Regex, TokenizerError> Regex::compile(std::string_view pattern) {
  // Built once per process, here at load rather than on a request's first match.
  (void)UnicodeGaps::instance();
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
  thread_local std::string patched;
  if (UnicodeGaps::instance().patch(text, patched)) text = patched;
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
