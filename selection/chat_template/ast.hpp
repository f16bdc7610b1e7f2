// The syntax tree of a parsed chat template: expressions and statements, built once by the parser
// and only read afterwards (so renders on several threads share it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "selection/chat_template/builtins.hpp"
#include "selection/chat_template/value.hpp"

namespace kvr::chat_template::detail {

/// What an Expr is, to dispatch on without virtual calls.
enum class ExprKind {
  kLiteral,
  kName,
  kList,
  kDict,
  kAttribute,
  kSubscript,
  kSlice,
  kCall,
  kFilter,
  kTest,
  kUnary,
  kBinary,
  kConcat,
  kConditional,
};

/// An expression node; `line` is where it starts in the template.
struct Expr {
  Expr(ExprKind expr_kind, int source_line) : kind(expr_kind), line(source_line) {}
  virtual ~Expr() = default;
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;

  ExprKind kind;
  int line;
  // The most nodes on a path from this one down to a leaf (a literal or a name is 1); the parser
  // bounds it, so that evaluating and destroying the tree recurse a bounded depth.
  int height = 1;
};
using ExprPtr = std::unique_ptr<Expr>;

/// A constant; a string literal's value views `text`.
struct LiteralExpr : Expr {
  explicit LiteralExpr(int source_line) : Expr(ExprKind::kLiteral, source_line) {}
  std::string text;
  Value value;
};

/// A variable; `symbol` indexes the template's symbol table.
struct NameExpr : Expr {
  explicit NameExpr(int source_line) : Expr(ExprKind::kName, source_line) {}
  std::string name;
  int symbol = 0;
  BuiltinFunction builtin = BuiltinFunction::kNone;
};

/// [a, b] or (a, b).
struct ListExpr : Expr {
  explicit ListExpr(int source_line) : Expr(ExprKind::kList, source_line) {}
  std::vector<ExprPtr> items;
};

/// {key: value, ...}.
struct DictExpr : Expr {
  explicit DictExpr(int source_line) : Expr(ExprKind::kDict, source_line) {}
  std::vector<std::pair<ExprPtr, ExprPtr>> entries;
};

/// object.name, or object.0 (an index).
struct AttributeExpr : Expr {
  explicit AttributeExpr(int source_line) : Expr(ExprKind::kAttribute, source_line) {}
  ExprPtr object;
  std::string name;
  Value key;  // the name as a string value, or the index as an int
  Method method = Method::kNone;
};

/// object[key].
struct SubscriptExpr : Expr {
  explicit SubscriptExpr(int source_line) : Expr(ExprKind::kSubscript, source_line) {}
  ExprPtr object;
  ExprPtr key;
};

/// object[start:stop:step]; absent parts are null.
struct SliceExpr : Expr {
  explicit SliceExpr(int source_line) : Expr(ExprKind::kSlice, source_line) {}
  ExprPtr object;
  ExprPtr start;
  ExprPtr stop;
  ExprPtr step;
};

/// One argument of a call: `value`, `name=value`, `*value` or `**value`.
struct Argument {
  enum class Kind { kPositional, kKeyword, kSpread, kKeywordSpread };
  Kind kind = Kind::kPositional;
  std::string name;
  Value name_value;  // the keyword's name as a string value
  ExprPtr value;
};

/// callee(args).
struct CallExpr : Expr {
  explicit CallExpr(int source_line) : Expr(ExprKind::kCall, source_line) {}
  ExprPtr callee;
  std::vector<Argument> args;
};

/// operand | name(args).
struct FilterExpr : Expr {
  explicit FilterExpr(int source_line) : Expr(ExprKind::kFilter, source_line) {}
  ExprPtr operand;  // null in a {% filter %} block
  Filter filter = Filter::kSafe;
  std::string name;
  std::vector<Argument> args;
};

/// operand is [not] name(args).
struct TestExpr : Expr {
  explicit TestExpr(int source_line) : Expr(ExprKind::kTest, source_line) {}
  ExprPtr operand;
  Test test = Test::kDefined;
  std::string name;
  bool negated = false;
  std::vector<Argument> args;
};

/// not, -, +.
enum class UnaryOp { kNot, kNegate, kPlus };

/// op operand.
struct UnaryExpr : Expr {
  explicit UnaryExpr(int source_line) : Expr(ExprKind::kUnary, source_line) {}
  UnaryOp op = UnaryOp::kNot;
  ExprPtr operand;
};

/// The binary operators other than + and ~ (which ConcatExpr holds).
enum class BinaryOp {
  kAnd,
  kOr,
  kSubtract,
  kMultiply,
  kDivide,
  kFloorDivide,
  kModulo,
  kPower,
  kEqual,
  kNotEqual,
  kLess,
  kLessEqual,
  kGreater,
  kGreaterEqual,
  kIn,
  kNotIn,
};

/// left op right; and/or evaluate `right` only when needed.
struct BinaryExpr : Expr {
  explicit BinaryExpr(int source_line) : Expr(ExprKind::kBinary, source_line) {}
  BinaryOp op = BinaryOp::kAnd;
  ExprPtr left;
  ExprPtr right;
};

/// a + b + c or a ~ b ~ c, flattened so that string chains are built in one buffer.
struct ConcatExpr : Expr {
  explicit ConcatExpr(int source_line) : Expr(ExprKind::kConcat, source_line) {}
  bool tilde = false;  // ~ (string concatenation) rather than +
  std::vector<ExprPtr> operands;
};

/// a if condition else b; without else, undefined when the condition fails.
struct ConditionalExpr : Expr {
  explicit ConditionalExpr(int source_line) : Expr(ExprKind::kConditional, source_line) {}
  ExprPtr condition;
  ExprPtr then_value;
  ExprPtr else_value;
};

/// What a Stmt is.
enum class StmtKind {
  kText,
  kOutput,
  kIf,
  kFor,
  kSet,
  kMacro,
  kCallBlock,
  kFilterBlock,
  kBreak,
  kContinue,
};

/// A statement node; `line` is where its tag starts.
struct Stmt {
  Stmt(StmtKind stmt_kind, int source_line) : kind(stmt_kind), line(source_line) {}
  virtual ~Stmt() = default;
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  StmtKind kind;
  int line;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

/// Template text, output as is.
struct TextStmt : Stmt {
  explicit TextStmt(int source_line) : Stmt(StmtKind::kText, source_line) {}
  std::string text;
};

/// {{ value }}.
struct OutputStmt : Stmt {
  explicit OutputStmt(int source_line) : Stmt(StmtKind::kOutput, source_line) {}
  ExprPtr value;
};

/// if / elif ... / else.
struct IfStmt : Stmt {
  explicit IfStmt(int source_line) : Stmt(StmtKind::kIf, source_line) {}
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body else_body;
};

/// for targets in iterable [if filter] ... [else ...].
struct ForStmt : Stmt {
  explicit ForStmt(int source_line) : Stmt(StmtKind::kFor, source_line) {}
  std::vector<int> targets;
  bool unpack = false;  // `for a, b in ...`
  ExprPtr iterable;
  ExprPtr filter;
  Body body;
  Body else_body;
};

/// set names = value, set ns.attr = value, or a block set (value rendered from body).
struct SetStmt : Stmt {
  explicit SetStmt(int source_line) : Stmt(StmtKind::kSet, source_line) {}
  std::vector<int> targets;
  bool unpack = false;
  ExprPtr namespace_object;  // set ns.attr: the namespace, and the attribute below
  std::string attribute_name;
  Value attribute;  // views attribute_name
  ExprPtr value;
  bool block = false;
  Body body;
};

/// A macro's or call block's parameter.
struct Parameter {
  int symbol = 0;
  std::string name;
  ExprPtr default_value;
};

/// What a macro or call-block body reads of Jinja's implicit arguments.
struct ImplicitArguments {
  bool caller = false;
  bool varargs = false;
  bool kwargs = false;
};

/// {% macro name(params) %} body {% endmacro %}.
struct MacroStmt : Stmt {
  explicit MacroStmt(int source_line) : Stmt(StmtKind::kMacro, source_line) {}
  int symbol = 0;
  std::string name;
  std::vector<Parameter> params;
  ImplicitArguments implicit;
  Body body;
};

/// {% call [(params)] macro(args) %} body {% endcall %}: the body is the macro's caller().
struct CallBlockStmt : Stmt {
  explicit CallBlockStmt(int source_line) : Stmt(StmtKind::kCallBlock, source_line) {}
  std::unique_ptr<CallExpr> call;
  std::vector<Parameter> params;
  ImplicitArguments implicit;
  Body body;
};

/// {% filter f(args) | g %} body {% endfilter %}: the filters apply to the rendered body.
struct FilterBlockStmt : Stmt {
  explicit FilterBlockStmt(int source_line) : Stmt(StmtKind::kFilterBlock, source_line) {}
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
};

/// {% break %} or {% continue %}.
struct LoopControlStmt : Stmt {
  LoopControlStmt(StmtKind stmt_kind, int source_line) : Stmt(stmt_kind, source_line) {}
};

/// Symbols every template has, at fixed indices.
inline constexpr int kLoopSymbol = 0;
inline constexpr int kCallerSymbol = 1;
inline constexpr int kVarargsSymbol = 2;
inline constexpr int kKwargsSymbol = 3;

/// A parsed template: its statements and the names of its symbols (by index).
struct Program {
  Body body;
  std::vector<std::string> symbols;
  // The symbols sorted by name, to bind the context's keys by name.
  std::vector<std::pair<std::string, int>> symbols_by_name;
};

}  // namespace kvr::chat_template::detail
