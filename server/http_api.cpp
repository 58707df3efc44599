#include "server/http_api.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

namespace burst::server {

using nlohmann::json;

namespace {

// A request the client got wrong (or the server cannot serve), thrown inside this file only:
// every handler runs under guarded(), which turns it into an OpenAI-style error response.
struct HttpError {
  int status;
  std::string message;
  std::string code = {};  // OpenAI "code" (e.g. "model_not_found"); empty: null
  std::string param = {};
};

const char* error_type(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
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

json error_body(int status, const std::string& message, const std::string& code = "",
                const std::string& param = "") {
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

void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& code = "", const std::string& param = "") {
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

// Typed access to optional request fields: absent or null means "use the default"; a value of
// the wrong type is a 400 naming the field.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void bad_field(const char* name, const char* want) {
  throw HttpError{400, std::string("'") + name + "' must be " + want, "", name};
}

double get_number(const json& body, const char* name, double dflt) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_number()) bad_field(name, "a number");
  return v->get<double>();
}

int64_t get_int(const json& body, const char* name, int64_t dflt) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_number_integer()) bad_field(name, "an integer");
  return v->get<int64_t>();
}

bool get_bool(const json& body, const char* name, bool dflt) {
  const json* v = field(body, name);
  if (!v) return dflt;
  if (!v->is_boolean()) bad_field(name, "a boolean");
  return v->get<bool>();
}

json parse_body(const httplib::Request& req) {
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::exception& e) {
    throw HttpError{400, std::string("the body is not valid JSON: ") + e.what()};
  }
  if (!body.is_object()) throw HttpError{400, "the body must be a JSON object"};
  return body;
}

std::vector<int32_t> encode_or_throw(const Tokenizer& tok, const std::string& text, bool bos) {
  auto ids = tok.encode(text, bos, false);
  if (!ids.ok()) throw HttpError{400, "the prompt is not valid UTF-8: " + ids.message(), "", "prompt"};
  return {ids.value().begin(), ids.value().end()};
}

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// What both OpenAI endpoints share: the model check, sampling, max_tokens, stop, streaming.
struct CommonParams {
  ScheduledRequest request;
  bool stream = false;
  bool include_usage = false;
  bool max_tokens_given = false;
};

CommonParams parse_common(const json& body, const std::string& model_name) {
  CommonParams p;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad_field("model", "a string");
    if (m->get<std::string>() != model_name) {
      throw HttpError{404, "The model '" + m->get<std::string>() + "' does not exist; this "
                      "server serves '" + model_name + "'", "model_not_found", "model"};
    }
  }
  if (get_int(body, "n", 1) != 1) throw HttpError{400, "only n = 1 is supported", "", "n"};
  auto& s = p.request.sampling;
  s.temperature = static_cast<float>(get_number(body, "temperature", 1.0));
  if (s.temperature < 0) throw HttpError{400, "'temperature' must be >= 0", "", "temperature"};
  s.top_p = static_cast<float>(get_number(body, "top_p", 1.0));
  if (!(s.top_p > 0 && s.top_p <= 1)) {
    throw HttpError{400, "'top_p' must be in (0, 1]", "", "top_p"};
  }
  const int64_t top_k = get_int(body, "top_k", 0);
  if (top_k < 0 && top_k != -1) throw HttpError{400, "'top_k' must be >= 0", "", "top_k"};
  s.top_k = top_k < 0 ? 0 : static_cast<int>(std::min<int64_t>(top_k, 1 << 30));
  const json* seed = field(body, "seed");
  s.seed = seed ? static_cast<uint64_t>(get_int(body, "seed", 0)) : std::random_device{}();
  const json* mt = field(body, "max_tokens");
  if (!mt) mt = field(body, "max_completion_tokens");
  if (mt) {
    if (!mt->is_number_integer()) bad_field("max_tokens", "an integer");
    const int64_t v = mt->get<int64_t>();
    if (v <= 0) throw HttpError{400, "'max_tokens' must be > 0", "", "max_tokens"};
    p.request.max_tokens = static_cast<int>(std::min<int64_t>(v, 1LL << 30));
    p.max_tokens_given = true;
  }
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      p.request.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array() && stop->size() <= 4) {
      for (const auto& s1 : *stop) {
        if (!s1.is_string()) bad_field("stop", "a string or an array of up to 4 strings");
        p.request.stop.push_back(s1.get<std::string>());
      }
    } else {
      bad_field("stop", "a string or an array of up to 4 strings");
    }
    for (const auto& s1 : p.request.stop) {
      if (s1.empty()) throw HttpError{400, "stop strings must not be empty", "", "stop"};
    }
  }
  p.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_field("stream_options", "an object");
    p.include_usage = get_bool(*so, "include_usage", false);
  }
  p.request.return_progress = get_bool(body, "return_progress", false);
  return p;
}

