#include "server/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "server/worker_registry.h"

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

Scheduler::Scheduler(SchedulerOptions options, const Tokenizer& tokenizer, Metrics& metrics)
    : options_(std::move(options)), tokenizer_(tokenizer), metrics_(metrics) {
  metrics_.kv_capacity_tokens = options_.group.kv_capacity;
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  drain(std::chrono::milliseconds(0));
}

std::vector<int> Scheduler::worker_pids() const {
  std::lock_guard<std::mutex> lock(group_mu_);
  return group_ ? group_->pids() : std::vector<int>{};
}

std::string Scheduler::waiting_status() const {
  if (!options_.group.registry || healthy_) return "";
  return options_.group.registry->waiting_status();
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
  // Requests run one at a time with the whole capacity, so one that fits now fits later:
  // only a request larger than the capacity itself can never run.
  if (n + r.max_tokens > options_.group.kv_capacity) {
    return refuse(ErrorCode::kTooLarge,
                  "prompt (" + std::to_string(n) + " tokens) + max_tokens (" +
                      std::to_string(r.max_tokens) + ") exceeds the KV capacity of " +
                      std::to_string(options_.group.kv_capacity) + " tokens");
  }
  auto stream = std::make_shared<RequestStream>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_) return refuse(ErrorCode::kUnavailable, "the server is shutting down");
    if (options_.group.registry && !healthy_) {
      return refuse(ErrorCode::kUnavailable, waiting_status());
    }
    // max_queue counts requests that must wait: with an idle ring (nothing running, nothing
    // queued) a request is admitted even when max_queue is 0.
    const bool must_wait = running_ != nullptr || !queue_.empty();
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
  spdlog::info("worker group ready: {} worker(s), device {}, vocab {}",
               options_.group.workers, group_->info().device, group_->info().vocab_size);
  healthy_ = true;
  metrics_.healthy = 1;
  started_once_ = true;
  return GroupState::kReady;
}

void Scheduler::loop() {
  auto backoff = std::chrono::milliseconds(200);
  while (!stop_) {
    const GroupState state = ensure_group();
    if (state == GroupState::kWaiting) continue;  // await_remote() waited already
    if (state == GroupState::kFailed) {
      // Failed start: back off (up to 10 s) so a broken model does not spin the CPU.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, backoff, [&] { return stop_.load(); });
      backoff = std::min(backoff * 2, std::chrono::milliseconds(10000));
      continue;
    }
    backoff = std::chrono::milliseconds(200);
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Wake at least every 100 ms to notice an idle worker's death and restart the group.
      cv_.wait_for(lock, std::chrono::milliseconds(100),
                   [&] { return stop_.load() || !queue_.empty(); });
      if (stop_ || queue_.empty()) continue;
      job = std::move(queue_.front());
      queue_.pop_front();
      metrics_.waiting = static_cast<int64_t>(queue_.size());
      running_ = job.stream;
    }
    run(job);
    std::lock_guard<std::mutex> lock(mu_);
    running_.reset();
  }
}

