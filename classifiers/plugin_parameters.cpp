#include "classifiers/plugin_parameters.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <system_error>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "classifiers/yaml_description.hpp"

namespace kvr::classifiers {
namespace {

// How a type is named in "expected ..." messages, alone and as list items.
template <class T>
struct TypeName;
template <>
struct TypeName<bool> {
  static constexpr std::string_view one = "a boolean (true or false)";
  static constexpr std::string_view many = "booleans";
};
template <>
struct TypeName<std::int32_t> {
  static constexpr std::string_view one = "a 32-bit integer";
  static constexpr std::string_view many = "32-bit integers";
};
template <>
struct TypeName<std::int64_t> {
  static constexpr std::string_view one = "a 64-bit integer";
  static constexpr std::string_view many = "64-bit integers";
};
template <>
struct TypeName<std::uint32_t> {
  static constexpr std::string_view one = "a non-negative 32-bit integer";
  static constexpr std::string_view many = "non-negative 32-bit integers";
};
template <>
struct TypeName<std::uint64_t> {
  static constexpr std::string_view one = "a non-negative 64-bit integer";
  static constexpr std::string_view many = "non-negative 64-bit integers";
};
template <>
struct TypeName<double> {
  static constexpr std::string_view one = "a finite number";
  static constexpr std::string_view many = "finite numbers";
};
template <>
struct TypeName<std::string> {
  static constexpr std::string_view one = "a string";
  static constexpr std::string_view many = "strings";
};

// Quoted or !!str-tagged scalars are strings, even when they look like numbers: `limit: "5"` is
// almost always a templating mistake, so it is reported rather than guessed at.
bool is_untyped_plain_scalar(const YAML::Node& node) {
  return node.IsScalar() && node.Tag() != "!" && node.Tag() != "tag:yaml.org,2002:str";
}

// YAML allows an explicit '+'; std::from_chars does not.
std::string_view strip_plus(std::string_view text) {
  if (text.size() > 1 && text.front() == '+' && text[1] != '-' && text[1] != '+') {
    text.remove_prefix(1);
  }
  return text;
}

std::string type_error(const ParameterSource& source, std::string_view key,
                       std::string_view expected, const YAML::Node& node,
                       std::string_view detail = {}) {
  return fmt::format("{}.{}: expected {}, got {}{}", source.context(), key, expected,
                     describe_yaml(node), detail);
}

template <ParameterScalar T>
std::expected<T, std::string> convert_scalar(const ParameterSource& source, std::string_view key,
                                             const YAML::Node& node) {
  constexpr std::string_view expected = TypeName<T>::one;
  if constexpr (std::same_as<T, std::string>) {
    if (!node.IsScalar()) return std::unexpected(type_error(source, key, expected, node));
    return node.Scalar();
  } else if constexpr (std::same_as<T, bool>) {
    bool value = false;
    // yaml-cpp's boolean spellings (true/false, yes/no, on/off in three casings) are accepted.
    if (!is_untyped_plain_scalar(node) || !YAML::convert<bool>::decode(node, value)) {
      return std::unexpected(type_error(source, key, expected, node));
    }
    return value;
  } else {
    if (!is_untyped_plain_scalar(node)) {
      return std::unexpected(type_error(source, key, expected, node));
    }
    const std::string_view text = strip_plus(node.Scalar());
    T value{};
    std::from_chars_result parsed{};
    if constexpr (std::same_as<T, double>) {
      parsed = std::from_chars(text.data(), text.data() + text.size(), value,
                               std::chars_format::general);
    } else {
      // Base 10 only: yaml-cpp's own conversion would read "010" as octal 8.
      parsed = std::from_chars(text.data(), text.data() + text.size(), value, 10);
    }
    const bool consumed_all = parsed.ptr == text.data() + text.size();
    if (parsed.ec == std::errc::result_out_of_range && consumed_all) {
      return std::unexpected(type_error(source, key, expected, node, " (out of range)"));
    }
    if (parsed.ec != std::errc{} || !consumed_all || text.empty()) {
      return std::unexpected(type_error(source, key, expected, node));
    }
    if constexpr (std::same_as<T, double>) {
      if (!std::isfinite(value)) return std::unexpected(type_error(source, key, expected, node));
    }
    return value;
  }
}

template <class T>
struct ReadAs {
  static std::expected<T, std::string> convert(const ParameterSource& source, std::string_view key,
                                               const YAML::Node& node) {
    return convert_scalar<T>(source, key, node);
  }
};

template <class T>
struct ReadAs<std::vector<T>> {
  static std::expected<std::vector<T>, std::string> convert(const ParameterSource& source,
                                                            std::string_view key,
                                                            const YAML::Node& node) {
    if (!node.IsSequence()) {
      return std::unexpected(
          type_error(source, key, fmt::format("a list of {}", TypeName<T>::many), node));
    }
    std::vector<T> values;
    values.reserve(node.size());
    for (std::size_t i = 0; i < node.size(); ++i) {
      auto value = convert_scalar<T>(source, fmt::format("{}[{}]", key, i), node[i]);
      if (!value) return std::unexpected(std::move(value.error()));
      values.push_back(std::move(*value));
    }
    return values;
  }
};

std::string join_quoted(std::span<const std::string> names) {
  std::string joined;
  for (const std::string& name : names) {
    if (!joined.empty()) joined += ", ";
    joined += fmt::format("'{}'", name);
  }
  return joined;
}

}  // namespace

struct ParameterSource::Entries {
  std::vector<YAML::Node> values;  // index-aligned with keys_
};

ParameterSource::ParameterSource(std::unique_ptr<Entries> entries, std::vector<std::string> keys,
                                 std::string context)
    : entries_(std::move(entries)), keys_(std::move(keys)), context_(std::move(context)) {}

ParameterSource::~ParameterSource() = default;

std::expected<std::shared_ptr<const ParameterSource>, std::string> ParameterSource::from_yaml(
    const YAML::Node& node, std::string context) {
  auto entries = std::make_unique<Entries>();
  std::vector<std::string> keys;
  try {
    if (!node.IsDefined() || node.IsNull()) return empty(std::move(context));
    if (!node.IsMap()) {
      return std::unexpected(
          fmt::format("{}: expected a mapping, got {}", context, describe_yaml(node)));
    }
    for (auto entry = node.begin(); entry != node.end(); ++entry) {
      if (!entry->first.IsScalar()) {
        return std::unexpected(fmt::format("{}: parameter names must be strings, got {}", context,
                                           describe_yaml(entry->first)));
      }
      std::string key = entry->first.Scalar();
      if (std::ranges::find(keys, key) != keys.end()) {
        return std::unexpected(fmt::format("{}.{}: duplicate key", context, key));
      }
      keys.push_back(std::move(key));
      entries->values.push_back(entry->second);
    }
  } catch (const YAML::Exception& error) {
    return std::unexpected(fmt::format("{}: {}", context, error.what()));
  }
  // make_shared cannot reach the private constructor.
  return std::shared_ptr<const ParameterSource>(
      new ParameterSource(std::move(entries), std::move(keys), std::move(context)));
}

std::expected<std::shared_ptr<const ParameterSource>, std::string> ParameterSource::from_text(
    std::string_view yaml_text, std::string context) {
  YAML::Node node;
  try {
    node = YAML::Load(std::string{yaml_text});
  } catch (const YAML::Exception& error) {
    return std::unexpected(fmt::format("{}: line {}, column {}: invalid YAML: {}", context,
                                       error.mark.line + 1, error.mark.column + 1, error.msg));
  }
  return from_yaml(node, std::move(context));
}

std::shared_ptr<const ParameterSource> ParameterSource::empty(std::string context) {
  return std::shared_ptr<const ParameterSource>(
      new ParameterSource(std::make_unique<Entries>(), {}, std::move(context)));
}

const YAML::Node* ParameterSource::find(std::string_view key) const {
  const auto found = std::ranges::find(keys_, key);
  if (found == keys_.end()) return nullptr;
  return &entries_->values[static_cast<std::size_t>(found - keys_.begin())];
}

template <ParameterValue T>
std::expected<std::optional<T>, std::string> read_parameter(const ParameterSource& source,
                                                            std::string_view key) {
  const YAML::Node* node = source.find(key);
  if (node == nullptr) return std::optional<T>{};
  try {
    auto value = ReadAs<T>::convert(source, key, *node);
    if (!value) return std::unexpected(std::move(value.error()));
    return std::optional<T>{std::move(*value)};
  } catch (const YAML::Exception& error) {
    return std::unexpected(fmt::format("{}.{}: {}", source.context(), key, error.what()));
  }
}

// Every ParameterValue; BasicParameterReader's templates call only these.
template std::expected<std::optional<bool>, std::string> read_parameter<bool>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::int32_t>, std::string> read_parameter<std::int32_t>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::int64_t>, std::string> read_parameter<std::int64_t>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::uint32_t>, std::string> read_parameter<std::uint32_t>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::uint64_t>, std::string> read_parameter<std::uint64_t>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<double>, std::string> read_parameter<double>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::string>, std::string> read_parameter<std::string>(
    const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<bool>>, std::string>
read_parameter<std::vector<bool>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<std::int32_t>>, std::string>
read_parameter<std::vector<std::int32_t>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<std::int64_t>>, std::string>
read_parameter<std::vector<std::int64_t>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<std::uint32_t>>, std::string>
read_parameter<std::vector<std::uint32_t>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<std::uint64_t>>, std::string>
read_parameter<std::vector<std::uint64_t>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<double>>, std::string>
read_parameter<std::vector<double>>(const ParameterSource&, std::string_view);
template std::expected<std::optional<std::vector<std::string>>, std::string>
read_parameter<std::vector<std::string>>(const ParameterSource&, std::string_view);

std::expected<std::optional<std::vector<std::shared_ptr<const ParameterSource>>>, std::string>
read_mapping_list(const ParameterSource& source, std::string_view key) {
  using Sources = std::vector<std::shared_ptr<const ParameterSource>>;
  const YAML::Node* node = source.find(key);
  if (node == nullptr) return std::optional<Sources>{};
  try {
    if (!node->IsSequence()) {
      return std::unexpected(type_error(source, key, "a list of mappings", *node));
    }
    Sources elements;
    elements.reserve(node->size());
    for (std::size_t i = 0; i < node->size(); ++i) {
      const std::string item = fmt::format("{}[{}]", key, i);
      const YAML::Node element = (*node)[i];
      if (!element.IsMap()) return std::unexpected(type_error(source, item, "a mapping", element));
      auto parsed =
          ParameterSource::from_yaml(element, fmt::format("{}.{}", source.context(), item));
      if (!parsed) return std::unexpected(std::move(parsed.error()));
      elements.push_back(std::move(*parsed));
    }
    return std::optional<Sources>{std::move(elements)};
  } catch (const YAML::Exception& error) {
    return std::unexpected(fmt::format("{}.{}: {}", source.context(), key, error.what()));
  }
}

std::string missing_parameter_message(const ParameterSource& source, std::string_view key) {
  if (source.keys().empty()) {
    return fmt::format("{}.{}: required parameter is missing (no parameters given)",
                       source.context(), key);
  }
  return fmt::format("{}.{}: required parameter is missing (given: {})", source.context(), key,
                     join_quoted(source.keys()));
}

std::expected<void, std::string> check_all_parameters_read(const ParameterSource& source,
                                                           std::span<const std::string> read_keys) {
  std::vector<std::string> unread;
  for (const std::string& key : source.keys()) {
    if (std::ranges::find(read_keys, key) == read_keys.end()) unread.push_back(key);
  }
  if (unread.empty()) return {};

  std::vector<std::string> accepted;
  for (const std::string& key : read_keys) {
    if (std::ranges::find(accepted, key) == accepted.end()) accepted.push_back(key);
  }
  return std::unexpected(fmt::format("{}: unknown parameter{} {}; {}", source.context(),
                                     unread.size() == 1 ? "" : "s", join_quoted(unread),
                                     accepted.empty()
                                         ? std::string{"this plugin takes no parameters"}
                                         : fmt::format("accepted: {}", join_quoted(accepted))));
}

}  // namespace kvr::classifiers
