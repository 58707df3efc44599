// A small Jinja interpreter for chat templates (the `chat_template` of a model's
// tokenizer_config.json, or --chat-template FILE). Debian packages no C++ Jinja library, and
// chat templates use a small part of the language; this is that part, with Jinja's semantics as
// Hugging Face renders templates (trim_blocks and lstrip_blocks on, no autoescape, the
// loopcontrols extension):
// - text, {{ expr }}, {% stmt %}, {# comment #}, whitespace control ({%- -%} {{- -}});
// - statements: for (one name or a tuple of names; loop.index, index0, revindex, revindex0,
//   first, last, length, previtem, nextitem, cycle(...); an `if` filter; else; break and
//   continue), if / elif / else, set (a name or namespace attribute; or a block), macro (with
//   positional and keyword parameters and defaults; called as a function, it returns its text;
//   it sees the template's top-level variables and its arguments), and nothing else;
// - expressions: literals (strings, integers, floats, true/false/none in either case, lists,
//   dicts), variables, subscripts and slices, attributes, calls, filters, tests (`is`), `~`,
//   arithmetic, comparisons, `in` / `not in`, `and` / `or` / `not`, `a if c else b`;
// - functions: raise_exception(msg), range(...), namespace(...), strftime_now(format)
//   (transformers' global: the local time); string methods (strip, lstrip, rstrip, upper, lower,
//   title, capitalize, startswith, endswith, split, replace, join), dict methods (items, keys,
//   values, get);
// - filters: trim, length / count, lower, upper, title, capitalize, first, last, join,
//   default / d, string, int, float, abs, list, reverse, replace, indent, tojson (indent=),
//   safe, items, dictsort, sort, unique, selectattr / rejectattr (an attribute alone, or with a
//   test and its value: equalto / eq / == / ne / != ...), map (attribute=, or a filter's name
//   and its arguments).
// Anything else is an error naming it and where it is (line of the template), never undefined
// behaviour: a template and the messages rendered with it are untrusted. Rendering is bounded
// (output bytes, loop iterations, nesting, macro recursion), so a hostile template cannot hang
// the server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/status.h"

namespace burst::server::jinja {

class Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // in insertion order

// A Jinja value. Lists and dicts are shared: a namespace() assigned inside a loop is seen after.
class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict };
  Value() = default;  // undefined
  static Value none();
  Value(bool b);                                    // NOLINT: implicit by design, as literals read
  Value(int64_t i);                                 // NOLINT
  Value(int i) : Value(static_cast<int64_t>(i)) {}  // NOLINT
  Value(double f);                                  // NOLINT
  Value(std::string s);                             // NOLINT
  Value(const char* s) : Value(std::string(s)) {}   // NOLINT
  Value(List l);                                    // NOLINT
  Value(Dict d);                                    // NOLINT

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool truthy() const;
  bool as_bool() const { return b_; }
  int64_t as_int() const;  // bool, int or float (truncated)
  double as_float() const;
  const std::string& str() const { return s_; }
  const List& list() const { return *list_; }
  const Dict& dict() const { return *dict_; }
  List& list_mut() { return *list_; }
  Dict& dict_mut() { return *dict_; }
  // A dict's value by key (undefined when absent).
  Value get(const std::string& key) const;
  void set(const std::string& key, Value v);  // a dict's key
  // The text {{ v }} writes: Python's str() (None, True, lists as repr).
  std::string to_string() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
};

struct Node;

// A parsed template; render() may be called from any number of threads at once.
class Template {
 public:
  // Parses `source`; errors name the line and what was expected.
  static Result<Template> parse(const std::string& source);
  // Renders with the variables of `context` (a dict). raise_exception(msg) in the template is
  // an error whose message is msg.
  Result<std::string> render(const Value& context) const;

 private:
  std::shared_ptr<const Node> root_;
};

}  // namespace burst::server::jinja
