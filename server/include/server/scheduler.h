// The scheduler between the APIs (HTTP, gRPC) and the worker group. Requests are plain C++
// structs (no protobuf). submit() validates and admits synchronously: a request that can never
// fit the KV capacity is refused at once (kTooLarge), a full queue or a draining server gives
// kUnavailable; an admitted request waits in a FIFO queue. One scheduler thread runs the queue
// through WorkerGroup::generate (the ring serves one request at a time) and delivers events to
// the request's RequestStream, a thread-safe queue the API thread reads. The scheduler thread
// also starts the worker group (the server answers /health 503 meanwhile) and restarts it when a
// worker dies: the request in flight fails with kUnavailable within a fraction of a second,
// queued ones wait for the fresh group. With remote workers (multi-node) the fresh group forms
// only when enough `burst-worker --join` processes registered, which may take an operator:
// until then requests are refused at once with kUnavailable ("waiting for workers (k/N
// registered ...)") instead of queueing for an unknown time.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "server/metrics.h"
#include "server/tokenizer.h"
#include "server/worker_group.h"

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
};

struct ScheduledRequest {
  std::string id;  // for logs and responses ("cmpl-...", "req-...")
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  engine::SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: the text ends before the first match
  bool return_progress = false;
};

struct FinishInfo {
  std::string reason;  // "stop", "length", "cancelled"
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  double queue_ms = 0;
  double prefill_ms = 0;
  double ttft_ms = 0;  // arrival to first token
  double decode_tokens_per_s = 0;
};

struct Event {
  enum class Kind { kStarted, kProgress, kToken, kFinished, kError };
  Kind kind = Kind::kToken;
  int64_t prompt_tokens = 0;  // kStarted
  double queue_ms = 0;        // kStarted
  double fraction = 0;        // kProgress: prompt fraction prefilled
  int32_t token = 0;          // kToken
  std::string text;           // kToken: text this token completes (held back near a stop string)
  double ttft_ms = -1;        // kToken: set on the first token only
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
  WorkerGroupOptions group;
  int64_t max_context = 0;  // longest prompt
  int max_tokens_limit = 0;
  int max_queue = 64;
  int vocab_size = 0;  // prompt ids must be below it (the model's config)
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, const Tokenizer& tokenizer, Metrics& metrics);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates and queues; on refusal returns nullptr and sets *error.
  std::shared_ptr<RequestStream> submit(ScheduledRequest request, ApiError* error);
  // True once the worker group serves and while it stays up.
  bool healthy() const { return healthy_.load(); }
  bool draining() const { return draining_.load(); }
  // Remote workers: "waiting for workers (k/N registered ...)" while the group is not serving;
  // otherwise empty.
  std::string waiting_status() const;
  // Refuses new requests, lets queued and running ones finish for up to `grace`, cancels the
  // rest, then stops the worker group. Safe to call once from any thread.
  void drain(std::chrono::milliseconds grace);
  int64_t kv_capacity() const { return options_.group.kv_capacity; }
  int64_t max_context() const { return options_.max_context; }
  int max_tokens_limit() const { return options_.max_tokens_limit; }
  int vocab_size() const { return options_.vocab_size; }
  int workers() const { return options_.group.workers; }
  const std::string& device() const { return options_.group.device; }
  // Worker pids (tests kill one); empty while no group runs.
  std::vector<int> worker_pids() const;

 private:
  struct Job {
    ScheduledRequest request;
    std::shared_ptr<RequestStream> stream;
    std::chrono::steady_clock::time_point arrival;
  };
  enum class GroupState { kReady, kWaiting, kFailed };
  void loop();
  GroupState ensure_group();  // starts, restarts or awaits the group
  void run(Job& job);
  void fail_queued(const std::string& why);

  SchedulerOptions options_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  std::unique_ptr<WorkerGroup> group_;  // touched by the scheduler thread only, after start
  mutable std::mutex group_mu_;         // guards the group_ pointer for worker_pids()
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;            // under mu_
  std::shared_ptr<RequestStream> running_;  // under mu_
  std::atomic<bool> healthy_{false};
  std::atomic<bool> draining_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> started_once_{false};
  std::thread thread_;
};

}  // namespace burst::server
