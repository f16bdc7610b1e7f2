// Chat-template filters and methods: tojson as transformers' json.dumps, the string, list and
// dict filters, and Python's str and dict methods.
#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using nlohmann::ordered_json;
using testing::render;

ordered_json tool() {
  return ordered_json::parse(R"({"tool": {"type": "function", "function": {"name": "get",
      "description": "Gets \"it\" — ünïcode\n", "parameters": {"type": "object",
      "properties": {"x": {"type": "integer"}}, "required": ["x"], "strict": true,
      "default": null, "scale": 1.0, "ratio": 0.25}}}})");
}

ordered_json people() {
  return ordered_json::parse(R"({"people": [{"name": "bob", "age": 30, "tag": "b"},
                                            {"name": "Al", "age": 25},
                                            {"name": "cy", "age": 35, "tag": null}]})");
}

TEST(ChatTemplateFiltersTest, TojsonWritesJsonDumpsDefaults) {
  EXPECT_EQ(
      render("{{ tool | tojson }}", tool()),
      R"({"type": "function", "function": {"name": "get", "description": "Gets \"it\" — ünïcode\n", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "strict": true, "default": null, "scale": 1.0, "ratio": 0.25}}})");
}

TEST(ChatTemplateFiltersTest, TojsonIndentUsesCompactItemSeparator) {
  EXPECT_EQ(render("{{ d | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}",
                   ordered_json::parse(R"({"d": {"a": [1, {"b": null}], "c": {}}})")),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": {}\n}|[]");
}

TEST(ChatTemplateFiltersTest, TojsonSortKeysSeparatorsAndEnsureAscii) {
  EXPECT_EQ(render("{{ d | tojson(sort_keys=true, separators=(',', ':')) }}|"
                   "{{ 'é😀' | tojson(ensure_ascii=true) }}",
                   ordered_json::parse(R"({"d": {"b": 1, "a": [1, 2]}})")),
            R"({"a":[1,2],"b":1}|"\u00e9\ud83d\ude00")");
}

TEST(ChatTemplateFiltersTest, TojsonOfTemplateValues) {
  EXPECT_EQ(render("{{ {'k': [1, 2.5, 'x', none, true]} | tojson }}|{{ missing | tojson }}|"
                   "{{ namespace(a=1) | tojson }}"),
            R"({"k": [1, 2.5, "x", null, true]}|null|{"a": 1})");
}

TEST(ChatTemplateFiltersTest, StringFilters) {
  EXPECT_EQ(render("{{ '  hi  ' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'Hello' | lower }}|"
                   "{{ 'hello' | upper }}|{{ 'hELLO wORLD' | capitalize }}|"
                   "{{ 'hello big-world' | title }}|{{ 'aaa' | replace('a', 'b', 2) }}|"
                   "{{ 5 | string }}{{ true | string }}|{{ '<a href=\"x\">&\\'' | escape }}|"
                   "{{ '<b>' | e }}{{ '<i>' | safe }}"),
            "hi|hi|hello|HELLO|Hello world|Hello Big-World|bba|5true|"
            "&lt;a href=&#34;x&#34;&gt;&amp;&#39;|&lt;b&gt;<i>");
}

TEST(ChatTemplateFiltersTest, LengthCountsCodePointsItemsAndKeys) {
  EXPECT_EQ(render("{{ 'h\xC3\xA9' | length }}{{ [1, 2] | length }}{{ {'a': 1} | count }}"
                   "{{ missing | length }}"),
            "2210");
}

TEST(ChatTemplateFiltersTest, DefaultReplacesUndefinedAndWithTheFlagFalsyValues) {
  EXPECT_EQ(render("{{ missing | default('d') }}|{{ '' | default('e') }}|"
                   "{{ '' | default('e', true) }}|{{ none | d('n', boolean=true) }}|"
                   "{{ 0 | d('z') }}|{{ missing | default }}"),
            "d||e|n|0|");
}

TEST(ChatTemplateFiltersTest, JoinMapAndAttributes) {
  EXPECT_EQ(
      render("{{ [1, 2, 3] | join(', ') }}|{{ people | map(attribute='name') | join }}|"
             "{{ people | join('/', attribute='age') }}|{{ ['a', 'b'] | map('upper') | join }}|"
             "{{ people | map(attribute='tag', default='?') | join }}",
             people()),
      "1, 2, 3|bobAlcy|30/25/35|AB|b?None");
}

TEST(ChatTemplateFiltersTest, SelectAndRejectByTest) {
  EXPECT_EQ(
      render("{{ people | selectattr('age', 'gt', 26) | map(attribute='name') | join }}|"
             "{{ people | rejectattr('name', 'equalto', 'Al') | map(attribute='name') | join }}|"
             "{{ people | selectattr('tag') | list | length }}|"
             "{{ people | selectattr('tag', 'undefined') | map(attribute='name') | join }}|"
             "{{ people | selectattr('tag', 'none') | map(attribute='name') | join }}|"
             "{{ [1, 2, 3, 4] | select('odd') | join }}{{ [1, 2, 3] | reject('==', 2) | join }}",
             people()),
      "bobcy|bobcy|1|Al|cy|1313");
}

