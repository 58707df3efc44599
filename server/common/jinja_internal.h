// What the pieces of the Jinja interpreter share (common/jinja.h is its public interface): the
// bounds on one render, the error they throw, the text helpers, the syntax tree, the tokens and
// the renderer. Pipeline: tokenize() (jinja_lexer.cpp) -> parse_tokens() (jinja_parser.cpp) ->
// Renderer (statements and operators in jinja_render.cpp; functions, methods, tests and
// filters in jinja_builtins.cpp); values and text helpers in jinja_value.cpp. Errors are
// thrown as Error and become a Status only at Template::parse and Template::render (jinja.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/jinja.h"

namespace burst::server::jinja {

// Bounds on what one template and one render may cost: a template and the messages it renders
// are untrusted, and a render runs on an API thread.
constexpr size_t kMaxOutputBytes = size_t{64} << 20;
constexpr int64_t kMaxSteps = 5'000'000;  // expressions and statements evaluated in one render
constexpr int64_t kMaxRange = int64_t{1} << 16;  // a list of that many values is MBs
constexpr int kMaxDepth = 200;                   // parser nesting (parentheses, statements)
constexpr int kMaxCallDepth = 64;                // macros calling macros (recursion)

// Errors inside the interpreter are thrown and become a Status at the two public entry points.
struct Error {
  std::string message;
};

[[noreturn]] void fail(int line, const std::string& what);

// ---- Text helpers (jinja_value.cpp) ----

// UTF-8 code points, as Python counts and indexes a str. A byte that starts no valid sequence
// counts as one character.
std::vector<std::string> chars_of(const std::string& s);
bool is_space(char c);
// Python's strip / lstrip / rstrip: `chars` (null: whitespace) dropped from the chosen ends.
std::string strip_chars(const std::string& s, const std::string* chars, bool left, bool right);
std::string ascii_case(std::string s, bool upper);
std::string title_case(const std::string& s);
std::string replace_all(const std::string& s, const std::string& from, const std::string& to);
// transformers' tojson (json.dumps with ensure_ascii=False): on one line, or with `indent` > 0
// spaces per level as json.dumps(indent=N) writes it; `line` names where a value it cannot
// write is.
std::string to_json(const Value& v, int line, int indent = 0, int depth = 0);
// The kind as errors name it ("integer", "list", ...).
const char* kind_name(const Value& v);

// ---- Syntax tree ----

struct Expr;
using ExprP = std::shared_ptr<Expr>;

struct Expr {
  enum class K {
    kLiteral,
    kName,
    kList,
    kDict,
    kAttr,
    kIndex,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kBinary,
    kAnd,
    kOr,
    kNot,
    kCond
  };
  K k = K::kLiteral;
  int line = 1;
  Value literal;
  std::string name;         // variable, attribute, operator, filter, test
  std::vector<ExprP> args;  // operands; for calls, filters and tests: [callee / input, args...]
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negate = false;  // `is not`, `not in`
};

struct Node {
  enum class K {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetBlock,
    kGeneration,
    kMacro,
    kBreak,
    kContinue
  };
  K k = K::kText;
  int line = 1;
  std::string text;
  ExprP expr;  // output, set, for's iterable
  std::vector<std::pair<ExprP, std::vector<std::shared_ptr<Node>>>> branches;  // if / elif
  std::vector<std::shared_ptr<Node>> body, else_body;
  std::vector<std::string> targets;  // for: names; set: the name; macro: its name, its params
  std::string attr;                  // set ns.attr
  ExprP filter;                      // for ... if cond
  std::vector<ExprP> defaults;       // macro: each param's default (null: none)
};
using NodeP = std::shared_ptr<Node>;

// ---- Lexer and parser ----

struct Token {
  enum class K {
    kText,
    kVarBegin,
    kVarEnd,
    kBlockBegin,
    kBlockEnd,
    kName,
    kInt,
    kFloat,
    kString,
    kOp,
    kEof
  };
  K k = K::kEof;
  std::string text;
  int64_t i = 0;
  double f = 0;
  int line = 1;
};

// The template's tokens, text and tags, with trim_blocks, lstrip_blocks and the whitespace
// control applied to the text; the last is kEof.
std::vector<Token> tokenize(const std::string& source);
// The template's top-level body.
std::vector<NodeP> parse_tokens(std::vector<Token> tokens);

// ---- Renderer ----

// One render: the variables' scopes, the namespaces made, the steps taken.
class Renderer {
 public:
  explicit Renderer(const Value& context);
  std::string run(const std::vector<NodeP>& body);

