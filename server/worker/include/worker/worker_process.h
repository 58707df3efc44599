// WorkerProcess: what belongs to the burst-worker process as a whole rather than to one of its
// parts: how it ends (Shutdown, SIGTERM, a broken group, or --join's dissolved group), the
// prefix its messages carry, and the thread that takes SIGTERM. One lives in main() and is
// handed to every part that may end the process or speak for it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>

namespace burst::worker {

constexpr int kExitBroken = 3;
constexpr int kExitRefused = 4;  // --join: the coordinator refused this worker
constexpr int kRejoin = 100;     // --join: leave the group and register again (not an exit code)

// How the process ends: the first code requested wins, and wait() returns it.
class ExitSignal {
 public:
  void request(int code);
  int wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int code_ = -1;
};

class WorkerProcess {
 public:
  // Asks the process to end with `code` (or, kRejoin, to register again); the first one wins.
  void request_exit(int code) { exit_.request(code); }
  // Blocks until an exit was requested; its code.
  int wait_exit() { return exit_.wait(); }

  // How messages name this process ("burst-worker rank 2"), and its rank (>= 0: JSON log
  // records carry it). Set only before the threads that speak through it are started.
  void set_who(std::string who, int rank = -1);
  const std::string& who() const { return who_; }
  // "<who>: <msg>" on stderr (--log-format json: a record of the default logger, which names
  // the rank).
  void say(const std::string& msg) const;
  // "<who>: error: <msg>" on stderr (json: an error record); returns 1, the exit code of a
  // failed set-up.
  int fail(const std::string& msg) const;

  // The rank is a member of a group now: from here on SIGTERM goes through the exit request,
  // which tears the group down, instead of ending the process at once.
  void enter_group() { in_group_ = true; }
  // This process is about to re-execute itself (rejoin); true when SIGTERM came already, and
  // then it must stop instead.
  bool begin_leaving();

  // SIGTERM must be blocked in every thread (main blocks it before creating any): this starts
  // the one thread that takes it.
  void start_sigterm_thread();

 private:
  ExitSignal exit_;
  std::string who_ = "burst-worker";
  std::atomic<bool> in_group_{false};
  // SIGTERM came / this process is about to re-execute itself (rejoin). Each side sets its flag
  // first and then reads the other's (sequentially consistent), so a SIGTERM that arrives while
  // a dissolved group is being left is never lost to the re-execution: one of the two exits.
  std::atomic<bool> terminated_{false};
  std::atomic<bool> leaving_{false};
};

}  // namespace burst::worker
