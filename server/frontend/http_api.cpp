// HttpApi (frontend/http_api.h): the routes, the hooks (error bodies, request ids, the API
// key, the access log) and the errors; request parsing is in http_request.cpp, responses in
// http_response.cpp (http_internal.h joins them).
#include "frontend/http_api.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "common/auth.h"
#include "common/logging.h"
#include "frontend/http_frontend.h"
#include "http_internal.h"

namespace burst::server {

namespace httpapi {

const char* error_type(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "invalid_request_error";
    case 413: return "request_too_large";
    case 415: return "invalid_request_error";
    case 408: return "timeout";
    case 499: return "client_disconnected";
    case 503: return "service_unavailable";
    default: return "server_error";
  }
}

int http_status(ErrorCode c) {
  switch (c) {
    case ErrorCode::kInvalidArgument: return 400;
    case ErrorCode::kUnauthenticated: return 401;
    case ErrorCode::kNotFound: return 404;
    case ErrorCode::kTooLarge: return 413;
    case ErrorCode::kUnavailable: return 503;
    case ErrorCode::kInternal: return 500;
  }
  return 500;
}

json error_body(int status, const std::string& message, const std::string& code,
                const std::string& param) {
  json e = {{"message", message},
            {"type", error_type(status)},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return {{"error", e}};
}

// Generated text is valid UTF-8 (StreamDecoder guarantees it), but dump() must never throw.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

AccessInfo& access_info() {
  static thread_local AccessInfo a;
  return a;
}

// Starts the access record of a new request on this thread.
AccessInfo& begin_access() {
  AccessInfo& a = access_info();
  a = AccessInfo{};
  a.start = std::chrono::steady_clock::now();
  a.started = true;
  return a;
}

std::string fmt_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", ms);
  return buf;
}

void note_finish(const FinishInfo& f) {
  AccessInfo& a = access_info();
  a.prompt_tokens = f.prompt_tokens;
  a.completion_tokens = f.completion_tokens;
  a.finish = runtime::finish_reason_name(f.reason);
}

// The access-log line of the request on this thread (then forgotten): text, or a JSON record.
void write_access_log(const std::string& method, const std::string& path, int status,
                      const std::string& client) {
  AccessInfo& a = access_info();
  const double ms = a.started ? std::chrono::duration<double, std::milli>(
                                    std::chrono::steady_clock::now() - a.start).count()
                              : 0.0;
  std::string line = "access " + method + " " + path + " " + std::to_string(status) + " " +
                     fmt_ms(ms) + " ms request_id=" + (a.started ? a.id : "-") +
                     " client=" + client;
  if (a.prompt_tokens >= 0) {
    line += " prompt_tokens=" + std::to_string(a.prompt_tokens) +
            " completion_tokens=" + std::to_string(a.completion_tokens) +
            " finish=" + (a.finish.empty() ? "-" : a.finish);
  }
  if (!a.error.empty()) line += " error=" + json_quote(a.error);
  std::string fields = "\"method\":" + json_quote(method) + ",\"path\":" + json_quote(path) +
                       ",\"status\":" + std::to_string(status) + ",\"latency_ms\":" +
                       fmt_ms(ms) + ",\"request_id\":" + json_quote(a.started ? a.id : "-") +
                       ",\"client\":" + json_quote(client);
  if (a.prompt_tokens >= 0) {
    fields += ",\"prompt_tokens\":" + std::to_string(a.prompt_tokens) +
              ",\"completion_tokens\":" + std::to_string(a.completion_tokens) +
              ",\"finish\":" + json_quote(a.finish);
  }
  if (!a.error.empty()) fields += ",\"error\":" + json_quote(a.error);
  // Probes and scrapes come every few seconds (and /health is 503 while loading): debug
  // level (--log-level debug shows them).
  const int level = path == "/health" || path == "/metrics" ? SPDLOG_LEVEL_DEBUG
                    : status >= 500                        ? SPDLOG_LEVEL_WARN
                                                           : SPDLOG_LEVEL_INFO;
  log_access(level, line, fields);
  a = AccessInfo{};
}

void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& code, const std::string& param) {
  access_info().error = message.substr(0, 200);
  if (status == 503) res.set_header("Retry-After", "1");
  send_json(res, status, error_body(status, message, code, param));
}

