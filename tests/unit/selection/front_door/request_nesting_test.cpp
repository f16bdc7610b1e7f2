// What a client's body may nest and how it must be written, checked where the front doors parse it
// (parse_generation_request) and where the native tokenizer turns it into a chat
// (PromptTokenizer::chat_from_openai): a body nested deeper than the limit (a tool's parameters,
// tool-call arguments as an object or as a JSON string, any other field) is a 400 naming the
// field, what stays within it renders as before, both parsers take and refuse the same bodies
// (a lone UTF-16 surrogate, JSON that only a lazy parser would skip over), and errors quote only
// so much of what a client sent.
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "messages/metrics/metrics_registry.hpp"
#include "selection/front_door/openai_api.hpp"
#include "selection/front_door/prompt_renderer.hpp"
#include "selection/tokenizer/prompt_tokenizer.hpp"
#include "tests/testing/stack_use.hpp"

namespace kvr::front_door {
namespace {

using Ordered = nlohmann::ordered_json;
using tokenizer::kDefaultMaxJsonDepth;
using tokenizer::PromptTokenizer;

constexpr int kHostileDepth = 40'000;

std::string repeated(std::string_view text, int times) {
  std::string out;
  out.reserve(text.size() * static_cast<std::size_t>(times));
  for (int i = 0; i < times; ++i) out += text;
  return out;
}

// {"a": {"a": ... {}}}, `levels` objects deep.
std::string nested_object(int levels) {
  return repeated(R"({"a":)", levels - 1) + "{}" + repeated("}", levels - 1);
}

// [[ ... ]], `levels` arrays deep.
std::string nested_array(int levels) { return repeated("[", levels) + repeated("]", levels); }

// A chat whose one tool's parameters are `parameters` (JSON text): they sit five levels deep
// (the body, tools, the tool, function, parameters).
std::string chat_with_tool_schema(const std::string& parameters) {
  return R"({"model":"m","messages":[{"role":"user","content":"Weather?"}],)"
         R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":)" +
         parameters + "}}]}";
}

// A chat whose assistant turn calls a tool with `arguments` (JSON text: an object, or a string
// holding one), written under `key`: they sit seven levels deep.
std::string chat_with_tool_call(const std::string& arguments, std::string_view key = "arguments") {
  return R"({"model":"m","messages":[{"role":"user","content":"Weather?"},)"
         R"({"role":"assistant","content":"","tool_calls":[{"id":"call1","type":"function",)"
         R"("function":{"name":"get_weather",")" +
         std::string{key} + R"(":)" + arguments + "}}]}]}";
}

// `value` as a JSON string literal.
std::string as_string(const std::string& value) { return Ordered(value).dump(); }

std::string too_deep(std::string_view field, int max_depth = kDefaultMaxJsonDepth) {
  return tokenizer::nested_too_deep_message(field, max_depth);
}

// The error of a chat body, or nullopt when it is accepted.
std::optional<HttpError> chat_error(const std::string& body, int max_depth = kDefaultMaxJsonDepth) {
  auto request =
      parse_generation_request(Endpoint::chat_completions, body, PromptTextUse::skip, max_depth);
  if (request) return std::nullopt;
  return request.error();
}

// What chat_from_openai says of a body, or "ok".
std::string native_verdict(const std::string& body, int max_depth = kDefaultMaxJsonDepth) {
  const auto chat = PromptTokenizer::chat_from_openai(Ordered::parse(body), max_depth);
  return chat ? std::string{"ok"} : chat.error().message;
}

// ---- nesting
// --------------------------------------------------------------------------------------

TEST(RequestNestingTest, AToolSchemaNestedTooDeepIsA400NamingIt) {
  const std::string body = chat_with_tool_schema(nested_object(kHostileDepth));
  const auto error = chat_error(body);
  ASSERT_TRUE(error);
  EXPECT_EQ(error->status, 400u);
  EXPECT_EQ(error->type, "invalid_request_error");
  EXPECT_EQ(error->param, "tools[0].function.parameters");
  EXPECT_EQ(error->message, too_deep("tools[0].function.parameters"));
  EXPECT_EQ(native_verdict(body), too_deep("tools[0].function.parameters"));
}

