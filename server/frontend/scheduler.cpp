// The scheduler's requests (frontend/scheduler.h): submit() and its checks, the queue, admission,
// the step loop's steps (plan, send, look ahead, read the outcome) and output processing. The
// worker group's start, restart, warm-up and the drain are in scheduler_group.cpp.
#include "frontend/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "scheduler_internal.h"

namespace burst::server {

namespace {

// Length of the longest suffix of `text` that is a proper prefix of some stop string: that
// much text must be held back, since the next token may complete the stop string.
size_t stop_prefix_len(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& s : stops) {
    for (size_t n = std::min(s.size() - 1, text.size()); n > best; --n) {
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        best = n;
        break;
      }
    }
  }
  return best;
}

}  // namespace

std::optional<Event> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void RequestStream::push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}


// A request's output processing, touched by the output thread only (after admission).
struct Scheduler::Output {
  Output(const Tokenizer& tok, const ScheduledRequest& r, std::shared_ptr<RequestStream> s,
         Clock::time_point arrival)
      : stream(std::move(s)), decoder(tok, r.prompt.back()), stop(r.stop), id(r.id),
        arrival(arrival), include_stop(r.include_stop_str_in_output),
        stop_token_ids(include_stop ? r.stop_token_ids : std::vector<int32_t>{}) {}
  std::shared_ptr<RequestStream> stream;
  StreamDecoder decoder;
  std::vector<std::string> stop;
  std::string id;
  Clock::time_point arrival;
  std::string held;  // decoded text not yet sent: it may be the start of a stop string
  int64_t completion = 0;
  Clock::time_point first{}, last{};
  bool stop_hit = false;
  bool include_stop = false;            // include_stop_str_in_output
  std::vector<int32_t> stop_token_ids;  // with include_stop: ids whose text is sent
};

// A running request as the step loop delivers it (its scheduling state is the planner's).
struct Scheduler::Running {
  Job job;
  std::shared_ptr<Output> out;
  std::shared_ptr<std::atomic<bool>> stop_hit;  // set by output processing
  int64_t generated = 0;
  Clock::time_point admitted, prefill_done;
  double queue_ms = 0, prefill_ms = 0;
  int64_t cached_tokens = 0;  // of the prompt, from the prefix cache
  int64_t prompt_len() const { return static_cast<int64_t>(job.request.prompt.size()); }
};

Scheduler::Scheduler(SchedulerOptions options, const Tokenizer& tokenizer, Metrics& metrics)
    : options_(std::move(options)), tokenizer_(tokenizer), metrics_(metrics) {
  if (options_.max_running < 1) options_.max_running = 1;
  // The smaller chunk of steps that decode: only where every chunking gives each rank the same
  // KV rows up to the last chunk's padding (kv_pages_needed), i.e. both chunks are multiples of
  // 2 x ranks; else (and where it is not smaller) chunks keep one size.
  {
    const int64_t full = options_.group.prefill_chunk, small = options_.prefill_chunk_decoding;
    const int64_t parts = 2 * int64_t{std::max(options_.group.ring_size(), 1)};
    if (small > 0 && !(full > 0 && small < full && full % parts == 0 && small % parts == 0)) {
      if (small < full || full <= 0) {
        spdlog::warn("prefill chunk while decoding ({}) unused: it and the prefill chunk ({}) "
                     "must be multiples of 2 x the ring's ranks ({}), and it smaller",
                     small, full, parts);
      }
      options_.prefill_chunk_decoding = 0;
    }
  }
  if (options_.max_batched_tokens <= 0) {
    // One full chunk plus room for the decode tokens and short prompts that share its step.
    const int64_t chunk =
        options_.group.prefill_chunk > 0 ? options_.group.prefill_chunk : options_.max_context;
    options_.max_batched_tokens = chunk + std::max<int64_t>(options_.max_running, chunk / 4);
  }
  PlannerOptions po;
  po.world = std::max(options_.group.ring_size(), 1);
  po.layout = options_.group.layout;
  po.prefill_chunk = options_.group.prefill_chunk;
  po.prefill_chunk_decoding = options_.prefill_chunk_decoding;
  po.max_batched_tokens = options_.max_batched_tokens;
  po.max_running = options_.max_running;
  po.decode_lookahead = options_.decode_lookahead;
  po.prefix_caching = options_.prefix_caching;
  if (options_.prefix_caching && options_.group.layout != engine::ShardLayout::kStriped) {
    spdlog::warn("prefix caching is off: it needs the striped layout (--layout {})",
                 engine::shard_layout_name(options_.group.layout));
  }
  planner_ = Planner(po);
  kv_capacity_ = options_.group.kv_capacity;
  metrics_.kv_capacity_tokens = options_.group.kv_capacity;
  if (!options_.group.start_progress) {
    options_.group.start_progress = std::make_shared<StartProgress>();
  }
  out_thread_ = std::thread([this] { output_loop(); });
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  drain(std::chrono::milliseconds(0));
  {
    std::lock_guard<std::mutex> lock(out_mu_);
    out_stop_ = true;
  }
  out_cv_.notify_all();
  if (out_thread_.joinable()) out_thread_.join();
}

