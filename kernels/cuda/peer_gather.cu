// The all-gather of the distributed decode's partials, and the all-reduce of a decode step's
// row-parallel products, between the GPUs of one host in one launch each: each CTA stores its
// chunk of this rank's bytes straight into every peer's inbox (memory mapped through CUDA IPC,
// over NVLink), publishes a flag per peer with a system-scope release, waits with system-scope
// acquires for the same chunk of every peer in its own inbox
// and copies them out. See kernels/include/kernels/ops_cuda.h (PeerGather).
#include <cstdio>

#include "kernels/cuda_dispatch.cuh"
#include "kernels/cuda_norm.cuh"
#include "kernels/ops_cuda.h"

namespace burst::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kFlagBytes = 2 * kPeerGatherMaxRanks * kPeerGatherMaxBlocks * 4;
constexpr int64_t kDataOffset = (kFlagBytes + 4095) / 4096 * 4096;

__device__ __forceinline__ uint32_t* flag_at(void* region, int parity, int src, int block) {
  return static_cast<uint32_t*>(region) +
         (parity * kPeerGatherMaxRanks + src) * kPeerGatherMaxBlocks + block;
}

__device__ __forceinline__ uint4* data_at(void* region, int parity, int src, int world,
                                          int64_t slot_bytes) {
  return reinterpret_cast<uint4*>(static_cast<char*>(region) + kDataOffset +
                                  (parity * world + src) * slot_bytes);
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// This CTA's flag to every peer, published once its stores into the peers' inboxes are done,
// then the same CTA's flag of every peer awaited in this rank's inbox.
__device__ __forceinline__ void publish_and_wait(const PeerGather& g, int parity,
                                                 uint32_t epoch) {
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < g.world && t != g.rank) {
    // Cumulative release: the CTA's stores (ordered before this thread by the barrier) are
    // visible to the peer before the flag is.
    __threadfence_system();
    store_release_sys(flag_at(g.region[t], parity, g.rank, blockIdx.x), epoch);
    const uint32_t* f = flag_at(g.region[g.rank], parity, t, blockIdx.x);
    const uint64_t start = global_ns();
    while (static_cast<int32_t>(load_acquire_sys(f) - epoch) < 0) {
      if (global_ns() - start > g.timeout_ns) {
        printf("peer exchange (%s:%d) rank %d: no data from rank %d for %llu ms (call %u)\n",
               __FILE__, __LINE__, g.rank, t,
               static_cast<unsigned long long>(g.timeout_ns / 1000000), epoch);
        __trap();
      }
    }
  }
  __syncthreads();
}

// The exchange of the gather and the plain sum: this CTA's chunk [lo, hi) of `in` stored into
// every peer's inbox, then publish_and_wait.
__device__ __forceinline__ void exchange(const PeerGather& g, const uint4* in, int64_t lo,
                                         int64_t hi, int parity, uint32_t epoch) {
  for (int dst = 0; dst < g.world; ++dst) {
    if (dst == g.rank) continue;
    uint4* d = data_at(g.region[dst], parity, g.rank, g.world, g.slot_bytes);
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = in[i];
  }
  publish_and_wait(g, parity, epoch);
}

__device__ __forceinline__ const uint4* block_of(const PeerGather& g, const uint4* in, int src,
                                                 int parity) {
  return src == g.rank ? in : data_at(g.region[g.rank], parity, src, g.world, g.slot_bytes);
}

