#include "classifiers/yaml_description.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

namespace kvr::classifiers {

std::string describe_yaml(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
      return "nothing";
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Scalar:
      break;
  }
  if (node.Tag() == "!") return fmt::format("\"{}\" (quoted, so a string)", node.Scalar());
  return fmt::format("'{}'", node.Scalar());
}

}  // namespace kvr::classifiers
