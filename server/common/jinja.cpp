#include "common/jinja.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>
#include <unordered_map>

namespace burst::server::jinja {

namespace {

// Bounds on what one template and one render may cost: a template and the messages it renders
// are untrusted, and a render runs on an API thread.
constexpr size_t kMaxOutputBytes = size_t{64} << 20;
constexpr int64_t kMaxSteps = 5'000'000;  // expressions and statements evaluated in one render
constexpr int64_t kMaxRange = int64_t{1} << 16;  // a list of that many values is MBs
constexpr int kMaxDepth = 200;                   // parser nesting (parentheses, statements)

// Errors inside this file are thrown and become a Status at the two public entry points.
struct Error {
  std::string message;
};

[[noreturn]] void fail(int line, const std::string& what) {
  throw Error{"chat template, line " + std::to_string(line) + ": " + what};
}

// UTF-8 code points, as Python counts and indexes a str. A byte that starts no valid sequence
// counts as one character.
std::vector<std::string> chars_of(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string strip_chars(const std::string& s, const std::string* chars, bool left, bool right) {
  auto drop = [&](char c) { return chars ? chars->find(c) != std::string::npos : is_space(c); };
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && drop(s[b])) ++b;
  }
  if (right) {
    while (e > b && drop(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

std::string ascii_case(std::string s, bool upper) {
  for (char& c : s) {
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

std::string title_case(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (alpha) {
      c = start ? ascii_case(std::string(1, c), true)[0] : ascii_case(std::string(1, c), false)[0];
    }
    start = !alpha && !(c >= '0' && c <= '9');
  }
  return out;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string float_text(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  // Python's repr: the shortest text that reads back as the same double.
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, f);
    if (std::strtod(buf, nullptr) == f) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";
  return s;
}

std::string py_repr_string(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  return out + q;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;  // ensure_ascii=False, as transformers' tojson
        }
    }
  }
  return out + "\"";
}

std::string repr(const Value& v);

std::string to_json(const Value& v, int line) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return "null";
    case Value::Kind::kBool:
      return v.as_bool() ? "true" : "false";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat: {
      if (!std::isfinite(v.as_float())) return v.as_float() != v.as_float() ? "NaN" : "Infinity";
      return float_text(v.as_float());
    }
    case Value::Kind::kString:
      return json_string(v.str());
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < v.list().size(); ++i) {
        out += (i ? ", " : "") + to_json(v.list()[i], line);
      }
      return out + "]";
    }
    case Value::Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.dict()) {
        out += (first ? "" : ", ") + json_string(k) + ": " + to_json(x, line);
        first = false;
      }
      return out + "}";
    }
  }
  fail(line, "a value tojson cannot write");
}

std::string repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString:
      return py_repr_string(v.str());
    case Value::Kind::kList: {
      std::string out = "[";
      for (size_t i = 0; i < v.list().size(); ++i) out += (i ? ", " : "") + repr(v.list()[i]);
      return out + "]";
    }
    case Value::Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.dict()) {
        out += (first ? "" : ", ") + py_repr_string(k) + ": " + repr(x);
        first = false;
      }
      return out + "}";
    }
    default:
      return v.to_string();
  }
}

const char* kind_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "none";
    case Value::Kind::kBool:
      return "boolean";
    case Value::Kind::kInt:
      return "integer";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "string";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return "dict";
  }
  return "value";
}

}  // namespace

// ---- Value ----

Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value::Value(bool b) : kind_(Kind::kBool), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::kInt), i_(i) {}
Value::Value(double f) : kind_(Kind::kFloat), f_(f) {}
Value::Value(std::string s) : kind_(Kind::kString), s_(std::move(s)) {}
Value::Value(List l) : kind_(Kind::kList), list_(std::make_shared<List>(std::move(l))) {}
Value::Value(Dict d) : kind_(Kind::kDict), dict_(std::make_shared<Dict>(std::move(d))) {}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
      return i_ != 0;
    case Kind::kFloat:
      return f_ != 0;
    case Kind::kString:
      return !s_.empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->empty();
  }
  return false;
}

int64_t Value::as_int() const {
  if (kind_ == Kind::kBool) return b_ ? 1 : 0;
  if (kind_ == Kind::kFloat) {
    if (!(std::fabs(f_) < 9.2e18)) return 0;
    return static_cast<int64_t>(f_);
  }
  return i_;
}

double Value::as_float() const {
  if (kind_ == Kind::kFloat) return f_;
  return static_cast<double>(as_int());
}