std::optional<ApiError> Scheduler::check_prompt_text(size_t bytes) {
  const int64_t limit = options_.max_prompt_bytes;
  if (limit <= 0 || static_cast<int64_t>(bytes) <= limit) return std::nullopt;
  ++metrics_.requests_rejected;
  return ApiError{ErrorCode::kTooLarge,
                  "the prompt is " + std::to_string(bytes) + " bytes of text, over the limit of " +
                      std::to_string(limit) + " bytes (--max-prompt-bytes; by default the most "
                      "text " + std::to_string(options_.max_context) +
                      " tokens of context can hold); it was not tokenized", "prompt"};
}

std::shared_ptr<RequestStream> Scheduler::submit(ScheduledRequest r, ApiError* error) {
  auto refuse = [&](ErrorCode code, std::string msg,
                    std::string param = "") -> std::shared_ptr<RequestStream> {
    *error = {code, std::move(msg), std::move(param)};
    ++metrics_.requests_rejected;
    return nullptr;
  };
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  if (n == 0) return refuse(ErrorCode::kInvalidArgument, "the prompt is empty", "prompt");
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= options_.vocab_size) {
      return refuse(ErrorCode::kInvalidArgument,
                    "prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                        std::to_string(options_.vocab_size) + ")",
                    "prompt");
    }
  }
  if (n > options_.max_context) {
    return refuse(ErrorCode::kInvalidArgument,
                  "the prompt has " + std::to_string(n) + " tokens, over the model's limit of " +
                      std::to_string(options_.max_context),
                  "prompt");
  }
  // max_tokens 0: the prompt alone (its logprobs; HTTP's echo), prefilled and no token drawn.
  if (r.max_tokens < 0 || r.max_tokens > options_.max_tokens_limit) {
    return refuse(ErrorCode::kInvalidArgument,
                  "max_tokens must be in 1.." + std::to_string(options_.max_tokens_limit) +
                      ", got " + std::to_string(r.max_tokens),
                  "max_tokens");
  }
  if (r.adjust.min_tokens > r.max_tokens) {
    return refuse(ErrorCode::kInvalidArgument,
                  "min_tokens (" + std::to_string(r.adjust.min_tokens) +
                      ") must not exceed max_tokens (" + std::to_string(r.max_tokens) + ")",
                  "min_tokens");
  }
  if (const std::string bad = engine::validate(r.sampling); !bad.empty()) {
    return refuse(ErrorCode::kInvalidArgument, bad);
  }
  for (const auto& s : r.stop) {
    if (s.empty()) return refuse(ErrorCode::kInvalidArgument, "a stop string is empty", "stop");
  }
  // A request that would not fit even an empty cache can never run; one that fits waits for
  // pages when others hold them.
  // (Sized from GPU memory, the capacity is known once a group runs; before that the pages
  // checked at admission refuse what can never fit.)
  const int64_t capacity = kv_capacity_.load();
  if (capacity > 0 && n + r.max_tokens > capacity) {
    return refuse(ErrorCode::kTooLarge,
                  "prompt (" + std::to_string(n) + " tokens) + max_tokens (" +
                      std::to_string(r.max_tokens) + ") exceeds the KV capacity of " +
                      std::to_string(capacity) + " tokens",
                  "max_tokens");
  }
  auto stream = std::make_shared<RequestStream>();
  drop_cancelled();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return refuse(ErrorCode::kUnavailable, "the server is shutting down");
    if (options_.group.registry && !healthy_) {
      return refuse(ErrorCode::kUnavailable, waiting_status());
    }
    // max_queue counts requests that must wait: with room in the batch a request is admitted
    // even when max_queue is 0.
    const bool must_wait = in_flight_ >= options_.max_running || !queue_.empty();
    if (must_wait && static_cast<int>(queue_.size()) >= options_.max_queue) {
      return refuse(ErrorCode::kUnavailable,
                    "the queue is full (" + std::to_string(queue_.size()) + " waiting)");
    }
    queue_.push_back({std::move(r), stream, Clock::now()});
    metrics_.waiting = static_cast<int64_t>(queue_.size());
  }
  cv_.notify_all();
  return stream;
}

