// The HTTP API's request parsing (http_internal.h): the body, the parameters each endpoint
// takes (the request options' table's and HTTP's own), refusals of what cannot be honoured, the
// prompts (chat through the template, completions' strings, ids and batches) and the bound on
// a response's size.
#include <algorithm>
#include <cstdio>
#include <set>

#include "common/chat_template.h"
#include "http_internal.h"

namespace burst::server::httpapi {

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

namespace {

Endpoint endpoint_of(bool chat) { return chat ? kChat : kCompletions; }

// The parameters each endpoint understands: the request options' table's and HTTP's own.
// Anything else is refused with a 400 naming it: a parameter that is accepted must do what it
// says, never be silently ignored.
const std::set<std::string>& known_keys(bool chat) {
  static const auto keys = [](bool is_chat) {
    // metadata, service_tier, user, skip_special_tokens: accepted, documented no-ops (they
    // change nothing a response holds: the text never holds special tokens).
    std::set<std::string> k = {"model",    "n",       "stream",       "stream_options",
                               "metadata", "service_tier", "user", "skip_special_tokens"};
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
  if (const json* t = field(body, "service_tier"); t && !t->is_string()) {
    bad_field("service_tier", "a string");
  }
  if (const json* m = field(body, "metadata")) {
    const bool strings = m->is_object() && std::all_of(m->begin(), m->end(), [](const json& v) {
      return v.is_string();
    });
    if (!strings) bad_field("metadata", "an object of string values");
  }
  get_bool(body, "skip_special_tokens", true);  // its type is checked; the text has none
  if (const json* sfx = field(body, "suffix")) {
    if (!sfx->is_string()) bad_field("suffix", "a string");
    if (!sfx->get<std::string>().empty()) unsupported("suffix", "no fill-in-the-middle");
  }
}

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
      if (key != "include_usage" && key != "continuous_usage_stats") {
        unsupported("stream_options." + key, "only include_usage and continuous_usage_stats");
      }
    }
    p.include_usage = get_bool(*so, "include_usage", false);
    p.continuous_usage = get_bool(*so, "continuous_usage_stats", false);
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

}  // namespace

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

// Chat: the messages (string or text-part contents) through the chat template: one prompt
// (add_generation_prompt: the template ends it with the assistant's header; the
// chat_template_kwargs are more of its variables).
Prompts chat_prompts(const json& body, const Tokenizer& tok, const CheckText& check,
                     const ParsedOptions& options) {
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
  auto ids = apply_chat_template(tok, roles, contents, options.add_generation_prompt,
                                chat_template_variables(options));
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
        // Checked here, as sent: an id past int32 (2^31, 2^64 - 1) is named, not its cast.
        const bool in_vocab = id.is_number_unsigned()
                                  ? id.get<uint64_t>() < static_cast<uint64_t>(vocab_size)
                                  : id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab_size;
        if (!in_vocab) {
          throw HttpError{400, "prompt token id " + id.dump() + " is outside the vocabulary [0, " +
                                   std::to_string(vocab_size) + ")", "", "prompt"};
        }
        prompt.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
      if (prompt.empty()) throw HttpError{400, "the prompt is empty", "", "prompt"};
      // A prompt over the context is refused by submit(): it is not decoded for echo first.
      if (p.echo && static_cast<int64_t>(prompt.size()) <= max_context) {
        out.echoes[i] = tok.decode(std::vector<int>(prompt.begin(), prompt.end()));
      }
    } else {
      bad_field("prompt", "a string, an array of token ids, or an array of those");
    }
  }
  return out;
}

namespace {

// What one token costs a response at most, in bytes, as rendered (completions' shape is the
// larger): its text and, with logprobs, its entry (token, logprob, text_offset) and each
// alternative ("token": logprob). Measured on LLaMA's vocabulary: about 26 bytes per entry or
// alternative; the estimate rounds up, so a response within the bound is within it in fact.
constexpr int64_t kTextBytesPerToken = 8;
constexpr int64_t kLogprobBytesPerEntry = 32;
constexpr int64_t kLogprobBytesPerAlternative = 28;

}  // namespace

// A response's size is bounded before anything runs (issue: echo + logprobs 20 over 64 prompts
// of 1900 ids came to 67 MB, held several times over while it was built): every sequence of
// every prompt, its echoed prompt and max_tokens, times the tokens' logprob entries. Over
// `limit` (0: none) is a 400 that says the sizes and the limit.
void check_response_size(const CommonParams& p, const Prompts& prompts, int64_t limit) {
  if (limit <= 0) return;
  const int64_t top = p.logprobs ? std::max(p.request.logprobs, 0) : 0;
  const int64_t per_token = kTextBytesPerToken +
                            (p.logprobs ? kLogprobBytesPerEntry + kLogprobBytesPerAlternative * top
                                        : 0);
  int64_t tokens = 0, longest = 0;
  for (const auto& ids : prompts.ids) {
    const int64_t prompt = p.echo ? static_cast<int64_t>(ids.size()) : 0;
    longest = std::max(longest, prompt);
    // Doubles: max_tokens is as asked (up to 2^63 - 1) until the scheduler bounds it.
    tokens += p.best_of * (prompt + std::min<int64_t>(p.request.max_tokens, int64_t{1} << 40));
  }
  const double bytes = static_cast<double>(tokens) * static_cast<double>(per_token);
  if (bytes <= static_cast<double>(limit)) return;
  const std::string sequences = std::to_string(prompts.ids.size()) + " prompt(s) x " +
                                std::to_string(p.best_of) + " sequence(s)";
  const std::string each = (p.echo ? "up to " + std::to_string(longest) + " echoed prompt + " : "") +
                           std::to_string(p.request.max_tokens) + " max_tokens";
  const std::string what = p.logprobs ? " with " + std::to_string(top) + " top logprobs each" : "";
  char mb[32];
  std::snprintf(mb, sizeof(mb), "%.1f", bytes / 1e6);
  throw HttpError{400, "the response could reach " + std::string(mb) + " MB (" + sequences +
                           " of " + each + " tokens" + what + "), over the limit of " +
                           std::to_string(limit) + " bytes (--max-response-bytes): ask for "
                           "fewer prompts, sequences, tokens or logprobs",
                  "", p.logprobs ? "logprobs" : "max_tokens"};
}

}  // namespace burst::server::httpapi
