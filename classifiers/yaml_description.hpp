// How a YAML node is named in configuration errors ("expected a mapping, got a list"), for the
// router-policy loader (selection/config/) and the plugin `parameters` reader alike. It lives in
// classifiers/ for the reason plugin_parameters.hpp does: the lowest folder both may include.
#pragma once

#include <string>

namespace YAML {
class Node;
}  // namespace YAML

namespace kvr::classifiers {

/// "nothing" (absent), "null", "a list", "a mapping", or the scalar in quotes; a quoted scalar
/// says it is a string, so that `limit: "5"` explains why it is no number.
std::string describe_yaml(const YAML::Node& node);

}  // namespace kvr::classifiers
