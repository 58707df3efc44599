#include "frontend/http_frontend.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <system_error>

namespace burst::server {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxHeadBytes = 64 * 1024;
constexpr int kMaxHeaderLines = 100;
// cpp-httplib's own limits, checked here first so that the refusal says what is wrong (it
// answers a bare 400): the longest request line and header line it reads, the methods it knows.
constexpr size_t kMaxRequestLine = 8192;
constexpr size_t kMaxHeaderLine = 8192;
constexpr const char* kMethods[] = {"GET",     "HEAD",    "POST",  "PUT", "DELETE",
                                    "CONNECT", "OPTIONS", "TRACE", "PATCH"};
// A refused connection's answer is written, its sending side shut, and its socket kept until
// the client's EOF or this long: closing with unread bytes would reset the connection, and the
// client might lose the answer.
constexpr auto kLinger = std::chrono::milliseconds(1000);
// Beyond this many lingering refused connections (a flood), a refused one is closed at once:
// descriptors stay bounded.
constexpr size_t kMaxLingering = 1024;

// The request a handler runs for on this thread (client_disconnected()).
struct ThreadRequest {
  int fd = -1;
  bool http10 = false;
  bool response_started = false;  // a byte of the response is written
  bool sse_chunked = false;       // the response is an uncompressed chunked text/event-stream
  bool probe_sent = false;        // bytes were written after the client's FIN (see below)
  std::chrono::milliseconds write_timeout{0};
};
thread_local ThreadRequest t_request;

// A preflight's answer may be cached this long by the browser (seconds; Starlette's, so vLLM's).
constexpr int kCorsMaxAge = 600;

int ms_until(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

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

const char* reason_phrase(int status) {
  switch (status) {
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";  // nginx's name; no standard one exists
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
  }
}

// Waits until fd is readable, the front end stops, or the deadline: 1 readable, 0 timeout or
// stop, -1 error.
int wait_readable(int fd, int wake_fd, Clock::time_point deadline) {
  for (;;) {
    pollfd p[2] = {{fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    const int n = poll(p, 2, ms_until(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (p[1].revents != 0) return 0;
    if (p[0].revents != 0) return 1;
    if (Clock::now() >= deadline) return 0;
  }
}

bool send_all(int fd, std::string_view data, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, ms_until(deadline)) <= 0 || (p.revents & (POLLERR | POLLHUP)) != 0) {
        return false;
      }
      continue;
    }
    return false;
  }
  return true;
}

std::string peer_address(int fd, int* port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  *port = -1;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv,
                  sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "";
  }
  *port = std::atoi(serv);
  return host;
}

// `extra`: header lines (each ending in CRLF) to add, the CORS ones of the request's origin.
std::string canned_response(int status, const std::string& body, const std::string& extra = "") {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n" + (status == 503 ? "Retry-After: 1\r\n" : "") + extra +
         "\r\n" + body;
}

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

// The CORS headers of a response to a request from `origin`: none unless it is allowed. A
// listed origin is echoed (with Vary: Origin, so that caches keep one answer per origin);
// "*" is answered "*". X-Request-Id is exposed so that a page can read it.
std::string cors_headers(const CorsPolicy& cors, const std::string& origin) {
  if (!cors.enabled() || origin.empty() || !listed(cors.origins, origin)) return "";
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

// A response head as cpp-httplib wrote it (status line, header lines, blank line), amended:
// `extra` header lines added, and 499's reason phrase, which cpp-httplib does not know (it
// writes "Internal Server Error"). *sse: whether the body is an uncompressed chunked
// text/event-stream, into which client_disconnected() may write a comment chunk.
std::string amend_response_head(std::string_view head, const std::string& extra, bool* sse) {
  std::string out(head.substr(0, head.size() - 2));  // up to the blank line
  if (out.compare(0, 13, "HTTP/1.1 499 ") == 0) {
    out.replace(0, out.find("\r\n"), "HTTP/1.1 499 Client Closed Request");
  }
  const std::string low = lower(out);
  *sse = low.find("\r\ntransfer-encoding: chunked\r\n") != std::string::npos &&
         low.find("\r\ncontent-type: text/event-stream") != std::string::npos &&
         low.find("\r\ncontent-encoding:") == std::string::npos;
  return out + extra + "\r\n";
}

// One request's bytes for cpp-httplib: reads never go past them (so it can never take a byte
// of the next pipelined request); writes go to the socket under the write timeout.
class OneRequestStream : public httplib::Stream {
 public:
  // `extra`: header lines every response head gets (the CORS ones of the request's origin).
  OneRequestStream(int fd, std::string_view request, std::chrono::milliseconds write_timeout,
                   const std::string& ip, int port, const std::string& extra)
      : fd_(fd), request_(request), write_timeout_(write_timeout), ip_(ip), port_(port),
        extra_(extra) {}

  bool is_readable() const override { return pos_ < request_.size(); }
  bool is_writable() const override {
    pollfd p = {fd_, POLLOUT, 0};
    const int n = poll(&p, 1, static_cast<int>(write_timeout_.count()));
    return n > 0 && (p.revents & (POLLERR | POLLHUP)) == 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, request_.size() - pos_);
    std::memcpy(ptr, request_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    std::string_view data(ptr, size);
    std::string head;
    // cpp-httplib writes a response's status line and headers in one write, before the body.
    if (!t_request.response_started && data.starts_with("HTTP/1.1 ") &&
        data.ends_with("\r\n\r\n")) {
      head = amend_response_head(data, extra_, &t_request.sse_chunked);
      data = head;
    }
    t_request.response_started = true;
    return send_all(fd_, data, write_timeout_) ? static_cast<ssize_t>(size) : -1;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = ip_;
    port = port_;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip.clear();
    port = -1;
  }
  // cpp-httplib reads this only to refuse descriptors beyond select()'s FD_SETSIZE; this stream
  // never selects (its socket is polled), so it names no descriptor.
  socket_t socket() const override { return -1; }

 private:
  int fd_;
  std::string_view request_;
  size_t pos_ = 0;
  std::chrono::milliseconds write_timeout_;
  std::string ip_;
  int port_;
  std::string extra_;
};

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

ChunkScan scan_chunked_body(std::string_view data, int64_t max_body, size_t* end,
                            std::string* why) {
  size_t pos = 0;
  int64_t total = 0;
  for (;;) {
    const size_t eol = data.find("\r\n", pos);
    if (eol == std::string_view::npos) {
      if (data.size() - pos > 1024) {
        *why = "a chunk-size line over 1024 bytes";
        return ChunkScan::kBad;
      }
      return ChunkScan::kNeedMore;
    }
    std::string_view size_text = data.substr(pos, eol - pos);
    size_text = size_text.substr(0, size_text.find(';'));  // chunk extensions are ignored
    int64_t size = 0;
    if (size_text.empty() || size_text.size() > 15) {
      *why = "bad chunk size " + quoted(size_text);
      return ChunkScan::kBad;
    }
    for (char c : size_text) {
      const auto u = static_cast<unsigned char>(c);
      const int d = std::isdigit(u) ? c - '0' : std::isxdigit(u) ? std::tolower(u) - 'a' + 10 : -1;
      if (d < 0) {
        *why = "bad chunk size " + quoted(size_text);
        return ChunkScan::kBad;
      }
      size = size * 16 + d;
    }
    total += size;
    if (total > max_body) {
      *why = "over " + std::to_string(max_body) + " bytes";
      return ChunkScan::kTooLarge;
    }
    pos = eol + 2;
    if (size == 0) {
      if (data.size() < pos + 2) return ChunkScan::kNeedMore;
      if (data.substr(pos, 2) != "\r\n") {
        *why = "trailer fields after the last chunk are not supported";
        return ChunkScan::kBad;
      }
      *end = pos + 2;
      return ChunkScan::kDone;
    }
    if (data.size() < pos + static_cast<size_t>(size) + 2) return ChunkScan::kNeedMore;
    if (data.substr(pos + static_cast<size_t>(size), 2) != "\r\n") {
      *why = "a chunk's data is not followed by CRLF";
      return ChunkScan::kBad;
    }
    pos += static_cast<size_t>(size) + 2;
  }
}

bool client_disconnected() {
  ThreadRequest& r = t_request;
  if (r.fd < 0) return false;
  pollfd p = {r.fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  // A reset (or both directions shut): gone. A FIN is POLLRDHUP.
  if ((p.revents & (POLLERR | POLLHUP)) != 0) return true;
  if ((p.revents & POLLRDHUP) == 0) {
    // Readable without a FIN: bytes of a pipelined request; unless the peek finds the EOF.
    char byte;
    const ssize_t n = ::recv(r.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) {
      return false;
    }
    if (n < 0) return true;
  }
  // The client sent its FIN: it closed the connection, or only its sending side and still
  // reads (shutdown(SHUT_WR) after a request is legitimate HTTP). A closed socket answers data
  // with a reset, which the next call sees as POLLERR | POLLHUP: write once what the client
  // must accept anyway. Once written, the FIN alone means a half-close.
  if (r.probe_sent) return false;
  std::string probe;
  if (!r.response_started && !r.http10) {
    probe = "HTTP/1.1 100 Continue\r\n\r\n";  // an interim answer, before the response
  } else if (r.response_started && r.sse_chunked) {
    probe = "e\r\n: keep-alive\n\n\r\n";  // a chunk of 14 bytes: an SSE comment, as the API's
  } else {
    // HTTP/1.0 has no interim answers, and a body of another kind cannot take foreign bytes:
    // the FIN has to count as a disconnect.
    return true;
  }
  r.probe_sent = true;
  return !send_all(r.fd, probe, r.write_timeout);
}

HttpFrontend::HttpFrontend(HttpRouter& router, HttpFrontendOptions options, HttpRefusal refusal)
    : router_(router), options_(std::move(options)), refusal_(std::move(refusal)) {}

HttpFrontend::~HttpFrontend() { stop(); }

Result<int> HttpFrontend::start() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(options_.port);
  const std::string where = options_.host + ":" + port;
  if (const int rc = getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return Status::error("cannot bind HTTP on " + where + ": " + gai_strerror(rc));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, options_.backlog) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
  }
  freeaddrinfo(found);
  if (listen_fd_ < 0) return Status::error("cannot bind HTTP on " + where + ": " + why);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  const int bound = ntohs(addr.ss_family == AF_INET6
                              ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::error(std::string("eventfd: ") + std::strerror(errno));
  router_.set_listening(listen_fd_);
  acceptor_ = std::thread([this] { accept_loop(); });
  rejecter_ = std::thread([this] { reject_loop(); });
  return bound;
}

void HttpFrontend::stop() {
  if (listen_fd_ < 0 || stopping_.exchange(true)) return;
  router_.set_listening(-1);  // streams in progress end at their next write
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) < 0) spdlog::warn("HTTP: cannot wake the front end");
  // Taking the lock orders stopping_ before any worker's next look at it: none waits forever.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
  if (acceptor_.joinable()) acceptor_.join();
  if (rejecter_.joinable()) rejecter_.join();
  // Workers see stopping_ under the lock, so none leaves workers_ for exited_ after this swap.
  std::list<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers.swap(workers_);
  }
  for (auto& t : workers) t.join();
  join_exited_workers();
  ::close(listen_fd_);
  ::close(wake_fd_);
}

