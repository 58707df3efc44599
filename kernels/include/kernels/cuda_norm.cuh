// The RMSNorm's arithmetic on a GPU, shared by its kernels (ops.cu) and the decode all-reduce
// that norms the sum it has just made, in the same launch (peer_gather.cu): one block of
// kNormThreads per row, out = w * (x * inv) rounded once per element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_chunks.cuh"

namespace burst::kernels {

constexpr int kNormThreads = 256;
static_assert(kNormThreads % 32 == 0 && kNormThreads <= 1024, "whole warps per block");
// Rows a thread holds in registers as whole 16-byte chunks: chunk threadIdx.x + i * kNormThreads
// for i < kNormVecChunks, so dim <= 8192 (16-bit) or 4096 (fp32).
constexpr int kNormVecChunks = 4;

// 1 / sqrt(mean of squares + eps) of a row from each thread's partial sum of squares: warp
// trees, then the warps' sums in order (one block of kNormThreads per row; every thread gets it).
__device__ __forceinline__ float rms_inverse(float ss, int64_t dim, float eps) {
  __shared__ float warp_sums[kNormThreads / 32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = ss;
  // The per-warp sums written above are read by every thread below.
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += warp_sums[i];
  return rsqrtf(total / static_cast<float>(dim) + eps);
}

// Whether this thread holds chunk threadIdx.x + i * kNormThreads of a row of `chunks` chunks.
__device__ __forceinline__ bool holds_chunk(int i, int chunks) {
  return static_cast<int>(threadIdx.x) + i * kNormThreads < chunks;
}

// The chunks of p this thread holds (holds_chunk), read through the read-only cache when
// kReadOnly (the norm's weights, loaded before a chained kernel's wait).
template <bool kReadOnly>
__device__ __forceinline__ void load_held(const uint4* p, int chunks,
                                          uint4 (&v)[kNormVecChunks]) {
#pragma unroll
  for (int i = 0; i < kNormVecChunks; ++i) {
    if (holds_chunk(i, chunks)) {
      const uint4* c = p + threadIdx.x + i * kNormThreads;
      v[i] = kReadOnly ? __ldg(c) : *c;
    }
  }
}

// The norm of a row this block holds in registers: xv[i] and wv[i] are the row's and the
// weights' chunk threadIdx.x + i * kNormThreads, for those below `chunks` (dim / kPerChunk<T>);
// out[c] = w * (x * inv) for the same chunks. Every thread of the block must call it.
template <typename T>
__device__ __forceinline__ void rms_norm_held(const uint4 (&xv)[kNormVecChunks],
                                              const uint4 (&wv)[kNormVecChunks], int chunks,
                                              int64_t dim, float eps, uint4* out) {
  constexpr int kPer = kPerChunk<T>;
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormVecChunks; ++i) {
    if (holds_chunk(i, chunks)) {
      float f[kPer];
      unpack_chunk<T>(xv[i], f);
#pragma unroll
      for (int j = 0; j < kPer; ++j) ss = fmaf(f[j], f[j], ss);
    }
  }
  const float inv = rms_inverse(ss, dim, eps);
#pragma unroll
  for (int i = 0; i < kNormVecChunks; ++i) {
    if (holds_chunk(i, chunks)) {
      float fx[kPer], fw[kPer];
      unpack_chunk<T>(xv[i], fx);
      unpack_chunk<T>(wv[i], fw);
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int j = 0; j < kPer; ++j) store_f32(oe + j, fw[j] * (fx[j] * inv));
      out[threadIdx.x + i * kNormThreads] = o;
    }
  }
}

// Whether rows of `dim` elements of T take the held-row norm (whole chunks, few enough).
template <typename T>
constexpr bool norm_row_held(int64_t dim) {
  return dim > 0 && dim % kPerChunk<T> == 0 &&
         dim <= int64_t{kPerChunk<T>} * kNormVecChunks * kNormThreads;
}

}  // namespace burst::kernels
