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
// - at most max_connections_per_client connections from one peer address; when a limit (that
//   one or max_connections) is reached, the connection idle longest between keep-alive
//   requests is closed to make room (the client reopens it when it needs it: every HTTP client
//   does), and only when none idles is the newcomer refused 503;
// - worker threads are started as connections come and leave after kWorkerIdleExit without
//   one, so the pool shrinks back when load goes (a few stay warm);
// - CORS (off unless origins are configured): a preflight (OPTIONS with Origin and
//   Access-Control-Request-Method) is answered here, 204 for an allowed origin, method and
//   headers, 400 otherwise, before any route or API key check (browsers send no credentials on
//   a preflight); every response to an allowed origin, streams and errors included, carries
//   Access-Control-Allow-Origin; a disallowed origin's get no CORS header, so the browser
//   keeps the answer from the page;
// - client_disconnected(): whether the client of the request handled on this thread has gone
//   (handlers poll it while they wait for an event; a stream also learns it from a failed write).
//   A client that only shut down its sending side (half-close) has not gone: it still reads.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
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

// Cross-origin requests from browsers (the Fetch standard's CORS protocol). Names as vLLM's
// --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials.
struct CorsPolicy {
  std::vector<std::string> origins;  // empty: CORS off (no CORS header ever); "*": any origin
  std::vector<std::string> methods = {"*"};  // "*": any method a preflight asks for
  std::vector<std::string> headers = {"*"};  // "*": any request header a preflight asks for
  bool credentials = false;  // Access-Control-Allow-Credentials: true (the origin echoed, not *)
  bool enabled() const { return !origins.empty(); }
};

// What the front end allows each client: connections per peer address and CORS.
struct HttpClientPolicy {
  int max_connections_per_client = 256;  // 0: no limit per client
  CorsPolicy cors;
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
  HttpClientPolicy client;
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
  bool http10 = false;                    // an HTTP/1.0 request (no interim 1xx answers)
  bool close = false;                     // "Connection: close" (HTTP/1.0: no keep-alive)
  // What CORS needs: the method, Origin, and a preflight's Access-Control-Request-Method and
  // Access-Control-Request-Headers (empty when absent).
  std::string method, origin, cors_method, cors_headers;
};

// `head` is a request's bytes up to and including the first CRLF CRLF.
RequestHead parse_request_head(std::string_view head);

// Where a chunked body starting at data[0] ends: kDone sets *end (bytes of the body, the last
// chunk and its CRLF included); kBad and kTooLarge set *why.
enum class ChunkScan { kNeedMore, kDone, kBad, kTooLarge };
ChunkScan scan_chunked_body(std::string_view data, int64_t max_body, size_t* end,
                            std::string* why);

// True when the client of the request being handled on the calling thread has gone: its
// connection was reset, or it closed it. A FIN alone cannot tell a close from a half-close
// (shutdown(SHUT_WR) after sending the request, still reading): the first time one is seen,
// bytes the client must accept are written (an interim "100 Continue" before the response, a
// ": keep-alive" comment chunk in an SSE stream), which a closed socket answers with a reset
// that a later call sees. Where nothing can be written safely (an HTTP/1.0 request, a response
// of another kind under way) a FIN counts as gone. False outside a request.
bool client_disconnected();

class HttpFrontend {
 public:
  using Clock = std::chrono::steady_clock;
  // Between keep-alive requests a connection may idle this long; after this many requests it
  // is closed (Connection: close on the last response). cpp-httplib's Keep-Alive header says so.
  static constexpr std::chrono::milliseconds kKeepAliveIdle{5000};
  static constexpr int kRequestsPerConnection = 100;
  // A worker thread with no connection for this long ends, unless it is one of the
  // kWarmWorkers kept for the next burst: threads cost memory and a scheduling slot each.
  static constexpr std::chrono::milliseconds kWorkerIdleExit{2000};
  static constexpr int kWarmWorkers = 4;

  HttpFrontend(HttpRouter& router, HttpFrontendOptions options, HttpRefusal refusal);
  ~HttpFrontend();
  HttpFrontend(const HttpFrontend&) = delete;
  HttpFrontend& operator=(const HttpFrontend&) = delete;

  // Binds, listens and starts accepting; returns the port.
  Result<int> start();
  // Stops accepting, wakes idle connections (closed), lets requests in progress finish, joins.
  void stop();

 private:
  // An open connection (under mu_): its peer, and whether it idles between keep-alive requests
  // (then the accept loop may close it to make room for another).
  struct Slot {
    int fd;
    std::string ip;
    bool idle = false;
    Clock::time_point idle_since;
    bool evicted = false;  // closed to make room: no longer counted
  };
  using SlotRef = std::list<Slot>::iterator;
  using WorkerRef = std::list<std::thread>::iterator;

  void accept_loop();
  void worker_loop(WorkerRef self);
  void reject_loop();
  void join_exited_workers();
  // Under mu_: "" when a connection from `ip` may open (closing idle ones to make room), else
  // why not.
  std::string admit(const std::string& ip);
  // Under mu_: closes the connection idle longest (of `ip`'s, when given); false if none idles.
  bool evict_idle(const std::string* ip);
  void release(Slot& slot);  // under mu_: the slot no longer counts toward the limits
  // Marks a connection idle or busy; false when it was closed to make room meanwhile.
  bool set_idle(SlotRef slot, bool idle);
  class Connection;  // one client connection's requests, in order (http_frontend.cpp)
  void serve(SlotRef slot);
  void refuse(int fd, int status, const std::string& message, const std::string& client);

  HttpRouter& router_;
  const HttpFrontendOptions options_;
  const HttpRefusal refusal_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd: readable once stop() begins; every wait polls it
  std::atomic<bool> stopping_{false};
  std::thread acceptor_, rejecter_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Slot> slots_;  // every open connection
  int open_ = 0;           // slots that count toward max_connections (not evicted)
  std::unordered_map<std::string, int> per_client_;  // the same, per peer address
  std::deque<SlotRef> pending_;  // accepted connections waiting for a worker
  std::list<std::thread> workers_;
  std::vector<std::thread> exited_;  // workers that ended (idle too long), to be joined
  int idle_workers_ = 0;
  std::deque<int> rejected_;    // over the limit: 503 written, for reject_loop()
  std::atomic<size_t> lingering_{0};  // refused connections reject_loop() waits on
};

}  // namespace burst::server