std::string random_id(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return std::string(prefix) + buf;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace httpapi

using httpapi::access_info;
using httpapi::AccessInfo;
using httpapi::bad_field;
using httpapi::begin_access;
using httpapi::chat_prompts;
using httpapi::check_response_size;
using httpapi::CheckText;
using httpapi::CommonParams;
using httpapi::completion_prompts;
using httpapi::dump;
using httpapi::encode_or_throw;
using httpapi::error_body;
using httpapi::field;
using httpapi::get_bool;
using httpapi::http_status;
using httpapi::HttpError;
using httpapi::is_json_type;
using httpapi::json;
using httpapi::parse_body;
using httpapi::parse_common;
using httpapi::Prompts;
using httpapi::random_id;
using httpapi::respond;
using httpapi::send_error;
using httpapi::send_json;
using httpapi::unsupported_type_message;
using httpapi::write_access_log;

HttpApi::HttpApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer,
                 Metrics& metrics)
    : config_(config), scheduler_(scheduler), tokenizer_(tokenizer), metrics_(metrics),
      server_(std::make_unique<HttpRouter>()) {
  install_routes();
}

HttpApi::~HttpApi() { stop(); }

Result<int> HttpApi::start() {
  HttpFrontendOptions o;
  o.host = config_.host;
  o.port = config_.http_port;
  o.backlog = config_.http_backlog;
  o.max_connections = config_.http_max_connections;
  o.header_timeout = std::chrono::milliseconds(config_.http_header_timeout_ms);
  o.body_timeout = std::chrono::milliseconds(config_.http_body_timeout_ms);
  o.max_body_bytes = config_.max_body_bytes;
  o.client.max_connections_per_client = config_.http_max_connections_per_client;
  // CORS from the config's lists (validated with the config, so these parse).
  Status cors_error;
  auto cors_list = [&](const std::string& text, const char* key) {
    auto list = parse_cors_list(text, key);
    if (!list.ok()) cors_error = list.status();
    return list.ok() ? list.take() : std::vector<std::string>{};
  };
  o.client.cors.origins = cors_list(config_.allowed_origins, "allowed_origins");
  o.client.cors.methods = cors_list(config_.allowed_methods, "allowed_methods");
  o.client.cors.headers = cors_list(config_.allowed_headers, "allowed_headers");
  o.client.cors.credentials = config_.allow_credentials == 1;
  if (!cors_error.ok()) return cors_error;
  frontend_ = std::make_unique<HttpFrontend>(
      *server_, o, [this](int status, const std::string& message, const std::string& client) {
        return refusal(status, message, client);
      });
  return frontend_->start();
}

void HttpApi::stop() {
  if (frontend_) frontend_->stop();
}

std::string HttpApi::refusal(int status, const std::string& message, const std::string& client) {
  metrics_.count_http_error(status);
  AccessInfo& a = begin_access();
  a.id = random_id("req-");
  a.error = message.substr(0, 200);
  write_access_log("-", "-", status, client);
  return dump(error_body(status, message));
}

void HttpApi::check_prompt_text(size_t bytes, const char* param) const {
  if (auto e = scheduler_.check_prompt_text(bytes)) {
    throw HttpError{http_status(e->code), e->message, "", param};
  }
}

namespace {

// The methods each path of install_routes() takes (HEAD: cpp-httplib answers it for a GET
// route), for the Allow header of a 405; nullptr for a path with no route.
const char* allowed_methods(const std::string& path) {
  static const std::pair<const char*, const char*> kRoutes[] = {
      {"/health", "GET, HEAD"},          {"/ping", "GET, HEAD, POST"},
      {"/metrics", "GET, HEAD"},         {"/v1/models", "GET, HEAD"},
      {"/version", "GET, HEAD"},         {"/detokenize", "POST"},
      {"/tokenize", "POST"},             {"/v1/completions", "POST"},
      {"/v1/chat/completions", "POST"},
  };
  for (const auto& [p, methods] : kRoutes) {
    if (path == p) return methods;
  }
  if (path.rfind("/v1/models/", 0) == 0 && path.size() > 11) return "GET, HEAD";
  return nullptr;
}

}  // namespace

namespace {

using Fn = std::function<void(const httplib::Request&, httplib::Response&)>;

// No exception reaches cpp-httplib: HttpError is the response it names, anything else a 500.
Fn guarded(Fn fn) {
  return [fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
    try {
      fn(req, res);
    } catch (const HttpError& e) {
      send_error(res, e.status, e.message, e.code, e.param);
    } catch (const std::exception& e) {
      spdlog::error("HTTP {} {}: {}", req.method, req.path, e.what());
      send_error(res, 500, std::string("internal error: ") + e.what());
    } catch (...) {
      send_error(res, 500, "internal error");
    }
  };
}

}  // namespace

