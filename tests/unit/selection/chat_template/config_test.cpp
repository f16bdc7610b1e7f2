// ChatTemplateConfig: reading tokenizer_config.json (string and named templates, special tokens
// in their forms) and rendering chats with transformers' context.
#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;

std::string render_chat(const ChatTemplateConfig& config, const ChatRequest& request) {
  const auto rendered = config.render_chat(request, testing::fixed_clock());
  return rendered ? *rendered : testing::describe("render", rendered.error());
}

ChatRequest hello_request() {
  ChatRequest request;
  request.messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  return request;
}

TEST(ChatTemplateConfigTest, ReadsATemplateAndSpecialTokensInEachForm) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(R"({
      "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}[{{ unk_token }}]",
      "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
      "eos_token": "</s>", "unk_token": null,
      "additional_special_tokens": ["<a>", {"content": "<b>"}]})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  EXPECT_TRUE(config->has_template());
  EXPECT_EQ(render_chat(*config, hello_request()), "<s>hi</s>[]");
  EXPECT_EQ(config->special_tokens(),
            ordered_json::parse(R"({"bos_token": "<s>", "eos_token": "</s>",
                                    "additional_special_tokens": ["<a>", "<b>"]})"));
}

TEST(ChatTemplateConfigTest, ContextHasTheRequestsFieldsAsTransformersPassesThem) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(R"({
      "chat_template": "{{ messages | length }}|{{ tools is defined }}{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}"})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  ChatRequest request = hello_request();
  request.add_generation_prompt = true;
  request.extra_kwargs = ordered_json{{"enable_thinking", false}};
  EXPECT_EQ(render_chat(*config, request), "1|truetrue|true|true|false");
}

TEST(ChatTemplateConfigTest, ExtraKwargsOverrideSpecialTokensButNotTheRequestsFields) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(
      ordered_json::parse(R"({"chat_template": "{{ bos_token }}", "bos_token": "<s>"})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  ChatRequest request = hello_request();
  request.extra_kwargs = ordered_json{{"bos_token", "<start>"}};
  EXPECT_EQ(render_chat(*config, request), "<start>");
  request.extra_kwargs = ordered_json{{"messages", ordered_json::array()}};
  EXPECT_EQ(render_chat(*config, request),
            "render error, line 0: extra template kwargs may not set 'messages', the request's own "
            "field");
}

TEST(ChatTemplateConfigTest, NamedTemplatesPickDefaultToolUseOrTheRequestedOne) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(R"({
      "chat_template": [{"name": "default", "template": "default"},
                        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
                        {"name": "rag", "template": "rag"}]})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  EXPECT_EQ(config->template_names(), (std::vector<std::string>{"default", "tool_use", "rag"}));
  ChatRequest request = hello_request();
  EXPECT_EQ(render_chat(*config, request), "default");
  request.tools = ordered_json::parse(R"([{"type": "function"}])");
  EXPECT_EQ(render_chat(*config, request), "tools:1");
  request.template_name = "rag";
  EXPECT_EQ(render_chat(*config, request), "rag");
  request.template_name = "missing";
  EXPECT_EQ(render_chat(*config, request),
            "render error, line 0: no chat template named 'missing'");
}

TEST(ChatTemplateConfigTest, NamedTemplatesWithoutDefaultNeedAName) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(
      ordered_json::parse(R"({"chat_template": [{"name": "rag", "template": "rag"}]})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  EXPECT_EQ(render_chat(*config, hello_request()),
            "render error, line 0: the tokenizer config has several chat templates and no "
            "\"default\" one; name one");
}

TEST(ChatTemplateConfigTest, ConfigWithoutTemplateRendersAClearError) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(
      ordered_json::parse(R"({"bos_token": "<s>", "chat_template": null})"));
  ASSERT_TRUE(config.has_value()) << config.error().message;
  EXPECT_FALSE(config->has_template());
  EXPECT_EQ(render_chat(*config, hello_request()),
            "render error, line 0: the tokenizer config has no chat_template: this model cannot "
            "render chats");
}

TEST(ChatTemplateConfigTest, TemplateThatDoesNotParseFailsTheConfigNamingIt) {
  const auto config = ChatTemplateConfig::from_tokenizer_config(ordered_json::parse(R"({
      "chat_template": [{"name": "default", "template": "ok"},
                        {"name": "broken", "template": "\n{{ x | nope }}"}]})"));
  ASSERT_FALSE(config.has_value());
  EXPECT_EQ(testing::describe("config", config.error()),
            "config error, line 2: chat template 'broken': unknown filter 'nope'");
}

TEST(ChatTemplateConfigTest, MalformedConfigsFail) {
  EXPECT_FALSE(ChatTemplateConfig::from_tokenizer_config(ordered_json::array()).has_value());
  EXPECT_FALSE(
      ChatTemplateConfig::from_tokenizer_config(ordered_json{{"chat_template", 3}}).has_value());
  EXPECT_FALSE(ChatTemplateConfig::from_tokenizer_config(
                   ordered_json::parse(R"({"chat_template": [{"name": "x"}]})"))
                   .has_value());
}

}  // namespace
}  // namespace kvr::chat_template