void Scheduler::drop_cancelled() {
  std::vector<Job> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (it->stream->cancelled()) {
        gone.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    if (gone.empty()) return;
    metrics_.waiting = static_cast<int64_t>(queue_.size());
  }
  const auto now = Clock::now();
  for (auto& job : gone) {
    // Nothing ran: no output state, no pages; the stream hears "cancelled" at once.
    Event e;
    e.kind = Event::Kind::kFinished;
    e.finish.reason = runtime::FinishReason::kCancelled;
    e.finish.prompt_tokens = static_cast<int64_t>(job.request.prompt.size());
    e.finish.queue_ms = ms_between(job.arrival, now);
    job.stream->push(std::move(e));
    ++metrics_.requests_cancelled;
  }
}

void Scheduler::fail_queued(const std::string& why) {
  std::deque<Job> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed.swap(queue_);
    metrics_.waiting = 0;
  }
  for (auto& job : failed) {
    Event e;
    e.kind = Event::Kind::kError;
    e.error = {ErrorCode::kUnavailable, why, ""};
    job.stream->push(std::move(e));
    ++metrics_.requests_failed;
  }
}

void Scheduler::enqueue_output(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(out_mu_);
    out_queue_.push_back(std::move(work));
  }
  out_cv_.notify_one();
}

void Scheduler::output_loop() {
  while (true) {
    std::function<void()> work;
    {
      std::unique_lock<std::mutex> lock(out_mu_);
      out_cv_.wait(lock, [&] { return out_stop_ || !out_queue_.empty(); });
      if (out_queue_.empty()) return;  // stopping and nothing left
      work = std::move(out_queue_.front());
      out_queue_.pop_front();
    }
    work();
  }
}

void Scheduler::publish_gauges() {
  int64_t waiting = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting = static_cast<int64_t>(queue_.size());
  }
  metrics_.waiting = waiting;
  metrics_.running = static_cast<int64_t>(running_.size());
}

