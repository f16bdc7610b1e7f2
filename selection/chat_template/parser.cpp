// The chat-template parser: recursive descent over the lexer's tokens, with @huggingface/jinja's
// operator precedence (filters and tests bind tighter than arithmetic).
#include "selection/chat_template/parser.hpp"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <unordered_map>

#include <fmt/format.h>

#include "selection/chat_template/chat_template.hpp"
#include "selection/chat_template/lexer.hpp"
#include "selection/chat_template/template_error.hpp"

namespace kvr::chat_template::detail {
namespace {

constexpr std::string_view kUnsupportedTags[] = {
    "raw",  "endraw",  "include", "import",     "from",          "extends", "block",   "endblock",
    "with", "endwith", "do",      "autoescape", "endautoescape", "trans",   "endtrans"};

constexpr std::string_view kEndTags[] = {"elif",   "else",     "endif",   "endfor",
                                         "endset", "endmacro", "endcall", "endfilter"};

// Names that end an argument-less test (`x is defined and ...`) rather than start its argument.
constexpr std::string_view kTestArgumentStops[] = {"else", "or", "and", "if", "is", "not", "in"};

template <std::size_t N>
bool one_of(std::string_view text, const std::string_view (&list)[N]) {
  return std::find(std::begin(list), std::end(list), text) != std::end(list);
}

// The height of the tallest direct child of `node` (0 for a leaf); each child's own height is
// already set.
int tallest_child(const Expr& node) {
  int tallest = 0;
  const auto see = [&tallest](const Expr* child) {
    if (child != nullptr) {
      tallest = std::max(tallest, child->height);
    }
  };
  const auto see_args = [&see](const std::vector<Argument>& args) {
    for (const Argument& argument : args) {
      see(argument.value.get());
    }
  };
  switch (node.kind) {
    case ExprKind::kLiteral:
    case ExprKind::kName:
      break;
    case ExprKind::kList:
      for (const ExprPtr& item : static_cast<const ListExpr&>(node).items) {
        see(item.get());
      }
      break;
    case ExprKind::kDict:
      for (const auto& [key, value] : static_cast<const DictExpr&>(node).entries) {
        see(key.get());
        see(value.get());
      }
      break;
    case ExprKind::kAttribute:
      see(static_cast<const AttributeExpr&>(node).object.get());
      break;
    case ExprKind::kSubscript: {
      const auto& subscript = static_cast<const SubscriptExpr&>(node);
      see(subscript.object.get());
      see(subscript.key.get());
      break;
    }
    case ExprKind::kSlice: {
      const auto& slice = static_cast<const SliceExpr&>(node);
      see(slice.object.get());
      see(slice.start.get());
      see(slice.stop.get());
      see(slice.step.get());
      break;
    }
    case ExprKind::kCall: {
      const auto& call = static_cast<const CallExpr&>(node);
      see(call.callee.get());
      see_args(call.args);
      break;
    }
    case ExprKind::kFilter: {
      const auto& filter = static_cast<const FilterExpr&>(node);
      see(filter.operand.get());
      see_args(filter.args);
      break;
    }
    case ExprKind::kTest: {
      const auto& test = static_cast<const TestExpr&>(node);
      see(test.operand.get());
      see_args(test.args);
      break;
    }
    case ExprKind::kUnary:
      see(static_cast<const UnaryExpr&>(node).operand.get());
      break;
    case ExprKind::kBinary: {
      const auto& binary = static_cast<const BinaryExpr&>(node);
      see(binary.left.get());
      see(binary.right.get());
      break;
    }
    case ExprKind::kConcat:
      for (const ExprPtr& operand : static_cast<const ConcatExpr&>(node).operands) {
        see(operand.get());
      }
      break;
    case ExprKind::kConditional: {
      const auto& conditional = static_cast<const ConditionalExpr&>(node);
      see(conditional.condition.get());
      see(conditional.then_value.get());
      see(conditional.else_value.get());
      break;
    }
  }
  return tallest;
}

[[noreturn]] void fail_nesting(int line) {
  fail(fmt::format("the template nests deeper than {} levels", kMaxTemplateNesting), line);
}

// Gives a node the parser just completed its height, refusing a tree taller than the template may
// nest.
template <typename Node>
std::unique_ptr<Node> sized(std::unique_ptr<Node> node) {
  node->height = tallest_child(*node) + 1;
  if (node->height > kMaxTemplateNesting) {
    fail_nesting(node->line);
  }
  return node;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {
    for (const std::string_view name : {"loop", "caller", "varargs", "kwargs"}) {
      intern(std::string(name));
    }
  }

  std::shared_ptr<const Program> run() {
    auto program = std::make_shared<Program>();
    program->body = parse_body({}, "", 0, nullptr);
    program->symbols = std::move(symbols_);
    for (std::size_t i = 0; i < program->symbols.size(); ++i) {
      program->symbols_by_name.emplace_back(program->symbols[i], static_cast<int>(i));
    }
    std::sort(program->symbols_by_name.begin(), program->symbols_by_name.end());
    return program;
  }

 private:
  // --- tokens ---

  bool at_end() const { return pos_ >= tokens_.size(); }

  int current_line() const {
    if (tokens_.empty()) {
      return 1;
    }
    return tokens_[std::min(pos_, tokens_.size() - 1)].line;
  }

  bool at(TokenKind kind, std::size_t ahead = 0) const {
    return pos_ + ahead < tokens_.size() && tokens_[pos_ + ahead].kind == kind;
  }

  bool at_name(std::string_view text, std::size_t ahead = 0) const {
    return at(TokenKind::kName, ahead) && tokens_[pos_ + ahead].text == text;
  }

  bool at_operator(std::string_view text) const {
    return at(TokenKind::kOperator) && tokens_[pos_].text == text;
  }

  std::string describe_current() const {
    if (at_end()) {
      return "the end of the template";
    }
    const Token& token = tokens_[pos_];
    switch (token.kind) {
      case TokenKind::kText:
        return "text";
      case TokenKind::kComment:
        return "a comment";
      case TokenKind::kString:
        return fmt::format("string '{}'", token.text);
      default:
        return fmt::format("'{}'", token.text);
    }
  }

  [[noreturn]] void fail_here(std::string message) const {
    fail(std::move(message), current_line());
  }

  // One level of the template's nesting while it lives: a statement inside a block, an
  // expression inside brackets, an operand of `not` or a sign. The parse recurses once per level.
  class Nested {
   public:
    explicit Nested(Parser& parser) : parser_(parser) {
      if (parser_.nesting_ >= kMaxTemplateNesting) {
        fail_nesting(parser_.current_line());
      }
      ++parser_.nesting_;
    }
    ~Nested() { --parser_.nesting_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    Parser& parser_;
  };

  const Token& advance() {
    if (at_end()) {
      fail_here("unexpected end of template");
    }
    return tokens_[pos_++];
  }

  const Token& expect(TokenKind kind, std::string_view what) {
    if (!at(kind)) {
      fail_here(fmt::format("expected {} but found {}", what, describe_current()));
    }
    return tokens_[pos_++];
  }

  const std::string& expect_name(std::string_view what) {
    return expect(TokenKind::kName, what).text;
  }

  void expect_close_statement() { expect(TokenKind::kCloseStatement, "'%}'"); }

  int intern(const std::string& name) {
    const auto [it, inserted] = symbol_ids_.try_emplace(name, static_cast<int>(symbols_.size()));
    if (inserted) {
      symbols_.push_back(name);
    }
    return it->second;
  }

  // --- statements ---

  // Statements up to one of `ends` (whose `{%` and name it consumes, naming it in *found); to the
  // end of the template when `ends` is empty.
  Body parse_body(std::initializer_list<std::string_view> ends, std::string_view opener,
                  int opener_line, std::string* found) {
    Body body;
    while (true) {
      if (at_end()) {
        if (ends.size() == 0) {
          return body;
        }
        std::string expected;
        for (const std::string_view end : ends) {
          expected += fmt::format("{}'{}'", expected.empty() ? "" : " or ", end);
        }
        fail(fmt::format("unclosed '{}' block: expected {} before the end of the template", opener,
                         expected),
             opener_line);
      }
      const Token& token = tokens_[pos_];
      switch (token.kind) {
        case TokenKind::kText: {
          auto text = std::make_unique<TextStmt>(token.line);
          text->text = token.text;
          body.push_back(std::move(text));
          ++pos_;
          break;
        }
        case TokenKind::kComment:
          ++pos_;
          break;
        case TokenKind::kOpenExpression: {
          ++pos_;
          auto output = std::make_unique<OutputStmt>(token.line);
          output->value = parse_expression();
          expect(TokenKind::kCloseExpression, "'}}'");
          body.push_back(std::move(output));
          break;
        }
        case TokenKind::kOpenStatement: {
          if (at(TokenKind::kName, 1) &&
              std::find(ends.begin(), ends.end(), tokens_[pos_ + 1].text) != ends.end()) {
            *found = tokens_[pos_ + 1].text;
            pos_ += 2;
            return body;
          }
          ++pos_;
          body.push_back(parse_statement());
          break;
        }
        default:
          fail_here(fmt::format("unexpected {}", describe_current()));
      }
    }
  }

  StmtPtr parse_statement() {
    const Nested nested(*this);
    const int line = current_line();
    const std::string& name = expect_name("a tag name after '{%'");
    if (name == "if") {
      return parse_if(line);
    }
    if (name == "for") {
      return parse_for(line);
    }
    if (name == "set") {
      return parse_set(line);
    }
    if (name == "macro") {
      return parse_macro(line);
    }
    if (name == "call") {
      return parse_call_block(line);
    }
    if (name == "filter") {
      return parse_filter_block(line);
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) {
        fail(fmt::format("'{}' outside a loop", name), line);
      }
      expect_close_statement();
      return std::make_unique<LoopControlStmt>(
          name == "break" ? StmtKind::kBreak : StmtKind::kContinue, line);
    }
    if (one_of(name, kEndTags)) {
      fail(fmt::format("unexpected '{}'", name), line);
    }
    if (one_of(name, kUnsupportedTags)) {
      fail(fmt::format("unsupported tag '{}'", name), line);
    }
    fail(fmt::format("unknown tag '{}'", name), line);
  }

  StmtPtr parse_if(int line) {
    auto node = std::make_unique<IfStmt>(line);
    ExprPtr condition = parse_expression();
    expect_close_statement();
    while (true) {
      std::string found;
      Body body = parse_body({"elif", "else", "endif"}, "if", line, &found);
      node->branches.emplace_back(std::move(condition), std::move(body));
      if (found == "elif") {
        condition = parse_expression();
        expect_close_statement();
        continue;
      }
      if (found == "else") {
        expect_close_statement();
        node->else_body = parse_body({"endif"}, "if", line, &found);
      }
      expect_close_statement();
      return node;
    }
  }

  std::vector<int> parse_targets(bool& unpack) {
    std::vector<int> targets;
    const bool parenthesized = at(TokenKind::kOpenParen);
    if (parenthesized) {
      ++pos_;
      unpack = true;
    }
    targets.push_back(intern(expect_name("a variable name")));
    while (at(TokenKind::kComma)) {
      ++pos_;
      unpack = true;
      if (!at(TokenKind::kName)) {
        break;
      }
      targets.push_back(intern(expect_name("a variable name")));
    }
    if (parenthesized) {
      expect(TokenKind::kCloseParen, "')'");
    }
    return targets;
  }

  StmtPtr parse_for(int line) {
    auto node = std::make_unique<ForStmt>(line);
    node->targets = parse_targets(node->unpack);
    if (!at_name("in")) {
      fail_here(
          fmt::format("expected 'in' after the loop variable but found {}", describe_current()));
    }
    ++pos_;
    node->iterable = parse_expression();
    // `for x in items if condition` parses as a conditional without else: the loop's filter.
    if (node->iterable->kind == ExprKind::kConditional) {
      auto& conditional = static_cast<ConditionalExpr&>(*node->iterable);
      if (!conditional.else_value) {
        node->filter = std::move(conditional.condition);
        ExprPtr items = std::move(conditional.then_value);
        node->iterable = std::move(items);
      }
    }
    if (at_name("recursive")) {
      fail_here("unsupported recursive loop");
    }
    expect_close_statement();
    ++loop_depth_;
    std::string found;
    node->body = parse_body({"else", "endfor"}, "for", line, &found);
    --loop_depth_;
    if (found == "else") {
      expect_close_statement();
      node->else_body = parse_body({"endfor"}, "for", line, &found);
    }
    expect_close_statement();
    return node;
  }

  StmtPtr parse_set(int line) {
    auto node = std::make_unique<SetStmt>(line);
    if (at(TokenKind::kName) && at(TokenKind::kDot, 1)) {
      auto object = std::make_unique<NameExpr>(current_line());
      object->name = expect_name("a variable name");
      object->symbol = intern(object->name);
      object->builtin = find_builtin_function(object->name);
      node->namespace_object = std::move(object);
      ++pos_;
      node->attribute_name = expect_name("an attribute name");
      node->attribute = Value::borrowed_string(node->attribute_name);
    } else {
      node->targets = parse_targets(node->unpack);
    }
    if (at(TokenKind::kAssign)) {
      ++pos_;
      node->value = parse_expression_sequence();
      expect_close_statement();
      return node;
    }
    expect_close_statement();
    node->block = true;
    std::string found;
    node->body = parse_body({"endset"}, "set", line, &found);
    expect_close_statement();
    return node;
  }

  std::vector<Parameter> parse_parameters() {
    std::vector<Parameter> params;
    expect(TokenKind::kOpenParen, "'('");
    bool saw_default = false;
    while (!at(TokenKind::kCloseParen)) {
      Parameter param;
      param.name = expect_name("a parameter name");
      param.symbol = intern(param.name);
      for (const Parameter& other : params) {
        if (other.name == param.name) {
          fail_here(fmt::format("duplicate parameter '{}'", param.name));
        }
      }
      if (at(TokenKind::kAssign)) {
        ++pos_;
        param.default_value = parse_expression();
        saw_default = true;
      } else if (saw_default) {
        fail_here("parameter without a default follows a parameter with one");
      }
      params.push_back(std::move(param));
      if (!at(TokenKind::kComma)) {
        break;
      }
      ++pos_;
    }
    expect(TokenKind::kCloseParen, "')'");
    return params;
  }

  // A macro's or call block's body: loops outside it do not enclose it, and its reads of
  // caller/varargs/kwargs are recorded.
  Body parse_callable_body(std::string_view end, std::string_view opener, int line,
                           ImplicitArguments& implicit) {
    const int saved_depth = loop_depth_;
    loop_depth_ = 0;
    implicit_stack_.push_back(&implicit);
    std::string found;
    Body body = parse_body({end}, opener, line, &found);
    implicit_stack_.pop_back();
    loop_depth_ = saved_depth;
    expect_close_statement();
    return body;
  }

  StmtPtr parse_macro(int line) {
    auto node = std::make_unique<MacroStmt>(line);
    node->name = expect_name("a macro name");
    node->symbol = intern(node->name);
    node->params = parse_parameters();
    expect_close_statement();
    node->body = parse_callable_body("endmacro", "macro", line, node->implicit);
    return node;
  }

  StmtPtr parse_call_block(int line) {
    auto node = std::make_unique<CallBlockStmt>(line);
    if (at(TokenKind::kOpenParen)) {
      node->params = parse_parameters();
    }
    ExprPtr call = parse_postfix(parse_primary());
    if (call->kind != ExprKind::kCall) {
      fail(fmt::format("expected a macro call after 'call'"), line);
    }
    node->call.reset(static_cast<CallExpr*>(call.release()));
    expect_close_statement();
    node->body = parse_callable_body("endcall", "call", line, node->implicit);
    return node;
  }

  StmtPtr parse_filter_block(int line) {
    auto node = std::make_unique<FilterBlockStmt>(line);
    do {
      if (!node->filters.empty()) {
        ++pos_;
      }
      node->filters.push_back(parse_filter_name(nullptr));
    } while (at(TokenKind::kPipe));
    expect_close_statement();
    std::string found;
    node->body = parse_body({"endfilter"}, "filter", line, &found);
    expect_close_statement();
    return node;
  }

  // --- expressions ---

  ExprPtr parse_expression_sequence() {
    const int line = current_line();
    ExprPtr first = parse_expression();
    if (!at(TokenKind::kComma)) {
      return first;
    }
    auto tuple = std::make_unique<ListExpr>(line);
    tuple->items.push_back(std::move(first));
    while (at(TokenKind::kComma)) {
      ++pos_;
      if (at(TokenKind::kCloseStatement) || at(TokenKind::kCloseParen)) {
        break;
      }
      tuple->items.push_back(parse_expression());
    }
    return sized(std::move(tuple));
  }

  ExprPtr parse_expression() {
    const Nested nested(*this);
    const int line = current_line();
    ExprPtr value = parse_or();
    if (!at_name("if")) {
      return value;
    }
    ++pos_;
    auto node = std::make_unique<ConditionalExpr>(line);
    node->then_value = std::move(value);
    node->condition = parse_or();
    if (at_name("else")) {
      ++pos_;
      node->else_value = parse_expression();
    }
    return sized(std::move(node));
  }

  ExprPtr make_binary(BinaryOp op, ExprPtr left, ExprPtr right, int line) {
    auto node = std::make_unique<BinaryExpr>(line);
    node->op = op;
    node->left = std::move(left);
    node->right = std::move(right);
    return sized(std::move(node));
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      const int line = advance().line;
      left = make_binary(BinaryOp::kOr, std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      const int line = advance().line;
      left = make_binary(BinaryOp::kAnd, std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      const Nested nested(*this);
      auto node = std::make_unique<UnaryExpr>(advance().line);
      node->op = UnaryOp::kNot;
      node->operand = parse_not();
      return sized(std::move(node));
    }
    return parse_comparison();
  }

  ExprPtr parse_comparison() {
    ExprPtr left = parse_additive();
    while (true) {
      const int line = current_line();
      BinaryOp op;
      if (at_name("not") && at_name("in", 1)) {
        pos_ += 2;
        op = BinaryOp::kNotIn;
      } else if (at_name("in")) {
        ++pos_;
        op = BinaryOp::kIn;
      } else if (at_operator("==")) {
        ++pos_;
        op = BinaryOp::kEqual;
      } else if (at_operator("!=")) {
        ++pos_;
        op = BinaryOp::kNotEqual;
      } else if (at_operator("<")) {
        ++pos_;
        op = BinaryOp::kLess;
      } else if (at_operator("<=")) {
        ++pos_;
        op = BinaryOp::kLessEqual;
      } else if (at_operator(">")) {
        ++pos_;
        op = BinaryOp::kGreater;
      } else if (at_operator(">=")) {
        ++pos_;
        op = BinaryOp::kGreaterEqual;
      } else {
        return left;
      }
      left = make_binary(op, std::move(left), parse_additive(), line);
    }
  }

  ExprPtr parse_additive() {
    ExprPtr left = parse_multiplicative();
    while (at_operator("+") || at_operator("-") || at_operator("~")) {
      const Token& op = advance();
      ExprPtr right = parse_multiplicative();
      if (op.text == "-") {
        left = make_binary(BinaryOp::kSubtract, std::move(left), std::move(right), op.line);
        continue;
      }
      const bool tilde = op.text == "~";
      if (left->kind == ExprKind::kConcat && static_cast<ConcatExpr&>(*left).tilde == tilde) {
        // Flat: a long chain only grows as tall as its tallest operand.
        left->height = std::max(left->height, right->height + 1);
        if (left->height > kMaxTemplateNesting) {
          fail_nesting(op.line);
        }
        static_cast<ConcatExpr&>(*left).operands.push_back(std::move(right));
        continue;
      }
      auto concat = std::make_unique<ConcatExpr>(op.line);
      concat->tilde = tilde;
      concat->operands.push_back(std::move(left));
      concat->operands.push_back(std::move(right));
      left = sized(std::move(concat));
    }
    return left;
  }

  ExprPtr parse_multiplicative() {
    ExprPtr left = parse_power();
    while (true) {
      BinaryOp op;
      if (at_operator("*")) {
        op = BinaryOp::kMultiply;
      } else if (at_operator("/")) {
        op = BinaryOp::kDivide;
      } else if (at_operator("//")) {
        op = BinaryOp::kFloorDivide;
      } else if (at_operator("%")) {
        op = BinaryOp::kModulo;
      } else {
        return left;
      }
      const int line = advance().line;
      left = make_binary(op, std::move(left), parse_power(), line);
    }
  }

  ExprPtr parse_power() {
    // Left-associative, as in Jinja2: 2 ** 3 ** 2 == (2 ** 3) ** 2.
    ExprPtr left = parse_test();
    while (at_operator("**")) {
      const int line = advance().line;
      left = make_binary(BinaryOp::kPower, std::move(left), parse_test(), line);
    }
    return left;
  }

  bool starts_test_argument() const {
    if (at(TokenKind::kName)) {
      return !one_of(tokens_[pos_].text, kTestArgumentStops);
    }
    return at(TokenKind::kNumber) || at(TokenKind::kString) || at(TokenKind::kOpenBracket) ||
           at(TokenKind::kOpenBrace);
  }

  ExprPtr parse_test() {
    ExprPtr operand = parse_filters(parse_unary());
    while (at_name("is")) {
      auto node = std::make_unique<TestExpr>(advance().line);
      if (at_name("not")) {
        ++pos_;
        node->negated = true;
      }
      node->name = expect_name("a test name after 'is'");
      const auto test = find_test(node->name);
      if (!test) {
        fail(fmt::format("unknown test '{}'", node->name), node->line);
      }
      node->test = *test;
      if (at(TokenKind::kOpenParen)) {
        node->args = parse_call_arguments();
      } else if (starts_test_argument()) {
        Argument argument;
        argument.value = parse_postfix(parse_primary());
        node->args.push_back(std::move(argument));
      }
      node->operand = std::move(operand);
      operand = sized(std::move(node));
    }
    return operand;
  }

  // One `name(args)` of a filter chain; the operand is filled in by the caller.
  std::unique_ptr<FilterExpr> parse_filter_name(ExprPtr operand) {
    auto node = std::make_unique<FilterExpr>(current_line());
    node->name = expect_name("a filter name");
    const auto filter = find_filter(node->name);
    if (!filter) {
      fail(fmt::format("unknown filter '{}'", node->name), node->line);
    }
    node->filter = *filter;
    if (at(TokenKind::kOpenParen)) {
      node->args = parse_call_arguments();
    }
    check_named_arguments(*node);
    node->operand = std::move(operand);
    return sized(std::move(node));
  }

  // Tests and filters named by string literals (select("odd"), map("upper")) are checked now.
  void check_named_arguments(const FilterExpr& node) {
    const auto literal_at = [&](std::size_t index) -> const std::string* {
      std::size_t seen = 0;
      for (const Argument& argument : node.args) {
        if (argument.kind != Argument::Kind::kPositional) {
          continue;
        }
        if (seen++ == index) {
          if (argument.value->kind == ExprKind::kLiteral &&
              static_cast<const LiteralExpr&>(*argument.value).value.is_string()) {
            return &static_cast<const LiteralExpr&>(*argument.value).text;
          }
          return nullptr;
        }
      }
      return nullptr;
    };
    const auto check_test = [&](const std::string* name) {
      if (name && !find_test(*name)) {
        fail(fmt::format("unknown test '{}'", *name), node.line);
      }
    };
    switch (node.filter) {
      case Filter::kSelect:
      case Filter::kReject:
        check_test(literal_at(0));
        break;
      case Filter::kSelectattr:
      case Filter::kRejectattr:
        check_test(literal_at(1));
        break;
      case Filter::kMap:
        if (const std::string* name = literal_at(0); name && !find_filter(*name)) {
          fail(fmt::format("unknown filter '{}'", *name), node.line);
        }
        break;
      default:
        break;
    }
  }

  ExprPtr parse_filters(ExprPtr operand) {
    while (at(TokenKind::kPipe)) {
      ++pos_;
      operand = parse_filter_name(std::move(operand));
    }
    return operand;
  }

  ExprPtr parse_unary() {
    if ((at(TokenKind::kUnary) || at(TokenKind::kOperator)) &&
        (tokens_[pos_].text == "-" || tokens_[pos_].text == "+")) {
      const Nested nested(*this);
      const Token& op = advance();
      auto node = std::make_unique<UnaryExpr>(op.line);
      node->op = op.text == "-" ? UnaryOp::kNegate : UnaryOp::kPlus;
      node->operand = parse_unary();
      return sized(std::move(node));
    }
    return parse_postfix(parse_primary());
  }

  std::vector<Argument> parse_call_arguments() {
    expect(TokenKind::kOpenParen, "'('");
    std::vector<Argument> args;
    bool saw_keyword = false;
    while (!at(TokenKind::kCloseParen)) {
      Argument argument;
      if (at_operator("**")) {
        ++pos_;
        argument.kind = Argument::Kind::kKeywordSpread;
        argument.value = parse_expression();
      } else if (at_operator("*")) {
        ++pos_;
        argument.kind = Argument::Kind::kSpread;
        argument.value = parse_expression();
      } else if (at(TokenKind::kName) && at(TokenKind::kAssign, 1)) {
        argument.kind = Argument::Kind::kKeyword;
        argument.name = advance().text;
        ++pos_;
        argument.value = parse_expression();
        saw_keyword = true;
      } else {
        if (saw_keyword) {
          fail_here("positional argument follows keyword argument");
        }
        argument.value = parse_expression();
      }
      args.push_back(std::move(argument));
      if (!at(TokenKind::kComma)) {
        break;
      }
      ++pos_;
    }
    expect(TokenKind::kCloseParen, "')'");
    // The names are viewed only once the vector stops moving its elements.
    for (Argument& argument : args) {
      argument.name_value = Value::borrowed_string(argument.name);
    }
    return args;
  }

  ExprPtr parse_postfix(ExprPtr object) {
    while (true) {
      const int line = current_line();
      if (at(TokenKind::kDot)) {
        ++pos_;
        auto node = std::make_unique<AttributeExpr>(line);
        if (at(TokenKind::kNumber) &&
            tokens_[pos_].text.find_first_not_of("0123456789") == std::string::npos) {
          node->name = advance().text;
          std::int64_t index = 0;
          std::from_chars(node->name.data(), node->name.data() + node->name.size(), index);
          node->key = Value::integer(index);
        } else {
          node->name = expect_name("an attribute name after '.'");
          node->key = Value::borrowed_string(node->name);
          node->method = find_method(node->name);
        }
        node->object = std::move(object);
        object = sized(std::move(node));
      } else if (at(TokenKind::kOpenBracket)) {
        ++pos_;
        object = parse_subscript(std::move(object), line);
      } else if (at(TokenKind::kOpenParen)) {
        auto node = std::make_unique<CallExpr>(line);
        node->callee = std::move(object);
        node->args = parse_call_arguments();
        object = sized(std::move(node));
      } else {
        return object;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object, int line) {
    std::vector<ExprPtr> parts;
    bool is_slice = false;
    while (!at(TokenKind::kCloseBracket)) {
      if (at_end()) {
        fail_here("expected ']'");
      }
      if (at(TokenKind::kColon)) {
        parts.push_back(nullptr);
        ++pos_;
        is_slice = true;
      } else {
        parts.push_back(parse_expression());
        if (at(TokenKind::kColon)) {
          ++pos_;
          is_slice = true;
        }
      }
    }
    ++pos_;
    if (parts.empty()) {
      fail("expected a subscript between '[' and ']'", line);
    }
    if (!is_slice) {
      if (parts.size() != 1) {
        fail("expected one subscript", line);
      }
      auto node = std::make_unique<SubscriptExpr>(line);
      node->object = std::move(object);
      node->key = std::move(parts[0]);
      return sized(std::move(node));
    }
    if (parts.size() > 3) {
      fail("a slice has at most three parts", line);
    }
    parts.resize(3);
    auto node = std::make_unique<SliceExpr>(line);
    node->object = std::move(object);
    node->start = std::move(parts[0]);
    node->stop = std::move(parts[1]);
    node->step = std::move(parts[2]);
    return sized(std::move(node));
  }

  ExprPtr literal(Value value, int line) {
    auto node = std::make_unique<LiteralExpr>(line);
    node->value = std::move(value);
    return node;
  }

  ExprPtr parse_primary() {
    const int line = current_line();
    if (at_end()) {
      fail_here("unexpected end of template in an expression");
    }
    const Token& token = tokens_[pos_];
    switch (token.kind) {
      case TokenKind::kNumber: {
        ++pos_;
        return literal(parse_number(token), line);
      }
      case TokenKind::kString: {
        auto node = std::make_unique<LiteralExpr>(line);
        while (at(TokenKind::kString)) {
          node->text += advance().text;
        }
        node->value = Value::borrowed_string(node->text);
        return node;
      }
      case TokenKind::kName: {
        ++pos_;
        const std::string& name = token.text;
        if (name == "true" || name == "True") {
          return literal(Value::boolean(true), line);
        }
        if (name == "false" || name == "False") {
          return literal(Value::boolean(false), line);
        }
        if (name == "none" || name == "None") {
          return literal(Value::none(), line);
        }
        auto node = std::make_unique<NameExpr>(line);
        node->name = name;
        node->symbol = intern(name);
        node->builtin = find_builtin_function(name);
        if (!implicit_stack_.empty()) {
          ImplicitArguments& implicit = *implicit_stack_.back();
          implicit.caller = implicit.caller || node->symbol == kCallerSymbol;
          implicit.varargs = implicit.varargs || node->symbol == kVarargsSymbol;
          implicit.kwargs = implicit.kwargs || node->symbol == kKwargsSymbol;
        }
        return node;
      }
      case TokenKind::kOpenParen: {
        ++pos_;
        if (at(TokenKind::kCloseParen)) {
          ++pos_;
          return std::make_unique<ListExpr>(line);
        }
        ExprPtr inner = parse_expression_sequence();
        expect(TokenKind::kCloseParen, "')'");
        return inner;
      }
      case TokenKind::kOpenBracket: {
        ++pos_;
        auto node = std::make_unique<ListExpr>(line);
        while (!at(TokenKind::kCloseBracket)) {
          node->items.push_back(parse_expression());
          if (!at(TokenKind::kComma)) {
            break;
          }
          ++pos_;
        }
        expect(TokenKind::kCloseBracket, "']'");
        return sized(std::move(node));
      }
      case TokenKind::kOpenBrace: {
        ++pos_;
        auto node = std::make_unique<DictExpr>(line);
        while (!at(TokenKind::kCloseBrace)) {
          ExprPtr key = parse_expression();
          expect(TokenKind::kColon, "':' in a dict literal");
          node->entries.emplace_back(std::move(key), parse_expression());
          if (!at(TokenKind::kComma)) {
            break;
          }
          ++pos_;
        }
        expect(TokenKind::kCloseBrace, "'}'");
        return sized(std::move(node));
      }
      default:
        fail_here(fmt::format("unexpected {} in an expression", describe_current()));
    }
  }

  Value parse_number(const Token& token) const {
    const std::string& text = token.text;
    if (text.find_first_of(".eE") != std::string::npos) {
      return Value::floating(std::strtod(text.c_str(), nullptr));
    }
    std::int64_t value = 0;
    const auto result =
        std::from_chars(text.data() + (text[0] == '+' ? 1 : 0), text.data() + text.size(), value);
    if (result.ec != std::errc()) {
      return Value::floating(std::strtod(text.c_str(), nullptr));
    }
    return Value::integer(value);
  }

  std::vector<Token> tokens_;
  std::size_t pos_ = 0;
  int loop_depth_ = 0;
  // Levels of nesting the parse is inside (Nested).
  int nesting_ = 0;
  std::vector<ImplicitArguments*> implicit_stack_;
  std::vector<std::string> symbols_;
  std::unordered_map<std::string, int> symbol_ids_;
};

}  // namespace

std::shared_ptr<const Program> parse_program(std::string_view source) {
  return Parser(tokenize(source)).run();
}

}  // namespace kvr::chat_template::detail