void HttpFrontend::join_exited_workers() {
  std::vector<std::thread> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(exited_);
  }
  // Each has left its loop; joining waits at most for it to release the lock and return.
  for (auto& t : done) t.join();
}

void HttpFrontend::release(Slot& slot) {
  --open_;
  auto it = per_client_.find(slot.ip);
  if (it != per_client_.end() && --it->second <= 0) per_client_.erase(it);
}

bool HttpFrontend::evict_idle(const std::string* ip) {
  Slot* oldest = nullptr;
  for (Slot& s : slots_) {
    if (s.idle && !s.evicted && (ip == nullptr || s.ip == *ip) &&
        (oldest == nullptr || s.idle_since < oldest->idle_since)) {
      oldest = &s;
    }
  }
  if (oldest == nullptr) return false;
  // Its worker, waiting for the next request, wakes to the EOF and closes it; the descriptor
  // stays open until that worker has removed the slot (under this lock), so it is this
  // connection's. The client sees an idle keep-alive connection closed, which HTTP clients
  // expect and answer by opening another when they next need one.
  oldest->evicted = true;
  oldest->idle = false;
  if (::shutdown(oldest->fd, SHUT_RDWR) != 0 && errno != ENOTCONN) {
    spdlog::warn("HTTP: closing an idle connection: {}", std::strerror(errno));
  }
  release(*oldest);
  spdlog::debug("HTTP: closed an idle keep-alive connection of {} to make room", oldest->ip);
  return true;
}

