#include "frontend/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "group/worker_registry.h"

namespace burst::server {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

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


std::vector<int64_t> kv_pages_needed(int64_t prompt, int64_t max_tokens, int64_t chunk,
                                     int world, engine::ShardLayout layout, int page_size,
                                     bool mixed_chunks) {
  std::vector<int64_t> rows(static_cast<size_t>(world), 0);
  if (chunk <= 0) chunk = prompt;
  for (int64_t start = 0; start < prompt; start += chunk) {
    const auto plan = engine::ShardPlan::make(layout, std::min(chunk, prompt - start), world, start);
    for (int r = 0; r < world; ++r) rows[static_cast<size_t>(r)] += plan.real_rows(r);
  }
  if (mixed_chunks) {
    for (auto& n : rows) n = std::max(n, std::min(prompt, prompt / world + 2));
  }
  // Decode tokens at positions prompt .. prompt + max_tokens - 1 (the last one is never fed
  // back, counted anyway): rank p mod N caches position p.
  for (int r = 0; r < world; ++r) {
    const int64_t first = prompt + ((r - prompt % world) % world + world) % world;
    const int64_t end = prompt + max_tokens;
    rows[static_cast<size_t>(r)] += first < end ? (end - first + world - 1) / world : 0;
  }
  std::vector<int64_t> pages(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) pages[r] = (rows[r] + page_size - 1) / page_size;
  return pages;
}

// A request's output processing, touched by the output thread only (after admission).
struct Scheduler::Output {
  Output(const Tokenizer& tok, const ScheduledRequest& r, std::shared_ptr<RequestStream> s,
         Clock::time_point arrival)
      : stream(std::move(s)), decoder(tok, r.prompt.back()), stop(r.stop), id(r.id),
        arrival(arrival) {}
  std::shared_ptr<RequestStream> stream;
  StreamDecoder decoder;
  std::vector<std::string> stop;
  std::string id;
  Clock::time_point arrival;
  std::string held;  // decoded text not yet sent: it may be the start of a stop string
  int64_t completion = 0;
  Clock::time_point first{}, last{};
  bool stop_hit = false;
};

// A running sequence, touched by the step loop only.
struct Scheduler::Seq {
  uint64_t id = 0;
  Job job;
  std::shared_ptr<Output> out;
  std::shared_ptr<std::atomic<bool>> stop_hit;  // set by output processing
  std::vector<int64_t> pages;                   // reserved per rank
  int64_t prefilled = 0;
  int64_t generated = 0;
  int32_t last_token = -1;
  Clock::time_point admitted, prefill_done;
  double queue_ms = 0, prefill_ms = 0;
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
    const int64_t parts = 2 * int64_t{std::max(options_.group.workers, 1)};
    if (small > 0 && !(full > 0 && small < full && full % parts == 0 && small % parts == 0)) {
      if (small < full || full <= 0) {
        spdlog::warn("prefill chunk while decoding ({}) unused: it and the prefill chunk ({}) "
                     "must be multiples of 2 x workers ({}), and it smaller",
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

std::vector<int> Scheduler::worker_pids() const {
  std::lock_guard<std::mutex> lock(group_mu_);
  return group_ ? group_->pids() : std::vector<int>{};
}

std::string Scheduler::waiting_status() const {
  if (!options_.group.registry || healthy_) return "";
  return options_.group.registry->waiting_status();
}

std::optional<ApiError> Scheduler::check_prompt_text(size_t bytes) {
  const int64_t limit = options_.max_prompt_bytes;
  if (limit <= 0 || static_cast<int64_t>(bytes) <= limit) return std::nullopt;
  ++metrics_.requests_rejected;
  return ApiError{ErrorCode::kTooLarge,
                  "the prompt is " + std::to_string(bytes) + " bytes of text, over the limit of " +
                      std::to_string(limit) + " bytes (--max-prompt-bytes; by default the most "
                      "text " + std::to_string(options_.max_context) +
                      " tokens of context can hold); it was not tokenized"};
}

std::shared_ptr<RequestStream> Scheduler::submit(ScheduledRequest r, ApiError* error) {
  auto refuse = [&](ErrorCode code, std::string msg) -> std::shared_ptr<RequestStream> {
    *error = {code, std::move(msg)};
    ++metrics_.requests_rejected;
    return nullptr;
  };
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  if (n == 0) return refuse(ErrorCode::kInvalidArgument, "the prompt is empty");
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= options_.vocab_size) {
      return refuse(ErrorCode::kInvalidArgument,
                    "prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                        std::to_string(options_.vocab_size) + ")");
    }
  }
  if (n > options_.max_context) {
    return refuse(ErrorCode::kInvalidArgument,
                  "the prompt has " + std::to_string(n) + " tokens, over the model's limit of " +
                      std::to_string(options_.max_context));
  }
  if (r.max_tokens <= 0 || r.max_tokens > options_.max_tokens_limit) {
    return refuse(ErrorCode::kInvalidArgument,
                  "max_tokens must be in 1.." + std::to_string(options_.max_tokens_limit) +
                      ", got " + std::to_string(r.max_tokens));
  }
  if (const std::string bad = engine::validate(r.sampling); !bad.empty()) {
    return refuse(ErrorCode::kInvalidArgument, bad);
  }
  for (const auto& s : r.stop) {
    if (s.empty()) return refuse(ErrorCode::kInvalidArgument, "a stop string is empty");
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
                      std::to_string(capacity) + " tokens");
  }
  auto stream = std::make_shared<RequestStream>();
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
    e.error = {ErrorCode::kUnavailable, why};
    job.stream->push(std::move(e));
    ++metrics_.requests_failed;
  }
}

Scheduler::GroupState Scheduler::ensure_group() {
  if (group_ && group_->healthy()) return GroupState::kReady;
  healthy_ = false;
  metrics_.healthy = 0;
  if (stop_) return GroupState::kFailed;
  if (!group_) {
    if (options_.group.registry) {
      spdlog::info("waiting for {} remote worker(s) (burst-worker --join) on {}",
                   options_.group.workers, options_.group.registry->options().listen);
    } else {
      spdlog::info("starting {} worker(s) on {} for {}", options_.group.workers,
                   options_.group.device,
                   options_.group.model.dir.empty() ? options_.group.model.preset
                                                    : options_.group.model.dir);
    }
    auto g = WorkerGroup::start(options_.group);
    if (!g.ok() && stop_) {
      spdlog::info("worker group start abandoned: {}", g.message());
      return GroupState::kFailed;
    }
    if (!g.ok()) {
      spdlog::error("worker group failed to start: {}", g.message());
      fail_queued("the worker group failed to start: " + g.message());
      return GroupState::kFailed;
    }
    std::lock_guard<std::mutex> lock(group_mu_);
    group_ = g.take();
  } else if (!group_->awaiting_workers()) {
    spdlog::warn("worker group unhealthy; restarting it");
    ++metrics_.worker_restarts;
    const Status st = group_->restart();
    if (!st.ok()) {
      spdlog::error("worker group restart failed: {}", st.message());
      fail_queued("the worker group failed to restart: " + st.message());
      return GroupState::kFailed;
    }
  }
  if (group_->remote()) {
    // Nobody knows when the missing workers come: refuse what waits rather than queue it.
    fail_queued(group_->waiting_status());
    auto formed = group_->await_remote(std::chrono::milliseconds(200));
    if (!formed.ok()) {
      spdlog::error("remote worker group: {}", formed.message());
      return GroupState::kWaiting;
    }
    if (!formed.value()) return GroupState::kWaiting;
  }
  spdlog::info("worker group ready: {} worker(s), device {}, vocab {}, KV {} pages of {} tokens "
               "per rank",
               options_.group.workers, group_->info().device, group_->info().vocab_size,
               group_->info().kv_pages, group_->info().kv_page_size);
  // A fresh group holds nothing: the ledger starts full.
  free_pages_.assign(static_cast<size_t>(options_.group.workers), group_->info().kv_pages);
  kv_capacity_ = group_->kv_capacity_tokens();
  metrics_.kv_capacity_tokens = kv_capacity_.load();
  to_release_.clear();
  healthy_ = true;
  metrics_.healthy = 1;
  started_once_ = true;
  return GroupState::kReady;
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
  const int world = options_.group.workers;
  while (static_cast<int>(running_.size()) < options_.max_running) {
    enum class What { kRun, kCancelled, kNever } what = What::kRun;
    std::vector<int64_t> need;
    auto seq = std::make_unique<Seq>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) break;
      Job& head = queue_.front();
      const ScheduledRequest& r = head.request;
      if (head.stream->cancelled()) {
        what = What::kCancelled;
      } else {
        need = kv_pages_needed(static_cast<int64_t>(r.prompt.size()), r.max_tokens,
                               options_.group.prefill_chunk, world, options_.group.layout,
                               info.kv_page_size, options_.prefill_chunk_decoding > 0);
        bool later = false;
        for (size_t k = 0; k < need.size(); ++k) {
          if (need[k] > info.kv_pages) what = What::kNever;
          later = later || need[k] > free_pages_[k];
        }
        // FIFO: the head waits for pages (finishing sequences free them); nothing passes it.
        if (what == What::kRun && later) break;
      }
      seq->job = std::move(head);
      queue_.pop_front();
      ++in_flight_;
    }
    seq->queue_ms = ms_between(seq->job.arrival, Clock::now());
    if (what == What::kCancelled) {
      finish(*seq, "cancelled");
      continue;
    }
    if (what == What::kNever) {
      // Page rounding and chunk padding can need more than the token count submit() checked.
      const ApiError err{ErrorCode::kTooLarge,
                         "the request needs more KV pages than a worker holds (" +
                             std::to_string(info.kv_pages) + " pages of " +
                             std::to_string(info.kv_page_size) + " tokens)"};
      finish(*seq, "", &err);
      continue;
    }
    for (size_t k = 0; k < need.size(); ++k) free_pages_[k] -= need[k];
    seq->pages = std::move(need);
    Seq& s = *seq;
    running_.push_back(std::move(seq));
    s.id = next_id_++;
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
  publish_gauges();
}

