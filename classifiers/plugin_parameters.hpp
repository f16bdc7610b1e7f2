// The `parameters` mapping of one configured plugin instance (ParameterSource) and the strict
// reader a plugin's provider uses on it (BasicParameterReader, exposed as `ParameterReader` by both
// plugin APIs). It lives in classifiers/ because that is the lowest folder that both the
// worker-selection API (selection/) and the request-classifier API (classifiers/) may include.
// The contract: docs/plugin-api.md.
#pragma once

#include <concepts>
#include <cstdint>
#include <expected>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace YAML {
class Node;
}  // namespace YAML

namespace kvr::classifiers {

/// An immutable parameters mapping with the place it came from, for error messages. Built by the
/// router-policy config loader; tests build one from YAML text.
class ParameterSource {
 public:
  /// `node` must be a mapping with string keys, or null/undefined (no parameters); `context`
  /// names its place in messages, e.g. "parameters".
  static std::expected<std::shared_ptr<const ParameterSource>, std::string> from_yaml(
      const YAML::Node& node, std::string context);
  /// Parses `yaml_text` (a flow or block mapping, or empty) as a parameters mapping.
  static std::expected<std::shared_ptr<const ParameterSource>, std::string> from_text(
      std::string_view yaml_text, std::string context);
  /// No parameters at all.
  static std::shared_ptr<const ParameterSource> empty(std::string context);

  ~ParameterSource();
  ParameterSource(const ParameterSource&) = delete;
  ParameterSource& operator=(const ParameterSource&) = delete;

  std::string_view context() const { return context_; }
  /// The mapping's keys, in document order.
  const std::vector<std::string>& keys() const { return keys_; }
  /// The value at `key`, or nullptr when absent.
  const YAML::Node* find(std::string_view key) const;

 private:
  struct Entries;
  ParameterSource(std::unique_ptr<Entries> entries, std::vector<std::string> keys,
                  std::string context);
  std::unique_ptr<Entries> entries_;
  std::vector<std::string> keys_;
  std::string context_;
};

/// The scalar types a parameter can be read as.
template <class T>
concept ParameterScalar = std::same_as<T, bool> || std::same_as<T, std::int32_t> ||
    std::same_as<T, std::int64_t> || std::same_as<T, std::uint32_t> ||
    std::same_as<T, std::uint64_t> || std::same_as<T, double> || std::same_as<T, std::string>;

template <class T>
inline constexpr bool kIsParameterList = false;
template <ParameterScalar T>
inline constexpr bool kIsParameterList<std::vector<T>> = true;

/// What a parameter can be read as: a ParameterScalar or a std::vector of one.
template <class T>
concept ParameterValue = ParameterScalar<T> || kIsParameterList<T>;

/// Reads `key` as T: nullopt when absent, an error naming the context, the key, the expected type
/// and what was given when present with another type (a fraction or text for an integer, a
/// negative value for an unsigned type, a mapping for a scalar, a quoted "5" for a number ...).
/// Defined in plugin_parameters.cpp for every ParameterValue.
template <ParameterValue T>
std::expected<std::optional<T>, std::string> read_parameter(const ParameterSource& source,
                                                            std::string_view key);

/// Reads `key` as a list of mappings (e.g. `buckets: [{max_input_tokens: 512, ...}]`): nullopt
/// when absent, else one ParameterSource per element, named "<context>.<key>[i]" in messages; an
/// error naming the key when it is not a list or an element is not a mapping.
std::expected<std::optional<std::vector<std::shared_ptr<const ParameterSource>>>, std::string>
read_mapping_list(const ParameterSource& source, std::string_view key);

/// The message for a required key that is absent.
std::string missing_parameter_message(const ParameterSource& source, std::string_view key);

/// Fails naming every key of `source` that is not in `read_keys`, and the keys that were read.
std::expected<void, std::string> check_all_parameters_read(const ParameterSource& source,
                                                           std::span<const std::string> read_keys);

}  // namespace kvr::classifiers

namespace kvr::plugins {

/// Reads one `parameters` mapping strictly; `Error` is the plugin API's provider error type (built
/// from a message). Every key asked for counts as read, present or not, so finish() can list what
/// the plugin accepts. Not thread-safe; a provider uses its own reader.
template <class Error>
class BasicParameterReader {
 public:
  /// A null `source` means no parameters.
  explicit BasicParameterReader(std::shared_ptr<const classifiers::ParameterSource> source)
      : source_(source ? std::move(source) : classifiers::ParameterSource::empty("parameters")) {}

  /// The value at `key`; an error names the key when it is missing or of the wrong type.
  template <classifiers::ParameterValue T>
  std::expected<T, Error> required(std::string_view key) {
    auto value = read<T>(key);
    if (!value) return std::unexpected(std::move(value.error()));
    if (!*value)
      return std::unexpected(Error{classifiers::missing_parameter_message(*source_, key)});
    return std::move(**value);
  }

  /// The value at `key`, or `fallback` when absent; an error when present with the wrong type.
  template <classifiers::ParameterValue T>
  std::expected<T, Error> optional(std::string_view key, T fallback) {
    auto value = read<T>(key);
    if (!value) return std::unexpected(std::move(value.error()));
    if (!*value) return fallback;
    return std::move(**value);
  }

  /// The value at `key`, or nullopt when absent (for parameters without a single default); an
  /// error when present with the wrong type.
  template <classifiers::ParameterValue T>
  std::expected<std::optional<T>, Error> optional(std::string_view key) {
    return read<T>(key);
  }

  /// The list of mappings at `key`, one strict reader per element (each element's keys are
  /// checked by that reader's own finish()); an error names the key when it is missing, not a
  /// list, or holds something other than mappings.
  std::expected<std::vector<BasicParameterReader>, Error> required_mappings(std::string_view key) {
    read_keys_.emplace_back(key);
    auto elements = classifiers::read_mapping_list(*source_, key);
    if (!elements) return std::unexpected(Error{std::move(elements.error())});
    if (!*elements) {
      return std::unexpected(Error{classifiers::missing_parameter_message(*source_, key)});
    }
    std::vector<BasicParameterReader> readers;
    readers.reserve((*elements)->size());
    for (auto& element : **elements) readers.emplace_back(std::move(element));
    return readers;
  }

  /// Fails naming every key that no required()/optional() call read (misspellings stop startup).
  std::expected<void, Error> finish() const {
    auto checked = classifiers::check_all_parameters_read(*source_, read_keys_);
    if (!checked) return std::unexpected(Error{std::move(checked.error())});
    return {};
  }

 private:
  template <class T>
  std::expected<std::optional<T>, Error> read(std::string_view key) {
    read_keys_.emplace_back(key);
    auto value = classifiers::read_parameter<T>(*source_, key);
    if (!value) return std::unexpected(Error{std::move(value.error())});
    return std::move(*value);
  }

  std::shared_ptr<const classifiers::ParameterSource> source_;
  std::vector<std::string> read_keys_;
};

}  // namespace kvr::plugins
