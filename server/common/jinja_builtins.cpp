// The chat template's built-ins: functions (raise_exception, range, namespace, strftime_now),
// macro calls, loop.cycle, string and dict methods, tests (`is`) and filters (`|`), as jinja.h
// lists them. Anything else is an error.
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <utility>

#include "jinja_internal.h"

namespace burst::server::jinja {

namespace {

// Jinja's indent(width, first, blank) of text: every line but the first (with first, it too)
// gets `pad`; blank lines none unless blank.
std::string indent_lines(const std::string& text, const std::string& pad, bool first, bool blank,
                         int line) {
  std::string out;
  size_t pos = 0;
  for (bool is_first = true;; is_first = false) {
    const size_t nl = text.find('\n', pos);
    const std::string row = text.substr(pos, nl == std::string::npos ? nl : nl - pos);
    if ((!is_first || first) && (blank || !row.empty())) out += pad;
    out += row;
    if (out.size() > kMaxOutputBytes) fail(line, "a string too long");
    if (nl == std::string::npos) break;
    out += '\n';
    pos = nl + 1;
  }
  return out;
}

// The int filter's value of v: a number truncated, or a string that is wholly a base-10
// integer; nullopt for anything else.
std::optional<Value> int_of(const Value& v) {
  if (v.is_number()) return Value(v.as_int());
  if (v.is_string()) {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.str().c_str(), &end, 10);
    if (errno == 0 && end && *end == '\0' && !v.str().empty()) return Value(int64_t{n});
  }
  return std::nullopt;
}

// The float filter's value of v: a number, or a string that is wholly one; else 0.0.
Value float_of(const Value& v) {
  if (v.is_number()) return Value(v.as_float());
  if (v.is_string()) {
    char* end = nullptr;
    const double d = std::strtod(v.str().c_str(), &end);
    if (end && *end == '\0' && !v.str().empty()) return Value(d);
  }
  return Value(0.0);
}

// The length filter: a string's code points, a list's items, a dict's keys; 0 for undefined.
Value length_of(const Value& v, int line) {
  if (v.is_string()) return Value(static_cast<int64_t>(chars_of(v.str()).size()));
  if (v.kind() == Value::Kind::kList) return Value(static_cast<int64_t>(v.list().size()));
  if (v.kind() == Value::Kind::kDict) return Value(static_cast<int64_t>(v.dict().size()));
  if (v.is_undefined()) return Value(int64_t{0});
  fail(line, std::string("a ") + kind_name(v) + " has no length");
}

// A string with its code points in reverse order.
std::string reversed_chars(const std::string& s) {
  const auto cs = chars_of(s);
  std::string out;
  for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
  return out;
}

// The join filter: the text of pick(x) for each item, sep between them.
template <typename Pick>
std::string joined(const List& items, const std::string& sep, Pick pick, int line) {
  std::string out;
  bool first = true;
  for (const Value& x : items) {
    out += (first ? "" : sep) + pick(x).to_string();
    first = false;
    if (out.size() > kMaxOutputBytes) fail(line, "a string too long");
  }
  return out;
}

// The unique filter: each item whose key(x) is same() as no earlier kept item's, in order.
template <typename Key, typename Same>
List first_of_each(const List& items, Key key, Same same) {
  List out, keys;
  for (const Value& x : items) {
    const Value k = key(x);
    if (std::none_of(keys.begin(), keys.end(), [&](const Value& y) { return same(k, y); })) {
      keys.push_back(k);
      out.push_back(x);
    }
  }
  return out;
}

// The items for which keep(x) holds, in order (selectattr, rejectattr).
template <typename Keep>
List kept_items(const List& items, Keep keep) {
  List out;
  for (const Value& x : items) {
    if (keep(x)) out.push_back(x);
  }
  return out;
}

// fn(x) of each item, in order (map).
template <typename Fn>
List mapped(const List& items, Fn fn) {
  List out;
  for (const Value& x : items) out.push_back(fn(x));
  return out;
}

// A test as selectattr and rejectattr name it: "==" and "!=" are eq and ne.
std::string test_alias(const std::string& name) {
  return name == "==" ? "eq" : name == "!=" ? "ne" : name;
}

}  // namespace

