// The chat-template interpreter: a tree walk over the Program, writing into one output string.
#include "selection/chat_template/interpreter.hpp"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <deque>
#include <memory>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "selection/chat_template/chat_template.hpp"
#include "selection/chat_template/template_error.hpp"

namespace kvr::chat_template::detail {

/// A variable scope: a for loop's, a macro call's, or the root (whose variables are a table by
/// symbol, holding the render's bindings and top-level sets).
struct Scope {
  explicit Scope(Scope* parent_scope) : parent(parent_scope) {}

  void set(int symbol, Value value) {
    if (globals != nullptr) {
      (*globals)[static_cast<std::size_t>(symbol)] = std::move(value);
      return;
    }
    for (auto& [existing, existing_value] : variables) {
      if (existing == symbol) {
        existing_value = std::move(value);
        return;
      }
    }
    variables.emplace_back(symbol, std::move(value));
  }

  Scope* parent;
  std::vector<std::pair<int, Value>> variables;
  std::vector<Value>* globals = nullptr;
};

namespace {

// Deep enough for any chat template, shallow enough to stay far from the stack's end.
constexpr int kMaxCallDepth = 100;

enum class Flow { kNormal, kBreak, kContinue };

bool is_integral(const Value& value) {
  return value.is_int() || value.kind() == Value::Kind::kBool;
}

std::int64_t integral(const Value& value) {
  return value.is_int() ? value.as_int() : (value.as_bool() ? 1 : 0);
}

[[noreturn]] void fail_operands(std::string_view op, const Value& left, const Value& right) {
  fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(left),
                   type_name(right)));
}

Value repeat(const Value& sequence, std::int64_t times) {
  if (sequence.is_string()) {
    std::string out;
    for (std::int64_t i = 0; i < times; ++i) {
      out.append(sequence.as_string());
    }
    return Value::owned_string(std::move(out));
  }
  std::vector<Value> items;
  const std::size_t size = sequence_size(sequence);
  for (std::int64_t i = 0; i < times; ++i) {
    for (std::size_t j = 0; j < size; ++j) {
      items.push_back(sequence_at(sequence, j));
    }
  }
  return Value::array(std::move(items));
}

// Python's `left + right`: numbers add, strings and lists concatenate, anything else fails.
Value add(const Value& left, const Value& right) {
  if (left.is_number() && right.is_number()) {
    if (is_integral(left) && is_integral(right)) {
      std::int64_t result = 0;
      if (!__builtin_add_overflow(integral(left), integral(right), &result)) {
        return Value::integer(result);
      }
    }
    return Value::floating(left.as_number() + right.as_number());
  }
  if (left.is_string() && right.is_string()) {
    std::string out;
    out.reserve(left.as_string().size() + right.as_string().size());
    out.append(left.as_string());
    out.append(right.as_string());
    return Value::owned_string(std::move(out));
  }
  if (left.is_sequence() && right.is_sequence()) {
    std::vector<Value> items;
    for (const Value* side : {&left, &right}) {
      const std::size_t size = sequence_size(*side);
      for (std::size_t i = 0; i < size; ++i) {
        items.push_back(sequence_at(*side, i));
      }
    }
    return Value::array(std::move(items));
  }
  fail_operands("+", left, right);
}

double checked_divisor(double divisor) {
  if (divisor == 0.0) {
    fail("division by zero");
  }
  return divisor;
}

