// The HTTP API (cpp-httplib): OpenAI-compatible POST /v1/completions and
// /v1/chat/completions (LLaMA-2 chat template), streaming (SSE: data: {...} chunks, keep-alive
// comments while no token is ready, optional `event: progress` events, data: [DONE]) or not;
// GET /v1/models, GET /health (503 while loading, unhealthy or draining), POST /tokenize, GET
// /metrics (Prometheus). Every error is an OpenAI-style object {"error": {"message", "type",
// "param", "code"}} with 400/401/404/413/503/500. A client that disconnects mid-stream cancels
// its request at the next token. Handlers catch everything: no exception reaches cpp-httplib.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "server/metrics.h"
#include "server/scheduler.h"
#include "server/server_config.h"
#include "server/tokenizer.h"

namespace httplib {
class Server;
}

namespace burst::server {

class HttpApi {
 public:
  HttpApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer,
          Metrics& metrics);
  ~HttpApi();
  // Binds config.host:config.http_port (0: any free port) and serves on a background thread.
  Result<int> start();
  // Stops listening and waits for the handlers in progress.
  void stop();

 private:
  void install_routes();

  const ServerConfig& config_;
  Scheduler& scheduler_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
};

// The LLaMA-2 chat template (Meta's reference `chat_completion`): an optional system message
// folded into the first user turn as <<SYS>>...<</SYS>>, each finished (user, assistant) pair as
// BOS "[INST] user [/INST] assistant " EOS, and the final user turn as BOS "[INST] user [/INST]".
// roles/contents are parallel; the error says what is wrong with the conversation.
Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents);

}  // namespace burst::server
