// The chat-template renderer's bounds on what it walks recursively: values nested deeper than
// kMaxValueDepth (a client's tool schema, a list the template made to hold itself), template
// source nested deeper than kMaxTemplateNesting, and renders nested deeper than kMaxRenderNesting
// fail with a TemplateError, while what stays within them renders as before. The deepest of each
// runs on a thread with a stack of a quarter of a default thread's, its use measured.
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/stack_use.hpp"
#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;
using testing::render;

std::string repeated(std::string_view text, int times) {
  std::string out;
  out.reserve(text.size() * static_cast<std::size_t>(times));
  for (int i = 0; i < times; ++i) out += text;
  return out;
}

// A list holding a list ... `levels` deep, the innermost empty: "[[[]]]" is three levels.
std::string nested_lists(int levels) { return repeated("[", levels) + repeated("]", levels); }

// {"x": <nested_lists(levels)>}, parsed by nlohmann (which does not recurse).
ordered_json context_with_nested_x(int levels) {
  return ordered_json{{"x", ordered_json::parse(nested_lists(levels))}};
}

std::string too_deep_to(std::string_view walk) {
  return fmt::format(
      "render error, line 1: cannot {} a value nested deeper than {} levels of lists "
      "and dicts",
      walk, kMaxValueDepth);
}

const std::string kTemplateTooDeep =
    fmt::format("the template nests deeper than {} levels", kMaxTemplateNesting);

// ---- values
// ---------------------------------------------------------------------------------------

TEST(ChatTemplateNestingTest, AValueAsDeepAsTheLimitIsWrittenAsJson) {
  EXPECT_EQ(render("{{ x | tojson }}", context_with_nested_x(kMaxValueDepth)),
            nested_lists(kMaxValueDepth));
  EXPECT_EQ(render("{{ x }}", context_with_nested_x(kMaxValueDepth)), nested_lists(kMaxValueDepth));
}