void Scheduler::finish(Seq& s, const std::string& reason, const ApiError* error) {
  if (s.id != 0) to_release_.push_back(s.id);
  for (size_t r = 0; r < s.pages.size() && r < free_pages_.size(); ++r) {
    free_pages_[r] += s.pages[r];
  }
  s.pages.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
  }
  const auto end = Clock::now();
  auto stream = s.job.stream;
  if (error) {
    ApiError err = *error;
    const std::string id = s.job.request.id;
    ++metrics_.requests_failed;
    enqueue_output([stream, err, id] {
      spdlog::error("{} failed: {}", id, err.message);
      Event e;
      e.kind = Event::Kind::kError;
      e.error = err;
      stream->push(std::move(e));
    });
    return;
  }
  auto out = s.out;
  FinishInfo f;
  f.reason = reason;
  f.prompt_tokens = s.prompt_len();
  f.queue_ms = s.queue_ms;
  f.prefill_ms = s.prefill_ms;
  const double decode_ms = s.generated > 0 ? ms_between(s.prefill_done, end) : 0;
  const double e2e_s = ms_between(s.job.arrival, end) / 1000.0;
  const std::string id = s.job.request.id;
  Metrics* m = &metrics_;
  if (s.generated > 0) {
    metrics_.prefill_time.observe(s.prefill_ms / 1000.0);
    metrics_.decode_time.observe(decode_ms / 1000.0);
  }
  enqueue_output([out, stream, f, decode_ms, e2e_s, id, m]() mutable {
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
    if (out->stop_hit) f.reason = "stop";
    if (stream->cancelled()) f.reason = "cancelled";
    f.completion_tokens = out->completion;
    f.ttft_ms = out->completion > 0 ? ms_between(out->arrival, out->first) : 0;
    f.decode_tokens_per_s = out->completion > 1 && out->last > out->first
                                ? (out->completion - 1) * 1000.0 / ms_between(out->first, out->last)
                                : 0;
    m->e2e.observe(e2e_s);
    if (f.reason == "cancelled") {
      ++m->requests_cancelled;
    } else {
      ++m->requests_ok;
      ++(f.reason == "length" ? m->success_length : m->success_stop);
    }
    spdlog::info("{} done: prompt {} tokens, queue {:.1f} ms, prefill {:.1f} ms, TTFT {:.1f} ms, "
                 "decode {:.1f} ms for {} tokens ({:.1f} tok/s), finish {}",
                 id, f.prompt_tokens, f.queue_ms, f.prefill_ms, f.ttft_ms, decode_ms,
                 f.completion_tokens, f.decode_tokens_per_s, f.reason);
    Event e;
    e.kind = Event::Kind::kFinished;
    e.finish = std::move(f);
    stream->push(std::move(e));
  });
}

