// WorkerGroup's pieces shared by its two sources (worker_group.cpp: start, spawn, connect,
// supervision, the monitor; worker_group_session.cpp: the Session streams and the steps).
#pragma once

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>
#include <string>
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

struct WorkerGroup::Rank {
  int rank = 0;
  pid_t pid = 0;  // local: 0 once reaped; remote: 0
  std::string port_file;  // local
  std::string address;    // of its control service
  std::unique_ptr<burst::v1::internal::WorkerControl::Stub> stub;
};

// "worker rank r (pid p)" or "worker rank r (address)".
std::string rank_name(const WorkerGroup::Rank& r);
// A waitpid status in words: "killed by signal 9 (Killed)", "exited with code 3".
std::string describe_exit(int status);

}  // namespace burst::server
