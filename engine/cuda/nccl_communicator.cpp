#include "engine/cuda/nccl_communicator.h"

#include <nccl.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "kernels/ops_cuda.h"

namespace burst::engine {

namespace {

std::string here(const char* file, int line, int rank) {
  return std::string(file) + ":" + std::to_string(line) + " rank " + std::to_string(rank) + ": ";
}

#define NCCL_TRY(expr)                                                                    \
  do {                                                                                    \
    const ncclResult_t _r = (expr);                                                       \
    if (_r != ncclSuccess && _r != ncclInProgress) {                                      \
      return Status::error(here(__FILE__, __LINE__, rank_) + #expr + ": " +              \
                           ncclGetErrorString(_r) + " (" + ncclGetLastError(comm_) + ")"); \
    }                                                                                     \
  } while (0)

#define CUDA_TRY(expr)                                                                          \
  do {                                                                                          \
    const cudaError_t _e = (expr);                                                              \
    if (_e != cudaSuccess) {                                                                    \
      return Status::error(here(__FILE__, __LINE__, rank_) + #expr + ": " +                    \
                           cudaGetErrorString(_e));                                             \
    }                                                                                           \
  } while (0)

class NcclHandle final : public CommHandle {
 public:
  NcclHandle(cudaEvent_t done, cudaStream_t compute) : done_(done), compute_(compute) {}
  // A handle dropped unwaited (an error path) still orders later compute after the transfer:
  // the buffers it reads and writes go back to a stream-ordered pool on the compute stream.
  ~NcclHandle() override {
    if (!waited_) cudaStreamWaitEvent(compute_, done_, 0);
    cudaEventDestroy(done_);
  }
  // Stream-ordered: later compute waits for the transfer; the host does not block.
  Status wait() override {
    const cudaError_t e = cudaStreamWaitEvent(compute_, done_, 0);
    if (e != cudaSuccess) return Status::error(std::string("nccl wait: ") + cudaGetErrorString(e));
    waited_ = true;
    return {};
  }

 private:
  cudaEvent_t done_;
  cudaStream_t compute_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclOptions& o) : opt_(o), rank_(o.rank) {}
  ~NcclCommunicator() override {
    close_peer_gather();
    if (comm_) ncclCommDestroy(comm_);
    if (comm_stream_) cudaStreamDestroy(comm_stream_);
    if (staging_) cudaFree(staging_);
  }

