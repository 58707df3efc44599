// The HTTP connection layer in front of cpp-httplib's parser and router: burst owns the
// listening socket, the connections and their deadlines; cpp-httplib (Debian's 0.11.4, a
// compiled library) only parses a request it is handed whole and writes the response.
//
// Why not cpp-httplib's own listen loop (docs/architecture.md, "The HTTP front end"): its listen
// backlog is compiled into the library (5: bursts of connections were reset), its read timeout
// applies to each recv (a client sending a header byte every few seconds held a thread forever),
// it starts a fresh stream per keep-alive request (the second of two pipelined requests was
// lost), it accepts Content-Length with chunked encoding and header lines without a colon, and
// its connection queue is unbounded.
//
// The contract here:
// - listen(backlog) with --http-backlog (the kernel caps it at net.core.somaxconn);
// - at most max_connections connections; one more is answered 503 (the API's error body,
//   Connection: close) at once, without reading it;
// - a request's head must arrive within header_timeout of its first byte (of the accept, for a
//   connection's first request), its body within body_timeout of its head: else 408 and close;
//   between keep-alive requests a connection may idle kKeepAliveIdle;
// - strict framing (parse_request_head): CRLF line ends, a colon on every header line, no
//   whitespace before it, no line folding, at most one Content-Length (digits only), never
//   together with Transfer-Encoding, only "chunked" as a transfer coding: else 400 (501 for
//   another coding, 413 for a body over max_body_bytes, 431 for an oversized head), then close;
// - pipelining: requests are served in order, each handed to cpp-httplib as exactly its own
//   bytes; what follows stays buffered for the next one;
// - client_disconnected(): whether the client of the request handled on this thread has gone
//   (handlers poll it while they wait for an event; a stream also learns it from a failed write).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engine/status.h"

namespace burst::server {

// cpp-httplib's Server with its request processing reachable: the front end hands it each
// request through process_request(), and never calls its listen().
class HttpRouter : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // cpp-httplib ends a chunked response (an SSE stream) when its listening socket is invalid,
  // i.e. once the server stops; the front end's socket stands for it while it serves.
  void set_listening(int fd) { svr_sock_ = fd; }
};

struct HttpFrontendOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  int backlog = 1024;
  int max_connections = 512;
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds body_timeout{30000};
  std::chrono::milliseconds write_timeout{30000};
  int64_t max_body_bytes = 8 << 20;
};

// What the front end writes when it refuses a request itself: `respond` returns the body
// (application/json) for a status and message and writes the access-log line.
using HttpRefusal =
    std::function<std::string(int status, const std::string& message, const std::string& client)>;

// A request head checked for framing (see the contract above).
struct RequestHead {
  int status = 0;          // 0: valid; else the refusal's HTTP status
  std::string message;     // why it was refused
  size_t head_bytes = 0;   // request line + headers + the blank line
  int64_t content_length = 0;
  bool chunked = false;
  bool expect_continue = false;           // "Expect: 100-continue"
  size_t expect_begin = 0, expect_end = 0;  // that header line's bytes in the head
};

// `head` is a request's bytes up to and including the first CRLF CRLF.
RequestHead parse_request_head(std::string_view head);

// Where a chunked body starting at data[0] ends: kDone sets *end (bytes of the body, the last
// chunk and its CRLF included); kBad and kTooLarge set *why.
enum class ChunkScan { kNeedMore, kDone, kBad, kTooLarge };
ChunkScan scan_chunked_body(std::string_view data, int64_t max_body, size_t* end,
                            std::string* why);

// True when the client of the request being handled on the calling thread has closed its
// connection (or shut down its sending side). False outside a request.
bool client_disconnected();

class HttpFrontend {
 public:
  // Between keep-alive requests a connection may idle this long; after this many requests it
  // is closed (Connection: close on the last response). cpp-httplib's Keep-Alive header says so.
  static constexpr std::chrono::milliseconds kKeepAliveIdle{5000};
  static constexpr int kRequestsPerConnection = 100;

  HttpFrontend(HttpRouter& router, HttpFrontendOptions options, HttpRefusal refusal);
  ~HttpFrontend();
  HttpFrontend(const HttpFrontend&) = delete;
  HttpFrontend& operator=(const HttpFrontend&) = delete;

  // Binds, listens and starts accepting; returns the port.
  Result<int> start();
  // Stops accepting, wakes idle connections (closed), lets requests in progress finish, joins.
  void stop();

 private:
  void accept_loop();
  void worker_loop();
  void reject_loop();
  class Connection;  // one client connection's requests, in order (http_frontend.cpp)
  void serve(int fd);
  void refuse(int fd, int status, const std::string& message, const std::string& client);

  HttpRouter& router_;
  const HttpFrontendOptions options_;
  const HttpRefusal refusal_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: readable once stop() begins; every wait polls it
  std::atomic<bool> stopping_{false};
  std::atomic<int> active_{0};
  std::thread acceptor_, rejecter_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> pending_;     // accepted connections waiting for a worker
  std::vector<std::thread> workers_;
  int idle_workers_ = 0;
  std::deque<int> rejected_;    // over the limit: 503 written, for reject_loop()
  std::atomic<size_t> lingering_{0};  // refused connections reject_loop() waits on
};

}  // namespace burst::server