__global__ void __launch_bounds__(kThreads)
    peer_all_gather_kernel(PeerGather g, const uint4* in, uint4* out, int64_t vecs,
                           uint32_t epoch) {
  // `in` is the previous kernel's output. No pdl_launch_dependents(): the kernels after this
  // one launch when it ends. Letting them launch as it starts (their CTAs, and through them the
  // next kernels', resident while this one waits for the peers) made a 2 x H200 decode step
  // slower: 5.72-5.78 against 5.36-5.53 ms at 2K context, 13.43-13.59 against 13.19-13.26 at
  // 128K (docs/benchmarks.md).
  pdl_wait();
  const int parity = static_cast<int>(epoch & 1u);
  const int64_t per = (vecs + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * per;
  const int64_t hi = lo + per < vecs ? lo + per : vecs;
  exchange(g, in, lo, hi, parity, epoch);
  for (int src = 0; src < g.world; ++src) {
    const uint4* s = block_of(g, in, src, parity);
    uint4* d = out + src * vecs;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
  }
}

// Chunk i of the sum: (o, out[i], when accumulating) + every rank's chunk i in rank order, in
// fp32, rounded once: every rank gets the same bits. `own` is this rank's chunk i.
template <typename T>
__device__ __forceinline__ uint4 sum_chunk(const PeerGather& g, uint4 own, uint4 o, int64_t i,
                                           int parity, bool accumulate) {
  constexpr int kPer = 16 / sizeof(T);
  float acc[kPer];
  const T* ov = reinterpret_cast<const T*>(&o);
  for (int j = 0; j < kPer; ++j) acc[j] = accumulate ? load_f32(ov + j) : 0.f;
  for (int src = 0; src < g.world; ++src) {
    const uint4 v =
        src == g.rank ? own : data_at(g.region[g.rank], parity, src, g.world, g.slot_bytes)[i];
    const T* vv = reinterpret_cast<const T*>(&v);
    for (int j = 0; j < kPer; ++j) acc[j] += load_f32(vv + j);
  }
  T* w = reinterpret_cast<T*>(&o);
  for (int j = 0; j < kPer; ++j) store_f32(w + j, acc[j]);
  return o;
}

// The same exchange, then out = (out when accumulating) + the blocks summed (sum_chunk).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    peer_all_reduce_kernel(PeerGather g, const uint4* in, uint4* out, int64_t vecs,
                           uint32_t epoch, bool accumulate) {
  pdl_wait();  // as peer_all_gather_kernel
  const int parity = static_cast<int>(epoch & 1u);
  const int64_t per = (vecs + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * per;
  const int64_t hi = lo + per < vecs ? lo + per : vecs;
  exchange(g, in, lo, hi, parity, epoch);
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    out[i] = sum_chunk<T>(g, in[i], out[i], i, parity, accumulate);
  }
}

// A decode step's row-parallel sum into the residual and the next RMSNorm in one launch: block
// r takes row r in registers, as rms_norm_held holds it. Its chunks of `in` and of x are loaded
// at once (one round trip, not one a chunk), stored from registers into every peer's inbox;
// once the peers' are in, x += the sum (sum_chunk) and h = rms_norm(x) * w, the norm kernel's
// bits. `in` may be h: it is read whole before h is written.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    peer_all_reduce_norm_kernel(PeerGather g, const uint4* in, uint4* x, const uint4* w,
                                uint4* h, int row_vecs, int64_t dim, float eps, uint32_t epoch) {
  uint4 wv[kNormVecChunks], xv[kNormVecChunks], mine[kNormVecChunks];
  load_held<true>(w, row_vecs, wv);  // the weights before the wait, as the norm does
  pdl_wait();  // as peer_all_gather_kernel
  const int parity = static_cast<int>(epoch & 1u);
  const int64_t lo = int64_t{blockIdx.x} * row_vecs;
  load_held<false>(in + lo, row_vecs, mine);
  load_held<false>(x + lo, row_vecs, xv);
  for (int dst = 0; dst < g.world; ++dst) {
    if (dst == g.rank) continue;
    uint4* d = data_at(g.region[dst], parity, g.rank, g.world, g.slot_bytes) + lo;
#pragma unroll
    for (int i = 0; i < kNormVecChunks; ++i) {
      if (holds_chunk(i, row_vecs)) d[threadIdx.x + i * kNormThreads] = mine[i];
    }
  }
  publish_and_wait(g, parity, epoch);
#pragma unroll
  for (int i = 0; i < kNormVecChunks; ++i) {
    const int64_t c = lo + threadIdx.x + i * kNormThreads;
    if (holds_chunk(i, row_vecs)) xv[i] = sum_chunk<T>(g, mine[i], xv[i], c, parity, true);
  }
#pragma unroll
  for (int i = 0; i < kNormVecChunks; ++i) {
    if (holds_chunk(i, row_vecs)) x[lo + threadIdx.x + i * kNormThreads] = xv[i];
  }
  rms_norm_held<T>(xv, wv, row_vecs, dim, eps, h + lo);
}

