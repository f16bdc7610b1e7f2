// Chat-template whitespace: trim_blocks and lstrip_blocks as transformers configures Jinja2, the
// `-` markers, and the single trailing newline Jinja2 drops.
#include <gtest/gtest.h>

#include "tests/unit/selection/chat_template/render_helpers.hpp"

namespace kvr::chat_template {
namespace {

using testing::render;

TEST(ChatTemplateWhitespaceTest, TrimBlocksRemovesTheNewlineAfterABlockTag) {
  EXPECT_EQ(render("{% if true %}\nyes\n{% endif %}\nafter"), "yes\nafter");
}

TEST(ChatTemplateWhitespaceTest, LstripBlocksRemovesIndentationBeforeABlockTag) {
  EXPECT_EQ(render("  {% if true %}\n  x\n  {% endif %}\n  done"), "  x\n  done");
}

TEST(ChatTemplateWhitespaceTest, LstripBlocksLeavesTextBeforeATagOnItsLine) {
  EXPECT_EQ(render("a  {% if true %}b{% endif %}"), "a  b");
}

TEST(ChatTemplateWhitespaceTest, ExpressionsKeepTheirIndentationAndNewline) {
  EXPECT_EQ(render("  {{ 'a' }}\n  {{ 'b' }}\nc"), "  a\n  b\nc");
}

TEST(ChatTemplateWhitespaceTest, OneTrailingNewlineIsDropped) {
  EXPECT_EQ(render("a\n\n"), "a\n");
  EXPECT_EQ(render("a\n"), "a");
}

TEST(ChatTemplateWhitespaceTest, MinusMarkersStripWhitespaceAndNewlines) {
  EXPECT_EQ(render("a  \n  {{- 'b' -}}  \n  c"), "abc");
  // trim_blocks also drops the newline after `%}`.
  EXPECT_EQ(render("a\n\t {%- if true -%} \n b \n {%- endif %}\nc"), "abc");
  EXPECT_EQ(render("a\n\t {%- if true -%} \n b \n {%- endif %}\n\nc"), "ab\nc");
}

TEST(ChatTemplateWhitespaceTest, CommentsAreTrimmedLikeBlocks) {
  EXPECT_EQ(render("a\n{# note #}\nb\n  {# indented #}\nc"), "a\nb\nc");
  EXPECT_EQ(render("a {#- note -#} b"), "ab");
}

TEST(ChatTemplateWhitespaceTest, LoopBodiesIndentedForReadingRenderNoIndentation) {
  EXPECT_EQ(render("{%- for m in ['x', 'y'] %}\n    {{- m }}\n{%- endfor %}\n"), "xy");
  EXPECT_EQ(render("{% for m in ['x', 'y'] %}\n  {{ m }}\n{% endfor %}\n"), "  x\n  y\n");
}

TEST(ChatTemplateWhitespaceTest, BracesInsideAnExpressionDoNotCloseIt) {
  EXPECT_EQ(render("{{ {'a': {'b': 1}} }}|{{ '{{ x }}' }}|{{ '%}' }}"),
            R"({"a": {"b": 1}}|{{ x }}|%})");
}

}  // namespace
}  // namespace kvr::chat_template
