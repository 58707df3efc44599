// WorkerGroup: the launcher and control client of N local burst-worker processes, written once
// for burst-generate --workers N and burst-server. It spawns the ranks (each joins the group's
// communicator through a fresh rendezvous directory, so parallel groups never collide and no
// fixed port is used), waits until every rank's control service answers, sends each request to
// every rank, streams rank 0's tokens, and supervises: a rank that dies fails the request in
// flight within a fraction of a second (not a hang), marks the group unhealthy, and restart()
// brings up a fresh group.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/sharding.h"
#include "models/generator.h"
#include "models/llama.h"

namespace grpc {
class ClientContext;
}

namespace burst::server {

struct WorkerGroupOptions {
  std::string worker_binary;  // path of burst-worker (default: beside the running binary)
  models::ModelSpec model;
  int workers = 1;
  std::string device = "cpu";
  int64_t kv_capacity = 4096;  // tokens (prompt + generated) one request may use, whole group
  engine::ShardLayout layout = engine::ShardLayout::kZigzag;
  std::chrono::milliseconds start_timeout{120000};
  std::chrono::milliseconds comm_timeout{30000};
  int threads_per_worker = 0;  // 0: cores / workers
};

struct WorkerGroupInfo {
  int32_t vocab_size = 0;
  int32_t eos_token_id = 2;
  std::string device;
};

// Per-request numbers beyond GenerateStats, from rank 0.
struct GroupStats {
  models::GenerateStats stats;
  double ring_compute_ms = 0;
  double ring_wait_ms = 0;
};

class WorkerGroup {
 public:
  static Result<std::unique_ptr<WorkerGroup>> start(WorkerGroupOptions options);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Runs one request on every rank (requests are serialised). on_token runs on this thread for
  // each token, on_progress (optional) after every prefill layer; either returning false
  // cancels the request on every rank (during the prefill: at the next layer).
  Result<GroupStats> generate(const models::GenerateRequest& request,
                              const models::TokenCallback& on_token,
                              const models::ProgressCallback& on_progress = nullptr);
  bool healthy() const { return healthy_.load(); }
  // Stops whatever is left of the group and starts a fresh one.
  Status restart();
  const WorkerGroupInfo& info() const { return info_; }
  const WorkerGroupOptions& options() const { return options_; }
  // Worker pids, for tests that kill one.
  std::vector<int> pids() const;

  struct Rank;  // one spawned worker (defined in worker_group.cpp)

 private:
  explicit WorkerGroup(WorkerGroupOptions options);
  Status spawn();
  void stop_all();
  void supervise();

  WorkerGroupOptions options_;
  WorkerGroupInfo info_;
  std::string run_dir_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<bool> healthy_{false};
  std::atomic<bool> stopping_{false};
  std::string death_;  // why the group died, under mu_
  mutable std::mutex mu_;
  std::vector<grpc::ClientContext*> in_flight_;  // under mu_: cancelled when a rank dies
  std::thread supervisor_;
  std::mutex run_mu_;  // one request at a time
};

// The path of burst-worker next to the running executable.
std::string default_worker_binary();

}  // namespace burst::server
