// The chat-template language's built-in filters, tests, methods and global functions, with
// Jinja2's and Python's semantics.
#include "selection/chat_template/builtins.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "selection/chat_template/template_error.hpp"
#include "selection/chat_template/text.hpp"

namespace kvr::chat_template::detail {
namespace {

template <typename Enum>
struct NamedEnum {
  std::string_view name;
  Enum value;
};

constexpr NamedEnum<Filter> kFilters[] = {
    {"abs", Filter::kAbs},
    {"attr", Filter::kAttr},
    {"batch", Filter::kBatch},
    {"capitalize", Filter::kCapitalize},
    {"count", Filter::kLength},
    {"d", Filter::kDefault},
    {"default", Filter::kDefault},
    {"dictsort", Filter::kDictsort},
    {"e", Filter::kEscape},
    {"escape", Filter::kEscape},
    {"first", Filter::kFirst},
    {"float", Filter::kFloat},
    {"indent", Filter::kIndent},
    {"int", Filter::kInt},
    {"items", Filter::kItems},
    {"join", Filter::kJoin},
    {"last", Filter::kLast},
    {"length", Filter::kLength},
    {"list", Filter::kList},
    {"lower", Filter::kLower},
    {"map", Filter::kMap},
    {"max", Filter::kMax},
    {"min", Filter::kMin},
    {"reject", Filter::kReject},
    {"rejectattr", Filter::kRejectattr},
    {"replace", Filter::kReplace},
    {"reverse", Filter::kReverse},
    {"round", Filter::kRound},
    {"safe", Filter::kSafe},
    {"select", Filter::kSelect},
    {"selectattr", Filter::kSelectattr},
    {"sort", Filter::kSort},
    {"string", Filter::kString},
    {"sum", Filter::kSum},
    {"title", Filter::kTitle},
    {"tojson", Filter::kTojson},
    {"trim", Filter::kTrim},
    {"unique", Filter::kUnique},
    {"upper", Filter::kUpper},
    {"wordcount", Filter::kWordcount},
};

constexpr NamedEnum<Test> kTests[] = {
    {"!=", Test::kNe},
    {"<", Test::kLt},
    {"<=", Test::kLe},
    {"==", Test::kEq},
    {">", Test::kGt},
    {">=", Test::kGe},
    {"boolean", Test::kBoolean},
    {"callable", Test::kCallable},
    {"defined", Test::kDefined},
    {"divisibleby", Test::kDivisibleby},
    {"eq", Test::kEq},
    {"equalto", Test::kEq},
    {"even", Test::kEven},
    {"false", Test::kFalse},
    {"float", Test::kFloat},
    {"ge", Test::kGe},
    {"greaterthan", Test::kGt},
    {"gt", Test::kGt},
    {"in", Test::kIn},
    {"integer", Test::kInteger},
    {"iterable", Test::kIterable},
    {"le", Test::kLe},
    {"lessthan", Test::kLt},
    {"lower", Test::kLower},
    {"lt", Test::kLt},
    {"mapping", Test::kMapping},
    {"ne", Test::kNe},
    {"none", Test::kNone},
    {"number", Test::kNumber},
    {"odd", Test::kOdd},
    {"sameas", Test::kSameas},
    {"sequence", Test::kSequence},
    {"string", Test::kString},
    {"true", Test::kTrue},
    {"undefined", Test::kUndefined},
    {"upper", Test::kUpper},
};

constexpr NamedEnum<Method> kMethods[] = {
    {"append", Method::kAppend},
    {"capitalize", Method::kCapitalize},
    {"count", Method::kCount},
    {"cycle", Method::kCycle},
    {"endswith", Method::kEndswith},
    {"find", Method::kFind},
    {"format", Method::kFormat},
    {"get", Method::kGet},
    {"isalnum", Method::kIsalnum},
    {"isalpha", Method::kIsalpha},
    {"isdigit", Method::kIsdigit},
    {"islower", Method::kIslower},
    {"isspace", Method::kIsspace},
    {"isupper", Method::kIsupper},
    {"items", Method::kItems},
    {"join", Method::kJoin},
    {"keys", Method::kKeys},
    {"lower", Method::kLower},
    {"lstrip", Method::kLstrip},
    {"replace", Method::kReplace},
    {"rfind", Method::kRfind},
    {"rsplit", Method::kRsplit},
    {"rstrip", Method::kRstrip},
    {"split", Method::kSplit},
    {"splitlines", Method::kSplitlines},
    {"startswith", Method::kStartswith},
    {"strip", Method::kStrip},
    {"title", Method::kTitle},
    {"upper", Method::kUpper},
    {"values", Method::kValues},
};

template <typename Enum, std::size_t N>
std::optional<Enum> find_named(const NamedEnum<Enum> (&table)[N], std::string_view name) {
  for (const auto& entry : table) {
    if (entry.name == name) {
      return entry.value;
    }
  }
  return std::nullopt;
}

bool is_absent(const Value* value) {
  return value == nullptr || value->is_none() || value->is_undefined();
}

std::string_view require_string(const Value& value, std::string_view what) {
  if (!value.is_string()) {
    fail(fmt::format("{} must be a string, not '{}'", what, type_name(value)));
  }
  return value.as_string();
}

std::int64_t require_int(const Value& value, std::string_view what) {
  if (value.is_int()) {
    return value.as_int();
  }
  if (value.kind() == Value::Kind::kBool) {
    return value.as_bool() ? 1 : 0;
  }
  fail(fmt::format("{} must be an integer, not '{}'", what, type_name(value)));
}

bool flag(const Value* value, bool fallback) { return value ? truthy(*value) : fallback; }

// The string an undefined value stands for in string filters (Jinja2's soft_str).
std::string_view text_of(const Value& value, std::string& storage) {
  if (value.is_string()) {
    return value.as_string();
  }
  storage = to_string(value);
  return storage;
}

Value loop_attribute(const LoopData& loop, std::string_view name) {
  const auto length = static_cast<std::int64_t>(loop.items->size());
  const std::int64_t i = loop.index0;
  if (name == "index") {
    return Value::integer(i + 1);
  }
  if (name == "index0") {
    return Value::integer(i);
  }
  if (name == "revindex") {
    return Value::integer(length - i);
  }
  if (name == "revindex0") {
    return Value::integer(length - i - 1);
  }
  if (name == "first") {
    return Value::boolean(i == 0);
  }
  if (name == "last") {
    return Value::boolean(i == length - 1);
  }
  if (name == "length") {
    return Value::integer(length);
  }
  if (name == "previtem") {
    return i > 0 ? (*loop.items)[static_cast<std::size_t>(i - 1)] : Value();
  }
  if (name == "nextitem") {
    return i + 1 < length ? (*loop.items)[static_cast<std::size_t>(i + 1)] : Value();
  }
  if (name == "depth") {
    return Value::integer(1);
  }
  if (name == "depth0") {
    return Value::integer(0);
  }
  return Value();
}

// Jinja2's attribute paths ("a.b", "items.0") for map, selectattr, sort, ...
Value get_path(const Value& item, std::string_view path) {
  Value current = item;
  while (true) {
    const std::size_t dot = path.find('.');
    const std::string_view part = path.substr(0, dot);
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) {
      std::int64_t index = 0;
      std::from_chars(part.data(), part.data() + part.size(), index);
      current = get_item(current, Value::integer(index));
    } else {
      current = get_item(current, Value::borrowed_string(part));
    }
    if (dot == std::string_view::npos) {
      return current;
    }
    path.remove_prefix(dot + 1);
  }
}

// Python's slice.indices: the positions a [start:stop:step] slice of `length` items takes.
std::vector<std::int64_t> slice_positions(std::size_t size, const Value& start_value,
                                          const Value& stop_value, const Value& step_value) {
  const auto length = static_cast<std::int64_t>(size);
  const auto bound = [](const Value& value, std::string_view what) -> std::optional<std::int64_t> {
    if (is_absent(&value)) {
      return std::nullopt;
    }
    return require_int(value, what);
  };
  const std::int64_t step = bound(step_value, "slice step").value_or(1);
  if (step == 0) {
    fail("slice step cannot be zero");
  }
  const auto adjust = [&](std::optional<std::int64_t> given, bool is_start) {
    if (!given) {
      if (step > 0) {
        return is_start ? std::int64_t{0} : length;
      }
      return is_start ? length - 1 : std::int64_t{-1};
    }
    std::int64_t value = *given;
    if (value < 0) {
      value += length;
      if (value < 0) {
        value = step < 0 ? -1 : 0;
      }
    } else if (value >= length) {
      value = step < 0 ? length - 1 : length;
    }
    return value;
  };
  const std::int64_t start = adjust(bound(start_value, "slice start"), true);
  const std::int64_t stop = adjust(bound(stop_value, "slice stop"), false);
  std::vector<std::int64_t> positions;
  for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    positions.push_back(i);
  }
  return positions;
}