Renderer::Args Renderer::args_of(const Expr& e, size_t first) {
  Args a;
  for (size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i]));
  for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v));
  return a;
}

std::string Renderer::need_string(const Expr& e, const Value& v, const std::string& what) {
  if (!v.is_string()) fail(e.line, what + " must be a string, got a " + kind_name(v));
  return v.str();
}

Value Renderer::call(const Expr& e) {
  const Expr& callee = *e.args[0];
  Args a = args_of(e, 1);
  if (callee.k == Expr::K::kName && lookup(callee.name).is_undefined()) {
    if (const auto macro = macros_.find(callee.name); macro != macros_.end()) {
      return call_macro(e, *macro->second, a);
    }
    return call_function(e, callee.name, a);
  }
  if (callee.k != Expr::K::kAttr) fail(e.line, "'" + text_of(callee) + "' is not callable");
  const Value obj = eval(*callee.args[0]);
  const std::string& m = callee.name;
  if (m == "cycle" && callee.args[0]->k == Expr::K::kName && callee.args[0]->name == "loop" &&
      obj.kind() == Value::Kind::kDict) {
    // loop.cycle(a, b, ...): the argument at this iteration's index, round and round.
    if (a.pos.empty()) fail(e.line, "loop.cycle() needs at least one value");
    const int64_t i = obj.get("index0").as_int();
    return a.pos[static_cast<size_t>(i % static_cast<int64_t>(a.pos.size()))];
  }
  if (obj.is_string()) return string_method(e, obj.str(), m, a);
  if (obj.kind() == Value::Kind::kDict) {
    if (std::optional<Value> v = dict_method(obj, m, a)) return *v;
    // A callable stored in a dict is not something a template can reach here.
  }
  if (obj.is_undefined()) {
    fail(e.line, std::string("'") + text_of(*callee.args[0]) + "' is undefined");
  }
  fail(e.line, std::string("a ") + kind_name(obj) + " has no method '" + m + "' here");
}

Value Renderer::call_macro(const Expr& e, const Node& macro, const Args& a) {
  const std::string& name = macro.targets[0];
  const size_t params = macro.targets.size() - 1;
  if (a.pos.size() > params) {
    fail(e.line, "macro '" + name + "' takes " + std::to_string(params) + " argument" +
                     (params == 1 ? "" : "s") + ", got " + std::to_string(a.pos.size()));
  }
  for (const auto& [k, v] : a.kw) {
    const auto it = std::find(macro.targets.begin() + 1, macro.targets.end(), k);
    if (it == macro.targets.end()) fail(e.line, "macro '" + name + "' has no argument '" + k + "'");
    if (static_cast<size_t>(it - macro.targets.begin() - 1) < a.pos.size()) {
      fail(e.line, "macro '" + name + "' got argument '" + k + "' twice");
    }
  }
  if (call_depth_ >= kMaxCallDepth) {
    fail(e.line, "macros call each other more than " + std::to_string(kMaxCallDepth) + " deep");
  }
  // The macro sees the template's top-level variables and its arguments, not the caller's
  // loop variables; the caller's scopes come back however the macro ends.
  std::vector<std::unordered_map<std::string, Value>> caller;
  caller.swap(scopes_);
  scopes_.push_back(caller.front());
  scopes_.emplace_back();
  ++call_depth_;
  struct Restore {
    Renderer& r;
    std::vector<std::unordered_map<std::string, Value>>& caller;
    ~Restore() {
      r.scopes_.swap(caller);
      --r.call_depth_;
    }
  } restore{*this, caller};
  for (size_t i = 0; i < params; ++i) {
    const std::string& param = macro.targets[i + 1];
    Value v;
    if (i < a.pos.size()) {
      v = a.pos[i];
    } else if (const Value* kw = a.find(param)) {
      v = *kw;
    } else if (macro.defaults[i]) {
      v = eval(*macro.defaults[i]);  // at the call, over the parameters bound before it
    }
    scopes_.back()[param] = std::move(v);
  }
  std::string out;
  exec(macro.body, out);
  return Value(std::move(out));
}

