// The runtime value of the chat-template interpreter. A value refers to the render's context
// (nlohmann::ordered_json nodes) and to the template's literals without copying them; lists,
// dicts and namespaces the template builds are shared, as Python shares its objects.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvr::chat_template::detail {

class Value;
struct MacroStmt;
struct CallBlockStmt;
struct Scope;

/// A list the template built (literal, filter result, slice); shared and mutable (append).
struct ArrayData {
  std::vector<Value> items;
};

/// A dict the template built, or a namespace; keys are string values, in insertion order.
struct ObjectData {
  std::vector<std::pair<Value, Value>> entries;

  /// The value under `key`, or nullptr.
  const Value* find(std::string_view key) const;
  /// Sets `key` (a string value) to `value`, keeping the position of an existing key.
  void set(Value key, Value value);
};

/// A macro or a call block's caller, with the scope it closes over.
struct Callable {
  const MacroStmt* macro = nullptr;
  const CallBlockStmt* call_block = nullptr;
  Scope* scope = nullptr;
};

/// The global functions templates call.
enum class BuiltinFunction : std::uint8_t {
  kNone,
  kRange,
  kNamespace,
  kRaiseException,
  kStrftimeNow,
  kDict,
};

/// A for loop's `loop` variable: the loop's items and the current position.
struct LoopData {
  std::shared_ptr<const std::vector<Value>> items;
  std::int64_t index0 = 0;
};

/// One runtime value: undefined, none, bool, int, float, string, a context JSON array or object,
/// a template-built list, dict or namespace, a macro, a builtin function, or a loop. Copying is
/// cheap: a small payload and, for what the value owns, one shared owner.
class Value {
 public:
  enum class Kind : std::uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kJson,  // an array or object node of the context
    kArray,
    kObject,
    kNamespace,
    kCallable,
    kBuiltin,
    kLoop,
  };

  /// Undefined.
  Value() = default;

  static Value none() { return Value(Kind::kNone); }
  static Value boolean(bool value) {
    Value result(Kind::kBool);
    result.payload_.boolean = value;
    return result;
  }
  static Value integer(std::int64_t value) {
    Value result(Kind::kInt);
    result.payload_.integer = value;
    return result;
  }
  static Value floating(double value) {
    Value result(Kind::kFloat);
    result.payload_.floating = value;
    return result;
  }
  /// A string whose bytes outlive the render (the template's literals, the context's strings).
  static Value borrowed_string(std::string_view text) {
    Value result(Kind::kString);
    result.payload_.text = {text.data(), text.size()};
    return result;
  }
  /// A string the value owns.
  static Value owned_string(std::string text);
  /// A part of `whole`'s text (a view into it), sharing its ownership.
  static Value substring(const Value& whole, std::string_view part) {
    Value result = borrowed_string(part);
    result.owner_ = whole.owner_;
    return result;
  }
  /// The context node `node`: scalars become values, arrays and objects are referenced.
  static Value from_json(const nlohmann::ordered_json& node);
  static Value array(std::vector<Value> items);
  static Value array(std::shared_ptr<ArrayData> data) {
    return owning(Kind::kArray, std::move(data));
  }
  static Value object(std::shared_ptr<ObjectData> data) {
    return owning(Kind::kObject, std::move(data));
  }
  static Value name_space(std::shared_ptr<ObjectData> data) {
    return owning(Kind::kNamespace, std::move(data));
  }
  static Value callable(std::shared_ptr<Callable> callable) {
    return owning(Kind::kCallable, std::move(callable));
  }
  static Value builtin(BuiltinFunction function) {
    Value result(Kind::kBuiltin);
    result.payload_.builtin = function;
    return result;
  }
  static Value loop(std::shared_ptr<LoopData> loop) { return owning(Kind::kLoop, std::move(loop)); }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_int() const { return kind_ == Kind::kInt; }
  /// int, float or bool (Python's numbers).
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  /// A list: a context array or a template-built list.
  bool is_sequence() const {
    return kind_ == Kind::kArray || (kind_ == Kind::kJson && json().is_array());
  }
  /// A dict: a context object or a template-built dict.
  bool is_mapping() const {
    return kind_ == Kind::kObject || (kind_ == Kind::kJson && json().is_object());
  }
  bool is_callable() const { return kind_ == Kind::kCallable || kind_ == Kind::kBuiltin; }

  // Accessors of one kind's payload: the caller has checked the kind.
  bool as_bool() const { return payload_.boolean; }
  std::int64_t as_int() const { return payload_.integer; }
  double as_float() const { return payload_.floating; }
  /// An int, float or bool as a double.
  double as_number() const;
  std::string_view as_string() const { return {payload_.text.data, payload_.text.size}; }
  const nlohmann::ordered_json& json() const { return *payload_.json; }
  ArrayData& array_data() const { return *static_cast<ArrayData*>(payload_.object); }
  ObjectData* object_data() const { return static_cast<ObjectData*>(payload_.object); }
  ObjectData* namespace_data() const { return static_cast<ObjectData*>(payload_.object); }
  const Callable& callable_data() const { return *static_cast<const Callable*>(payload_.object); }
  BuiltinFunction builtin_function() const { return payload_.builtin; }
  const LoopData& loop_data() const { return *static_cast<const LoopData*>(payload_.object); }

  /// Whether both refer to the same object (Jinja's `sameas` for containers).
  bool same_object(const Value& other) const;

 private:
  struct Text {
    const char* data;
    std::size_t size;
  };
  union Payload {
    bool boolean;
    std::int64_t integer;
    double floating;
    Text text;
    const nlohmann::ordered_json* json;
    BuiltinFunction builtin;
    void* object;
  };

  explicit Value(Kind kind) : kind_(kind) {}

  template <typename T>
  static Value owning(Kind kind, std::shared_ptr<T> data) {
    Value result(kind);
    result.payload_.object = data.get();
    result.owner_ = std::move(data);
    return result;
  }

  Kind kind_ = Kind::kUndefined;
  Payload payload_{.integer = 0};
  // What keeps an owned string, list, dict, namespace, macro or loop alive; null otherwise.
  std::shared_ptr<const void> owner_;
};

