// Communicator: how the ranks of one worker group talk to each other (never through the
// frontend). Ring neighbours exchange KV blocks with async send/recv; decode all-gathers the
// per-rank (o, lse) pairs; rank 0 broadcasts sampled token ids.
//
// Implementations: GlooCommunicator (CPU, TCP transport over loopback or the network,
// engine/gloo_communicator.cpp) and NcclCommunicator (GPU, a dedicated communication stream;
// engine/cuda/nccl_communicator.cpp). Every call returns a Status naming the rank and peer; a
// peer that dies or stops answering turns into an error after the timeout, never a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "engine/rendezvous_store.h"
#include "engine/status.h"
#include "engine/tensor.h"

namespace burst::engine {

// The completion handle of a posted send or receive.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  // After wait(), work the caller queues next sees the transfer complete: on the host
  // (Gloo) wait() blocks until it is; on a GPU (NCCL) it only orders the backend's compute
  // stream after the transfer (stream-ordered, the host does not block), so device work queued
  // afterwards may read the received buffer and reuse the sent one.
  virtual Status wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Posts a send of `bytes` from `data` to `peer`; `data` must stay valid and unchanged until
  // the handle's wait() returns. Matching is by (peer, tag) in posting order. peer != rank(),
  // tag >= 0. After any error the group is broken (peers' pairs are closed): rebuild it.
  virtual Result<std::unique_ptr<CommHandle>> isend(const void* data, size_t bytes, int peer,
                                                    int tag) = 0;
  // Posts a receive of exactly `bytes` into `data` from `peer`.
  virtual Result<std::unique_ptr<CommHandle>> irecv(void* data, size_t bytes, int peer,
                                                    int tag) = 0;
  // The ring exchange: a send to `send_peer` and a receive from `recv_peer` posted as one
  // operation (NCCL must group the pair or every rank's send waits on a receive queued behind
  // it). The default posts isend + irecv and waits on both.
  virtual Result<std::unique_ptr<CommHandle>> isendrecv(const void* send, int send_peer,
                                                        void* recv, int recv_peer, size_t bytes,
                                                        int tag);
  // out holds world_size blocks of `bytes`, block r from rank r (in rank order on every rank).
  virtual Status all_gather(const void* in, void* out, size_t bytes) = 0;
  // data on every rank becomes root's data.
  virtual Status broadcast(void* data, size_t bytes, int root) = 0;
  // data ([count] of dtype, in place) becomes the sum over the ranks, the same bits on every
  // rank (a tensor-parallel group's replicated activations must stay identical). The default,
  // for host memory: one all_gather, then every rank adds the blocks in rank order in fp32 and
  // rounds once to dtype. NCCL reduces device memory on the compute stream (stream-ordered).
  virtual Status all_reduce_sum(void* data, int64_t count, DType dtype);
  // x ([count] of dtype) += the sum over the ranks of partial ([count], overwritten): a
  // row-parallel product into the residual, the add fused where the implementation can (NCCL's
  // one-shot path: one kernel sums the gathered partials into x). The same bits on every rank
  // that holds the same x. The default, for host memory: all_reduce_sum, then the add in fp32.
  virtual Status all_reduce_add(void* partial, void* x, int64_t count, DType dtype);
  // The RMSNorm a row-parallel sum feeds: h = rms_norm(x) * w (eps) over rows of w.dim
  // elements, the Backend's rms_norm bit for bit.
  struct NormAfter {
    const void* w;
    float eps;
    void* h;  // [rows, dim]; may be the partial
    int64_t rows, dim;
  };
  // all_reduce_add (count = rows * dim), then the norm, where this communicator does both: true
  // when it did; false having done nothing, and the caller runs the two. NCCL's one-shot path
  // does them in one kernel (a decode step's rows). The default, for host memory: fp32 only,
  // all_reduce_add then the CPU backend's RMSNorm (kernels::rms_norm_cpu).
  virtual Result<bool> all_reduce_add_norm(void* partial, void* x, DType dtype,
                                           const NormAfter& norm);
  virtual Status barrier() = 0;
  // How this communicator moves data, for the logs ("gloo (tcp)", "nccl; ...").
  virtual std::string transport() const { return "unnamed"; }
};

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  // Rendezvous: a directory every rank can see (a FileStore); unique per group, so parallel
  // groups (tests) never collide and no fixed port is needed.
  std::string store_dir;
  // The address the TCP transport binds and advertises to its peers: loopback for a group on
  // one host, an address the other hosts can reach for a multi-node group.
  std::string hostname = "127.0.0.1";
  std::chrono::milliseconds timeout{30000};
  // Or a store shared over the network (multi-node); when set, store_dir is not used. Last,
  // so that positional initialisers of the fields above keep working.
  std::shared_ptr<RendezvousStore> store;
};

// Joins the group; returns once every rank has connected (or the timeout passed).
Result<std::unique_ptr<Communicator>> make_gloo_communicator(const GlooOptions& options);

// A group of one rank in this process (the single-request driver, tests): all_gather copies
// (host memory), broadcast and barrier do nothing, a send or receive is an error (a rank has
// no peer). Code that branches on world_size() == 1 never reaches it with device pointers.
std::unique_ptr<Communicator> make_local_communicator();

}  // namespace burst::engine