// raise_exception(), range(), namespace(), strftime_now(): names no variable or macro of the
// template shadows.
Value Renderer::call_function(const Expr& e, const std::string& f, const Args& a) {
  if (f == "raise_exception") {
    throw Error{a.pos.empty() ? "chat template error" : a.pos[0].to_string()};
  }
  if (f == "range") {
    if (a.pos.empty() || a.pos.size() > 3) fail(e.line, "range() takes 1 to 3 integers");
    for (const auto& v : a.pos) {
      if (v.kind() != Value::Kind::kInt) fail(e.line, "range() takes integers");
    }
    int64_t lo = 0, hi = 0, st = 1;
    if (a.pos.size() == 1) {
      hi = a.pos[0].as_int();
    } else {
      lo = a.pos[0].as_int();
      hi = a.pos[1].as_int();
      if (a.pos.size() == 3) st = a.pos[2].as_int();
    }
    if (st == 0) fail(e.line, "range() step cannot be zero");
    List l;
    for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
      if (static_cast<int64_t>(l.size()) >= kMaxRange) fail(e.line, "range() too long");
      l.emplace_back(i);
    }
    return Value(std::move(l));
  }
  if (f == "strftime_now") {
    // transformers' global: the date now (the server's local time) in a strftime format, for
    // templates that write today's date into the system prompt.
    const std::string fmt = need_string(e, a.at(0, "format"), "strftime_now()'s format");
    if (fmt.size() > 256) fail(e.line, "strftime_now()'s format is too long");
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[1024];
    const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
    return Value(std::string(buf, n));
  }
  if (f == "namespace") {
    Value ns{Dict{}};
    for (auto& [k, v] : a.kw) ns.set(k, v);
    namespaces_.insert(&ns.dict());
    keep_.push_back(ns);  // keeps the address valid for the namespace check
    return ns;
  }
  fail(e.line, "unknown function '" + f + "'");
}

Value Renderer::string_method(const Expr& e, const std::string& s, const std::string& m,
                              const Args& a) {
  if (m == "strip" || m == "lstrip" || m == "rstrip") {
    const Value chars = a.at(0, "chars");
    std::string set;
    if (chars.is_string()) set = chars.str();
    return Value(
        strip_chars(s, chars.is_string() ? &set : nullptr, m != "rstrip", m != "lstrip"));
  }
  if (m == "upper" || m == "lower") return Value(ascii_case(s, m == "upper"));
  if (m == "title") return Value(title_case(s));
  if (m == "capitalize") {
    std::string out = ascii_case(s, false);
    if (!out.empty()) out[0] = ascii_case(out.substr(0, 1), true)[0];
    return Value(out);
  }
  if (m == "startswith" || m == "endswith") {
    const Value p = a.at(0, "prefix");
    std::vector<std::string> opts;
    if (p.kind() == Value::Kind::kList) {
      for (const auto& v : p.list()) opts.push_back(need_string(e, v, m + "()'s argument"));
    } else {
      opts.push_back(need_string(e, p, m + "()'s argument"));
    }
    for (const auto& o : opts) {
      if (m == "startswith"
              ? s.rfind(o, 0) == 0
              : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0) {
        return Value(true);
      }
    }
    return Value(false);
  }
  if (m == "split") {
    const Value sep = a.at(0, "sep");
    List out;
    if (sep.is_string()) {
      if (sep.str().empty()) fail(e.line, "split() with an empty separator");
      size_t pos = 0;
      for (size_t hit; (hit = s.find(sep.str(), pos)) != std::string::npos;
           pos = hit + sep.str().size()) {
        out.emplace_back(s.substr(pos, hit - pos));
      }
      out.emplace_back(s.substr(pos));
    } else {
      size_t i = 0;
      while (i < s.size()) {
        while (i < s.size() && is_space(s[i])) ++i;
        size_t j = i;
        while (j < s.size() && !is_space(s[j])) ++j;
        if (j > i) out.emplace_back(s.substr(i, j - i));
        i = j;
      }
    }
    return Value(std::move(out));
  }
  if (m == "replace") {
    return Value(replace_all(s, need_string(e, a.at(0, "old"), "replace()'s old"),
                             need_string(e, a.at(1, "new"), "replace()'s new")));
  }
  if (m == "join") {  // ", ".join(items): Python's, strings only
    std::string out;
    bool first = true;
    for (const Value& x : as_list(e, a.at(0, "iterable"))) {
      out += (first ? "" : s) + need_string(e, x, "join()'s items");
      first = false;
      if (out.size() > kMaxOutputBytes) fail(e.line, "a string too long");
    }
    return Value(std::move(out));
  }
  fail(e.line, "strings have no method '" + m + "' here");
}

