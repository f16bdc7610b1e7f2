#include "selection/tokenizer/request_json.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <expected>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "selection/tokenizer/utf8.hpp"

namespace kvr::tokenizer {
namespace {

using Json = nlohmann::ordered_json;

// A key in an error is cut to this many bytes: a client's key can be megabytes long.
constexpr std::size_t kMaxKeyBytes = 64;

void append_key(std::string& out, std::string_view key) {
  if (key.size() <= kMaxKeyBytes) {
    out += key;
    return;
  }
  std::size_t cut = kMaxKeyBytes;
  // Not inside a UTF-8 sequence: back to the start of the character that does not fit.
  while (cut > 0 && (static_cast<unsigned char>(key[cut]) & 0xC0U) == 0x80U) --cut;
  out += key.substr(0, cut);
  out += "…";
}

// How many steps of `path` name its field: through the fixed structure of a chat or completions
// body, down to the first value that is the client's own.
std::size_t field_steps(std::span<const JsonPathStep> path) {
  const auto key_at = [&](std::size_t i, std::string_view name) {
    return i < path.size() && !path[i].in_array && path[i].key == name;
  };
  const auto index_at = [&](std::size_t i) { return i < path.size() && path[i].in_array; };
  // A body that is not an object has no fields: it is named as a whole.
  if (path.empty() || path[0].in_array) return 0;
  std::size_t steps = 1;
  if (key_at(0, "messages") && index_at(1)) {
    // messages[i].tool_calls[j].function.<arguments, name>, messages[i].tool_calls[j].<id, ...>,
    // messages[i].<content, ...>
    steps = key_at(2, "tool_calls") && index_at(3) ? (key_at(4, "function") ? 6 : 5) : 3;
  } else if (key_at(0, "tools") && index_at(1)) {
    // tools[i].function.<parameters, ...>, tools[i].<type, ...>
    steps = key_at(2, "function") ? 4 : 3;
  } else if (key_at(0, "chat_template_kwargs")) {
    steps = 2;
  }
  return std::min(steps, path.size());
}

bool is_json_space(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

bool is_hex(char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

unsigned hex_value(std::string_view four) {
  unsigned value = 0;
  for (const char c : four) {
    value = value * 16 + static_cast<unsigned>(is_digit(c) ? c - '0'
                                               : c >= 'a'  ? c - 'a' + 10
                                                           : c - 'A' + 10);
  }
  return value;
}

// The position of the first '"', '\\' or control character at or after `at`; the size when none.
std::size_t find_string_stop(std::string_view text, std::size_t at) {
  if constexpr (std::endian::native == std::endian::little) {
    constexpr std::uint64_t kOnes = 0x0101010101010101ULL;
    constexpr std::uint64_t kHighs = 0x8080808080808080ULL;
    // Eight bytes at a time: a byte's high bit is set where it is '"' or '\\' (equal: zero after
    // the xor) or below 0x20. A borrow only marks bytes after the first marked one.
    for (; at + 8 <= text.size(); at += 8) {
      std::uint64_t chunk = 0;
      std::memcpy(&chunk, text.data() + at, sizeof chunk);
      const std::uint64_t quotes = chunk ^ (kOnes * '"');
      const std::uint64_t backslashes = chunk ^ (kOnes * '\\');
      const std::uint64_t stops =
          (((quotes - kOnes) & ~quotes) | ((backslashes - kOnes) & ~backslashes) |
           ((chunk - kOnes * 0x20) & ~chunk)) &
          kHighs;
      if (stops != 0) return at + static_cast<std::size_t>(std::countr_zero(stops)) / 8;
    }
  }
  while (at < text.size() && text[at] != '"' && text[at] != '\\' &&
         static_cast<unsigned char>(text[at]) >= 0x20) {
    ++at;
  }
  return at;
}

// The text of a string the checker has found valid (between its quotes), its escapes resolved.
std::string unescape(std::string_view raw) {
  std::string out;
  out.reserve(raw.size());
  for (std::size_t at = 0; at < raw.size();) {
    if (raw[at] != '\\') {
      out.push_back(raw[at++]);
      continue;
    }
    const char escape = raw[at + 1];
    at += 2;
    switch (escape) {
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'u': {
        unsigned code_point = hex_value(raw.substr(at, 4));
        at += 4;
        if (code_point >= 0xD800 && code_point < 0xDC00) {
          code_point =
              0x10000 + ((code_point - 0xD800) << 10) + (hex_value(raw.substr(at + 2, 4)) - 0xDC00);
          at += 6;
        }
        append_utf8(out, code_point);
        break;
      }
      default:  // '"', '\\', '/'
        out.push_back(escape);
    }
  }
  return out;
}

// One walk over a JSON text, without recursion: the first fault, if any. Each step returns
// whether the text goes on well; the first that does not leaves its fault in `fault_` (kept out
// of the steps' return values: a body of 12,000 token ids takes 40,000 steps).
class JsonCheck {
 public:
  // `max_depth` levels at most; with `into_arguments`, tool-call arguments given as strings are
  // walked too (as what they hold, nested inside the body).
  JsonCheck(std::string_view text, int max_depth, bool into_arguments)
      : text_(text), max_depth_(max_depth), into_arguments_(into_arguments) {}

  std::optional<RequestJsonFault> run() {
    if (walk()) return std::nullopt;
    return std::move(fault_);
  }

 private:
  // An object or array the walk is in, and where in it.
  struct Open {
    bool array = false;
    std::size_t index = 0;   // an array's current item
    bool in_member = false;  // an object's: its current member's key has been read
    std::string_view raw_key;
    bool escaped_key = false;
    std::string key;  // the current member's key, when it had escapes

    std::string_view current_key() const { return escaped_key ? std::string_view{key} : raw_key; }
  };

  bool walk() {
    enum class Next { value, member_or_end, item_or_end, after_value };
    Next next = Next::value;
    for (;;) {
      skip_space();
      switch (next) {
        case Next::value: {
          if (at_ == text_.size()) return invalid("a value is missing at the end of the body");
          const char c = text_[at_];
          if (c == '{' || c == '[') {
            if (std::cmp_greater_equal(open_.size(), max_depth_)) return too_deep();
            open_.push_back(Open{.array = c == '['});
            ++at_;
            next = c == '{' ? Next::member_or_end : Next::item_or_end;
            continue;
          }
          if ((c == '-' || is_digit(c)) && !open_.empty() && open_.back().array) {
            // A run of numbers in an array (token ids, say), in one loop.
            if (!numbers()) return false;
            next = Next::after_value;
            continue;
          }
          const bool read = c == '"'                  ? string_value()
                            : c == '-' || is_digit(c) ? number()
                            : literal("true") || literal("false") || literal("null")
                                ? true
                                : invalid("a value is expected");
          if (!read) return false;
          next = Next::after_value;
          continue;
        }
        case Next::member_or_end:
          if (at_ < text_.size() && text_[at_] == '}') {
            ++at_;
            open_.pop_back();
            next = Next::after_value;
            continue;
          }
          if (!member_key()) return false;
          next = Next::value;
          continue;
        case Next::item_or_end:
          if (at_ < text_.size() && text_[at_] == ']') {
            ++at_;
            open_.pop_back();
            next = Next::after_value;
            continue;
          }
          next = Next::value;
          continue;
        case Next::after_value: {
          if (open_.empty()) {
            return at_ == text_.size() || invalid("more follows the JSON value");
          }
          Open& top = open_.back();
          const char close = top.array ? ']' : '}';
          if (at_ < text_.size() && text_[at_] == close) {
            ++at_;
            open_.pop_back();
            continue;
          }
          if (at_ == text_.size() || text_[at_] != ',') {
            return invalid(top.array ? "',' or ']' is expected" : "',' or '}' is expected");
          }
          ++at_;
          if (top.array) {
            ++top.index;
            next = Next::value;
            continue;
          }
          top.in_member = false;
          skip_space();
          if (!member_key()) return false;
          next = Next::value;
          continue;
        }
      }
    }
  }

  // The loops over characters count in a local: a store through a char may alias at_, which
  // would otherwise be written back at every character.
  void skip_space() {
    std::size_t at = at_;
    while (at < text_.size() && is_json_space(text_[at])) ++at;
    at_ = at;
  }

  bool literal(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  // The path to where the walk is: each open container's current member or item.
  std::vector<JsonPathStep> path() const {
    std::vector<JsonPathStep> steps;
    for (const Open& open : open_) {
      if (open.array) {
        steps.push_back({.index = open.index, .in_array = true});
      } else if (open.in_member) {
        steps.push_back({.key = open.current_key()});
      }
    }
    return steps;
  }

  bool invalid(std::string what) {
    fault_ =
        RequestJsonFault{.what = std::move(what), .offset = at_, .field = request_field(path())};
    return false;
  }

  bool too_deep() {
    fault_ = RequestJsonFault{.too_deep = true, .offset = at_, .field = request_field(path())};
    return false;
  }

  // Reads the string at `at_` (a '"') into `raw`, its text between the quotes.
  bool string(std::string_view& raw) {
    const std::size_t begin = ++at_;
    for (;;) {
      at_ = find_string_stop(text_, at_);
      if (at_ == text_.size()) return invalid("a string is not closed");
      const char c = text_[at_];
      if (c == '"') {
        raw = text_.substr(begin, at_++ - begin);
        return true;
      }
      if (c != '\\') {
        return invalid("a control character in a string (it must be written as an escape)");
      }
      const char escape = at_ + 1 < text_.size() ? text_[at_ + 1] : '\0';
      if (escape != 'u') {
        if (escape == '\0' || std::strchr("\"\\/bfnrt", escape) == nullptr) {
          return invalid("an invalid escape in a string");
        }
        at_ += 2;
        continue;
      }
      const auto unit = [&](std::size_t escape_at) -> std::optional<unsigned> {
        if (escape_at + 6 > text_.size() || text_[escape_at] != '\\' ||
            text_[escape_at + 1] != 'u' ||
            !std::all_of(text_.begin() + static_cast<std::ptrdiff_t>(escape_at + 2),
                         text_.begin() + static_cast<std::ptrdiff_t>(escape_at + 6), is_hex)) {
          return std::nullopt;
        }
        return hex_value(text_.substr(escape_at + 2, 4));
      };
      const auto first = unit(at_);
      if (!first) return invalid("an invalid \\u escape in a string");
      if (*first >= 0xDC00 && *first <= 0xDFFF) {
        return invalid(fmt::format(
            "\\u{:04x} is a lone UTF-16 surrogate (a low surrogate must follow a high one, "
            "\\ud800 to \\udbff)",
            *first));
      }
      if (*first >= 0xD800 && *first <= 0xDBFF) {
        const auto second = unit(at_ + 6);
        if (!second || *second < 0xDC00 || *second > 0xDFFF) {
          return invalid(fmt::format(
              "\\u{:04x} is a lone UTF-16 surrogate (a high surrogate must be followed by a low "
              "one, \\udc00 to \\udfff)",
              *first));
        }
        at_ += 6;
      }
      at_ += 6;
    }
  }

  bool member_key() {
    if (at_ == text_.size() || text_[at_] != '"') return invalid("a member's key is expected");
    std::string_view raw;
    if (!string(raw)) return false;
    Open& top = open_.back();
    top.raw_key = raw;
    top.escaped_key = raw.find('\\') != std::string_view::npos;
    if (top.escaped_key) top.key = unescape(raw);
    top.in_member = true;
    skip_space();
    if (at_ == text_.size() || text_[at_] != ':') return invalid("':' is expected after a key");
    ++at_;
    return true;
  }

  // Whether the walk is at messages[i].tool_calls[j].function.arguments.
  bool at_tool_call_arguments() const {
    if (open_.size() != static_cast<std::size_t>(kToolCallArgumentsDepth)) return false;
    const auto key_is = [&](std::size_t i, std::string_view key) {
      return !open_[i].array && open_[i].in_member && open_[i].current_key() == key;
    };
    return key_is(0, "messages") && open_[1].array && key_is(2, "tool_calls") && open_[3].array &&
           key_is(4, "function") && key_is(5, "arguments");
  }

  bool string_value() {
    std::string_view raw;
    if (!string(raw)) return false;
    if (!into_arguments_ || !at_tool_call_arguments()) return true;
    // The native tokenizer parses these into objects; what is not JSON stays a string.
    const std::string arguments = unescape(raw);
    const auto inner = JsonCheck{arguments, max_depth_ - kToolCallArgumentsDepth, false}.run();
    return !(inner && inner->too_deep) || too_deep();
  }

  // Numbers one after another in an array, up to the last that a ',' and another number follow;
  // the walk is left after that last number.
  bool numbers() {
    for (;;) {
      if (!number()) return false;
      std::size_t at = at_;
      while (at < text_.size() && is_json_space(text_[at])) ++at;
      if (at == text_.size() || text_[at] != ',') return true;
      ++at;
      while (at < text_.size() && is_json_space(text_[at])) ++at;
      if (at == text_.size() || (text_[at] != '-' && !is_digit(text_[at]))) return true;
      at_ = at;
      ++open_.back().index;
    }
  }

  bool number() {
    const auto digits = [&] {
      std::size_t at = at_;
      while (at < text_.size() && is_digit(text_[at])) ++at;
      const bool any = at > at_;
      at_ = at;
      return any;
    };
    const std::size_t start = at_;
    if (text_[at_] == '-') ++at_;
    if (at_ < text_.size() && text_[at_] == '0') {
      ++at_;
    } else if (!digits()) {
      return invalid("an invalid number");
    }
    if (at_ < text_.size() && text_[at_] == '.') {
      ++at_;
      if (!digits()) return invalid("an invalid number");
    }
    if (at_ < text_.size() && (text_[at_] == 'e' || text_[at_] == 'E')) {
      ++at_;
      if (at_ < text_.size() && (text_[at_] == '+' || text_[at_] == '-')) ++at_;
      if (!digits()) return invalid("an invalid number");
    }
    // Beyond a double's range (1e400) nlohmann, which the native renderer and engine calls use,
    // refuses the body: so is it here. Only a long number or one with an exponent can be.
    const std::string_view spelled = text_.substr(start, at_ - start);
    if (spelled.size() > 300 || spelled.find_first_of("eE") != std::string_view::npos) {
      const std::string copy{spelled};
      if (!std::isfinite(std::strtod(copy.c_str(), nullptr))) {
        return invalid("a number out of range");
      }
    }
    return true;
  }

  std::string_view text_;
  int max_depth_;
  bool into_arguments_;
  std::size_t at_ = 0;
  std::vector<Open> open_;
  std::optional<RequestJsonFault> fault_;
};

}  // namespace

std::string request_field(std::span<const JsonPathStep> path) {
  std::string field;
  const std::size_t steps = field_steps(path);
  for (std::size_t i = 0; i < steps; ++i) {
    if (path[i].in_array) {
      field += fmt::format("[{}]", path[i].index);
    } else {
      if (i > 0) field.push_back('.');
      append_key(field, path[i].key);
    }
  }
  return field;
}

std::optional<RequestJsonFault> check_request_json(std::string_view body, int max_depth) {
  return JsonCheck{body, max_depth, true}.run();
}

std::string request_json_message(const RequestJsonFault& fault, int max_depth) {
  if (fault.too_deep) return nested_too_deep_message(fault.field, max_depth);
  if (fault.field.empty())
    return fmt::format("invalid JSON at byte {}: {}", fault.offset, fault.what);
  return fmt::format("invalid JSON at byte {} (in {}): {}", fault.offset, fault.field, fault.what);
}

std::optional<std::string> field_nested_too_deep(const Json& body, int max_depth) {
  if (!body.is_structured()) return std::nullopt;
  std::vector<JsonPathStep> path;
  if (max_depth < 1) return request_field(path);
  // The containers entered, each with the next of its items to look at.
  struct Open {
    const Json* node;
    Json::const_iterator next;
  };
  std::vector<Open> open;
  open.push_back({&body, body.cbegin()});
  while (!open.empty()) {
    const Json& node = *open.back().node;
    if (open.back().next == node.cend()) {
      open.pop_back();
      if (!path.empty()) path.pop_back();
      continue;
    }
    const auto item = open.back().next++;
    if (!item->is_structured()) continue;
    path.push_back(node.is_array()
                       ? JsonPathStep{.index = static_cast<std::size_t>(item - node.cbegin()),
                                      .in_array = true}
                       : JsonPathStep{.key = item.key()});
    if (std::cmp_greater_equal(open.size(), max_depth)) return request_field(path);
    open.push_back({&*item, item->cbegin()});
  }
  return std::nullopt;
}

std::string nested_too_deep_message(std::string_view field, int max_depth) {
  return fmt::format(
      "{}: nested deeper than {} levels of objects and arrays (the most a request may nest)",
      field.empty() ? "the body" : field, max_depth);
}

std::expected<void, std::string> validate_max_json_depth(int max_depth) {
  if (max_depth < 1 || max_depth > kMaxJsonDepthCeiling) {
    return std::unexpected(fmt::format("--max-json-depth: between 1 and {}", kMaxJsonDepthCeiling));
  }
  return {};
}

}  // namespace kvr::tokenizer