std::string HttpFrontend::admit(const std::string& ip) {
  const int per_client = options_.client.max_connections_per_client;
  const auto mine = per_client_.find(ip);
  if (per_client > 0 && mine != per_client_.end() && mine->second >= per_client &&
      !evict_idle(&ip)) {
    return "too many connections from " + (ip.empty() ? std::string("this client") : ip) +
           ": this server serves at most " + std::to_string(per_client) +
           " at once from one client (--http-max-connections-per-client); retry";
  }
  if (open_ >= options_.max_connections && !evict_idle(nullptr)) {
    return "too many connections: this server serves at most " +
           std::to_string(options_.max_connections) +
           " at once (--http-max-connections); retry";
  }
  return "";
}

bool HttpFrontend::set_idle(SlotRef slot, bool idle) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot->evicted) return false;
  slot->idle = idle;
  if (idle) slot->idle_since = Clock::now();
  return true;
}

void HttpFrontend::accept_loop() {
  while (!stopping_) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) break;
    if (p[1].revents != 0) break;
    if (p[0].revents == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the connection stays in the backlog until one frees up.
        spdlog::warn("HTTP accept: {}", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      continue;
    }
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // SSE tokens go out at once
    int port = -1;
    const std::string ip = peer_address(fd, &port);
    std::unique_lock<std::mutex> lock(mu_);
    std::string why = admit(ip);
    if (why.empty()) {
      const SlotRef slot = slots_.insert(slots_.end(), Slot{fd, ip, false, {}, false});
      ++open_;
      ++per_client_[ip];
      // A connection holds its worker for its whole life (a stream runs on it); the limits
      // bound both, so a worker is started whenever none is idle.
      if (idle_workers_ <= static_cast<int>(pending_.size())) {
        const WorkerRef worker = workers_.emplace(workers_.end());
        try {
          // The new thread waits for the lock held here before it looks at `worker`.
          *worker = std::thread([this, worker] { worker_loop(worker); });
          ++idle_workers_;
        } catch (const std::system_error& e) {
          workers_.erase(worker);
          release(*slot);
          slots_.erase(slot);
          why = std::string("no thread for another connection (") + e.what() + "); retry";
        }
      }
      if (why.empty()) {
        pending_.push_back(slot);
        cv_.notify_one();
        continue;
      }
    }
    lock.unlock();
    refuse(fd, 503, why, ip);
  }
}

