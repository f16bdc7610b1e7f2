// Chat-template expressions: literals, operators, attribute and subscript access, slices,
// comparisons, truthiness and tests, each on a small template.
#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;
using testing::render;

ordered_json message_context() {
  return ordered_json::parse(R"({"message": {"role": "user", "content": "hi"},
                                 "items": [10, 20, 30]})");
}

TEST(ChatTemplateExpressionsTest, LiteralsPrintAsPythonPrintsThem) {
  EXPECT_EQ(render("{{ 1 }}|{{ 1.0 }}|{{ 2.5 }}|{{ 'a' }}|{{ \"b\" }}|{{ 1e3 }}|{{ -4 }}"),
            "1|1.0|2.5|a|b|1000.0|-4");
}

TEST(ChatTemplateExpressionsTest, BooleansAndNonePrintAsHuggingFaceJinjaPrintsThem) {
  EXPECT_EQ(render("{{ true }}|{{ False }}|{{ none }}|{{ None }}|{{ undefined_name }}"),
            "true|false|||");
}

TEST(ChatTemplateExpressionsTest, StringEscapesAreResolved) {
  EXPECT_EQ(render(R"({{ 'it\'s' }}|{{ "tab\there" }}|{{ '\u00e9\x41' }}|{{ 'a' "b" }})"),
            "it's|tab\there|\xC3\xA9"
            "A|ab");
}

TEST(ChatTemplateExpressionsTest, ArithmeticFollowsPython) {
  EXPECT_EQ(
      render("{{ 7 / 2 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|"
             "{{ 0.1 + 0.2 }}|{{ 10 - 2 - 3 }}|{{ 2 + 3 * 4 }}|{{ (2 + 3) * 4 }}|{{ 6 / 3 }}"),
      "3.5|3|-4|2|1024|0.30000000000000004|5|14|20|2.0");
}

TEST(ChatTemplateExpressionsTest, FloatsPrintAsPythonReprDoes) {
  EXPECT_EQ(render("{{ 3.0 }}|{{ 2 * 1.5 }}|{{ 1e16 }}|{{ 0.00001 }}|{{ 123456.789 }}|{{ -0.0 }}"),
            "3.0|3.0|1e+16|1e-05|123456.789|-0.0");
}

TEST(ChatTemplateExpressionsTest, PlusAndTildeConcatenate) {
  EXPECT_EQ(render("{{ 'a' + 'b' + 'c' }}|{{ 'x' ~ 1 ~ none ~ missing }}|{{ 'ab' * 2 }}|"
                   "{{ [1] + [2] }}"),
            "abc|x1None|abab|[1, 2]");
}

TEST(ChatTemplateExpressionsTest, PlusOfAStringAndANonStringFailsAsInPython) {
  EXPECT_EQ(render("{{ 'n' + 1 }}"),
            "render error, line 1: unsupported operand type(s) for +: 'str' and 'int'");
}

TEST(ChatTemplateExpressionsTest, ListsAndDictsPrintAsJson) {
  EXPECT_EQ(render("{{ [1, 'a', none, true] }}|{{ {'k': [1, 2], 'q': 'x'} }}|{{ (1, 2) }}"),
            R"([1, "a", null, true]|{"k": [1, 2], "q": "x"}|[1, 2])");
}

TEST(ChatTemplateExpressionsTest, AttributeAndSubscriptReadTheContext) {
  EXPECT_EQ(render("{{ message.role }}|{{ message['content'] }}|{{ items[0] }}|{{ items[-1] }}|"
                   "{{ items.1 }}",
                   message_context()),
            "user|hi|10|30|20");
}

TEST(ChatTemplateExpressionsTest, MissingAttributeIsUndefined) {
  EXPECT_EQ(render("[{{ message.missing }}]|{{ message.missing is defined }}|"
                   "{{ message.missing.deeper is undefined }}|{{ items[9] is defined }}|"
                   "{% if message.missing %}t{% else %}f{% endif %}",
                   message_context()),
            "[]|false|true|false|f");
}

TEST(ChatTemplateExpressionsTest, SlicesFollowPython) {
  EXPECT_EQ(render("{{ items[1:] }}|{{ items[:-1] }}|{{ items[::-1] }}|{{ items[::2] }}|"
                   "{{ items[5:] }}|{{ items[-2::-1] }}|{{ 'hello'[1:3] }}|{{ 'hello'[::-1] }}",
                   message_context()),
            "[20, 30]|[10, 20]|[30, 20, 10]|[10, 30]|[]|[20, 10]|el|olleh");
}

