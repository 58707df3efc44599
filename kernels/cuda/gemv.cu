// out[m, n] (+)= x[m, k] . w[n, k]^T for a few rows m (a decode step's GEMMs): the contracts of
// gemv_cuda, gemv_multi_cuda and gemv_swiglu_cuda in kernels/ops_cuda.h.
//
// At m <= 4 a GEMM of the 7B's weights is a read of w, and cuBLAS's kernels read it at ~76 % of
// the H200's bandwidth (docs/benchmarks.md). Here each warp owns kRows rows of w and streams them
// once, 16 bytes a lane per load, kUnroll loads per row in flight before any arithmetic (bytes in
// flight are what a memory-bound kernel lives on); x (m rows, a few KB) is read beside them
// through L1. Every lane
// accumulates its share of the dot products in fp32, the warp reduces them with shuffles, and
// the sum is rounded once at the store (after adding out's old value when accumulating), as
// cuBLAS with fp32 compute does.
//
// A decode step chains these with small kernels, so the launch is a programmatic dependent
// (cuda_dispatch.cuh): the first loads of w (which no kernel writes) are issued before
// pdl_wait, while the kernel before still runs; x and out are touched only after it.
// One launch serves several products of the same x (q, k and v: "segments", a CTA's segment
// found from its index), or gate and up together with SwiGLU applied at the store (a warp
// streams row j of both; out[j] = silu(gate_j) * up_j from the two sums rounded as the separate
// products would store them, so the result is theirs bit for bit), or q, k and v with RoPE
// applied to q and k at the store (GemvRope: a warp streams the pair of rows RoPE turns
// together, d and d + head_dim / 2 of one head, and rotates the two rounded sums as the rope
// kernel would; one launch fewer a layer). (Folding the RMSNorm before
// them in, every warp computing the row's scale in rms_norm's order, ran slower on an H200: 32
// layers' chain 4.48 against 4.04-4.07 ms; each warp re-reads x, 88 MB of L1/L2 reads a step
// for gate/up alone, before its first product.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda_dispatch.cuh"
#include "kernels/ops_cuda.h"

namespace burst::kernels {
namespace {

constexpr int kWarps = 4;   // per CTA
constexpr int kRows = 2;    // rows of w per warp
constexpr int kUnroll = 4;  // 16-byte loads of each w row in flight per lane
constexpr int kVec = 8;     // 16-bit elements per 16-byte load
constexpr int kStep = 32 * kUnroll;  // 16-byte chunks of a row per iteration of a warp

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

// Up to kGemvMaxOuts products of one x: segment s is w[s] [n[s], k] -> out[s] [m, n[s]], served
// by CTAs [first_cta[s], first_cta[s + 1]). With SwiGLU one segment: w[0] gate, w[1] up.
// The first rope_count segments rotate at the store (GemvRope): warp j of such a segment
// streams rows d and d + half of head j / half (d = j % half), the pair RoPE turns together.
template <typename T>
struct Segments {
  const T* w[kGemvMaxOuts];
  T* out[kGemvMaxOuts];
  int n[kGemvMaxOuts];
  int first_cta[kGemvMaxOuts + 1];
  int count;
  int rope_count;  // 0: none
  int half;        // head_dim / 2
  const int64_t* positions;
  const float* inv_freq;
};

// Outputs per warp: kRows rows of one w, or one row of gate and of up.
template <bool kSwiglu>
constexpr int kOutsPerWarp = kSwiglu ? 1 : kRows;

template <typename T, int kM, bool kSwiglu>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const Segments<T> sg, int k, int accumulate) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // This CTA's segment (constant indices only: a dynamic one would copy sg to local memory).
  const T* w = sg.w[0];
  T* out = sg.out[0];
  int n = sg.n[0], first_cta = 0, seg = 0;
#pragma unroll
  for (int s = 1; s < kGemvMaxOuts; ++s) {
    if (s < sg.count && static_cast<int>(blockIdx.x) >= sg.first_cta[s]) {
      w = sg.w[s];
      out = sg.out[s];
      n = sg.n[s];
      first_cta = sg.first_cta[s];
      seg = s;
    }
  }
  constexpr int kOuts = kOutsPerWarp<kSwiglu>;
  const int wi = (static_cast<int>(blockIdx.x) - first_cta) * kWarps + warp;
  // Rotating: rows n0 and n0 + half (n0 = head * 2 half + d); otherwise rows n0, n0 + 1, ...
  const bool rope = !kSwiglu && seg < sg.rope_count;
  const int n0 = rope ? wi / sg.half * 2 * sg.half + wi % sg.half : wi * kOuts;
  const int row_step = rope ? sg.half : 1;
  // The next kernel may be scheduled now (it waits for this grid before touching our output).
  pdl_launch_dependents();
  if (rope ? wi * kRows >= n : n0 >= n) return;
  const int chunks = k / kVec;
  // A row past n (the last warp's tail) re-reads row n - 1; its sum is not stored.
  const uint4* wr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const T* base = kSwiglu ? sg.w[r] + int64_t{n0} * k
                            : w + int64_t{min(n0 + r * row_step, n - 1)} * k;
    wr[r] = reinterpret_cast<const uint4*>(base);
  }
  auto load = [&](uint4 (&wv)[kUnroll][kRows], int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[u][r] = c < chunks ? load_stream(wr[r] + c) : uint4{};
    }
  };
  // The first batch of w is issued before the wait (weights: no earlier kernel writes them),
  // the rest a batch at a time. (Two batches in flight, the next issued before the current one
  // is used, ran slower on an H200: 16 against 14 us at 4096 x 4096, 33 against 31 at 11008 x
  // 4096; the CTAs a multiprocessor holds already cover the latency.)
  uint4 cur[kUnroll][kRows];
  load(cur, 0);
  pdl_wait();  // x (and out, when accumulating) are the kernel before's
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  float acc[kM][kRows];
#pragma unroll
  for (int i = 0; i < kM; ++i) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[i][r] = 0.f;
  }
  for (int base = 0; base < chunks; base += kStep) {
    if (base > 0) load(cur, base);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * 32 + lane;
      if (c >= chunks) break;
#pragma unroll
      for (int i = 0; i < kM; ++i) {
        const uint4 xv = __ldg(xr + int64_t{i} * chunks + c);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[i][r] = dot8<T>(xv, cur[u][r], acc[i][r]);
      }
    }
  }
  // Every lane ends with the full sums; one lane stores each output of the warp.