json usage_json(const FinishInfo& f) {
  return {{"prompt_tokens", f.prompt_tokens},
          {"completion_tokens", f.completion_tokens},
          {"total_tokens", f.prompt_tokens + f.completion_tokens}};
}

// burst's own timing numbers, beside OpenAI's usage (clients ignore unknown fields).
json timings_json(const FinishInfo& f) {
  return {{"queue_ms", f.queue_ms},
          {"prefill_ms", f.prefill_ms},
          {"ttft_ms", f.ttft_ms},
          {"decode_tokens_per_s", f.decode_tokens_per_s}};
}

json finish_reason_json(const std::string& r) {
  return r == "cancelled" ? json(nullptr) : json(r);
}

// Shared by the SSE provider and its releaser; touched by one httplib worker thread at a time.
struct SseState {
  std::shared_ptr<RequestStream> stream;
  bool chat = false;
  bool include_usage = false;
  std::string id, model;
  int64_t created = 0;
  bool finished = false;
};

json chunk(const SseState& st, json choice) {
  json j = {{"id", st.id},
            {"object", st.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", st.created},
            {"model", st.model},
            {"choices", json::array({std::move(choice)})}};
  if (st.include_usage) j["usage"] = nullptr;
  return j;
}

json choice_json(const SseState& st, const std::string& text, const json& finish) {
  if (st.chat) {
    json delta = json::object();
    if (!text.empty()) delta["content"] = text;
    return {{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", finish}};
  }
  return {{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

// The SSE text for one event (empty: nothing to send). Sets st.finished at the end.
std::string render_event(SseState& st, const Event& ev) {
  switch (ev.kind) {
    case Event::Kind::kStarted:
      if (!st.chat) return "";
      return sse(chunk(st, {{"index", 0},
                            {"delta", {{"role", "assistant"}, {"content", ""}}},
                            {"logprobs", nullptr},
                            {"finish_reason", nullptr}}));
    case Event::Kind::kProgress:
      // A named event: OpenAI SDKs skip events they do not know, so progress never breaks them.
      return "event: progress\ndata: " +
             dump({{"object", "progress"}, {"id", st.id}, {"prefilled_fraction", ev.fraction}}) +
             "\n\n";
    case Event::Kind::kToken:
      if (ev.text.empty()) return "";
      return sse(chunk(st, choice_json(st, ev.text, nullptr)));
    case Event::Kind::kFinished: {
      st.finished = true;
      std::string out = sse(chunk(st, choice_json(st, "", finish_reason_json(ev.finish.reason))));
      if (st.include_usage) {
        json u = chunk(st, nullptr);
        u["choices"] = json::array();
        u["usage"] = usage_json(ev.finish);
        u["timings"] = timings_json(ev.finish);
        out += sse(u);
      }
      return out + "data: [DONE]\n\n";
    }
    case Event::Kind::kError: {
      st.finished = true;
      const int status = http_status(ev.error.code);
      return sse(error_body(status, ev.error.message)) + "data: [DONE]\n\n";
    }
  }
  return "";
}

}  // namespace

Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents) {
  std::vector<std::string> r = roles, c = contents;
  if (r.empty()) return Status::error("'messages' must not be empty");
  if (r[0] == "system") {
    if (r.size() < 2) return Status::error("a system message must be followed by a user message");
    c[1] = "<<SYS>>\n" + c[0] + "\n<</SYS>>\n\n" + c[1];
    r.erase(r.begin());
    c.erase(c.begin());
  }
  for (size_t i = 0; i < r.size(); ++i) {
    const char* want = i % 2 == 0 ? "user" : "assistant";
    if (r[i] != want) {
      return Status::error("messages must alternate user and assistant (after an optional "
                           "system message); message " + std::to_string(i) + " is '" + r[i] +
                           "'");
    }
  }
  if (r.back() != "user") return Status::error("the last message must be from the user");
  std::vector<int32_t> ids;
  auto append = [&](const std::string& text, bool eos) -> Status {
    auto e = tok.encode(text, true, eos);
    if (!e.ok()) return Status::error("a message is not valid UTF-8: " + e.message());
    ids.insert(ids.end(), e.value().begin(), e.value().end());
    return {};
  };
  for (size_t i = 0; i + 1 < r.size(); i += 2) {
    BURST_RETURN_IF_ERROR(
        append("[INST] " + trim(c[i]) + " [/INST] " + trim(c[i + 1]) + " ", true));
  }
  BURST_RETURN_IF_ERROR(append("[INST] " + trim(c.back()) + " [/INST]", false));
  return ids;
}

HttpApi::HttpApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer,
                 Metrics& metrics)
    : config_(config), scheduler_(scheduler), tokenizer_(tokenizer), metrics_(metrics),
      server_(std::make_unique<httplib::Server>()) {
  install_routes();
}

HttpApi::~HttpApi() { stop(); }

Result<int> HttpApi::start() {
  int port = config_.http_port;
  if (port == 0) {
    port = server_->bind_to_any_port(config_.host);
    if (port < 0) return Status::error("cannot bind HTTP on " + config_.host);
  } else if (!server_->bind_to_port(config_.host, port)) {
    return Status::error("cannot bind HTTP on " + config_.host + ":" + std::to_string(port));
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  return port;
}

void HttpApi::stop() {
  if (thread_.joinable()) {
    server_->stop();
    thread_.join();
  }
}

void HttpApi::install_routes() {
  httplib::Server& s = *server_;
  // Streams hold a thread each for their whole life; a large pool keeps /health and /metrics
  // answering while many clients stream (requests beyond it wait for a free thread).
  s.new_task_queue = [] { return new httplib::ThreadPool(128); };
  s.set_payload_max_length(static_cast<size_t>(config_.max_body_bytes));
  s.set_read_timeout(30, 0);
  s.set_write_timeout(30, 0);

  // Fills in the body of errors cpp-httplib produces itself (404 route, 413 body size, 400).
  s.set_error_handler(httplib::Server::HandlerWithResponse(
      [](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg = "HTTP " + std::to_string(res.status);
    if (res.status == 404) msg = "no route " + req.method + " " + req.path;
    if (res.status == 413) msg = "the request body is over the size limit";
    send_json(res, res.status, error_body(res.status, msg));
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res,
                             std::exception_ptr) {
    send_error(res, 500, "internal error");
  });
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (config_.api_key.empty() || req.path == "/health" || req.path == "/metrics") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    const std::string auth = req.get_header_value("Authorization");
    if (auth != "Bearer " + config_.api_key) {
      send_error(res, 401,
                 auth.empty() ? "missing API key (Authorization: Bearer KEY)" : "wrong API key",
                 "invalid_api_key");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  using Fn = std::function<void(const httplib::Request&, httplib::Response&)>;
  auto guarded = [](Fn fn) {
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
  };

  s.Get("/health", guarded([this](const httplib::Request&, httplib::Response& res) {
    const std::string waiting = scheduler_.waiting_status();
    const char* state = scheduler_.draining() ? "draining"
                        : scheduler_.healthy() ? "ok"
                        : !waiting.empty() ? "waiting"
                        : metrics_.worker_restarts > 0 ? "unhealthy"
                                                       : "loading";
    json body = {{"status", state}};
    if (!waiting.empty() && !scheduler_.draining()) body["message"] = waiting;
    send_json(res, std::string(state) == "ok" ? 200 : 503, body);
  }));
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
  s.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
    const json body = parse_body(req);
    const json* text = field(body, "prompt");
    if (!text) text = field(body, "text");
    if (!text || !text->is_string()) bad_field("prompt", "a string");
    const bool special = get_bool(body, "add_special_tokens", true);
    const auto ids = encode_or_throw(tokenizer_, text->get<std::string>(), special);
    send_json(res, 200, {{"tokens", ids},
                         {"count", ids.size()},
                         {"max_model_len", scheduler_.max_context()}});
  }));

  // Both OpenAI endpoints: build the request, submit, then stream or collect.
  auto serve = [this](const httplib::Request& req, httplib::Response& res, bool chat) {
    const json body = parse_body(req);
    CommonParams p = parse_common(body, config_.model_name);
    std::vector<int32_t>& prompt = p.request.prompt;
    if (chat) {
      const json* msgs = field(body, "messages");
      if (!msgs || !msgs->is_array()) bad_field("messages", "an array of messages");
      std::vector<std::string> roles, contents;
      for (const auto& m : *msgs) {
        if (!m.is_object()) bad_field("messages", "an array of {role, content} objects");
        const json* role = field(m, "role");
        const json* content = field(m, "content");
        if (!role || !role->is_string()) bad_field("messages", "objects with a string 'role'");
        std::string text;
        if (content && content->is_string()) {
          text = content->get<std::string>();
        } else if (content && content->is_array()) {
          // The multi-part form: only text parts exist for this model.
          for (const auto& part : *content) {
            const json* t = part.is_object() ? field(part, "text") : nullptr;
            if (!t || !t->is_string()) bad_field("messages", "text content parts");
            text += t->get<std::string>();
          }
        } else {
          bad_field("messages", "objects with a string 'content'");
        }
        roles.push_back(role->get<std::string>());
        contents.push_back(std::move(text));
      }
      auto ids = apply_llama2_chat_template(tokenizer_, roles, contents);
      if (!ids.ok()) throw HttpError{400, ids.message(), "", "messages"};
      prompt = ids.take();
    } else {
      const json* pr = field(body, "prompt");
      if (!pr) throw HttpError{400, "'prompt' is required", "", "prompt"};
      const json* one = pr;
      if (pr->is_array() && !pr->empty() && !(*pr)[0].is_number_integer()) {
        // A batch ([string] or [[ids]]): one prompt per request here.
        if (pr->size() != 1) throw HttpError{400, "only one prompt per request", "", "prompt"};
        one = &(*pr)[0];
      }
      if (one->is_string()) {
        const std::string text = one->get<std::string>();
        if (text.empty()) throw HttpError{400, "the prompt is empty", "", "prompt"};
        prompt = encode_or_throw(tokenizer_, text, true);
      } else if (one->is_array()) {
        for (const auto& id : *one) {
          if (!id.is_number_integer()) bad_field("prompt", "a string or an array of token ids");
          const int64_t v = id.get<int64_t>();
          prompt.push_back(v < INT32_MIN || v > INT32_MAX ? -1 : static_cast<int32_t>(v));
        }
        if (prompt.empty()) throw HttpError{400, "the prompt is empty", "", "prompt"};
      } else {
        bad_field("prompt", "a string or an array of token ids");
      }
    }
    if (!p.max_tokens_given) {
      // OpenAI's defaults: 16 for completions, "until done" for chat; both bounded by what is
      // left of the KV capacity, so a default never makes a fitting prompt fail.
      const int64_t room = scheduler_.kv_capacity() - static_cast<int64_t>(prompt.size());
      const int64_t want = chat ? scheduler_.max_tokens_limit() : 16;
      p.request.max_tokens = static_cast<int>(std::max<int64_t>(1, std::min(want, room)));
    }
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    p.request.id = id;
    ApiError err;
    auto stream = scheduler_.submit(std::move(p.request), &err);
    if (!stream) {
      send_error(res, http_status(err.code), err.message);
      return;
    }
    if (p.stream) {
      auto st = std::make_shared<SseState>();
      st->stream = stream;
      st->chat = chat;
      st->include_usage = p.include_usage;
      st->id = id;
      st->model = config_.model_name;
      st->created = unix_now();
      const auto keepalive = std::chrono::milliseconds(config_.keepalive_ms);
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream",
          [st, keepalive](size_t, httplib::DataSink& sink) {
            if (st->finished) {
              sink.done();
              return true;
            }
            // Blocks at most one keep-alive interval: a comment line keeps proxies and clients
            // from timing out during a long prefill, and a failed write detects a gone client.
            auto ev = st->stream->next(keepalive);
            const std::string out = ev ? render_event(*st, *ev) : ": keep-alive\n\n";
            if (!out.empty() && !sink.write(out.data(), out.size())) {
              st->stream->cancel();
              return false;
            }
            if (st->finished) sink.done();
            return true;
          },
          [st](bool) {
            if (!st->finished) st->stream->cancel();
          });
      return;
    }
    std::string text;
    for (;;) {
      auto ev = stream->next(std::chrono::milliseconds(1000));
      if (!ev) continue;
      if (ev->kind == Event::Kind::kToken) text += ev->text;
      if (ev->kind == Event::Kind::kError) {
        send_error(res, http_status(ev->error.code), ev->error.message);
        return;
      }
      if (ev->kind != Event::Kind::kFinished) continue;
      json choice = {{"index", 0},
                     {"logprobs", nullptr},
                     {"finish_reason", finish_reason_json(ev->finish.reason)}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
      } else {
        choice["text"] = text;
      }
      send_json(res, 200,
                {{"id", id},
                 {"object", chat ? "chat.completion" : "text_completion"},
                 {"created", unix_now()},
                 {"model", config_.model_name},
                 {"choices", json::array({choice})},
                 {"usage", usage_json(ev->finish)},
                 {"timings", timings_json(ev->finish)}});
      return;
    }
  };
  s.Post("/v1/completions", guarded([serve](const httplib::Request& req,
                                            httplib::Response& res) { serve(req, res, false); }));
  s.Post("/v1/chat/completions",
         guarded([serve](const httplib::Request& req, httplib::Response& res) {
           serve(req, res, true);
         }));
}

}  // namespace burst::server