 private:
  struct Args {
    std::vector<Value> pos;
    std::vector<std::pair<std::string, Value>> kw;
    const Value* find(const std::string& k) const {
      for (const auto& [n, v] : kw) {
        if (n == k) return &v;
      }
      return nullptr;
    }
    // Positional i, else keyword `k`, else undefined.
    Value at(size_t i, const std::string& k) const {
      if (i < pos.size()) return pos[i];
      const Value* v = find(k);
      return v ? *v : Value();
    }
  };

  // {% break %} / {% continue %} on their way out of the statements to their loop.
  enum class LoopSignal { kNone, kBreak, kContinue };

  // Statements and operators (jinja_render.cpp).
  void step(int line);
  void write(std::string& out, const std::string& s, int line);
  void exec(const std::vector<NodeP>& body, std::string& out);
  void exec(const Node& n, std::string& out);
  void exec_for(const Node& n, std::string& out);
  void bind(const Node& n, const Value& item);
  Value lookup(const std::string& name) const;
  static std::string text_of(const Expr& e);
  Value eval(const Expr& e);
  Value index(const Expr& e, const Value& obj, const Value& key);
  Value slice(const Expr& e);
  static bool equal(const Value& a, const Value& b);
  // Python's ordering of two numbers or two strings (-1, 0, 1); anything else is an error.
  static int compare(const Expr& e, const Value& a, const Value& b);
  bool contains(const Expr& e, const Value& hay, const Value& needle);
  Value binary(const Expr& e);
  static Value arithmetic(const Expr& e, const Value& a, const Value& b);

  // Functions, methods, tests and filters (jinja_builtins.cpp).
  Args args_of(const Expr& e, size_t first);
  std::string need_string(const Expr& e, const Value& v, const std::string& what);
  Value call(const Expr& e);
  // A {% macro %}: its text, rendered with the arguments bound to its parameters over the
  // template's top-level variables (not the caller's locals, as Jinja scopes it).
  Value call_macro(const Expr& e, const Node& macro, const Args& a);
  Value call_function(const Expr& e, const std::string& f, const Args& a);
  Value string_method(const Expr& e, const std::string& s, const std::string& m, const Args& a);
  static std::optional<Value> dict_method(const Value& obj, const std::string& m,
                                          const Args& a);
  static List as_list(const Expr& e, const Value& v);
  static Value attribute(const Value& v, const std::string& path);
  bool run_test(const Expr& e, const std::string& name, const Value& v, const Args& a);
  bool test(const Expr& e);
  Value filter(const Expr& e);
  std::optional<Value> text_filter(const Expr& e, const std::string& f, const Value& v,
                                   const Args& a);
  std::optional<Value> sequence_filter(const Expr& e, const std::string& f, const Value& v,
                                       const Args& a);
  std::optional<Value> dict_filter(const Expr& e, const std::string& f, const Value& v,
                                   const Args& a);
  // Jinja's sorts and unique: a string in lower case unless case_sensitive.
  static Value folded(const Value& v, bool case_sensitive);
  // Sorts by field(item), stably, as Jinja's sort and dictsort.
  static void sort_list(const Expr& e, List& l, bool case_sensitive, bool reverse,
                        const std::function<Value(const Value&)>& field);
  // Filter `f` (text, sequence or dict filters) of v: filter() and map('f') call it.
  Value apply_filter(const Expr& e, const std::string& f, const Value& v, const Args& a);

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  std::unordered_map<std::string, const Node*> macros_;  // defined so far (nodes of the tree)
  int call_depth_ = 0;
  LoopSignal signal_ = LoopSignal::kNone;
  std::set<const Dict*> namespaces_;
  std::vector<Value> keep_;
  int64_t steps_ = 0;
};

}  // namespace burst::server::jinja
