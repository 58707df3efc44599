// What the attention kernels of kernels/cuda/ share (private to this folder): the kernel
// arguments built from AttnParams, the PTX wrappers for async copies and exp2, fp32 -> 16-bit
// packing, and the per-architecture prefill entry points that attention_cuda() chooses from.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/cuda_dispatch.cuh"

namespace burst::kernels::detail {

// What a prefill kernel reads; built once by the launcher from AttnParams.
template <typename T, typename OutT>
struct KernelArgs {
  const T* q;
  const T* k;
  const T* v;
  OutT* o;
  float* lse;
  int64_t q_row_stride, q_head_stride;
  int64_t k_row_stride, k_head_stride;
  int64_t v_row_stride, v_head_stride;
  int64_t o_row_stride, o_head_stride;
  int64_t lse_head_stride;
  int64_t delta;  // q_start - kv_start: query i sees key j iff j <= i + delta (causal)
  int32_t n_q, n_kv, group;
  int32_t causal;
  float scale;       // natural-log units, for the LSE
  float scale_log2;  // scale * log2(e): scores go straight into exp2
  int32_t merge;     // AttnParams::merge_into_o (the sm90 kernel, fp32 o)
  // e4m3 operands (attention_sm90_fp8, AttnParams::qkv_fp8): a score is q8.k8 x q_scale x
  // k_scale, O's column d is (P.v8)[d] x v_scale[d]. q_scale[h * q_groups + i]: query rows of
  // group i, 64 rows counted from the first query tile's start (q_pad rows before row 0);
  // k_scale[g * k_blocks + n]: keys [128 n, 128 n + 128); v_scale[g * 128 + d]. Null otherwise.
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  int32_t q_groups, k_blocks, q_pad;
};

// What every prefill launch (attention_cuda, attention_fp8_cuda) requires of its params: valid,
// K and V contiguous (no pages, no FP8 rows), bf16 or f16 inputs, an output in that dtype or
// f32, at most 65535 heads (a grid dimension), strides a multiple of 8 elements and 16-byte
// aligned pointers (TMA and 16-byte loads). The head_dim each supports is its own check.
inline bool prefill_params_ok(const AttnParams& p) {
  if (!validate(p).empty() || p.kv_pages || p.kv_fp8) return false;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return false;
  const DType od = output_dtype(p);
  if ((od != p.dtype && od != DType::kF32) || p.heads > 65535) return false;
  const int64_t strides[] = {p.q_row_stride, p.q_head_stride, p.k_row_stride, p.k_head_stride,
                             p.v_row_stride, p.v_head_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0) return false;
  }
  return aligned16(p.q) && aligned16(p.o) && (p.n_kv == 0 || (aligned16(p.k) && aligned16(p.v)));
}

// The fields the prefill and decode kernels' arguments share (q, k, v, their strides, the
// mask), set from the params.
template <typename T, typename Args>
void set_qkv_args(Args& a, const AttnParams& p) {
  a.q = static_cast<const T*>(p.q);
  a.k = static_cast<const T*>(p.k);
  a.v = static_cast<const T*>(p.v);
  a.q_row_stride = p.q_row_stride;
  a.q_head_stride = p.q_head_stride;
  a.k_row_stride = p.k_row_stride;
  a.k_head_stride = p.k_head_stride;
  a.v_row_stride = p.v_row_stride;
  a.v_head_stride = p.v_head_stride;
  a.delta = p.q_start - p.kv_start;
  a.n_q = p.n_q;
  a.n_kv = p.n_kv;
  a.group = p.heads / p.kv_heads;
  a.causal = p.mask == MaskKind::kCausal ? 1 : 0;
  a.scale_log2 = p.scale * kLog2e;
}

template <typename T, typename OutT>
KernelArgs<T, OutT> make_kernel_args(const AttnParams& p) {
  KernelArgs<T, OutT> a{};
  set_qkv_args<T>(a, p);
  a.o = static_cast<OutT*>(p.o);
  a.lse = p.lse;
  a.o_row_stride = p.o_row_stride;
  a.o_head_stride = p.o_head_stride;
  a.lse_head_stride = p.lse_head_stride;
  a.merge = p.merge_into_o ? 1 : 0;
  a.scale = p.scale;
  return a;
}

// The keys a query block [m0, m0 + rows) sees under the mask: keys [0, n_end) are visible to
// at least one of its rows (all later key blocks are skipped); keys <= min_limit are visible to
// every row (key blocks ending there need no per-element mask).
struct KeyRange {
  int n_end, min_limit;
};
template <typename Args>
__device__ __forceinline__ KeyRange visible_keys(const Args& a, int m0, int rows) {
  if (!a.causal) return {a.n_kv, a.n_kv - 1};
  const int64_t last_row = m0 + rows - 1;
  return {static_cast<int>(std::clamp<int64_t>(last_row + a.delta + 1, 0, a.n_kv)),
          static_cast<int>(std::clamp<int64_t>(m0 + a.delta, -1, a.n_kv - 1))};
}