Value string_slice(const Value& value, const Value& start, const Value& stop, const Value& step) {
  const std::string_view text = value.as_string();
  if (is_ascii(text)) {
    const auto positions = slice_positions(text.size(), start, stop, step);
    if (!positions.empty() && (is_absent(&step) || require_int(step, "slice step") == 1)) {
      return Value::substring(
          value, text.substr(static_cast<std::size_t>(positions.front()), positions.size()));
    }
    std::string out;
    out.reserve(positions.size());
    for (const std::int64_t i : positions) {
      out.push_back(text[static_cast<std::size_t>(i)]);
    }
    return Value::owned_string(std::move(out));
  }
  const std::vector<std::size_t> offsets = code_point_offsets(text);
  const auto positions = slice_positions(offsets.size() - 1, start, stop, step);
  std::string out;
  for (const std::int64_t i : positions) {
    const auto index = static_cast<std::size_t>(i);
    out.append(text.substr(offsets[index], offsets[index + 1] - offsets[index]));
  }
  return Value::owned_string(std::move(out));
}

// The characters of a string as string values.
std::vector<Value> characters(const Value& value) { return iterate(value); }

// The items of an iterable (undefined: none).
std::vector<Value> items_of(const Value& value) { return iterate(value); }

Value lowered_for_sort(const Value& value, bool case_sensitive) {
  if (!case_sensitive && value.is_string()) {
    return Value::owned_string(ascii_lower(value.as_string()));
  }
  return value;
}

// Items sorted by Python's ordering of key(item), stably.
template <typename Key>
std::vector<Value> sorted(std::vector<Value> items, bool reverse, Key&& key) {
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  for (Value& item : items) {
    Value k = key(item);
    keyed.emplace_back(std::move(k), std::move(item));
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? compare(b.first, a.first) < 0 : compare(a.first, b.first) < 0;
  });
  std::vector<Value> result;
  result.reserve(keyed.size());
  for (auto& [k, item] : keyed) {
    result.push_back(std::move(item));
  }
  return result;
}

Value make_pair(Value first, Value second) {
  std::vector<Value> pair;
  pair.reserve(2);
  pair.push_back(std::move(first));
  pair.push_back(std::move(second));
  return Value::array(std::move(pair));
}

std::vector<Value> mapping_items(const Value& value) {
  std::vector<Value> items;
  items.reserve(mapping_size(value));
  for_each_entry(
      value, [&](const Value& key, const Value& item) { items.push_back(make_pair(key, item)); });
  return items;
}

std::optional<std::int64_t> parse_python_int(std::string_view text, int base) {
  text = python_strip(text, std::nullopt, true, true);
  std::string digits;
  for (std::size_t i = 0; i < text.size(); ++i) {
    // Python allows single underscores between digits.
    if (text[i] == '_' && i > 0 && i + 1 < text.size() && text[i - 1] != '_') {
      continue;
    }
    digits.push_back(text[i]);
  }
  std::string_view view = digits;
  bool negative = false;
  if (!view.empty() && (view[0] == '+' || view[0] == '-')) {
    negative = view[0] == '-';
    view.remove_prefix(1);
  }
  if (view.empty()) {
    return std::nullopt;
  }
  std::int64_t value = 0;
  const auto result = std::from_chars(view.data(), view.data() + view.size(), value, base);
  if (result.ec != std::errc() || result.ptr != view.data() + view.size()) {
    return std::nullopt;
  }
  return negative ? -value : value;
}

std::optional<double> parse_python_float(std::string_view text) {
  const std::string trimmed(python_strip(text, std::nullopt, true, true));
  if (trimmed.empty()) {
    return std::nullopt;
  }
  char* end = nullptr;
  const double value = std::strtod(trimmed.c_str(), &end);
  if (end != trimmed.c_str() + trimmed.size()) {
    return std::nullopt;
  }
  return value;
}

