// WorkerGroup: the control client of a group of N burst-worker ranks, written once for
// burst-generate --workers N and burst-server. Two ways to get the ranks, one of everything else:
// - local (the default): it spawns the ranks (each joins the group's communicator through a
//   fresh rendezvous directory, so parallel groups never collide and no fixed port is used),
//   waits until every rank's control service answers, and supervises them with waitpid;
// - remote (options.registry set; multi-node): the ranks are `burst-worker --join` processes
//   that registered with the coordinator's WorkerRegistry; start() returns at once, and
//   await_remote() connects once N of them formed the group. A member whose Join stream breaks
//   (the registry's supervision) counts as a dead rank.
// Both drive the ranks the same way: one Session stream per rank carries the steps of the
// continuous batch (step(): the same plan to every rank, rank 0's sampled tokens back), and
// both treat a dead rank the same way: the step in flight fails within a fraction of a second
// (not a hang), the group is marked unhealthy, and restart() brings up a fresh group (local:
// new processes; remote: the registry tells the survivors to leave, and the group re-forms
// when N workers joined again). As a runtime::StepRunner it runs the single-request driver's
// steps (burst-generate --workers N, tests).
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/attention_dtype.h"
#include "engine/kv_pages.h"
#include "engine/sharding.h"
#include "models/llama.h"
#include "runtime/driver.h"
#include "runtime/step.h"

namespace grpc {
class ClientContext;
}

namespace burst::server {

class WorkerRegistry;

// A group's start as its owner sees it: the weights' loading progress summed over the ranks (a
// local group reads it from the ranks' progress files while they load), and a flag that
// abandons the start at once (SIGTERM while a 7B model loads). The owner keeps it across
// starts and restarts.
struct StartProgress {
  std::atomic<int64_t> bytes_done{0};
  std::atomic<int64_t> bytes_total{0};  // 0: nothing reported yet
  std::atomic<bool> cancel{false};
};

struct WorkerGroupOptions {
  std::string worker_binary;  // path of burst-worker (default: beside the running binary)
  models::ModelSpec model;
  int workers = 1;
  int tp = 1;  // tensor parallelism: the ring has workers / tp ranks (engine::ParallelLayout)
  std::string device = "cpu";
  int64_t kv_capacity = 4096;  // KV tokens of the whole group, shared by every sequence
  // kv_capacity 0 (CUDA ranks, local or joined): each rank sizes its KV pool from its GPU's memory
  // once the weights are in (kv_rows_from_memory): kv_memory_fraction of the device for this
  // process, less kv_reserve_bytes kept for activations. kv_capacity_tokens() then reports
  // what the ranks hold.
  double kv_memory_fraction = 0.9;
  int64_t kv_reserve_bytes = 0;
  // What the ranks' KV pools hold (--kv-cache-dtype): the compute dtype, or FP8 rows.
  engine::KvCacheDtype kv_cache_dtype = engine::KvCacheDtype::kAuto;
  // Prefill attention's products on the ranks (--attention-dtype): the compute dtype, or fp8.
  engine::AttentionDtype attention_dtype = engine::AttentionDtype::kAuto;
  int64_t prefill_chunk = 0;   // the largest prefill chunk a step carries (0: whole prompts)
  engine::ShardLayout layout = engine::ShardLayout::kStriped;
  // From the spawn until every rank answers (loading the weights included): see
  // default_start_timeout().
  std::chrono::milliseconds start_timeout{120000};
  std::shared_ptr<StartProgress> start_progress;  // optional
  std::chrono::milliseconds comm_timeout{30000};
  int threads_per_worker = 0;  // 0: cores / workers (local mode)
  // Liveness of ranks that are alive but hung (SIGSTOP, a wedged process): a monitor thread
  // pings every rank's control service (served on its own gRPC thread, so a busy step does not
  // delay it) every heartbeat_interval; a rank that answered none for heartbeat_timeout fails
  // the step in flight and marks the group unhealthy. 0: off. $BURST_WORKER_HEARTBEAT_MS and
  // $BURST_WORKER_HEARTBEAT_TIMEOUT_MS override them.
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds heartbeat_timeout{5000};
  // A step deadline, the backstop for a rank that answers pings but never finishes its step:
  // step_timeout + step_ms_per_token x the step's tokens (generous: a 128K-token GPU prefill
  // chunk takes ~0.7 s, a CPU chunk of 1500 tokens seconds). 0: off.
  // $BURST_WORKER_STEP_TIMEOUT_MS overrides step_timeout.
  std::chrono::milliseconds step_timeout{60000};
  double step_ms_per_token = 20;
  // Remote mode (multi-node): the ranks join through this registry instead of being spawned;
  // its world size is `workers`.
  std::shared_ptr<WorkerRegistry> registry;