void HttpFrontend::worker_loop(WorkerRef self) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!cv_.wait_for(lock, kWorkerIdleExit, [&] { return stopping_ || !pending_.empty(); })) {
      // Idle for kWorkerIdleExit: beyond the warm few, the thread ends (reject_loop joins it).
      if (idle_workers_ > kWarmWorkers) {
        --idle_workers_;
        exited_.push_back(std::move(*self));
        workers_.erase(self);
        return;
      }
      continue;
    }
    if (pending_.empty()) break;  // stopping
    const SlotRef slot = pending_.front();
    pending_.pop_front();
    --idle_workers_;
    lock.unlock();
    serve(slot);
    lock.lock();
    ++idle_workers_;
  }
}

void HttpFrontend::refuse(int fd, int status, const std::string& message,
                          const std::string& client) {
  // A fresh socket's send buffer takes the short answer at once: the accept loop never waits.
  const std::string response = canned_response(status, refusal_(status, message, client));
  send_all(fd, response, std::chrono::milliseconds(0));
  shutdown(fd, SHUT_WR);
  std::lock_guard<std::mutex> lock(mu_);
  if (rejected_.size() + lingering_ >= kMaxLingering) {
    ::close(fd);
    return;
  }
  rejected_.push_back(fd);
}

void HttpFrontend::reject_loop() {
  // Refused connections, each kept until its client's EOF or kLinger. This loop also joins the
  // worker threads that ended (it wakes every 50 ms).
  std::vector<std::pair<int, Clock::time_point>> open;
  std::vector<pollfd> p;
  while (!stopping_ || !open.empty()) {
    join_exited_workers();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : rejected_) open.emplace_back(fd, Clock::now() + kLinger);
      rejected_.clear();
    }
    p.assign(1, {wake_fd_, POLLIN, 0});
    for (const auto& [fd, t] : open) p.push_back({fd, POLLIN, 0});
    poll(p.data(), p.size(), 50);
    std::vector<std::pair<int, Clock::time_point>> keep;
    for (size_t i = 0; i < open.size(); ++i) {
      bool done = stopping_ || Clock::now() >= open[i].second;
      if (!done && p[i + 1].revents != 0) {
        char sink[4096];
        const ssize_t n = ::recv(open[i].first, sink, sizeof(sink), MSG_DONTWAIT);
        done = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
      }
      if (done) {
        ::close(open[i].first);
      } else {
        keep.push_back(open[i]);
      }
    }
    open.swap(keep);
    lingering_ = open.size();
    if (stopping_ && open.empty()) break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (int fd : rejected_) ::close(fd);
  rejected_.clear();
}