TEST(ChatTemplateExpressionsTest, StringsIndexByCodePoint) {
  EXPECT_EQ(render("{{ s[1] }}|{{ s[-1] }}|{{ s[::-1] }}|{{ s | length }}",
                   ordered_json{{"s", "h\xC3\xA9llo"}}),
            "\xC3\xA9|o|oll\xC3\xA9h|5");
}

TEST(ChatTemplateExpressionsTest, ComparisonsAndMembership) {
  EXPECT_EQ(render("{{ 1 == 1.0 }}|{{ 'a' != 'b' }}|{{ 2 < 3 }}|{{ 'b' >= 'a' }}|"
                   "{{ 'ell' in 'hello' }}|{{ 2 in items }}|{{ 20 in items }}|"
                   "{{ 'role' in message }}|{{ 'x' not in message }}|{{ [1, 2] < [1, 3] }}",
                   message_context()),
            "true|true|true|true|true|false|true|true|true|true");
}

TEST(ChatTemplateExpressionsTest, EqualityComparesContentAsPythonDoes) {
  EXPECT_EQ(render("{{ message == {'content': 'hi', 'role': 'user'} }}|{{ items == [10, 20, 30] }}|"
                   "{{ message == {'role': 'user'} }}|{{ 1 == true }}|{{ none == none }}",
                   message_context()),
            "true|true|false|true|true");
}

TEST(ChatTemplateExpressionsTest, AndOrReturnTheirOperands) {
  EXPECT_EQ(render("{{ [] or 'empty' }}|{{ 0 and 1 }}|{{ 'a' and 'b' }}|{{ not '' }}|"
                   "{{ not missing is defined }}"),
            "empty|0|b|true|true");
}

TEST(ChatTemplateExpressionsTest, TruthinessFollowsPython) {
  EXPECT_EQ(render("{% for v in [0, 0.0, '', [], {}, none, missing, 1, 'a', [0], {'a': 0}] %}"
                   "{{ 'T' if v else 'F' }}{% endfor %}"),
            "FFFFFFFTTTT");
}

TEST(ChatTemplateExpressionsTest, ConditionalExpressions) {
  EXPECT_EQ(render("{{ 'a' if 1 > 2 else 'b' if 2 > 1 else 'c' }}|[{{ 'x' if false }}]"), "b|[]");
}

TEST(ChatTemplateExpressionsTest, FiltersBindTighterThanArithmetic) {
  EXPECT_EQ(
      render("{{ items | length - 1 }}|{{ -1 | abs }}|{{ 'a' ~ 'b' | upper }}", message_context()),
      "2|1|aB");
}

TEST(ChatTemplateExpressionsTest, TypeTests) {
  EXPECT_EQ(render("{{ 'a' is string }}{{ 1 is number }}{{ 1 is integer }}{{ 1.5 is float }}"
                   "{{ {} is mapping }}{{ [] is sequence }}{{ 'a' is iterable }}{{ none is none }}"
                   "{{ true is boolean }}{{ range is callable }}|"
                   "{{ 1 is string }}{{ 'a' is number }}{{ 1.5 is integer }}{{ [] is mapping }}"
                   "{{ 1 is iterable }}{{ 0 is none }}{{ 1 is boolean }}{{ 'a' is callable }}"),
            "truetruetruetruetruetruetruetruetruetrue|"
            "falsefalsefalsefalsefalsefalsefalsefalse");
}

TEST(ChatTemplateExpressionsTest, ValueTests) {
  EXPECT_EQ(render("{{ 4 is even }}{{ 3 is odd }}{{ 9 is divisibleby 3 }}{{ true is true }}"
                   "{{ false is false }}{{ missing is undefined }}{{ 2 is in [1, 2] }}"
                   "{{ 2 is eq 2 }}{{ 2 is equalto(2) }}{{ 1 is not none }}{{ 1 is defined }}|"
                   "{{ 3 is even }}{{ 9 is divisibleby(2) }}{{ 1 is true }}{{ 0 is false }}"
                   "{{ 3 is in [1, 2] }}{{ 2 is ne 2 }}"),
            "truetruetruetruetruetruetruetruetruetruetrue|falsefalsefalsefalsefalsefalse");
}

TEST(ChatTemplateExpressionsTest, NegatedTestsCombineWithLogic) {
  EXPECT_EQ(render("{{ message.content is not none and message.role == 'user' }}|"
                   "{{ not message.tool_calls is defined }}",
                   message_context()),
            "true|true");
}

}  // namespace
}  // namespace kvr::chat_template