Value filter_int(const Value& operand, const CallArgs& args) {
  const Value* fallback = args.get(0, "default");
  const Value* base_value = args.get(1, "base");
  const int base = base_value ? static_cast<int>(require_int(*base_value, "base")) : 10;
  switch (operand.kind()) {
    case Value::Kind::kInt:
      return operand;
    case Value::Kind::kBool:
      return Value::integer(operand.as_bool() ? 1 : 0);
    case Value::Kind::kFloat:
      if (std::isfinite(operand.as_float())) {
        return Value::integer(static_cast<std::int64_t>(std::trunc(operand.as_float())));
      }
      break;
    case Value::Kind::kString: {
      if (const auto parsed = parse_python_int(operand.as_string(), base)) {
        return Value::integer(*parsed);
      }
      if (const auto parsed = parse_python_float(operand.as_string());
          parsed && std::isfinite(*parsed)) {
        return Value::integer(static_cast<std::int64_t>(std::trunc(*parsed)));
      }
      break;
    }
    default:
      break;
  }
  return fallback ? *fallback : Value::integer(0);
}

Value filter_float(const Value& operand, const CallArgs& args) {
  const Value* fallback = args.get(0, "default");
  if (operand.is_number()) {
    return Value::floating(operand.as_number());
  }
  if (operand.is_string()) {
    if (const auto parsed = parse_python_float(operand.as_string())) {
      return Value::floating(*parsed);
    }
  }
  return fallback ? *fallback : Value::floating(0.0);
}

Value filter_round(const Value& operand, const CallArgs& args) {
  const Value* precision_value = args.get(0, "precision");
  const Value* method_value = args.get(1, "method");
  const std::int64_t precision = precision_value ? require_int(*precision_value, "precision") : 0;
  const std::string_view method =
      method_value ? require_string(*method_value, "method") : std::string_view("common");
  if (!operand.is_number()) {
    fail(fmt::format("round() of '{}'", type_name(operand)));
  }
  if (method == "common") {
    if (operand.is_int() || operand.kind() == Value::Kind::kBool) {
      return Value::integer(static_cast<std::int64_t>(operand.as_number()));
    }
    // printf rounds the exact binary value half to even, as Python's round does.
    const int digits = static_cast<int>(std::clamp<std::int64_t>(precision, 0, 300));
    char buffer[400];
    std::snprintf(buffer, sizeof(buffer), "%.*f", digits, operand.as_float());
    double rounded = std::strtod(buffer, nullptr);
    if (precision < 0) {
      const double scale = std::pow(10.0, static_cast<double>(-precision));
      rounded = std::nearbyint(operand.as_float() / scale) * scale;
    }
    return Value::floating(rounded);
  }
  if (method != "ceil" && method != "floor") {
    fail("method must be 'common', 'ceil' or 'floor'");
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double scaled = operand.as_number() * scale;
  return Value::floating((method == "ceil" ? std::ceil(scaled) : std::floor(scaled)) / scale);
}

Value filter_tojson(const Value& operand, const CallArgs& args) {
  // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
  JsonFormat format;
  format.ensure_ascii = flag(args.get(0, "ensure_ascii"), false);
  const Value* indent = args.get(1, "indent");
  if (!is_absent(indent)) {
    format.indented = true;
    if (indent->is_string()) {
      format.indent = std::string(indent->as_string());
    } else {
      const std::int64_t width = require_int(*indent, "indent");
      format.indent = std::string(static_cast<std::size_t>(std::max<std::int64_t>(width, 0)), ' ');
    }
    format.item_separator = ",";
  }
  const Value* separators = args.get(2, "separators");
  if (!is_absent(separators)) {
    if (!separators->is_sequence() || sequence_size(*separators) != 2) {
      fail("separators must be a pair of strings");
    }
    format.item_separator = require_string(sequence_at(*separators, 0), "separator");
    format.key_separator = require_string(sequence_at(*separators, 1), "separator");
  }
  format.sort_keys = flag(args.get(3, "sort_keys"), false);
  std::string out;
  append_json(out, operand, format);
  return Value::owned_string(std::move(out));
}

// Jinja2's indent filter, lines split as Python's splitlines does for \n, \r\n and \r.
Value filter_indent(const Value& operand, const CallArgs& args) {
  const Value* width = args.get(0, "width");
  std::string indention = "    ";
  if (width) {
    if (width->is_string()) {
      indention = std::string(width->as_string());
    } else {
      indention.assign(
          static_cast<std::size_t>(std::max<std::int64_t>(require_int(*width, "width"), 0)), ' ');
    }
  }
  const bool first = flag(args.get(1, "first"), false);
  const bool blank = flag(args.get(2, "blank"), false);
  std::string storage;
  std::string text(text_of(operand, storage));
  text.push_back('\n');
  std::vector<std::string_view> lines;
  const std::string_view view = text;
  std::size_t start = 0;
  for (std::size_t i = 0; i < view.size(); ++i) {
    if (view[i] == '\n' || view[i] == '\r') {
      lines.push_back(view.substr(start, i - start));
      if (view[i] == '\r' && i + 1 < view.size() && view[i + 1] == '\n') {
        ++i;
      }
      start = i + 1;
    }
  }
  if (start < view.size()) {
    lines.push_back(view.substr(start));
  }
  std::string out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      out.push_back('\n');
      if (blank || !lines[i].empty()) {
        out.append(indention);
      }
    }
    out.append(lines[i]);
  }
  if (first) {
    out.insert(0, indention);
  }
  return Value::owned_string(std::move(out));
}

// select/reject/selectattr/rejectattr: items whose (attribute's) test passes (fails).
Value filter_select(const Value& operand, const CallArgs& args, bool by_attribute, bool keep) {
  std::size_t next = 0;
  std::string_view attribute;
  if (by_attribute) {
    if (args.positional.empty()) {
      fail("selectattr/rejectattr need an attribute");
    }
    attribute = require_string(args.positional[0], "attribute");
    next = 1;
  }
  std::optional<Test> test;
  CallArgs test_args;
  if (args.positional.size() > next) {
    const std::string_view name = require_string(args.positional[next], "test name");
    test = find_test(name);
    if (!test) {
      fail(fmt::format("unknown test '{}'", name));
    }
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next + 1),
                                args.positional.end());
    test_args.keywords = args.keywords;
  }
  std::vector<Value> result;
  for (Value& item : items_of(operand)) {
    const Value subject = by_attribute ? get_path(item, attribute) : item;
    const bool passed = test ? apply_test(*test, subject, test_args) : truthy(subject);
    if (passed == keep) {
      result.push_back(std::move(item));
    }
  }
  return Value::array(std::move(result));
}

