// The YAML `parameters` mapping of one configured instance, as read by ParameterReader. The type
// lives in classifiers/plugin_parameters.hpp so that the request-classifier API, which may not
// include selection/, shares it; this header keeps its selection-side name.
#pragma once

#include "classifiers/plugin_parameters.hpp"

namespace kvr::selection {

/// See classifiers::ParameterSource.
using classifiers::ParameterSource;

}  // namespace kvr::selection
