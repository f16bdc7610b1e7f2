// The chat-template interpreter: renders a parsed Program against the render's variables. Used by
// ChatTemplate; one call renders once, on the calling thread, with state of its own.
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "selection/chat_template/ast.hpp"

namespace kvr::chat_template::detail {

/// A variable of the render: its name and its value in the caller's JSON (not copied).
using Binding = std::pair<std::string_view, const nlohmann::ordered_json*>;

/// The clock strftime_now reads.
using NowFunction = std::function<std::chrono::system_clock::time_point()>;

/// Renders `program` with `bindings` (a later binding of a name replaces an earlier one); throws
/// TemplateFailure on a render error (raise_exception, a type error, ...).
std::string render_program(const Program& program, std::span<const Binding> bindings,
                           const NowFunction& now);

}  // namespace kvr::chat_template::detail
