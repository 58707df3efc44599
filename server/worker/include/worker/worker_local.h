// The spawned form of burst-worker: one rank of a group its local coordinator (burst-server or
// burst-generate --workers N) started on this host.
#pragma once

#include <string>

#include "engine/backend.h"
#include "models/llama.h"
#include "worker/worker_args.h"
#include "worker/worker_process.h"

namespace burst::worker {

// Joins the group through the rendezvous directory, opens the KV pool, serves the control
// service on loopback (its port into --port-file) with `secret` as the token, until the process
// is asked to end; then exits. Returns only the exit code of a set-up failure.
int run_local(WorkerProcess& process, const Args& a, engine::Backend& backend,
              models::LlamaModel& model, const std::string& secret);

}  // namespace burst::worker