void Scheduler::admit() {
  if (!group_) return;
  const auto& info = group_->info();
  // Cancelled requests leave wherever they wait, not only from the head: the head may wait
  // for pages while the clients behind it give up.
  drop_cancelled();
  while (!planner_.full()) {
    bool never = false;
    std::vector<int64_t> need;
    auto run = std::make_unique<Running>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) break;
      // Round-robin over client requests (the planner's pick); the one picked waits for pages
      // when they do not suffice yet (finishing sequences free them) and nothing passes it.
      std::vector<const ScheduledRequest*> waiting;
      waiting.reserve(queue_.size());
      for (const Job& job : queue_) waiting.push_back(&job.request);
      Planner::Pick pick = planner_.pick(waiting);
      if (pick.index < 0 || pick.fit == Planner::Fit::kLater) break;
      never = pick.fit == Planner::Fit::kNever;
      need = std::move(pick.need);
      const auto it = queue_.begin() + pick.index;
      run->job = std::move(*it);
      queue_.erase(it);
      ++in_flight_;
    }
    run->queue_ms = ms_between(run->job.arrival, Clock::now());
    if (never) {
      // Page rounding and chunk padding can need more than the token count submit() checked.
      const ApiError err{ErrorCode::kTooLarge,
                         "the request needs more KV pages than a worker holds (" +
                             std::to_string(info.kv_pages) + " pages of " +
                             std::to_string(info.kv_page_size) + " tokens)", ""};
      fail(*run, 0, err);
      continue;
    }
    Running& s = *run;
    const uint64_t id = planner_.admit(s.job.request, std::move(need));
    s.cached_tokens = planner_.find(id)->cached;
    if (planner_.caching()) {
      metrics_.prefix_cache_queries += static_cast<uint64_t>(s.prompt_len());
      metrics_.prefix_cache_hits += static_cast<uint64_t>(s.cached_tokens);
    }
    metrics_.prefix_cache_evictions = planner_.evicted_blocks();
    running_[id] = std::move(run);
    started(s);
  }
  publish_gauges();
}

void Scheduler::started(Running& s) {
  s.admitted = Clock::now();
  s.stop_hit = std::make_shared<std::atomic<bool>>(false);
  s.out = std::make_shared<Output>(tokenizer_, s.job.request, s.job.stream, s.job.arrival);
  metrics_.queue.observe(s.queue_ms / 1000.0);
  metrics_.prompt_tokens += static_cast<uint64_t>(s.prompt_len());
  Event e;
  e.kind = Event::Kind::kStarted;
  e.prompt_tokens = s.prompt_len();
  e.queue_ms = s.queue_ms;
  s.job.stream->push(std::move(e));
  if (s.job.request.return_progress) {
    Event p;
    p.kind = Event::Kind::kProgress;
    p.fraction = 0;
    s.job.stream->push(std::move(p));
  }
}

void Scheduler::leave(uint64_t id) {
  planner_.finish(id);  // pages back, released in the next step (nothing for id 0 or twice)
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_;
}

void Scheduler::fail(Running& s, uint64_t id, const ApiError& err) {
  leave(id);
  auto stream = s.job.stream;
  const std::string rid = s.job.request.id;
  ++metrics_.requests_failed;
  enqueue_output([stream, err, rid] {
    spdlog::error("{} failed: {}", rid, err.message);
    Event e;
    e.kind = Event::Kind::kError;
    e.error = err;
    stream->push(std::move(e));
  });
}

