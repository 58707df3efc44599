// WorkerGroup's pieces shared by its two sources (worker_group.cpp: start, spawn, connect,
// supervision, the monitor; worker_group_session.cpp: the Session streams and the steps).
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "burst/v1/worker.grpc.pb.h"
#include "group/worker_group.h"

namespace burst::server {

struct WorkerGroup::Session {
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx;  // per rank
  using Stream = grpc::ClientReaderWriter<burst::v1::internal::StepRequest,
                                          burst::v1::internal::StepReply>;
  std::vector<std::unique_ptr<Stream>> streams;
};

// Relays a local rank's stderr (the read end of a pipe) into the server's log stream line by
// line (relay_worker_line, common/logging.h), on its own thread, until the rank's end closes.
// A line longer than kMaxLine bytes is relayed in pieces cut between UTF-8 characters.
class StderrRelay {
 public:
  static constexpr size_t kMaxLine = 16384;
  StderrRelay(int fd, int rank);
  // Relays what is left and joins: at once when the rank is gone (its end is closed), within
  // a second when a process it started still holds its end.
  ~StderrRelay();
  StderrRelay(const StderrRelay&) = delete;
  StderrRelay& operator=(const StderrRelay&) = delete;

 private:
  void run();
  const int fd_;
  const int rank_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

struct WorkerGroup::Rank {
  int rank = 0;
  pid_t pid = 0;  // local: 0 once reaped; remote: 0
  std::string port_file;  // local
  std::string address;    // of its control service
  std::unique_ptr<burst::v1::internal::WorkerControl::Stub> stub;
  std::unique_ptr<StderrRelay> stderr_relay;  // local, json log format: its stderr's reader
};

// "worker rank r (pid p)" or "worker rank r (address)".
std::string rank_name(const WorkerGroup::Rank& r);
// A waitpid status in words: "killed by signal 9 (Killed)", "exited with code 3".
std::string describe_exit(int status);

}  // namespace burst::server
