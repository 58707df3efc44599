#include "frontend/http_api.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "common/auth.h"
#include "common/chat_template.h"
#include "frontend/http_frontend.h"
#include "frontend/request_options.h"
#include "common/logging.h"

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

// What the access-log line of the request on this thread says beyond status and route.
struct AccessInfo {
  bool started = false;
  std::chrono::steady_clock::time_point start;
  std::string id;
  int64_t prompt_tokens = -1, completion_tokens = 0;  // -1: no generation
  std::string finish;
  std::string error;
};

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
                const std::string& code = "", const std::string& param = "") {
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

// Typed access to optional request fields: absent or null means "use the default"; a value of
// the wrong type is a 400 naming the field.
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

[[noreturn]] void bad_field(const char* name, const char* want) {
  throw HttpError{400, std::string("'") + name + "' must be " + want, "", name};
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

// application/json, application/*+json (parameters such as charset allowed). A request without
// a Content-Type is read as JSON (hand-written clients); any other type is refused with 415.
bool is_json_type(const std::string& content_type) {
  std::string t = content_type.substr(0, content_type.find(';'));
  t.erase(0, t.find_first_not_of(" \t"));
  t.erase(t.find_last_not_of(" \t") + 1);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "application/json") return true;
  return t.rfind("application/", 0) == 0 && t.size() > 5 && t.compare(t.size() - 5, 5, "+json") == 0;
}

std::string unsupported_type_message(const std::string& content_type) {
  return "Content-Type '" + content_type + "' is not supported: send the body as JSON with "
         "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')";
}

json parse_body(const httplib::Request& req) {
  if (req.has_header("Content-Type") && !is_json_type(req.get_header_value("Content-Type"))) {
    throw HttpError{415, unsupported_type_message(req.get_header_value("Content-Type"))};
  }
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

Endpoint endpoint_of(bool chat) { return chat ? kChat : kCompletions; }

// The parameters each endpoint understands: the request options' table's and HTTP's own.
// Anything else is refused with a 400 naming it: a parameter that is accepted must do what it
// says, never be silently ignored.
const std::set<std::string>& known_keys(bool chat) {
  static const auto keys = [](bool is_chat) {
    std::set<std::string> k = {"model", "n", "stream", "stream_options", "user"};
    if (is_chat) {
      k.insert({"messages", "response_format", "tools", "tool_choice", "parallel_tool_calls",
                "functions", "function_call", "modalities", "audio", "prediction", "store",
                "reasoning_effort", "web_search_options"});
    } else {
      k.insert({"prompt", "echo", "suffix", "best_of"});
    }
    for (const OptionSpec& o : option_table()) {
      if (o.endpoints & endpoint_of(is_chat)) k.insert(o.name);
    }
    return k;
  };
  static const std::set<std::string> completions = keys(false), chat_keys = keys(true);
  return chat ? chat_keys : completions;
}

[[noreturn]] void unsupported(const std::string& name, const std::string& why) {
  throw HttpError{400, "'" + name + "' is not supported: " + why, "unsupported_parameter", name};
}

// OpenAI parameters burst knows but cannot honour: refused unless given their neutral value.
void refuse_unsupported(const json& body, bool chat) {
  for (const auto& [key, v] : body.items()) {
    if (!known_keys(chat).count(key)) {
      throw HttpError{400, "unrecognized request argument '" + key + "' (" +
                               (chat ? "/v1/chat/completions" : "/v1/completions") +
                               " does not support it)",
                      "unsupported_parameter", key};
    }
  }
  if (const json* t = field(body, "tools")) {
    if (!t->is_array()) bad_field("tools", "an array");
    if (!t->empty()) unsupported("tools", "this server has no function calling");
  }
  if (const json* t = field(body, "functions")) {
    if (!t->is_array()) bad_field("functions", "an array");
    if (!t->empty()) unsupported("functions", "this server has no function calling");
  }
  for (const char* k : {"tool_choice", "function_call"}) {
    if (const json* t = field(body, k)) {
      if (!(t->is_string() && t->get<std::string>() == "none")) {
        unsupported(k, "this server has no function calling (only \"none\")");
      }
    }
  }
  if (const json* t = field(body, "parallel_tool_calls"); t && !t->is_boolean()) {
    bad_field("parallel_tool_calls", "a boolean");
  }
  if (const json* rf = field(body, "response_format")) {
    const json* type = rf->is_object() ? field(*rf, "type") : nullptr;
    if (!type || !type->is_string()) bad_field("response_format", "an object with a 'type'");
    if (type->get<std::string>() != "text") {
      unsupported("response_format", "only {\"type\": \"text\"} (no JSON mode or schema)");
    }
  }
  if (const json* m = field(body, "modalities")) {
    if (!m->is_array()) bad_field("modalities", "an array");
    for (const auto& x : *m) {
      if (!x.is_string() || x.get<std::string>() != "text") {
        unsupported("modalities", "only [\"text\"]");
      }
    }
  }
  for (const char* k : {"audio", "prediction", "web_search_options", "reasoning_effort"}) {
    if (field(body, k)) unsupported(k, "this model has no such feature");
  }
  if (const json* st = field(body, "store")) {
    if (!st->is_boolean()) bad_field("store", "a boolean");
    if (st->get<bool>()) unsupported("store", "responses are not stored");
  }
  if (const json* u = field(body, "user"); u && !u->is_string()) bad_field("user", "a string");
  if (const json* sfx = field(body, "suffix")) {
    if (!sfx->is_string()) bad_field("suffix", "a string");
    if (!sfx->get<std::string>().empty()) unsupported("suffix", "no fill-in-the-middle");
  }
}

// Sequences one request may start (n choices of each prompt of a batch).
constexpr int64_t kMaxChoices = 64;

// What both OpenAI endpoints share: the request options' table's (ParsedOptions: the request,
// whether max_tokens and seed were given), plus HTTP's own choices and streaming.
struct CommonParams : ParsedOptions {
  int n = 1;                // choices per prompt
  int best_of = 1;          // sequences per prompt (>= n; the n most likely are returned)
  bool echo = false;        // completions: the prompt's text precedes each choice's text
  bool logprobs = false;    // the client asked for logprobs (best_of also needs them inside)
  bool stream = false;
  bool include_usage = false;
};

// A JSON value as the request options' table reads it.
RawValue raw_value(const json& v) {
  switch (v.type()) {
    case json::value_t::boolean: return RawValue::boolean(v.get<bool>());
    case json::value_t::number_integer: return RawValue::integer(v.get<int64_t>());
    case json::value_t::number_unsigned: return RawValue::unsigned_integer(v.get<uint64_t>());
    case json::value_t::number_float: return RawValue::number(v.get<double>());
    case json::value_t::string: return RawValue::string(v.get<std::string>());
    case json::value_t::array: {
      std::vector<RawValue> items;
      for (const auto& x : v) items.push_back(raw_value(x));
      return RawValue::array(std::move(items));
    }
    case json::value_t::object: {
      std::vector<std::pair<std::string, RawValue>> fields;
      for (const auto& [key, x] : v.items()) fields.emplace_back(key, raw_value(x));
      return RawValue::object(std::move(fields));
    }
    default: return {};  // null (inside an array or object: refused as the wrong type)
  }
}

// The body's values of the table's options (a null one is absent).
RawOptions raw_options(const json& body, bool chat) {
  RawOptions raw;
  for (const OptionSpec& o : option_table()) {
    if (!(o.endpoints & endpoint_of(chat))) continue;
    if (const json* v = field(body, o.name)) raw[o.name] = raw_value(*v);
  }
  return raw;
}

// model, n.
void parse_model_and_n(const json& body, const std::string& model_name, CommonParams& p) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad_field("model", "a string");
    if (m->get<std::string>() != model_name) {
      throw HttpError{404, "The model '" + m->get<std::string>() + "' does not exist; this "
                      "server serves '" + model_name + "'", "model_not_found", "model"};
    }
  }
  const int64_t n = get_int(body, "n", 1);
  if (n < 1 || n > kMaxChoices) {
    throw HttpError{400, "'n' must be in [1, " + std::to_string(kMaxChoices) + "]", "", "n"};
  }
  p.n = static_cast<int>(n);
  p.best_of = p.n;
}

