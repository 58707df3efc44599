// The HTTP API's pieces shared by its files (frontend/http_api.h is the public face):
// errors and the access log (http_api.cpp), request parsing (http_request.cpp), and the
// responses, streamed or whole, with their logprobs (http_response.cpp). Handlers throw
// HttpError for a request the client got wrong; HttpApi's guarded() turns it into an
// OpenAI-style error response, so no exception reaches cpp-httplib.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/tokenizer.h"
#include "frontend/request_options.h"
#include "frontend/scheduler.h"

namespace burst::server::httpapi {

using nlohmann::json;

// A request the client got wrong (or the server cannot serve), thrown by the HTTP API's code
// only: every handler runs under HttpApi's guarded(), which turns it into an error response.
struct HttpError {
  int status;
  std::string message;
  std::string code = {};  // OpenAI "code" (e.g. "model_not_found"); empty: null
  std::string param = {};
};

// ---- errors and the access log (http_api.cpp)

int http_status(ErrorCode c);
// {"error": {"message", "type", "param", "code"}}; empty code / param: null.
json error_body(int status, const std::string& message, const std::string& code = "",
                const std::string& param = "");
// JSON text; never throws (invalid UTF-8 is replaced).
std::string dump(const json& j);
void send_json(httplib::Response& res, int status, const json& body);
// An error response (503s with Retry-After), its message noted for the access log.
void send_error(httplib::Response& res, int status, const std::string& message,
                const std::string& code = "", const std::string& param = "");

// What the access-log line of the request on this thread says beyond status and route.
struct AccessInfo {
  bool started = false;
  std::chrono::steady_clock::time_point start;
  std::string id;
  int64_t prompt_tokens = -1, completion_tokens = 0;  // -1: no generation
  std::string finish;
  std::string error;
};
AccessInfo& access_info();  // this thread's
AccessInfo& begin_access();  // a new request's, on this thread
void note_finish(const FinishInfo& f);
void write_access_log(const std::string& method, const std::string& path, int status,
                      const std::string& client);
std::string random_id(const char* prefix);
int64_t unix_now();

// ---- request parsing (http_request.cpp)

// Optional fields: absent or null is nullptr ("use the default"); a value of the wrong type is
// a 400 naming the field (bad_field).
const json* field(const json& body, const char* name);
[[noreturn]] void bad_field(const char* name, const char* want);
int64_t get_int(const json& body, const char* name, int64_t dflt);
bool get_bool(const json& body, const char* name, bool dflt);
// application/json, application/*+json (parameters such as charset allowed).
bool is_json_type(const std::string& content_type);
std::string unsupported_type_message(const std::string& content_type);
// The body as a JSON object (415 for another Content-Type, 400 for bad JSON).
json parse_body(const httplib::Request& req);
std::vector<int32_t> encode_or_throw(const Tokenizer& tok, const std::string& text, bool bos);

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
  bool continuous_usage = false;  // stream_options.continuous_usage_stats: usage in every chunk
};

// Every parameter of a completions (chat false) or chat body but the prompt, checked.
CommonParams parse_common(const json& body, const std::string& model_name, bool chat,
                          int vocab_size);

// The prompt byte limit, checked before the tokenizer runs (HttpApi::check_prompt_text).
using CheckText = std::function<void(size_t bytes, const char* param)>;

struct Prompts {
  std::vector<std::vector<int32_t>> ids = {{}};
  std::vector<std::string> echoes = {""};  // completions with echo: each prompt's text
};

// The messages through the chat template, with the request's add_generation_prompt and
// chat_template_kwargs.
Prompts chat_prompts(const json& body, const Tokenizer& tok, const CheckText& check,
                     const ParsedOptions& options);
Prompts completion_prompts(const json& body, const CommonParams& p, const Tokenizer& tok,
                           int64_t max_context, int vocab_size, int64_t max_prompt_bytes,
                           const CheckText& check);
// A 400 when the response could grow past `limit` bytes (0: no limit), before anything runs.
void check_response_size(const CommonParams& p, const Prompts& prompts, int64_t limit);

// ---- responses (http_response.cpp)

// Submits every choice of every prompt (all or none) and answers: an SSE stream (p.stream) or
// one JSON response once every choice finished; a refusal is the scheduler's error.
void respond(httplib::Response& res, Scheduler& sched, const Tokenizer& tok,
             const CommonParams& p, const Prompts& prompts, bool chat, const std::string& model,
             std::chrono::milliseconds keepalive);

}  // namespace burst::server::httpapi
