// The bundled families' chat templates (Qwen3, DeepSeek-V3, Mistral-Nemo), read from their
// tokenizer_config.json under KVR_TOKENIZERS_DIR, rendered for a few chats and compared byte for
// byte with what @huggingface/jinja 0.5.13 renders (the same as Python's Jinja2 renders with
// transformers' settings for these chats).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/tokenizer_data.hpp"
#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;

constexpr const char* kSystemTwoTurns = R"json({"messages": [
  {"role": "system", "content": "You are a helpful assistant."},
  {"role": "user", "content": "What is 2+2?"},
  {"role": "assistant", "content": "2+2 equals 4."},
  {"role": "user", "content": "And 3+3?"}]})json";
constexpr const char* kToolChat = R"json({"messages": [
  {"role": "user", "content": "What's the weather in Paris?"},
  {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
  {"role": "tool", "tool_call_id": "call12345", "content": "{\"temperature\": 18, \"sky\": \"cloudy\"}"},
  {"role": "assistant", "content": "It is 18°C and cloudy in Paris."}],
 "tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]})json";
constexpr const char* kDeepSeekToolChat = R"json({"messages": [
  {"role": "user", "content": "What's the weather in Paris?"},
  {"role": "assistant", "content": null, "tool_calls": [{"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
  {"role": "tool", "tool_call_id": "call12345", "content": "{\"temperature\": 18, \"sky\": \"cloudy\"}"},
  {"role": "assistant", "content": "It is 18°C and cloudy in Paris."}],
 "tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]})json";
constexpr const char* kThinkingChat = R"json({"messages": [
  {"role": "user", "content": "Hi"},
  {"role": "assistant", "content": "<think>\nThe user greets.\n</think>\n\nHello! How can I help?"},
  {"role": "user", "content": "Tell me a joke"}]})json";
constexpr const char* kMultiStepToolChat = R"json({"messages": [
  {"role": "user", "content": "Weather in Oslo?"},
  {"role": "assistant", "content": "<think>\nI should call the tool.\n</think>\n\nChecking.", "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
  {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
  {"role": "assistant", "content": "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Oslo."}],
 "tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]})json";
constexpr const char* kNotAlternating = R"json({"messages": [
  {"role": "user", "content": "a"},
  {"role": "user", "content": "b"}]})json";

// The family's config (read once per family), or nullopt (with the reason in *skip) when
// KVR_TOKENIZERS_DIR is unset.
std::optional<ChatTemplateConfig> load_family(const std::string& family, std::string* skip) {
  const char* dir = kvr::testing::bundled_tokenizers_dir();
  if (dir == nullptr || *dir == '\0') {
    *skip = "KVR_TOKENIZERS_DIR is not set";
    return std::nullopt;
  }
  static std::map<std::string, ChatTemplateConfig> loaded;
  if (const auto it = loaded.find(family); it != loaded.end()) {
    return it->second;
  }
  const std::filesystem::path path = std::filesystem::path(dir) / family / "tokenizer_config.json";
  std::ifstream file(path);
  if (!file) {
    ADD_FAILURE() << "cannot read " << path;
    return std::nullopt;
  }
  auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(file));
  if (!config) {
    ADD_FAILURE() << path << ": " << testing::describe("parse", config.error());
    return std::nullopt;
  }
  loaded.emplace(family, *config);
  return std::move(*config);
}

// The render of `chat` (messages and tools) by the family's template, or its error described.
std::string render_family(const std::string& family, const char* chat, bool add_generation_prompt,
                          const ordered_json& extra_kwargs = ordered_json::object()) {
  std::string skip;
  const auto config = load_family(family, &skip);
  if (!config) {
    return skip.empty() ? "no config" : "SKIP: " + skip;
  }
  const ordered_json parsed = ordered_json::parse(chat);
  ChatRequest request;
  request.messages = parsed.at("messages");
  request.tools = parsed.value("tools", ordered_json());
  request.add_generation_prompt = add_generation_prompt;
  request.extra_kwargs = extra_kwargs;
  const auto rendered = config->render_chat(request, testing::fixed_clock());
  return rendered ? *rendered : testing::describe("render", rendered.error());
}

#define KVR_SKIP_WITHOUT_TOKENIZERS()                         \
  if (kvr::testing::bundled_tokenizers_dir() == nullptr) {    \
    GTEST_SKIP() << "the bundled tokenizers folder is empty"; \
  }

TEST(Qwen3TemplateTest, SystemAndTwoTurns) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kSystemTwoTurns, false),
            R"x(<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 2+2?<|im_end|>
<|im_start|>assistant
2+2 equals 4.<|im_end|>
<|im_start|>user
And 3+3?<|im_end|>
)x");
}

TEST(Qwen3TemplateTest, SystemAndTwoTurnsWithGenerationPrompt) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kSystemTwoTurns, true),
            R"x(<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 2+2?<|im_end|>