// stream, stream_options.
void parse_stream(const json& body, CommonParams& p) {
  p.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_field("stream_options", "an object");
    for (const auto& [key, v] : so->items()) {
      if (key != "include_usage") unsupported("stream_options." + key, "only include_usage");
    }
    p.include_usage = get_bool(*so, "include_usage", false);
  }
}

// Completions: echo and best_of, after the options (logprobs) and stream.
void parse_echo_and_best_of(const json& body, CommonParams& p) {
  p.echo = get_bool(body, "echo", false);
  // max_tokens 0 asks for the prompt alone: its text and logprobs (lm-eval's scoring, as the
  // legacy OpenAI API and vLLM take it), which only echo returns.
  if (p.max_tokens_given && p.request.max_tokens == 0 && !p.echo) {
    throw HttpError{400, "'max_tokens' must be > 0, got 0 (0 is taken with 'echo': true only)",
                    "", "max_tokens"};
  }
  // echo with logprobs: the prompt's tokens' logprobs too, computed by every rank for its
  // shard of each prefill chunk.
  if (p.echo && p.logprobs) p.request.prompt_logprobs = p.request.logprobs;
  const int64_t best_of = get_int(body, "best_of", p.n);
  if (best_of < p.n || best_of > kMaxChoices) {
    throw HttpError{400, "'best_of' must be in [n, " + std::to_string(kMaxChoices) + "]", "",
                    "best_of"};
  }
  if (best_of > p.n && p.stream) {
    throw HttpError{400, "'best_of' > n cannot stream (the best are known at the end)", "",
                    "best_of"};
  }
  p.best_of = static_cast<int>(best_of);
  // Ranking by cumulative logprob needs each token's logprob.
  if (p.best_of > p.n && !p.logprobs) p.request.logprobs = 0;
}