TEST(RequestNestingTest, ToolCallArgumentsNestedTooDeepAreA400NamingThemAsObjectOrString) {
  const std::string field = "messages[1].tool_calls[0].function.arguments";
  for (const std::string& body :
       {chat_with_tool_call(nested_object(kHostileDepth)),
        chat_with_tool_call(as_string(nested_object(kHostileDepth))),
        chat_with_tool_call(as_string(nested_array(kHostileDepth))),
        // The key spelled with an escape is the same key.
        chat_with_tool_call(as_string(nested_object(kHostileDepth)), R"(argum\u0065nts)")}) {
    const auto error = chat_error(body);
    ASSERT_TRUE(error) << body.substr(0, 300);
    EXPECT_EQ(error->param, field);
    EXPECT_EQ(error->message, too_deep(field));
    EXPECT_EQ(native_verdict(body), too_deep(field));
  }
}

TEST(RequestNestingTest, DeepNestingAnywhereElseInTheBodyIsA400NamingItsField) {
  const std::string deep = nested_array(kHostileDepth);
  const std::string chat_start = R"({"model":"m","messages":[{"role":"user","content":"hi"}])";
  const std::vector<std::pair<std::string, std::string>> bodies = {
      {R"({"model":"m","messages":[{"role":"user","content":)" + deep + "}]}",
       "messages[0].content"},
      {R"({"model":"m","messages":[{"role":"user","content":"hi","name":)" + deep + "}]}",
       "messages[0].name"},
      {chat_start + R"(,"response_format":{"type":"json_schema","json_schema":)" + deep + "}}",
       "response_format"},
      {chat_start + R"(,"metadata":{"note":)" + deep + "}}", "metadata"},
      {chat_start + R"(,"x_unknown_extra":)" + deep + "}", "x_unknown_extra"},
      {chat_start + R"(,"chat_template_kwargs":{"enable_thinking":)" + deep + "}}",
       "chat_template_kwargs.enable_thinking"},
      {chat_start + R"(,"tools":[{"type":"function","extra":)" + deep + "}]}", "tools[0].extra"},
      {deep, ""},
  };
  for (const auto& [body, field] : bodies) {
    const auto error = chat_error(body);
    ASSERT_TRUE(error) << field;
    EXPECT_EQ(error->status, 400u) << field;
    EXPECT_EQ(error->param, field);
    EXPECT_EQ(error->message, too_deep(field));
  }
  // Where the body starts to nest, it is named by its first step past the body's structure.
  EXPECT_EQ(native_verdict(bodies[0].first), too_deep("messages[0].content"));
  const auto completion =
      parse_generation_request(Endpoint::completions, R"({"model":"m","prompt":)" + deep + "}");
  ASSERT_FALSE(completion);
  EXPECT_EQ(completion.error().param, "prompt");
}

TEST(RequestNestingTest, BothParsersAcceptUpToTheLimitAndRefuseOneLevelMore) {
  // The parameters start on level 5 of the body, the arguments (once parsed) on level 7.
  const int schema_levels = kDefaultMaxJsonDepth - 4;
  const int argument_levels = kDefaultMaxJsonDepth - 6;
  const std::string schema_field = "tools[0].function.parameters";
  const std::string arguments_field = "messages[1].tool_calls[0].function.arguments";
  EXPECT_EQ(chat_error(chat_with_tool_schema(nested_object(schema_levels))), std::nullopt);
  EXPECT_EQ(native_verdict(chat_with_tool_schema(nested_object(schema_levels))), "ok");
  EXPECT_EQ(chat_error(chat_with_tool_schema(nested_object(schema_levels + 1)))->param,
            schema_field);
  EXPECT_EQ(native_verdict(chat_with_tool_schema(nested_object(schema_levels + 1))),
            too_deep(schema_field));
  for (const auto& arguments :
       {nested_object(argument_levels), as_string(nested_object(argument_levels))}) {
    EXPECT_EQ(chat_error(chat_with_tool_call(arguments)), std::nullopt) << arguments;
    EXPECT_EQ(native_verdict(chat_with_tool_call(arguments)), "ok");
  }
  for (const auto& arguments :
       {nested_object(argument_levels + 1), as_string(nested_object(argument_levels + 1))}) {
    EXPECT_EQ(chat_error(chat_with_tool_call(arguments))->param, arguments_field) << arguments;
    EXPECT_EQ(native_verdict(chat_with_tool_call(arguments)), too_deep(arguments_field));
  }
  // Arguments that are not JSON stay a string, however many brackets they open.
  const std::string not_json = as_string(nested_array(50) + "x");
  EXPECT_EQ(chat_error(chat_with_tool_call(not_json)), std::nullopt);
  EXPECT_EQ(native_verdict(chat_with_tool_call(not_json)), "ok");
}