#pragma unroll
  for (int i = 0; i < kM; ++i) {
    float v[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      v[r] = acc[i][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], off);
    }
    if (rope) {
      // The pair rounded as the plain stores would leave it, then rope_kernel's arithmetic.
      if (lane == i * kRows || lane == i * kRows + 1) {
        T a, b;
        store_f32(&a, v[0]);
        store_f32(&b, v[1]);
        const int d = n0 % (2 * sg.half);
        const float2 y = rope_rotate(load_f32(&a), load_f32(&b), sg.positions[i], sg.inv_freq[d]);
        if (lane == i * kRows) {
          store_f32(out + int64_t{i} * n + n0, y.x);
        } else {
          store_f32(out + int64_t{i} * n + n0 + sg.half, y.y);
        }
      }
    } else if constexpr (kSwiglu) {
      if (lane == i) {
        // gate and up rounded as their own products would be stored, then silu_mul's formula.
        T g, u;
        store_f32(&g, v[0]);
        store_f32(&u, v[1]);
        store_f32(out + int64_t{i} * n + n0, silu_times(load_f32(&g), load_f32(&u)));
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (lane == i * kRows + r && n0 + r < n) {
          T* o = out + int64_t{i} * n + n0 + r;
          store_f32(o, accumulate ? load_f32(o) + v[r] : v[r]);
        }
      }
    }
  }
}
static_assert(kGemvMaxRows * kRows <= 32, "one lane stores each output of a warp");
static_assert(kRows == 2, "a rotating warp streams the two rows of one RoPE pair");

template <typename T, int kM, bool kSwiglu>
cudaError_t launch(const void* x, const Segments<T>& sg, int k, bool accumulate,
                   cudaStream_t stream) {
  return launch_chained<gemv_kernel<T, kM, kSwiglu>>(
      dim3(static_cast<unsigned>(sg.first_cta[sg.count])), dim3(kWarps * 32), 0, stream,
      static_cast<const T*>(x), sg, k, accumulate ? 1 : 0);
}

