// The chat-template runtime value: Python's truthiness, equality and ordering, printing and
// json.dumps.
#include "selection/chat_template/value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "selection/chat_template/chat_template.hpp"
#include "selection/chat_template/template_error.hpp"
#include "selection/chat_template/text.hpp"

namespace kvr::chat_template::detail {
namespace {

using Json = nlohmann::ordered_json;

void append_int(std::string& out, std::int64_t value) {
  char buffer[24];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

void append_unsigned(std::string& out, std::uint64_t value) {
  char buffer[24];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

// A list or dict `depth` levels inside what a walk started from: past kMaxValueDepth the walk
// stops (a list the template made to hold itself would never end).
void check_depth(int depth, std::string_view walk) {
  if (depth >= kMaxValueDepth) {
    fail(fmt::format("cannot {} a value nested deeper than {} levels of lists and dicts", walk,
                     kMaxValueDepth));
  }
}

void append_newline_indent(std::string& out, const JsonFormat& format, int depth) {
  out.push_back('\n');
  for (int i = 0; i < depth; ++i) {
    out.append(format.indent);
  }
}

void append_json_node(std::string& out, const Json& node, const JsonFormat& format, int depth);

// The i-th entry of an object (ordered_map's operator[] takes keys, not positions).
const Json::object_t::value_type& entry_at(const Json::object_t& entries, std::size_t i) {
  return *(entries.begin() + static_cast<std::ptrdiff_t>(i));
}

// Writes a JSON list of `size` items, `item(i)` writing the i-th.
template <typename Item>
void append_json_list(std::string& out, std::size_t size, const JsonFormat& format, int depth,
                      Item&& item) {
  check_depth(depth, "write");
  if (size == 0) {
    out.append("[]");
    return;
  }
  out.push_back('[');
  for (std::size_t i = 0; i < size; ++i) {
    if (i > 0) {
      out.append(format.item_separator);
    }
    if (format.indented) {
      append_newline_indent(out, format, depth + 1);
    }
    item(i);
  }
  if (format.indented) {
    append_newline_indent(out, format, depth);
  }
  out.push_back(']');
}

// Writes a JSON object of `size` entries, `key(i)` naming the i-th and `item(i)` writing its
// value; sort_keys orders them by key.
template <typename Key, typename Item>
void append_json_object(std::string& out, std::size_t size, const JsonFormat& format, int depth,
                        Key&& key, Item&& item) {
  check_depth(depth, "write");
  if (size == 0) {
    out.append("{}");
    return;
  }
  std::vector<std::size_t> order(size);
  for (std::size_t i = 0; i < size; ++i) {
    order[i] = i;
  }
  if (format.sort_keys) {
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return key(a) < key(b); });
  }
  out.push_back('{');
  for (std::size_t n = 0; n < size; ++n) {
    if (n > 0) {
      out.append(format.item_separator);
    }
    if (format.indented) {
      append_newline_indent(out, format, depth + 1);
    }
    append_json_string(out, key(order[n]), format.ensure_ascii);
    out.append(format.key_separator);
    item(order[n]);
  }
  if (format.indented) {
    append_newline_indent(out, format, depth);
  }
  out.push_back('}');
}

void append_json_node(std::string& out, const Json& node, const JsonFormat& format, int depth) {
  switch (node.type()) {
    case Json::value_t::null:
    case Json::value_t::discarded:
    case Json::value_t::binary:
      out.append("null");
      return;
    case Json::value_t::boolean:
      out.append(node.get<bool>() ? "true" : "false");
      return;
    case Json::value_t::number_integer:
      append_int(out, node.get<std::int64_t>());
      return;
    case Json::value_t::number_unsigned:
      append_unsigned(out, node.get<std::uint64_t>());
      return;
    case Json::value_t::number_float:
      append_float(out, node.get<double>(), true);
      return;
    case Json::value_t::string:
      append_json_string(out, node.get_ref<const std::string&>(), format.ensure_ascii);
      return;
    case Json::value_t::array:
      append_json_list(out, node.size(), format, depth,
                       [&](std::size_t i) { append_json_node(out, node[i], format, depth + 1); });
      return;
    case Json::value_t::object: {
      const auto& entries = node.get_ref<const Json::object_t&>();
      append_json_object(
          out, entries.size(), format, depth,
          [&](std::size_t i) { return std::string_view(entry_at(entries, i).first); },
          [&](std::size_t i) {
            append_json_node(out, entry_at(entries, i).second, format, depth + 1);
          });
      return;
    }
  }
}

void append_container_output(std::string& out, const Value& value) {
  JsonFormat format;
  format.undefined_as_null = false;
  append_json(out, value, format);
}

}  // namespace

const Value* ObjectData::find(std::string_view key) const {
  for (const auto& [entry_key, entry_value] : entries) {
    if (entry_key.as_string() == key) {
      return &entry_value;
    }
  }
  return nullptr;
}

void ObjectData::set(Value key, Value value) {
  for (auto& [entry_key, entry_value] : entries) {
    if (entry_key.as_string() == key.as_string()) {
      entry_value = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

Value Value::owned_string(std::string text) {
  auto owner = std::make_shared<const std::string>(std::move(text));
  Value result = borrowed_string(*owner);
  result.owner_ = std::move(owner);
  return result;
}

Value Value::from_json(const nlohmann::ordered_json& node) {
  switch (node.type()) {
    case Json::value_t::null:
    case Json::value_t::binary:
      return none();
    case Json::value_t::discarded:
      return Value();
    case Json::value_t::boolean:
      return boolean(node.get<bool>());
    case Json::value_t::number_integer:
      return integer(node.get<std::int64_t>());
    case Json::value_t::number_unsigned: {
      const auto value = node.get<std::uint64_t>();
      if (value <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return integer(static_cast<std::int64_t>(value));
      }
      return floating(static_cast<double>(value));
    }
    case Json::value_t::number_float:
      return floating(node.get<double>());
    case Json::value_t::string:
      return borrowed_string(node.get_ref<const std::string&>());
    case Json::value_t::array:
    case Json::value_t::object: {
      Value result(Kind::kJson);
      result.payload_.json = &node;
      return result;
    }
  }
  return Value();
}

Value Value::array(std::vector<Value> items) {
  auto data = std::make_shared<ArrayData>();
  data->items = std::move(items);
  return array(std::move(data));
}

double Value::as_number() const {
  switch (kind()) {
    case Kind::kInt:
      return static_cast<double>(as_int());
    case Kind::kFloat:
      return as_float();
    case Kind::kBool:
      return as_bool() ? 1.0 : 0.0;
    default:
      return 0.0;
  }
}

bool Value::same_object(const Value& other) const {
  if (kind() != other.kind()) {
    return false;
  }
  switch (kind()) {
    case Kind::kJson:
      return &json() == &other.json();
    case Kind::kArray:
      return &array_data() == &other.array_data();
    case Kind::kObject:
    case Kind::kNamespace:
      return payload_.object == other.payload_.object;
    case Kind::kCallable:
      return &callable_data() == &other.callable_data();
    case Kind::kLoop:
      return &loop_data() == &other.loop_data();
    default:
      return equals(*this, other);
  }
}

bool truthy(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return value.as_bool();
    case Value::Kind::kInt:
      return value.as_int() != 0;
    case Value::Kind::kFloat:
      return value.as_float() != 0.0;
    case Value::Kind::kString:
      return !value.as_string().empty();
    case Value::Kind::kJson:
      return !value.json().empty();
    case Value::Kind::kArray:
      return !value.array_data().items.empty();
    case Value::Kind::kObject:
      return !value.object_data()->entries.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
    case Value::Kind::kBuiltin:
    case Value::Kind::kLoop:
      return true;
  }
  return false;
}

namespace {

// equals and compare, `depth` levels inside the values they started from.
bool equals_within(const Value& left, const Value& right, int depth);
int compare_within(const Value& left, const Value& right, int depth);

bool equals_within(const Value& left, const Value& right, int depth) {
  if (left.is_number() && right.is_number()) {
    if (left.is_int() && right.is_int()) {
      return left.as_int() == right.as_int();
    }
    return left.as_number() == right.as_number();
  }
  if (left.is_string() && right.is_string()) {
    return left.as_string() == right.as_string();
  }
  if (left.is_sequence() && right.is_sequence()) {
    const std::size_t size = sequence_size(left);
    if (size != sequence_size(right)) {
      return false;
    }
    if (left.same_object(right)) {
      return true;
    }
    check_depth(depth, "compare");
    for (std::size_t i = 0; i < size; ++i) {
      if (!equals_within(sequence_at(left, i), sequence_at(right, i), depth + 1)) {
        return false;
      }
    }
    return true;
  }
  if (left.is_mapping() && right.is_mapping()) {
    if (mapping_size(left) != mapping_size(right)) {
      return false;
    }
    if (left.same_object(right)) {
      return true;
    }
    check_depth(depth, "compare");
    bool same = true;
    for_each_entry(left, [&](const Value& key, const Value& item) {
      if (same) {
        const Value other = mapping_get(right, key.as_string());
        same = !other.is_undefined() && equals_within(item, other, depth + 1);
      }
    });
    return same;
  }
  if (left.kind() != right.kind()) {
    return false;
  }
  switch (left.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kBuiltin:
      return left.builtin_function() == right.builtin_function();
    default:
      return left.same_object(right);
  }
}

int compare_within(const Value& left, const Value& right, int depth) {
  if (left.is_number() && right.is_number()) {
    if (left.is_int() && right.is_int()) {
      return left.as_int() < right.as_int() ? -1 : (left.as_int() > right.as_int() ? 1 : 0);
    }
    const double a = left.as_number();
    const double b = right.as_number();
    return a < b ? -1 : (a > b ? 1 : 0);
  }
  if (left.is_string() && right.is_string()) {
    const int result = left.as_string().compare(right.as_string());
    return result < 0 ? -1 : (result > 0 ? 1 : 0);
  }
  if (left.is_sequence() && right.is_sequence()) {
    check_depth(depth, "compare");
    const std::size_t a = sequence_size(left);
    const std::size_t b = sequence_size(right);
    for (std::size_t i = 0; i < a && i < b; ++i) {
      const Value x = sequence_at(left, i);
      const Value y = sequence_at(right, i);
      if (!equals_within(x, y, depth + 1)) {
        return compare_within(x, y, depth + 1);
      }
    }
    return a < b ? -1 : (a > b ? 1 : 0);
  }
  fail(fmt::format("'<' not supported between instances of '{}' and '{}'", type_name(left),
                   type_name(right)));
}

}  // namespace

bool equals(const Value& left, const Value& right) { return equals_within(left, right, 0); }

int compare(const Value& left, const Value& right) { return compare_within(left, right, 0); }

std::string_view type_name(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kJson:
      return value.json().is_array() ? "list" : "dict";
    case Value::Kind::kArray:
      return "list";
    case Value::Kind::kObject:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kCallable:
    case Value::Kind::kBuiltin:
      return "function";
    case Value::Kind::kLoop:
      return "LoopContext";
  }
  return "unknown";
}

std::size_t sequence_size(const Value& value) {
  return value.kind() == Value::Kind::kJson ? value.json().size() : value.array_data().items.size();
}

Value sequence_at(const Value& value, std::size_t index) {
  return value.kind() == Value::Kind::kJson ? Value::from_json(value.json()[index])
                                            : value.array_data().items[index];
}

std::vector<Value> iterate(const Value& value) {
  std::vector<Value> items;
  if (value.is_sequence()) {
    const std::size_t size = sequence_size(value);
    items.reserve(size);
    for (std::size_t i = 0; i < size; ++i) {
      items.push_back(sequence_at(value, i));
    }
  } else if (value.is_mapping()) {
    items.reserve(mapping_size(value));
    for_each_entry(value, [&](const Value& key, const Value&) { items.push_back(key); });
  } else if (value.is_string()) {
    const std::string_view text = value.as_string();
    for (std::size_t pos = 0; pos < text.size();) {
      const std::size_t size = decode_utf8(text, pos).size;
      items.push_back(Value::substring(value, text.substr(pos, size)));
      pos += size;
    }
  } else if (!value.is_undefined()) {
    fail(fmt::format("'{}' object is not iterable", type_name(value)));
  }
  return items;
}

Value mapping_get(const Value& value, std::string_view key) {
  switch (value.kind()) {
    case Value::Kind::kJson: {
      const Json& node = value.json();
      if (!node.is_object()) {
        return Value();
      }
      for (const auto& [entry_key, entry_value] : node.get_ref<const Json::object_t&>()) {
        if (entry_key == key) {
          return Value::from_json(entry_value);
        }
      }
      return Value();
    }
    case Value::Kind::kObject: {
      const Value* found = value.object_data()->find(key);
      return found ? *found : Value();
    }
    case Value::Kind::kNamespace: {
      const Value* found = value.namespace_data()->find(key);
      return found ? *found : Value();
    }
    default:
      return Value();
  }
}

std::size_t mapping_size(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kJson:
      return value.json().size();
    case Value::Kind::kObject:
      return value.object_data()->entries.size();
    case Value::Kind::kNamespace:
      return value.namespace_data()->entries.size();
    default:
      return 0;
  }
}

void append_output(std::string& out, const Value& value) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
    case Value::Kind::kCallable:
    case Value::Kind::kBuiltin:
      return;
    case Value::Kind::kBool:
      out.append(value.as_bool() ? "true" : "false");
      return;
    case Value::Kind::kInt:
      append_int(out, value.as_int());
      return;
    case Value::Kind::kFloat:
      append_float(out, value.as_float(), false);
      return;
    case Value::Kind::kString:
      out.append(value.as_string());
      return;
    case Value::Kind::kLoop:
      out.append("<LoopContext>");
      return;
    case Value::Kind::kJson:
    case Value::Kind::kArray:
    case Value::Kind::kObject:
    case Value::Kind::kNamespace:
      append_container_output(out, value);
      return;
  }
}

