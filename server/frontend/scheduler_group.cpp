// The scheduler's worker group (frontend/scheduler.h): the step loop's thread, which starts,
// restarts or awaits the group (ensure_group), warms a fresh one up before it serves, gives up
// on a group that fails to start twice the same way, and the drain that stops it all. The
// requests' side of the loop (admission, steps, output processing) is in scheduler.cpp.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <regex>

#include "frontend/scheduler.h"
#include "group/worker_registry.h"
#include "scheduler_internal.h"

namespace burst::server {

std::vector<int> Scheduler::worker_pids() const {
  std::lock_guard<std::mutex> lock(group_mu_);
  return group_ ? group_->pids() : std::vector<int>{};
}

std::string Scheduler::waiting_status() const {
  if (!options_.group.registry || healthy_) return "";
  return options_.group.registry->waiting_status();
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
      failed_again(g.message());
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
      failed_again(st.message());
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
  // A fresh group holds nothing: the ledger starts full, nothing is left to release. Whatever
  // still ran belonged to the group before (its step failed and failed it, normally).
  if (!running_.empty()) {
    fail_running(ErrorCode::kUnavailable, "worker failure: the group restarted");
  }
  planner_.reset(group_->info().kv_pages, group_->info().kv_page_size);
  warm_up();
  kv_capacity_ = group_->kv_capacity_tokens();
  metrics_.kv_capacity_tokens = kv_capacity_.load();
  healthy_ = true;
  metrics_.healthy = 1;
  started_once_ = true;
  last_failure_.clear();
  return GroupState::kReady;
}

bool Scheduler::failed_again(const std::string& why) {
  // The same way: the same words once the rank and its pid are left out (they differ every
  // start: whichever rank is seen to exit first is named).
  static const std::regex kRank(R"(worker rank [0-9]+ \(pid [0-9]+\))");
  const std::string way = std::regex_replace(why, kRank, "a worker rank");
  const bool again = !last_failure_.empty() && way == last_failure_;
  last_failure_ = way;
  if (!again) return false;
  const std::string reason =
      "the worker group failed to start twice in a row the same way, so it is not restarted: " +
      why;
  spdlog::critical("{}", reason);
  {
    std::lock_guard<std::mutex> lock(gave_up_mu_);
    gave_up_ = reason;
  }
  stop_ = true;
  return true;
}

std::string Scheduler::gave_up() const {
  std::lock_guard<std::mutex> lock(gave_up_mu_);
  return gave_up_;
}

void Scheduler::warm_up() {
  const int64_t n = std::min<int64_t>(options_.warmup_tokens, options_.max_context);
  if (n <= 0) return;
  runtime::GenerateRequest req;
  req.prompt.push_back(1);  // BOS, then ids spread over the vocabulary (no text needed)
  const auto vocab = static_cast<uint64_t>(std::max(group_->info().vocab_size, 260));
  for (int64_t i = 1; i < n; ++i) {
    req.prompt.push_back(static_cast<int32_t>(3 + (static_cast<uint64_t>(i) * 2654435761u) %
                                                      (vocab - 3)));
  }
  req.max_tokens = 2;
  req.stop_at_eos = false;
  req.prefill_chunk = options_.group.prefill_chunk;
  req.layout = options_.group.layout;
  req.sampling.temperature = 0.f;
  const auto t0 = Clock::now();
  // Its own sequence id, far from the planner's; generate() releases it at the end. Nothing of
  // it reaches the metrics or the prefix cache.
  auto r = runtime::generate(*group_, req, [](int32_t) { return true; }, nullptr,
                             uint64_t{1} << 62);
  if (!r.ok()) {
    spdlog::warn("warm-up request of {} tokens failed: {}", n, r.message());
    return;
  }
  spdlog::info("warm-up: a {}-token request in {:.1f} ms (TTFT {:.1f} ms) before serving", n,
               ms_between(t0, Clock::now()), r.value().prefill_ms);
}

void Scheduler::loop() {
  auto backoff = std::chrono::milliseconds(200);
  while (!stop_) {
    const GroupState state = ensure_group();
    if (state != GroupState::kReady) {
      // The sequences in flight belonged to the dead group.
      if (!running_.empty()) {
        fail_running(ErrorCode::kUnavailable, "worker failure: the group died");
      }
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
