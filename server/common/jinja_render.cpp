// The chat template's renderer: statements (text, output, if, for with break and continue, set,
// macro definitions), variables and their scopes, and expressions with Python's semantics for
// indexing, slicing, comparison and arithmetic. Functions, macro calls, methods, tests and
// filters are in jinja_builtins.cpp.
#include <algorithm>
#include <cmath>
#include <utility>

#include "jinja_internal.h"

namespace burst::server::jinja {

namespace {

int64_t norm_index(int64_t i, int64_t len) { return i < 0 ? i + len : i; }

// "an integer", "a string": a value's kind for messages.
std::string with_article(const Value& v) {
  const std::string k = kind_name(v);
  return (k[0] == 'i' || k[0] == 'u' ? "an " : "a ") + k;
}

}  // namespace

Renderer::Renderer(const Value& context) {
  scopes_.emplace_back();
  if (context.kind() == Value::Kind::kDict) {
    for (const auto& [k, v] : context.dict()) scopes_.back()[k] = v;
  }
}

std::string Renderer::run(const std::vector<NodeP>& body) {
  std::string out;
  exec(body, out);
  return out;
}

void Renderer::step(int line) {
  if (++steps_ > kMaxSteps) fail(line, "rendering takes too many steps");
}

void Renderer::write(std::string& out, const std::string& s, int line) {
  if (out.size() + s.size() > kMaxOutputBytes) {
    fail(line, "the rendered text exceeds " + std::to_string(kMaxOutputBytes >> 20) + " MiB");
  }
  out += s;
}

void Renderer::exec(const std::vector<NodeP>& body, std::string& out) {
  for (const NodeP& n : body) {
    exec(*n, out);
    if (signal_ != LoopSignal::kNone) return;  // a break or continue leaves to its loop
  }
}

void Renderer::exec(const Node& n, std::string& out) {
  step(n.line);
  switch (n.k) {
    case Node::K::kText:
      write(out, n.text, n.line);
      return;
    case Node::K::kOutput:
      write(out, eval(*n.expr).to_string(), n.line);
      return;
    case Node::K::kIf:
      for (const auto& [cond, body] : n.branches) {
        if (eval(*cond).truthy()) {
          exec(body, out);
          return;
        }
      }
      exec(n.else_body, out);
      return;
    case Node::K::kFor:
      exec_for(n, out);
      return;
    case Node::K::kSet: {
      Value v = eval(*n.expr);
      if (n.attr.empty()) {
        scopes_.back()[n.targets[0]] = std::move(v);
        return;
      }
      Value ns = lookup(n.targets[0]);
      if (ns.kind() != Value::Kind::kDict || !namespaces_.count(&ns.dict())) {
        fail(n.line, "'" + n.targets[0] + "' is not a namespace(): cannot set ." + n.attr);
      }
      ns.set(n.attr, std::move(v));
      return;
    }
    case Node::K::kSetBlock: {
      std::string s;
      exec(n.body, s);
      scopes_.back()[n.targets[0]] = Value(std::move(s));
      return;
    }
    case Node::K::kGeneration:
      exec(n.body, out);
      return;
    case Node::K::kMacro:
      macros_[n.targets[0]] = &n;
      return;
    case Node::K::kBreak:
      signal_ = LoopSignal::kBreak;
      return;
    case Node::K::kContinue:
      signal_ = LoopSignal::kContinue;
      return;
  }
}

void Renderer::exec_for(const Node& n, std::string& out) {
  const Value seq = eval(*n.expr);
  List items;
  switch (seq.kind()) {
    case Value::Kind::kUndefined:
      break;  // Jinja iterates an undefined value as empty
    case Value::Kind::kList:
      items = seq.list();
      break;
    case Value::Kind::kDict:
      for (const auto& kv : seq.dict()) items.emplace_back(kv.first);
      break;
    case Value::Kind::kString:
      for (auto& c : chars_of(seq.str())) items.emplace_back(std::move(c));
      break;
    default:
      fail(n.line, std::string("cannot loop over a ") + kind_name(seq));
  }
  // The `if` filter runs before the loop counts (loop.length, loop.last see what is kept).
  if (n.filter) {
    List kept;
    for (const Value& item : items) {
      scopes_.emplace_back();
      bind(n, item);
      const bool keep = eval(*n.filter).truthy();
      scopes_.pop_back();
      if (keep) kept.push_back(item);
    }
    items.swap(kept);
  }
  if (items.empty()) {
    exec(n.else_body, out);
    return;
  }
  const auto len = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < len; ++i) {
    step(n.line);
    scopes_.emplace_back();
    bind(n, items[static_cast<size_t>(i)]);
    Dict loop = {{"index", Value(i + 1)},
                 {"index0", Value(i)},
                 {"revindex", Value(len - i)},
                 {"revindex0", Value(len - i - 1)},
                 {"first", Value(i == 0)},
                 {"last", Value(i == len - 1)},
                 {"length", Value(len)},
                 {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value()},
                 {"nextitem", i + 1 < len ? items[static_cast<size_t>(i + 1)] : Value()}};
    scopes_.back()["loop"] = Value(std::move(loop));
    exec(n.body, out);
    scopes_.pop_back();
    const LoopSignal signal = std::exchange(signal_, LoopSignal::kNone);
    if (signal == LoopSignal::kBreak) break;
  }
}

