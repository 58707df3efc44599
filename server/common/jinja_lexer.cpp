// The chat template's lexer: text and tags with Hugging Face's whitespace rules (trim_blocks,
// lstrip_blocks, `-` and `+` controls), and the tokens inside {{ }} and {% %}; comments go.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>

#include "jinja_internal.h"

namespace burst::server::jinja {

namespace {

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
    int depth = 0;  // brackets: a `}` inside a dict literal does not close the tag
    while (true) {
      while (p < src_.size() && is_space(src_[p])) ++p;
      const int line = line_at(p);
      if (p >= src_.size()) fail(line, std::string("a tag is not closed with ") + close + "}");
      const char c = src_[p];
      if (depth == 0) {
        if (const size_t end = lex_close(p, close, line, strip_next)) return end;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        p = lex_name(p, line);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        p = lex_number(p, line);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p, line);
      } else {
        p = lex_op(p, line, &depth);
      }
    }
  }

  // The tag's end at `p` (`-}}`, `-%}`, `+%}`, `}}`, `%}`): its token, and the position after
  // it; 0 when the tag does not end there.
  size_t lex_close(size_t p, char close, int line, bool* strip_next) {
    const char c = src_[p];
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
    return 0;
  }

  size_t lex_name(size_t p, int line) {
    size_t e = p;
    while (e < src_.size() &&
           (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) {
      ++e;
    }
    out_.push_back({Token::K::kName, src_.substr(p, e - p), 0, 0, line});
    return e;
  }

  size_t lex_number(size_t p, int line) {
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
    return e;
  }

  size_t lex_string(size_t p, int line) {
    const char c = src_[p];
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
    return e + 1;
  }

  size_t lex_op(size_t p, int line, int* depth) {
    static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                 "/",  "%",  "~",  "<",  ">",  "=",  "(", ")", "[",
                                 "]",  "{",  "}",  ".",  ",",  ":",  "|"};
    for (const char* op : kOps) {
      const size_t n = std::char_traits<char>::length(op);
      if (src_.compare(p, n, op) == 0) {
        if (*op == '(' || *op == '[' || *op == '{') ++*depth;
        if ((*op == ')' || *op == ']' || *op == '}') && *depth > 0) --*depth;
        out_.push_back({Token::K::kOp, op, 0, 0, line});
        return p + n;
      }
    }
    fail(line, std::string("unexpected character '") + src_[p] + "'");
  }

  const std::string& src_;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source) { return Lexer(source).run(); }

}  // namespace burst::server::jinja