TEST(ChatTemplateFiltersTest, ListFilters) {
  EXPECT_EQ(
      render("{{ [1, 2] | first }}{{ [1, 2] | last }}|{{ 'abc' | list }}|"
             "{{ ['A', 'a', 'b', 'A'] | unique | join }}|{{ [1, 2, 3] | reverse | join }}|"
             "{{ 'abc' | reverse }}|{{ [3, 1, 2] | sort | join }}|"
             "{{ [3, 1, 2] | sort(reverse=true) | join }}|{{ ['b', 'A', 'c'] | sort | join }}|"
             "{{ people | sort(attribute='age') | map(attribute='name') | join(',') }}|"
             "{{ [1, 2, 3, 4, 5] | batch(2, 0) | list }}",
             people()),
      R"(12|["a", "b", "c"]|Ab|321|cba|123|321|Abc|Al,bob,cy|[[1, 2], [3, 4], [5, 0]])");
}

TEST(ChatTemplateFiltersTest, DictFilters) {
  EXPECT_EQ(render("{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %}|"
                   "{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}|"
                   "{% for k, v in d | dictsort(by='value', reverse=true) %}{{ k }}{% endfor %}",
                   ordered_json::parse(R"({"d": {"b": 1, "C": 3, "a": 2}})")),
            "b1C3a2|a2b1C3|Cab");
}

TEST(ChatTemplateFiltersTest, NumberFilters) {
  EXPECT_EQ(render("{{ '42' | int + 1 }}|{{ 'x' | int }}|{{ 'x' | int(7) }}|{{ '3.9' | int }}|"
                   "{{ 3.7 | int }}|{{ '2.5' | float }}|{{ 5 | float }}|{{ -3 | abs }}|"
                   "{{ 2.5 | round }}|{{ 3.14159 | round(2) }}|{{ 2.1 | round(0, 'ceil') }}|"
                   "{{ [1, 2, 3] | sum }}|{{ [4, 9, 2] | max }}{{ [4, 9, 2] | min }}"),
            "43|0|7|3|3|2.5|5.0|3|2.0|3.14|3.0|6|92");
}

TEST(ChatTemplateFiltersTest, IndentAndWordcount) {
  EXPECT_EQ(
      render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|"
             "{{ 'a\\n\\nb' | indent('> ', blank=true) }}|{{ 'one two, three' | wordcount }}"),
      "a\n  b\n\n  c|  a\n  b|a\n> \n> b|3");
}

TEST(ChatTemplateFiltersTest, StringMethodsFollowPython) {
  EXPECT_EQ(
      render("{{ s.startswith('<a>') }}{{ s.startswith(('x', '<a')) }}{{ s.endswith('</a>') }}|"
             "{{ s.split('</a>')[0] }}|{{ 'a b  c '.split() | join('|') }}|"
             "{{ 'a,b,c'.split(',', 1) | join('|') }}|{{ 'a,b,c'.rsplit(',', 1) | join('|') }}|"
             "{{ 'xaxbx'.replace('x', '-') }}{{ 'xaxbx'.replace('x', '-', 1) }}|"
             "{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}{{ 'hello wORLD'.title() }}"
             "{{ 'hELLO'.capitalize() }}|{{ 'abcabc'.find('c') }}{{ 'abcabc'.rfind('c') }}"
             "{{ 'abcabc'.find('z') }}{{ 'abcabc'.count('b') }}|"
             "{{ '{} is {x}'.format('sky', x='blue') }}|{{ ', '.join(['a', 'b']) }}",
             ordered_json{{"s", "<a>text</a>"}}),
      "truetruetrue|<a>text|a|b|c|a|b,c|a,b|c|-a-b--axbx|HIhiHello WorldHello|25-12|"
      "sky is blue|a, b");
}

TEST(ChatTemplateFiltersTest, StripMethodsTakeCharactersAsPython) {
  // Python strips only the characters given: the space before the newline stays.
  EXPECT_EQ(render("[{{ r.strip('\\n') }}]|[{{ r.lstrip('\\n') }}]|[{{ r.rstrip('\\n') }}]|"
                   "[{{ r.strip() }}]|[{{ 'xyhixy'.strip('yx') }}]",
                   ordered_json{{"r", "\n\nR2 \n"}}),
            "[R2 ]|[R2 \n]|[\n\nR2 ]|[R2]|[hi]");
}

TEST(ChatTemplateFiltersTest, DictMethods) {
  EXPECT_EQ(render("{{ d.get('a') }}{{ d.get('z', 'dflt') }}[{{ d.get('z') }}]|"
                   "{{ d.keys() | join }}|{{ d.values() | join }}|"
                   "{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}",
                   ordered_json::parse(R"({"d": {"a": 1, "b": 2}})")),
            "1dflt[]|ab|12|a1b2");
}

}  // namespace
}  // namespace kvr::chat_template