void Scheduler::run(Job& job) {
  const ScheduledRequest& r = job.request;
  RequestStream& out = *job.stream;
  const auto start = Clock::now();
  const double queue_ms = ms_between(job.arrival, start);
  metrics_.queue.observe(queue_ms / 1000.0);
  const int64_t n_prompt = static_cast<int64_t>(r.prompt.size());
  if (out.cancelled()) {
    Event e;
    e.kind = Event::Kind::kFinished;
    e.finish = {"cancelled", n_prompt, 0, queue_ms, 0, 0, 0};
    out.push(std::move(e));
    ++metrics_.requests_cancelled;
    return;
  }
  {
    Event e;
    e.kind = Event::Kind::kStarted;
    e.prompt_tokens = n_prompt;
    e.queue_ms = queue_ms;
    out.push(std::move(e));
  }
  if (r.return_progress) {
    Event e;
    e.kind = Event::Kind::kProgress;
    e.fraction = 0;
    out.push(std::move(e));
  }
  metrics_.running = 1;
  metrics_.kv_used_tokens = n_prompt;
  metrics_.prompt_tokens += static_cast<uint64_t>(n_prompt);

  models::GenerateRequest greq;
  greq.prompt = r.prompt;
  greq.max_tokens = r.max_tokens;
  greq.sampling = r.sampling;
  greq.stop_at_eos = true;
  const int32_t eos = group_->info().eos_token_id;
  StreamDecoder decoder(tokenizer_, r.prompt.back());
  std::string held;  // decoded text not yet sent: it may be the start of a stop string
  int64_t completion = 0;
  bool stop_hit = false;
  Clock::time_point first{}, last{};
  auto emit = [&](int32_t id, std::string text) {
    Event e;
    e.kind = Event::Kind::kToken;
    e.token = id;
    e.text = std::move(text);
    if (completion == 1) e.ttft_ms = ms_between(job.arrival, first);
    out.push(std::move(e));
  };
  auto on_token = [&](int32_t id) -> bool {
    const auto now = Clock::now();
    ++completion;
    ++metrics_.kv_used_tokens;
    ++metrics_.generation_tokens;
    if (completion == 1) {
      first = now;
      metrics_.ttft.observe(ms_between(job.arrival, now) / 1000.0);
    } else {
      metrics_.tpot.observe(ms_between(last, now) / 1000.0);
    }
    last = now;
    if (out.cancelled()) return false;
    if (id == eos) return true;  // the worker stops after EOS; EOS has no text
    held += decoder.push(id);
    if (!r.stop.empty()) {
      size_t cut = std::string::npos;
      for (const auto& s : r.stop) cut = std::min(cut, held.find(s));
      if (cut != std::string::npos) {
        emit(id, held.substr(0, cut));
        held.clear();
        stop_hit = true;
        return false;
      }
      const size_t keep = stop_prefix_len(held, r.stop);
      emit(id, held.substr(0, held.size() - keep));
      held.erase(0, held.size() - keep);
    } else {
      emit(id, std::move(held));
      held.clear();
    }
    return true;
  };
  // After every prefill layer: the fraction done for clients that asked, and the chance to
  // cancel a long prefill whose client is gone (the workers stop at the next layer).
  auto on_progress = [&](double fraction) -> bool {
    if (r.return_progress) {
      Event e;
      e.kind = Event::Kind::kProgress;
      e.fraction = fraction;
      out.push(std::move(e));
    }
    return !out.cancelled();
  };
  auto result = group_->generate(greq, on_token, on_progress);
  metrics_.running = 0;
  metrics_.kv_used_tokens = 0;  // generate() returned: every rank has cleared its KV shard
  const auto end = Clock::now();
  if (!result.ok()) {
    // A surviving rank can report the broken ring before the supervisor (polling every 20 ms)
    // has reaped the dead one: give it a moment, so a worker death is told apart from an
    // engine error (UNAVAILABLE, retry, versus INTERNAL).
    for (int i = 0; i < 25 && group_->healthy(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const bool dead = !group_->healthy();
    // Unhealthy before the error is pushed: a client that reads the error and asks /health at
    // once must not still see "ok" from a group that is gone.
    if (dead) healthy_ = false, metrics_.healthy = 0;
    Event e;
    e.kind = Event::Kind::kError;
    e.error = {dead ? ErrorCode::kUnavailable : ErrorCode::kInternal,
               (dead ? "worker failure: " : "generation failed: ") + result.message()};
    spdlog::error("{} failed: {}", r.id, e.error.message);
    out.push(std::move(e));
    ++metrics_.requests_failed;
    return;
  }
  const models::GenerateStats& s = result.value().stats;
  if (!stop_hit && !out.cancelled()) {
    // Text the decoder or the stop-string check still held: the generation ended without
    // completing a stop string, so it belongs to the output.
    held += decoder.flush();
    if (!held.empty()) {
      Event e;
      e.kind = Event::Kind::kToken;
      e.token = -1;
      e.text = std::move(held);
      out.push(std::move(e));
    }
  }
  FinishInfo f;
  f.reason = stop_hit ? "stop" : out.cancelled() ? "cancelled" : s.finish_reason;
  f.prompt_tokens = n_prompt;
  f.completion_tokens = completion;
  f.queue_ms = queue_ms;
  f.prefill_ms = s.prefill_ms;
  f.ttft_ms = completion > 0 ? ms_between(job.arrival, first) : 0;
  f.decode_tokens_per_s = completion > 1 && last > first
                              ? (completion - 1) * 1000.0 / ms_between(first, last)
                              : 0;
  metrics_.e2e.observe(ms_between(job.arrival, end) / 1000.0);
  if (f.reason == "cancelled") {
    ++metrics_.requests_cancelled;
  } else {
    ++metrics_.requests_ok;
  }
  spdlog::info("{} done: prompt {} tokens, queue {:.1f} ms, prefill {:.1f} ms, TTFT {:.1f} ms, "
               "{} tokens at {:.1f} tok/s, finish {}",
               r.id, n_prompt, queue_ms, f.prefill_ms, f.ttft_ms, completion,
               f.decode_tokens_per_s, f.reason);
  Event e;
  e.kind = Event::Kind::kFinished;
  e.finish = std::move(f);
  out.push(std::move(e));
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
    return queue_.empty() && !running_;
  };
  while (!idle() && Clock::now() < deadline && healthy_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& job : queue_) job.stream->cancel();
    if (running_) running_->cancel();
  }
  // Cancelled jobs finish at their next token; queued ones are answered "cancelled" at once.
  const auto hard = Clock::now() + std::chrono::seconds(30);
  while (!idle() && Clock::now() < hard && healthy_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
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
