// Chat-template statements: if, for (loop variables, filters, else, unpacking, break and
// continue), set (plain, block, tuple, namespace), macros and call blocks, filter blocks, globals.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;
using testing::render;

ordered_json chat() {
  return ordered_json::parse(R"({"messages": [{"role": "system", "content": "S"},
                                              {"role": "user", "content": "U"},
                                              {"role": "assistant", "content": "A"}]})");
}

TEST(ChatTemplateStatementsTest, IfElifElse) {
  const char* source = "{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}";
  EXPECT_EQ(render(source, ordered_json{{"n", 1}}), "one");
  EXPECT_EQ(render(source, ordered_json{{"n", 2}}), "two");
  EXPECT_EQ(render(source, ordered_json{{"n", 3}}), "many");
}

TEST(ChatTemplateStatementsTest, LoopVariables) {
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
                   "{{ loop.revindex0 }}{{ loop.length }}{{ 'F' if loop.first }}"
                   "{{ 'L' if loop.last }} {% endfor %}",
                   chat()),
            "10323F 21213 32103L ");
}

TEST(ChatTemplateStatementsTest, LoopPreviousNextItemsAndCycle) {
  EXPECT_EQ(render("{% for m in messages %}{{ loop.previtem.role | default('-') }}>"
                   "{{ loop.nextitem.role | default('-') }}:{{ loop.cycle('a', 'b') }} "
                   "{% endfor %}",
                   chat()),
            "->user:a system>assistant:b user>-:a ");
}

TEST(ChatTemplateStatementsTest, LoopFilterCountsOnlySelectedItems) {
  EXPECT_EQ(render("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}"
                   ":{{ m.role }} {% endfor %}",
                   chat()),
            "1/2:user 2/2:assistant ");
}

TEST(ChatTemplateStatementsTest, LoopElseRendersWhenNothingIsIterated) {
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}|"
                   "{% for x in [1] if false %}a{% else %}none{% endfor %}|"
                   "{% for x in missing %}a{% else %}undefined{% endfor %}"),
            "empty|none|undefined");
}

TEST(ChatTemplateStatementsTest, LoopUnpacksPairs) {
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}|"
                   "{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}",
                   ordered_json::parse(R"({"d": {"b": 1, "a": [1, 2]}})")),
            "b=1;a=[1, 2];|37");
}

TEST(ChatTemplateStatementsTest, LoopOverDictWalksKeysAndOverStringWalksCharacters) {
  EXPECT_EQ(
      render("{% for k in d %}{{ k }}{% endfor %}|{% for c in 'h\xC3\xA9y' %}[{{ c }}]{% endfor %}",
             ordered_json::parse(R"({"d": {"z": 1, "y": 2}})")),
      "zy|[h][\xC3\xA9][y]");
}

TEST(ChatTemplateStatementsTest, ReversedLoopWithIndexArithmetic) {
  EXPECT_EQ(render("{% for m in messages[::-1] %}{{ (messages | length - 1) - loop.index0 }}"
                   "{{ m.role[0] }} {% endfor %}",
                   chat()),
            "2a 1u 0s ");
}

TEST(ChatTemplateStatementsTest, BreakAndContinue) {
  EXPECT_EQ(render("{% for i in range(10) %}{% if i == 4 %}{% break %}{% endif %}"
                   "{% if i is odd %}{% continue %}{% endif %}{{ i }}{% endfor %}"),
            "02");
}

TEST(ChatTemplateStatementsTest, RangeCountsAsPython) {
  EXPECT_EQ(render("{% for i in range(3) %}{{ i }}{% endfor %}|{% for i in range(1, 8, 3) %}{{ i }}"
                   "{% endfor %}|{% for i in range(3, 0, -1) %}{{ i }}{% endfor %}"),
            "012|147|321");
}

TEST(ChatTemplateStatementsTest, SetInsideLoopDoesNotLeak) {
  EXPECT_EQ(render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"),
            "21");
}

TEST(ChatTemplateStatementsTest, SetInsideIfIsVisibleAfterIt) {
  EXPECT_EQ(render("{% if true %}{% set x = 'set' %}{% endif %}{{ x }}"), "set");
}

TEST(ChatTemplateStatementsTest, NamespaceCarriesStateOutOfLoops) {
  EXPECT_EQ(render("{% set ns = namespace(count=0, roles='') %}{% for m in messages %}"
                   "{% set ns.count = ns.count + 1 %}{% set ns.roles = ns.roles + m.role[0] %}"
                   "{% endfor %}{{ ns.count }} {{ ns.roles }} {{ ns.missing is defined }}",
                   chat()),
            "3 sua false");
}