TEST(ChatTemplateNestingTest, TojsonOfAClientsDeeplyNestedValueFailsTheRender) {
  EXPECT_EQ(render("{{ x | tojson }}", context_with_nested_x(kMaxValueDepth + 1)),
            too_deep_to("write"));
  EXPECT_EQ(render("{{ x | tojson(indent=2) }}", context_with_nested_x(40'000)),
            too_deep_to("write"));
  EXPECT_EQ(render("{{ x }}", context_with_nested_x(40'000)), too_deep_to("write"));
  EXPECT_EQ(render("{{ x | string }}", context_with_nested_x(40'000)), too_deep_to("write"));
}

TEST(ChatTemplateNestingTest, ADeepObjectInsideAListTheTemplateBuiltFailsTheRender) {
  ordered_json schema = ordered_json::object();
  for (int level = 0; level < 40'000; ++level) {
    schema = ordered_json{{"type", "object"}, {"properties", {{"a", std::move(schema)}}}};
  }
  EXPECT_EQ(render("{{ [{'tool': x}] | tojson }}", ordered_json{{"x", std::move(schema)}}),
            too_deep_to("write"));
}

TEST(ChatTemplateNestingTest, ComparingDeeplyNestedValuesFailsTheRender) {
  ordered_json context = ordered_json::object();
  // Room for both: growing an ordered object copies its members, recursively.
  context.get_ref<ordered_json::object_t&>().reserve(2);
  context["x"] = ordered_json::parse(nested_lists(40'000));
  context["y"] = ordered_json::parse(nested_lists(40'000));
  EXPECT_EQ(render("{{ x == y }}", context), too_deep_to("compare"));
  EXPECT_EQ(render("{{ x < y }}", context), too_deep_to("compare"));
  EXPECT_EQ(render("{{ x in [y] }}", context), too_deep_to("compare"));
  EXPECT_EQ(render("{{ [x, y] | unique | list | length }}", context), too_deep_to("compare"));
  // Within the limit, equal content compares equal.
  context["x"] = ordered_json::parse(nested_lists(kMaxValueDepth));
  context["y"] = ordered_json::parse(nested_lists(kMaxValueDepth));
  EXPECT_EQ(render("{{ x == y }}", context), "true");
}

TEST(ChatTemplateNestingTest, ALongChainOfListsTheTemplateBuiltIsFreedWithoutRecursion) {
  EXPECT_EQ(render("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}"
                   "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | length }}"),
            "1");
}

TEST(ChatTemplateNestingTest, AListThatHoldsItselfFailsToPrintInsteadOfRecursingForever) {
  const std::string holds_itself =
      "{% set a = [1] %}{% set _ = a.append(a) %}{% set b = [1] %}{% set _ = b.append(b) %}";
  EXPECT_EQ(render(holds_itself + "{{ a | tojson }}"), too_deep_to("write"));
  EXPECT_EQ(render(holds_itself + "{{ a }}"), too_deep_to("write"));
  EXPECT_EQ(render(holds_itself + "{{ a == b }}"), too_deep_to("compare"));
  EXPECT_EQ(render(holds_itself + "{{ a < b }}"), too_deep_to("compare"));
  // As in Python, a list is equal to itself without a look inside.
  EXPECT_EQ(render(holds_itself + "{{ a == a }} {{ a == [1, a] }}"), "true true");
}

// ---- template source ---------------------------------------------------------------------------

TEST(ChatTemplateNestingTest, SourceNestedWithinTheLimitRendersAsBefore) {
  const int depth = kMaxTemplateNesting - 1;
  EXPECT_EQ(render("{{ " + repeated("(", depth - 1) + "7" + repeated(")", depth - 1) + " }}"), "7");
  EXPECT_EQ(render(repeated("{% if true %}", depth - 1) + "x" + repeated("{% endif %}", depth - 1)),
            "x");
  EXPECT_EQ(render("{{ 9" + repeated(" - 1", depth - 1) + " }}"), std::to_string(9 - depth + 1));
  EXPECT_EQ(render("{{ " + nested_lists(depth - 1) + " | tojson }}"), nested_lists(depth - 1));
  // A chain of + or ~ is flat, however long.
  EXPECT_EQ(render("{{ 'a'" + repeated(" ~ 'b'", 10'000) + " }}"), "a" + repeated("b", 10'000));
}

TEST(ChatTemplateNestingTest, SourceNestedDeeperThanTheLimitFailsTheParse) {
  const auto parse_error = [](const std::string& source) {
    const auto parsed = ChatTemplate::parse(source);
    return parsed ? std::string{"parsed"} : parsed.error().message;
  };
  // Fifty times the limit: the parse stops at the limit, whatever follows.
  constexpr int kDeep = 5'000;
  EXPECT_EQ(parse_error("{{ " + repeated("(", kDeep) + "1" + repeated(")", kDeep) + " }}"),
            kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ " + nested_lists(kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ " + repeated("{'a': ", kDeep) + "1" + repeated("}", kDeep) + " }}"),
            kTemplateTooDeep);
  EXPECT_EQ(parse_error(repeated("{% if true %}", kDeep) + repeated("{% endif %}", kDeep)),
            kTemplateTooDeep);
  EXPECT_EQ(parse_error(repeated("{% for x in y %}", kDeep) + repeated("{% endfor %}", kDeep)),
            kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ 1" + repeated(" - 1", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated(".a", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated("[0]", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated("()", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated(" | string", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated(" is defined", kDeep) + " }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ " + repeated("not ", kDeep) + "x }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ " + repeated("- ", kDeep) + "x }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ " + repeated("x if y else ", kDeep) + "z }}"), kTemplateTooDeep);
  EXPECT_EQ(parse_error("{{ x" + repeated(" and x", kDeep) + " }}"), kTemplateTooDeep);
  // The error names the line where the nesting went too deep.
  const auto parsed = ChatTemplate::parse("\n\n{{ " + nested_lists(kDeep) + " }}");
  ASSERT_FALSE(parsed);
  EXPECT_EQ(parsed.error().line, 3);
}

// ---- renders
// -------------------------------------------------------------------------------------

// A macro that calls itself `levels` times from inside `blocks` nested ifs.
std::string recursive_macro(int blocks, int levels) {
  return "{% macro r(n) %}{% if n > 0 %}" + repeated("{% if true %}", blocks) + "{{ r(n - 1) }}" +
         repeated("{% endif %}", blocks) + "{% else %}done{% endif %}{% endmacro %}{{ r(" +
         std::to_string(levels) + ") }}";
}

// A macro that calls itself `levels` times from inside a loop, through a filter and a call block.
std::string recursive_loop(int levels) {
  return "{% macro r(n) %}{% for i in [n] if i > 0 %}{% set s = (i | string) ~ '' %}"
         "{% call(x) w() %}{{ r(n - 1) | trim }}{% endcall %}{% else %}done{% endfor %}"
         "{% endmacro %}{% macro w() %}{{ caller(1) }}{% endmacro %}{{ r(" +
         std::to_string(levels) + ") }}";
}

const std::string kRenderTooDeep = fmt::format(
    "render error, line 1: the template nests deeper than {} levels as it renders (recursion?)",
    kMaxRenderNesting);

TEST(ChatTemplateNestingTest, ARenderNestedDeeperThanTheLimitFails) {
  // Each call nests its body's blocks inside the caller's: 90 calls inside ten blocks each go
  // past the render's limit before the macro-call limit.
  EXPECT_EQ(render(recursive_macro(10, 90)), kRenderTooDeep);
  EXPECT_EQ(render(recursive_macro(0, 90)), "done");
  EXPECT_EQ(render(recursive_macro(0, 200)),
            "render error, line 1: macro calls nested too deep (recursion?)");
}

// ---- the stack the deepest of each uses ---------------------------------------------------------

// The most levels `source(levels)` renders to "done" with, below `from`: one more fails on the
// render's nesting limit or the macro-call limit.
int deepest_rendered(const std::function<std::string(int)>& source, int from) {
  for (int levels = from; levels > 0; --levels) {
    const std::string rendered = render(source(levels));
    if (rendered == "done") {
      const std::string deeper = render(source(levels + 1));
      EXPECT_TRUE(deeper == kRenderTooDeep ||
                  deeper == "render error, line 1: macro calls nested too deep (recursion?)")
          << deeper;
      return levels;
    }
  }
  ADD_FAILURE() << "nothing renders";
  return 0;
}

TEST(ChatTemplateNestingTest, TheDeepestRendersTheLimitsAllowFitAQuarterOfAThreadsStack) {
  const int source_depth = kMaxTemplateNesting - 1;
  const int recursion =
      deepest_rendered([](int levels) { return recursive_macro(10, levels); }, 99);
  const int loop_recursion = deepest_rendered(recursive_loop, 99);
  EXPECT_GT(recursion, 30);
  EXPECT_GT(loop_recursion, 30);
  struct Case {
    std::string name;
    std::string source;
    ordered_json context;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"parentheses",
       "{{ " + repeated("(", source_depth - 1) + "7" + repeated(")", source_depth - 1) + " }}",
       ordered_json::object(), "7"},
      {"blocks",
       repeated("{% if true %}", source_depth - 1) + "x" +
           repeated("{% endif %}", source_depth - 1),
       ordered_json::object(), "x"},
      {"operators", "{{ 9" + repeated(" - 1", source_depth - 1) + " }}", ordered_json::object(),
       std::to_string(9 - source_depth + 1)},
      {"recursion in blocks", recursive_macro(10, recursion), ordered_json::object(), "done"},
      {"recursion in loops", recursive_loop(loop_recursion), ordered_json::object(), "done"},
      {"tojson", "{{ x | tojson(indent=1) | length > 0 }}", context_with_nested_x(kMaxValueDepth),
       "true"},
      {"equality", "{{ x == y }}",
       ordered_json{{"x", ordered_json::parse(nested_lists(kMaxValueDepth))},
                    {"y", ordered_json::parse(nested_lists(kMaxValueDepth))}},
       "true"},
  };
  for (const Case& deepest : cases) {
    std::string rendered;
    const auto used =
        kvr::testing::stack_used_by([&] { rendered = render(deepest.source, deepest.context); },
                                    kvr::testing::kQuarterOfAThreadStack);
    ASSERT_TRUE(used) << deepest.name;
    EXPECT_EQ(rendered, deepest.expected) << deepest.name;
    std::cout << "[ stack    ] " << deepest.name << ": " << *used / 1024 << " KiB\n";
  }
}

}  // namespace
}  // namespace kvr::chat_template