/// Python's truthiness.
bool truthy(const Value& value);

/// Python's ==: numbers across int/float/bool, lists and dicts by content.
bool equals(const Value& left, const Value& right);

/// Python's ordering (<0, 0, >0) of numbers, strings and lists; throws for other kinds.
int compare(const Value& left, const Value& right);

/// The type's name in error messages (Python's names).
std::string_view type_name(const Value& value);

/// The number of items of a list (is_sequence()).
std::size_t sequence_size(const Value& value);
/// The item at `index` of a list (is_sequence(), index < size).
Value sequence_at(const Value& value, std::size_t index);

/// The items a for loop walks: a list's items, a string's characters, a dict's keys; undefined
/// walks nothing. Throws for other kinds.
std::vector<Value> iterate(const Value& value);

/// The value under `key` of a dict or namespace, or undefined.
Value mapping_get(const Value& value, std::string_view key);
/// The number of entries of a dict or namespace.
std::size_t mapping_size(const Value& value);
/// Calls f(key, value) (both values) for each entry of a dict or namespace, in order.
template <typename F>
void for_each_entry(const Value& value, F&& f);

/// How {{ }} prints a value: undefined and none print nothing, booleans `true`/`false`, floats as
/// Python prints them, lists and dicts as JSON (what @huggingface/jinja prints).
void append_output(std::string& out, const Value& value);

/// The value as a string, for `~`, `|string`, `join` and `+` with a string: as printed, except
/// that none is `None` (Python's str).
void append_string(std::string& out, const Value& value);
/// The value as a string, as append_string writes it.
std::string to_string(const Value& value);

/// Python's repr of a float (`1.0`, `0.1`, `1e+16`); JSON spells non-finite values its way.
void append_float(std::string& out, double value, bool json);

/// json.dumps's options: indent (none when empty and !indented), separators, ensure_ascii,
/// sort_keys.
struct JsonFormat {
  bool indented = false;
  std::string indent;
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool ensure_ascii = false;
  bool sort_keys = false;
  // Printing a list of undefined values says `undefined`; tojson says null.
  bool undefined_as_null = true;
};

/// Appends `value` as json.dumps writes it with `format`; throws for macros and functions.
void append_json(std::string& out, const Value& value, const JsonFormat& format, int depth = 0);

/// Appends `text` as a JSON string literal.
void append_json_string(std::string& out, std::string_view text, bool ensure_ascii);

template <typename F>
void for_each_entry(const Value& value, F&& f) {
  if (value.kind() == Value::Kind::kJson) {
    const nlohmann::ordered_json& node = value.json();
    for (auto it = node.begin(); it != node.end(); ++it) {
      f(Value::borrowed_string(it.key()), Value::from_json(it.value()));
    }
    return;
  }
  const auto& data =
      value.kind() == Value::Kind::kObject ? value.object_data() : value.namespace_data();
  for (const auto& [key, item] : data->entries) {
    f(key, item);
  }
}

}  // namespace kvr::chat_template::detail