TEST(RequestNestingTest, TheLimitIsASettingBoundedByTheCeiling) {
  const std::string body = chat_with_tool_schema(nested_object(300));
  EXPECT_EQ(chat_error(body)->param, "tools[0].function.parameters");
  EXPECT_EQ(chat_error(body, 400), std::nullopt);
  EXPECT_EQ(native_verdict(body, 400), "ok");
  EXPECT_EQ(chat_error(chat_with_tool_schema(nested_object(17)), 20)->message,
            too_deep("tools[0].function.parameters", 20));
  // Above the ceiling a setting counts as the ceiling.
  const std::string hostile = chat_with_tool_schema(nested_object(kHostileDepth));
  EXPECT_EQ(chat_error(hostile, 1'000'000)->message,
            too_deep("tools[0].function.parameters", tokenizer::kMaxJsonDepthCeiling));
  EXPECT_EQ(native_verdict(hostile, 1'000'000),
            too_deep("tools[0].function.parameters", tokenizer::kMaxJsonDepthCeiling));
}

// The bundled Qwen3 tokenizer, whose template writes tools and tool-call arguments with tojson.
std::shared_ptr<const PromptTokenizer> qwen3() {
  static const auto loaded = PromptTokenizer::load(std::string{KVR_TOKENIZERS_DIR} + "/qwen3");
  return loaded ? *loaded : nullptr;
}

// `{"a": {"a": ... {}}}` as json.dumps writes it (tojson).
std::string dumped_nested_object(int levels) {
  return repeated(R"({"a": )", levels - 1) + "{}" + repeated("}", levels - 1);
}

TEST(RequestNestingTest, ToolsAndArgumentsNestedTwentyAndAHundredLevelsRenderAsBefore) {
  const auto tokenizer = qwen3();
  if (!tokenizer) GTEST_SKIP() << "the bundled qwen3 tokenizer is not unpacked";
  for (const int levels : {20, 100}) {
    const std::string schema = chat_with_tool_schema(nested_object(levels));
    ASSERT_EQ(chat_error(schema), std::nullopt) << levels;
    auto chat = PromptTokenizer::chat_from_openai(Ordered::parse(schema));
    ASSERT_TRUE(chat) << chat.error().message;
    auto rendered = tokenizer->encode_chat(*chat);
    ASSERT_TRUE(rendered) << rendered.error().message;
    EXPECT_NE(rendered->text.find(R"("parameters": )" + dumped_nested_object(levels) + "}}"),
              std::string::npos)
        << rendered->text;
    EXPECT_FALSE(rendered->ids.empty());

    const int argument_levels = std::min(levels, kDefaultMaxJsonDepth - 6);
    for (const auto& arguments :
         {nested_object(argument_levels), as_string(nested_object(argument_levels))}) {
      const std::string call = chat_with_tool_call(arguments);
      ASSERT_EQ(chat_error(call), std::nullopt) << levels;
      auto call_chat = PromptTokenizer::chat_from_openai(Ordered::parse(call));
      ASSERT_TRUE(call_chat) << call_chat.error().message;
      auto call_rendered = tokenizer->encode_chat(*call_chat);
      ASSERT_TRUE(call_rendered) << call_rendered.error().message;
      EXPECT_NE(
          call_rendered->text.find(R"("arguments": )" + dumped_nested_object(argument_levels)),
          std::string::npos)
          << call_rendered->text;
    }
  }
}