void Renderer::bind(const Node& n, const Value& item) {
  if (n.targets.size() == 1) {
    scopes_.back()[n.targets[0]] = item;
    return;
  }
  if (item.kind() != Value::Kind::kList || item.list().size() != n.targets.size()) {
    fail(n.line, "cannot unpack a " + std::string(kind_name(item)) + " into " +
                     std::to_string(n.targets.size()) + " names");
  }
  for (size_t k = 0; k < n.targets.size(); ++k) scopes_.back()[n.targets[k]] = item.list()[k];
}

Value Renderer::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    const auto f = it->find(name);
    if (f != it->end()) return f->second;
  }
  return Value();
}

std::string Renderer::text_of(const Expr& e) {
  switch (e.k) {
    case Expr::K::kName:
      return e.name;
    case Expr::K::kAttr:
      return text_of(*e.args[0]) + "." + e.name;
    case Expr::K::kIndex:
      return text_of(*e.args[0]) + "[...]";
    case Expr::K::kCall:
      return text_of(*e.args[0]) + "(...)";
    default:
      return "a value";
  }
}

Value Renderer::eval(const Expr& e) {
  step(e.line);
  switch (e.k) {
    case Expr::K::kLiteral:
      return e.literal;
    case Expr::K::kName:
      return lookup(e.name);
    case Expr::K::kList: {
      List l;
      for (const auto& a : e.args) l.push_back(eval(*a));
      return Value(std::move(l));
    }
    case Expr::K::kDict: {
      Value d{Dict{}};
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        const Value k = eval(*e.args[i]);
        if (!k.is_string()) fail(e.line, "dict keys must be strings here");
        d.set(k.str(), eval(*e.args[i + 1]));
      }
      return d;
    }
    case Expr::K::kAttr: {
      const Value obj = eval(*e.args[0]);
      if (obj.is_undefined()) fail(e.line, "'" + text_of(*e.args[0]) + "' is undefined");
      if (obj.kind() == Value::Kind::kDict) return obj.get(e.name);
      return Value();
    }
    case Expr::K::kIndex:
      return index(e, eval(*e.args[0]), eval(*e.args[1]));
    case Expr::K::kSlice:
      return slice(e);
    case Expr::K::kCall:
      return call(e);
    case Expr::K::kFilter:
      return filter(e);
    case Expr::K::kTest: {
      const bool r = test(e);
      return Value(e.negate ? !r : r);
    }
    case Expr::K::kNeg: {
      const Value v = eval(*e.args[0]);
      if (v.kind() == Value::Kind::kFloat) return Value(-v.as_float());
      if (v.is_number()) return Value(-v.as_int());
      fail(e.line, std::string("cannot negate a ") + kind_name(v));
    }
    case Expr::K::kNot:
      return Value(!eval(*e.args[0]).truthy());
    case Expr::K::kAnd: {
      Value a = eval(*e.args[0]);
      return a.truthy() ? eval(*e.args[1]) : a;
    }
    case Expr::K::kOr: {
      Value a = eval(*e.args[0]);
      return a.truthy() ? a : eval(*e.args[1]);
    }
    case Expr::K::kCond:
      return eval(*e.args[0]).truthy() ? eval(*e.args[1]) : eval(*e.args[2]);
    case Expr::K::kBinary:
      return binary(e);
  }
  fail(e.line, "an expression it cannot evaluate");
}

