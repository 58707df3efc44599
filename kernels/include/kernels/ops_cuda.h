// CUDA twins of the element-wise and row-wise LLaMA ops of kernels/ops.h: same contracts and
// layouts (contiguous row-major), activations and weights in `dtype` (kBF16, kF16 or kF32),
// arithmetic and accumulation in fp32, one rounding to dtype at the store. All pointers are
// device pointers; launchers are asynchronous on `stream` and return the first CUDA error
// (cudaErrorInvalidValue for bad arguments). n = 0 / rows = 0 are no-ops.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/attention.h"  // DType

namespace burst::kernels {

// Switches of every launch in this process, set once before the first launch by a program's
// main (through engine::make_cuda_backend's Tuning, or the kernel benchmark's own): pdl false
// launches every kernel plainly, never as a programmatic dependent (cuda_dispatch.cuh's
// launch_chained; a kernel decides at its first launch on a device and keeps to it).
struct LaunchSwitches {
  bool pdl = true;
};
void set_launch_switches(const LaunchSwitches& switches);
LaunchSwitches launch_switches();

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w; x, out [rows, dim]; w [dim]. The sum
// of squares is an fp32 tree reduction over the row (one block per row).
cudaError_t rms_norm_cuda(const void* x, const void* w, void* out, int64_t rows, int64_t dim,
                          float eps, DType dtype, cudaStream_t stream);

// Rotate-half RoPE in place (HF LLaMA): x [rows, heads, head_dim] with row stride row_stride
// (elements); pairs (d, d + head_dim / 2) rotate by the fp32 angle positions[r] * inv_freq[d],
// cos/sin in fp32 with full-range argument reduction. positions [rows] (absolute, int64) and
// inv_freq [head_dim / 2] (fp32) are device arrays. head_dim must be even.
cudaError_t rope_cuda(void* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                      const int64_t* positions, const float* inv_freq, DType dtype,
                      cudaStream_t stream);
// The same on q [rows, heads, head_dim] and k [rows, kv_heads, head_dim] (row strides q_stride,
// k_stride) in one launch; kv_heads may be 0 (k unused).
cudaError_t rope_qk_cuda(void* q, int64_t heads, int64_t q_stride, void* k, int64_t kv_heads,
                         int64_t k_stride, int64_t rows, int64_t head_dim,
                         const int64_t* positions, const float* inv_freq, DType dtype,
                         cudaStream_t stream);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)); n elements.
cudaError_t silu_mul_cuda(const void* gate, const void* up, void* out, int64_t n, DType dtype,
                          cudaStream_t stream);

// out[r, :] = table[id, :]; table [vocab, dim]; ids [rows] int32 on the device: id = ids[r],
// or drawn[-1 - ids[r]] where ids[r] < 0. That negative encoding is this launcher's alone: a row
// whose id an earlier kernel drew on the device (Backend::DrawnId's index k) is passed as
// -1 - k, by the CUDA backend only; drawn may be null when no id is negative. Every id in range
// (checked by the caller, as for embedding_cpu).
cudaError_t embedding_cuda(const void* table, const int32_t* ids, const int32_t* drawn, void* out,
                           int64_t rows, int64_t dim, DType dtype, cudaStream_t stream);

// dst = src ([bytes], a multiple of 16; both 16-byte aligned) by a kernel launched chained with
// the step's others (launch_chained): a cudaMemcpyAsync between two chained kernels waits for
// the one before to end and holds back the launch of the one after.
cudaError_t copy_chained_cuda(void* dst, const void* src, int64_t bytes, cudaStream_t stream);

// Paged row gather, the twin of gather_rows_cpu: dst row i = pool row pages[i / page_size] *
// page_size + i % page_size; row_bytes a multiple of 16, pool and dst 16-byte aligned; pages
// is a device array. One launch for every row (the ring gathers a sequence's cached prefix).
cudaError_t gather_rows_cuda(const void* pool, const int32_t* pages, int64_t page_size,
                             int64_t rows, int64_t row_bytes, void* dst, cudaStream_t stream);