void Scheduler::fail_running(ErrorCode code, const std::string& why) {
  ahead_.reset();  // a step sent ahead belonged to the same session or group
  ApiError err{code, why};
  for (auto& s : running_) finish(*s, "", &err);
  running_.clear();
  to_release_.clear();  // the group is gone or its session ended: nothing to release
  publish_gauges();
}

// Sequences whose client left, or whose output hit a stop string, leave the batch first; after
// a drain's timeout, every running sequence ends with an error that says so.
void Scheduler::drop_finished() {
  if (cancel_all_) {
    // Drain ran out of time: what still runs ends with an error event that says so (never a
    // silent finish_reason null, which a client reads as an empty normal answer).
    for (auto& sp : running_) {
      if (sp->job.stream->cancelled()) continue;  // the client left: a plain cancel
      const ApiError err{ErrorCode::kUnavailable,
                         "the server is shutting down: the drain timeout ended this request "
                         "after " + std::to_string(sp->generated) + " generated token(s)"};
      finish(*sp, "", &err);
      sp.reset();
    }
    running_.erase(std::remove(running_.begin(), running_.end(), nullptr), running_.end());
  }
  for (size_t i = 0; i < running_.size();) {
    Seq& s = *running_[i];
    const bool cancelled = s.job.stream->cancelled();
    if (cancelled || s.stop_hit->load()) {
      finish(s, cancelled ? "cancelled" : "stop");
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
}

// The step's work: decode first (every sequence past its prompt advances one token), then
// prefill chunks while the token budget lasts. chunks gets the prefill chunks, in plan order.
runtime::StepPlan Scheduler::plan_step(std::vector<Chunk>& chunks) {
  runtime::StepPlan plan;
  plan.layout = options_.group.layout;
  plan.release.swap(to_release_);
  int64_t budget = options_.max_batched_tokens;
  int64_t chunk = options_.group.prefill_chunk;
  // Decode first: every sequence past its prompt advances one token per step.
  for (auto& sp : running_) {
    Seq& s = *sp;
    if (s.prefilled < s.prompt_len()) continue;
    runtime::SeqWork w = runtime::decode_work(s.id, s.last_token,
                                            s.prompt_len() + s.generated - 1, s.prompt_len(),
                                            s.job.request.sampling);
    w.adjust = s.job.request.adjust;
    w.logprobs = s.job.request.logprobs;
    plan.seqs.push_back(std::move(w));
    --budget;
  }
  // Decoding sequences wait one step per token: while any decode, prefill in smaller chunks.
  if (!plan.seqs.empty() && options_.prefill_chunk_decoding > 0) {
    chunk = options_.prefill_chunk_decoding;
  }
  // Then prefill chunks, the prompt with the fewest tokens left first (shortest remaining work
  // first: a 100-token prompt that arrives during a 128K prefill goes into the next step), in
  // arrival order among equals, while the budget lasts; a chunk that does not fit waits for the
  // next step, but a step always makes progress.
  std::vector<Seq*> waiting_prefill;
  for (auto& sp : running_) {
    if (sp->prefilled < sp->prompt_len()) waiting_prefill.push_back(sp.get());
  }
  std::stable_sort(waiting_prefill.begin(), waiting_prefill.end(), [](Seq* a, Seq* b) {
    return a->prompt_len() - a->prefilled < b->prompt_len() - b->prefilled;
  });
  // A prompt that fits in one chunk and waits while a long prompt's full chunk would share its
  // step runs in a step of its own first (a few ms instead of a chunk's time: its TTFT), but
  // never twice in a row, so a stream of short prompts cannot stall a long prefill.
  const int64_t full = chunk > 0 ? chunk : std::numeric_limits<int64_t>::max();
  bool short_waiting = false;
  for (Seq* sp : waiting_prefill) short_waiting |= sp->prompt_len() - sp->prefilled < full;
  const bool defer_full = short_waiting && !deferred_full_;
  deferred_full_ = false;
  for (Seq* sp : waiting_prefill) {
    Seq& s = *sp;
    if (defer_full && s.prompt_len() - s.prefilled >= full) {
      deferred_full_ = true;
      continue;
    }
    const int64_t len = std::min(chunk > 0 ? chunk : s.prompt_len(), s.prompt_len() - s.prefilled);
    if (len > budget && !plan.seqs.empty()) continue;
    runtime::SeqWork w =
        runtime::prefill_work(s.id, s.job.request.prompt, s.prefilled, len, s.job.request.sampling);
    w.adjust = s.job.request.adjust;
    w.logprobs = s.job.request.logprobs;
    w.prompt_logprobs = s.job.request.prompt_logprobs;
    if (w.prompt_logprobs >= 0 && s.prefilled + len < s.prompt_len()) {
      w.next_token = s.job.request.prompt[static_cast<size_t>(s.prefilled + len)];
    }
    plan.seqs.push_back(std::move(w));
    chunks.push_back({&s, s.prefilled, len});
    budget -= len;
  }
  return plan;
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
  if (is_eos) return;  // the sequence stops after EOS; EOS has no text
  out.held += out.decoder.push(token);
  // The request's stop strings, copied once into its Output at admission.
  const std::vector<std::string>& stops = out.stop;
  if (!stops.empty()) {
    size_t cut = std::string::npos;
    for (const auto& x : stops) cut = std::min(cut, out.held.find(x));
    if (cut != std::string::npos) {
      emit(out.held.substr(0, cut));
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

void Scheduler::observe_step(const runtime::StepPlan& plan, const std::vector<Chunk>& chunks) {
  if (plan.seqs.empty()) return;
  // One token per decoding sequence, and the chunks' tokens.
  auto tokens = static_cast<int64_t>(plan.seqs.size() - chunks.size());
  for (const Chunk& c : chunks) tokens += c.len;
  metrics_.iteration_tokens.observe(static_cast<double>(tokens));
}

// Whether the step after `plan` (in flight, its tokens not read yet) can be sent now: every
// running sequence decodes (so `plan` is decode rows only) and no request waits for admission
// (it would join the next planned step, one step later than without the lookahead otherwise).
bool Scheduler::can_look_ahead(const runtime::StepPlan& plan, const std::vector<Chunk>& chunks) {
  if (!options_.decode_lookahead || plan.seqs.empty() || !chunks.empty() || cancel_all_) {
    return false;
  }
  for (const auto& sp : running_) {
    if (sp->prefilled < sp->prompt_len()) return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty();
}

// The decode step after `plan`: each of its sequences that is still running and will not end
// by max_tokens at `plan` feeds the token `plan` draws (kPreviousToken; a sequence `plan`
// ends by EOS runs one wasted row, its token is dropped and it is released a step later).
runtime::StepPlan Scheduler::continue_decode(const runtime::StepPlan& plan) {
  runtime::StepPlan next;
  next.layout = plan.layout;
  next.release.swap(to_release_);
  for (const runtime::SeqWork& w : plan.seqs) {
    const auto it = std::find_if(running_.begin(), running_.end(),
                                 [&](const std::unique_ptr<Seq>& sp) { return sp->id == w.id; });
    if (it == running_.end()) continue;
    const Seq& s = **it;
    // `plan` draws token number generated + 1; the next row feeds it.
    if (s.generated + 1 >= s.job.request.max_tokens) continue;
    runtime::SeqWork n = runtime::decode_work(s.id, runtime::kPreviousToken,
                                            s.prompt_len() + s.generated, s.prompt_len(),
                                            s.job.request.sampling);
    n.adjust = s.job.request.adjust;
    n.logprobs = s.job.request.logprobs;
    next.seqs.push_back(std::move(n));
  }
  return next;
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

bool Scheduler::run_step() {
  const int32_t eos = group_->info().eos_token_id;
  drop_finished();
  std::vector<Chunk> chunks;
  runtime::StepPlan plan;
  LayerProgress on_layer;
  if (ahead_) {
    // Sent by the step before, while that one ran: now its tokens are read.
    plan = std::move(*ahead_);
    ahead_.reset();
  } else {
    plan = plan_step(chunks);
    if (plan.seqs.empty() && plan.release.empty()) return false;
    bool progress = false;
    for (const Chunk& c : chunks) progress = progress || c.seq->job.request.return_progress;
    if (progress) {
      on_layer = [&](int done, int layers) {
        for (const Chunk& c : chunks) {
          if (!c.seq->job.request.return_progress) continue;
          Event e;
          e.kind = Event::Kind::kProgress;
          e.fraction = (static_cast<double>(c.start) + static_cast<double>(c.len) * done / layers) /
                       static_cast<double>(c.seq->prompt_len());
          c.seq->job.stream->push(std::move(e));
        }
      };
    }
    observe_step(plan, chunks);
    if (Status st = group_->send_step(plan, progress); !st.ok()) {
      step_failed(plan.seqs.size(), st);
      return true;
    }
  }
  if (can_look_ahead(plan, chunks)) {
    runtime::StepPlan next = continue_decode(plan);
    if (!next.seqs.empty()) {
      observe_step(next, {});
      if (Status st = group_->send_step(next); !st.ok()) {
        step_failed(plan.seqs.size(), st);
        return true;
      }
      ahead_ = std::move(next);
      ++metrics_.lookahead_steps;
    } else {
      to_release_.swap(next.release);  // nothing to send: they go with the next step
    }
  }
  auto result = group_->receive_step(on_layer);
  if (!result.ok()) {
    step_failed(plan.seqs.size(), result.status());
    return true;
  }
  const StepOutcome& out = result.value();
  int64_t used = 0;
  for (int64_t p : out.kv_used_pages) used += p;
  metrics_.kv_used_tokens = used * group_->info().kv_page_size;
  const auto now = Clock::now();
  for (const Chunk& c : chunks) {
    c.seq->prefilled += c.len;
    if (c.seq->job.request.return_progress) {
      Event e;
      e.kind = Event::Kind::kProgress;
      e.fraction = static_cast<double>(c.seq->prefilled) / static_cast<double>(c.seq->prompt_len());
      c.seq->job.stream->push(std::move(e));
    }
    if (c.seq->prefilled == c.seq->prompt_len()) {
      c.seq->prefill_done = now;
      c.seq->prefill_ms = ms_between(c.seq->admitted, now);
    }
  }
  // Prompt logprobs go out before the step's tokens (those pass through output processing).
  for (const auto& pl : out.prompt_logprobs) {
    for (auto& sp : running_) {
      if (sp->id != pl.id) continue;
      Event e;
      e.kind = Event::Kind::kPromptLogprobs;
      e.prompt_logprobs = pl.entries;
      sp->job.stream->push(std::move(e));
    }
  }
  std::unordered_map<uint64_t, const runtime::SampledToken*> sampled;
  for (const auto& t : out.tokens) sampled[t.id] = &t;
  size_t taken = 0;
  for (size_t i = 0; i < running_.size();) {
    Seq& s = *running_[i];
    const auto it = sampled.find(s.id);
    if (it == sampled.end()) {
      ++i;
      continue;
    }
    ++taken;
    const int32_t token = it->second->token;
    runtime::SampledToken st = *it->second;
    ++s.generated;
    s.last_token = token;
    ++metrics_.generation_tokens;
    auto o = s.out;
    auto stop_hit = s.stop_hit;
    const ScheduledRequest* r = &s.job.request;
    const bool is_eos = token == eos && !r->ignore_eos;
    Metrics* m = &metrics_;
    enqueue_output([o, stop_hit, token, now, is_eos, m, st = std::move(st)] {
      process_token(*o, *stop_hit, token, now, is_eos, st, *m);
    });
    if (is_eos || s.generated >= r->max_tokens) {
      finish(s, is_eos ? "stop" : "length");
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  metrics_.lookahead_dropped += out.tokens.size() - taken;  // their sequences had ended
  publish_gauges();
  return true;
}

void Scheduler::loop() {
  auto backoff = std::chrono::milliseconds(200);
  while (!stop_) {
    const GroupState state = ensure_group();
    if (state != GroupState::kReady) {
      // The sequences in flight belonged to the dead group.
      if (!running_.empty()) fail_running(ErrorCode::kUnavailable, "worker failure: the group died");
    }
    if (state == GroupState::kWaiting) continue;  // await_remote() waited already
    if (state == GroupState::kFailed) {
      // Failed start: back off (up to 10 s) so a broken model does not spin the CPU.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, backoff, [&] { return stop_.load(); });
      backoff = std::min(backoff * 2, std::chrono::milliseconds(10000));
      continue;
    }
    backoff = std::chrono::milliseconds(200);
    admit();
    if (run_step()) continue;
    std::unique_lock<std::mutex> lock(mu_);
    // Idle: wake for new work, or at least every 100 ms to notice an idle worker's death.
    cv_.wait_for(lock, std::chrono::milliseconds(100),
                 [&] { return stop_.load() || !queue_.empty(); });
  }
  if (!running_.empty()) fail_running(ErrorCode::kUnavailable, "the server is shutting down");
}

void Scheduler::drain(std::chrono::milliseconds grace) {
  if (draining_.exchange(true)) {
    if (thread_.joinable() && stop_) thread_.join();
    return;
  }
  spdlog::info("draining: no new requests; {} ms for the ones in flight", grace.count());
  const auto deadline = Clock::now() + grace;
  auto idle = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.empty() && in_flight_ == 0;
  };
  while (!idle() && Clock::now() < deadline && healthy_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Out of time: queued requests get an error event saying why (not a silent cancel), running
  // ones leave at the next step with one (run_step).
  fail_queued("the server is shutting down: the drain timeout (" +
              std::to_string(grace.count()) + " ms) ended this request before it started");
  cancel_all_ = true;
  const auto hard = Clock::now() + std::chrono::seconds(30);
  while (!idle() && Clock::now() < hard && healthy_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // A group still starting (minutes for a large model) is abandoned at once: its ranks are
  // stopped and the scheduler's thread returns.
  options_.group.start_progress->cancel = true;
  stop_ = true;
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  fail_queued("the server is shutting down");
  std::lock_guard<std::mutex> lock(group_mu_);
  group_.reset();  // stops every worker
  healthy_ = false;
  metrics_.healthy = 0;
}

}  // namespace burst::server