void append_string(std::string& out, const Value& value) {
  if (value.is_none()) {
    out.append("None");
    return;
  }
  append_output(out, value);
}

std::string to_string(const Value& value) {
  if (value.is_string()) {
    return std::string(value.as_string());
  }
  std::string out;
  append_string(out, value);
  return out;
}

void append_float(std::string& out, double value, bool json) {
  if (std::isnan(value)) {
    out.append(json ? "NaN" : "nan");
    return;
  }
  if (std::isinf(value)) {
    out.append(value > 0 ? (json ? "Infinity" : "inf") : (json ? "-Infinity" : "-inf"));
    return;
  }
  // The shortest digits that read back as `value`, laid out as Python's repr lays them out:
  // positional for exponents in [-4, 16), scientific otherwise, always with a '.' or exponent.
  char buffer[64];
  const auto result =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  const std::string_view text(buffer, static_cast<std::size_t>(result.ptr - buffer));
  const std::size_t e = text.find('e');
  std::string_view mantissa = text.substr(0, e);
  int exponent = 0;
  std::from_chars(text.data() + e + 1 + (text[e + 1] == '+' ? 1 : 0), text.data() + text.size(),
                  exponent);
  if (mantissa.starts_with('-')) {
    out.push_back('-');
    mantissa.remove_prefix(1);
  }
  std::string digits;
  for (const char c : mantissa) {
    if (c != '.') {
      digits.push_back(c);
    }
  }
  const auto count = static_cast<int>(digits.size());
  if (exponent >= -4 && exponent < 16) {
    if (exponent >= 0) {
      if (count <= exponent + 1) {
        out.append(digits);
        out.append(static_cast<std::size_t>(exponent + 1 - count), '0');
        out.append(".0");
      } else {
        out.append(digits, 0, static_cast<std::size_t>(exponent + 1));
        out.push_back('.');
        out.append(digits, static_cast<std::size_t>(exponent + 1));
      }
    } else {
      out.append("0.");
      out.append(static_cast<std::size_t>(-exponent - 1), '0');
      out.append(digits);
    }
    return;
  }
  out.push_back(digits[0]);
  if (count > 1) {
    out.push_back('.');
    out.append(digits, 1);
  }
  out.push_back('e');
  out.push_back(exponent < 0 ? '-' : '+');
  const int magnitude = exponent < 0 ? -exponent : exponent;
  if (magnitude < 10) {
    out.push_back('0');
  }
  append_int(out, magnitude);
}