  // The BurstAttention ring's ranks (each a tensor-parallel group of tp workers).
  int ring_size() const { return workers / std::max(tp, 1); }
};

// The start timeout when none is given: 120 s plus 30 s per GB of weights each rank holds (a
// rank loads the whole model: it is sharded by sequence), i.e. ~35 MB/s, which a slow network
// volume still reaches: kjv-tiny 120 s, 1b (fp32 on CPU) 4.4 GB -> 252 s, 7b bf16 13.5 GB ->
// 524 s, 70b bf16 138 GB -> ~73 min.
std::chrono::milliseconds default_start_timeout(int64_t weight_bytes_per_rank);


struct WorkerGroupInfo {
  int32_t vocab_size = 0;
  int32_t eos_token_id = 2;
  std::string device;
  int64_t kv_pages = 0;    // per rank (the fewest any rank has, when sized from memory)
  int32_t kv_page_size = 0;
};

// What one step returned: rank 0's StepResult (its tokens, prompt logprobs, rows and ring
// times), and the KV pages every rank uses after it.
struct StepOutcome : runtime::StepResult {
  std::vector<int64_t> kv_used_pages;  // per ring rank (a tensor-parallel group counts once)
};
// Called on rank 0's progress replies during a step: layers done of all layers.
using LayerProgress = std::function<void(int layers_done, int layers)>;

class WorkerGroup final : public runtime::StepRunner {
 public:
  static Result<std::unique_ptr<WorkerGroup>> start(WorkerGroupOptions options);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // One step of the continuous batch on every rank (the Session streams open on first use).
  // Errors carry their code: kInvalidArgument when the ranks refused the plan (nothing ran,
  // the group stays usable), kUnavailable when a rank died or its stream broke (the group is
  // unhealthy; restart() next).
  Result<StepOutcome> step(const runtime::StepPlan& plan, const LayerProgress& on_layer = nullptr);
  // step() in two halves, for a caller that keeps a second step in flight (the scheduler's
  // lookahead): send_step() hands the plan to every rank and returns; receive_step() waits for
  // the replies of the oldest step sent and not yet received. The ranks run the steps in the
  // order sent, each as soon as the one before ends, whoever reads the replies. After an error
  // of either, steps still in flight are lost: end_session() (or the restart) clears them.
  Status send_step(const runtime::StepPlan& plan, bool report_progress = false);
  Result<StepOutcome> receive_step(const LayerProgress& on_layer = nullptr);
  // Closes the Session streams: every rank frees every sequence's pages.
  void end_session();
  // runtime::StepRunner, for the single-request driver: step() as rank 0's StepResult (the
  // ranks cannot stop a step mid-way: on_layer's "stop" takes effect after it).
  Result<runtime::StepResult> run_step(const runtime::StepPlan& plan,
                                       const runtime::StepProgress& on_layer) override;
  int32_t eos_token_id() const override { return info_.eos_token_id; }
  bool healthy() const { return healthy_.load(); }
  // Stops whatever is left of the group and starts a fresh one. Remote mode: dissolves the
  // group (the survivors leave and rejoin) and returns at once; await_remote() waits for it.
  Status restart();
  bool remote() const { return options_.registry != nullptr; }
  // Remote mode, while no group is connected: waits up to max_wait for N workers to form one,
  // then connects to every rank. True once the group serves; false while still waiting; an
  // error when the formed group did not answer (it is dissolved and re-forms).
  Result<bool> await_remote(std::chrono::milliseconds max_wait);
  // Remote mode: no group connected (restart() or a failed connect); await_remote() next.
  bool awaiting_workers() const { return remote() && ranks_.empty(); }
  // Remote mode: "waiting for workers (k/N registered ...)" while no group serves; else "".
  std::string waiting_status() const;
  const WorkerGroupInfo& info() const { return info_; }
  // KV tokens the group holds: options().kv_capacity, or (sized from memory) the rows the
  // ranks report, summed (the exact per-rank need of a request is the scheduler's ledger's).
  int64_t kv_capacity_tokens() const override;
  const WorkerGroupOptions& options() const { return options_; }
  // Worker pids, for tests that kill one.
  std::vector<int> pids() const;