void Scheduler::finish(Running& s, uint64_t id, runtime::FinishReason reason) {
  leave(id);
  const auto end = Clock::now();
  auto stream = s.job.stream;
  auto out = s.out;
  FinishInfo f;
  f.reason = reason;
  f.prompt_tokens = s.prompt_len();
  f.cached_tokens = s.cached_tokens;
  f.queue_ms = s.queue_ms;
  f.prefill_ms = s.prefill_ms;
  const double decode_ms = s.generated > 0 ? ms_between(s.prefill_done, end) : 0;
  const double e2e_s = ms_between(s.job.arrival, end) / 1000.0;
  const std::string rid = s.job.request.id;
  Metrics* m = &metrics_;
  if (s.generated > 0) {
    metrics_.prefill_time.observe(s.prefill_ms / 1000.0);
    metrics_.decode_time.observe(decode_ms / 1000.0);
    metrics_.request_ran(s.prompt_len(), s.generated, (s.prefill_ms + decode_ms) / 1000.0);
  }
  enqueue_output([out, stream, f, decode_ms, e2e_s, rid, m]() mutable {
    if (!out) {  // cancelled while waiting: nothing ran
      Event e;
      e.kind = Event::Kind::kFinished;
      e.finish = f;
      stream->push(std::move(e));
      ++m->requests_cancelled;
      return;
    }
    if (!out->stop_hit && !stream->cancelled()) {
      // Text the decoder or the stop-string check still held: the generation ended without
      // completing a stop string, so it belongs to the output.
      out->held += out->decoder.flush();
      if (!out->held.empty()) {
        Event e;
        e.kind = Event::Kind::kToken;
        e.token = -1;
        e.text = std::move(out->held);
        out->held.clear();
        stream->push(std::move(e));
      }
    }
    if (out->stop_hit) f.reason = runtime::FinishReason::kStop;
    if (stream->cancelled()) f.reason = runtime::FinishReason::kCancelled;
    f.completion_tokens = out->completion;
    f.ttft_ms = out->completion > 0 ? ms_between(out->arrival, out->first) : 0;
    f.decode_tokens_per_s = out->completion > 1 && out->last > out->first
                                ? (out->completion - 1) * 1000.0 / ms_between(out->first, out->last)
                                : 0;
    m->e2e.observe(e2e_s);
    if (f.reason == runtime::FinishReason::kCancelled) {
      ++m->requests_cancelled;
    } else {
      ++m->requests_ok;
      ++(f.reason == runtime::FinishReason::kLength ? m->success_length : m->success_stop);
    }
    spdlog::info("{} done: prompt {} tokens ({} cached), queue {:.1f} ms, prefill {:.1f} ms, "
                 "TTFT {:.1f} ms, decode {:.1f} ms for {} tokens ({:.1f} tok/s), finish {}",
                 rid, f.prompt_tokens, f.cached_tokens, f.queue_ms, f.prefill_ms, f.ttft_ms,
                 decode_ms,
                 f.completion_tokens, f.decode_tokens_per_s,
                 runtime::finish_reason_name(f.reason));
    Event e;
    e.kind = Event::Kind::kFinished;
    e.finish = std::move(f);
    stream->push(std::move(e));
  });
}

void Scheduler::fail_running(ErrorCode code, const std::string& why) {
  ahead_.reset();  // a step sent ahead belonged to the same session or group
  ApiError err{code, why, ""};
  for (auto& [id, s] : running_) fail(*s, id, err);
  running_.clear();
  planner_.drop_all();  // the group is gone or its session ended: nothing to release
  publish_gauges();
}

// Sequences whose client left, or whose output hit a stop string, leave the batch first; after
// a drain's timeout, every running sequence ends with an error that says so.
void Scheduler::drop_finished() {
  for (auto it = running_.begin(); it != running_.end();) {
    Running& s = *it->second;
    const bool cancelled = s.job.stream->cancelled();
    if (cancel_all_ && !cancelled) {
      // Drain ran out of time: what still runs ends with an error event that says so (never a
      // silent finish_reason null, which a client reads as an empty normal answer).
      const ApiError err{ErrorCode::kUnavailable,
                         "the server is shutting down: the drain timeout ended this request "
                         "after " + std::to_string(s.generated) + " generated token(s)", ""};
      fail(s, it->first, err);
    } else if (cancelled || s.stop_hit->load()) {
      finish(s, it->first,
             cancelled ? runtime::FinishReason::kCancelled : runtime::FinishReason::kStop);
    } else {
      ++it;
      continue;
    }
    it = running_.erase(it);
  }
}

Scheduler::Running* Scheduler::running(uint64_t id) {
  const auto it = running_.find(id);
  return it == running_.end() ? nullptr : it->second.get();
}

