// The chat-template parser: tokens to the syntax tree, with every tag, filter and test checked
// against what the interpreter supports, so that an unsupported template fails at parse time.
#pragma once

#include <memory>
#include <string_view>

#include "selection/chat_template/ast.hpp"

namespace kvr::chat_template::detail {

/// The parsed program of `source`; throws TemplateFailure naming the problem and its line.
std::shared_ptr<const Program> parse_program(std::string_view source);

}  // namespace kvr::chat_template::detail