Value filter_map(const Value& operand, const CallArgs& args) {
  std::vector<Value> result;
  if (const Value* attribute = args.get(std::string_view::npos, "attribute")) {
    const std::string_view path = require_string(*attribute, "attribute");
    const Value* fallback = args.get(std::string_view::npos, "default");
    for (const Value& item : items_of(operand)) {
      Value mapped = get_path(item, path);
      result.push_back(mapped.is_undefined() && fallback ? *fallback : std::move(mapped));
    }
    return Value::array(std::move(result));
  }
  if (args.positional.empty()) {
    fail("map needs a filter name or attribute=");
  }
  const std::string_view name = require_string(args.positional[0], "filter name");
  const auto filter = find_filter(name);
  if (!filter) {
    fail(fmt::format("unknown filter '{}'", name));
  }
  CallArgs filter_args;
  filter_args.positional.assign(args.positional.begin() + 1, args.positional.end());
  filter_args.keywords = args.keywords;
  for (const Value& item : items_of(operand)) {
    result.push_back(apply_filter(*filter, item, filter_args));
  }
  return Value::array(std::move(result));
}

Value filter_join(const Value& operand, const CallArgs& args) {
  const Value* separator = args.get(0, "d");
  const Value* attribute = args.get(1, "attribute");
  const std::string_view sep = separator ? require_string(*separator, "separator") : "";
  std::string out;
  bool first = true;
  for (const Value& item : items_of(operand)) {
    if (!first) {
      out.append(sep);
    }
    first = false;
    append_string(out, attribute ? get_path(item, require_string(*attribute, "attribute")) : item);
  }
  return Value::owned_string(std::move(out));
}

Value filter_sort(const Value& operand, const CallArgs& args) {
  const bool reverse = flag(args.get(0, "reverse"), false);
  const bool case_sensitive = flag(args.get(1, "case_sensitive"), false);
  const Value* attribute = args.get(2, "attribute");
  std::string_view path;
  if (attribute) {
    path = require_string(*attribute, "attribute");
  }
  return Value::array(sorted(items_of(operand), reverse, [&](const Value& item) {
    return lowered_for_sort(attribute ? get_path(item, path) : item, case_sensitive);
  }));
}

Value filter_dictsort(const Value& operand, const CallArgs& args) {
  if (!operand.is_mapping()) {
    fail(fmt::format("dictsort needs a dict, not '{}'", type_name(operand)));
  }
  const bool case_sensitive = flag(args.get(0, "case_sensitive"), false);
  const Value* by = args.get(1, "by");
  const std::string_view by_name = by ? require_string(*by, "by") : "key";
  if (by_name != "key" && by_name != "value") {
    fail("You can only sort by either 'key' or 'value'");
  }
  const bool reverse = flag(args.get(2, "reverse"), false);
  const std::size_t position = by_name == "key" ? 0 : 1;
  return Value::array(sorted(mapping_items(operand), reverse, [&](const Value& pair) {
    return lowered_for_sort(sequence_at(pair, position), case_sensitive);
  }));
}

Value filter_unique(const Value& operand, const CallArgs& args) {
  const bool case_sensitive = flag(args.get(0, "case_sensitive"), false);
  const Value* attribute = args.get(1, "attribute");
  std::vector<Value> seen;
  std::vector<Value> result;
  for (Value& item : items_of(operand)) {
    Value key = lowered_for_sort(
        attribute ? get_path(item, require_string(*attribute, "attribute")) : item, case_sensitive);
    const bool duplicate = std::any_of(seen.begin(), seen.end(),
                                       [&](const Value& other) { return equals(other, key); });
    if (!duplicate) {
      seen.push_back(std::move(key));
      result.push_back(std::move(item));
    }
  }
  return Value::array(std::move(result));
}

Value filter_extreme(const Value& operand, const CallArgs& args, bool maximum) {
  const bool case_sensitive = flag(args.get(0, "case_sensitive"), false);
  const Value* attribute = args.get(1, "attribute");
  std::optional<Value> best;
  Value best_key;
  for (Value& item : items_of(operand)) {
    Value key = lowered_for_sort(
        attribute ? get_path(item, require_string(*attribute, "attribute")) : item, case_sensitive);
    if (!best || (maximum ? compare(key, best_key) > 0 : compare(key, best_key) < 0)) {
      best = std::move(item);
      best_key = std::move(key);
    }
  }
  return best ? *best : Value();
}

Value add_numbers(const Value& a, const Value& b) {
  if ((a.is_int() || a.kind() == Value::Kind::kBool) &&
      (b.is_int() || b.kind() == Value::Kind::kBool)) {
    return Value::integer(static_cast<std::int64_t>(a.as_number()) +
                          static_cast<std::int64_t>(b.as_number()));
  }
  return Value::floating(a.as_number() + b.as_number());
}

Value filter_sum(const Value& operand, const CallArgs& args) {
  const Value* attribute = args.get(0, "attribute");
  const Value* start = args.get(1, "start");
  Value total = start ? *start : Value::integer(0);
  for (const Value& item : items_of(operand)) {
    const Value term = attribute ? get_path(item, require_string(*attribute, "attribute")) : item;
    if (!term.is_number() || !total.is_number()) {
      fail(fmt::format("unsupported operand type(s) for +: '{}' and '{}'", type_name(total),
                       type_name(term)));
    }
    total = add_numbers(total, term);
  }
  return total;
}

Value filter_batch(const Value& operand, const CallArgs& args) {
  const Value* count_value = args.get(0, "linecount");
  if (!count_value) {
    fail("batch needs a line count");
  }
  const std::int64_t count = require_int(*count_value, "linecount");
  if (count <= 0) {
    fail("batch line count must be positive");
  }
  const Value* fill = args.get(1, "fill_with");
  std::vector<Value> batches;
  std::vector<Value> current;
  for (Value& item : items_of(operand)) {
    if (static_cast<std::int64_t>(current.size()) == count) {
      batches.push_back(Value::array(std::move(current)));
      current.clear();
    }
    current.push_back(std::move(item));
  }
  if (!current.empty()) {
    if (!is_absent(fill)) {
      while (static_cast<std::int64_t>(current.size()) < count) {
        current.push_back(*fill);
      }
    }
    batches.push_back(Value::array(std::move(current)));
  }
  return Value::array(std::move(batches));
}