// A sampled token, on the output thread: TTFT/TPOT metrics, detokenizing, the stop strings.
void Scheduler::process_token(Output& out, std::atomic<bool>& stop_flag, int32_t token,
                              Clock::time_point now, bool is_eos,
                              const runtime::SampledToken& st, Metrics& metrics) {
  if (out.stop_hit || out.stream->cancelled()) return;
  ++out.completion;
  if (out.completion == 1) {
    out.first = now;
    metrics.ttft.observe(ms_between(out.arrival, now) / 1000.0);
  } else {
    metrics.tpot.observe(ms_between(out.last, now) / 1000.0);
  }
  out.last = now;
  auto emit = [&](std::string text) {
    Event e;
    e.kind = Event::Kind::kToken;
    e.token = token;
    e.text = std::move(text);
    if (out.completion == 1) e.ttft_ms = ms_between(out.arrival, out.first);
    e.has_logprob = st.has_logprob;
    e.logprob = st.logprob;
    e.top_logprobs = st.top;
    out.stream->push(std::move(e));
  };
  if (is_eos) {
    // The sequence stops after EOS or a stop token id. EOS has no text; a stop token id's is
    // sent with include_stop_str_in_output (with what was held back for a stop string).
    const auto& ids = out.stop_token_ids;
    if (std::find(ids.begin(), ids.end(), token) == ids.end()) return;
    emit(out.held + out.decoder.push(token));
    out.held.clear();
    return;
  }
  out.held += out.decoder.push(token);
  // The request's stop strings, copied once into its Output at admission.
  const std::vector<std::string>& stops = out.stop;
  if (!stops.empty()) {
    size_t cut = std::string::npos, len = 0;  // the first match; at one place, the longest
    for (const auto& x : stops) {
      const size_t at = out.held.find(x);
      if (at < cut || (at == cut && at != std::string::npos && x.size() > len)) {
        cut = at;
        len = x.size();
      }
    }
    if (cut != std::string::npos) {
      emit(out.held.substr(0, out.include_stop ? cut + len : cut));
      out.held.clear();
      out.stop_hit = true;
      stop_flag = true;  // the step loop finishes the sequence at its next step
      return;
    }
    const size_t keep = stop_prefix_len(out.held, stops);
    emit(out.held.substr(0, out.held.size() - keep));
    out.held.erase(0, out.held.size() - keep);
  } else {
    emit(std::move(out.held));
    out.held.clear();
  }
}

void Scheduler::observe_step(const Planner::Plan& plan) {
  if (plan.step.seqs.empty()) return;
  // One token per decoding sequence, and the chunks' tokens.
  auto tokens = static_cast<int64_t>(plan.step.seqs.size() - plan.chunks.size());
  for (const Planner::Chunk& c : plan.chunks) tokens += c.len;
  metrics_.iteration_tokens.observe(static_cast<double>(tokens));
}

// A step failed (send or replies): what runs fails, and a step sent ahead is lost with it.
void Scheduler::step_failed(size_t seqs, const Status& st) {
  const bool dead = st.code() == StatusCode::kUnavailable || !group_->healthy();
  if (dead) healthy_ = false, metrics_.healthy = 0;
  spdlog::error("step of {} sequence(s) failed: {}", seqs, st.message());
  fail_running(dead ? ErrorCode::kUnavailable : ErrorCode::kInternal,
               (dead ? "worker failure: " : "generation failed: ") + st.message());
  if (!dead) group_->end_session();  // the ranks free everything with the session
}

// Progress events of the step's chunks during its forward (rank 0 reports each layer).
LayerProgress Scheduler::layer_progress(const Planner::Plan& plan, bool* any) {
  *any = false;
  for (const Planner::Chunk& c : plan.chunks) {
    const Running* s = running(c.id);
    *any = *any || (s && s->job.request.return_progress);
  }
  if (!*any) return nullptr;
  return [this, chunks = plan.chunks](int done, int layers) {
    for (const Planner::Chunk& c : chunks) {
      Running* s = running(c.id);
      if (!s || !s->job.request.return_progress) continue;
      Event e;
      e.kind = Event::Kind::kProgress;
      e.fraction = (static_cast<double>(c.start) + static_cast<double>(c.len) * done / layers) /
                   static_cast<double>(s->prompt_len());
      s->job.stream->push(std::move(e));
    }
  };
}