// The multiprocessor count of the current device (the prefill launches plan by it).
inline cudaError_t multiprocessors(int& sms) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
}

// Prefill launchers by architecture, for parameters attention_cuda() has validated.
cudaError_t attention_sm80(const AttnParams& p, cudaStream_t stream);
// Whether attention_sm80 on a device with `sms` multiprocessors starts the CTAs heads first
// (kernels/attention_cuda.h: attention_sm80_heads_first).
bool attention_sm80_heads_first(const AttnParams& p, int sms);
// head_dim 128 or 64, and only on a compute capability 9.0 device (the sm_90a build). rows: the
// query tile (128, or 192 at head_dim 64), 0 to let the launch choose.
cudaError_t attention_sm90(const AttnParams& p, cudaStream_t stream, int rows);
// The e4m3 operands of one prefill launch (attention_fp8.cu writes them from p's q, k, v):
// q8 [n_q][heads][128] and k8 [n_kv][kv_heads][128] bytes, vt8 [kv_heads][128][vt_keys] (V
// transposed, keys padded with zeros to vt_keys, a multiple of 128, and permuted within each
// 32 as vt_position says), and the scales KernelArgs describes.
struct Fp8Operands {
  const void* q8;
  const void* k8;
  const void* vt8;
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  int32_t q_groups, k_blocks, q_pad;
  int64_t vt_keys;
  bool pingpong;  // Fp8AttnOptions::pingpong
  int rows;       // Fp8AttnOptions::rows
};
// The Hopper kernel over e4m3 operands (head_dim 128 or 64; 128-row tiles, or 192 at 64): p's
// shape, mask, o, lse and merge_into_o as attention_sm90, its q/k/v pointers unused.
cudaError_t attention_sm90_fp8(const AttnParams& p, const Fp8Operands& f, cudaStream_t stream);
// The most key ranges attention_sm90(p, ..., rows) cuts a tile of its last round into (its
// split tail); 1 where it cuts none.
int attention_sm90_split_parts(const AttnParams& p, int rows);
// The work attention_sm90(p, ..., rows) would give each CTA on a device with `sms`
// multiprocessors (kernels/attention_cuda.h: attention_sm90_schedule). Host only, no device.
cudaError_t attention_sm90_schedule(const AttnParams& p, int rows, int sms, Sm90Schedule& out);

// ---- PTX wrappers ----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination and reads nothing (tails).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 2^x; ex2.approx of -inf is +0, which is what masked scores must become.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The sum of x over the 4 lanes of a quad (in the m16n8 accumulator layout they hold one row).
// Every lane of the warp calls it.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Within each quad of lanes, lane q holds v[c] = its part (columns 2q, 2q + 1) of 16-byte
// chunk c, for 4 chunks; afterwards it holds chunk q whole, v[p] = part p (a 4 x 4 transpose by
// two butterfly exchanges, lanes q ^ 1 then q ^ 2). Every lane of the warp takes part.
__device__ __forceinline__ void quad_transpose(uint32_t* v, int q) {
#pragma unroll
  for (int m = 0; m < 4; m += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 1) ? v[m] : v[m + 1], 1);
    if (q & 1) {
      v[m] = got;
    } else {
      v[m + 1] = got;
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, (q & 2) ? v[m] : v[m + 2], 2);
    if (q & 2) {
      v[m] = got;
    } else {
      v[m + 2] = got;
    }
  }
}

template <typename OutT>
__device__ __forceinline__ void store2(OutT* dst, float lo, float hi) {
  if constexpr (std::is_same_v<OutT, float>) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = pack2<OutT>(lo, hi);
  }
}