Value filter_length(const Value& operand) {
  if (operand.is_string()) {
    return Value::integer(static_cast<std::int64_t>(code_point_count(operand.as_string())));
  }
  if (operand.is_sequence()) {
    return Value::integer(static_cast<std::int64_t>(sequence_size(operand)));
  }
  if (operand.is_mapping() || operand.kind() == Value::Kind::kNamespace) {
    return Value::integer(static_cast<std::int64_t>(mapping_size(operand)));
  }
  if (operand.is_undefined()) {
    return Value::integer(0);
  }
  fail(fmt::format("object of type '{}' has no len()", type_name(operand)));
}

Value filter_first_or_last(const Value& operand, bool first) {
  if (operand.is_sequence()) {
    const std::size_t size = sequence_size(operand);
    if (size == 0) {
      return Value();
    }
    return sequence_at(operand, first ? 0 : size - 1);
  }
  std::vector<Value> items = items_of(operand);
  if (items.empty()) {
    return Value();
  }
  return first ? items.front() : items.back();
}

Value filter_reverse(const Value& operand) {
  if (operand.is_string()) {
    std::vector<Value> chars = characters(operand);
    std::string out;
    out.reserve(operand.as_string().size());
    for (auto it = chars.rbegin(); it != chars.rend(); ++it) {
      out.append(it->as_string());
    }
    return Value::owned_string(std::move(out));
  }
  std::vector<Value> items = items_of(operand);
  std::reverse(items.begin(), items.end());
  return Value::array(std::move(items));
}

Value filter_abs(const Value& operand) {
  switch (operand.kind()) {
    case Value::Kind::kInt:
      return Value::integer(operand.as_int() < 0 ? -operand.as_int() : operand.as_int());
    case Value::Kind::kBool:
      return Value::integer(operand.as_bool() ? 1 : 0);
    case Value::Kind::kFloat:
      return Value::floating(std::fabs(operand.as_float()));
    default:
      fail(fmt::format("bad operand type for abs(): '{}'", type_name(operand)));
  }
}

Value filter_default(const Value& operand, const CallArgs& args) {
  const Value* fallback = args.get(0, "default_value");
  const bool boolean = flag(args.get(1, "boolean"), false);
  if (operand.is_undefined() || (boolean && !truthy(operand))) {
    return fallback ? *fallback : Value::borrowed_string("");
  }
  return operand;
}

Value string_result(std::string text) { return Value::owned_string(std::move(text)); }

bool starts_or_ends_with(const Value& object, const CallArgs& args, bool start) {
  const std::string_view text = object.as_string();
  if (args.positional.empty()) {
    fail(start ? "startswith() takes at least 1 argument" : "endswith() takes at least 1 argument");
  }
  const Value& pattern = args.positional[0];
  const auto matches = [&](std::string_view affix) {
    return start ? text.starts_with(affix) : text.ends_with(affix);
  };
  if (pattern.is_string()) {
    return matches(pattern.as_string());
  }
  if (pattern.is_sequence()) {
    for (const Value& item : items_of(pattern)) {
      if (matches(require_string(item, "affix"))) {
        return true;
      }
    }
    return false;
  }
  fail("startswith/endswith argument must be a string or a tuple of strings");
}

std::optional<std::string_view> optional_chars(const CallArgs& args) {
  const Value* chars = args.get(0, "chars");
  if (is_absent(chars)) {
    return std::nullopt;
  }
  return require_string(*chars, "chars");
}

Value split_method(const Value& object, const CallArgs& args, bool from_right) {
  const Value* sep_value = args.get(0, "sep");
  const Value* max_value = args.get(1, "maxsplit");
  std::optional<std::string_view> sep;
  if (!is_absent(sep_value)) {
    sep = require_string(*sep_value, "sep");
    if (sep->empty()) {
      fail("empty separator");
    }
  }
  const std::int64_t maxsplit = max_value ? require_int(*max_value, "maxsplit") : -1;
  const std::string_view text = object.as_string();
  const auto parts =
      from_right ? python_rsplit(text, sep, maxsplit) : python_split(text, sep, maxsplit);
  std::vector<Value> values;
  values.reserve(parts.size());
  for (const std::string_view part : parts) {
    values.push_back(Value::substring(object, part));
  }
  return Value::array(std::move(values));
}

// Python's str.format with plain fields: {}, {0}, {name}; no conversions or format specs.
Value format_method(std::string_view pattern, const CallArgs& args) {
  std::string out;
  std::size_t auto_index = 0;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '{') {
      if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
        out.push_back('{');
        ++i;
        continue;
      }
      const std::size_t close = pattern.find('}', i);
      if (close == std::string_view::npos) {
        fail("Single '{' encountered in format string");
      }
      const std::string_view field = pattern.substr(i + 1, close - i - 1);
      if (field.find_first_of("!:[.") != std::string_view::npos) {
        fail(fmt::format("unsupported format field '{{{}}}'", field));
      }
      const Value* value = nullptr;
      if (field.empty() || (field[0] >= '0' && field[0] <= '9')) {
        std::size_t index = auto_index++;
        if (!field.empty()) {
          std::from_chars(field.data(), field.data() + field.size(), index);
        }
        if (index >= args.positional.size()) {
          fail("Replacement index out of range for positional args tuple");
        }
        value = &args.positional[index];
      } else {
        value = args.get(std::string_view::npos, field);
        if (!value) {
          fail(fmt::format("KeyError: '{}'", field));
        }
      }
      append_string(out, *value);
      i = close;
    } else if (c == '}') {
      if (i + 1 < pattern.size() && pattern[i + 1] == '}') {
        ++i;
      } else {
        fail("Single '}' encountered in format string");
      }
      out.push_back('}');
    } else {
      out.push_back(c);
    }
  }
  return string_result(std::move(out));
}

template <typename Predicate>
bool all_code_points(std::string_view text, Predicate&& predicate) {
  if (text.empty()) {
    return false;
  }
  for (std::size_t pos = 0; pos < text.size();) {
    const CodePoint cp = decode_utf8(text, pos);
    if (!predicate(cp.value)) {
      return false;
    }
    pos += cp.size;
  }
  return true;
}

