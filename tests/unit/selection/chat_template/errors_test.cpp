// Chat-template errors: unsupported constructs fail at parse time naming themselves and their
// line; render errors (raise_exception, type errors) carry their message and line.
#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;
using testing::render;

TEST(ChatTemplateErrorsTest, UnknownFilterFailsAtParseNamingItAndItsLine) {
  EXPECT_EQ(render("line one\n{{ x | frobnicate }}"),
            "parse error, line 2: unknown filter 'frobnicate'");
}

TEST(ChatTemplateErrorsTest, UnknownFilterNamedByStringFailsAtParse) {
  EXPECT_EQ(render("{{ xs | map('nope') | list }}"), "parse error, line 1: unknown filter 'nope'");
  EXPECT_EQ(render("\n{{ xs | selectattr('a', 'nope') | list }}"),
            "parse error, line 2: unknown test 'nope'");
}

TEST(ChatTemplateErrorsTest, UnknownTestFailsAtParse) {
  EXPECT_EQ(render("{% if x is frob %}{% endif %}"), "parse error, line 1: unknown test 'frob'");
}

TEST(ChatTemplateErrorsTest, UnknownAndUnsupportedTagsFailAtParse) {
  EXPECT_EQ(render("a\n\n{% frob %}"), "parse error, line 3: unknown tag 'frob'");
  EXPECT_EQ(render("{% include 'other.jinja' %}"),
            "parse error, line 1: unsupported tag 'include'");
}

TEST(ChatTemplateErrorsTest, UnclosedBlockNamesItsOpeningLine) {
  EXPECT_EQ(render("x\n{% for m in messages %}\n{{ m }}\n"),
            "parse error, line 2: unclosed 'for' block: expected 'else' or 'endfor' before the "
            "end of the template");
  EXPECT_EQ(render("{% if a %}{% elif b %}"),
            "parse error, line 1: unclosed 'if' block: expected 'elif' or 'else' or 'endif' before "
            "the end of the template");
}

TEST(ChatTemplateErrorsTest, StrayEndTagFails) {
  EXPECT_EQ(render("{% endif %}"), "parse error, line 1: unexpected 'endif'");
  EXPECT_EQ(render("{% for x in y %}{% else %}{% elif z %}{% endfor %}"),
            "parse error, line 1: unexpected 'elif'");
}

TEST(ChatTemplateErrorsTest, BreakOutsideALoopFails) {
  EXPECT_EQ(render("{% if true %}{% break %}{% endif %}"),
            "parse error, line 1: 'break' outside a loop");
}

TEST(ChatTemplateErrorsTest, MalformedSourceFails) {
  EXPECT_EQ(render("{{ 'open }}"), "parse error, line 1: unterminated string literal");
  EXPECT_EQ(render("{# open"), "parse error, line 1: unterminated comment: missing '#}'");
  EXPECT_EQ(render("{{ 1 + }}"), "parse error, line 1: unexpected '}}' in an expression");
  EXPECT_EQ(render("{{ a b }}"), "parse error, line 1: expected '}}' but found 'b'");
}

TEST(ChatTemplateErrorsTest, RaiseExceptionFailsTheRenderWithItsMessage) {
  EXPECT_EQ(render("ok\n{% if n > 2 %}{{ raise_exception('Too many turns: ' ~ n) }}{% endif %}",
                   ordered_json{{"n", 3}}),
            "render error, line 2: Too many turns: 3");
}

TEST(ChatTemplateErrorsTest, TypeErrorsNameTheirLine) {
  EXPECT_EQ(render("\n\n{{ 1 + [1] }}"),
            "render error, line 3: unsupported operand type(s) for +: 'int' and 'list'");
  EXPECT_EQ(render("{{ 1 / 0 }}"), "render error, line 1: division by zero");
  EXPECT_EQ(render("{{ 'a' < 1 }}"),
            "render error, line 1: '<' not supported between instances of 'str' and 'int'");
}

TEST(ChatTemplateErrorsTest, CallingAnUndefinedNameFails) {
  EXPECT_EQ(render("{{ nope() }}"), "render error, line 1: 'nope' is undefined");
  EXPECT_EQ(render("{{ 'abc'.nope() }}"),
            "render error, line 1: 'str' object has no attribute 'nope'");
}

TEST(ChatTemplateErrorsTest, MacroArgumentsAreChecked) {
  EXPECT_EQ(render("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "render error, line 1: macro 'm' takes not more than 1 argument(s)");
  EXPECT_EQ(render("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}"),
            "render error, line 1: macro 'm' takes no keyword argument 'b'");
}

TEST(ChatTemplateErrorsTest, AssigningAnAttributeNeedsANamespace) {
  EXPECT_EQ(render("{% set d = {} %}{% set d.x = 1 %}"),
            "render error, line 1: cannot assign attribute on non-namespace object 'dict'");
}

TEST(ChatTemplateErrorsTest, ContextMustBeAnObject) {
  const auto parsed = ChatTemplate::parse("x");
  ASSERT_TRUE(parsed.has_value());
  const auto rendered = parsed->render(ordered_json::array());
  ASSERT_FALSE(rendered.has_value());
  EXPECT_EQ(rendered.error().message, "the render context must be a JSON object");
}

}  // namespace
}  // namespace kvr::chat_template