// Row scatter, the twin of scatter_rows_cpu (negative dst_rows skip); same alignment rules as
// gather_rows_cuda; dst_rows is a device array.
cudaError_t scatter_rows_cuda(const void* src, const int32_t* dst_rows, int64_t rows,
                              int64_t row_bytes, void* pool, cudaStream_t stream);
// Two scatters to the same rows in one launch (a decode step's k and v): src0 into pool0 and
// src1 into pool1 (both or neither of src1, pool1 given), the rules of scatter_rows_cuda.
cudaError_t scatter_rows_pair_cuda(const void* src0, void* pool0, const void* src1, void* pool1,
                                   const int32_t* dst_rows, int64_t rows, int64_t row_bytes,
                                   cudaStream_t stream);

// FP8 KV rows (kernels/kv_fp8.h), the twins of quantize_kv_cpu and dequantize_kv_cpu (the same
// bytes and values). quantize_kv_cuda: src [rows, kv_heads * head_dim] of dtype into FP8 rows
// of dst: row i into row dst_rows[i] (a device array; negative: skipped) or, null, row i;
// kv_heads * head_dim a multiple of 4. dequantize_kv_cuda: dst [rows, kv_heads * head_dim] of
// dtype = the values of src's rows [0, rows), rounded once; head_dim a multiple of 8, src and
// dst 16-byte aligned.
cudaError_t quantize_kv_cuda(const void* src, DType dtype, int64_t rows, int kv_heads,
                             int head_dim, const int32_t* dst_rows, void* dst,
                             cudaStream_t stream);
cudaError_t dequantize_kv_cuda(const void* src, int64_t rows, int kv_heads, int head_dim,
                               void* dst, DType dtype, cudaStream_t stream);

// dst[i] = src[i] converted through fp32 (which holds bf16 and fp16 exactly: one rounding at
// most); n elements, any pair of dtypes.
cudaError_t convert_cuda(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                         cudaStream_t stream);

// out[m, n] (+)= x[m, k] . w[n, k]^T for the few rows of a decode step (1 <= m <=
// kGemvMaxRows): x, w, out contiguous row-major in dtype (kBF16 or kF16), k a multiple of 8,
// x and w 16-byte aligned; fp32 accumulation, out rounded once (after adding its old value when
// accumulating). A weight-streaming kernel: cuBLAS reads w more slowly at these m.
// gemv_cuda_applies says whether it takes these arguments (else cudaErrorInvalidValue).
constexpr int64_t kGemvMaxRows = 4;
bool gemv_cuda_applies(int64_t m, int64_t n, int64_t k, DType dtype, const void* x,
                       const void* w, const void* out);
cudaError_t gemv_cuda(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k,
                      DType dtype, bool accumulate, cudaStream_t stream);

// Several products of one x in one launch (a layer's q, k and v): out_s = x . w_s^T for each of
// `count` (<= kGemvMaxOuts) outputs, each as gemv_cuda would store it (no accumulation); every
// (w_s, out_s, n_s) must satisfy gemv_cuda_applies.
constexpr int kGemvMaxOuts = 3;
struct GemvOut {
  const void* w;  // [n, k]
  void* out;      // [m, n]
  int64_t n;
};
// With `rope`, the first rope->segments outputs (a layer's q and k) leave the launch rotated:
// bit for bit gemv_multi_cuda's stores then rope_qk_cuda on them (each rotated pair is rounded
// to dtype as those stores would, then turned by the same arithmetic); their n must be a
// multiple of head_dim. One launch fewer a layer in a decode step.
struct GemvRope {
  const int64_t* positions;  // [m], device
  const float* inv_freq;     // [head_dim / 2], device
  int head_dim;              // even
  int segments;              // 1..count
};
cudaError_t gemv_multi_cuda(const void* x, const GemvOut* outs, int count, int64_t m, int64_t k,
                            DType dtype, cudaStream_t stream, const GemvRope* rope = nullptr);

// out[m, n] = silu(x . w_gate^T) * (x . w_up^T): bit for bit what gemv_cuda into gate and up,
// then silu_mul_cuda, store (both products rounded to dtype first), without the two [m, n]
// intermediates; as gemv_cuda_applies for each weight.
cudaError_t gemv_swiglu_cuda(const void* x, const void* w_gate, const void* w_up, void* out,
                             int64_t m, int64_t n, int64_t k, DType dtype, cudaStream_t stream);