bool is_letter(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80; }
bool is_digit_char(char32_t c) { return c >= '0' && c <= '9'; }

std::vector<Value> split_lines(const Value& object) {
  const std::string_view text = object.as_string();
  std::vector<Value> lines;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\n' || text[i] == '\r') {
      lines.push_back(Value::substring(object, text.substr(start, i - start)));
      if (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') {
        ++i;
      }
      start = i + 1;
    }
  }
  if (start < text.size()) {
    lines.push_back(Value::substring(object, text.substr(start)));
  }
  return lines;
}

Value string_method(const Value& object, Method method, std::string_view name,
                    const CallArgs& args) {
  const std::string_view text = object.as_string();
  switch (method) {
    case Method::kStartswith:
      return Value::boolean(starts_or_ends_with(object, args, true));
    case Method::kEndswith:
      return Value::boolean(starts_or_ends_with(object, args, false));
    case Method::kStrip:
      return Value::substring(object, python_strip(text, optional_chars(args), true, true));
    case Method::kLstrip:
      return Value::substring(object, python_strip(text, optional_chars(args), true, false));
    case Method::kRstrip:
      return Value::substring(object, python_strip(text, optional_chars(args), false, true));
    case Method::kSplit:
      return split_method(object, args, false);
    case Method::kRsplit:
      return split_method(object, args, true);
    case Method::kSplitlines:
      return Value::array(split_lines(object));
    case Method::kReplace: {
      const Value* old_text = args.get(0, "old");
      const Value* new_text = args.get(1, "new");
      if (!old_text || !new_text) {
        fail("replace() takes at least 2 arguments");
      }
      const Value* count = args.get(2, "count");
      return string_result(python_replace(text, require_string(*old_text, "old"),
                                          require_string(*new_text, "new"),
                                          is_absent(count) ? -1 : require_int(*count, "count")));
    }
    case Method::kUpper:
      return string_result(ascii_upper(text));
    case Method::kLower:
      return string_result(ascii_lower(text));
    case Method::kTitle:
      return string_result(python_title(text));
    case Method::kCapitalize:
      return string_result(python_capitalize(text));
    case Method::kFind:
    case Method::kRfind:
    case Method::kCount: {
      const Value* sub = args.get(0, "sub");
      if (!sub) {
        fail(fmt::format("{}() takes at least 1 argument", name));
      }
      const std::string_view needle = require_string(*sub, "sub");
      return Value::integer(method == Method::kCount
                                ? python_count(text, needle)
                                : python_find(text, needle, method == Method::kRfind));
    }
    case Method::kFormat:
      return format_method(text, args);
    case Method::kJoin: {
      if (args.positional.empty()) {
        fail("join() takes exactly one argument");
      }
      std::string out;
      bool first = true;
      for (const Value& item : items_of(args.positional[0])) {
        if (!first) {
          out.append(text);
        }
        first = false;
        append_string(out, item);
      }
      return string_result(std::move(out));
    }
    case Method::kIsdigit:
      return Value::boolean(all_code_points(text, is_digit_char));
    case Method::kIsalpha:
      return Value::boolean(all_code_points(text, is_letter));
    case Method::kIsalnum:
      return Value::boolean(
          all_code_points(text, [](char32_t c) { return is_letter(c) || is_digit_char(c); }));
    case Method::kIsspace:
      return Value::boolean(all_code_points(text, is_python_space));
    case Method::kIslower:
      return Value::boolean(is_all_lower(text));
    case Method::kIsupper:
      return Value::boolean(is_all_upper(text));
    default:
      fail(fmt::format("'str' object has no attribute '{}'", name));
  }
}

Value mapping_method(const Value& object, Method method, std::string_view name,
                     const CallArgs& args) {
  switch (method) {
    case Method::kItems:
      return Value::array(mapping_items(object));
    case Method::kKeys: {
      std::vector<Value> keys;
      for_each_entry(object, [&](const Value& key, const Value&) { keys.push_back(key); });
      return Value::array(std::move(keys));
    }
    case Method::kValues: {
      std::vector<Value> values;
      for_each_entry(object, [&](const Value&, const Value& item) { values.push_back(item); });
      return Value::array(std::move(values));
    }
    case Method::kGet: {
      const Value* key = args.get(0, "key");
      if (!key) {
        fail("get() takes at least 1 argument");
      }
      const Value* fallback = args.get(1, "default");
      Value found = key->is_string() ? mapping_get(object, key->as_string()) : Value();
      if (found.is_undefined()) {
        return fallback ? *fallback : Value::none();
      }
      return found;
    }
    default:
      fail(fmt::format("'dict' object has no attribute '{}'", name));
  }
}

}  // namespace

std::optional<Filter> find_filter(std::string_view name) { return find_named(kFilters, name); }

std::optional<Test> find_test(std::string_view name) { return find_named(kTests, name); }

Method find_method(std::string_view name) {
  return find_named(kMethods, name).value_or(Method::kNone);
}

BuiltinFunction find_builtin_function(std::string_view name) {
  if (name == "range") {
    return BuiltinFunction::kRange;
  }
  if (name == "namespace") {
    return BuiltinFunction::kNamespace;
  }
  if (name == "raise_exception") {
    return BuiltinFunction::kRaiseException;
  }
  if (name == "strftime_now") {
    return BuiltinFunction::kStrftimeNow;
  }
  if (name == "dict") {
    return BuiltinFunction::kDict;
  }
  return BuiltinFunction::kNone;
}

const Value* CallArgs::get(std::size_t index, std::string_view name) const {
  if (index < positional.size()) {
    return &positional[index];
  }
  for (const auto& [key, value] : keywords) {
    if (key.as_string() == name) {
      return &value;
    }
  }
  return nullptr;
}

