// Request heads and CORS for HttpFrontend (frontend/http_frontend.h): strict HTTP/1.1 framing
// of a head (parse_request_head) and the CORS policy's answers (http_head.h), apart from the
// sockets, threads and deadlines of http_frontend.cpp.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/http_frontend.h"
#include "http_head.h"

namespace burst::server {

namespace {

constexpr int kMaxHeaderLines = 100;
// cpp-httplib's own limits, checked here first so that the refusal says what is wrong (it
// answers a bare 400): the longest request line and header line it reads, the methods it knows.
constexpr size_t kMaxRequestLine = 8192;
constexpr size_t kMaxHeaderLine = 8192;
constexpr const char* kMethods[] = {"GET",     "HEAD",    "POST",  "PUT", "DELETE",
                                    "CONNECT", "OPTIONS", "TRACE", "PATCH"};
// A preflight's answer may be cached this long by the browser (seconds; Starlette's, so vLLM's).
constexpr int kCorsMaxAge = 600;

}  // namespace

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

namespace {

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// RFC 9110 token characters (header names, methods).
bool is_tchar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) ||
         std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

}  // namespace

// A printable quote of a client's bytes for an error message.
std::string quoted(std::string_view s) {
  std::string out = "'";
  for (char c : s.substr(0, 60)) {
    out += c >= 0x20 && c < 0x7f ? std::string(1, c) : "\\x" + [&] {
      char b[4];
      std::snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(c));
      return std::string(b);
    }();
  }
  return out + (s.size() > 60 ? "...'" : "'");
}

namespace {

// Case-insensitive equality of ASCII names (header names, methods, origins' scheme and host).
bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

// Whether a CORS list ("*": anything) holds `item`.
bool listed(const std::vector<std::string>& list, std::string_view item) {
  return std::any_of(list.begin(), list.end(),
                     [&](const std::string& e) { return e == "*" || same_name(e, item); });
}

bool lists_any(const std::vector<std::string>& list) {
  return std::find(list.begin(), list.end(), "*") != list.end();
}

std::string joined(const std::vector<std::string>& list) {
  std::string out;
  for (const auto& e : list) out += (out.empty() ? "" : ", ") + e;
  return out;
}

}  // namespace

// The CORS headers of a response to a request from `origin`: none unless it is allowed. A
// listed origin is echoed (with Vary: Origin, so that caches keep one answer per origin);
// "*" is answered "*", except with credentials: browsers refuse a credentialed answer whose
// allowed origin is "*", so the origin is echoed then too. X-Request-Id is exposed so that a
// page can read it.
std::string cors_headers(const CorsPolicy& cors, const std::string& origin) {
  if (!cors.enabled() || origin.empty() || !listed(cors.origins, origin)) return "";
  if (cors.credentials) {
    return "Access-Control-Allow-Origin: " + origin +
           "\r\nVary: Origin\r\nAccess-Control-Allow-Credentials: true\r\n"
           "Access-Control-Expose-Headers: X-Request-Id\r\n";
  }
  if (lists_any(cors.origins)) {
    return "Access-Control-Allow-Origin: *\r\nAccess-Control-Expose-Headers: X-Request-Id\r\n";
  }
  return "Access-Control-Allow-Origin: " + origin +
         "\r\nVary: Origin\r\nAccess-Control-Expose-Headers: X-Request-Id\r\n";
}