// Everything a node does with a chat body, on the deepest body a setting may allow: checked,
// made into the engine's /tokenize body, copied, compared, printed, made into a chat and rendered.
TEST(RequestNestingTest, TheDeepestBodyTheCeilingAllowsFitsAQuarterOfAThreadsStack) {
  const auto tokenizer = qwen3();
  if (!tokenizer) GTEST_SKIP() << "the bundled qwen3 tokenizer is not unpacked";
  constexpr int kCeiling = tokenizer::kMaxJsonDepthCeiling;
  const std::string body = chat_with_tool_schema(nested_object(kCeiling - 4));
  std::string rendered;
  std::string failure;
  const auto used = kvr::testing::stack_used_by(
      [&] {
        if (auto error = chat_error(body, kCeiling)) failure = error->message;
        if (tokenize_request_body(true, body).size() < body.size() / 2) failure += " tokenize";
        const Ordered parsed = Ordered::parse(body);
        const Ordered copy = parsed;
        if (copy != parsed || copy.dump().size() != body.size()) failure += " copy";
        auto chat = PromptTokenizer::chat_from_openai(parsed, kCeiling);
        if (!chat) {
          failure += chat.error().message;
          return;
        }
        auto encoded = tokenizer->encode_chat(*chat);
        if (!encoded) {
          failure += encoded.error().message;
          return;
        }
        rendered = std::move(encoded->text);
      },
      kvr::testing::kQuarterOfAThreadStack);
  ASSERT_TRUE(used);
  EXPECT_EQ(failure, "");
  EXPECT_NE(rendered.find(dumped_nested_object(kCeiling - 4)), std::string::npos);
  std::cout << "[ stack    ] a body " << kCeiling << " levels deep: " << *used / 1024 << " KiB\n";
}

// ---- how the body is written
// ----------------------------------------------------------------------

TEST(RequestJsonTest, ALoneSurrogateIsA400SayingSoAndNamingItsField) {
  const auto content_error = [](std::string_view content) {
    return chat_error(R"({"model":"m","messages":[{"role":"user","content":")" +
                      std::string{content} + R"("}]})");
  };
  const auto high = content_error(R"(Hello \ud800 world)");
  ASSERT_TRUE(high);
  EXPECT_EQ(high->status, 400u);
  EXPECT_EQ(high->param, "messages[0].content");
  EXPECT_EQ(high->message,
            "invalid JSON at byte 57 (in messages[0].content): \\ud800 is a lone UTF-16 surrogate "
            "(a high surrogate must be followed by a low one, \\udc00 to \\udfff)");
  const auto low = content_error(R"(\uDC00)");
  ASSERT_TRUE(low);
  EXPECT_EQ(low->param, "messages[0].content");
  EXPECT_NE(low->message.find("\\udc00 is a lone UTF-16 surrogate"), std::string::npos)
      << low->message;
  for (const char* lone : {R"(\ud800\u0041)", R"(\ud800\n)", R"(\udbff)", R"(\ud800\ud800)"}) {
    EXPECT_TRUE(content_error(lone)) << lone;
  }
  // A pair is one character.
  EXPECT_EQ(content_error(R"(\ud83d\ude00)"), std::nullopt);
  // In a field routing never reads, too.
  const auto unread = chat_error(
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"metadata":{"note":"\udfff"}})");
  ASSERT_TRUE(unread);
  EXPECT_EQ(unread->param, "metadata");
}