<|im_start|>assistant
2+2 equals 4.<|im_end|>
<|im_start|>user
And 3+3?<|im_end|>
<|im_start|>assistant
)x");
}

TEST(Qwen3TemplateTest, ToolCallAndToolResponse) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kToolChat, true),
            R"x(<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
What's the weather in Paris?<|im_end|>
<|im_start|>assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"temperature": 18, "sky": "cloudy"}
</tool_response><|im_end|>
<|im_start|>assistant
<think>

</think>

It is 18°C and cloudy in Paris.<|im_end|>
<|im_start|>assistant
)x");
}

TEST(Qwen3TemplateTest, ReasoningBeforeTheLastQueryIsDropped) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kThinkingChat, true),
            R"x(<|im_start|>user
Hi<|im_end|>
<|im_start|>assistant
Hello! How can I help?<|im_end|>
<|im_start|>user
Tell me a joke<|im_end|>
<|im_start|>assistant
)x");
}

TEST(Qwen3TemplateTest, ReasoningAfterTheLastQueryIsKept) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kMultiStepToolChat, false),
            R"x(<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Oslo?<|im_end|>
<|im_start|>assistant
<think>
I should call the tool.
</think>

Checking.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Oslo"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
sunny
</tool_response><|im_end|>
<|im_start|>assistant
<think>
The tool says sunny.
</think>

It is sunny in Oslo.<|im_end|>
)x");
}

TEST(Qwen3TemplateTest, EnableThinkingFalseAddsAnEmptyThinkBlock) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("qwen3", kSystemTwoTurns, true,
                          ordered_json::parse(R"({"enable_thinking": false})")),
            R"x(<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is 2+2?<|im_end|>
<|im_start|>assistant
2+2 equals 4.<|im_end|>
<|im_start|>user
And 3+3?<|im_end|>
<|im_start|>assistant
<think>

</think>

)x");
}

TEST(DeepSeekV3TemplateTest, SystemAndTwoTurns) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(
      render_family("deepseek-v3", kSystemTwoTurns, false),
      R"x(<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>2+2 equals 4.<｜end▁of▁sentence｜><｜User｜>And 3+3?)x");
}

TEST(DeepSeekV3TemplateTest, SystemAndTwoTurnsWithGenerationPrompt) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(
      render_family("deepseek-v3", kSystemTwoTurns, true),
      R"x(<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>2+2 equals 4.<｜end▁of▁sentence｜><｜User｜>And 3+3?<｜Assistant｜>)x");
}

TEST(DeepSeekV3TemplateTest, ToolCallAndToolOutput) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(
      render_family("deepseek-v3", kDeepSeekToolChat, true),
      R"x(<｜begin▁of▁sentence｜><｜User｜>What's the weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
```json
{"city": "Paris", "unit": "celsius"}
```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"temperature": 18, "sky": "cloudy"}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is 18°C and cloudy in Paris.<｜end▁of▁sentence｜><｜Assistant｜>)x");
}

TEST(DeepSeekV3TemplateTest, ThinkingTurnIsKeptVerbatim) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("deepseek-v3", kThinkingChat, false),
            R"x(<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>
The user greets.
</think>

Hello! How can I help?<｜end▁of▁sentence｜><｜User｜>Tell me a joke)x");
}

TEST(MistralNemoTemplateTest, SystemAndTwoTurns) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("mistral-nemo", kSystemTwoTurns, false),
            R"x(<s>[INST]What is 2+2?[/INST]2+2 equals 4.</s>[INST]You are a helpful assistant.

And 3+3?[/INST])x");
}

TEST(MistralNemoTemplateTest, GenerationPromptChangesNothing) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("mistral-nemo", kSystemTwoTurns, true),
            R"x(<s>[INST]What is 2+2?[/INST]2+2 equals 4.</s>[INST]You are a helpful assistant.

And 3+3?[/INST])x");
}

TEST(MistralNemoTemplateTest, ToolCallAndToolResult) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(
      render_family("mistral-nemo", kToolChat, true),
      R"x(<s>[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}][/AVAILABLE_TOOLS][INST]What's the weather in Paris?[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "call12345"}]</s>[TOOL_RESULTS]{"content": {"temperature": 18, "sky": "cloudy"}, "call_id": "call12345"}[/TOOL_RESULTS]It is 18°C and cloudy in Paris.</s>)x");
}

// Jinja2 raises here; @huggingface/jinja renders the chat, as its selectattr drops the messages
// that lack the attribute the `undefined` test looks for.
TEST(MistralNemoTemplateTest, NonAlternatingRolesRaiseTheTemplatesException) {
  KVR_SKIP_WITHOUT_TOKENIZERS();
  EXPECT_EQ(render_family("mistral-nemo", kNotAlternating, false),
            "render error, line 14: After the optional system message, conversation roles must "
            "alternate user/assistant/user/assistant/...");
}

}  // namespace
}  // namespace kvr::chat_template
