// What every rank builds, spawned or --join: its weights' loading progress, its communicator
// and its share of the KV cache (the ring).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/communicator_factory.h"
#include "engine/ring_attention.h"
#include "models/llama.h"
#include "worker/worker_args.h"
#include "worker/worker_process.h"

namespace burst::worker {

// Loading progress: written to `progress_file` ("DONE TOTAL", bytes; write then rename, at most
// every 200 ms and at the end) for the coordinator, which logs it and shows it on /health; a
// --join worker has no file and logs a line every 5 s itself.
models::LoadProgress load_reporter(const WorkerProcess& process, const std::string& progress_file);

// engine::make_rank_communicators (the tensor-parallel group, then the ring) for tensor
// parallelism `tp`, and rank 0 of a group says how they move data (NCCL or peer stores).
Result<engine::RankCommunicators> join_communicators(const WorkerProcess& process, int tp,
                                                     engine::Backend& backend,
                                                     const engine::CommunicatorOptions& options);

// The rows of this rank's KV pool: --kv-capacity, or (0) what the GPU holds once the weights
// are in (engine::kv_rows_from_memory), said in the log.
Result<int64_t> kv_rows(const WorkerProcess& process, const Args& a, engine::Backend& backend,
                        const models::LlamaModel& model);

// The ring over `comm` with a KV pool of kv_rows() rows, in the backend's page size.
Result<std::unique_ptr<engine::RingAttention>> open_ring(const WorkerProcess& process,
                                                         const Args& a, engine::Backend& backend,
                                                         const models::LlamaModel& model,
                                                         engine::Communicator& comm);

}  // namespace burst::worker
