// Jinja values (common/jinja.h) and the text helpers the interpreter shares (jinja_internal.h):
// Python's str(), repr() and float text, transformers' tojson, UTF-8 characters, case and strip.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "jinja_internal.h"

namespace burst::server::jinja {

namespace {

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

}  // namespace

[[noreturn]] void fail(int line, const std::string& what) {
  throw Error{"chat template, line " + std::to_string(line) + ": " + what};
}

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
std::string to_json(const Value& v, int line, int indent, int depth) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return "null";
    case Value::Kind::kBool:
      return v.as_bool() ? "true" : "false";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat: {
      const double x = v.as_float();
      if (!std::isfinite(x)) return x != x ? "NaN" : x > 0 ? "Infinity" : "-Infinity";
      return float_text(x);
    }
    case Value::Kind::kString:
      return json_string(v.str());
    case Value::Kind::kList:
    case Value::Kind::kDict: {
      const bool list = v.kind() == Value::Kind::kList;
      const size_t n = list ? v.list().size() : v.dict().size();
      if (n == 0) return list ? "[]" : "{}";
      // json.dumps: ", " between items on one line; with indent, "," and a new line, each item
      // indented one level deeper than its bracket.
      // A new line and `level` indents (indent and depth are never negative).
      auto new_line = [&](int level) {
        std::string s(1 + static_cast<size_t>(indent) * static_cast<size_t>(level), ' ');
        s[0] = '\n';
        return s;
      };
      const std::string open = indent > 0 ? new_line(depth + 1) : std::string();
      const std::string sep = indent > 0 ? std::string(",").append(open) : std::string(", ");
      std::string out = list ? "[" : "{";
      out += open;
      for (size_t i = 0; i < n; ++i) {
        if (i) out += sep;
        if (list) {
          out += to_json(v.list()[i], line, indent, depth + 1);
        } else {
          const auto& [k, x] = v.dict()[i];
          out += json_string(k) + ": " + to_json(x, line, indent, depth + 1);
        }
      }
      if (indent > 0) out += new_line(depth);
      return out + (list ? "]" : "}");
    }
  }
  fail(line, "a value tojson cannot write");
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
}  // namespace burst::server::jinja