// One client connection of a worker thread: the bytes received and not yet served (pipelined
// requests wait there) and the deadline of what it waits for.
class HttpFrontend::Connection {
 public:
  Connection(HttpFrontend& frontend, SlotRef slot) : f_(frontend), slot_(slot), fd_(slot->fd) {
    ip_ = peer_address(fd_, &port_);
  }

  // Serves requests in order until the client closes, a limit or a refusal ends the connection.
  void run() {
    // A connection's first request has header_timeout from the accept; later ones may idle
    // kKeepAliveIdle before their first byte, then have header_timeout.
    deadline_ = Clock::now() + f_.options_.header_timeout;
    for (int served = 0; served < kRequestsPerConnection && !f_.stopping_; ++served) {
      if (served > 0 && in_.empty()) {
        deadline_ = Clock::now() + HttpFrontend::kKeepAliveIdle;
        idle_ = true;
        // From now on the accept loop may close this connection to make room for another.
        if (!f_.set_idle(slot_, true)) return;
      }
      size_t head_end = 0;
      cors_.clear();
      if (!read_head(head_end)) return;
      const RequestHead head = parse_request_head(std::string_view(in_).substr(0, head_end + 4));
      if (head.status != 0) return refuse(head.status, head.message);
      const CorsPolicy& cors = f_.options_.client.cors;
      cors_ = cors_headers(cors, head.origin);
      if (head.content_length > f_.options_.max_body_bytes) {
        return refuse(413, "the request body (" + std::to_string(head.content_length) +
                               " bytes) is over the size limit (" +
                               std::to_string(f_.options_.max_body_bytes) + " bytes)");
      }
      size_t body_at = head.head_bytes, body_bytes = 0;
      if (!read_body(head, body_at, body_bytes)) return;
      const size_t request_bytes = body_at + body_bytes;
      const bool last = served + 1 >= kRequestsPerConnection || f_.stopping_;
      if (cors.enabled() && head.method == "OPTIONS" && !head.origin.empty() &&
          !head.cors_method.empty()) {
        // A CORS preflight: answered here, before cpp-httplib's routes and the API key check
        // (a browser sends no Authorization on a preflight, only on the request it asks for).
        in_.erase(0, request_bytes);
        if (!answer_preflight(cors, head, last || head.close)) return;
        continue;
      }
      bool closed = false;
      OneRequestStream stream(fd_, std::string_view(in_).substr(0, request_bytes),
                              f_.options_.write_timeout, ip_, port_, cors_);
      t_request = ThreadRequest{fd_, head.http10, false, false, false, f_.options_.write_timeout};
      const bool ok = f_.router_.process_request(stream, last, closed, nullptr);
      t_request = ThreadRequest{};
      in_.erase(0, request_bytes);
      if (in_.capacity() > kMaxHeadBytes && in_.size() < kMaxHeadBytes) in_.shrink_to_fit();
      if (!ok || closed || last) return;
    }
  }

