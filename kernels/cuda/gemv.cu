// out[m, n] (+)= x[m, k] . w[n, k]^T for a few rows m (a decode step's GEMMs): the contract of
// gemv_cuda in kernels/ops_cuda.h.
//
// At m <= 4 a GEMM of the 7B's weights is a read of w, and cuBLAS's kernels read it at ~76 % of
// the H200's bandwidth (docs/benchmarks.md). Here each warp owns kRows rows of w and streams them
// once, 16 bytes a lane per load, kUnroll loads per row in flight before any arithmetic (bytes in
// flight are what a memory-bound kernel lives on); x (m rows, a few KB) is read beside them
// through L1. Every lane accumulates its share of the dot products in fp32, the warp reduces
// them with shuffles, and the sum is rounded once at the store (after adding out's old value
// when accumulating), as cuBLAS with fp32 compute does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda_dispatch.cuh"
#include "kernels/ops_cuda.h"

namespace burst::kernels {
namespace {

constexpr int kWarps = 4;   // per CTA
constexpr int kRows = 2;    // rows of w (outputs) per warp
constexpr int kUnroll = 4;  // 16-byte loads of each w row in flight per lane
constexpr int kVec = 8;     // 16-bit elements per 16-byte load

// Streams w: read once, so keep it out of L1 (it would only evict x).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ float2 to_float2(uint32_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

// acc += the dot product of 8 elements of x and of w.
template <typename T>
__device__ __forceinline__ float dot8(const uint4& xv, const uint4& wv, float acc) {
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 a = to_float2<T>(xs[j]), b = to_float2<T>(ws[j]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

template <typename T, int kM>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out, int n,
                int k, int accumulate) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kWarps + warp) * kRows;
  if (n0 >= n) return;
  const int chunks = k / kVec;
  // A row past n (the last warp's tail) re-reads row n - 1; its sum is not stored.
  const uint4* wr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    wr[r] = reinterpret_cast<const uint4*>(w + int64_t{min(n0 + r, n - 1)} * k);
  }
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  float acc[kM][kRows];
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[i][r] = 0.f;
  }
  for (int base = 0; base < chunks; base += 32 * kUnroll) {
    uint4 wv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[u][r] = c < chunks ? load_stream(wr[r] + c) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * 32 + lane;
      if (c >= chunks) break;
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        const uint4 xv = __ldg(xr + int64_t{i} * chunks + c);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[i][r] = dot8<T>(xv, wv[u][r], acc[i][r]);
      }
    }
  }
  // Every lane ends with the full sums; lane i * kRows + r stores out[i, n0 + r].
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float v = acc[i][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == i * kRows + r && n0 + r < n) {
        T* o = out + int64_t{i} * n + n0 + r;
        store_f32(o, accumulate ? load_f32(o) + v : v);
      }
    }
  }
}
static_assert(kGemvMaxRows * kRows <= 32, "one lane stores each output of a warp");

template <typename T, int kM>
cudaError_t launch(const void* x, const void* w, void* out, int n, int k, bool accumulate,
                   cudaStream_t stream) {
  const int rows_per_cta = kWarps * kRows;
  const unsigned grid = static_cast<unsigned>((n + rows_per_cta - 1) / rows_per_cta);
  gemv_kernel<T, kM><<<grid, kWarps * 32, 0, stream>>>(static_cast<const T*>(x),
                                                       static_cast<const T*>(w),
                                                       static_cast<T*>(out), n, k, accumulate);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_rows(const void* x, const void* w, void* out, int64_t m, int n, int k,
                          bool accumulate, cudaStream_t stream) {
  static_assert(kGemvMaxRows == 4, "one instantiation per row count");
  switch (m) {
    case 1: return launch<T, 1>(x, w, out, n, k, accumulate, stream);
    case 2: return launch<T, 2>(x, w, out, n, k, accumulate, stream);
    case 3: return launch<T, 3>(x, w, out, n, k, accumulate, stream);
    default: return launch<T, 4>(x, w, out, n, k, accumulate, stream);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

bool gemv_cuda_applies(int64_t m, int64_t n, int64_t k, DType dtype, const void* x,
                       const void* w, const void* out) {
  return m >= 1 && m <= kGemvMaxRows && n >= 1 && n <= INT32_MAX && k >= kVec &&
         k % kVec == 0 && k <= INT32_MAX && (dtype == DType::kBF16 || dtype == DType::kF16) &&
         aligned16(x) && aligned16(w) && out != nullptr;
}

cudaError_t gemv_cuda(const void* x, const void* w, void* out, int64_t m, int64_t n, int64_t k,
                      DType dtype, bool accumulate, cudaStream_t stream) {
  if (!gemv_cuda_applies(m, n, k, dtype, x, w, out)) return cudaErrorInvalidValue;
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  return dtype == DType::kBF16
             ? dispatch_rows<__nv_bfloat16>(x, w, out, m, ni, ki, accumulate, stream)
             : dispatch_rows<__half>(x, w, out, m, ni, ki, accumulate, stream);
}

}  // namespace burst::kernels