CommonParams parse_common(const json& body, const std::string& model_name, bool chat,
                          int vocab_size) {
  refuse_unsupported(body, chat);
  CommonParams p;
  parse_model_and_n(body, model_name, p);
  if (auto e = parse_options(raw_options(body, chat), endpoint_of(chat), vocab_size, p)) {
    throw HttpError{400, e->message, "", e->param};
  }
  p.logprobs = p.request.logprobs >= 0;
  parse_stream(body, p);
  if (!chat) parse_echo_and_best_of(body, p);
  return p;
}

json usage_json(const FinishInfo& f) {
  return {{"prompt_tokens", f.prompt_tokens},
          {"completion_tokens", f.completion_tokens},
          {"total_tokens", f.prompt_tokens + f.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", f.cached_tokens}}}};
}

// burst's own timing numbers, beside OpenAI's usage (clients ignore unknown fields).
json timings_json(const FinishInfo& f) {
  return {{"queue_ms", f.queue_ms},
          {"prefill_ms", f.prefill_ms},
          {"ttft_ms", f.ttft_ms},
          {"decode_tokens_per_s", f.decode_tokens_per_s}};
}

// OpenAI's finish_reason: "stop", "length", or null for a request the client cancelled.
json finish_reason_json(runtime::FinishReason r) {
  return r == runtime::FinishReason::kCancelled ? json(nullptr)
                                                : json(runtime::finish_reason_name(r));
}

// A token's text as logprobs show it: the SentencePiece piece with U+2581 as a space and a
// byte piece (<0xNN>) as its byte (alone it may be half a UTF-8 character; dump() replaces it).
std::string token_text(const Tokenizer& tok, int32_t id) {
  if (id == tok.bos_id() || id == tok.eos_id()) return "";
  const std::string p = tok.piece(id);
  if (p.size() == 6 && p.rfind("<0x", 0) == 0 && p.back() == '>') {
    return std::string(1, static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
  }
  return tok.piece_text(id);
}

json token_bytes(const std::string& t) {
  json b = json::array();
  for (unsigned char c : t) b.push_back(static_cast<int>(c));
  return b;
}

// Collects the logprobs of the tokens since the last chunk, in OpenAI's shapes: chat
// {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}, completions
// {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}.
struct LogprobsAcc {
  bool chat = false;
  const Tokenizer* tok = nullptr;
  json content = json::array();
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t offset = 0;  // completions: characters of the completion before the next token
  // Completions with echo: characters the pieces hold before the echoed text (the
  // SentencePiece dummy prefix: "▁And" is " And" while the text starts "And"). text_offset
  // indexes the returned text, so they are taken off.
  size_t lead = 0;
  size_t at(size_t o) const { return o > lead ? o - lead : 0; }

  bool empty() const { return content.empty() && tokens.empty(); }
  // Completions with echo: a prompt token (no logprob for the first one: null).
  void add_prompt(int32_t id, const float* logprob, const std::vector<std::pair<int32_t, float>>& t) {
    const std::string text = token_text(*tok, id);
    json alts = json::object();
    for (const auto& [aid, lp] : t) alts[token_text(*tok, aid)] = lp;
    tokens.push_back(text);
    token_logprobs.push_back(logprob ? json(*logprob) : json(nullptr));
    top.push_back(logprob ? alts : json(nullptr));
    offsets.push_back(at(offset));
    offset += text.size();
  }
  void add_prompt_event(const Event& ev, int32_t first_token) {
    for (const auto& e : ev.prompt_logprobs) {
      if (e.pos == 1) add_prompt(first_token, nullptr, {});
      add_prompt(e.token, &e.logprob, e.top);
    }
  }
  void add(const Event& ev) {
    if (!ev.has_logprob) return;
    const std::string t = token_text(*tok, ev.token);
    if (chat) {
      json alts = json::array();
      for (const auto& [id, lp] : ev.top_logprobs) {
        const std::string at = token_text(*tok, id);
        alts.push_back({{"token", at}, {"logprob", lp}, {"bytes", token_bytes(at)}});
      }
      content.push_back({{"token", t}, {"logprob", ev.logprob}, {"bytes", token_bytes(t)},
                         {"top_logprobs", alts}});
      return;
    }
    json alts = json::object();
    for (const auto& [id, lp] : ev.top_logprobs) alts[token_text(*tok, id)] = lp;
    tokens.push_back(t);
    token_logprobs.push_back(ev.logprob);
    top.push_back(alts);
    offsets.push_back(at(offset));
    offset += t.size();
  }
  // The choice's "logprobs" value for what was collected (then forgets it).
  json take() {
    json j;
    if (chat) {
      j = {{"content", std::move(content)}};
      content = json::array();
    } else {
      j = {{"tokens", std::move(tokens)},
           {"token_logprobs", std::move(token_logprobs)},
           {"top_logprobs", std::move(top)},
           {"text_offset", std::move(offsets)}};
      tokens = token_logprobs = top = offsets = json::array();
    }
    return j;
  }
};

// One sequence of a request: choice `index` (prompt p, sample j: index p * n + j).
struct Choice {
  std::shared_ptr<RequestStream> stream;
  int index = 0;
  LogprobsAcc acc;
  bool finished = false;
  FinishInfo finish;
  std::string text;  // non-streaming: the whole text
  bool first_of_prompt = true;  // counts the prompt's tokens in usage (once per prompt)
  std::string echo;             // completions with echo: the prompt's text
  double cum_logprob = 0;       // best_of: the sum of the tokens' logprobs
  int prompt = 0;               // which prompt of a batch
  int32_t first_token = 0;      // echo with logprobs: the prompt's first id (no logprob)
  bool echo_pending = false;    // streaming echo with logprobs: sent with the prompt's logprobs
};

// Usage over the choices: the prompts once each, every choice's completion.
FinishInfo total_usage(const std::vector<Choice>& cs) {
  FinishInfo f = cs.at(0).finish;
  f.prompt_tokens = f.completion_tokens = f.cached_tokens = 0;
  for (const Choice& c : cs) {
    if (c.first_of_prompt) {
      f.prompt_tokens += c.finish.prompt_tokens;
      f.cached_tokens += c.finish.cached_tokens;
    }
    f.completion_tokens += c.finish.completion_tokens;
  }
  return f;
}

void cancel_all(std::vector<Choice>& cs) {
  for (Choice& c : cs) {
    if (!c.finished) c.stream->cancel();
  }
}

// Shared by the SSE provider and its releaser; touched by one httplib worker thread at a time.
struct SseState {
  std::vector<Choice> choices;
  bool chat = false;
  bool include_usage = false;
  bool logprobs = false;  // the request asked for them
  std::string id, model;
  int64_t created = 0;
  bool finished = false;
  size_t next = 0;  // round-robin position among the choices
};

json chunk(const SseState& st, json choice) {
  json j = {{"id", st.id},
            {"object", st.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", st.created},
            {"model", st.model},
            {"choices", choice.is_null() ? json::array() : json::array({std::move(choice)})}};
  if (st.include_usage) j["usage"] = nullptr;
  return j;
}

json choice_json(SseState& st, Choice& c, const std::string& text, const json& finish) {
  const json lp = st.logprobs && !c.acc.empty() ? c.acc.take() : json(nullptr);
  if (st.chat) {
    json delta = json::object();
    if (!text.empty()) delta["content"] = text;
    return {{"index", c.index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}};
  }
  return {{"index", c.index}, {"text", text}, {"logprobs", lp}, {"finish_reason", finish}};
}

std::string sse(const json& j) { return "data: " + dump(j) + "\n\n"; }

// Streaming echo with logprobs: the prompt's text and logprobs, once they are all in.
std::string flush_echo(SseState& st, Choice& c) {
  if (!c.echo_pending) return "";
  c.echo_pending = false;
  return sse(chunk(st, choice_json(st, c, c.echo, nullptr)));
}

// The SSE text for one event of choice c (empty: nothing to send). Sets st.finished at the end
// (every choice finished, or one failed).
std::string render_event(SseState& st, Choice& c, const Event& ev) {
  switch (ev.kind) {
    case Event::Kind::kStarted:
      if (!st.chat) {
        // With logprobs the prompt's text waits for its logprobs (they come with the prefill).
        if (c.echo.empty() || st.logprobs) {
          c.echo_pending = !c.echo.empty();
          return "";
        }
        return sse(chunk(st, choice_json(st, c, c.echo, nullptr)));
      }
      return sse(chunk(st, {{"index", c.index},
                            {"delta", {{"role", "assistant"}, {"content", ""}}},
                            {"logprobs", nullptr},
                            {"finish_reason", nullptr}}));
    case Event::Kind::kProgress: {
      // A data chunk with no choices (as the usage chunk): the SDKs' standard loop
      // (chunk.choices[0]?.delta) passes over it; the progress object is burst's extension.
      json j = chunk(st, nullptr);
      j["progress"] = {{"prefilled_fraction", ev.fraction}};
      if (st.choices.size() > 1) j["progress"]["index"] = c.index;
      return sse(j);
    }
    case Event::Kind::kPromptLogprobs:
      c.acc.add_prompt_event(ev, c.first_token);
      return "";
    case Event::Kind::kToken: {
      std::string out = flush_echo(st, c);
      if (st.logprobs) c.acc.add(ev);
      if (ev.text.empty()) return out;
      return out + sse(chunk(st, choice_json(st, c, ev.text, nullptr)));
    }
    case Event::Kind::kFinished: {
      c.finished = true;
      c.finish = ev.finish;
      std::string out = flush_echo(st, c);
      out += sse(chunk(st, choice_json(st, c, "", finish_reason_json(ev.finish.reason))));
      for (const Choice& o : st.choices) {
        if (!o.finished) return out;
      }
      st.finished = true;
      const FinishInfo total = total_usage(st.choices);
      note_finish(total);
      if (st.include_usage) {
        json u = chunk(st, nullptr);
        u["usage"] = usage_json(total);
        u["timings"] = timings_json(total);
        out += sse(u);
      }
      return out + "data: [DONE]\n\n";
    }
    case Event::Kind::kError: {
      c.finished = true;
      st.finished = true;
      cancel_all(st.choices);
      access_info().error = ev.error.message.substr(0, 200);
      const int status = http_status(ev.error.code);
      return sse(error_body(status, ev.error.message)) + "data: [DONE]\n\n";
    }
  }
  return "";
}

// The next SSE text of a stream of several choices, waiting at most `wait` (empty: nothing
// happened). One choice: blocks on it; more: polls them in turn.
// How often a handler that waits for events looks whether its client has gone.
constexpr auto kDisconnectPoll = std::chrono::milliseconds(100);

std::string next_sse(SseState& st, std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    size_t open = 0;
    for (const Choice& c : st.choices) open += c.finished ? 0 : 1;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    for (size_t k = 0; k < st.choices.size(); ++k) {
      Choice& c = st.choices[(st.next + k) % st.choices.size()];
      if (c.finished) continue;
      auto ev = c.stream->next(open == 1 ? std::max(left, std::chrono::milliseconds(0))
                                         : std::chrono::milliseconds(0));
      if (!ev) continue;
      st.next = (st.next + k + 1) % st.choices.size();
      std::string out = render_event(st, c, *ev);
      if (!out.empty() || st.finished) return out;
    }
    if (std::chrono::steady_clock::now() >= deadline) return "";
    if (open > 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace


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

namespace {

// The prompt byte limit, checked before the tokenizer runs (HttpApi::check_prompt_text).
using CheckText = std::function<void(size_t bytes, const char* param)>;

struct Prompts {
  std::vector<std::vector<int32_t>> ids = {{}};
  std::vector<std::string> echoes = {""};  // completions with echo: each prompt's text
};

// Chat: the messages (string or text-part contents) through the LLaMA-2 template: one prompt.
Prompts chat_prompts(const json& body, const Tokenizer& tok, const CheckText& check) {
  Prompts out;
  const json* msgs = field(body, "messages");
  if (!msgs || !msgs->is_array()) bad_field("messages", "an array of messages");
  std::vector<std::string> roles, contents;
  size_t text_bytes = 0;
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
    text_bytes += text.size();
    roles.push_back(role->get<std::string>());
    contents.push_back(std::move(text));
  }
  check(text_bytes, "messages");
  auto ids = apply_chat_template(tok, roles, contents);
  if (!ids.ok()) throw HttpError{400, ids.message(), "", "messages"};
  out.ids[0] = ids.take();
  return out;
}

// Completions: a string, an array of ids, or a batch of either (at most kMaxChoices sequences
// with best_of); echo keeps each prompt's text. A batch's texts together are held to
// max_prompt_bytes (0: no limit) before any is tokenized.
Prompts completion_prompts(const json& body, const CommonParams& p, const Tokenizer& tok,
                           int64_t max_context, int vocab_size, int64_t max_prompt_bytes,
                           const CheckText& check) {
  Prompts out;
  const json* pr = field(body, "prompt");
  if (!pr) throw HttpError{400, "'prompt' is required", "", "prompt"};
  // A batch ([string, ...] or [[ids], ...]) is several prompts; [ids] is one.
  std::vector<const json*> items = {pr};
  if (pr->is_array() && !pr->empty() && !(*pr)[0].is_number_integer()) {
    items.clear();
    for (const auto& one : *pr) items.push_back(&one);
  }
  if (static_cast<int64_t>(items.size()) * p.best_of > kMaxChoices) {
    throw HttpError{400, "a request may start at most " + std::to_string(kMaxChoices) +
                             " sequences (prompts x n)", "", "prompt"};
  }
  // The byte limit holds for the request as a whole: a batch of prompts each just under it
  // would otherwise cost seconds of tokenizing before any refusal. A prompt over it by itself is
  // the per-prompt refusal (413, naming its size); a batch over it in all is a 400.
  if (items.size() > 1 && max_prompt_bytes > 0) {
    size_t total = 0;
    for (const json* one : items) {
      if (!one->is_string()) continue;
      const size_t bytes = one->get_ref<const std::string&>().size();
      check(bytes, "prompt");
      total += bytes;
    }
    if (static_cast<int64_t>(total) > max_prompt_bytes) {
      throw HttpError{400, "the " + std::to_string(items.size()) + " prompts are " +
                               std::to_string(total) + " bytes of text in all, over the limit "
                               "of " + std::to_string(max_prompt_bytes) + " bytes per request "
                               "(--max-prompt-bytes); none was tokenized", "", "prompt"};
    }
  }
  out.ids.assign(items.size(), {});
  out.echoes.assign(items.size(), "");
  for (size_t i = 0; i < items.size(); ++i) {
    const json* one = items[i];
    std::vector<int32_t>& prompt = out.ids[i];
    if (one->is_string()) {
      const std::string text = one->get<std::string>();
      if (text.empty()) throw HttpError{400, "the prompt is empty", "", "prompt"};
      check(text.size(), "prompt");
      prompt = encode_or_throw(tok, text, true);
      out.echoes[i] = text;
    } else if (one->is_array()) {
      for (const auto& id : *one) {
        if (!id.is_number_integer()) bad_field("prompt", "a string or an array of token ids");
        const int64_t v = id.get<int64_t>();
        prompt.push_back(v < INT32_MIN || v > INT32_MAX ? -1 : static_cast<int32_t>(v));
      }
      if (prompt.empty()) throw HttpError{400, "the prompt is empty", "", "prompt"};
      // A prompt over the context is refused by submit(): it is not decoded for echo first.
      if (p.echo && static_cast<int64_t>(prompt.size()) <= max_context) {
        std::vector<int> ids(prompt.begin(), prompt.end());
        for (int& x : ids) x = x < 0 || x >= vocab_size ? 0 : x;
        out.echoes[i] = tok.decode(ids);
      }
    } else {
      bad_field("prompt", "a string, an array of token ids, or an array of those");
    }
  }
  return out;
}

// How many characters the prompt's pieces (as logprobs show them) hold before `echo`, the text
// returned: the dummy-prefix space of the first word.
size_t pieces_lead(const Tokenizer& tok, const std::vector<int32_t>& ids,
                   const std::string& echo) {
  std::string pieces;
  for (int32_t id : ids) {
    if (id >= 0 && id < tok.vocab_size()) pieces += token_text(tok, id);
  }
  if (pieces.size() >= echo.size() &&
      pieces.compare(pieces.size() - echo.size(), echo.size(), echo) == 0) {
    return pieces.size() - echo.size();
  }
  return !pieces.empty() && pieces[0] == ' ' && (echo.empty() || echo[0] != ' ') ? 1 : 0;
}

// Every choice (prompts x best_of) is a sequence of its own in the batch; all or none are
// admitted: on a refusal the admitted ones are cancelled and err says why.
bool submit_choices(Scheduler& sched, const Tokenizer& tok, const CommonParams& p,
                    const Prompts& prompts, bool chat, const std::string& log_id,
                    std::vector<Choice>& choices, ApiError& err) {
  // The choices share one fair share of the batch (ScheduledRequest::owner).
  static std::atomic<uint64_t> next_owner{1};
  const uint64_t owner = next_owner++;
  for (size_t pi = 0; pi < prompts.ids.size(); ++pi) {
    for (int j = 0; j < p.best_of; ++j) {
      ScheduledRequest r = p.request;
      r.prompt = prompts.ids[pi];
      r.owner = owner;
      const int index = static_cast<int>(pi) * p.best_of + j;
      r.id = choices.empty() && prompts.ids.size() * p.best_of == 1
                 ? log_id
                 : log_id + "/" + std::to_string(index);  // logs: the request id
      if (index > 0) {
        r.sampling.seed = p.seed_given ? p.request.sampling.seed + static_cast<uint64_t>(index)
                                       : std::random_device{}();
      }
      auto stream = sched.submit(std::move(r), &err);
      if (!stream) {
        cancel_all(choices);
        return false;
      }
      Choice c;
      c.stream = std::move(stream);
      c.index = index;
      c.acc.chat = chat;
      c.acc.tok = &tok;
      c.first_of_prompt = j == 0;
      c.prompt = static_cast<int>(pi);
      c.first_token = prompts.ids[pi].front();
      if (p.echo) {
        c.echo = prompts.echoes[pi];
        c.acc.lead = pieces_lead(tok, prompts.ids[pi], c.echo);
      }
      choices.push_back(std::move(c));
    }
  }
  return true;
}

// The SSE response: the provider interleaves the choices' events, sends keep-alive comments
// while none is ready, and cancels every choice if the client leaves.
void stream_choices(httplib::Response& res, std::vector<Choice> choices, const CommonParams& p,
                    bool chat, const std::string& id, const std::string& model,
                    std::chrono::milliseconds keepalive) {
  auto st = std::make_shared<SseState>();
  st->choices = std::move(choices);
  st->chat = chat;
  st->include_usage = p.include_usage;
  st->logprobs = p.logprobs;
  st->id = id;
  st->model = model;
  st->created = unix_now();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [st, keepalive](size_t, httplib::DataSink& sink) {
        if (st->finished) {
          sink.done();
          return true;
        }
        // Waits at most one keep-alive interval (a comment line then keeps proxies and
        // clients from timing out during a long prefill), in slices between which the
        // client's socket is looked at: a client that leaves while its request waits in the
        // queue or a long prefill is cancelled within ~100 ms, not at the next write.
        std::string out;
        const auto until = std::chrono::steady_clock::now() + keepalive;
        while (out.empty() && !st->finished) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              until - std::chrono::steady_clock::now());
          if (left.count() <= 0) break;
          out = next_sse(*st, std::min(left, kDisconnectPoll));
          if (out.empty() && !st->finished && client_disconnected()) {
            cancel_all(st->choices);
            return false;
          }
        }
        if (out.empty() && !st->finished) out = ": keep-alive\n\n";
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          cancel_all(st->choices);
          return false;
        }
        if (st->finished) sink.done();
        return true;
      },
      [st](bool) {
        if (!st->finished) cancel_all(st->choices);
      });
}

// The non-streaming response: every choice collected, best_of's n best per prompt, usage.
void collect_choices(httplib::Response& res, std::vector<Choice>& choices, const CommonParams& p,
                     size_t n_prompts, bool chat, const std::string& id,
                     const std::string& model) {
  // Nothing is written until the end, so a client that leaves is found by polling its socket
  // between events; its sequences are then cancelled as a departed stream's are (their KV
  // pages are freed at the next step, not after a generation nobody reads).
  auto next_poll = std::chrono::steady_clock::now() + kDisconnectPoll;
  for (Choice& c : choices) {
    while (!c.finished) {
      if (std::chrono::steady_clock::now() >= next_poll) {
        if (client_disconnected()) {
          cancel_all(choices);
          send_error(res, 499, "the client closed the connection; the request was cancelled");
          return;
        }
        next_poll = std::chrono::steady_clock::now() + kDisconnectPoll;
      }
      auto ev = c.stream->next(kDisconnectPoll);
      if (!ev) continue;
      if (ev->kind == Event::Kind::kPromptLogprobs) c.acc.add_prompt_event(*ev, c.first_token);
      if (ev->kind == Event::Kind::kToken) {
        c.text += ev->text;
        if (p.logprobs) c.acc.add(*ev);
        if (ev->has_logprob) c.cum_logprob += ev->logprob;
      }
      if (ev->kind == Event::Kind::kError) {
        c.finished = true;
        cancel_all(choices);
        send_error(res, http_status(ev->error.code), ev->error.message);
        return;
      }
      if (ev->kind == Event::Kind::kFinished) {
        c.finished = true;
        c.finish = ev->finish;
      }
    }
  }
  // best_of: per prompt, the n sequences with the highest cumulative logprob, renumbered.
  std::vector<Choice*> shown;
  for (size_t pi = 0; pi < n_prompts; ++pi) {
    std::vector<Choice*> mine;
    for (Choice& c : choices) {
      if (c.prompt == static_cast<int>(pi)) mine.push_back(&c);
    }
    if (p.best_of > p.n) {
      std::stable_sort(mine.begin(), mine.end(), [](const Choice* a, const Choice* b) {
        return a->cum_logprob > b->cum_logprob;
      });
    }
    for (size_t j = 0; j < static_cast<size_t>(p.n) && j < mine.size(); ++j) {
      mine[j]->index = static_cast<int>(pi) * p.n + static_cast<int>(j);
      shown.push_back(mine[j]);
    }
  }
  json out_choices = json::array();
  for (Choice* cp : shown) {
    Choice& c = *cp;
    json choice = {{"index", c.index},
                   {"logprobs", p.logprobs ? c.acc.take() : json(nullptr)},
                   {"finish_reason", finish_reason_json(c.finish.reason)}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
    } else {
      choice["text"] = c.echo + c.text;
    }
    out_choices.push_back(std::move(choice));
  }
  const FinishInfo total = total_usage(choices);
  note_finish(total);
  send_json(res, 200,
            {{"id", id},
             {"object", chat ? "chat.completion" : "text_completion"},
             {"created", unix_now()},
             {"model", model},
             {"choices", out_choices},
             {"usage", usage_json(total)},
             {"timings", timings_json(total)}});
}

// The error.param of a scheduler refusal: the field it names, "messages" for chat's prompt.
std::string submit_error_param(const ApiError& e, bool chat) {
  return chat && e.param == "prompt" ? "messages" : e.param;
}

}  // namespace

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

void HttpApi::install_routes() {
  install_hooks();
  httplib::Server& s = *server_;
  using Fn = std::function<void(const httplib::Request&, httplib::Response&)>;
  // No exception reaches cpp-httplib: HttpError is the response it names, anything else a 500.
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
      chat ? chat_prompts(body, tokenizer_, check)
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
  const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
  const std::string log_id = access_info().id.empty() ? id : access_info().id;
  std::vector<Choice> choices;
  ApiError err;
  if (!submit_choices(scheduler_, tokenizer_, p, prompts, chat, log_id, choices, err)) {
    send_error(res, http_status(err.code), err.message, "", submit_error_param(err, chat));
    return;
  }
  if (p.stream) {
    stream_choices(res, std::move(choices), p, chat, id, config_.model_name,
                   std::chrono::milliseconds(config_.keepalive_ms));
  } else {
    collect_choices(res, choices, p, prompts.ids.size(), chat, id, config_.model_name);
  }
}

}  // namespace burst::server
