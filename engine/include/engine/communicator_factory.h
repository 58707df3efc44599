// make_communicator: the communicator a rank on a given backend joins. NCCL for a CUDA backend
// (engine/include/engine/cuda/nccl_communicator.h), Gloo otherwise; the rendezvous is a network
// store (multi-node) or a directory every rank sees (one host).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/rendezvous_store.h"

namespace burst::engine {

struct CommunicatorOptions {
  int rank = 0;
  int world_size = 1;
  // Rendezvous: `store` when set (multi-node), else the directory `store_dir` (one host).
  std::string store_dir;
  std::shared_ptr<RendezvousStore> store;
  // What Gloo binds and advertises to its peers (NCCL finds its own interfaces).
  std::string host = "127.0.0.1";
  std::chrono::milliseconds timeout{30000};
};

// Joins the group through the rendezvous; returns once every rank has connected (or the
// timeout passed). A CUDA backend in a build without CUDA is an error.
Result<std::unique_ptr<Communicator>> make_communicator(Backend& backend,
                                                        const CommunicatorOptions& options);

}  // namespace burst::engine
