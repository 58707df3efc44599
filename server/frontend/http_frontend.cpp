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
thread_local int t_connection_fd = -1;

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
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
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

// One request's bytes for cpp-httplib: reads never go past them (so it can never take a byte
// of the next pipelined request); writes go to the socket under the write timeout.
class OneRequestStream : public httplib::Stream {
 public:
  OneRequestStream(int fd, std::string_view request, std::chrono::milliseconds write_timeout,
                   const std::string& ip, int port)
      : fd_(fd), request_(request), write_timeout_(write_timeout), ip_(ip), port_(port) {}

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
    return send_all(fd_, std::string_view(ptr, size), write_timeout_) ? static_cast<ssize_t>(size)
                                                                      : -1;
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
};

std::string canned_response(int status, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n" + (status == 503 ? "Retry-After: 1\r\n" : "") + "\r\n" +
         body;
}

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
// (Content-Length, Transfer-Encoding, Expect) into h; the counts catch repeated ones.
HeadError check_header_line(size_t i, std::string_view line, size_t offset, RequestHead& h,
                            int& content_lengths, int& transfer_encodings) {
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
  int content_lengths = 0, transfer_encodings = 0;
  size_t offset = lines[0].size() + 2;
  for (size_t i = 1; i < lines.size(); offset += lines[i].size() + 2, ++i) {
    HeadError e = check_header_line(i, lines[i], offset, h, content_lengths, transfer_encodings);
    if (e.status != 0) return bad(std::move(e));
  }
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
  const int fd = t_connection_fd;
  if (fd < 0) return false;
  pollfd p = {fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLERR | POLLHUP | POLLRDHUP)) != 0) return true;
  // Readable: bytes of a pipelined request, or the EOF of a closed connection.
  char byte;
  const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
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
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    workers.swap(workers_);
  }
  for (auto& t : workers) t.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
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
    if (active_.load() >= options_.max_connections) {
      refuse(fd, 503, "too many connections: this server serves at most " +
                          std::to_string(options_.max_connections) +
                          " at once (--http-max-connections); retry",
             peer_address(fd, &port));
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    // A connection holds its worker for its whole life (a stream runs on it); active_ bounds
    // both, so a worker is started whenever none is idle.
    if (idle_workers_ <= static_cast<int>(pending_.size())) {
      try {
        workers_.emplace_back([this] { worker_loop(); });
      } catch (const std::system_error& e) {
        lock.unlock();
        refuse(fd, 503, std::string("no thread for another connection (") + e.what() +
                            "); retry", peer_address(fd, &port));
        continue;
      }
      ++idle_workers_;
    }
    ++active_;
    pending_.push_back(fd);
    cv_.notify_one();
  }
}

void HttpFrontend::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
    if (pending_.empty()) break;  // stopping
    const int fd = pending_.front();
    pending_.pop_front();
    --idle_workers_;
    lock.unlock();
    serve(fd);
    ::close(fd);
    --active_;
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
  // Refused connections, each kept until its client's EOF or kLinger.
  std::vector<std::pair<int, Clock::time_point>> open;
  std::vector<pollfd> p;
  while (!stopping_ || !open.empty()) {
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
  Connection(HttpFrontend& frontend, int fd) : f_(frontend), fd_(fd) {
    ip_ = peer_address(fd, &port_);
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
      }
      size_t head_end = 0;
      if (!read_head(head_end)) return;
      const RequestHead head = parse_request_head(std::string_view(in_).substr(0, head_end + 4));
      if (head.status != 0) return refuse(head.status, head.message);
      if (head.content_length > f_.options_.max_body_bytes) {
        return refuse(413, "the request body (" + std::to_string(head.content_length) +
                               " bytes) is over the size limit (" +
                               std::to_string(f_.options_.max_body_bytes) + " bytes)");
      }
      size_t body_at = head.head_bytes, body_bytes = 0;
      if (!read_body(head, body_at, body_bytes)) return;
      const size_t request_bytes = body_at + body_bytes;
      const bool last = served + 1 >= kRequestsPerConnection || f_.stopping_;
      bool closed = false;
      OneRequestStream stream(fd_, std::string_view(in_).substr(0, request_bytes),
                              f_.options_.write_timeout, ip_, port_);
      t_connection_fd = fd_;
      const bool ok = f_.router_.process_request(stream, last, closed, nullptr);
      t_connection_fd = -1;
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

  void refuse(int status, const std::string& message) {
    send_all(fd_, canned_response(status, f_.refusal_(status, message, ip_)),
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
  const int fd_;
  std::string ip_;
  int port_ = -1;
  std::string in_;  // bytes received and not yet served
  Clock::time_point deadline_;
  bool idle_ = false;  // waiting for a keep-alive connection's next request
};

void HttpFrontend::serve(int fd) { Connection(*this, fd).run(); }

}  // namespace burst::server