TEST(RequestJsonTest, ANumberBeyondADoublesRangeIsA400LikeNlohmannsRefusal) {
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"hi"}],"x":)";
  for (const char* number : {"1e400", "-1e4007", "1E+309"}) {
    const auto error = chat_error(chat + number + "}");
    ASSERT_TRUE(error) << number;
    EXPECT_EQ(error->status, 400u);
    EXPECT_NE(error->message.find("a number out of range"), std::string::npos) << error->message;
    EXPECT_TRUE(nlohmann::json::parse(chat + number + "}", nullptr, false).is_discarded());
  }
  // Within range, however spelled: both take it.
  for (const char* number : {"1e308", "1e-400", "18446744073709551616", "-0.5E3"}) {
    EXPECT_EQ(chat_error(chat + number + "}"), std::nullopt) << number;
    EXPECT_FALSE(nlohmann::json::parse(chat + number + "}", nullptr, false).is_discarded());
  }
}

// Each body is a request both readers would take but for what it shows; the front door takes it
// exactly when nlohmann (the native tokenizer's reader) does.
TEST(RequestJsonTest, TheFrontDoorAndTheNativeTokenizerTakeTheSameBodies) {
  const std::string head = R"({"model":"m","messages":[{"role":"user","content":"hi"}],"x":)";
  const std::vector<std::string> values = {
      // Refused by both.
      "[1,]",
      "[,1]",
      "{\"a\":1,}",
      "{\"a\" 1}",
      "{1:2}",
      "01",
      "1.",
      ".5",
      "-",
      "1e",
      "+1",
      "tru",
      "nul",
      "True",
      "NaN",
      "Infinity",
      "'x'",
      "\"\\x\"",
      "\"\\u12\"",
      "\"\\ud800\"",
      "\"\\udc00x\"",
      "\"a\tb\"",
      "\"a\nb\"",
      "[1 2]",
      "{\"a\":1 \"b\":2}",
      "",
      // Taken by both.
      "[1,2]",
      "{\"a\":1}",
      "0",
      "-0.5e+3",
      "1E9",
      "true",
      "null",
      "\"\\u00e9\\/\\\\\\\"\"",
      "\"\\ud83d\\ude00\"",
      "\"\\u0000\"",
      "[]",
      "{}",
      " [ 1 , { } ] ",
  };
  for (const std::string& value : values) {
    const std::string body = head + value + "}";
    const bool nlohmann_takes = !Ordered::parse(body, nullptr, false).is_discarded();
    const auto error = chat_error(body);
    EXPECT_EQ(!error.has_value(), nlohmann_takes) << value << ": " << (error ? error->message : "");
    if (error) {
      EXPECT_EQ(error->param, "x") << value;
    }
  }
  for (const std::string& tail : {std::string{"} x"}, std::string{"}}"}, std::string{"},"}}) {
    const std::string body = head + "1" + tail;
    EXPECT_TRUE(Ordered::parse(body, nullptr, false).is_discarded()) << tail;
    EXPECT_TRUE(chat_error(body)) << tail;
  }
  const auto trailing = chat_error(head + "1} x");
  ASSERT_TRUE(trailing);
  EXPECT_EQ(trailing->param, "");
  EXPECT_EQ(trailing->message, "invalid JSON at byte 64: more follows the JSON value");
  // Bytes are counted in the body as sent, also when a prompt of token ids was read ahead.
  const auto after_ids = parse_generation_request(
      Endpoint::completions, R"({"model":"m","prompt":[1,2,3,4,5],"max_tokens":01})");
  ASSERT_FALSE(after_ids);
  EXPECT_EQ(after_ids.error().message,
            "invalid JSON at byte 48 (in max_tokens): ',' or '}' is expected");
}

