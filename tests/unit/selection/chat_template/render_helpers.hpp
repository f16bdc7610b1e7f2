// Helpers of the chat-template tests: render a template to its output, or to a readable error
// string, so that each test is one EXPECT_EQ.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "selection/chat_template/chat_template.hpp"

namespace kvr::chat_template::testing {

/// 2024-03-15 12:00:00 UTC: the same date in every time zone from UTC-11 to UTC+11.
inline RenderEnvironment fixed_clock() {
  RenderEnvironment env;
  env.now = [] { return std::chrono::system_clock::time_point(std::chrono::seconds(1710504000)); };
  return env;
}

/// The error as a string the tests compare: "parse error, line N: message".
inline std::string describe(std::string_view stage, const TemplateError& error) {
  return fmt::format("{} error, line {}: {}", stage, error.line, error.message);
}

/// The render of `source` with `context`, or its parse or render error described.
inline std::string render(std::string_view source, const nlohmann::ordered_json& context =
                                                       nlohmann::ordered_json::object()) {
  const auto parsed = ChatTemplate::parse(source);
  if (!parsed) {
    return describe("parse", parsed.error());
  }
  const auto rendered = parsed->render(context, fixed_clock());
  if (!rendered) {
    return describe("render", rendered.error());
  }
  return *rendered;
}

}  // namespace kvr::chat_template::testing
