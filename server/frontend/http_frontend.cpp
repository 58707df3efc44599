#include "frontend/http_frontend.h"

#include "http_head.h"

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


int ms_until(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
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

}  // namespace


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
