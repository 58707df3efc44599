// The scheduler between the APIs (HTTP, gRPC) and the worker group: continuous batching.
// Requests are plain C++ structs (no protobuf). Three parts, each on its own thread(s):
// - queue and admission (submit(), the caller's thread): validates, refuses at once what can
//   never fit the KV pages of some rank (kTooLarge) and what finds the queue full or the server
//   draining (kUnavailable); an admitted request waits in a FIFO queue.
// - the step loop (one thread, the only one that drives the workers): admits waiting requests
//   while every rank has the KV pages a request will ever need (pages are reserved whole at
//   admission, so a running sequence never runs out and nothing is preempted) and fewer than
//   max_running run; then plans one step: every decoding sequence's next token first, then
//   prefill chunks (fewest prompt tokens left first, at most one chunk per sequence, chunks of
//   prefill_chunk tokens) while the step's token budget (max_batched_tokens) allows, so a short
//   prompt is never stuck behind a long prefill and decoding sequences advance every step. It
//   sends the plan to the group (WorkerGroup::send_step) and hands each sampled token to output
//   processing. While every running sequence decodes and nothing waits, it sends the next
//   decode step before reading the current one's tokens (decode_lookahead), so the workers
//   never wait for this process between steps. Cancelled, finished and failed sequences are
//   released on every rank in the next step sent.
// - output processing (one thread): detokenizes, holds back text that may start a stop string,
//   cuts at a stop string (and tells the step loop to finish that sequence), and delivers
//   events to the request's RequestStream, a thread-safe queue the API thread reads.
// The step loop also starts the worker group (the server answers /health 503 meanwhile) and
// restarts it when a worker dies: the sequences in flight fail with kUnavailable within a
// fraction of a second, queued ones wait for the fresh group. With remote workers (multi-node)
// the fresh group forms only when enough `burst-worker --join` processes registered, which may
// take an operator: until then requests are refused at once with kUnavailable ("waiting for
// workers (k/N registered ...)") instead of queueing for an unknown time.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "frontend/planner.h"
#include "frontend/metrics.h"
#include "common/tokenizer.h"
#include "group/worker_group.h"

