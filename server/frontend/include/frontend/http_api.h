// The HTTP API (cpp-httplib): OpenAI-compatible POST /v1/completions and
// /v1/chat/completions (LLaMA-2 chat template), streaming (SSE: data: {...} chunks, keep-alive
// comments while no token is ready, optional `event: progress` events, data: [DONE]) or not;
// GET /v1/models, GET /health (503 while loading, unhealthy or draining), POST /tokenize, GET
// /metrics (Prometheus). Every error is an OpenAI-style object {"error": {"message", "type",
// "param", "code"}} with 400/401/404/413/503/500. A client that disconnects cancels its request
// (a stream at its next write, a non-streaming request within 100 ms). Handlers catch
// everything: no exception reaches cpp-httplib. Connections, deadlines and framing belong to
// HttpFrontend (http_frontend.h); cpp-httplib parses and routes each request it is handed.
#pragma once

#include <memory>
#include <string>

#include "frontend/metrics.h"
#include "frontend/scheduler.h"
#include "frontend/server_config.h"
#include "common/tokenizer.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace burst::server {

class HttpRouter;
class HttpFrontend;

class HttpApi {
 public:
  HttpApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer,
          Metrics& metrics);
  ~HttpApi();
  // Binds config.host:config.http_port (0: any free port) and serves on background threads.
  Result<int> start();
  // Stops listening and waits for the handlers in progress.
  void stop();
  // The OpenAI-style error body for a refusal the front end writes itself (over the connection
  // limit, a timeout, bad framing), counted and access-logged like any error response.
  std::string refusal(int status, const std::string& message, const std::string& client);

 private:
  void install_routes();  // the hooks, then every route
  void install_probe_routes();  // /health, /ping, /metrics, /v1/models, /version
  void install_hooks();   // error bodies, request ids, the API key check, the access log
  // POST /v1/completions (chat false) and /v1/chat/completions: parse, submit every choice,
  // then stream or collect them.
  void serve(const httplib::Request& req, httplib::Response& res, bool chat);
  // Refuses text over the prompt byte limit before the tokenizer spends time on it (throws the
  // 413 the handlers turn into a response).
  void check_prompt_text(size_t bytes, const char* param) const;

  const ServerConfig& config_;
  Scheduler& scheduler_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  std::unique_ptr<HttpRouter> server_;
  std::unique_ptr<HttpFrontend> frontend_;
};


}  // namespace burst::server