  Status init() {
    CUDA_TRY(cudaSetDevice(opt_.device));
    // The ring's transfers at the highest priority: NCCL's kernel and the attention step it
    // overlaps become ready at the same moment (both wait for the previous step); with
    // priority the block scheduler places NCCL's CTAs first. Alone it moved 128K on 4 H200s
    // from 12.4 to 9.7 % of a layer exposed; the rest came from the attention kernel's tile
    // schedule beside a transfer (AttnParams::beside_transfer; docs/benchmarks.md).
    int least = 0, greatest = 0;
    CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CUDA_TRY(cudaStreamCreateWithPriority(&comm_stream_, cudaStreamNonBlocking, greatest));
    ncclUniqueId id;
    const std::string path = opt_.store_dir + "/nccl-id";
    if (opt_.store) {
      BURST_RETURN_IF_ERROR(exchange_id_through_store(&id));
    } else if (rank_ == 0) {
      NCCL_TRY(ncclGetUniqueId(&id));
      const std::string tmp = path + ".tmp";
      {
        std::ofstream f(tmp, std::ios::binary);
        f.write(reinterpret_cast<const char*>(&id), sizeof id);
        if (!f) return Status::error(here(__FILE__, __LINE__, rank_) + "cannot write " + tmp);
      }
      std::filesystem::rename(tmp, path);  // readers never see half an id
    } else {
      const auto end = std::chrono::steady_clock::now() + opt_.timeout;
      while (!std::filesystem::exists(path)) {
        if (std::chrono::steady_clock::now() > end) {
          return Status::error(here(__FILE__, __LINE__, rank_) + "no NCCL id from rank 0 in " +
                               path);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      std::ifstream f(path, std::ios::binary);
      f.read(reinterpret_cast<char*>(&id), sizeof id);
    }
    // Non-blocking init so that a peer that never joins is a timeout, not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    NCCL_TRY(ncclCommInitRankConfig(&comm_, opt_.world_size, id, rank_, &config));
    BURST_RETURN_IF_ERROR(poll_comm("init"));
    BURST_RETURN_IF_ERROR(connect_ring());
    return init_peer_gather();
  }

  std::string transport() const override {
    return peer_gather_ ? "nccl; decode all-gathers and all-reduces of up to " +
                              std::to_string(kPeerSlotBytes >> 20) +
                              " MiB by stores into the peers' memory (CUDA IPC)"
                        : "nccl (" + peer_gather_off_ + ")";
  }

  // Small device all-gathers (the decode's per-layer partials) skip NCCL where every rank is on
  // this host and every pair of GPUs has peer access: each rank maps the others' regions
  // (kernels::peer_all_gather_cuda). Every rank must agree, so they decide together; anything
  // missing (another host, no P2P, a rank's Tuning::peer_gather off) leaves NCCL in charge.
  Status init_peer_gather() {
    const int world = opt_.world_size;
    if (world < 2) return {};
    if (world > kernels::kPeerGatherMaxRanks) {
      peer_gather_off_ = "more ranks than peer stores serve";
      return {};
    }
    // Decided together even when this rank declines (its switches may differ from the
    // others' with --join): every rank takes part in the same two all-gathers.
    const bool declined = !opt_.peer_gather;
    struct Card {
      char host[160];
      char bus[32];
      cudaIpcMemHandle_t handle;
      int32_t ok;  // 1: exported; 0: could not; -1: declined (BURST_PEER_GATHER=0)
    };
    Card mine{};
    std::string host(64, '\0');
    gethostname(host.data(), host.size() - 1);
    host.resize(std::strlen(host.c_str()));
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string boot_id;
    std::getline(boot, boot_id);
    std::snprintf(mine.host, sizeof mine.host, "%s/%s", host.c_str(), boot_id.c_str());
    const int64_t bytes = kernels::peer_gather_region_bytes(world, kPeerSlotBytes);
    mine.ok = declined ? -1
              : cudaDeviceGetPCIBusId(mine.bus, sizeof mine.bus, opt_.device) == cudaSuccess &&
                        cudaMalloc(&region_, static_cast<size_t>(bytes)) == cudaSuccess &&
                        cudaMemset(region_, 0, static_cast<size_t>(bytes)) == cudaSuccess &&
                        cudaDeviceSynchronize() == cudaSuccess &&
                        cudaIpcGetMemHandle(&mine.handle, region_) == cudaSuccess
                  ? 1
                  : 0;
    if (mine.ok == 0) cudaGetLastError();
    std::vector<Card> all(static_cast<size_t>(world));
    BURST_RETURN_IF_ERROR(all_gather(&mine, all.data(), sizeof(Card)));
    std::string why;
    for (int r = 0; r < world && why.empty(); ++r) {
      const Card& c = all[static_cast<size_t>(r)];
      if (c.ok < 0) why = "BURST_PEER_GATHER=0 on rank " + std::to_string(r);
      else if (c.ok == 0) why = "rank " + std::to_string(r) + " could not export its region";
      else if (std::strcmp(c.host, mine.host) != 0) why = "the ranks span hosts";
    }
    for (int r = 0; r < world && why.empty(); ++r) {
      if (r == rank_) continue;
      const Card& c = all[static_cast<size_t>(r)];
      int dev = -1, can = 0;
      if (cudaDeviceGetByPCIBusId(&dev, c.bus) != cudaSuccess) {
        why = "rank " + std::to_string(r) + "'s GPU " + c.bus + " is not visible here";
      } else if (cudaDeviceCanAccessPeer(&can, opt_.device, dev) != cudaSuccess || !can) {
        why = "no peer access to rank " + std::to_string(r) + "'s GPU " + c.bus;
      } else if (cudaIpcOpenMemHandle(&peer_[static_cast<size_t>(r)], c.handle,
                                      cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        peer_[static_cast<size_t>(r)] = nullptr;
        why = "cannot map rank " + std::to_string(r) + "'s region";
      }
    }
    if (!why.empty()) cudaGetLastError();
    int32_t ok = why.empty() ? 1 : 0;
    std::vector<int32_t> oks(static_cast<size_t>(world));
    BURST_RETURN_IF_ERROR(all_gather(&ok, oks.data(), sizeof ok));
    for (int r = 0; r < world && why.empty(); ++r) {
      if (!oks[static_cast<size_t>(r)]) why = "rank " + std::to_string(r) + " cannot map its peers";
    }
    if (!why.empty()) {
      peer_gather_off_ = why;
      close_peer_gather();
      return {};
    }
    pg_.rank = rank_;
    pg_.world = world;
    for (int r = 0; r < world; ++r) {
      pg_.region[r] = r == rank_ ? region_ : peer_[static_cast<size_t>(r)];
    }
    pg_.slot_bytes = kPeerSlotBytes;
    pg_.timeout_ns = static_cast<uint64_t>(opt_.timeout.count()) * 1000000ull;
    peer_gather_ = true;
    return {};
  }

  void close_peer_gather() {
    for (void*& p : peer_) {
      if (p) cudaIpcCloseMemHandle(p);
      p = nullptr;
    }
    if (region_) cudaFree(region_);
    region_ = nullptr;
    peer_gather_ = false;
  }

  // Rank 0 publishes the id under "nccl-id"; the others wait for it (up to the timeout).
  Status exchange_id_through_store(ncclUniqueId* id) {
    constexpr const char* kKey = "nccl-id";
    if (rank_ == 0) {
      NCCL_TRY(ncclGetUniqueId(id));
      const char* bytes = reinterpret_cast<const char*>(id);
      const Status st = opt_.store->set(kKey, std::vector<char>(bytes, bytes + sizeof *id));
      if (!st.ok()) return Status::error(here(__FILE__, __LINE__, rank_) + st.message());
      return {};
    }
    auto got = opt_.store->get(kKey, opt_.timeout);
    if (!got.ok()) {
      return Status::error(here(__FILE__, __LINE__, rank_) + "no NCCL id from rank 0: " +
                           got.message());
    }
    if (got.value().size() != sizeof *id) {
      return Status::error(here(__FILE__, __LINE__, rank_) + "the NCCL id in the store has " +
                           std::to_string(got.value().size()) + " bytes, expected " +
                           std::to_string(sizeof *id));
    }
    std::memcpy(id, got.value().data(), sizeof *id);
    return {};
  }

  int rank() const override { return rank_; }
  int world_size() const override { return opt_.world_size; }

  Result<std::unique_ptr<CommHandle>> isend(const void* data, size_t bytes, int peer,
                                            int tag) override {
    return post(data, peer, nullptr, -1, bytes, tag);
  }
  Result<std::unique_ptr<CommHandle>> irecv(void* data, size_t bytes, int peer,
                                            int tag) override {
    return post(nullptr, -1, data, peer, bytes, tag);
  }
  Result<std::unique_ptr<CommHandle>> isendrecv(const void* send, int send_peer, void* recv,
                                                int recv_peer, size_t bytes, int tag) override {
    return post(send, send_peer, recv, recv_peer, bytes, tag);
  }

  Status all_gather(const void* in, void* out, size_t bytes) override {
    const size_t total = bytes * static_cast<size_t>(opt_.world_size);
    if (is_device(out) && is_device(in)) {
      if (peer_gather_ && bytes <= static_cast<size_t>(kPeerSlotBytes) && bytes % 16 == 0 &&
          bytes > 0) {
        CUDA_TRY(kernels::peer_all_gather_cuda(pg_, in, out, static_cast<int64_t>(bytes),
                                               ++peer_epoch_, opt_.compute_stream));
        return {};
      }
      NCCL_TRY(ncclAllGather(in, out, bytes, ncclChar, comm_, opt_.compute_stream));
      return poll_comm("all_gather");  // enqueued before anything else touches the comm
    }
    // Host buffers: stage, gather on device, copy back (the caller reads them right away).
    BURST_RETURN_IF_ERROR(ensure_staging(total + bytes));
    char* dev_out = static_cast<char*>(staging_);
    char* dev_in = dev_out + total;
    CUDA_TRY(cudaMemcpyAsync(dev_in, in, bytes, cudaMemcpyDefault, opt_.compute_stream));
    NCCL_TRY(ncclAllGather(dev_in, dev_out, bytes, ncclChar, comm_, opt_.compute_stream));
    // Non-blocking communicator: the collective may still be being enqueued; the copy back
    // must be queued after it.
    BURST_RETURN_IF_ERROR(poll_comm("all_gather"));
    CUDA_TRY(cudaMemcpyAsync(out, dev_out, total, cudaMemcpyDefault, opt_.compute_stream));
    return sync(opt_.compute_stream, "all_gather");
  }

  Status broadcast(void* data, size_t bytes, int root) override {
    if (is_device(data)) {
      NCCL_TRY(ncclBroadcast(data, data, bytes, ncclChar, root, comm_, opt_.compute_stream));
      return poll_comm("broadcast");
    }
    BURST_RETURN_IF_ERROR(ensure_staging(bytes));
    CUDA_TRY(cudaMemcpyAsync(staging_, data, bytes, cudaMemcpyDefault, opt_.compute_stream));
    NCCL_TRY(ncclBroadcast(staging_, staging_, bytes, ncclChar, root, comm_, opt_.compute_stream));
    BURST_RETURN_IF_ERROR(poll_comm("broadcast"));  // see all_gather
    CUDA_TRY(cudaMemcpyAsync(data, staging_, bytes, cudaMemcpyDefault, opt_.compute_stream));
    return sync(opt_.compute_stream, "broadcast");
  }

  // Device memory up to a peer slot (a decode step's rows): one-shot, by peer stores: one
  // launch stores the partials into every peer's memory and sums the ones it receives in rank
  // order (kernels::peer_all_reduce_cuda, a few microseconds where NCCL's call costs tens), so
  // the bits agree. Larger (prefill): one ncclAllReduce in place
  // on the compute stream (ring or tree: each element is reduced once and the result copied to
  // every rank). Host memory: the default (one all_gather, rank-order sums).
  Status all_reduce_sum(void* data, int64_t count, DType dtype) override {
    return reduce(data, data, count, dtype, /*accumulate=*/false);
  }
  // The same, summed into x: on the one-shot path in the summing kernel itself.
  Status all_reduce_add(void* partial, void* x, int64_t count, DType dtype) override {
    return reduce(partial, x, count, dtype, /*accumulate=*/true);
  }

  // On the one-shot path, the sum and the norm are one kernel (peer_all_reduce_norm_cuda).
  Result<bool> all_reduce_add_norm(void* partial, void* x, DType dtype,
                                   const NormAfter& norm) override {
    // applies: rows that one launch takes, within a peer slot (pg_.slot_bytes).
    if (!peer_gather_ || opt_.world_size == 1 || !is_device(partial) || !is_device(x) ||
        !is_device(norm.h) || !is_device(norm.w) ||
        !kernels::peer_all_reduce_norm_applies(pg_, partial, x, norm.w, norm.h, norm.rows,
                                               norm.dim, dtype)) {
      return false;
    }
    CUDA_TRY(kernels::peer_all_reduce_norm_cuda(pg_, partial, x, norm.w, norm.h, norm.rows,
                                                norm.dim, norm.eps, dtype, ++peer_epoch_,
                                                opt_.compute_stream));
    return true;
  }

  Status barrier() override {
    int32_t token = 0;
    return broadcast(&token, sizeof token, 0);
  }

 private:
  Result<std::unique_ptr<CommHandle>> post(const void* send, int send_peer, void* recv,
                                           int recv_peer, size_t bytes, int) {
    cudaEvent_t ready, done;
    CUDA_TRY(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    // The block to send was written by kernels on the compute stream: order the transfer after
    // them, without blocking the host.
    CUDA_TRY(cudaEventRecord(ready, opt_.compute_stream));
    CUDA_TRY(cudaStreamWaitEvent(comm_stream_, ready, 0));
    cudaEventDestroy(ready);
    NCCL_TRY(ncclGroupStart());
    if (send) NCCL_TRY(ncclSend(send, bytes, ncclChar, send_peer, comm_, comm_stream_));
    if (recv) NCCL_TRY(ncclRecv(recv, bytes, ncclChar, recv_peer, comm_, comm_stream_));
    NCCL_TRY(ncclGroupEnd());
    BURST_RETURN_IF_ERROR(poll_comm("send/recv"));
    CUDA_TRY(cudaEventRecord(done, comm_stream_));
    return std::unique_ptr<CommHandle>(new NcclHandle(done, opt_.compute_stream));
  }

  // NCCL connects two ranks for send and receive at their first transfer, channel by channel,
  // on its own thread (a few milliseconds a channel). Left to the first prefill, that held its
  // first ring hop back ~0.4 s on 4 x H200 (a timeline: NCCL's small uploads between idle
  // gaps, the attention waiting). One exchange with each ring neighbour here, large enough to
  // be spread over every channel, connects them while the group starts instead.
  Status connect_ring() {
    const int world = opt_.world_size;
    if (world < 2) return {};
    constexpr size_t kBytes = size_t{64} << 20;
    void* buf = nullptr;  // not from a pool: freed, it goes back before the KV pool is sized
    CUDA_TRY(cudaMalloc(&buf, 2 * kBytes));
    char* send = static_cast<char*>(buf);
    const int next = (rank_ + 1) % world, prev = (rank_ - 1 + world) % world;
    Status st;
    // To the next rank (pass-KV's blocks), then back to the previous one (pass-Q's partials,
    // and the reverse ring); with two ranks the first exchange is both.
    for (int dir = 0; dir < (world > 2 ? 2 : 1) && st.ok(); ++dir) {
      auto h = post(send, dir == 0 ? next : prev, send + kBytes, dir == 0 ? prev : next, kBytes, 0);
      st = h.ok() ? h.value()->wait() : h.status();
    }
    if (st.ok()) st = sync(opt_.compute_stream, "connect");
    // After an error the communicator is aborted (no transfer still reads or writes buf).
    const cudaError_t freed = cudaFree(buf);
    BURST_RETURN_IF_ERROR(st);
    CUDA_TRY(freed);
    return {};
  }

  // Waits until the communicator has no operation in progress (non-blocking mode), failing on
  // an asynchronous error.
  Status poll_comm(const char* what) {
    const auto end = std::chrono::steady_clock::now() + opt_.timeout;
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return {};
      if (state != ncclInProgress) return abort(what, ncclGetErrorString(state));
      if (std::chrono::steady_clock::now() > end) return abort(what, "timed out");
      std::this_thread::yield();
    }
  }

  // all_reduce_sum (out == partial, accumulate false) and all_reduce_add (out += the sum).
  Status reduce(void* partial, void* out, int64_t count, DType dtype, bool accumulate) {
    if (count <= 0 || opt_.world_size == 1 || !is_device(partial) || !is_device(out)) {
      return accumulate ? Communicator::all_reduce_add(partial, out, count, dtype)
                        : Communicator::all_reduce_sum(partial, count, dtype);
    }
    const int64_t bytes = count * dtype_size(dtype);
    if (peer_gather_ && bytes <= kPeerSlotBytes && bytes % 16 == 0) {
      CUDA_TRY(kernels::peer_all_reduce_cuda(pg_, partial, out, bytes, dtype, accumulate,
                                             ++peer_epoch_, opt_.compute_stream));
      return {};
    }
    const ncclDataType_t type = dtype == DType::kF32    ? ncclFloat32
                                : dtype == DType::kBF16 ? ncclBfloat16
                                                        : ncclFloat16;
    NCCL_TRY(ncclAllReduce(partial, partial, static_cast<size_t>(count), type, ncclSum, comm_,
                           opt_.compute_stream));
    BURST_RETURN_IF_ERROR(poll_comm("all_reduce"));
    if (!accumulate) return {};
    CUDA_TRY(kernels::add_cuda(out, partial, count, dtype, opt_.compute_stream));  // x += sum
    return {};
  }

  // Host-blocking wait for a stream, with the deadline and async-error checks.
  Status sync(cudaStream_t s, const char* what) {
    const auto end = std::chrono::steady_clock::now() + opt_.timeout;
    while (true) {
      const cudaError_t e = cudaStreamQuery(s);
      if (e == cudaSuccess) return {};
      if (e != cudaErrorNotReady) return abort(what, cudaGetErrorString(e));
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return abort(what, ncclGetErrorString(state));
      }
      if (std::chrono::steady_clock::now() > end) return abort(what, "timed out");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // After a failure the communicator cannot be trusted: abort it so no kernel waits forever.
  Status abort(const char* what, const std::string& why) {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    return Status::error("nccl " + std::string(what) + " on rank " + std::to_string(rank_) +
                         " failed: " + why);
  }

  Status ensure_staging(size_t bytes) {
    if (bytes <= staging_bytes_) return {};
    if (staging_) cudaFree(staging_);
    staging_ = nullptr;
    CUDA_TRY(cudaMalloc(&staging_, bytes));
    staging_bytes_ = bytes;
    return {};
  }

  static bool is_device(const void* p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error of an unknown host pointer
      return false;
    }
    return attr.type == cudaMemoryTypeDevice;
  }

  NcclOptions opt_;
  int rank_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  // Peer stores (init_peer_gather): this rank's region, the peers' as mapped here.
  static constexpr int64_t kPeerSlotBytes = 2 << 20;  // a 64-token decode batch's partials: 1 MiB
  bool peer_gather_ = false;
  std::string peer_gather_off_ = "one rank";
  void* region_ = nullptr;
  std::array<void*, kernels::kPeerGatherMaxRanks> peer_{};
  kernels::PeerGather pg_;
  uint32_t peer_epoch_ = 0;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const NcclOptions& options) {
  auto c = std::make_unique<NcclCommunicator>(options);
  BURST_RETURN_IF_ERROR(c->init());
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace burst::engine
