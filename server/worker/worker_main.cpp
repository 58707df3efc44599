// burst-worker: one rank of a worker group. Loads the model, joins the group's communicator
// (Gloo on CPU, NCCL on GPU), holds its shard of every sequence's KV cache (paged), and runs
// the steps its coordinator sends over one Session stream of the internal WorkerControl gRPC
// service (proto/burst/v1/worker.proto). Every rank runs the same steps in lockstep; rank 0
// samples and returns the tokens.
//
// Two ways to start:
// - spawned by a local coordinator (--rank --world --store --port-file): rendezvous through a
//   directory, control service on loopback, port written to the port file; dies with its parent.
//   After a communicator error the group is broken (a peer died or hung): the worker reports the
//   error on the call, then exits with code 3 so the coordinator restarts the group instead of
//   reusing a half-dead ring.
// - --join HOST:PORT (multi-node): registers with burst-server's WorkerRegistry, which checks
//   the model and hands out rank and world size once the group is complete; the communicator
//   meets through the coordinator's store, the control service listens on the advertised
//   address and is published through the same store. When the group breaks or is dissolved (a
//   peer died, the coordinator restarted it or went away), the worker re-executes itself and
//   registers again: a fresh process, because a communicator that saw a failure (Gloo pairs
//   closed, NCCL kernels stuck on a dead peer) cannot be reused or even safely destroyed.
//   Refusals (another model, one worker too many) end the process with code 4.
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "common/logging.h"
#include "engine/backend.h"
#include "group/grpc_logging.h"
#include "group/worker_registry.h"
#include "models/llama.h"
#include "worker/worker_args.h"
#include "worker/worker_join.h"
#include "worker/worker_local.h"
#include "worker/worker_process.h"
#include "worker/worker_rank.h"

int main(int argc, char** argv) {
  using namespace burst;
  using namespace burst::worker;
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);  // inherited by every thread created below
  const Args a = parse_args(argc, argv);
  // The server's format (inherited, or the flags): in json, every line this process writes is
  // a record of the default logger, with the rank once it is known.
  if (Status st = server::setup_logging("burst-worker", a.log_level, a.log_format,
                                        a.join.empty() ? a.rank : -1);
      !st.ok()) {
    std::cerr << "burst-worker: " << st.message() << std::endl;
    return 2;
  }
  if (server::log_is_json()) server::route_grpc_logs();
  // A spawned worker's group secret: taken from the environment and removed from it, so no
  // child of this process inherits it. Without one, a spawned worker would open a control
  // port anyone on this host could drive: it refuses to start.
  std::string secret;
  if (const char* s = std::getenv(burst::server::kWorkerSecretEnv); s != nullptr) secret = s;
  unsetenv(burst::server::kWorkerSecretEnv);
  if (a.join.empty() && secret.empty()) {
    WorkerProcess().fail(std::string("$") + burst::server::kWorkerSecretEnv +
                         " is not set: a worker with --rank/--world is started by burst-server "
                         "or burst-generate, which hand it its group's secret");
    return 2;
  }
  // Die with the coordinator: a spawned worker must never outlive the process that supervises
  // it. A --join worker has no such parent; it outlives even its server, and registers again.
  if (a.join.empty()) prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The process outlives main's scope: the SIGTERM thread may use it while main returns.
  static WorkerProcess process;
  if (a.join.empty()) process.set_who("burst-worker rank " + std::to_string(a.rank));
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  omp_set_num_threads(a.threads > 0 ? a.threads : std::max(1, cores / std::max(1, a.world)));

  process.start_sigterm_thread();
  // A --join worker runs on its own host, started by hand or by its own unit: it says what it
  // is. A spawned one is the coordinator's build, which the coordinator's log names already.
  if (!a.join.empty()) process.say(burst::server::version_string("burst-worker"));

  // The A/B switches (BURST_OVERLAP, BURST_PDL, BURST_PEER_GATHER, BURST_ATTN_KERNEL), read
  // here once: the backend keeps them for its kernels, the communicator and the step loop.
  auto tuning = engine::Tuning::from_env();
  if (!tuning.ok()) return process.fail(tuning.message());
  auto backend = engine::make_backend(a.device, tuning.value());
  if (!backend.ok()) return process.fail(backend.message());
  // A --join worker learns its rank (and so its tensor-parallel slice) from the server: it
  // loads once assigned. A spawned rank knows its place: it reads only its slice.
  if (!a.join.empty()) return run_join(process, a, *backend.value(), argv);
  models::ModelSpec spec = a.model;
  spec.tp = {a.rank % a.tp, a.tp};
  auto model = models::load_model(*backend.value(), spec, load_reporter(process, a.progress_file));
  if (!model.ok()) return process.fail(model.message());
  return run_local(process, a, *backend.value(), *model.value(), secret);
}
