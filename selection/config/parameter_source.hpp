// The YAML `parameters` mapping of one configured instance, as read by ParameterReader.
// Built by the router-policy config loader; tests build one from YAML text.
#pragma once

#include <expected>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace YAML {
class Node;
}  // namespace YAML

namespace kvr::selection {

/// An immutable parameters mapping with the location it came from, for error messages.
class ParameterSource {
 public:
  /// `node` must be a mapping or null/undefined (no parameters); `context` names its place,
  /// e.g. "router.yaml: worker_selection.instances[0] (least-busy).parameters".
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

}  // namespace kvr::selection