// A prefill kernel's plain epilogue for one row of which this thread holds kGroups column
// pairs (pair(j): columns 8j + 2 (lane % 4) + {0, 1}, the m16n8 accumulator layout both
// kernels use), times inv; o_row == nullptr for a row outside O. Every lane of the warp calls
// it. A 16-bit O goes out in 16-byte stores: transposed within the quad, each lane writes
// kGroups / 4 whole chunks, where 4-byte stores took kGroups and each instruction covered 8
// rows x 16 bytes instead of x 64 (at head_dim 128 those cost 4-9 % of a 4K-token Hopper
// launch: docs/benchmarks.md); attention_cuda admits only a 16-byte aligned O whose strides are
// multiples of 8 elements, so its rows are whole chunks. fp32 pairs go out 8 bytes a lane.
template <int kGroups, typename OutT, typename Pair>
__device__ __forceinline__ void store_row(OutT* o_row, int lane, float inv, Pair pair) {
  if constexpr (sizeof(OutT) == 2) {
    static_assert(kGroups % 4 == 0, "whole chunks of a 16-bit row");
    uint32_t w[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float2 v = pair(j);
      w[j] = pack2<OutT>(v.x * inv, v.y * inv);
    }
#pragma unroll
    for (int k = 0; k < kGroups / 4; ++k) quad_transpose(w + 4 * k, lane & 3);
    if (o_row == nullptr) return;
#pragma unroll
    for (int k = 0; k < kGroups / 4; ++k) {
      *reinterpret_cast<uint4*>(o_row + 8 * (4 * k + (lane & 3))) =
          make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
  } else if (o_row != nullptr) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float2 v = pair(j);
      store2(o_row + j * 8 + (lane & 3) * 2, v.x * inv, v.y * inv);
    }
  }
}

// AttnParams::merge_into_o in a prefill kernel's epilogue, for one row of which this thread holds
// kGroups column pairs (columns 8j + 2 (lane % 4) + {0, 1}, the m16n8 accumulator layout both
// kernels use): merges this launch's result b (pair(j) unnormalised, times inv; LSE lb) into the
// partial result a at o_row / *lse_at, with merge_cuda's arithmetic. la is a's LSE, which every
// thread of the row must have read before any thread of it calls this (it writes *lse_at).
template <int kGroups, typename Pair>
__device__ __forceinline__ void merge_row_into(float* o_row, float* lse_at, int lane, float la,
                                               float lb, float inv, Pair&& pair) {
  if (lb == -INFINITY) return;  // b saw nothing: a is already the answer
  // a saw nothing: take b (max + log1p(exp(-|a - b|)) would meet inf - inf).
  const bool take_b = la == -INFINITY;
  const float merged = take_b ? lb : fmaxf(la, lb) + log1pf(expf(-fabsf(la - lb)));
  const float wa = take_b ? 0.f : expf(la - merged), wb = take_b ? 1.f : expf(lb - merged);
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    float* dst = o_row + j * 8 + (lane & 3) * 2;
    const float2 v = pair(j);
    const float b0 = v.x * inv, b1 = v.y * inv;
    if (take_b) {
      *reinterpret_cast<float2*>(dst) = make_float2(b0, b1);
    } else {
      const float2 prev = *reinterpret_cast<const float2*>(dst);
      *reinterpret_cast<float2*>(dst) = make_float2(prev.x * wa + b0 * wb, prev.y * wa + b1 * wb);
    }
  }
  if ((lane & 3) == 0) *lse_at = merged;
}

// ---- tensor-core fragments (mma.sync m16n8k16, ldmatrix): the sm_80 prefill and the decode --

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D = A.B + D, m16n8k16, fp32 accumulators; A row-major 16x16, B column-major 16x8.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---- shared-memory tiles ---------------------------------------------------------------------

// Element offset of (row, 16-byte chunk) in a [rows, kD] tile. The chunk index is XORed with
// row % 8 so that the 8 rows one ldmatrix phase reads (rows are 128 or 256 bytes, i.e. all in
// the same banks) land in 8 different bank groups: conflict-free without padding.
template <int kD>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kD + ((chunk ^ (row & 7)) << 3);
}

// ldmatrix addresses without a register per (row block, chunk) pair. Every ldmatrix of the
// kernels that use it reads rows whose row % 8 is lane % 8 and chunk 2j + b (+ 8m), b in
// {0, 1} fixed per lane; since the XOR touches only the low 3 bits, the swizzled chunk is
// 8m + (2j ^ (b ^ lane % 8)). So 4 base addresses (j = 0..3) per operand suffice, and the row
// block and m become immediate offsets.
template <int kD, typename T>
struct LdmBases {
  uint32_t base[4];
  __device__ __forceinline__ LdmBases(const T* tile, int row, int b, int lane) {
    const int c = b ^ (lane & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      base[j] = smem_addr(tile + row * kD + (((2 * j) ^ c) << 3));
    }
  }
  // Byte address of (row + row_off, chunk 2 * slice + b) for compile-time slice and row_off.
  __device__ __forceinline__ uint32_t at(int slice, int row_off) const {
    return base[slice & 3] + ((slice >> 2) * 8 * 8 + row_off * kD) * int(sizeof(T));
  }
};

}  // namespace burst::kernels::detail