Value Value::get(const std::string& key) const {
  if (kind_ != Kind::kDict) return Value();
  for (const auto& [k, v] : *dict_) {
    if (k == key) return v;
  }
  return Value();
}

void Value::set(const std::string& key, Value v) {
  for (auto& [k, x] : *dict_) {
    if (k == key) {
      x = std::move(v);
      return;
    }
  }
  dict_->emplace_back(key, std::move(v));
}

std::string Value::to_string() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return b_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(i_);
    case Kind::kFloat:
      return float_text(f_);
    case Kind::kString:
      return s_;
    case Kind::kList:
    case Kind::kDict:
      return repr(*this);
  }
  return "";
}

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
  enum class K { kText, kOutput, kIf, kFor, kSet, kSetBlock, kGeneration };
  K k = K::kText;
  int line = 1;
  std::string text;
  ExprP expr;  // output, set, for's iterable
  std::vector<std::pair<ExprP, std::vector<std::shared_ptr<Node>>>> branches;  // if / elif
  std::vector<std::shared_ptr<Node>> body, else_body;
  std::vector<std::string> targets;  // for: names; set: the name
  std::string attr;                  // set ns.attr
  ExprP filter;                      // for ... if cond
};
using NodeP = std::shared_ptr<Node>;

namespace {

// ---- Lexer ----

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

class Lexer {
 public:
  explicit Lexer(const std::string& src) : src_(src) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool strip_next = false, trim_newline = false;
    while (pos < src_.size()) {
      size_t open = find_open(pos);
      std::string text = src_.substr(pos, open - pos);
      if (trim_newline) {
        if (text.rfind("\r\n", 0) == 0) {
          text.erase(0, 2);
        } else if (!text.empty() && text[0] == '\n') {
          text.erase(0, 1);
        }
      }
      if (strip_next) text = strip_chars(text, nullptr, true, false);
      strip_next = trim_newline = false;
      if (open == src_.size()) {
        push_text(text, line_at(pos));
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      size_t p = open + 2;
      bool minus = false, plus = false;
      if (p < src_.size() && src_[p] == '-') {
        minus = true;
        ++p;
      } else if (p < src_.size() && src_[p] == '+') {
        plus = true;
        ++p;
      }
      if (minus) {
        text = strip_chars(text, nullptr, false, true);
      } else if (kind != '{' && !plus) {
        // lstrip_blocks: spaces and tabs from the start of the line to a block or comment.
        size_t b = open;
        while (b > pos && (src_[b - 1] == ' ' || src_[b - 1] == '\t')) --b;
        if (b == 0 || src_[b - 1] == '\n') {
          text.resize(text.size() - std::min(text.size(), open - b));
        }
      }
      push_text(text, line_at(pos));
      const int line = line_at(open);
      if (kind == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) fail(line, "a comment is not closed with #}");
        strip_next = end > p && src_[end - 1] == '-';
        trim_newline = !strip_next;
        pos = end + 2;
        continue;
      }
      out_.push_back({kind == '{' ? Token::K::kVarBegin : Token::K::kBlockBegin, "", 0, 0, line});
      pos = lex_tag(p, kind == '{' ? '}' : '%', &strip_next);
      trim_newline = kind == '%' && !strip_next && !(pos >= 3 && src_[pos - 3] == '+');
    }
    out_.push_back({Token::K::kEof, "", 0, 0, line_at(src_.size())});
    return std::move(out_);
  }

 private:
  size_t find_open(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return src_.size();
  }