TEST(RequestJsonTest, TheNativeRendererSaysWhyItsParserRefusesABody) {
  const auto tokenizer = qwen3();
  if (!tokenizer) GTEST_SKIP() << "the bundled qwen3 tokenizer is not unpacked";
  auto tokenizers = std::make_shared<NativeTokenizers>();
  tokenizers->emplace("m", tokenizer);
  PromptRenderer renderer{selection::TokenizerModes{}, 1, std::chrono::seconds{10},
                          std::make_shared<metrics::MetricsRegistry>(), tokenizers};
  boost::asio::io_context io;
  // A body the front door refuses: were it passed on, the renderer would name its fault.
  const std::string body = R"({"model":"m","messages":[{"role":"user","content":"\ud800"}]})";
  GenerationRequest request;
  request.model = "m";
  std::optional<RenderResult> result;
  renderer.render(io.get_executor(), request, body, {},
                  [&](RenderResult rendered) { result = std::move(rendered); });
  ASSERT_TRUE(result);
  ASSERT_FALSE(*result);
  EXPECT_EQ(result->error().status, 400u);
  EXPECT_TRUE(result->error().message.starts_with("cannot tokenize the prompt: invalid JSON: "))
      << result->error().message;
  EXPECT_NE(result->error().message.find("surrogate"), std::string::npos)
      << result->error().message;
}

TEST(RequestJsonTest, MaxTokensAboveTheLimitIsRefusedNamingTheLimit) {
  for (const std::string name : {"max_tokens", "max_completion_tokens"}) {
    const auto error = parse_generation_request(
        Endpoint::completions, R"({"model":"m","prompt":"x",")" + name + R"(":4294967296})");
    ASSERT_FALSE(error) << name;
    EXPECT_EQ(error.error().param, name);
    EXPECT_EQ(error.error().message,
              name + ": a positive integer no larger than 4294967295 is required");
  }
  EXPECT_TRUE(parse_generation_request(Endpoint::completions,
                                       R"({"model":"m","prompt":"x","max_tokens":4294967295})"));
}

// ---- quoting a client's input
// ---------------------------------------------------------------------

TEST(QuoteForErrorTest, ALongInputIsCutAtACharactersStart) {
  EXPECT_EQ(quote_for_error("gpt-4o"), "gpt-4o");
  EXPECT_EQ(quote_for_error(std::string(kMaxQuotedBytes, 'm')), std::string(kMaxQuotedBytes, 'm'));
  const std::string long_name(100'000, 'm');
  EXPECT_EQ(quote_for_error(long_name), std::string(kMaxQuotedBytes, 'm') + "…");
  // "é" is two bytes: 255 bytes of them would split the 128th.
  std::string accents = "x";
  for (int i = 0; i < 200; ++i) accents += "é";
  const std::string quoted = quote_for_error(accents);
  EXPECT_EQ(quoted, accents.substr(0, kMaxQuotedBytes - 1) + "…");
  EXPECT_EQ(quote_for_error("abcdef", 3), "abc…");
}

TEST(QuoteForErrorTest, AnErrorQuotingBytesThatAreNotUtf8IsStillJson) {
  const HttpError error{.status = 404, .message = "no endpoint /\x97\xff", .code = "unknown_url"};
  const auto parsed = nlohmann::json::parse(error.body(), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(parsed.is_discarded()) << error.body();
  const auto message = parsed["error"]["message"].get<std::string>();
  EXPECT_TRUE(message.starts_with("no endpoint /\uFFFD")) << message;
}

TEST(RequestJsonTest, AnAddGenerationPromptThatIsNotABooleanIsRefusedNamingIt) {
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  EXPECT_EQ(native_verdict(chat + R"("add_generation_prompt":"yes"})"),
            "add_generation_prompt: must be a boolean");
  EXPECT_EQ(native_verdict(chat + R"("add_generation_prompt":false})"), "ok");
  EXPECT_EQ(native_verdict(chat + R"("add_generation_prompt":null})"), "ok");
}

TEST(QuoteForErrorTest, ARouteErrorQuotesAtMostAKilobyte) {
  v1::RouteError error;
  error.set_code(v1::ROUTE_ERROR_NO_WORKERS);
  error.set_message("no worker serves model '" + std::string(100'000, 'm') + "'");
  const HttpError http = error_for_route(error);
  EXPECT_EQ(http.status, 503u);
  EXPECT_LE(http.message.size(), 1024u + std::string_view{"…"}.size());
  EXPECT_TRUE(http.message.starts_with("no worker serves model 'mmm"));
  EXPECT_TRUE(http.message.ends_with("…"));
}

}  // namespace
}  // namespace kvr::front_door
