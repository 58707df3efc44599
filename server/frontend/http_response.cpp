// The HTTP API's responses (http_internal.h): every choice submitted as a sequence, then an SSE
// stream (choices interleaved, keep-alive comments, progress events, usage, [DONE]) or one JSON
// response (best_of's n best per prompt), with logprobs in OpenAI's shapes. A client that
// leaves cancels its sequences (a stream at its next write or poll, a whole response within
// 100 ms).
#include <algorithm>
#include <random>
#include <thread>

#include "frontend/http_frontend.h"
#include "http_internal.h"

namespace burst::server::httpapi {

namespace {

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
  int64_t started_prompt_tokens = 0;  // streaming: the prompt's tokens, once started
  int64_t tokens_sent = 0;            // streaming: tokens whose events came so far
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
  bool continuous_usage = false;  // usage so far in every chunk
  bool logprobs = false;  // the request asked for them
  std::string id, model;
  int64_t created = 0;
  bool finished = false;
  size_t next = 0;  // round-robin position among the choices
};

// vLLM's continuous_usage_stats: the usage so far (each prompt once it started, every token
// sent; a finished choice's own counts, EOS included).
json usage_so_far(const SseState& st) {
  int64_t prompt = 0, completion = 0;
  for (const Choice& c : st.choices) {
    if (c.first_of_prompt) prompt += c.finished ? c.finish.prompt_tokens : c.started_prompt_tokens;
    completion += c.finished ? c.finish.completion_tokens : c.tokens_sent;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

json chunk(const SseState& st, json choice) {
  json j = {{"id", st.id},
            {"object", st.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", st.created},
            {"model", st.model},
            {"choices", choice.is_null() ? json::array() : json::array({std::move(choice)})}};
  if (st.continuous_usage) {
    j["usage"] = usage_so_far(st);
  } else if (st.include_usage) {
    j["usage"] = nullptr;
  }
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
      c.started_prompt_tokens = ev.prompt_tokens;
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
      if (ev.token >= 0) ++c.tokens_sent;  // -1: text held back, sent at the end
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
  st->continuous_usage = p.continuous_usage;
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

void respond(httplib::Response& res, Scheduler& sched, const Tokenizer& tok,
             const CommonParams& p, const Prompts& prompts, bool chat, const std::string& model,
             std::chrono::milliseconds keepalive) {
  const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
  const std::string log_id = access_info().id.empty() ? id : access_info().id;
  std::vector<Choice> choices;
  ApiError err;
  if (!submit_choices(sched, tok, p, prompts, chat, log_id, choices, err)) {
    send_error(res, http_status(err.code), err.message, "", submit_error_param(err, chat));
    return;
  }
  if (p.stream) {
    stream_choices(res, std::move(choices), p, chat, id, model, keepalive);
  } else {
    collect_choices(res, choices, p, prompts.ids.size(), chat, id, model);
  }
}

}  // namespace burst::server::httpapi
