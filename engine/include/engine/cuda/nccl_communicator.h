// NcclCommunicator: the GPU Communicator (NCCL from /usr/local/cuda). Buffers are device
// pointers on this rank's GPU, except broadcast/all_gather, which also accept host buffers (the
// token ids and logits the generation loop shares) and stage them through device memory.
//
// Ordering is stream-based, not host-blocking: isendrecv makes a dedicated communication
// stream wait for the compute stream (the data to send is ready), posts the grouped
// ncclSend/ncclRecv there, and records an event; CommHandle::wait() makes the compute stream
// wait on that event, so the next ring step's kernels start as soon as the block arrives while
// the host runs ahead. Host-blocking calls poll with a deadline and abort the communicator on
// timeout or on an asynchronous NCCL error (a dead peer), returning an error naming the rank.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <memory>
#include <string>

#include "engine/communicator.h"

namespace burst::engine {

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  int device = 0;
  // Rendezvous: rank 0 writes the NCCL unique id here, the others read it.
  std::string store_dir;
  cudaStream_t compute_stream = nullptr;
  std::chrono::milliseconds timeout{60000};
  // Or through this store (multi-node: the coordinator's network store); store_dir unused
  // then. After the fields above, so that their positional initialisers keep working.
  std::shared_ptr<RendezvousStore> store;
  // Tuning::peer_gather: false declines the stores into the peers' memory (every rank then
  // takes NCCL, whatever the others said).
  bool peer_gather = true;
};

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options);

}  // namespace burst::engine