namespace burst::server {

enum class ErrorCode {
  kInvalidArgument,  // HTTP 400, gRPC INVALID_ARGUMENT
  kUnauthenticated,  // 401, UNAUTHENTICATED
  kNotFound,         // 404, NOT_FOUND
  kTooLarge,         // 413, RESOURCE_EXHAUSTED: can never fit
  kUnavailable,      // 503 (+ Retry-After), UNAVAILABLE: queue full, draining, worker died
  kInternal,         // 500, INTERNAL
};

struct ApiError {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  // The request field at fault (OpenAI's error.param): "prompt", "max_tokens", "min_tokens",
  // "stop"; empty when none is. The chat API says "messages" for "prompt".
  std::string param;
};

struct ScheduledRequest {
  std::string id;  // for logs and responses ("cmpl-...", "req-...")
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;  // 0: the prompt alone (prefilled for its logprobs; HTTP's echo)
  engine::SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: the text ends before the first match
  bool return_progress = false;
  engine::LogitAdjust adjust;  // penalties, logit_bias, min_tokens (applied on rank 0)
  int logprobs = -1;           // -1: none; n >= 0: each token's logprob and the n most likely
  bool ignore_eos = false;     // EOS does not finish the sequence (max_tokens, stop do)
  int prompt_logprobs = -1;    // -1: none; k >= 0: kPromptLogprobs events (prompt tokens 1..)
  // Sampling one of these ids finishes the sequence with "stop" (its text is not emitted, like
  // EOS), once at least adjust.min_tokens tokens came before it; ignore_eos does not apply.
  std::vector<int32_t> stop_token_ids;
  // vLLM's include_stop_str_in_output: the stop string that ended the text is kept at its end
  // (text after it in the same token is still cut), and a stop token id's text is sent.
  bool include_stop_str_in_output = false;
  // The client request this sequence is one choice of (its n choices and prompts share it, and
  // share one fair share of the batch: Planner::pick); 0: a request of one sequence.
  uint64_t owner = 0;
};

struct FinishInfo {
  runtime::FinishReason reason = runtime::FinishReason::kLength;  // the API says its name
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // of prompt_tokens: found in the prefix cache, not computed
  int64_t completion_tokens = 0;
  double queue_ms = 0;
  double prefill_ms = 0;
  double ttft_ms = 0;  // arrival to first token
  double decode_tokens_per_s = 0;
};

struct Event {
  enum class Kind { kStarted, kProgress, kToken, kFinished, kError, kPromptLogprobs };
  Kind kind = Kind::kToken;
  int64_t prompt_tokens = 0;  // kStarted
  double queue_ms = 0;        // kStarted
  double fraction = 0;        // kProgress: prompt fraction prefilled
  int32_t token = 0;          // kToken
  std::string text;           // kToken: text this token completes (held back near a stop string)
  double ttft_ms = -1;        // kToken: set on the first token only
  bool has_logprob = false;   // kToken with request.logprobs >= 0 (not on held-back text)
  float logprob = 0;          // kToken: log-softmax of the raw logits at `token`
  std::vector<std::pair<int32_t, float>> top_logprobs;  // kToken: the most likely ids
  std::vector<runtime::PromptTokenLogprob> prompt_logprobs;  // kPromptLogprobs: a chunk's
  FinishInfo finish;          // kFinished
  ApiError error;             // kError
};

// One request's event queue: written by the scheduler thread, read by one API thread.
class RequestStream {
 public:
  // The next event, or nullopt after `timeout` without one (time for a keep-alive).
  std::optional<Event> next(std::chrono::milliseconds timeout);
  // The client is gone or asked to stop: generation stops at the next token.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_.load(); }
  void push(Event e);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  std::atomic<bool> cancelled_{false};
};

struct SchedulerOptions {
  WorkerGroupOptions group;  // group.prefill_chunk: the prefill chunk size (0: whole prompts)
  // The prefill chunk of a step that also decodes (0 or >= group.prefill_chunk: the same). Used
  // only when both are multiples of 2 x ranks, so every chunking gives each rank the same KV
  // rows (the pages reserved at admission hold whichever chunks a prompt gets).
  int64_t prefill_chunk_decoding = 0;
  // While every running sequence decodes and nothing waits, the step after the one in flight
  // is sent before that one's tokens are read (each decoding sequence's next row with
  // runtime::kPreviousToken): the workers start it the moment they finish, and the round trip
  // through this process (replies, output processing, planning) leaves the critical path.
  bool decode_lookahead = true;
  int64_t max_context = 0;  // longest prompt
  int max_tokens_limit = 0;
  int max_queue = 64;
  int vocab_size = 0;  // prompt ids must be below it (the model's config)
  int64_t max_batched_tokens = 0;  // tokens per step; 0: chunk + max(max_running, chunk / 4)
  int max_running = 64;            // sequences in flight at once
  int64_t max_prompt_bytes = 0;    // prompt text beyond this is refused untokenized; 0: no limit
  // A request whose prompt starts with blocks of tokens computed before (by a finished or a
  // running request: ring ranks x page size tokens a block) reuses their KV pages and prefills
  // only the rest (Planner; the striped layout only).
  bool prefix_caching = true;
  // Before a (re)started group serves, one request of this many tokens (and 2 new ones) runs
  // through it, chunked as requests are: the first request of that size would otherwise pay
  // for the memory pools' growth, the kernels' loading and the libraries' first calls (0: none).
  int64_t warmup_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, const Tokenizer& tokenizer, Metrics& metrics);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates and queues; on refusal returns nullptr and sets *error.
  std::shared_ptr<RequestStream> submit(ScheduledRequest request, ApiError* error);
  // The check both APIs make on prompt text before tokenizing it (tokenizing megabytes costs
  // seconds of CPU): more than max_prompt_bytes is kTooLarge, naming both sizes.
  std::optional<ApiError> check_prompt_text(size_t bytes);
  int64_t max_prompt_bytes() const { return options_.max_prompt_bytes; }
  // True once the worker group serves and while it stays up.
  bool healthy() const { return healthy_.load(); }
  bool draining() const { return draining_.load(); }
  // Remote workers: "waiting for workers (k/N registered ...)" while the group is not serving;
  // otherwise empty.
  std::string waiting_status() const;
  // While a local group starts: the weights loaded and in all, bytes summed over the ranks
  // (total 0 until every rank has reported, and again once the start is over).
  struct Loading {
    int64_t done = 0, total = 0;
  };
  Loading loading() const {
    const StartProgress& p = *options_.group.start_progress;
    return {p.bytes_done.load(), p.bytes_total.load()};
  }
  // Refuses new requests, lets queued and running ones finish for up to `grace`, cancels the
  // rest, then stops the worker group. Safe to call once from any thread.
  void drain(std::chrono::milliseconds grace);
  // KV tokens of the group: the configured capacity, or (sized from GPU memory) what the
  // running group holds; 0 until a group sized from memory has started.
  int64_t kv_capacity() const { return kv_capacity_.load(); }
  // A request's max_tokens when the client gave none: `want`, within what the KV capacity
  // leaves beside a prompt of `prompt` tokens (so a default never makes a fitting prompt fail;
  // max_tokens_limit while the capacity is not known yet), at least 1.
  int default_max_tokens(int64_t prompt, int64_t want) const {
    const int64_t cap = kv_capacity();
    const int64_t room = cap > 0 ? cap - prompt : options_.max_tokens_limit;
    return static_cast<int>(std::max<int64_t>(1, std::min(want, room)));
  }
  int64_t max_context() const { return options_.max_context; }
  int max_tokens_limit() const { return options_.max_tokens_limit; }
  int vocab_size() const { return options_.vocab_size; }
  int workers() const { return options_.group.workers; }
  int max_running() const { return options_.max_running; }
  int64_t max_batched_tokens() const { return options_.max_batched_tokens; }
  int64_t prefill_chunk() const { return options_.group.prefill_chunk; }
  const std::string& device() const { return options_.group.device; }
  // Worker pids (tests kill one); empty while no group runs.
  std::vector<int> worker_pids() const;
  // Why the scheduler stopped trying to start its worker group (it failed to start twice in a
  // row the same way: a model the workers refuse, memory that does not suffice, and restarting
  // forever would hide it); empty while it keeps the group going. The server then exits.
  std::string gave_up() const;

