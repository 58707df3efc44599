// The chat template's parser: tokens (jinja_lexer.cpp) into the syntax tree (jinja_internal.h),
// by recursive descent with Jinja's operator precedence; nesting is bounded (kMaxDepth).
#include <algorithm>
#include <set>

#include "jinja_internal.h"

namespace burst::server::jinja {

namespace {

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
    if (kw.text == "if") {
      parse_if(*n);
    } else if (kw.text == "for") {
      parse_for(*n);
    } else if (kw.text == "set") {
      parse_set(*n);
    } else if (kw.text == "generation") {
      // transformers' assistant-mask marker: renders its body unchanged.
      n->k = Node::K::kGeneration;
      expect(Token::K::kBlockEnd, "'%}'");
      std::string stopped;
      n->body = parse_body({"endgeneration"}, &stopped);
      expect(Token::K::kBlockEnd, "'%}'");
    } else if (kw.text == "macro") {
      parse_macro(*n);
    } else if (kw.text == "break" || kw.text == "continue") {
      // jinja2.ext.loopcontrols, which transformers enables.
      if (loops_ == 0) fail(kw.line, "'{% " + kw.text + " %}' outside a loop");
      n->k = kw.text == "break" ? Node::K::kBreak : Node::K::kContinue;
      expect(Token::K::kBlockEnd, "'%}'");
    } else {
      fail(kw.line, "the statement '{% " + kw.text +
                        " %}' is not supported (for, if, set, macro, break, continue)");
    }
    return n;
  }

  // {% macro name(a, b=default, ...) %}body{% endmacro %}
  void parse_macro(Node& n) {
    n.k = Node::K::kMacro;
    n.targets.push_back(expect_name());
    expect_op("(");
    while (!is_op(")")) {
      n.targets.push_back(expect_name());
      ExprP dflt;
      if (is_op("=")) {
        next();
        dflt = parse_expr();
      }
      n.defaults.push_back(dflt);
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    expect(Token::K::kBlockEnd, "'%}'");
    const int loops = loops_;
    loops_ = 0;  // a loop around the definition is not the macro's: no break out of it
    std::string stopped;
    n.body = parse_body({"endmacro"}, &stopped);
    loops_ = loops;
    if (peek().k == Token::K::kName) next();  // {% endmacro name %}
    expect(Token::K::kBlockEnd, "'%}'");
  }

  void parse_if(Node& n) {
    std::string stopped;
    n.k = Node::K::kIf;
    ExprP cond = parse_expr();
    expect(Token::K::kBlockEnd, "'%}'");
    auto body = parse_body({"elif", "else", "endif"}, &stopped);
    n.branches.emplace_back(cond, std::move(body));
    while (stopped == "elif") {
      cond = parse_expr();
      expect(Token::K::kBlockEnd, "'%}'");
      body = parse_body({"elif", "else", "endif"}, &stopped);
      n.branches.emplace_back(cond, std::move(body));
    }
    if (stopped == "else") {
      expect(Token::K::kBlockEnd, "'%}'");
      n.else_body = parse_body({"endif"}, &stopped);
    }
    expect(Token::K::kBlockEnd, "'%}'");
  }

  void parse_for(Node& n) {
    std::string stopped;
    n.k = Node::K::kFor;
    const bool paren = is_op("(");
    if (paren) next();
    n.targets.push_back(expect_name());
    while (is_op(",")) {
      next();
      n.targets.push_back(expect_name());
    }
    if (paren) expect_op(")");
    if (!is_name("in")) fail(peek().line, "expected 'in', got " + describe(peek()));
    next();
    n.expr = parse_or();  // no `a if b else c` here: `if` filters the loop
    if (is_name("if")) {
      next();
      n.filter = parse_expr();
    }
    if (is_name("recursive")) fail(peek().line, "recursive loops are not supported");
    expect(Token::K::kBlockEnd, "'%}'");
    ++loops_;
    n.body = parse_body({"else", "endfor"}, &stopped);
    --loops_;
    if (stopped == "else") {
      expect(Token::K::kBlockEnd, "'%}'");
      n.else_body = parse_body({"endfor"}, &stopped);
    }
    expect(Token::K::kBlockEnd, "'%}'");
  }

  void parse_set(Node& n) {
    n.k = Node::K::kSet;
    n.targets.push_back(expect_name());
    if (is_op(".")) {
      next();
      n.attr = expect_name();
    }
    if (is_op("=")) {
      next();
      n.expr = parse_expr();
      expect(Token::K::kBlockEnd, "'%}'");
    } else {
      if (!n.attr.empty()) fail(n.line, "a block set takes a plain name");
      n.k = Node::K::kSetBlock;
      expect(Token::K::kBlockEnd, "'%}'");
      std::string stopped;
      n.body = parse_body({"endset"}, &stopped);
      expect(Token::K::kBlockEnd, "'%}'");
    }
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
  // As Jinja: a filter or test after a sign applies to the signed value (-3|abs is 3).
  ExprP parse_unary(bool with_filters = true) {
    Deeper d(*this);
    ExprP e;
    if (is_op("-")) {
      e = make(Expr::K::kNeg, next().line);
      e->args = {parse_unary(false)};
    } else if (is_op("+")) {
      next();
      e = parse_unary(false);
    } else {
      e = parse_postfix(parse_primary());
    }
    return with_filters ? parse_filters(e) : e;
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
      case Token::K::kOp:
        if (ExprP e = parse_bracketed(t)) return e;
        break;
      default:
        break;
    }
    fail(t.line, "expected a value, got " + describe(t));
  }

  // A parenthesised expression or tuple, a list or a dict literal; null when `t` opens none.
  ExprP parse_bracketed(const Token& t) {
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
    return nullptr;
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loops_ = 0;  // for bodies around the statement being parsed (break, continue)
};

}  // namespace

std::vector<NodeP> parse_tokens(std::vector<Token> tokens) {
  return Parser(std::move(tokens)).parse_template();
}

}  // namespace burst::server::jinja
