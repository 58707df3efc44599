// Runs a function in N forked processes (ranks) and collects their exit codes; a child that
// outlives the deadline is killed and reported as -9. Children report failures through their
// exit code and stderr (gtest assertions do not cross fork()).
#pragma once

#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace burst::testing {

inline std::vector<int> run_ranks(int n, const std::function<int(int rank)>& fn,
                                  std::chrono::seconds deadline = std::chrono::seconds(60)) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      // N ranks share the machine's cores: one OpenMP thread each, or spinning threads of
      // different ranks starve each other (seen here: 40x slower with 4 ranks on 2 cores).
      omp_set_num_threads(1);
      const int code = fn(r);
      std::_Exit(code);  // skip atexit handlers and gtest's teardown in the child
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(static_cast<size_t>(n), -1);
  const auto end = std::chrono::steady_clock::now() + deadline;
  int left = n;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (codes[r] != -1 || pids[r] == 0) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        pids[r] = 0;
        --left;
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      for (int r = 0; r < n; ++r) {
        if (pids[r] != 0) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], nullptr, 0);
          codes[r] = -9;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return codes;
}

inline std::string make_temp_dir() {
  char tmpl[] = "/tmp/burst-test-XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d ? d : "";
}

}  // namespace burst::testing