 private:
  // Reads more bytes until the deadline: false on EOF, timeout, stop or error (*timed_out says
  // which).
  bool receive(bool* timed_out) {
    *timed_out = false;
    const int r = wait_readable(fd_, f_.wake_fd_, deadline_);
    if (r == 0) {
      *timed_out = !f_.stopping_;
      return false;
    }
    if (r < 0) return false;
    char buf[64 * 1024];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    if (n <= 0) return false;
    in_.append(buf, static_cast<size_t>(n));
    return true;
  }

  // A preflight's answer: 204 with the grants, or 400 naming what is not allowed (as vLLM's
  // Starlette answers; then close). False when the connection is done.
  bool answer_preflight(const CorsPolicy& cors, const RequestHead& head, bool close) {
    std::string why;
    const std::string grants = preflight_grants(cors, head, &why);
    if (!why.empty()) {
      cors_.clear();  // a refused preflight carries no grant
      refuse(400, why);
      return false;
    }
    // A 204 has no body and no Content-Length (RFC 9110 8.6).
    const std::string response = "HTTP/1.1 204 No Content\r\n" + grants +
                                 (close ? "Connection: close\r\n" : "") + "\r\n";
    spdlog::debug("HTTP: CORS preflight from {} ({} {}) allowed", ip_, head.cors_method,
                  head.origin);
    return send_all(fd_, response, f_.options_.write_timeout) && !close;
  }

  void refuse(int status, const std::string& message) {
    send_all(fd_, canned_response(status, f_.refusal_(status, message, ip_), cors_),
             f_.options_.write_timeout);
    shutdown(fd_, SHUT_WR);
    // Waits briefly for the client's EOF so that unread bytes do not reset the connection.
    deadline_ = Clock::now() + kLinger;
    bool t = false;
    in_.clear();
    while (receive(&t)) in_.clear();
  }

