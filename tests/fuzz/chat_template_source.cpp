// A chat template's source as tokenizer_config.json carries it: parsed (ChatTemplate::parse),
// then rendered twice with a small fixed context (a system, user, assistant-with-tool-call and
// tool conversation, one tool, the special tokens) and a fixed clock. Templates come with the
// model rather than from clients, but a malformed or hostile one must end in an error, never a
// crash. A first line "%nest ..." nests part of the source deeply (nesting.hpp). Properties:
// errors carry a message; a render is a function of its context (both renders agree).
#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

#include "selection/chat_template/chat_template.hpp"
#include "tests/fuzz/harness.hpp"
#include "tests/fuzz/nesting.hpp"

namespace kvr::fuzz {
namespace {

const nlohmann::ordered_json& render_context() {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris? <think>"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
      {"role": "tool", "tool_call_id": "call1", "content": "18 °C"},
      {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "description": "The weather.", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "documents": null,
    "add_generation_prompt": true,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "enable_thinking": false
  })");
  return context;
}

}  // namespace

void chat_template_source(Input input) {
  const std::string source = expand_nesting(as_text(input));
  const auto parsed = chat_template::ChatTemplate::parse(source);
  if (!parsed) {
    KVR_FUZZ_CHECK(!parsed.error().message.empty());
    KVR_FUZZ_CHECK(parsed.error().line >= 0);
    return;
  }
  const chat_template::RenderEnvironment environment{.now = [] {
    return std::chrono::system_clock::time_point{std::chrono::seconds{1'700'000'000}};
  }};
  const auto first = parsed->render(render_context(), environment);
  const auto second = parsed->render(render_context(), environment);
  KVR_FUZZ_CHECK(first.has_value() == second.has_value());
  if (first) {
    KVR_FUZZ_CHECK(*first == *second);
  } else {
    KVR_FUZZ_CHECK(!first.error().message.empty());
    KVR_FUZZ_CHECK(first.error().message == second.error().message);
  }
}

}  // namespace kvr::fuzz