TEST(ChatTemplateStatementsTest, BlockSetCapturesRenderedText) {
  EXPECT_EQ(render("{% set x %}sum={{ 1 + 1 }}{% endset %}[{{ x }}]"), "[sum=2]");
}

TEST(ChatTemplateStatementsTest, TupleSetUnpacks) {
  EXPECT_EQ(render("{% set a, b = 1, 'two' %}{{ a }}{{ b }}"), "1two");
}

TEST(ChatTemplateStatementsTest, ListAppendMutatesATemplateList) {
  EXPECT_EQ(render("{% set ns = namespace(items=[]) %}{% for i in range(3) %}"
                   "{% set _ = ns.items.append(i * 2) %}{% endfor %}{{ ns.items }}"),
            "[0, 2, 4]");
}

TEST(ChatTemplateStatementsTest, MacroDefaultsAndKeywordArguments) {
  EXPECT_EQ(render("{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!"
                   "{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Hi') }} "
                   "{{ greet(name='Zoe') }}"),
            "Hello, Bob! Hi, Al! Hello, Zoe!");
}

TEST(ChatTemplateStatementsTest, MacroDefaultsSeeEarlierParameters) {
  EXPECT_EQ(
      render(
          "{% macro m(a, b=a ~ '!') %}{{ a }}{{ b }}{% endmacro %}{{ m('x') }} {{ m('y', 'z') }}"),
      "xx! yz");
}

TEST(ChatTemplateStatementsTest, MacroVarargsAndKwargs) {
  EXPECT_EQ(render("{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}"
                   "{{ m(1, 2, 3, k='v') }}"),
            R"(1[2, 3]{"k": "v"})");
}

TEST(ChatTemplateStatementsTest, MacroSeesTheTemplatesVariables) {
  EXPECT_EQ(render("{% macro role(i) %}{{ messages[i].role }}{% endmacro %}{{ role(1) }}", chat()),
            "user");
}

TEST(ChatTemplateStatementsTest, CallBlockIsTheMacrosCaller) {
  EXPECT_EQ(render("{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}"
                   "{% call wrap('b') %}inner{% endcall %}"),
            "<b>inner</b>");
}

TEST(ChatTemplateStatementsTest, CallBlockWithCallerArguments) {
  EXPECT_EQ(render("{% macro each(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}"
                   "{% endmacro %}{% call(x) each([1, 2]) %}[{{ x }}]{% endcall %}"),
            "[1][2]");
}

TEST(ChatTemplateStatementsTest, FilterBlockFiltersItsBody) {
  EXPECT_EQ(render("{% filter upper %}abc {{ 'def' }}{% endfilter %}"), "ABC DEF");
}

TEST(ChatTemplateStatementsTest, StrftimeNowReadsTheInjectedClock) {
  EXPECT_EQ(render("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}"),
            "2024-03-15|15 March 2024");
}

TEST(ChatTemplateStatementsTest, DictGlobalBuildsADict) {
  EXPECT_EQ(render("{{ dict(a=1, b='x') }}"), R"({"a": 1, "b": "x"})");
}

TEST(ChatTemplateStatementsTest, GenerationTagsRenderTheirBodyOnly) {
  EXPECT_EQ(render("{% generation %}reply{% endgeneration %}|"
                   "{%- generation -%}  trimmed  {%- endgeneration -%} |"),
            "reply|trimmed|");
}

TEST(ChatTemplateStatementsTest, CommentsRenderNothing) {
  EXPECT_EQ(render("a{# a comment {{ with }} {% tags %} #}b"), "ab");
}

TEST(ChatTemplateStatementsTest, ContextVariablesAreShadowedBySet) {
  EXPECT_EQ(render("{{ x }}{% set x = 'local' %}{{ x }}", ordered_json{{"x", "ctx"}}), "ctxlocal");
}

TEST(ChatTemplateStatementsTest, OneParseRendersConcurrently) {
  const auto parsed = ChatTemplate::parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
      "{{ m.role }}{% endfor %}{{ ns.n }}");
  ASSERT_TRUE(parsed.has_value());
  const ordered_json context = chat();
  std::vector<std::string> outputs(4);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < outputs.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        outputs[t] = parsed->render(context).value_or("error");
      }
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
  for (const std::string& output : outputs) {
    EXPECT_EQ(output, "systemuserassistant3");
  }
}

}  // namespace
}  // namespace kvr::chat_template