  // Until in_ holds a whole request head, ending at head_end ("\r\n\r\n" there). False when
  // the connection is done (closed, timed out or refused).
  bool read_head(size_t& head_end) {
    size_t scanned = 0;  // bytes of in_ already searched (a head may arrive a byte at a time)
    bool timed_out = false;
    for (;;) {
      // Empty lines before a request line are ignored (RFC 9112 2.2: some clients send a CRLF
      // after a body).
      if (scanned == 0) {
        while (in_.compare(0, 2, "\r\n") == 0) in_.erase(0, 2);
      }
      head_end = in_.find("\r\n\r\n", scanned < 3 ? 0 : scanned - 3);
      const size_t head_size = head_end == std::string::npos ? in_.size() : head_end + 4;
      if (head_size > kMaxHeadBytes) {
        refuse(431, "the request head is over " + std::to_string(kMaxHeadBytes) + " bytes");
        return false;
      }
      if (head_end != std::string::npos) return true;
      // A head with a bare LF never ends in CRLF CRLF: refused now, not after the deadline.
      for (size_t i = scanned; i < in_.size(); ++i) {
        if (in_[i] == '\n' && (i == 0 || in_[i - 1] != '\r')) {
          refuse(400, "a bare LF in the request head (lines must end with CRLF)");
          return false;
        }
      }
      scanned = in_.size();
      if (!receive(&timed_out)) {
        // An idle keep-alive connection simply closes; a started request is told why.
        if (timed_out && !(idle_ && in_.empty())) {
          refuse(408, "the request head did not arrive within " +
                          std::to_string(f_.options_.header_timeout.count()) +
                          " ms (--http-header-timeout-ms)");
        }
        return false;
      }
      if (idle_) {
        idle_ = false;
        deadline_ = Clock::now() + f_.options_.header_timeout;
        if (!f_.set_idle(slot_, false)) return false;  // closed to make room meanwhile
      }
    }
  }

  // Until in_ holds the whole body after the head (body_at: where it starts; body_bytes: its
  // size as sent, chunked framing included). Leaves out an Expect line (cpp-httplib would answer
  // it a second time). False when the connection is done.
  bool read_body(const RequestHead& head, size_t& body_at, size_t& body_bytes) {
    const bool has_body = head.chunked || head.content_length > 0;
    if (head.expect_continue && has_body && in_.size() == body_at) {
      send_all(fd_, "HTTP/1.1 100 Continue\r\n\r\n", f_.options_.write_timeout);
    }
    deadline_ = Clock::now() + f_.options_.body_timeout;
    if (!head.chunked) in_.reserve(body_at + static_cast<size_t>(head.content_length));
    bool timed_out = false;
    for (;;) {
      if (head.chunked) {
        std::string why;
        const ChunkScan s = scan_chunked_body(std::string_view(in_).substr(body_at),
                                              f_.options_.max_body_bytes, &body_bytes, &why);
        if (s == ChunkScan::kBad) {
          refuse(400, "malformed chunked body: " + why);
          return false;
        }
        if (s == ChunkScan::kTooLarge) {
          refuse(413, "the request body is over the size limit (" +
                          std::to_string(f_.options_.max_body_bytes) + " bytes)");
          return false;
        }
        if (s == ChunkScan::kDone) break;
      } else {
        body_bytes = static_cast<size_t>(head.content_length);
        if (in_.size() >= body_at + body_bytes) break;
      }
      if (!receive(&timed_out)) {
        if (timed_out) {
          refuse(408, "the request body did not arrive within " +
                          std::to_string(f_.options_.body_timeout.count()) +
                          " ms (--http-body-timeout-ms)");
        }
        return false;
      }
    }
    if (head.expect_continue) {
      in_.erase(head.expect_begin, head.expect_end - head.expect_begin);
      body_at -= head.expect_end - head.expect_begin;
    }
    return true;
  }

  HttpFrontend& f_;
  const SlotRef slot_;
  const int fd_;
  std::string ip_;
  int port_ = -1;
  std::string in_;  // bytes received and not yet served
  Clock::time_point deadline_;
  bool idle_ = false;  // waiting for a keep-alive connection's next request
  std::string cors_;   // the CORS header lines of the current request's answers
};

void HttpFrontend::serve(SlotRef slot) {
  Connection(*this, slot).run();
  int fd = -1;
  {
    // The slot goes before the descriptor is closed: evict_idle() never sees a closed (and
    // perhaps reused) descriptor.
    std::lock_guard<std::mutex> lock(mu_);
    if (!slot->evicted) release(*slot);
    fd = slot->fd;
    slots_.erase(slot);
  }
  ::close(fd);
}

}  // namespace burst::server