Value Renderer::index(const Expr& e, const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail(e.line, "'" + text_of(*e.args[0]) + "' is undefined");
  switch (obj.kind()) {
    case Value::Kind::kDict:
      if (!key.is_string()) return Value();
      return obj.get(key.str());
    case Value::Kind::kList:
    case Value::Kind::kString: {
      if (key.kind() != Value::Kind::kInt && key.kind() != Value::Kind::kBool) {
        fail(e.line, std::string("a ") + kind_name(obj) + " index must be an integer, got a " +
                         kind_name(key));
      }
      if (obj.kind() == Value::Kind::kList) {
        const auto len = static_cast<int64_t>(obj.list().size());
        const int64_t i = norm_index(key.as_int(), len);
        return i >= 0 && i < len ? obj.list()[static_cast<size_t>(i)] : Value();
      }
      const auto cs = chars_of(obj.str());
      const auto len = static_cast<int64_t>(cs.size());
      const int64_t i = norm_index(key.as_int(), len);
      return i >= 0 && i < len ? Value(cs[static_cast<size_t>(i)]) : Value();
    }
    default:
      return Value();
  }
}

Value Renderer::slice(const Expr& e) {
  const Value obj = eval(*e.args[0]);
  auto part = [&](int k) -> std::optional<int64_t> {
    if (!e.args[static_cast<size_t>(k)]) return std::nullopt;
    const Value v = eval(*e.args[static_cast<size_t>(k)]);
    if (v.kind() == Value::Kind::kNone) return std::nullopt;
    if (v.kind() != Value::Kind::kInt && v.kind() != Value::Kind::kBool) {
      fail(e.line, "slice bounds must be integers");
    }
    return v.as_int();
  };
  const auto start = part(1), stop = part(2), stride = part(3);
  const int64_t st = stride.value_or(1);
  if (st == 0) fail(e.line, "a slice step cannot be zero");
  std::vector<Value> items;
  if (obj.kind() == Value::Kind::kList) {
    items = obj.list();
  } else if (obj.kind() == Value::Kind::kString) {
    for (auto& c : chars_of(obj.str())) items.emplace_back(std::move(c));
  } else {
    fail(e.line, std::string("cannot slice a ") + kind_name(obj));
  }
  const auto len = static_cast<int64_t>(items.size());
  // Python's slice.indices().
  auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + len : *v;
    if (st > 0) return std::clamp<int64_t>(x, 0, len);
    return std::clamp<int64_t>(x, -1, len - 1);
  };
  const int64_t b = clamp(start, st > 0 ? 0 : len - 1), en = clamp(stop, st > 0 ? len : -1);
  List out;
  for (int64_t i = b; st > 0 ? i < en : i > en; i += st)
    out.push_back(items[static_cast<size_t>(i)]);
  if (obj.kind() == Value::Kind::kString) {
    std::string s;
    for (const auto& v : out) s += v.str();
    return Value(std::move(s));
  }
  return Value(std::move(out));
}

bool Renderer::equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat) {
      return a.as_float() == b.as_float();
    }
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.str() == b.str();
    case Value::Kind::kList: {
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!equal(a.list()[i], b.list()[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict()) {
        if (!equal(v, b.get(k))) return false;
      }
      return true;
    }
    default:
      return false;
  }
}

bool Renderer::contains(const Expr& e, const Value& hay, const Value& needle) {
  switch (hay.kind()) {
    case Value::Kind::kString:
      if (!needle.is_string()) fail(e.line, "'in <string>' needs a string on its left");
      return hay.str().find(needle.str()) != std::string::npos;
    case Value::Kind::kList:
      return std::any_of(hay.list().begin(), hay.list().end(),
                         [&](const Value& v) { return equal(v, needle); });
    case Value::Kind::kDict:
      return needle.is_string() && !hay.get(needle.str()).is_undefined();
    case Value::Kind::kUndefined:
      return false;
    default:
      fail(e.line, std::string("'in' cannot look into a ") + kind_name(hay));
  }
}