// items(), keys(), values(), get(); nullopt for any other name.
std::optional<Value> Renderer::dict_method(const Value& obj, const std::string& m,
                                           const Args& a) {
  if (m == "items" || m == "keys" || m == "values") {
    List out;
    for (const auto& [k, v] : obj.dict()) {
      if (m == "items") {
        out.emplace_back(List{Value(k), v});
      } else {
        out.push_back(m == "keys" ? Value(k) : v);
      }
    }
    return Value(std::move(out));
  }
  if (m == "get") {
    const Value k = a.at(0, "key");
    const Value v = k.is_string() ? obj.get(k.str()) : Value();
    if (!v.is_undefined()) return v;
    return a.pos.size() > 1 ? a.pos[1] : Value::none();
  }
  return std::nullopt;
}

List Renderer::as_list(const Expr& e, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
      return v.list();
    case Value::Kind::kDict: {
      List l;
      for (const auto& kv : v.dict()) l.emplace_back(kv.first);
      return l;
    }
    case Value::Kind::kString: {
      List l;
      for (auto& c : chars_of(v.str())) l.emplace_back(std::move(c));
      return l;
    }
    case Value::Kind::kUndefined:
      return {};
    default:
      fail(e.line, std::string("a ") + kind_name(v) + " is not a sequence");
  }
}