// A preflight's grants as header lines, or (in *why) what it asked that is not allowed.
std::string preflight_grants(const CorsPolicy& cors, const RequestHead& h, std::string* why) {
  if (!listed(cors.origins, h.origin)) {
    *why = "CORS: origin " + quoted(std::string_view(h.origin)) +
           " is not allowed (--allowed-origins)";
    return "";
  }
  if (!listed(cors.methods, h.cors_method)) {
    *why = "CORS: method " + quoted(std::string_view(h.cors_method)) +
           " is not allowed (--allowed-methods " + joined(cors.methods) + ")";
    return "";
  }
  std::string_view asked = h.cors_headers;
  while (!asked.empty()) {
    const size_t comma = asked.find(',');
    const std::string_view name = trim_ows(asked.substr(0, comma));
    asked = comma == std::string_view::npos ? std::string_view() : asked.substr(comma + 1);
    if (!name.empty() && !listed(cors.headers, name)) {
      *why = "CORS: request header " + quoted(name) + " is not allowed (--allowed-headers " +
             joined(cors.headers) + ")";
      return "";
    }
  }
  // "*" grants what was asked, by name: a literal "*" would not cover Authorization, and
  // browsers ignore it on requests with credentials.
  std::string out = cors_headers(cors, h.origin) + "Access-Control-Allow-Methods: " +
                    (lists_any(cors.methods) ? h.cors_method : joined(cors.methods)) + "\r\n";
  if (!h.cors_headers.empty()) {
    out += "Access-Control-Allow-Headers: " +
           (lists_any(cors.headers) ? h.cors_headers : joined(cors.headers)) + "\r\n";
  }
  return out + "Access-Control-Max-Age: " + std::to_string(kCorsMaxAge) + "\r\n";
}

namespace {

// A refusal of a request head: the HTTP status (0: none) and what was wrong.
struct HeadError {
  int status = 0;
  std::string message;
};

// Splits a head into its lines (without CRLF), the last, empty one dropped. Every line must end
// with CRLF: a lone CR or LF is how one parser's line becomes two of another's.
HeadError head_lines(std::string_view head, std::vector<std::string_view>& lines) {
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == '\r' && (i + 1 >= head.size() || head[i + 1] != '\n')) {
      return {400, "a bare CR in the request head (lines must end with CRLF)"};
    }
    if (head[i] == '\n' && (i == 0 || head[i - 1] != '\r')) {
      return {400, "a bare LF in the request head (lines must end with CRLF)"};
    }
  }
  for (size_t pos = 0; pos < head.size();) {
    const size_t eol = head.find("\r\n", pos);
    if (eol == std::string_view::npos) return {400, "the request head does not end in CRLF"};
    lines.push_back(head.substr(pos, eol - pos));
    pos = eol + 2;
  }
  if (lines.size() < 2 || !lines.back().empty()) return {400, "incomplete request head"};
  lines.pop_back();
  return {};
}

// METHOD SP TARGET SP HTTP/1.x, a method we serve; *version is the protocol.
HeadError check_request_line(std::string_view line, std::string_view* version) {
  if (line.size() > kMaxRequestLine) {
    return {414, "the request line is over " + std::to_string(kMaxRequestLine) + " bytes"};
  }
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string_view::npos || sp2 == sp1 + 1 ||
      line.find(' ', sp2 + 1) != std::string_view::npos) {
    return {400, "malformed request line " + quoted(line) +
                     " (want METHOD SP TARGET SP HTTP/1.1)"};
  }
  *version = line.substr(sp2 + 1);
  if (*version != "HTTP/1.1" && *version != "HTTP/1.0") {
    if (version->size() == 8 && version->substr(0, 5) == "HTTP/") {
      return {505, "HTTP version " + quoted(*version) + " is not supported (HTTP/1.1, 1.0)"};
    }
    return {400, "malformed request line " + quoted(line)};
  }
  const std::string_view method = line.substr(0, sp1);
  if (std::none_of(std::begin(kMethods), std::end(kMethods),
                   [&](const char* m) { return method == m; })) {
    return {501, "method " + quoted(method) + " is not supported"};
  }
  return {};
}