int Renderer::compare(const Expr& e, const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    return a.as_float() < b.as_float() ? -1 : a.as_float() > b.as_float() ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str().compare(b.str());
  // Both orders, so that the message does not depend on which pair the sort compared first.
  const bool swap = b.is_number();
  fail(e.line, "cannot order " + with_article(swap ? b : a) + " and " + with_article(swap ? a : b));
}

Value Renderer::binary(const Expr& e) {
  const std::string& op = e.name;
  const Value a = eval(*e.args[0]);
  const Value b = eval(*e.args[1]);
  if (op == "~") return Value(a.to_string() + b.to_string());
  if (op == "==") return Value(equal(a, b));
  if (op == "!=") return Value(!equal(a, b));
  if (op == "in") return Value(contains(e, b, a) != e.negate);
  auto type_error = [&]() {
    fail(e.line,
         "'" + op + "' between " + with_article(a) + " and " + with_article(b) + " is not defined");
  };
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    if (!(a.is_number() && b.is_number()) && !(a.is_string() && b.is_string())) type_error();
    const int c = compare(e, a, b);
    return Value(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      if (a.str().size() + b.str().size() > kMaxOutputBytes) fail(e.line, "a string too long");
      return Value(a.str() + b.str());
    }
    if (a.kind() == Value::Kind::kList && b.kind() == Value::Kind::kList) {
      List l = a.list();
      l.insert(l.end(), b.list().begin(), b.list().end());
      return Value(std::move(l));
    }
  }
  if (op == "*" && (a.is_string() || b.is_string()) && (a.is_number() || b.is_number())) {
    const std::string& s = a.is_string() ? a.str() : b.str();
    const int64_t n = a.is_string() ? b.as_int() : a.as_int();
    if (n > 0 && s.size() * static_cast<uint64_t>(n) > kMaxOutputBytes) {
      fail(e.line, "a string too long");
    }
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += s;
    return Value(std::move(out));
  }
  if (!a.is_number() || !b.is_number()) type_error();
  return arithmetic(e, a, b);
}

// Numbers only: Python's int (overflow is an error) and float arithmetic.
Value Renderer::arithmetic(const Expr& e, const Value& a, const Value& b) {
  const std::string& op = e.name;
  const bool fl = a.kind() == Value::Kind::kFloat || b.kind() == Value::Kind::kFloat;
  if (op == "/") {
    if (b.as_float() == 0) fail(e.line, "division by zero");
    return Value(a.as_float() / b.as_float());
  }
  if (fl) {
    const double x = a.as_float(), y = b.as_float();
    if ((op == "//" || op == "%") && y == 0) fail(e.line, "division by zero");
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (op == "//") return Value(std::floor(x / y));
    if (op == "%") return Value(x - y * std::floor(x / y));
    if (op == "**") return Value(std::pow(x, y));
  } else {
    const int64_t x = a.as_int(), y = b.as_int();
    int64_t r = 0;
    if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value(r);
    if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value(r);
    if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value(r);
    if (op == "//" || op == "%") {
      if (y == 0) fail(e.line, "division by zero");
      if (x == INT64_MIN && y == -1) fail(e.line, "integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {  // Python floors
        --q;
        m += y;
      }
      return Value(op == "//" ? q : m);
    }
    if (op == "**") {
      if (y < 0) return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
      int64_t p = 1;
      for (int64_t i = 0; i < y; ++i) {
        if (__builtin_mul_overflow(p, x, &p)) fail(e.line, "integer overflow");
        if (p == 0 || p == 1) break;
      }
      return Value(p);
    }
    if (op == "+" || op == "-" || op == "*") fail(e.line, "integer overflow");
  }
  fail(e.line, "unknown operator '" + op + "'");
}

}  // namespace burst::server::jinja