void HttpApi::install_probe_routes() {
  httplib::Server& s = *server_;
  // /ping is /health under the name vLLM and SageMaker probe (GET or POST).
  const Fn health = guarded([this](const httplib::Request&, httplib::Response& res) {
    const std::string waiting = scheduler_.waiting_status();
    const char* state = scheduler_.draining() ? "draining"
                        : scheduler_.healthy() ? "ok"
                        : !waiting.empty() ? "waiting"
                        : metrics_.worker_restarts > 0 ? "unhealthy"
                                                       : "loading";
    json body = {{"status", state}};
    if (!waiting.empty() && !scheduler_.draining()) body["message"] = waiting;
    if (const Scheduler::Loading l = scheduler_.loading();
        !scheduler_.healthy() && !scheduler_.draining() && waiting.empty()) {
      // A group starting (first start or restart): how far the ranks' weights have loaded.
      body["loaded_fraction"] =
          l.total > 0 ? static_cast<double>(l.done) / static_cast<double>(l.total) : 0.0;
      body["message"] = l.total > 0 ? "loading the model: " + bytes_progress(l.done, l.total)
                                    : std::string("starting the workers");
    }
    send_json(res, std::string(state) == "ok" ? 200 : 503, body);
  });
  s.Get("/health", health);
  s.Get("/ping", health);
  s.Post("/ping", health);
  s.Get("/metrics", guarded([this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4; charset=utf-8");
  }));
  s.Get("/v1/models", guarded([this](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", config_.model_name},
              {"object", "model"},
              {"created", 0},
              {"owned_by", "burst"},
              {"max_model_len", scheduler_.max_context()}};
    send_json(res, 200, {{"object", "list"}, {"data", json::array({m})}});
  }));
  s.Get(R"(/v1/models/(.+))", guarded([this](const httplib::Request& req,
                                             httplib::Response& res) {
    const std::string want = req.matches[1];
    if (want != config_.model_name) {
      throw HttpError{404, "The model '" + want + "' does not exist; this server serves '" +
                               config_.model_name + "'", "model_not_found", "model"};
    }
    send_json(res, 200, {{"id", config_.model_name},
                         {"object", "model"},
                         {"created", 0},
                         {"owned_by", "burst"},
                         {"max_model_len", scheduler_.max_context()}});
  }));
  s.Get("/version", guarded([](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"version", kVersion}, {"build", version_string("burst-server")}});
  }));
}

void HttpApi::install_routes() {
  install_hooks();
  install_probe_routes();
  httplib::Server& s = *server_;
  s.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    const json* ids = field(body, "tokens");
    if (!ids || !ids->is_array()) bad_field("tokens", "an array of token ids");
    std::vector<int> v;
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() >= scheduler_.vocab_size()) {
        throw HttpError{400, "'tokens' must hold token ids in [0, " +
                                 std::to_string(scheduler_.vocab_size()) + ")", "", "tokens"};
      }
      v.push_back(static_cast<int>(id.get<int64_t>()));
    }
    send_json(res, 200, {{"prompt", tokenizer_.decode(v)}});
  }));
  s.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    const json* text = field(body, "prompt");
    if (!text) text = field(body, "text");
    if (!text || !text->is_string()) bad_field("prompt", "a string");
    const bool special = get_bool(body, "add_special_tokens", true);
    check_prompt_text(text->get<std::string>().size(), "prompt");
    const auto ids = encode_or_throw(tokenizer_, text->get<std::string>(), special);
    send_json(res, 200, {{"tokens", ids},
                         {"count", ids.size()},
                         {"max_model_len", scheduler_.max_context()}});
  }));
  s.Post("/v1/completions", guarded([this](const httplib::Request& req,
                                           httplib::Response& res) { serve(req, res, false); }));
  s.Post("/v1/chat/completions",
         guarded([this](const httplib::Request& req, httplib::Response& res) {
           serve(req, res, true);
         }));
}