// The launch both share; 0 when the arguments are valid, with the grid's block count.
int64_t exchange_blocks(const PeerGather& g, const void* in, const void* out, int64_t bytes) {
  if (g.world < 2 || g.world > kPeerGatherMaxRanks || g.rank < 0 || g.rank >= g.world ||
      bytes <= 0 || bytes % 16 != 0 || bytes > g.slot_bytes || g.slot_bytes % 16 != 0 || !in ||
      !out || (reinterpret_cast<uintptr_t>(in) & 15u) || (reinterpret_cast<uintptr_t>(out) & 15u)) {
    return 0;
  }
  for (int r = 0; r < g.world; ++r) {
    if (!g.region[r] || (reinterpret_cast<uintptr_t>(g.region[r]) & 15u)) return 0;
  }
  // About 4 KB a CTA, at most kPeerGatherMaxBlocks: every CTA must be resident at once (each
  // spins until the same CTA of every peer has stored), which this few on one GPU always are.
  const int64_t blocks = (bytes / 16 + 255) / 256;
  return blocks > kPeerGatherMaxBlocks ? kPeerGatherMaxBlocks : blocks;
}

}  // namespace

int64_t peer_gather_region_bytes(int world, int64_t slot_bytes) {
  return kDataOffset + 2 * int64_t{world} * slot_bytes;
}

cudaError_t peer_all_gather_cuda(const PeerGather& g, const void* in, void* out, int64_t bytes,
                                 uint32_t epoch, cudaStream_t stream) {
  const int64_t blocks = exchange_blocks(g, in, out, bytes);
  if (blocks == 0) return cudaErrorInvalidValue;
  return launch_chained<peer_all_gather_kernel>(dim3(static_cast<unsigned>(blocks)),
                                                dim3(kThreads), 0, stream, g,
                                                static_cast<const uint4*>(in),
                                                static_cast<uint4*>(out), bytes / 16, epoch);
}

cudaError_t peer_all_reduce_cuda(const PeerGather& g, const void* in, void* out, int64_t bytes,
                                 DType dtype, bool accumulate, uint32_t epoch,
                                 cudaStream_t stream) {
  const int64_t blocks = exchange_blocks(g, in, out, bytes);
  if (blocks == 0) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_chained<peer_all_reduce_kernel<T>>(
        dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, g,
        static_cast<const uint4*>(in), static_cast<uint4*>(out), bytes / 16, epoch, accumulate);
  });
}

cudaError_t peer_all_reduce_norm_cuda(const PeerGather& g, const void* in, void* x,
                                      const void* w, void* h, int64_t rows, int64_t dim,
                                      float eps, DType dtype, uint32_t epoch,
                                      cudaStream_t stream) {
  if (!peer_all_reduce_norm_applies(g, in, x, w, h, rows, dim, dtype) || !(eps >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto row_vecs = static_cast<int>(dim / kPerChunk<T>);
    return launch_chained<peer_all_reduce_norm_kernel<T>>(
        dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), 0, stream, g,
        static_cast<const uint4*>(in), static_cast<uint4*>(x), static_cast<const uint4*>(w),
        static_cast<uint4*>(h), row_vecs, dim, eps, epoch);
  });
}

bool peer_all_reduce_norm_applies(const PeerGather& g, const void* in, const void* x,
                                  const void* w, const void* h, int64_t rows, int64_t dim,
                                  DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) return false;
  const int64_t size = dtype == DType::kF32 ? 4 : 2;
  const bool held = dtype == DType::kF32 ? norm_row_held<float>(dim) : norm_row_held<__half>(dim);
  if (!held || rows < 1 || rows > kPeerGatherMaxBlocks) return false;
  auto aligned = [](const void* p) { return p && (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  return aligned(w) && aligned(h) && exchange_blocks(g, in, x, rows * dim * size) > 0;
}

}  // namespace burst::kernels