Value apply_filter(Filter filter, const Value& operand, const CallArgs& args) {
  std::string storage;
  switch (filter) {
    case Filter::kAbs:
      return filter_abs(operand);
    case Filter::kAttr: {
      const Value* name = args.get(0, "name");
      if (!name) {
        fail("attr needs a name");
      }
      return get_attribute(operand, require_string(*name, "name"));
    }
    case Filter::kBatch:
      return filter_batch(operand, args);
    case Filter::kCapitalize:
      return string_result(python_capitalize(text_of(operand, storage)));
    case Filter::kDefault:
      return filter_default(operand, args);
    case Filter::kDictsort:
      return filter_dictsort(operand, args);
    case Filter::kEscape:
      return string_result(html_escape(text_of(operand, storage)));
    case Filter::kFirst:
      return filter_first_or_last(operand, true);
    case Filter::kFloat:
      return filter_float(operand, args);
    case Filter::kIndent:
      return filter_indent(operand, args);
    case Filter::kInt:
      return filter_int(operand, args);
    case Filter::kItems:
      if (operand.is_undefined()) {
        return Value::array(std::vector<Value>{});
      }
      if (!operand.is_mapping()) {
        fail(fmt::format("items needs a dict, not '{}'", type_name(operand)));
      }
      return Value::array(mapping_items(operand));
    case Filter::kJoin:
      return filter_join(operand, args);
    case Filter::kLast:
      return filter_first_or_last(operand, false);
    case Filter::kLength:
      return filter_length(operand);
    case Filter::kList:
      if (operand.kind() == Value::Kind::kArray) {
        return Value::array(operand.array_data().items);
      }
      return Value::array(items_of(operand));
    case Filter::kLower:
      return string_result(ascii_lower(text_of(operand, storage)));
    case Filter::kMap:
      return filter_map(operand, args);
    case Filter::kMax:
      return filter_extreme(operand, args, true);
    case Filter::kMin:
      return filter_extreme(operand, args, false);
    case Filter::kReject:
      return filter_select(operand, args, false, false);
    case Filter::kRejectattr:
      return filter_select(operand, args, true, false);
    case Filter::kReplace: {
      const Value* old_text = args.get(0, "old");
      const Value* new_text = args.get(1, "new");
      if (!old_text || !new_text) {
        fail("replace needs the old and the new text");
      }
      const Value* count = args.get(2, "count");
      return string_result(python_replace(
          text_of(operand, storage), require_string(*old_text, "old"),
          require_string(*new_text, "new"), is_absent(count) ? -1 : require_int(*count, "count")));
    }
    case Filter::kReverse:
      return filter_reverse(operand);
    case Filter::kRound:
      return filter_round(operand, args);
    case Filter::kSafe:
      return operand;
    case Filter::kSelect:
      return filter_select(operand, args, false, true);
    case Filter::kSelectattr:
      return filter_select(operand, args, true, true);
    case Filter::kSort:
      return filter_sort(operand, args);
    case Filter::kString:
      return operand.is_string() ? operand : string_result(to_string(operand));
    case Filter::kSum:
      return filter_sum(operand, args);
    case Filter::kTitle:
      return string_result(jinja_title(text_of(operand, storage)));
    case Filter::kTojson:
      return filter_tojson(operand, args);
    case Filter::kTrim: {
      if (!operand.is_string()) {
        return string_result(
            std::string(python_strip(text_of(operand, storage), optional_chars(args), true, true)));
      }
      return Value::substring(operand,
                              python_strip(operand.as_string(), optional_chars(args), true, true));
    }
    case Filter::kUnique:
      return filter_unique(operand, args);
    case Filter::kUpper:
      return string_result(ascii_upper(text_of(operand, storage)));
    case Filter::kWordcount:
      return Value::integer(word_count(text_of(operand, storage)));
  }
  fail("unknown filter");
}

bool apply_test(Test test, const Value& operand, const CallArgs& args) {
  const auto argument = [&](std::string_view test_name) -> const Value& {
    if (args.positional.empty()) {
      fail(fmt::format("test '{}' needs an argument", test_name));
    }
    return args.positional[0];
  };
  const auto integral = [&](std::string_view test_name) {
    if (operand.is_int() || operand.kind() == Value::Kind::kBool) {
      return static_cast<std::int64_t>(operand.as_number());
    }
    fail(fmt::format("test '{}' needs an integer, not '{}'", test_name, type_name(operand)));
  };
  switch (test) {
    case Test::kBoolean:
      return operand.kind() == Value::Kind::kBool;
    case Test::kCallable:
      return operand.is_callable();
    case Test::kDefined:
      return !operand.is_undefined();
    case Test::kUndefined:
      return operand.is_undefined();
    case Test::kDivisibleby: {
      const std::int64_t divisor = require_int(argument("divisibleby"), "divisor");
      if (divisor == 0) {
        fail("integer division or modulo by zero");
      }
      if (operand.kind() == Value::Kind::kFloat) {
        return std::fmod(operand.as_float(), static_cast<double>(divisor)) == 0.0;
      }
      return integral("divisibleby") % divisor == 0;
    }
    case Test::kEq:
      return equals(operand, argument("eq"));
    case Test::kNe:
      return !equals(operand, argument("ne"));
    case Test::kLt:
      return compare(operand, argument("lt")) < 0;
    case Test::kLe:
      return compare(operand, argument("le")) <= 0;
    case Test::kGt:
      return compare(operand, argument("gt")) > 0;
    case Test::kGe:
      return compare(operand, argument("ge")) >= 0;
    case Test::kEven:
      return integral("even") % 2 == 0;
    case Test::kOdd:
      return integral("odd") % 2 != 0;
    case Test::kFalse:
      return operand.kind() == Value::Kind::kBool && !operand.as_bool();
    case Test::kTrue:
      return operand.kind() == Value::Kind::kBool && operand.as_bool();
    case Test::kFloat:
      return operand.kind() == Value::Kind::kFloat;
    case Test::kInteger:
      return operand.is_int();
    case Test::kNumber:
      return operand.is_number();
    case Test::kIn:
      return contains(argument("in"), operand);
    case Test::kIterable:
    case Test::kSequence:
      return operand.is_string() || operand.is_sequence() || operand.is_mapping() ||
             operand.is_undefined();
    case Test::kLower:
      return operand.is_string() && is_all_lower(operand.as_string());
    case Test::kUpper:
      return operand.is_string() && is_all_upper(operand.as_string());
    case Test::kMapping:
      return operand.is_mapping();
    case Test::kNone:
      return operand.is_none();
    case Test::kSameas:
      return operand.same_object(argument("sameas"));
    case Test::kString:
      return operand.is_string();
  }
  return false;
}