  int line_at(size_t pos) {
    // Lines are asked for in increasing positions: count incrementally.
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_)
      line_ += src_[line_pos_] == '\n';
    return line_;
  }

  void push_text(const std::string& text, int line) {
    if (!text.empty()) out_.push_back({Token::K::kText, text, 0, 0, line});
  }

  // The tokens of one tag from `p` to its closing `}}` or `%}`; returns the position after it.
  size_t lex_tag(size_t p, char close, bool* strip_next) {
    static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                 "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                 "]",  "{",  "}",  ".",  ",",  ":",  "|"};
    int depth = 0;  // brackets: a `}` inside a dict literal does not close the tag
    while (true) {
      while (p < src_.size() && is_space(src_[p])) ++p;
      const int line = line_at(p);
      if (p >= src_.size()) fail(line, std::string("a tag is not closed with ") + close + "}");
      const char c = src_[p];
      if (depth == 0) {
        if (c == '-' && p + 2 < src_.size() + 0 && src_[p + 1] == close && src_[p + 2] == '}') {
          *strip_next = true;
          out_.push_back({close == '}' ? Token::K::kVarEnd : Token::K::kBlockEnd, "", 0, 0, line});
          return p + 3;
        }
        if (c == '+' && close == '%' && p + 2 < src_.size() && src_[p + 1] == '%' &&
            src_[p + 2] == '}') {
          out_.push_back({Token::K::kBlockEnd, "", 0, 0, line});
          return p + 3;
        }
        if (c == close && p + 1 < src_.size() && src_[p + 1] == '}') {
          out_.push_back({close == '}' ? Token::K::kVarEnd : Token::K::kBlockEnd, "", 0, 0, line});
          return p + 2;
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
          ++e;
        }
        out_.push_back({Token::K::kName, src_.substr(p, e - p), 0, 0, line});
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = p;
        while (e < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
          ++e;
        }
        bool is_float = false;
        if (e + 1 < src_.size() && src_[e] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        std::string digits;
        for (size_t i = p; i < e; ++i) {
          if (src_[i] != '_') digits += src_[i];
        }
        Token t{is_float ? Token::K::kFloat : Token::K::kInt, digits, 0, 0, line};
        if (is_float) {
          t.f = std::strtod(digits.c_str(), nullptr);
        } else {
          errno = 0;
          const unsigned long long v = std::strtoull(digits.c_str(), nullptr, 10);
          if (errno != 0 || v > static_cast<unsigned long long>(INT64_MAX)) {
            fail(line, "the integer " + digits + " is too large");
          }
          t.i = static_cast<int64_t>(v);
        }
        out_.push_back(t);
        p = e;
      } else if (c == '\'' || c == '"') {
        std::string s;
        size_t e = p + 1;
        for (; e < src_.size() && src_[e] != c; ++e) {
          if (src_[e] != '\\' || e + 1 >= src_.size()) {
            s += src_[e];
            continue;
          }
          const char n = src_[++e];
          switch (n) {
            case 'n':
              s += '\n';
              break;
            case 't':
              s += '\t';
              break;
            case 'r':
              s += '\r';
              break;
            case '\\':
              s += '\\';
              break;
            case '\'':
              s += '\'';
              break;
            case '"':
              s += '"';
              break;
            case '\n':
              break;
            default:
              s += '\\';
              s += n;
          }
        }
        if (e >= src_.size()) fail(line, "a string is not closed");
        out_.push_back({Token::K::kString, s, 0, 0, line});
        p = e + 1;
      } else {
        bool found = false;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (src_.compare(p, n, op) == 0) {
            if (*op == '(' || *op == '[' || *op == '{') ++depth;
            if ((*op == ')' || *op == ']' || *op == '}') && depth > 0) --depth;
            out_.push_back({Token::K::kOp, op, 0, 0, line});
            p += n;
            found = true;
            break;
          }
        }
        if (!found) fail(line, std::string("unexpected character '") + c + "'");
      }
    }
  }

  const std::string& src_;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

