// The --join form of burst-worker (multi-node): registers with burst-server's WorkerRegistry,
// serves as the member it is assigned, and when the group breaks or is dissolved re-executes
// itself and registers again (see the top of worker_main.cpp for why a fresh process).
#pragma once

#include "engine/backend.h"
#include "models/llama.h"
#include "worker/worker_args.h"
#include "worker/worker_process.h"

namespace burst::worker {

// Registers with the server (retrying with backoff until the group forms; a refusal ends the
// process with kExitRefused), then joins the communicators, loads its (tensor-parallel share
// of the) weights and serves as the member it was assigned. `argv` is what a rejoin
// re-executes. Returns only the exit code of a refusal or a set-up failure.
int run_join(WorkerProcess& process, const Args& a, engine::Backend& backend, char** argv);

}  // namespace burst::worker