Value arithmetic(BinaryOp op, const Value& left, const Value& right) {
  if (op == BinaryOp::kMultiply) {
    if ((left.is_string() || left.is_sequence()) && is_integral(right)) {
      return repeat(left, integral(right));
    }
    if ((right.is_string() || right.is_sequence()) && is_integral(left)) {
      return repeat(right, integral(left));
    }
  }
  if (!left.is_number() || !right.is_number()) {
    constexpr std::string_view kNames[] = {"", "", "-", "*", "/", "//", "%", "**"};
    fail_operands(kNames[static_cast<int>(op)], left, right);
  }
  if (is_integral(left) && is_integral(right)) {
    const std::int64_t a = integral(left);
    const std::int64_t b = integral(right);
    std::int64_t result = 0;
    switch (op) {
      case BinaryOp::kSubtract:
        if (!__builtin_sub_overflow(a, b, &result)) {
          return Value::integer(result);
        }
        break;
      case BinaryOp::kMultiply:
        if (!__builtin_mul_overflow(a, b, &result)) {
          return Value::integer(result);
        }
        break;
      case BinaryOp::kFloorDivide: {
        if (b == 0) {
          fail("integer division or modulo by zero");
        }
        std::int64_t quotient = a / b;
        if ((a % b != 0) && ((a < 0) != (b < 0))) {
          --quotient;
        }
        return Value::integer(quotient);
      }
      case BinaryOp::kModulo: {
        if (b == 0) {
          fail("integer division or modulo by zero");
        }
        std::int64_t remainder = a % b;
        if (remainder != 0 && ((remainder < 0) != (b < 0))) {
          remainder += b;
        }
        return Value::integer(remainder);
      }
      case BinaryOp::kPower:
        if (b >= 0) {
          std::int64_t power = 1;
          bool overflow = false;
          for (std::int64_t i = 0; i < b && !overflow; ++i) {
            overflow = __builtin_mul_overflow(power, a, &power);
          }
          if (!overflow) {
            return Value::integer(power);
          }
        }
        break;
      default:
        break;
    }
  }
  const double a = left.as_number();
  const double b = right.as_number();
  switch (op) {
    case BinaryOp::kSubtract:
      return Value::floating(a - b);
    case BinaryOp::kMultiply:
      return Value::floating(a * b);
    case BinaryOp::kDivide:
      return Value::floating(a / checked_divisor(b));
    case BinaryOp::kFloorDivide:
      return Value::floating(std::floor(a / checked_divisor(b)));
    case BinaryOp::kModulo: {
      double remainder = std::fmod(a, checked_divisor(b));
      if (remainder != 0.0 && ((remainder < 0) != (b < 0))) {
        remainder += b;
      }
      return Value::floating(remainder);
    }
    case BinaryOp::kPower:
      if (a == 0.0 && b < 0) {
        fail("0.0 cannot be raised to a negative power");
      }
      return Value::floating(std::pow(a, b));
    default:
      fail("unknown arithmetic operator");
  }
}

std::string format_time(const NowFunction& now, std::string_view format) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now());
  std::tm local{};
  localtime_r(&seconds, &local);
  const std::string pattern(format);
  if (pattern.empty()) {
    return {};
  }
  std::string out(pattern.size() * 4 + 64, '\0');
  while (true) {
    const std::size_t size = std::strftime(out.data(), out.size(), pattern.c_str(), &local);
    if (size > 0 || out.size() > 65536) {
      out.resize(size);
      return out;
    }
    out.resize(out.size() * 2);
  }
}

class Interpreter {
 public:
  Interpreter(const Program& program, const NowFunction& now)
      : program_(program), now_(now), globals_(program.symbols.size()) {}
  ~Interpreter() { release_containers(); }
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  void bind(std::string_view name, Value value) {
    const auto& symbols = program_.symbols_by_name;
    const auto it =
        std::lower_bound(symbols.begin(), symbols.end(), name,
                         [](const std::pair<std::string, int>& entry, std::string_view key) {
                           return std::string_view(entry.first) < key;
                         });
    // Variables the template never names cannot be read; they are not kept.
    if (it != symbols.end() && it->first == name) {
      globals_[static_cast<std::size_t>(it->second)] = std::move(value);
    }
  }

  std::string run() {
    Scope& root = scopes_.emplace_back(nullptr);
    root.globals = &globals_;
    std::string out;
    out.reserve(1024);
    render(program_.body, root, out);
    return out;
  }

 private:
  Scope& new_scope(Scope* parent) { return scopes_.emplace_back(parent); }