Value call_method(const Value& object, Method method, std::string_view name, CallArgs& args) {
  if (object.is_string()) {
    return string_method(object, method, name, args);
  }
  if (object.is_mapping()) {
    return mapping_method(object, method, name, args);
  }
  if (object.kind() == Value::Kind::kArray && method == Method::kAppend) {
    if (args.positional.size() != 1) {
      fail("append() takes exactly one argument");
    }
    object.array_data().items.push_back(std::move(args.positional[0]));
    return Value::none();
  }
  if (object.kind() == Value::Kind::kJson && method == Method::kAppend) {
    fail("append() on a list of the render's input; build a list with [] instead");
  }
  if (object.kind() == Value::Kind::kLoop && method == Method::kCycle) {
    if (args.positional.empty()) {
      fail("no items for cycling given");
    }
    const LoopData& loop = object.loop_data();
    return args.positional[static_cast<std::size_t>(loop.index0) % args.positional.size()];
  }
  if (object.is_undefined()) {
    fail(fmt::format("undefined value has no attribute '{}'", name));
  }
  fail(fmt::format("'{}' object has no attribute '{}'", type_name(object), name));
}

Value call_builtin_function(BuiltinFunction function, const CallArgs& args) {
  switch (function) {
    case BuiltinFunction::kRange: {
      std::int64_t start = 0;
      std::int64_t stop = 0;
      std::int64_t step = 1;
      if (args.positional.size() == 1) {
        stop = require_int(args.positional[0], "range() argument");
      } else if (args.positional.size() == 2 || args.positional.size() == 3) {
        start = require_int(args.positional[0], "range() argument");
        stop = require_int(args.positional[1], "range() argument");
        if (args.positional.size() == 3) {
          step = require_int(args.positional[2], "range() argument");
        }
      } else {
        fail("range expected 1 to 3 arguments");
      }
      if (step == 0) {
        fail("range() arg 3 must not be zero");
      }
      std::vector<Value> items;
      constexpr std::int64_t kMaxRange = 1'000'000;
      for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<std::int64_t>(items.size()) >= kMaxRange) {
          fail("range() too large");
        }
        items.push_back(Value::integer(i));
      }
      return Value::array(std::move(items));
    }
    case BuiltinFunction::kNamespace:
    case BuiltinFunction::kDict: {
      auto data = std::make_shared<ObjectData>();
      if (args.positional.size() > 1) {
        fail("expected at most 1 positional argument");
      }
      if (args.positional.size() == 1) {
        const Value& source = args.positional[0];
        if (source.is_mapping()) {
          for_each_entry(source,
                         [&](const Value& key, const Value& item) { data->set(key, item); });
        } else if (source.is_sequence()) {
          for (const Value& pair : items_of(source)) {
            if (!pair.is_sequence() || sequence_size(pair) != 2 ||
                !sequence_at(pair, 0).is_string()) {
              fail("expected an iterable of [key, value] pairs");
            }
            data->set(sequence_at(pair, 0), sequence_at(pair, 1));
          }
        } else {
          fail(fmt::format("'{}' object is not iterable", type_name(source)));
        }
      }
      for (const auto& [key, item] : args.keywords) {
        data->set(key, item);
      }
      return function == BuiltinFunction::kDict ? Value::object(std::move(data))
                                                : Value::name_space(std::move(data));
    }
    default:
      fail("not a callable builtin");
  }
}

Value get_attribute(const Value& object, std::string_view name) {
  switch (object.kind()) {
    case Value::Kind::kJson:
    case Value::Kind::kObject:
    case Value::Kind::kNamespace:
      return mapping_get(object, name);
    case Value::Kind::kLoop:
      return loop_attribute(object.loop_data(), name);
    default:
      return Value();
  }
}

Value get_item(const Value& object, const Value& key) {
  if (key.is_string()) {
    return get_attribute(object, key.as_string());
  }
  if (!key.is_int() && key.kind() != Value::Kind::kBool) {
    return Value();
  }
  auto index = static_cast<std::int64_t>(key.as_number());
  if (object.is_sequence()) {
    const auto size = static_cast<std::int64_t>(sequence_size(object));
    if (index < 0) {
      index += size;
    }
    if (index < 0 || index >= size) {
      return Value();
    }
    return sequence_at(object, static_cast<std::size_t>(index));
  }
  if (object.is_string()) {
    const std::string_view text = object.as_string();
    if (is_ascii(text)) {
      const auto size = static_cast<std::int64_t>(text.size());
      if (index < 0) {
        index += size;
      }
      if (index < 0 || index >= size) {
        return Value();
      }
      return Value::substring(object, text.substr(static_cast<std::size_t>(index), 1));
    }
    const std::vector<std::size_t> offsets = code_point_offsets(text);
    const auto size = static_cast<std::int64_t>(offsets.size() - 1);
    if (index < 0) {
      index += size;
    }
    if (index < 0 || index >= size) {
      return Value();
    }
    const auto i = static_cast<std::size_t>(index);
    return Value::substring(object, text.substr(offsets[i], offsets[i + 1] - offsets[i]));
  }
  return Value();
}

Value slice(const Value& object, const Value& start, const Value& stop, const Value& step) {
  if (object.is_string()) {
    return string_slice(object, start, stop, step);
  }
  if (object.is_sequence()) {
    const auto positions = slice_positions(sequence_size(object), start, stop, step);
    std::vector<Value> items;
    items.reserve(positions.size());
    for (const std::int64_t i : positions) {
      items.push_back(sequence_at(object, static_cast<std::size_t>(i)));
    }
    return Value::array(std::move(items));
  }
  if (object.is_undefined()) {
    return Value();
  }
  fail(fmt::format("'{}' object is not subscriptable", type_name(object)));
}

bool contains(const Value& container, const Value& item) {
  if (container.is_string()) {
    if (!item.is_string()) {
      fail(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
    }
    return container.as_string().find(item.as_string()) != std::string_view::npos;
  }
  if (container.is_sequence()) {
    const std::size_t size = sequence_size(container);
    for (std::size_t i = 0; i < size; ++i) {
      if (equals(sequence_at(container, i), item)) {
        return true;
      }
    }
    return false;
  }
  if (container.is_mapping()) {
    return item.is_string() && !mapping_get(container, item.as_string()).is_undefined();
  }
  if (container.is_undefined()) {
    return false;
  }
  fail(fmt::format("argument of type '{}' is not iterable", type_name(container)));
}

}  // namespace kvr::chat_template::detail