 private:
  struct Job {
    ScheduledRequest request;
    std::shared_ptr<RequestStream> stream;
    std::chrono::steady_clock::time_point arrival;
  };
  struct Output;   // a request's output processing state (scheduler.cpp)
  struct Running;  // a running request as the step loop delivers it (scheduler.cpp)
  enum class GroupState { kReady, kWaiting, kFailed };
  void loop();
  GroupState ensure_group();  // starts, restarts or awaits the group
  void warm_up();             // the warm-up request on a fresh group (warmup_tokens)
  void admit();
  void started(Running& s);  // admitted: the kStarted event, its output state
  Running* running(uint64_t id);
  // One step of the running sequences (its tokens read, a lookahead step perhaps sent); false
  // when nothing was runnable.
  bool run_step();
  LayerProgress layer_progress(const Planner::Plan& plan, bool* any);
  // A start or restart failed with `why`: true when the one before failed the same way (no
  // ready group in between), and the scheduler gives up.
  bool failed_again(const std::string& why);
  bool look_ahead(const Planner::Plan& plan);
  void take_outcome(const Planner::Plan& plan, const StepOutcome& out);
  void drop_finished();
  void observe_step(const Planner::Plan& plan);
  void step_failed(size_t seqs, const Status& st);
  static void process_token(Output& out, std::atomic<bool>& stop_flag, int32_t token,
                            std::chrono::steady_clock::time_point now, bool is_eos,
                            const runtime::SampledToken& st, Metrics& metrics);
  // The request leaves (planner sequence `id`, 0 if never admitted): its pages are released on
  // every rank in the next step, and its output gets the finish `reason` (finish) or an error
  // event (fail).
  void finish(Running& s, uint64_t id, runtime::FinishReason reason);
  void fail(Running& s, uint64_t id, const ApiError& err);
  void leave(uint64_t id);
  void fail_running(ErrorCode code, const std::string& why);
  void fail_queued(const std::string& why);
  // Requests cancelled while they wait leave the queue wherever they are, their streams told
  // "cancelled": only live requests count toward max_queue (submit() and admit() call it).
  void drop_cancelled();
  void output_loop();
  void enqueue_output(std::function<void()> work);
  void publish_gauges();

  SchedulerOptions options_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  std::unique_ptr<WorkerGroup> group_;  // touched by the step loop only, after start
  mutable std::mutex group_mu_;         // guards the group_ pointer for worker_pids()
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;  // under mu_
  int64_t in_flight_ = 0;  // under mu_: admitted and not finished (drain waits for 0)
  // Step loop only:
  Planner planner_{PlannerOptions{}};  // the policy: sequences, page ledger, plans
  std::map<uint64_t, std::unique_ptr<Running>> running_;  // by planner id (admission order)
  std::optional<Planner::Plan> ahead_;  // the lookahead step: sent, its tokens not read
  std::atomic<bool> healthy_{false};
  std::atomic<int64_t> kv_capacity_{0};
  std::atomic<bool> draining_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> started_once_{false};
  std::atomic<bool> cancel_all_{false};  // drain: the step loop cancels what runs
  std::string last_failure_;             // step loop: the last start failure since a ready group
  mutable std::mutex gave_up_mu_;
  std::string gave_up_;  // under gave_up_mu_
  // Output processing: work items run in order on one thread.
  std::mutex out_mu_;
  std::condition_variable out_cv_;
  std::deque<std::function<void()>> out_queue_;
  bool out_stop_ = false;
  std::thread out_thread_;
  std::thread thread_;
};

}  // namespace burst::server