// Header line i (at byte `offset` of the head): its syntax, and the framing headers we act on
// (Content-Length, Transfer-Encoding, Expect) into h, as Connection and the CORS ones; the
// counts catch repeated ones; keep_alive: "Connection: keep-alive" (an HTTP/1.0 client's ask).
HeadError check_header_line(size_t i, std::string_view line, size_t offset, RequestHead& h,
                            int& content_lengths, int& transfer_encodings, bool& keep_alive) {
  if (line.size() > kMaxHeaderLine) {
    return {431, "header line " + std::to_string(i) + " is over " +
                     std::to_string(kMaxHeaderLine) + " bytes"};
  }
  if (line.front() == ' ' || line.front() == '\t') {
    return {400, "header line " + std::to_string(i) + " " + quoted(line) +
                     " starts with whitespace (obsolete line folding is refused)"};
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) {
    return {400, "header line " + std::to_string(i) + " " + quoted(line) + " has no colon"};
  }
  const std::string_view name = line.substr(0, colon);
  if (name.empty() || !std::all_of(name.begin(), name.end(), is_tchar)) {
    return {400, "header name " + quoted(name) + " is not a token (whitespace before the "
                     "colon or a character a header name cannot hold)"};
  }
  const std::string_view value = trim_ows(line.substr(colon + 1));
  for (char c : value) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\t') || u == 0x7f) {
      return {400, "header " + quoted(name) + " holds a control character"};
    }
  }
  const std::string key = lower(name);
  if (key == "content-length") {
    if (++content_lengths > 1) return {400, "more than one Content-Length header"};
    if (value.empty() || value.size() > 18 ||
        !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return {400, "Content-Length " + quoted(value) + " is not a number of bytes"};
    }
    h.content_length = std::stoll(std::string(value));
  } else if (key == "transfer-encoding") {
    if (++transfer_encodings > 1) return {400, "more than one Transfer-Encoding header"};
    if (lower(value) != "chunked") {
      return {501, "Transfer-Encoding " + quoted(value) + " is not supported (only chunked)"};
    }
    h.chunked = true;
  } else if (key == "expect") {
    if (lower(value) != "100-continue") {
      return {417, "Expect " + quoted(value) + " is not supported (only 100-continue)"};
    }
    h.expect_continue = true;
    h.expect_begin = offset;
    h.expect_end = offset + line.size() + 2;
  } else if (key == "connection") {
    // A token list ("keep-alive, Upgrade"); what matters here is whether it ends the connection.
    for (std::string_view rest = value; !rest.empty();) {
      const size_t comma = rest.find(',');
      const std::string token = lower(trim_ows(rest.substr(0, comma)));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      if (token == "close") h.close = true;
      if (token == "keep-alive") keep_alive = true;
    }
  } else if (key == "origin" && h.origin.empty()) {
    h.origin = value;
  } else if (key == "access-control-request-method" && h.cors_method.empty()) {
    h.cors_method = value;
  } else if (key == "access-control-request-headers" && h.cors_headers.empty()) {
    h.cors_headers = value;
  }
  return {};
}

}  // namespace

RequestHead parse_request_head(std::string_view head) {
  RequestHead h;
  auto bad = [&](HeadError e) {
    h.status = e.status;
    h.message = std::move(e.message);
    return h;
  };
  h.head_bytes = head.size();
  std::vector<std::string_view> lines;
  if (HeadError e = head_lines(head, lines); e.status != 0) return bad(std::move(e));
  std::string_view version;
  if (HeadError e = check_request_line(lines[0], &version); e.status != 0) {
    return bad(std::move(e));
  }
  if (lines.size() - 1 > kMaxHeaderLines) {
    return bad({431, "more than " + std::to_string(kMaxHeaderLines) + " header lines"});
  }
  h.method = lines[0].substr(0, lines[0].find(' '));
  h.http10 = version == "HTTP/1.0";
  int content_lengths = 0, transfer_encodings = 0;
  bool keep_alive = false;
  size_t offset = lines[0].size() + 2;
  for (size_t i = 1; i < lines.size(); offset += lines[i].size() + 2, ++i) {
    HeadError e = check_header_line(i, lines[i], offset, h, content_lengths, transfer_encodings,
                                     keep_alive);
    if (e.status != 0) return bad(std::move(e));
  }
  if (h.http10 && !keep_alive) h.close = true;  // HTTP/1.0 closes unless asked not to
  if (content_lengths > 0 && h.chunked) {
    return bad({400, "Content-Length together with Transfer-Encoding: chunked (a request "
                     "smuggling pattern) is refused"});
  }
  if (h.chunked && version == "HTTP/1.0") {
    return bad({400, "Transfer-Encoding in an HTTP/1.0 request is refused"});
  }
  return h;
}

}  // namespace burst::server