// x[i] += y[i] in fp32, one rounding to dtype; n elements.
cudaError_t add_cuda(void* x, const void* y, int64_t n, DType dtype, cudaStream_t stream);

// Which part of a [*, cols] matrix out is ([*, local_cols], from row0 and col0 on).
struct FillWindow {
  int64_t local_cols, cols, row0, col0;
};
// out[i] = uniform_at(seed, counter, scale) (kernels/random.h) with counter the element's index
// in the whole matrix ((row0 + i / local_cols) * cols + col0 + i % local_cols), rounded once to
// dtype: the CPU backend's values element for element.
cudaError_t fill_uniform_cuda(void* out, int64_t n, DType dtype, uint64_t seed, float scale,
                              FillWindow window, cudaStream_t stream);
// out[i] = value rounded once to dtype (kBF16, kF16 or kF32), n elements.
cudaError_t fill_cuda(void* out, int64_t n, DType dtype, float value, cudaStream_t stream);

// The all-gather between the GPUs of one host without NCCL (the distributed decode's per-layer
// exchange of a few KB, where NCCL's call costs ~10 us): every rank owns a `region` of
// peer_gather_region_bytes(world, slot_bytes) zeroed device bytes that every other rank maps
// (CUDA IPC, peer access); region[r] is rank r's as this process sees it (region[rank]: its
// own). A call stores this rank's `bytes` (<= slot_bytes, a multiple of 16) into each peer's
// region and raises a flag per peer there (system-scope release), waits for every peer's flag
// in its own region (acquire) and writes out[r * bytes ...] = rank r's input for every r, as
// ncclAllGather does. Every rank makes the same sequence of calls with the same sizes; `epoch`
// is the call's number, from 1, one more each call: two alternating halves of the region keep
// a peer that is one call ahead off the data still being read. A peer that never arrives is a
// device trap after timeout_ns (the context is lost: the rank must exit), never a silent hang.
constexpr int kPeerGatherMaxRanks = 8;
constexpr int kPeerGatherMaxBlocks = 32;
struct PeerGather {
  int rank = 0, world = 1;
  void* region[kPeerGatherMaxRanks] = {};
  int64_t slot_bytes = 0;
  uint64_t timeout_ns = 60ull * 1000 * 1000 * 1000;
};
int64_t peer_gather_region_bytes(int world, int64_t slot_bytes);
cudaError_t peer_all_gather_cuda(const PeerGather& g, const void* in, void* out, int64_t bytes,
                                 uint32_t epoch, cudaStream_t stream);
// The same exchange as an all-reduce, in the one launch: out ([bytes] of dtype; may be in) =
// (out when accumulate) + every rank's `in` summed in rank order in fp32, rounded once (the
// same bits on every rank whose out is the same). Shares the region and the epochs with
// peer_all_gather_cuda.
cudaError_t peer_all_reduce_cuda(const PeerGather& g, const void* in, void* out, int64_t bytes,
                                 DType dtype, bool accumulate, uint32_t epoch,
                                 cudaStream_t stream);
// A decode step's row-parallel sum and the RMSNorm after it, in one launch: x ([rows, dim]) +=
// every rank's `in` summed as peer_all_reduce_cuda sums them (the same bits), then
// h = rms_norm(x) * w (eps) with rms_norm_cuda's bits. `in` may be h. Only where
// peer_all_reduce_norm_applies (rows <= kPeerGatherMaxBlocks, a row whole 16-byte chunks held
// by one block, 16-byte aligned, within a slot); the caller runs the two otherwise.
cudaError_t peer_all_reduce_norm_cuda(const PeerGather& g, const void* in, void* x,
                                      const void* w, void* h, int64_t rows, int64_t dim,
                                      float eps, DType dtype, uint32_t epoch, cudaStream_t stream);
bool peer_all_reduce_norm_applies(const PeerGather& g, const void* in, const void* x,
                                  const void* w, const void* h, int64_t rows, int64_t dim,
                                  DType dtype);

}  // namespace burst::kernels