// ---- Parser ----

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  std::vector<NodeP> parse_template() {
    std::string stopped;
    auto body = parse_body({}, &stopped);
    return body;
  }

 private:
  const Token& peek(size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool is_op(const char* op, size_t ahead = 0) const {
    return peek(ahead).k == Token::K::kOp && peek(ahead).text == op;
  }
  bool is_name(const char* n, size_t ahead = 0) const {
    return peek(ahead).k == Token::K::kName && peek(ahead).text == n;
  }
  static std::string describe(const Token& t) {
    switch (t.k) {
      case Token::K::kText:
        return "text";
      case Token::K::kVarBegin:
        return "'{{'";
      case Token::K::kVarEnd:
        return "'}}'";
      case Token::K::kBlockBegin:
        return "'{%'";
      case Token::K::kBlockEnd:
        return "'%}'";
      case Token::K::kName:
        return "'" + t.text + "'";
      case Token::K::kInt:
      case Token::K::kFloat:
        return "the number " + t.text;
      case Token::K::kString:
        return "a string";
      case Token::K::kOp:
        return "'" + t.text + "'";
      case Token::K::kEof:
        return "the end of the template";
    }
    return "?";
  }
  void expect_op(const char* op) {
    if (!is_op(op))
      fail(peek().line, std::string("expected '") + op + "', got " + describe(peek()));
    next();
  }
  void expect(Token::K k, const char* what) {
    if (peek().k != k)
      fail(peek().line, std::string("expected ") + what + ", got " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().k != Token::K::kName) fail(peek().line, "expected a name, got " + describe(peek()));
    return next().text;
  }

  struct Deeper {
    explicit Deeper(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxDepth) fail(p_.peek().line, "the template nests too deeply");
    }
    ~Deeper() { --p_.depth_; }
    Parser& p_;
  };

  std::vector<NodeP> parse_body(const std::set<std::string>& stops, std::string* stopped) {
    Deeper d(*this);
    std::vector<NodeP> body;
    while (true) {
      const Token& t = peek();
      if (t.k == Token::K::kEof) {
        if (!stops.empty()) {
          std::string want;
          for (const auto& s : stops) want += (want.empty() ? "" : " or ") + ("{% " + s + " %}");
          fail(t.line, "the template ends where " + want + " was expected");
        }
        return body;
      }
      if (t.k == Token::K::kText) {
        auto n = std::make_shared<Node>();
        n->k = Node::K::kText;
        n->line = t.line;
        n->text = next().text;
        body.push_back(n);
      } else if (t.k == Token::K::kVarBegin) {
        next();
        auto n = std::make_shared<Node>();
        n->k = Node::K::kOutput;
        n->line = t.line;
        n->expr = parse_expr();
        expect(Token::K::kVarEnd, "'}}'");
        body.push_back(n);
      } else if (t.k == Token::K::kBlockBegin) {
        next();
        const Token& name = peek();
        if (name.k != Token::K::kName)
          fail(name.line, "expected a statement, got " + describe(name));
        if (stops.count(name.text)) {
          *stopped = next().text;
          return body;
        }
        body.push_back(parse_statement());
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  NodeP parse_statement() {
    const Token& kw = next();
    auto n = std::make_shared<Node>();
    n->line = kw.line;
    std::string stopped;
    if (kw.text == "if") {
      n->k = Node::K::kIf;
      ExprP cond = parse_expr();
      expect(Token::K::kBlockEnd, "'%}'");
      auto body = parse_body({"elif", "else", "endif"}, &stopped);
      n->branches.emplace_back(cond, std::move(body));
      while (stopped == "elif") {
        cond = parse_expr();
        expect(Token::K::kBlockEnd, "'%}'");
        body = parse_body({"elif", "else", "endif"}, &stopped);
        n->branches.emplace_back(cond, std::move(body));
      }
      if (stopped == "else") {
        expect(Token::K::kBlockEnd, "'%}'");
        n->else_body = parse_body({"endif"}, &stopped);
      }
      expect(Token::K::kBlockEnd, "'%}'");
    } else if (kw.text == "for") {
      n->k = Node::K::kFor;
      const bool paren = is_op("(");
      if (paren) next();
      n->targets.push_back(expect_name());
      while (is_op(",")) {
        next();
        n->targets.push_back(expect_name());
      }
      if (paren) expect_op(")");
      if (!is_name("in")) fail(peek().line, "expected 'in', got " + describe(peek()));
      next();
      n->expr = parse_or();  // no `a if b else c` here: `if` filters the loop
      if (is_name("if")) {
        next();
        n->filter = parse_expr();
      }
      if (is_name("recursive")) fail(peek().line, "recursive loops are not supported");
      expect(Token::K::kBlockEnd, "'%}'");
      n->body = parse_body({"else", "endfor"}, &stopped);
      if (stopped == "else") {
        expect(Token::K::kBlockEnd, "'%}'");
        n->else_body = parse_body({"endfor"}, &stopped);
      }
      expect(Token::K::kBlockEnd, "'%}'");
    } else if (kw.text == "set") {
      n->k = Node::K::kSet;
      n->targets.push_back(expect_name());
      if (is_op(".")) {
        next();
        n->attr = expect_name();
      }
      if (is_op("=")) {
        next();
        n->expr = parse_expr();
        expect(Token::K::kBlockEnd, "'%}'");
      } else {
        if (!n->attr.empty()) fail(n->line, "a block set takes a plain name");
        n->k = Node::K::kSetBlock;
        expect(Token::K::kBlockEnd, "'%}'");
        n->body = parse_body({"endset"}, &stopped);
        expect(Token::K::kBlockEnd, "'%}'");
      }
    } else if (kw.text == "generation") {
      // transformers' assistant-mask marker: renders its body unchanged.
      n->k = Node::K::kGeneration;
      expect(Token::K::kBlockEnd, "'%}'");
      n->body = parse_body({"endgeneration"}, &stopped);
      expect(Token::K::kBlockEnd, "'%}'");
    } else {
      fail(kw.line, "the statement '{% " + kw.text + " %}' is not supported (for, if, set)");
    }
    return n;
  }

  ExprP make(Expr::K k, int line) {
    auto e = std::make_shared<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  ExprP parse_expr() {
    Deeper d(*this);
    ExprP e = parse_or();
    if (is_name("if")) {
      const int line = next().line;
      ExprP c = make(Expr::K::kCond, line);
      ExprP cond = parse_or();
      ExprP other;
      if (is_name("else")) {
        next();
        other = parse_expr();
      } else {
        other = make(Expr::K::kLiteral, line);  // undefined
      }
      c->args = {cond, e, other};
      return c;
    }
    return e;
  }

  ExprP parse_or() {
    ExprP e = parse_and();
    while (is_name("or")) {
      ExprP o = make(Expr::K::kOr, next().line);
      o->args = {e, parse_and()};
      e = o;
    }
    return e;
  }
  ExprP parse_and() {
    ExprP e = parse_not();
    while (is_name("and")) {
      ExprP a = make(Expr::K::kAnd, next().line);
      a->args = {e, parse_not()};
      e = a;
    }
    return e;
  }
  ExprP parse_not() {
    Deeper d(*this);
    if (is_name("not")) {
      ExprP n = make(Expr::K::kNot, next().line);
      n->args = {parse_not()};
      return n;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    ExprP e = parse_concat();
    while (true) {
      std::string op;
      bool negate = false;
      if (peek().k == Token::K::kOp &&
          (peek().text == "==" || peek().text == "!=" || peek().text == "<" || peek().text == ">" ||
           peek().text == "<=" || peek().text == ">=")) {
        op = peek().text;
      } else if (is_name("in")) {
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        op = "in";
        negate = true;
        next();
      } else {
        return e;
      }
      ExprP b = make(Expr::K::kBinary, next().line);
      b->name = op;
      b->negate = negate;
      b->args = {e, parse_concat()};
      e = b;
    }
  }
  ExprP parse_concat() {
    ExprP e = parse_add();
    while (is_op("~")) {
      ExprP b = make(Expr::K::kBinary, next().line);
      b->name = "~";
      b->args = {e, parse_add()};
      e = b;
    }
    return e;
  }
  ExprP parse_add() {
    ExprP e = parse_mul();
    while (is_op("+") || is_op("-")) {
      ExprP b = make(Expr::K::kBinary, peek().line);
      b->name = next().text;
      b->args = {e, parse_mul()};
      e = b;
    }
    return e;
  }
  ExprP parse_mul() {
    ExprP e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      ExprP b = make(Expr::K::kBinary, peek().line);
      b->name = next().text;
      b->args = {e, parse_pow()};
      e = b;
    }
    return e;
  }
  ExprP parse_pow() {
    ExprP e = parse_unary();
    while (is_op("**")) {
      ExprP b = make(Expr::K::kBinary, next().line);
      b->name = "**";
      b->args = {e, parse_unary()};
      e = b;
    }
    return e;
  }
  ExprP parse_unary() {
    Deeper d(*this);
    if (is_op("-")) {
      ExprP n = make(Expr::K::kNeg, next().line);
      n->args = {parse_unary()};
      return n;
    }
    if (is_op("+")) {
      next();
      return parse_unary();
    }
    return parse_filters(parse_postfix(parse_primary()));
  }

  void parse_call_args(ExprP& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().k == Token::K::kName && is_op("=", 1)) {
        std::string key = next().text;
        next();
        call->kwargs.emplace_back(std::move(key), parse_expr());
      } else {
        call->args.push_back(parse_expr());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        ExprP a = make(Expr::K::kAttr, next().line);
        a->name = peek().k == Token::K::kInt ? next().text : expect_name();
        a->args = {e};
        e = a;
      } else if (is_op("[")) {
        const int line = next().line;
        ExprP parts[3];
        int colons = 0;
        for (;;) {
          if (!is_op(":") && !is_op("]")) parts[colons] = parse_expr();
          if (is_op(":") && colons < 2) {
            next();
            ++colons;
            continue;
          }
          break;
        }
        expect_op("]");
        if (colons == 0) {
          if (!parts[0]) fail(line, "an empty subscript");
          ExprP s = make(Expr::K::kIndex, line);
          s->args = {e, parts[0]};
          e = s;
        } else {
          ExprP s = make(Expr::K::kSlice, line);
          s->args = {e, parts[0], parts[1], parts[2]};
          e = s;
        }
      } else if (is_op("(")) {
        ExprP c = make(Expr::K::kCall, peek().line);
        c->args = {e};
        parse_call_args(c);
        e = c;
      } else {
        return e;
      }
    }
  }

  ExprP parse_filters(ExprP e) {
    while (true) {
      if (is_op("|")) {
        ExprP f = make(Expr::K::kFilter, next().line);
        f->name = expect_name();
        f->args = {e};
        if (is_op("(")) parse_call_args(f);
        e = parse_postfix(f);
      } else if (is_name("is")) {
        ExprP t = make(Expr::K::kTest, next().line);
        if (is_name("not")) {
          next();
          t->negate = true;
        }
        // `none`, `true` and `false` are test names here, not literals.
        t->name = expect_name();
        t->args = {e};
        if (is_op("(")) {
          parse_call_args(t);
        } else if (peek().k == Token::K::kInt || peek().k == Token::K::kString) {
          t->args.push_back(parse_primary());  // `is divisibleby 3`, `is equalto 'x'`
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  ExprP parse_primary() {
    Deeper d(*this);
    const Token& t = peek();
    switch (t.k) {
      case Token::K::kName: {
        next();
        ExprP e = make(Expr::K::kLiteral, t.line);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::none();
        } else {
          e->k = Expr::K::kName;
          e->name = t.text;
        }
        return e;
      }
      case Token::K::kInt:
      case Token::K::kFloat: {
        next();
        ExprP e = make(Expr::K::kLiteral, t.line);
        e->literal = t.k == Token::K::kInt ? Value(t.i) : Value(t.f);
        return e;
      }
      case Token::K::kString: {
        std::string s = next().text;
        while (peek().k == Token::K::kString) s += next().text;  // adjacent literals join
        ExprP e = make(Expr::K::kLiteral, t.line);
        e->literal = Value(std::move(s));
        return e;
      }
      case Token::K::kOp: {
        if (t.text == "(") {
          next();
          ExprP e = parse_expr();
          if (is_op(",")) {  // a tuple: a list here
            ExprP l = make(Expr::K::kList, t.line);
            l->args.push_back(e);
            while (is_op(",")) {
              next();
              if (is_op(")")) break;
              l->args.push_back(parse_expr());
            }
            e = l;
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          next();
          ExprP l = make(Expr::K::kList, t.line);
          while (!is_op("]")) {
            l->args.push_back(parse_expr());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return l;
        }
        if (t.text == "{") {
          next();
          ExprP m = make(Expr::K::kDict, t.line);
          while (!is_op("}")) {
            m->args.push_back(parse_expr());
            expect_op(":");
            m->args.push_back(parse_expr());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return m;
        }
        break;
      }
      default:
        break;
    }
    fail(t.line, "expected a value, got " + describe(t));
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---- Renderer ----

class Renderer {
 public:
  explicit Renderer(const Value& context) {
    scopes_.emplace_back();
    if (context.kind() == Value::Kind::kDict) {
      for (const auto& [k, v] : context.dict()) scopes_.back()[k] = v;
    }
  }

  std::string run(const std::vector<NodeP>& body) {
    std::string out;
    exec(body, out);
    return out;
  }

 private:
  void step(int line) {
    if (++steps_ > kMaxSteps) fail(line, "rendering takes too many steps");
  }

  void write(std::string& out, const std::string& s, int line) {
    if (out.size() + s.size() > kMaxOutputBytes) {
      fail(line, "the rendered text exceeds " + std::to_string(kMaxOutputBytes >> 20) + " MiB");
    }
    out += s;
  }

  void exec(const std::vector<NodeP>& body, std::string& out) {
    for (const NodeP& n : body) exec(*n, out);
  }

  void exec(const Node& n, std::string& out) {
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
    }
  }

  void exec_for(const Node& n, std::string& out) {
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
    }
  }

  void bind(const Node& n, const Value& item) {
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

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      const auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value();
  }

  static std::string text_of(const Expr& e) {
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

  Value eval(const Expr& e) {
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

  static int64_t norm_index(int64_t i, int64_t len) { return i < 0 ? i + len : i; }

  Value index(const Expr& e, const Value& obj, const Value& key) {
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

  Value slice(const Expr& e) {
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

  static bool equal(const Value& a, const Value& b) {
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

  bool contains(const Expr& e, const Value& hay, const Value& needle) {
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

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    const Value a = eval(*e.args[0]);
    const Value b = eval(*e.args[1]);
    if (op == "~") return Value(a.to_string() + b.to_string());
    if (op == "==") return Value(equal(a, b));
    if (op == "!=") return Value(!equal(a, b));
    if (op == "in") return Value(contains(e, b, a) != e.negate);
    auto article = [](const Value& v) {
      const std::string k = kind_name(v);
      return (k[0] == 'i' || k[0] == 'u' ? "an " : "a ") + k;
    };
    auto type_error = [&]() {
      fail(e.line, "'" + op + "' between " + article(a) + " and " + article(b) + " is not defined");
    };
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c = 0;
      if (a.is_number() && b.is_number()) {
        c = a.as_float() < b.as_float() ? -1 : a.as_float() > b.as_float() ? 1 : 0;
      } else if (a.is_string() && b.is_string()) {
        c = a.str().compare(b.str());
      } else {
        type_error();
      }
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

  Args args_of(const Expr& e, size_t first) {
    Args a;
    for (size_t i = first; i < e.args.size(); ++i) a.pos.push_back(eval(*e.args[i]));
    for (const auto& [k, v] : e.kwargs) a.kw.emplace_back(k, eval(*v));
    return a;
  }

  std::string need_string(const Expr& e, const Value& v, const std::string& what) {
    if (!v.is_string()) fail(e.line, what + " must be a string, got a " + kind_name(v));
    return v.str();
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    Args a = args_of(e, 1);
    if (callee.k == Expr::K::kName && lookup(callee.name).is_undefined()) {
      const std::string& f = callee.name;
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
      if (f == "namespace") {
        Value ns{Dict{}};
        for (auto& [k, v] : a.kw) ns.set(k, v);
        namespaces_.insert(&ns.dict());
        keep_.push_back(ns);  // keeps the address valid for the namespace check
        return ns;
      }
      fail(e.line, "unknown function '" + f + "'");
    }
    if (callee.k != Expr::K::kAttr) fail(e.line, "'" + text_of(callee) + "' is not callable");
    const Value obj = eval(*callee.args[0]);
    const std::string& m = callee.name;
    if (obj.is_string()) {
      const std::string& s = obj.str();
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
      fail(e.line, "strings have no method '" + m + "' here");
    }
    if (obj.kind() == Value::Kind::kDict) {
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
      // A callable stored in a dict is not something a template can reach here.
    }
    if (obj.is_undefined()) fail(e.line, "'" + text_of(*callee.args[0]) + "' is undefined");
    fail(e.line, std::string("a ") + kind_name(obj) + " has no method '" + m + "' here");
  }

  static List as_list(const Expr& e, const Value& v) {
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
  static Value attribute(const Value& v, const std::string& path) {
    Value cur = v;
    size_t pos = 0;
    while (true) {
      const size_t dot = path.find('.', pos);
      cur = cur.get(path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
      if (dot == std::string::npos) return cur;
      pos = dot + 1;
    }
  }

  bool run_test(const Expr& e, const std::string& name, const Value& v, const Args& a) {
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

  bool test(const Expr& e) {
    const Value v = eval(*e.args[0]);
    return run_test(e, e.name, v, args_of(e, 1));
  }

  Value filter(const Expr& e) {
    const std::string& f = e.name;
    const Value v = eval(*e.args[0]);
    const Args a = args_of(e, 1);
    if (f == "trim") {
      const Value chars = a.at(0, "chars");
      std::string set = chars.is_string() ? chars.str() : "";
      return Value(strip_chars(v.to_string(), chars.is_string() ? &set : nullptr, true, true));
    }
    if (f == "length" || f == "count") {
      if (v.is_string()) return Value(static_cast<int64_t>(chars_of(v.str()).size()));
      if (v.kind() == Value::Kind::kList) return Value(static_cast<int64_t>(v.list().size()));
      if (v.kind() == Value::Kind::kDict) return Value(static_cast<int64_t>(v.dict().size()));
      if (v.is_undefined()) return Value(int64_t{0});
      fail(e.line, std::string("a ") + kind_name(v) + " has no length");
    }
    if (f == "lower" || f == "upper") return Value(ascii_case(v.to_string(), f == "upper"));
    if (f == "title") return Value(title_case(v.to_string()));
    if (f == "capitalize") {
      std::string out = ascii_case(v.to_string(), false);
      if (!out.empty()) out[0] = ascii_case(out.substr(0, 1), true)[0];
      return Value(out);
    }
    if (f == "first" || f == "last") {
      const List l = as_list(e, v);
      if (l.empty()) return Value();
      return f == "first" ? l.front() : l.back();
    }
    if (f == "join") {
      const Value sep = a.at(0, "d");
      const Value attr = a.at(1, "attribute");
      std::string out;
      bool first = true;
      for (const Value& x : as_list(e, v)) {
        out += (first ? "" : sep.to_string()) +
               (attr.is_string() ? attribute(x, attr.str()) : x).to_string();
        first = false;
        if (out.size() > kMaxOutputBytes) fail(e.line, "a string too long");
      }
      return Value(std::move(out));
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
      if (v.is_number()) return Value(v.as_int());
      if (v.is_string()) {
        char* end = nullptr;
        errno = 0;
        const long long n = std::strtoll(v.str().c_str(), &end, 10);
        if (errno == 0 && end && *end == '\0' && !v.str().empty()) return Value(int64_t{n});
      }
      return a.pos.empty() ? Value(int64_t{0}) : a.pos[0];
    }
    if (f == "float") {
      if (v.is_number()) return Value(v.as_float());
      if (v.is_string()) {
        char* end = nullptr;
        const double d = std::strtod(v.str().c_str(), &end);
        if (end && *end == '\0' && !v.str().empty()) return Value(d);
      }
      return Value(0.0);
    }
    if (f == "list") return Value(as_list(e, v));
    if (f == "reverse") {
      if (v.is_string()) {
        auto cs = chars_of(v.str());
        std::string out;
        for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
        return Value(std::move(out));
      }
      List l = as_list(e, v);
      std::reverse(l.begin(), l.end());
      return Value(std::move(l));
    }
    if (f == "replace") {
      return Value(replace_all(v.to_string(), need_string(e, a.at(0, "old"), "replace's old"),
                               need_string(e, a.at(1, "new"), "replace's new")));
    }
    if (f == "tojson") return Value(to_json(v, e.line));
    if (f == "selectattr" || f == "rejectattr") {
      const std::string attr = need_string(e, a.at(0, "attr"), f + "'s attribute");
      List out;
      for (const Value& x : as_list(e, v)) {
        const Value field = attribute(x, attr);
        bool ok = field.truthy();
        if (a.pos.size() > 1) {
          Args rest;
          rest.pos.assign(a.pos.begin() + 2, a.pos.end());
          const std::string test_name = need_string(e, a.pos[1], f + "'s test");
          ok = run_test(e,
                        test_name == "=="   ? "eq"
                        : test_name == "!=" ? "ne"
                                            : test_name,
                        field, rest);
        }
        if (ok == (f == "selectattr")) out.push_back(x);
      }
      return Value(std::move(out));
    }
    if (f == "map") {
      const Value* attr = a.find("attribute");
      if (!attr || !attr->is_string()) fail(e.line, "map is supported with attribute= only");
      List out;
      for (const Value& x : as_list(e, v)) out.push_back(attribute(x, attr->str()));
      return Value(std::move(out));
    }
    fail(e.line, "unknown filter '" + f + "'");
  }

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  std::set<const Dict*> namespaces_;
  std::vector<Value> keep_;
  int64_t steps_ = 0;
};

}  // namespace

Result<Template> Template::parse(const std::string& source) {
  try {
    Lexer lexer(source);
    Parser parser(lexer.run());
    auto root = std::make_shared<Node>();
    root->k = Node::K::kGeneration;  // a body rendered as it is
    root->body = parser.parse_template();
    Template t;
    t.root_ = std::move(root);
    return t;
  } catch (const Error& e) {
    return Status::error(e.message);
  } catch (const std::exception& e) {
    return Status::error(std::string("chat template: ") + e.what());
  }
}

Result<std::string> Template::render(const Value& context) const {
  if (!root_) return Status::error("chat template: nothing parsed");
  try {
    Renderer r(context);
    return r.run(root_->body);
  } catch (const Error& e) {
    return Status::error(e.message);
  } catch (const std::exception& e) {
    return Status::error(std::string("chat template: ") + e.what());
  }
}

}  // namespace burst::server::jinja