template <typename T, bool kSwiglu>
cudaError_t dispatch_rows(const void* x, const Segments<T>& sg, int64_t m, int k,
                          bool accumulate, cudaStream_t stream) {
  static_assert(kGemvMaxRows == 4, "one instantiation per row count");
  switch (m) {
    case 1: return launch<T, 1, kSwiglu>(x, sg, k, accumulate, stream);
    case 2: return launch<T, 2, kSwiglu>(x, sg, k, accumulate, stream);
    case 3: return launch<T, 3, kSwiglu>(x, sg, k, accumulate, stream);
    default: return launch<T, 4, kSwiglu>(x, sg, k, accumulate, stream);
  }
}

// Segments of `count` products (outs), CTAs counted per segment; false where they do not fit.
template <typename T>
bool make_segments(const GemvOut* outs, int count, bool swiglu, const GemvRope* rope,
                   Segments<T>& sg) {
  sg = Segments<T>{};
  sg.count = count;
  if (rope) {
    sg.rope_count = rope->segments;
    sg.half = rope->head_dim / 2;
    sg.positions = rope->positions;
    sg.inv_freq = rope->inv_freq;
  }
  const int per_cta = kWarps * (swiglu ? kOutsPerWarp<true> : kOutsPerWarp<false>);
  int64_t ctas = 0;
  for (int s = 0; s < (swiglu ? 2 : count); ++s) {
    sg.w[s] = static_cast<const T*>(outs[s].w);
    sg.out[s] = static_cast<T*>(outs[s].out);
    sg.n[s] = static_cast<int>(outs[s].n);
  }
  for (int s = 0; s < count; ++s) {
    sg.first_cta[s] = static_cast<int>(ctas);
    ctas += (outs[s].n + per_cta - 1) / per_cta;
    if (ctas > INT32_MAX) return false;
  }
  sg.first_cta[count] = static_cast<int>(ctas);
  return true;
}

template <bool kSwiglu>
cudaError_t run(const void* x, const GemvOut* outs, int count, int64_t m, int64_t k, DType dtype,
                bool accumulate, cudaStream_t stream, const GemvRope* rope = nullptr) {
  const int ki = static_cast<int>(k);
  if (dtype == DType::kBF16) {
    Segments<__nv_bfloat16> sg;
    if (!make_segments(outs, count, kSwiglu, rope, sg)) return cudaErrorInvalidValue;
    return dispatch_rows<__nv_bfloat16, kSwiglu>(x, sg, m, ki, accumulate, stream);
  }
  Segments<__half> sg;
  if (!make_segments(outs, count, kSwiglu, rope, sg)) return cudaErrorInvalidValue;
  return dispatch_rows<__half, kSwiglu>(x, sg, m, ki, accumulate, stream);
}

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
  const GemvOut one{w, out, n};
  return run<false>(x, &one, 1, m, k, dtype, accumulate, stream);
}

cudaError_t gemv_multi_cuda(const void* x, const GemvOut* outs, int count, int64_t m, int64_t k,
                            DType dtype, cudaStream_t stream, const GemvRope* rope) {
  if (outs == nullptr || count < 1 || count > kGemvMaxOuts) return cudaErrorInvalidValue;
  for (int s = 0; s < count; ++s) {
    if (!gemv_cuda_applies(m, outs[s].n, k, dtype, x, outs[s].w, outs[s].out)) {
      return cudaErrorInvalidValue;
    }
  }
  if (rope) {
    if (!rope->positions || !rope->inv_freq || rope->head_dim < 2 || rope->head_dim % 2 != 0 ||
        rope->segments < 1 || rope->segments > count) {
      return cudaErrorInvalidValue;
    }
    for (int s = 0; s < rope->segments; ++s) {
      if (outs[s].n % rope->head_dim != 0) return cudaErrorInvalidValue;
    }
  }
  return run<false>(x, outs, count, m, k, dtype, false, stream, rope);
}

cudaError_t gemv_swiglu_cuda(const void* x, const void* w_gate, const void* w_up, void* out,
                             int64_t m, int64_t n, int64_t k, DType dtype, cudaStream_t stream) {
  if (!gemv_cuda_applies(m, n, k, dtype, x, w_gate, out) ||
      !gemv_cuda_applies(m, n, k, dtype, x, w_up, out)) {
    return cudaErrorInvalidValue;
  }
  const GemvOut pair[2] = {{w_gate, out, n}, {w_up, out, n}};
  return run<true>(x, pair, 1, m, k, dtype, false, stream);
}

}  // namespace burst::kernels