void append_json_string(std::string& out, std::string_view text, bool ensure_ascii) {
  out.push_back('"');
  for (std::size_t pos = 0; pos < text.size();) {
    const auto byte = static_cast<unsigned char>(text[pos]);
    if (byte >= 0x80U && ensure_ascii) {
      const CodePoint cp = decode_utf8(text, pos);
      const auto append_unit = [&out](unsigned unit) {
        out.append(fmt::format("\\u{:04x}", unit));
      };
      if (cp.value >= 0x10000U) {
        const unsigned v = cp.value - 0x10000U;
        append_unit(0xD800U + (v >> 10U));
        append_unit(0xDC00U + (v & 0x3FFU));
      } else {
        append_unit(cp.value);
      }
      pos += cp.size;
      continue;
    }
    switch (byte) {
      case '"':
        out.append("\\\"");
        break;
      case '\\':
        out.append("\\\\");
        break;
      case '\n':
        out.append("\\n");
        break;
      case '\r':
        out.append("\\r");
        break;
      case '\t':
        out.append("\\t");
        break;
      case '\b':
        out.append("\\b");
        break;
      case '\f':
        out.append("\\f");
        break;
      default:
        if (byte < 0x20U || (byte == 0x7FU && ensure_ascii)) {
          out.append(fmt::format("\\u{:04x}", byte));
        } else {
          out.push_back(static_cast<char>(byte));
        }
    }
    ++pos;
  }
  out.push_back('"');
}