  // One level of the render's nesting while it lives: every body rendered and every expression
  // evaluated inside another holds one, so that the stack the render uses stays bounded whatever
  // the template recurses into.
  class Nested {
   public:
    explicit Nested(int& nesting) : nesting_(nesting) {
      if (nesting_ >= kMaxRenderNesting) {
        fail(fmt::format("the template nests deeper than {} levels as it renders (recursion?)",
                         kMaxRenderNesting));
      }
      ++nesting_;
    }
    ~Nested() { --nesting_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    int& nesting_;
  };

  Flow render(const Body& body, Scope& scope, std::string& out) {
    const Nested nested(nesting_);
    for (const StmtPtr& statement : body) {
      try {
        const Flow flow = render_statement(*statement, scope, out);
        if (flow != Flow::kNormal) {
          return flow;
        }
      } catch (TemplateFailure& failure) {
        if (failure.error().line == 0) {
          failure.error().line = statement->line;
        }
        throw;
      }
    }
    return Flow::kNormal;
  }

  Flow render_statement(const Stmt& statement, Scope& scope, std::string& out) {
    switch (statement.kind) {
      case StmtKind::kText:
        out.append(static_cast<const TextStmt&>(statement).text);
        return Flow::kNormal;
      case StmtKind::kOutput: {
        const Expr& value = *static_cast<const OutputStmt&>(statement).value;
        if (value.kind == ExprKind::kConcat) {
          render_concat(static_cast<const ConcatExpr&>(value), scope, out);
        } else {
          Value storage;
          append_output(out, eval_ref(value, scope, storage));
        }
        return Flow::kNormal;
      }
      case StmtKind::kIf: {
        const auto& node = static_cast<const IfStmt&>(statement);
        for (const auto& [condition, body] : node.branches) {
          if (truthy(eval(*condition, scope))) {
            return render(body, scope, out);
          }
        }
        return render(node.else_body, scope, out);
      }
      case StmtKind::kFor:
        return render_for(static_cast<const ForStmt&>(statement), scope, out);
      case StmtKind::kSet:
        return execute_set(static_cast<const SetStmt&>(statement), scope);
      case StmtKind::kMacro: {
        const auto& node = static_cast<const MacroStmt&>(statement);
        auto callable = std::make_shared<Callable>();
        callable->macro = &node;
        callable->scope = &scope;
        scope.set(node.symbol, Value::callable(std::move(callable)));
        return Flow::kNormal;
      }
      case StmtKind::kCallBlock:
        render_call_block(static_cast<const CallBlockStmt&>(statement), scope, out);
        return Flow::kNormal;
      case StmtKind::kFilterBlock: {
        const auto& node = static_cast<const FilterBlockStmt&>(statement);
        std::string body;
        const Flow flow = render(node.body, scope, body);
        Value value = Value::owned_string(std::move(body));
        for (const auto& filter : node.filters) {
          const CallArgs args = eval_args(filter->args, scope);
          value = apply_filter(filter->filter, value, args);
        }
        append_output(out, value);
        return flow;
      }
      case StmtKind::kBreak:
        return Flow::kBreak;
      case StmtKind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void bind_targets(const std::vector<int>& targets, bool unpack, const Value& item, Scope& scope) {
    if (!unpack) {
      scope.set(targets[0], item);
      return;
    }
    if (!item.is_sequence()) {
      fail(fmt::format("cannot unpack non-sequence '{}'", type_name(item)));
    }
    const std::size_t size = sequence_size(item);
    if (size != targets.size()) {
      fail(fmt::format("too {} values to unpack (expected {}, got {})",
                       size < targets.size() ? "few" : "many", targets.size(), size));
    }
    for (std::size_t i = 0; i < size; ++i) {
      scope.set(targets[i], sequence_at(item, i));
    }
  }

  Flow render_for(const ForStmt& node, Scope& scope, std::string& out) {
    Scope& loop_scope = new_scope(&scope);
    auto items = std::make_shared<std::vector<Value>>(iterate(eval(*node.iterable, loop_scope)));
    if (node.filter) {
      Scope& test_scope = new_scope(&loop_scope);
      std::vector<Value> selected;
      for (Value& item : *items) {
        test_scope.variables.clear();
        bind_targets(node.targets, node.unpack, item, test_scope);
        if (truthy(eval(*node.filter, test_scope))) {
          selected.push_back(std::move(item));
        }
      }
      *items = std::move(selected);
    }
    if (items->empty()) {
      return render(node.else_body, loop_scope, out);
    }
    auto loop = std::make_shared<LoopData>();
    loop->items = items;
    loop_scope.set(kLoopSymbol, Value::loop(loop));
    for (std::size_t i = 0; i < items->size(); ++i) {
      // A `loop` the body kept (in a namespace, say) keeps its own position.
      if (loop.use_count() > 2) {
        loop = std::make_shared<LoopData>();
        loop->items = items;
        loop_scope.set(kLoopSymbol, Value::loop(loop));
      }
      loop->index0 = static_cast<std::int64_t>(i);
      bind_targets(node.targets, node.unpack, (*items)[i], loop_scope);
      if (render(node.body, loop_scope, out) == Flow::kBreak) {
        break;
      }
    }
    return Flow::kNormal;
  }

  Flow execute_set(const SetStmt& node, Scope& scope) {
    Flow flow = Flow::kNormal;
    Value value;
    if (node.block) {
      std::string body;
      flow = render(node.body, scope, body);
      value = Value::owned_string(std::move(body));
    } else {
      value = eval(*node.value, scope);
    }
    if (node.namespace_object) {
      const Value target = eval(*node.namespace_object, scope);
      if (target.kind() != Value::Kind::kNamespace) {
        fail(
            fmt::format("cannot assign attribute on non-namespace object '{}'", type_name(target)));
      }
      target.namespace_data()->set(node.attribute, std::move(value));
    } else {
      bind_targets(node.targets, node.unpack, value, scope);
    }
    return flow;
  }

  void render_call_block(const CallBlockStmt& node, Scope& scope, std::string& out) {
    const Value callee = eval(*node.call->callee, scope);
    if (callee.kind() != Value::Kind::kCallable || callee.callable_data().macro == nullptr) {
      fail("'call' needs a macro");
    }
    CallArgs args = eval_args(node.call->args, scope);
    auto caller = std::make_shared<Callable>();
    caller->call_block = &node;
    caller->scope = &scope;
    append_output(out, invoke(callee.callable_data(), args, Value::callable(std::move(caller))));
  }

  // --- expressions ---

  // Empties every list, dict and namespace the render's variables reach, then lets them go one at
  // a time: a list made to hold itself (a.append(a)) is freed rather than leaked, and a long chain
  // of lists in lists is freed without a recursion down its length.
  void release_containers() {
    std::vector<Value> reached;
    std::vector<Value> pending(globals_.begin(), globals_.end());
    for (const Scope& scope : scopes_) {
      for (const auto& [symbol, value] : scope.variables) {
        pending.push_back(value);
      }
    }
    std::unordered_set<const void*> seen;
    while (!pending.empty()) {
      Value value = std::move(pending.back());
      pending.pop_back();
      switch (value.kind()) {
        case Value::Kind::kArray:
          if (seen.insert(&value.array_data()).second) {
            pending.insert(pending.end(), value.array_data().items.begin(),
                           value.array_data().items.end());
            reached.push_back(std::move(value));
          }
          break;
        case Value::Kind::kObject:
        case Value::Kind::kNamespace:
          if (seen.insert(value.object_data()).second) {
            for (const auto& [key, item] : value.object_data()->entries) {
              pending.push_back(item);
            }
            reached.push_back(std::move(value));
          }
          break;
        case Value::Kind::kLoop:
          if (seen.insert(&value.loop_data()).second) {
            pending.insert(pending.end(), value.loop_data().items->begin(),
                           value.loop_data().items->end());
          }
          break;
        default:
          break;
      }
    }
    // All of them are held here: emptying one frees none of the others.
    for (Value& container : reached) {
      if (container.kind() == Value::Kind::kArray) {
        container.array_data().items.clear();
      } else {
        container.object_data()->entries.clear();
      }
    }
  }

  // The stored value of a variable, or nullptr when no scope holds it.
  static const Value* find_variable(const NameExpr& name, const Scope& scope) {
    for (const Scope* current = &scope; current != nullptr; current = current->parent) {
      if (current->globals != nullptr) {
        const Value& value = (*current->globals)[static_cast<std::size_t>(name.symbol)];
        return value.is_undefined() ? nullptr : &value;
      }
      for (const auto& [symbol, value] : current->variables) {
        if (symbol == name.symbol) {
          return &value;
        }
      }
    }
    return nullptr;
  }

  static Value lookup(const NameExpr& name, const Scope& scope) {
    if (const Value* found = find_variable(name, scope)) {
      return *found;
    }
    if (name.builtin != BuiltinFunction::kNone) {
      return Value::builtin(name.builtin);
    }
    return Value();
  }

  // The value of `expr`, without a copy when it is a variable (as the object of `a.b` mostly
  // is); otherwise evaluated into `storage`.
  const Value& eval_ref(const Expr& expr, Scope& scope, Value& storage) {
    if (expr.kind == ExprKind::kName) {
      if (const Value* found = find_variable(static_cast<const NameExpr&>(expr), scope)) {
        return *found;
      }
    }
    storage = eval(expr, scope);
    return storage;
  }

  Value eval(const Expr& expr, Scope& scope) {
    const Nested nested(nesting_);
    switch (expr.kind) {
      case ExprKind::kLiteral:
        return static_cast<const LiteralExpr&>(expr).value;
      case ExprKind::kName:
        return lookup(static_cast<const NameExpr&>(expr), scope);
      case ExprKind::kList: {
        const auto& node = static_cast<const ListExpr&>(expr);
        std::vector<Value> items;
        items.reserve(node.items.size());
        for (const ExprPtr& item : node.items) {
          items.push_back(eval(*item, scope));
        }
        return Value::array(std::move(items));
      }
      case ExprKind::kDict: {
        const auto& node = static_cast<const DictExpr&>(expr);
        auto data = std::make_shared<ObjectData>();
        for (const auto& [key_expr, value_expr] : node.entries) {
          Value key = eval(*key_expr, scope);
          if (!key.is_string()) {
            fail(fmt::format("dict keys must be strings, not '{}'", type_name(key)), expr.line);
          }
          data->set(std::move(key), eval(*value_expr, scope));
        }
        return Value::object(std::move(data));
      }
      case ExprKind::kAttribute: {
        const auto& node = static_cast<const AttributeExpr&>(expr);
        Value storage;
        const Value& object = eval_ref(*node.object, scope, storage);
        return node.key.is_string() ? get_attribute(object, node.key.as_string())
                                    : get_item(object, node.key);
      }
      case ExprKind::kSubscript: {
        const auto& node = static_cast<const SubscriptExpr&>(expr);
        Value storage;
        const Value& object = eval_ref(*node.object, scope, storage);
        return get_item(object, eval(*node.key, scope));
      }
      case ExprKind::kSlice: {
        const auto& node = static_cast<const SliceExpr&>(expr);
        Value storage;
        const Value& object = eval_ref(*node.object, scope, storage);
        const auto part = [&](const ExprPtr& bound) {
          return bound ? eval(*bound, scope) : Value();
        };
        return slice(object, part(node.start), part(node.stop), part(node.step));
      }
      case ExprKind::kCall:
        return with_line(expr,
                         [&] { return eval_call(static_cast<const CallExpr&>(expr), scope); });
      case ExprKind::kFilter:
        return with_line(expr, [&] {
          const auto& node = static_cast<const FilterExpr&>(expr);
          Value storage;
          const Value& operand = eval_ref(*node.operand, scope, storage);
          if (node.args.empty()) {
            return apply_filter(node.filter, operand, CallArgs{});
          }
          return apply_filter(node.filter, operand, eval_args(node.args, scope));
        });
      case ExprKind::kTest:
        return with_line(expr, [&] {
          const auto& node = static_cast<const TestExpr&>(expr);
          Value storage;
          const Value& operand = eval_ref(*node.operand, scope, storage);
          const bool passed = node.args.empty()
                                  ? apply_test(node.test, operand, CallArgs{})
                                  : apply_test(node.test, operand, eval_args(node.args, scope));
          return Value::boolean(passed != node.negated);
        });
      case ExprKind::kUnary:
        return eval_unary(static_cast<const UnaryExpr&>(expr), scope);
      case ExprKind::kBinary:
        return with_line(expr,
                         [&] { return eval_binary(static_cast<const BinaryExpr&>(expr), scope); });
      case ExprKind::kConcat:
        return with_line(expr,
                         [&] { return eval_concat(static_cast<const ConcatExpr&>(expr), scope); });
      case ExprKind::kConditional: {
        const auto& node = static_cast<const ConditionalExpr&>(expr);
        if (truthy(eval(*node.condition, scope))) {
          return eval(*node.then_value, scope);
        }
        return node.else_value ? eval(*node.else_value, scope) : Value();
      }
    }
    return Value();
  }

  // Runs `evaluate`, giving a failure without a line the line of `expr`.
  template <typename F>
  static Value with_line(const Expr& expr, F&& evaluate) {
    try {
      return evaluate();
    } catch (TemplateFailure& failure) {
      if (failure.error().line == 0) {
        failure.error().line = expr.line;
      }
      throw;
    }
  }

  Value eval_unary(const UnaryExpr& node, Scope& scope) {
    const Value operand = eval(*node.operand, scope);
    if (node.op == UnaryOp::kNot) {
      return Value::boolean(!truthy(operand));
    }
    if (!operand.is_number()) {
      fail(fmt::format("bad operand type for unary {}: '{}'",
                       node.op == UnaryOp::kNegate ? '-' : '+', type_name(operand)),
           node.line);
    }
    if (node.op == UnaryOp::kPlus) {
      return operand.kind() == Value::Kind::kBool ? Value::integer(integral(operand)) : operand;
    }
    if (operand.kind() == Value::Kind::kFloat) {
      return Value::floating(-operand.as_float());
    }
    return Value::integer(-integral(operand));
  }

  Value eval_binary(const BinaryExpr& node, Scope& scope) {
    Value left = eval(*node.left, scope);
    if (node.op == BinaryOp::kAnd) {
      return truthy(left) ? eval(*node.right, scope) : left;
    }
    if (node.op == BinaryOp::kOr) {
      return truthy(left) ? left : eval(*node.right, scope);
    }
    const Value right = eval(*node.right, scope);
    switch (node.op) {
      case BinaryOp::kEqual:
        return Value::boolean(equals(left, right));
      case BinaryOp::kNotEqual:
        return Value::boolean(!equals(left, right));
      case BinaryOp::kLess:
        return Value::boolean(compare(left, right) < 0);
      case BinaryOp::kLessEqual:
        return Value::boolean(compare(left, right) <= 0);
      case BinaryOp::kGreater:
        return Value::boolean(compare(left, right) > 0);
      case BinaryOp::kGreaterEqual:
        return Value::boolean(compare(left, right) >= 0);
      case BinaryOp::kIn:
        return Value::boolean(contains(right, left));
      case BinaryOp::kNotIn:
        return Value::boolean(!contains(right, left));
      default:
        return arithmetic(node.op, left, right);
    }
  }

  using Operands = absl::InlinedVector<Value, 8>;

  Operands eval_operands(const ConcatExpr& node, Scope& scope) {
    Operands values;
    for (const ExprPtr& operand : node.operands) {
      values.push_back(eval(*operand, scope));
    }
    return values;
  }

  static bool all_strings(const Operands& values) {
    return std::all_of(values.begin(), values.end(),
                       [](const Value& value) { return value.is_string(); });
  }

  // a + b + c: strings are joined in one buffer; anything else folds pairwise, left to right.
  Value eval_concat(const ConcatExpr& node, Scope& scope) {
    const Operands values = eval_operands(node, scope);
    if (node.tilde || all_strings(values)) {
      std::string out;
      for (const Value& value : values) {
        append_string(out, value);
      }
      return Value::owned_string(std::move(out));
    }
    Value result = values[0];
    for (std::size_t i = 1; i < values.size(); ++i) {
      result = add(result, values[i]);
    }
    return result;
  }

  // {{ a + b + c }}: strings go straight to the output.
  void render_concat(const ConcatExpr& node, Scope& scope, std::string& out) {
    const Operands values = eval_operands(node, scope);
    if (node.tilde || all_strings(values)) {
      for (const Value& value : values) {
        append_string(out, value);
      }
      return;
    }
    Value result = values[0];
    for (std::size_t i = 1; i < values.size(); ++i) {
      result = add(result, values[i]);
    }
    append_output(out, result);
  }

  CallArgs eval_args(const std::vector<Argument>& arguments, Scope& scope) {
    CallArgs args;
    for (const Argument& argument : arguments) {
      switch (argument.kind) {
        case Argument::Kind::kPositional:
          args.positional.push_back(eval(*argument.value, scope));
          break;
        case Argument::Kind::kKeyword:
          args.keywords.emplace_back(argument.name_value, eval(*argument.value, scope));
          break;
        case Argument::Kind::kSpread: {
          const Value spread = eval(*argument.value, scope);
          if (!spread.is_sequence()) {
            fail(fmt::format("argument after * must be a list, not '{}'", type_name(spread)));
          }
          for (Value& item : iterate(spread)) {
            args.positional.push_back(std::move(item));
          }
          break;
        }
        case Argument::Kind::kKeywordSpread: {
          const Value spread = eval(*argument.value, scope);
          if (!spread.is_mapping()) {
            fail(fmt::format("argument after ** must be a mapping, not '{}'", type_name(spread)));
          }
          for_each_entry(spread, [&](const Value& key, const Value& item) {
            args.keywords.emplace_back(key, item);
          });
          break;
        }
      }
    }
    return args;
  }

  Value eval_call(const CallExpr& node, Scope& scope) {
    if (node.callee->kind == ExprKind::kAttribute) {
      const auto& attribute = static_cast<const AttributeExpr&>(*node.callee);
      Value storage;
      const Value& object = eval_ref(*attribute.object, scope, storage);
      // A namespace's or dict's entry that is a macro is called as such; dict methods (items,
      // get, ...) come first, as Python's getattr finds them first.
      const bool dict_method = object.is_mapping() && attribute.method != Method::kNone;
      if (!dict_method && attribute.key.is_string() &&
          (object.is_mapping() || object.kind() == Value::Kind::kNamespace)) {
        const Value entry = mapping_get(object, attribute.name);
        if (!entry.is_undefined()) {
          CallArgs args = eval_args(node.args, scope);
          return call_value(entry, args, attribute.name);
        }
      }
      CallArgs args = eval_args(node.args, scope);
      return call_method(object, attribute.method, attribute.name, args);
    }
    const Value callee = eval(*node.callee, scope);
    CallArgs args = eval_args(node.args, scope);
    const std::string_view name =
        node.callee->kind == ExprKind::kName
            ? std::string_view(static_cast<const NameExpr&>(*node.callee).name)
            : std::string_view("expression");
    return call_value(callee, args, name);
  }

  Value call_value(const Value& callee, CallArgs& args, std::string_view name) {
    switch (callee.kind()) {
      case Value::Kind::kBuiltin:
        switch (callee.builtin_function()) {
          case BuiltinFunction::kRaiseException:
            fail(args.positional.empty() ? std::string("raise_exception called")
                                         : to_string(args.positional[0]));
          case BuiltinFunction::kStrftimeNow: {
            const Value* format = args.get(0, "format");
            if (format == nullptr || !format->is_string()) {
              fail("strftime_now needs a format string");
            }
            return Value::owned_string(format_time(now_, format->as_string()));
          }
          default:
            return call_builtin_function(callee.builtin_function(), args);
        }
      case Value::Kind::kCallable:
        return invoke(callee.callable_data(), args, Value());
      case Value::Kind::kUndefined:
        fail(fmt::format("'{}' is undefined", name));
      default:
        fail(fmt::format("'{}' object is not callable", type_name(callee)));
    }
  }

  // Calls a macro (with `caller` the call block's body, if any) or a call block's caller.
  Value invoke(const Callable& callable, CallArgs& args, Value caller) {
    if (depth_ >= kMaxCallDepth) {
      fail("macro calls nested too deep (recursion?)");
    }
    const bool is_macro = callable.macro != nullptr;
    const std::vector<Parameter>& params =
        is_macro ? callable.macro->params : callable.call_block->params;
    const ImplicitArguments& implicit =
        is_macro ? callable.macro->implicit : callable.call_block->implicit;
    const std::string_view display_name =
        is_macro ? std::string_view(callable.macro->name) : std::string_view("caller");
    Scope& scope = new_scope(callable.scope);
    std::vector<bool> keyword_used(args.keywords.size(), false);
    std::vector<const Parameter*> pending_defaults;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Parameter& param = params[i];
      Value value;
      bool given = false;
      if (i < args.positional.size()) {
        value = args.positional[i];
        given = true;
      } else {
        for (std::size_t k = 0; k < args.keywords.size(); ++k) {
          if (!keyword_used[k] && args.keywords[k].first.as_string() == param.name) {
            value = args.keywords[k].second;
            keyword_used[k] = true;
            given = true;
            break;
          }
        }
      }
      if (!given && param.default_value) {
        pending_defaults.push_back(&param);
      }
      scope.set(param.symbol, std::move(value));
    }
    if (args.positional.size() > params.size()) {
      if (!implicit.varargs) {
        fail(fmt::format("macro '{}' takes not more than {} argument(s)", display_name,
                         params.size()));
      }
    }
    if (implicit.varargs) {
      std::vector<Value> extra;
      for (std::size_t i = params.size(); i < args.positional.size(); ++i) {
        extra.push_back(args.positional[i]);
      }
      scope.set(kVarargsSymbol, Value::array(std::move(extra)));
    }
    auto unused = std::make_shared<ObjectData>();
    for (std::size_t k = 0; k < args.keywords.size(); ++k) {
      if (!keyword_used[k]) {
        if (!implicit.kwargs) {
          fail(fmt::format("macro '{}' takes no keyword argument '{}'", display_name,
                           args.keywords[k].first.as_string()));
        }
        unused->set(args.keywords[k].first, args.keywords[k].second);
      }
    }
    if (implicit.kwargs) {
      scope.set(kKwargsSymbol, Value::object(std::move(unused)));
    }
    if (implicit.caller) {
      scope.set(kCallerSymbol, std::move(caller));
    }
    for (const Parameter* param : pending_defaults) {
      scope.set(param->symbol, eval(*param->default_value, scope));
    }
    ++depth_;
    std::string out;
    render(is_macro ? callable.macro->body : callable.call_block->body, scope, out);
    --depth_;
    return Value::owned_string(std::move(out));
  }

  const Program& program_;
  const NowFunction& now_;
  std::vector<Value> globals_;
  // Every scope of the render, alive until it ends: macros close over the scope they were
  // defined in.
  std::deque<Scope> scopes_;
  int depth_ = 0;
  // Bodies and expressions being rendered inside each other (Nested).
  int nesting_ = 0;
};

}  // namespace

std::string render_program(const Program& program, std::span<const Binding> bindings,
                           const NowFunction& now) {
  Interpreter interpreter(program, now);
  for (const auto& [name, value] : bindings) {
    interpreter.bind(name, Value::from_json(*value));
  }
  return interpreter.run();
}

}  // namespace kvr::chat_template::detail
