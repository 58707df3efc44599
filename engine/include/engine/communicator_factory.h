// make_communicator: the communicator a rank on a given backend joins. NCCL for a CUDA backend
// (engine/include/engine/cuda/nccl_communicator.h), Gloo otherwise; the rendezvous is a network
// store (multi-node) or a directory every rank sees (one host).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "engine/backend.h"
#include "engine/communicator.h"
#include "engine/parallel_layout.h"
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
  // A subgroup of the ranks that share the rendezvous (a tensor-parallel group, a context-
  // parallel ring): the ranks of one subgroup pass the same name, and rank / world_size are
  // within it. Its rendezvous keys live apart from every other group's (a subdirectory of
  // store_dir, or keys prefixed in `store`). Empty: the whole group.
  std::string group;
};

// A rank's communicators in a tp x cp layout: `tp` sums the row-parallel products (its
// tensor-parallel group), `ring` is its context-parallel ring (BurstAttention, sampling). A
// group of one rank is the local communicator; with tp 1 the ring is the whole group, joined as
// before.
struct RankCommunicators {
  std::unique_ptr<Communicator> tp, ring;
};
// Joins both, every rank in the same order (tensor-parallel group first). `options` names the
// whole group (rank, world size, rendezvous); layout.world() must be its world size.
Result<RankCommunicators> make_rank_communicators(Backend& backend,
                                                  const CommunicatorOptions& options,
                                                  const ParallelLayout& layout);

// `store` with every key under "<prefix>/": subgroups meet through one store without colliding.
std::shared_ptr<RendezvousStore> prefixed_store(std::shared_ptr<RendezvousStore> store,
                                                const std::string& prefix);

// Joins the group through the rendezvous; returns once every rank has connected (or the
// timeout passed). A CUDA backend in a build without CUDA is an error.
Result<std::unique_ptr<Communicator>> make_communicator(Backend& backend,
                                                        const CommunicatorOptions& options);

}  // namespace burst::engine
