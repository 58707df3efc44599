#include "worker/worker_process.h"

#include <signal.h>

#include <cstdlib>
#include <iostream>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/logging.h"

namespace burst::worker {

void ExitSignal::request(int code) {
  std::lock_guard<std::mutex> lock(mu_);
  if (code_ < 0) code_ = code;
  cv_.notify_all();
}

int ExitSignal::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return code_ >= 0; });
  return code_;
}

void WorkerProcess::set_who(std::string who, int rank) {
  who_ = std::move(who);
  if (rank >= 0) server::set_log_rank(rank);
}

void WorkerProcess::say(const std::string& msg) const {
  if (server::log_is_json()) {
    spdlog::info("{}", msg);
  } else {
    std::cerr << who_ << ": " << msg << std::endl;
  }
}

int WorkerProcess::fail(const std::string& msg) const {
  if (server::log_is_json()) {
    spdlog::error("{}", msg);
  } else {
    std::cerr << who_ << ": error: " << msg << std::endl;
  }
  return 1;
}

bool WorkerProcess::begin_leaving() {
  leaving_ = true;
  return terminated_;
}

// SIGTERM (blocked in every thread since main's start) is taken by this thread with sigwait,
// so the exit path runs in normal context, not in a signal handler. Started before the model
// loads: a worker that is not in a group yet (loading, joining its communicator, registering)
// has nothing to tear down and exits at once, so a stop never waits for a load of minutes.
void WorkerProcess::start_sigterm_thread() {
  std::thread([this] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    if (sigwait(&set, &sig) != 0) return;
    terminated_ = true;
    exit_.request(0);
    if (!in_group_ || leaving_) std::_Exit(0);
  }).detach();
}

}  // namespace burst::worker