void append_json(std::string& out, const Value& value, const JsonFormat& format, int depth) {
  switch (value.kind()) {
    case Value::Kind::kUndefined:
      out.append(format.undefined_as_null ? "null" : "undefined");
      return;
    case Value::Kind::kNone:
      out.append("null");
      return;
    case Value::Kind::kBool:
      out.append(value.as_bool() ? "true" : "false");
      return;
    case Value::Kind::kInt:
      append_int(out, value.as_int());
      return;
    case Value::Kind::kFloat:
      append_float(out, value.as_float(), true);
      return;
    case Value::Kind::kString:
      append_json_string(out, value.as_string(), format.ensure_ascii);
      return;
    case Value::Kind::kJson:
      append_json_node(out, value.json(), format, depth);
      return;
    case Value::Kind::kArray: {
      const auto& items = value.array_data().items;
      append_json_list(out, items.size(), format, depth,
                       [&](std::size_t i) { append_json(out, items[i], format, depth + 1); });
      return;
    }
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: {
      const auto& entries =
          (value.kind() == Value::Kind::kObject ? value.object_data() : value.namespace_data())
              ->entries;
      append_json_object(
          out, entries.size(), format, depth,
          [&](std::size_t i) { return entries[i].first.as_string(); },
          [&](std::size_t i) { append_json(out, entries[i].second, format, depth + 1); });
      return;
    }
    case Value::Kind::kCallable:
    case Value::Kind::kBuiltin:
    case Value::Kind::kLoop:
      fail(fmt::format("Object of type {} is not JSON serializable", type_name(value)));
  }
}

}  // namespace kvr::chat_template::detail
