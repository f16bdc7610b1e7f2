// The chat-template language's built-in filters, tests, methods (str, dict, list, loop) and
// global functions, looked up by name when a template is parsed and applied when it renders.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>

#include <absl/container/inlined_vector.h>

#include "selection/chat_template/value.hpp"

namespace kvr::chat_template::detail {

/// The built-in filters (`value | name`).
enum class Filter {
  kAbs,
  kAttr,
  kBatch,
  kCapitalize,
  kDefault,
  kDictsort,
  kEscape,
  kFirst,
  kFloat,
  kIndent,
  kInt,
  kItems,
  kJoin,
  kLast,
  kLength,
  kList,
  kLower,
  kMap,
  kMax,
  kMin,
  kReject,
  kRejectattr,
  kReplace,
  kReverse,
  kRound,
  kSafe,
  kSelect,
  kSelectattr,
  kSort,
  kString,
  kSum,
  kTitle,
  kTojson,
  kTrim,
  kUnique,
  kUpper,
  kWordcount,
};

/// The built-in tests (`value is name`).
enum class Test {
  kBoolean,
  kCallable,
  kDefined,
  kDivisibleby,
  kEq,
  kEven,
  kFalse,
  kFloat,
  kGe,
  kGt,
  kIn,
  kInteger,
  kIterable,
  kLe,
  kLower,
  kLt,
  kMapping,
  kNe,
  kNone,
  kNumber,
  kOdd,
  kSameas,
  kSequence,
  kString,
  kTrue,
  kUndefined,
  kUpper,
};

/// Methods callable as `value.name(...)`; kNone for any other name.
enum class Method {
  kNone,
  kAppend,
  kCapitalize,
  kCount,
  kCycle,
  kEndswith,
  kFind,
  kFormat,
  kGet,
  kIsalnum,
  kIsalpha,
  kIsdigit,
  kIslower,
  kIsspace,
  kIsupper,
  kItems,
  kJoin,
  kKeys,
  kLower,
  kLstrip,
  kReplace,
  kRfind,
  kRsplit,
  kRstrip,
  kSplit,
  kSplitlines,
  kStartswith,
  kStrip,
  kTitle,
  kUpper,
  kValues,
};

/// The filter called `name` (aliases included: d, e, count), if there is one.
std::optional<Filter> find_filter(std::string_view name);
/// The test called `name` (aliases included: equalto, ==, ne, lessthan, ...), if there is one.
std::optional<Test> find_test(std::string_view name);
/// The method called `name`, or Method::kNone.
Method find_method(std::string_view name);
/// The global function called `name`, or BuiltinFunction::kNone.
BuiltinFunction find_builtin_function(std::string_view name);

/// The evaluated arguments of a call: positional, then keyword (key: a string value).
struct CallArgs {
  absl::InlinedVector<Value, 4> positional;
  absl::InlinedVector<std::pair<Value, Value>, 2> keywords;

  /// The argument at positional `index`, else the keyword `name`; nullptr when neither is given.
  const Value* get(std::size_t index, std::string_view name) const;
};

/// `operand | filter(args)`.
Value apply_filter(Filter filter, const Value& operand, const CallArgs& args);
/// `operand is test(args)`.
bool apply_test(Test test, const Value& operand, const CallArgs& args);
/// `object.name(args)` for a built-in method of object's kind.
Value call_method(const Value& object, Method method, std::string_view name, CallArgs& args);
/// range(), namespace() and dict(); the interpreter itself handles the others.
Value call_builtin_function(BuiltinFunction function, const CallArgs& args);

/// `object.name`: a dict's or namespace's entry, a loop's attribute; undefined otherwise.
Value get_attribute(const Value& object, std::string_view name);
/// `object[key]`: a dict's entry, a list's or string's item (negative from the end); undefined
/// when missing.
Value get_item(const Value& object, const Value& key);
/// `object[start:stop:step]` of a list or string, as Python slices (undefined/none bounds are
/// open).
Value slice(const Value& object, const Value& start, const Value& stop, const Value& step);
/// Python's `item in container`.
bool contains(const Value& container, const Value& item);

}  // namespace kvr::chat_template::detail