  struct Rank;  // one spawned worker (defined in worker_group.cpp)
  struct Session;  // the Session streams of the ranks (worker_group.cpp)

 private:
  explicit WorkerGroup(WorkerGroupOptions options);
  Status spawn();  // the local ranks: run directory, fork + exec, wait for their ports, connect
  Result<std::string> make_run_dir();
  std::vector<std::string> worker_environment() const;
  std::vector<std::string> worker_args(const Rank& rk, const std::string& store) const;
  Result<std::vector<std::string>> await_ports();
  // Creates the control stubs, pings every rank (checking its rank and world size) and marks
  // the group healthy: the step both modes share once they know the ranks' addresses.
  Status connect(const std::vector<std::string>& addresses);
  // A rank is gone: fail the request in flight at once and mark the group unhealthy.
  void mark_dead(const std::string& why);
  void stop_all();
  void supervise();
  // The liveness monitor (heartbeats and the step deadline), both modes: started once the
  // ranks answer (connect()), stopped before the ranks are dropped.
  void start_monitor();
  void stop_monitor();
  void monitor();
  Result<StepOutcome> step_locked(const runtime::StepPlan& plan, const LayerProgress& on_layer);
  Status send_locked(const runtime::StepPlan& plan, bool report_progress);
  Result<StepOutcome> receive_locked(const LayerProgress& on_layer);
  // The Session streams of every rank, opened on the first step (or after a broken one).
  Status open_session_locked();
  // Rank r's stream broke (it died or cannot be reached): cancels the session, names the cause
  // (the supervisor's or registry's word when it has one, with the status rank r ended its
  // session with: a step's own error, such as an out-of-memory), marks the group dead.
  // read_failed: a Read ended the stream (its status has arrived), else a Write failed.
  Status session_broken_locked(size_t r, const std::string& what, bool read_failed);
  // Arms the step deadline the monitor watches (step_timeout plus a time per token).
  void arm_step_deadline(const runtime::StepPlan& plan);
  void end_session_locked();

  WorkerGroupOptions options_;
  WorkerGroupInfo info_;
  std::string run_dir_;
  // Sent as metadata (kWorkerTokenKey) on every WorkerControl call: the per-group secret of
  // local workers, the registry's cluster token for remote ones.
  std::string token_;
  void authorize(grpc::ClientContext& ctx) const;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<bool> healthy_{false};
  std::atomic<bool> stopping_{false};
  std::string death_;  // why the group died, under mu_
  mutable std::mutex mu_;
  std::vector<grpc::ClientContext*> in_flight_;  // under mu_: cancelled when a rank dies
  std::thread supervisor_;
  std::thread monitor_;
  std::mutex monitor_mu_;
  std::condition_variable monitor_cv_;
  bool monitor_stop_ = false;                        // under monitor_mu_
  grpc::ClientContext* monitor_ping_ = nullptr;      // under monitor_mu_: the ping in flight
  // The step in flight (under mu_): its deadline and size, for the monitor.
  std::chrono::steady_clock::time_point step_deadline_{};
  bool step_running_ = false;
  int64_t step_tokens_ = 0;
  std::atomic<uint64_t> generation_{0};  // remote: the registry generation connected to
  std::mutex run_mu_;  // one step at a time
  std::unique_ptr<Session> session_;  // under run_mu_
  int steps_sent_ = 0;                // under run_mu_: sent to the session, replies not read
};

// The path of burst-worker next to the running executable.
std::string default_worker_binary();

}  // namespace burst::server