void HttpApi::install_hooks() {
  httplib::Server& s = *server_;
  // Sockets, threads and timeouts are HttpFrontend's; cpp-httplib reads a request from memory.
  s.set_payload_max_length(static_cast<size_t>(config_.max_body_bytes));
  s.set_keep_alive_timeout(HttpFrontend::kKeepAliveIdle.count() / 1000);
  s.set_keep_alive_max_count(HttpFrontend::kRequestsPerConnection);

  // Fills in the body of errors cpp-httplib produces itself (404 route, 413 body size, 400).
  // cpp-httplib parses an application/x-www-form-urlencoded body (what `curl -d` sends without
  // -H) as a form and refuses one over 8 KB with 413: the real fault is the type, so 415.
  s.set_error_handler(httplib::Server::HandlerWithResponse(
      [this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg = "HTTP " + std::to_string(res.status);
    if (res.status == 404) {
      msg = "no route " + req.method + " " + req.path;
      if (const char* allow = allowed_methods(req.path)) {
        // A known path asked with another method: 405 and the methods it takes.
        res.status = 405;
        res.set_header("Allow", allow);
        msg = "method " + req.method + " is not allowed on " + req.path + " (Allow: " + allow +
              ")";
      }
    }
    if (res.status == 413) {
      msg = "the request body is over the size limit (" +
            std::to_string(config_.max_body_bytes) + " bytes)";
      const std::string type = req.get_header_value("Content-Type");
      if (req.has_header("Content-Type") && !is_json_type(type)) {
        res.status = 415;
        msg = unsupported_type_message(type);
      }
    }
    access_info().error = msg;
    send_json(res, res.status, error_body(res.status, msg));
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res,
                             std::exception_ptr) {
    send_error(res, 500, "internal error");
  });
  // Every request gets an id (the client's X-Request-Id, else a fresh one), returned in the
  // X-Request-Id header and written with its status, route and latency to the access log. The
  // whole exchange runs on one httplib thread: the id and timing live in a thread_local.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    AccessInfo& a = begin_access();
    a.id = req.get_header_value("X-Request-Id");
    // A client's id is taken when it is short printable ASCII (it goes into headers and logs).
    const bool printable = std::all_of(a.id.begin(), a.id.end(),
                                       [](char ch) { return ch > 0x20 && ch < 0x7f; });
    if (a.id.empty() || a.id.size() > 200 || !printable) a.id = random_id("req-");
    // Probes and scrapers answer without the key by default (docs/reliability.md: they tell
    // liveness and load, not prompts); --metrics-require-key 1 puts /metrics behind it.
    if (config_.api_key.empty() || req.path == "/health" || req.path == "/ping" ||
        (req.path == "/metrics" && config_.metrics_require_key == 0)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    const std::string auth = req.get_header_value("Authorization");
    if (!token_equal("Bearer " + config_.api_key, auth)) {
      send_error(res, 401,
                 auth.empty() ? "missing API key (Authorization: Bearer KEY)" : "wrong API key",
                 "invalid_api_key");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  s.set_post_routing_handler([](const httplib::Request&, httplib::Response& res) {
    const AccessInfo& a = access_info();
    if (a.started) res.set_header("X-Request-Id", a.id);
  });
  s.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    if (res.status >= 400) metrics_.count_http_error(res.status);
    write_access_log(req.method, req.path, res.status, req.remote_addr);
  });
}

void HttpApi::serve(const httplib::Request& req, httplib::Response& res, bool chat) {
  const json body = parse_body(req);
  CommonParams p = parse_common(body, config_.model_name, chat, scheduler_.vocab_size());
  const CheckText check = [this](size_t bytes, const char* param) {
    check_prompt_text(bytes, param);
  };
  const Prompts prompts =
      chat ? chat_prompts(body, tokenizer_, check, p)
           : completion_prompts(body, p, tokenizer_, scheduler_.max_context(),
                                scheduler_.vocab_size(), scheduler_.max_prompt_bytes(), check);
  if (!p.max_tokens_given) {
    // OpenAI's defaults: 16 for completions, "until done" for chat; both bounded by what is
    // left of the KV capacity, so a default never makes a fitting prompt fail.
    size_t longest = 0;
    for (const auto& pr : prompts.ids) longest = std::max(longest, pr.size());
    p.request.max_tokens = scheduler_.default_max_tokens(
        static_cast<int64_t>(longest), chat ? scheduler_.max_tokens_limit() : 16);
  }
  if (auto e = check_min_tokens(p)) throw HttpError{400, e->message, "", e->param};
  check_response_size(p, prompts, config_.max_response_bytes);
  respond(res, scheduler_, tokenizer_, p, prompts, chat, config_.model_name,
          std::chrono::milliseconds(config_.keepalive_ms));
}

}  // namespace burst::server