// An attribute of a list element, as selectattr/map read them ("a.b" walks dicts).
Value Renderer::attribute(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    cur = cur.get(path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

bool Renderer::run_test(const Expr& e, const std::string& name, const Value& v, const Args& a) {
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.kind() == Value::Kind::kNone;
  if (name == "string") return v.is_string();
  if (name == "number") return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kFloat;
  if (name == "integer") return v.kind() == Value::Kind::kInt;
  if (name == "float") return v.kind() == Value::Kind::kFloat;
  if (name == "boolean") return v.kind() == Value::Kind::kBool;
  if (name == "true") return v.kind() == Value::Kind::kBool && v.as_bool();
  if (name == "false") return v.kind() == Value::Kind::kBool && !v.as_bool();
  if (name == "mapping") return v.kind() == Value::Kind::kDict;
  if (name == "sequence" || name == "iterable") {
    return v.kind() == Value::Kind::kList || v.kind() == Value::Kind::kDict || v.is_string();
  }
  if (name == "even" || name == "odd") {
    if (v.kind() != Value::Kind::kInt) fail(e.line, "'" + name + "' tests integers");
    return (v.as_int() % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const Value d = a.at(0, "num");
    if (v.kind() != Value::Kind::kInt || d.kind() != Value::Kind::kInt || d.as_int() == 0) {
      fail(e.line, "'divisibleby' tests integers by a non-zero integer");
    }
    return v.as_int() % d.as_int() == 0;
  }
  if (name == "equalto" || name == "eq" || name == "sameas") return equal(v, a.at(0, "other"));
  if (name == "ne") return !equal(v, a.at(0, "other"));
  if (name == "in") return contains(e, a.at(0, "seq"), v);
  fail(e.line, "unknown test '" + name + "'");
}

bool Renderer::test(const Expr& e) {
  const Value v = eval(*e.args[0]);
  return run_test(e, e.name, v, args_of(e, 1));
}

Value Renderer::filter(const Expr& e) {
  const Value v = eval(*e.args[0]);
  return apply_filter(e, e.name, v, args_of(e, 1));
}

Value Renderer::apply_filter(const Expr& e, const std::string& f, const Value& v, const Args& a) {
  if (std::optional<Value> r = text_filter(e, f, v, a)) return *r;
  if (std::optional<Value> r = sequence_filter(e, f, v, a)) return *r;
  if (std::optional<Value> r = dict_filter(e, f, v, a)) return *r;
  fail(e.line, "unknown filter '" + f + "'");
}

// Filters of one value as text or a number; nullopt for any other name.
std::optional<Value> Renderer::text_filter(const Expr& e, const std::string& f, const Value& v,
                                           const Args& a) {
  if (f == "trim") {
    const Value chars = a.at(0, "chars");
    std::string set = chars.is_string() ? chars.str() : "";
    return Value(strip_chars(v.to_string(), chars.is_string() ? &set : nullptr, true, true));
  }
  if (f == "lower" || f == "upper") return Value(ascii_case(v.to_string(), f == "upper"));
  if (f == "title") return Value(title_case(v.to_string()));
  if (f == "capitalize") {
    std::string out = ascii_case(v.to_string(), false);
    if (!out.empty()) out[0] = ascii_case(out.substr(0, 1), true)[0];
    return Value(out);
  }
  if (f == "default" || f == "d") {
    const bool boolean = a.at(1, "boolean").truthy();
    if (v.is_undefined() || (boolean && !v.truthy())) {
      const Value d = a.at(0, "default_value");
      return d.is_undefined() ? Value(std::string()) : d;
    }
    return v;
  }
  if (f == "string") return Value(v.to_string());
  if (f == "safe" || f == "e" || f == "escape") {
    // No autoescape (transformers renders without it): safe changes nothing; escaping is
    // HTML's and has no meaning in a prompt, so it is refused rather than guessed.
    if (f != "safe") fail(e.line, "the filter '" + f + "' is not supported");
    return v;
  }
  if (f == "int") {
    if (std::optional<Value> n = int_of(v)) return *n;
    return a.pos.empty() ? Value(int64_t{0}) : a.pos[0];
  }
  if (f == "float") return float_of(v);
  if (f == "replace") {
    return Value(replace_all(v.to_string(), need_string(e, a.at(0, "old"), "replace's old"),
                             need_string(e, a.at(1, "new"), "replace's new")));
  }
  if (f == "tojson") {
    const Value indent = a.at(0, "indent");
    if (!indent.is_undefined() && indent.kind() != Value::Kind::kNone &&
        (indent.kind() != Value::Kind::kInt || indent.as_int() < 0 || indent.as_int() > 64)) {
      fail(e.line, "tojson's indent must be an integer in 0..64");
    }
    const int spaces = indent.kind() == Value::Kind::kInt ? static_cast<int>(indent.as_int()) : 0;
    return Value(to_json(v, e.line, spaces));
  }
  if (f == "abs") {
    if (v.kind() == Value::Kind::kFloat)
      return Value(v.as_float() < 0 ? -v.as_float() : v.as_float());
    if (!v.is_number()) fail(e.line, std::string("abs of a ") + kind_name(v));
    if (v.as_int() == INT64_MIN) fail(e.line, "integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (f == "indent") {
    // Jinja's indent(width=4, first=False, blank=False): every line but the first (with
    // first=True, it too) gets `width` spaces (or the string given); blank lines none unless
    // blank=True.
    const Value w = a.at(0, "width");
    const std::string pad =
        w.is_string() ? w.str()
        : w.is_undefined()
            ? std::string(4, ' ')
            : std::string(static_cast<size_t>(std::clamp<int64_t>(w.as_int(), 0, 256)), ' ');
    const bool first = a.at(1, "first").truthy(), blank = a.at(2, "blank").truthy();
    return Value(indent_lines(v.to_string(), pad, first, blank, e.line));
  }
  return std::nullopt;
}

// Filters of sequences (lists, dicts' keys, strings' characters); nullopt for any other name.
std::optional<Value> Renderer::sequence_filter(const Expr& e, const std::string& f,
                                               const Value& v, const Args& a) {
  if (f == "length" || f == "count") return length_of(v, e.line);
  if (f == "first" || f == "last") {
    const List l = as_list(e, v);
    if (l.empty()) return Value();
    return f == "first" ? l.front() : l.back();
  }
  if (f == "join") {
    const Value sep = a.at(0, "d");
    const Value attr = a.at(1, "attribute");
    return Value(joined(
        as_list(e, v), sep.to_string(),
        [&](const Value& x) { return attr.is_string() ? attribute(x, attr.str()) : x; }, e.line));
  }
  if (f == "list") return Value(as_list(e, v));
  if (f == "reverse") {
    if (v.is_string()) return Value(reversed_chars(v.str()));
    List l = as_list(e, v);
    std::reverse(l.begin(), l.end());
    return Value(std::move(l));
  }
  if (f == "selectattr" || f == "rejectattr") {
    const std::string attr = need_string(e, a.at(0, "attr"), f + "'s attribute");
    return Value(kept_items(as_list(e, v), [&](const Value& x) {
      const Value field = attribute(x, attr);
      bool ok = field.truthy();
      if (a.pos.size() > 1) {
        Args rest;
        rest.pos.assign(a.pos.begin() + 2, a.pos.end());
        ok = run_test(e, test_alias(need_string(e, a.pos[1], f + "'s test")), field, rest);
      }
      return ok == (f == "selectattr");
    }));
  }
  if (f == "map") {
    if (const Value* attr = a.find("attribute")) {
      if (!attr->is_string()) fail(e.line, "map's attribute must be a string");
      const Value* dflt = a.find("default");
      return Value(mapped(as_list(e, v), [&](const Value& x) {
        Value field = attribute(x, attr->str());
        return field.is_undefined() && dflt ? *dflt : field;
      }));
    }
    // map('filter', args...): the filter applied to each item.
    const std::string name = need_string(e, a.at(0, "filter"), "map's filter");
    Args rest;
    rest.pos.assign(a.pos.begin() + 1, a.pos.end());
    rest.kw = a.kw;
    return Value(mapped(as_list(e, v), [&](const Value& x) {
      step(e.line);
      return apply_filter(e, name, x, rest);
    }));
  }
  if (f == "unique") {
    // Jinja's unique(case_sensitive=False, attribute=None): the first of each, in order.
    const bool cased = a.at(0, "case_sensitive").truthy();
    const Value attr = a.at(1, "attribute");
    auto key = [&](const Value& x) {
      return folded(attr.is_string() ? attribute(x, attr.str()) : x, cased);
    };
    // Each comparison is a step: quadratic in the list, so bounded like a nested loop.
    return Value(first_of_each(as_list(e, v), key, [&](const Value& k, const Value& y) {
      step(e.line);
      return equal(k, y);
    }));
  }
  if (f == "sort") {
    // Jinja's sort(reverse=False, case_sensitive=False, attribute=None): stable; strings
    // compared case-blind unless asked; numbers with numbers, strings with strings.
    const Value attr = a.at(2, "attribute");
    List l = as_list(e, v);
    sort_list(e, l, a.at(1, "case_sensitive").truthy(), a.at(0, "reverse").truthy(),
              [&](const Value& x) { return attr.is_string() ? attribute(x, attr.str()) : x; });
    return Value(std::move(l));
  }
  return std::nullopt;
}

Value Renderer::folded(const Value& v, bool case_sensitive) {
  return v.is_string() && !case_sensitive ? Value(ascii_case(v.str(), false)) : v;
}

void Renderer::sort_list(const Expr& e, List& l, bool case_sensitive, bool reverse,
                         const std::function<Value(const Value&)>& field) {
  // Python's sort with reverse=True keeps equal items in their order too: stable either way.
  std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
    const int c = compare(e, folded(field(x), case_sensitive), folded(field(y), case_sensitive));
    return reverse ? c > 0 : c < 0;
  });
}

// Filters of dicts; nullopt for any other name.
std::optional<Value> Renderer::dict_filter(const Expr& e, const std::string& f, const Value& v,
                                           const Args& a) {
  if (f != "items" && f != "dictsort") return std::nullopt;
  if (v.is_undefined()) return Value(List{});
  if (v.kind() != Value::Kind::kDict) fail(e.line, f + " needs a dict, got a " + kind_name(v));
  List out;
  for (const auto& [k, x] : v.dict()) out.emplace_back(List{Value(k), x});
  if (f == "dictsort") {
    // dictsort(case_sensitive=False, by='key', reverse=False).
    const Value by = a.at(1, "by");
    const size_t at = by.is_string() && by.str() == "value" ? 1 : 0;
    if (by.is_string() && by.str() != "key" && by.str() != "value") {
      fail(e.line, "dictsort's by must be 'key' or 'value'");
    }
    sort_list(e, out, a.at(0, "case_sensitive").truthy(), a.at(2, "reverse").truthy(),
              [&](const Value& kv) { return kv.list()[at]; });
  }
  return Value(std::move(out));
}

}  // namespace burst::server::jinja
