// The parameters the table classifiers share (`length-class`, `tenant-class`): a required list of
// rows, each a key of the classifier's own and the policy class it maps to, and a `default_class`
// for requests no row matches. Reading checks the shape and the classes; each classifier then
// checks its keys. Written against the public API (classifiers/request_classifier.hpp) only.
#pragma once

#include <cstddef>
#include <expected>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "classifiers/request_classifier.hpp"

namespace kvr::classifiers::builtin {

/// One row of a table: the classifier's key and its policy class (checked: not empty, known).
template <class Key>
struct ClassTableRow {
  Key key;
  std::string policy_class;
};

/// A table classifier's parameters, read.
template <class Key>
struct ClassTable {
  std::vector<ClassTableRow<Key>> rows;
  std::string default_class = "default";
};

/// Reads `parameters.<list>`: at least one mapping `{<key_field>: K, policy_class: C}`, and the
/// optional `default_class` ("default"). Every class must be non-empty and configured; an unknown
/// or missing field fails naming it (e.g. `parameters.tenants[1].policy_class`). `row_kind` names
/// a row in the message for an empty list ("bucket", "tenant").
template <class Key>
std::expected<ClassTable<Key>, plugins::request_classifier::RequestClassifierProviderError>
read_class_table(const plugins::request_classifier::RequestClassifierParameters& parameters,
                 std::string_view list, std::string_view row_kind, std::string_view key_field) {
  using plugins::request_classifier::RequestClassifierProviderError;
  const auto fail = [](std::string message) {
    return std::unexpected(RequestClassifierProviderError{std::move(message)});
  };
  auto reader = parameters.reader();
  auto entries = reader.required_mappings(list);
  if (!entries) return std::unexpected(entries.error());
  auto default_class = reader.optional<std::string>("default_class", "default");
  if (!default_class) return std::unexpected(default_class.error());
  if (auto finished = reader.finish(); !finished) return std::unexpected(finished.error());

  ClassTable<Key> table;
  if (entries->empty()) {
    return fail(fmt::format("parameters.{}: expected at least one {}, got []", list, row_kind));
  }
  for (std::size_t i = 0; i < entries->size(); ++i) {
    auto& entry = (*entries)[i];
    auto key = entry.required<Key>(key_field);
    if (!key) return std::unexpected(key.error());
    auto policy_class = entry.required<std::string>("policy_class");
    if (!policy_class) return std::unexpected(policy_class.error());
    if (auto finished = entry.finish(); !finished) return std::unexpected(finished.error());
    const std::string where = fmt::format("parameters.{}[{}].policy_class", list, i);
    if (policy_class->empty()) return fail(where + ": must not be empty");
    if (auto known = parameters.check_policy_class(*policy_class, where); !known) {
      return std::unexpected(known.error());
    }
    table.rows.push_back({std::move(*key), std::move(*policy_class)});
  }
  if (default_class->empty()) return fail("parameters.default_class: must not be empty");
  if (auto known = parameters.check_policy_class(*default_class, "parameters.default_class");
      !known) {
    return std::unexpected(known.error());
  }
  table.default_class = std::move(*default_class);
  return table;
}

}  // namespace kvr::classifiers::builtin