// While every running sequence decodes and nothing waits, the next decode step goes out before
// this one's tokens are read (false when sending it failed: the step failed).
bool Scheduler::look_ahead(const Planner::Plan& plan) {
  bool queue_empty = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_empty = queue_.empty();
  }
  if (cancel_all_ || !planner_.can_look_ahead(plan, queue_empty)) return true;
  Planner::Plan next = planner_.continue_decode(plan);
  if (next.step.seqs.empty()) {
    planner_.keep(std::move(next.step));  // its releases and blocks go with the next step
    return true;
  }
  observe_step(next);
  if (Status st = group_->send_step(next.step); !st.ok()) {
    step_failed(plan.step.seqs.size(), st);
    return false;
  }
  ahead_ = std::move(next);
  ++metrics_.lookahead_steps;
  return true;
}

bool Scheduler::run_step() {
  drop_finished();
  Planner::Plan plan;
  LayerProgress on_layer;
  if (ahead_) {
    // Sent by the step before, while that one ran: now its tokens are read.
    plan = std::move(*ahead_);
    ahead_.reset();
  } else {
    plan = planner_.plan();
    if (plan.step.seqs.empty() && plan.step.release.empty() && plan.step.publish.empty() &&
        plan.step.evict.empty()) {
      return false;
    }
    bool progress = false;
    on_layer = layer_progress(plan, &progress);
    observe_step(plan);
    if (Status st = group_->send_step(plan.step, progress); !st.ok()) {
      step_failed(plan.step.seqs.size(), st);
      return true;
    }
  }
  if (!look_ahead(plan)) return true;
  auto result = group_->receive_step(on_layer);
  if (!result.ok()) {
    step_failed(plan.step.seqs.size(), result.status());
    return true;
  }
  take_outcome(plan, result.value());
  publish_gauges();
  return true;
}

// A step's outcome: the chunks' progress, prompt logprobs, then each token to output processing
// (in running order); sequences that end leave the batch.
void Scheduler::take_outcome(const Planner::Plan& plan, const StepOutcome& out) {
  int64_t used = 0;
  for (int64_t p : out.kv_used_pages) used += p;
  metrics_.kv_used_tokens = used * group_->info().kv_page_size;
  metrics_.kv_cached_tokens = out.kv.cached_pages * group_->info().kv_page_size *
                              static_cast<int64_t>(out.kv_used_pages.size());
  const auto now = Clock::now();
  const Planner::Update u = planner_.update(plan, out.tokens, group_->info().eos_token_id);
  for (const Planner::Progress& c : u.chunks) {
    Running* s = running(c.id);
    if (!s) continue;
    if (s->job.request.return_progress) {
      Event e;
      e.kind = Event::Kind::kProgress;
      e.fraction = static_cast<double>(c.prefilled) / static_cast<double>(s->prompt_len());
      s->job.stream->push(std::move(e));
    }
    if (c.prefill_done) {
      s->prefill_done = now;
      s->prefill_ms = ms_between(s->admitted, now);
    }
  }
  // Prompt logprobs go out before the step's tokens (those pass through output processing).
  for (const auto& pl : out.prompt_logprobs) {
    if (Running* s = running(pl.id)) {
      Event e;
      e.kind = Event::Kind::kPromptLogprobs;
      e.prompt_logprobs = pl.entries;
      s->job.stream->push(std::move(e));
    }
  }
  std::unordered_map<uint64_t, const runtime::SampledToken*> sampled;
  for (const auto& t : out.tokens) sampled[t.id] = &t;
  for (const Planner::Token& t : u.tokens) {
    Running& s = *running_.at(t.id);
    if (t.discard) {  // a prompt-only request: its prefill is all it asked for
      finish(s, t.id, t.reason);
      running_.erase(t.id);
      continue;
    }
    ++s.generated;
    ++metrics_.generation_tokens;
    auto o = s.out;
    auto stop_hit = s.stop_hit;
    Metrics* m = &metrics_;
    enqueue_output([o, stop_hit, token = t.token, now, is_stop = t.is_stop, m,
                    st = *sampled.at(t.id)] {
      process_token(*o, *stop_hit, token, now, is_stop, st, *m);
    });
    if (t.ends) {
      finish(s, t.id, t.reason);
      running_.erase(t.id);
    }
  }
  metrics_.lookahead_dropped += u.dropped;  // their sequences had ended
}

}  // namespace burst::server
