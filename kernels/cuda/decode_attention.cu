// Split-KV flash-decoding (kernels/attention_cuda.h): a few query rows against a long KV.
//
// Decode is bound by reading K and V once, so the work is cut along the keys: CTA (split,
// kv head, row chunk) takes one range of keys and up to kRows query rows that share the kv
// head (GQA: the heads of a group and the n_q tokens are all rows of it, so K/V are read once
// per group, not once per query head). Its 4 warps take 32-key tiles in turn: lane j scores key
// j against every row (K staged through shared memory, q broadcast from shared memory), then
// the lanes split head_dim for P.V. K and V of a tile are copied into shared memory together
// with cp.async, so the V copy is in flight while the scores and the softmax run.
// Each split writes a normalised partial (o, lse) in fp32 to the workspace; a second kernel
// merges the splits in split order, so the result does not depend on scheduling.
// Scores are kept in log2 units (q is pre-multiplied by scale * log2(e)); softmax and
// accumulation in fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"
#include "kernels/attention_cuda.h"

namespace burst::kernels {
namespace {

using detail::cp_async_16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::exp2_approx;
using detail::kLog2e;
using detail::smem_addr;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMinKeysPerSplit = 256;  // below this a split's fixed cost dominates

template <int kHeadDim>
struct DecodeTile {
  static constexpr int kD = kHeadDim;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 8;                // query rows per CTA
  static constexpr int kKeys = 32;               // keys per warp tile: one per lane
  static constexpr int kChunks = kD / 8;         // 16-byte chunks per K row
  static constexpr int kKStride = kD + 8;        // padded: lane j reads row j, 8 rows per
                                                 // phase land 16 bytes apart in the banks
  static constexpr int kDimsPerLane = kD / 32;   // of O, in P.V
  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  static_assert(kDimsPerLane == 2 || kDimsPerLane == 4, "4- or 8-byte V loads per lane");
  static_assert((kKeys * kChunks) % 32 == 0, "a warp stages whole K tiles");
};

template <typename T>
struct DecodeArgs {
  const T* q;
  const T* k;
  const T* v;
  float* o_part;    // [splits, heads, n_q, head_dim]
  float* lse_part;  // [splits, heads, n_q]
  int64_t q_row_stride, q_head_stride;
  int64_t k_row_stride, k_head_stride;
  int64_t v_row_stride, v_head_stride;
  int64_t delta;  // q_start - kv_start
  int32_t n_q, n_kv, heads, group, causal;
  int32_t keys_per_split;
  float scale_log2;
  const int32_t* pages;  // paged K/V (AttnParams::kv_pages), or null
  int32_t page_size;
  // Per-row K/V (AttnParams::row_kv_len): blockIdx.z is the query, its keys and page table
  // are its own; null: every row shares n_kv keys and `pages`.
  const int32_t* row_kv_len;
  const int32_t* row_page_offset;
};

// The physical row of logical key t0, the first key of a warp tile. A tile never crosses a page
// (page_size is a multiple of kKeys and tiles start at multiples of kKeys, checked at launch),
// so one page-table read per tile maps all of its rows: row t0 + i is key_row(t0) + i.
__device__ __forceinline__ int64_t tile_row(const int32_t* pages, int page_size, int t0) {
  return pages ? int64_t{__ldg(pages + t0 / page_size)} * page_size + t0 % page_size : t0;
}

template <int kD>
struct DecodeSmem {
  using Tl = DecodeTile<kD>;
  float q[Tl::kRows][kD];
  union {
    struct {
      uint16_t k[Tl::kWarps][Tl::kKeys][Tl::kKStride];  // T bits
      uint16_t v[Tl::kWarps][Tl::kKeys][kD];            // T bits; lanes read along a row
      float p[Tl::kWarps][Tl::kRows][Tl::kKeys];
    } loop;
    struct {
      float acc[Tl::kWarps][Tl::kRows][kD];
      float m[Tl::kWarps][Tl::kRows];
      float l[Tl::kWarps][Tl::kRows];
    } combine;
  };
};

template <typename T>
__device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

// 8 values of T packed in a uint4 -> fp32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = to_f32(t[e]);
}

// 3 CTAs per multiprocessor: the residency make_plan sizes its single wave for.
constexpr int kCtasPerSm = 3;

template <typename T, int kD>
__global__ void __launch_bounds__(DecodeTile<kD>::kThreads, kCtasPerSm)
    decode_split_kernel(const DecodeArgs<T> a) {
  using Tl = DecodeTile<kD>;
  constexpr int kRows = Tl::kRows, kKeys = Tl::kKeys, kDL = Tl::kDimsPerLane;
  extern __shared__ uint4 smem_raw[];  // 16-byte aligned for cp.async
  DecodeSmem<kD>& sm = *reinterpret_cast<DecodeSmem<kD>*>(smem_raw);
  const int split = blockIdx.x, kvh = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Per-row K/V: this CTA serves the `group` rows of query blockIdx.z (group <= kRows, checked
  // at launch) against that query's own keys.
  const bool per_row = a.row_kv_len != nullptr;
  const int row0 = per_row ? blockIdx.z * a.group : blockIdx.z * kRows;
  const int rows_total = per_row ? row0 + a.group : a.n_q * a.group;
  const int n_kv = per_row ? __ldg(a.row_kv_len + blockIdx.z) : a.n_kv;
  const int32_t* pages = per_row ? a.pages + __ldg(a.row_page_offset + blockIdx.z) : a.pages;

  // Row r is query i = R / group of head kvh * group + R % group, R = row0 + r.
  for (int idx = tid; idx < kRows * kD; idx += Tl::kThreads) {
    const int r = idx / kD, d = idx % kD, rr = row0 + r;
    float x = 0.f;
    if (rr < rows_total) {
      const int i = rr / a.group, h = kvh * a.group + rr % a.group;
      x = to_f32(a.q[int64_t{i} * a.q_row_stride + int64_t{h} * a.q_head_stride + d]);
    }
    sm.q[r][d] = x * a.scale_log2;
  }
  // The last key each row may see (-1: none; rows past rows_total see none).
  int limit[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int rr = row0 + r;
    const int64_t i = rr / a.group;
    limit[r] = rr >= rows_total ? -1
               : a.causal      ? static_cast<int>(std::clamp<int64_t>(i + a.delta, -1,
                                                                      n_kv - 1))
                               : n_kv - 1;
  }
  const int kb = split * a.keys_per_split;
  const int ke = min(n_kv, kb + a.keys_per_split);
  // sm.q is written by all threads and read by all warps.
  __syncthreads();

  float m[kRows], l[kRows], acc[kRows][kDL];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < kDL; ++e) acc[r][e] = 0.f;
  }
  const T* k_head = a.k + int64_t{kvh} * a.k_head_stride;
  const T* v_head = a.v + int64_t{kvh} * a.v_head_stride;

  // The next tile's first row is read one tile ahead, so the page-table load is not on the
  // critical path of the K/V copies.
  int64_t next_row = kb + warp * kKeys < ke ? tile_row(pages, a.page_size, kb + warp * kKeys) : 0;
  for (int t0 = kb + warp * kKeys; t0 < ke; t0 += Tl::kWarps * kKeys) {
    const int nk = min(kKeys, ke - t0);
    const int64_t key0 = next_row;
    if (t0 + Tl::kWarps * kKeys < ke) {
      next_row = tile_row(pages, a.page_size, t0 + Tl::kWarps * kKeys);
    }
    // Stage K and V rows t0 .. t0 + nk - 1 as two copy groups; rows past nk are zero-filled
    // (their P is 0, and 0 * V must not meet stale NaN bits).
#pragma unroll
    for (int i = 0; i < kKeys * Tl::kChunks / 32; ++i) {
      const int idx = i * 32 + lane, row = idx / Tl::kChunks, c = idx % Tl::kChunks;
      const bool ok = row < nk;
      const T* src = k_head + (key0 + (ok ? row : 0)) * a.k_row_stride + c * 8;
      cp_async_16(&sm.loop.k[warp][row][c * 8], src, ok ? 16 : 0);
    }
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < kKeys * Tl::kChunks / 32; ++i) {
      const int idx = i * 32 + lane, row = idx / Tl::kChunks, c = idx % Tl::kChunks;
      const bool ok = row < nk;
      const T* src = v_head + (key0 + (ok ? row : 0)) * a.v_row_stride + c * 8;
      cp_async_16(&sm.loop.v[warp][row][c * 8], src, ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<1>();
    // This lane's K copies are complete; the warp barrier makes every lane's visible to all.
    __syncwarp();

    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.f;
#pragma unroll 4
    for (int c = 0; c < Tl::kChunks; ++c) {
      float kf[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(&sm.loop.k[warp][lane][c * 8]), kf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float4 q0 = *reinterpret_cast<const float4*>(&sm.q[r][c * 8]);
        const float4 q1 = *reinterpret_cast<const float4*>(&sm.q[r][c * 8 + 4]);
        s[r] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] +
                q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
      }
    }

    const int key = t0 + lane;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sr = (lane < nk && key <= limit[r]) ? s[r] : -INFINITY;
      float mx = sr;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      }
      mx = fmaxf(mx, m[r]);
      // Nothing seen yet (max -inf): offset 0 keeps exp2(-inf - offset) = 0, never NaN.
      const float offset = mx == -INFINITY ? 0.f : mx;
      const float corr = exp2_approx(m[r] - offset);
      const float p = exp2_approx(sr - offset);
      m[r] = mx;
      l[r] = l[r] * corr + p;  // per-lane partial sum, reduced once at the end
#pragma unroll
      for (int e = 0; e < kDL; ++e) acc[r][e] *= corr;
      sm.loop.p[warp][r][lane] = p;
    }

    cp_async_wait<0>();
    // V copies complete and visible to the warp; P written above is visible too.
    __syncwarp();
    const T* v_lane = reinterpret_cast<const T*>(&sm.loop.v[warp][0][lane * kDL]);
#pragma unroll
    for (int j0 = 0; j0 < kKeys; j0 += 4) {
      float4 p4[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        p4[r] = *reinterpret_cast<const float4*>(&sm.loop.p[warp][r][j0]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        // kDL consecutive elements in one 8- or 4-byte load.
        using Vec = std::conditional_t<kDL == 4, uint2, uint32_t>;
        const Vec w = *reinterpret_cast<const Vec*>(v_lane + (j0 + u) * kD);
        const T* wt = reinterpret_cast<const T*>(&w);
        float vf[kDL];
#pragma unroll
        for (int e = 0; e < kDL; ++e) vf[e] = to_f32(wt[e]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float p = u == 0 ? p4[r].x : u == 1 ? p4[r].y : u == 2 ? p4[r].z : p4[r].w;
#pragma unroll
          for (int e = 0; e < kDL; ++e) acc[r][e] = fmaf(p, vf[e], acc[r][e]);
        }
      }
    }
    // Every lane is done reading this tile's K, V and P before the next tile overwrites them.
    __syncwarp();
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
  }
  // The combine area aliases the K/V/P tiles: every warp must be done with them first.
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < kDL; ++e) sm.combine.acc[warp][r][lane * kDL + e] = acc[r][e];
    if (lane == 0) {
      sm.combine.m[warp][r] = m[r];
      sm.combine.l[warp][r] = l[r];
    }
  }
  // Every warp's partial (m, l, acc) is visible to the threads that combine them.
  __syncthreads();

  for (int idx = tid; idx < kRows * kD; idx += Tl::kThreads) {
    const int r = idx / kD, d = idx % kD, rr = row0 + r;
    if (rr >= rows_total) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tl::kWarps; ++w) mx = fmaxf(mx, sm.combine.m[w][r]);
    float o = 0.f, lse = -INFINITY;  // the split saw no key of this row: empty partial
    if (mx != -INFINITY) {
      float sum = 0.f, num = 0.f;
#pragma unroll
      for (int w = 0; w < Tl::kWarps; ++w) {
        const float wgt = exp2_approx(sm.combine.m[w][r] - mx);  // -inf warps weigh 0
        sum += sm.combine.l[w][r] * wgt;
        num += sm.combine.acc[w][r][d] * wgt;
      }
      o = num / sum;
      lse = (mx + log2f(sum)) * kLn2;  // log2 units back to natural log
    }
    const int i = rr / a.group, h = kvh * a.group + rr % a.group;
    const int64_t item = (int64_t{split} * a.heads + h) * a.n_q + i;
    a.o_part[item * kD + d] = o;
    if (d == 0) a.lse_part[item] = lse;
  }
}

// Merges the splits of one (head, query) in split order; one thread per element of head_dim.
template <typename OutT, int kD>
__global__ void __launch_bounds__(kD)
    decode_combine_kernel(const float* o_part, const float* lse_part, OutT* o, float* lse,
                          int64_t o_row_stride, int64_t o_head_stride, int64_t lse_head_stride,
                          int n_q, int heads, int splits) {
  const int h = blockIdx.x / n_q, i = blockIdx.x % n_q, d = threadIdx.x;
  const int64_t stride = int64_t{heads} * n_q;  // between splits of one (head, query)
  const int64_t item = int64_t{h} * n_q + i;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse_part[s * stride + item]);
  float out = 0.f, out_lse = -INFINITY;  // every split empty: the row saw no key
  if (mx != -INFINITY) {
    float sum = 0.f, num = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = expf(lse_part[s * stride + item] - mx);  // empty splits weigh 0
      sum += w;
      num += w * o_part[(s * stride + item) * kD + d];
    }
    out = num / sum;
    out_lse = mx + logf(sum);
  }
  OutT* dst = o + int64_t{i} * o_row_stride + int64_t{h} * o_head_stride + d;
  if constexpr (std::is_same_v<OutT, float>) {
    *dst = out;
  } else if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    *dst = __float2bfloat16_rn(out);
  } else {
    *dst = __float2half_rn(out);
  }
  if (d == 0) lse[int64_t{h} * lse_head_stride + i] = out_lse;
}

struct DecodePlan {
  int splits = 1, keys_per_split = 32, row_chunks = 1;
  size_t o_part_bytes = 0, workspace_bytes = 0;
};

// The same plan for the workspace query and the launch (both read the current device).
cudaError_t make_plan(const AttnParams& p, DecodePlan& plan) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  constexpr int kRows = DecodeTile<128>::kRows;
  static_assert(kRows == DecodeTile<64>::kRows, "one plan for both head dims");
  const int64_t rows_total = int64_t{p.n_q} * (p.heads / p.kv_heads);
  // Per-row K/V: one query (its group of heads) per row chunk, since its keys are its own.
  plan.row_chunks = p.row_kv_len ? p.n_q : static_cast<int>((rows_total + kRows - 1) / kRows);
  // One full wave of kCtasPerSm CTAs per multiprocessor (the launch bounds hold registers to
  // that; shared memory allows it on sm_90, 75 KiB a CTA). Never splits shorter than
  // kMinKeysPerSplit.
  const int64_t base = int64_t{p.kv_heads} * plan.row_chunks;
  const int64_t want = (kCtasPerSm * int64_t{sms} + base - 1) / base;
  const int64_t most = std::max<int64_t>(1, (int64_t{p.n_kv} + kMinKeysPerSplit - 1) /
                                                kMinKeysPerSplit);
  int64_t splits = std::clamp<int64_t>(want, 1, most);
  int64_t per = (int64_t{p.n_kv} + splits - 1) / splits;
  per = std::max<int64_t>(32, (per + 31) / 32 * 32);
  splits = std::max<int64_t>(1, (int64_t{p.n_kv} + per - 1) / per);
  plan.splits = static_cast<int>(splits);
  plan.keys_per_split = static_cast<int>(per);
  const size_t items = size_t(plan.splits) * p.heads * p.n_q;
  plan.o_part_bytes = items * p.head_dim * sizeof(float);
  plan.workspace_bytes = plan.o_part_bytes + items * sizeof(float);
  return cudaSuccess;
}

template <typename T, typename OutT, int kD>
cudaError_t launch(const AttnParams& p, const DecodePlan& plan, void* workspace,
                   cudaStream_t stream) {
  DecodeArgs<T> a{};
  a.q = static_cast<const T*>(p.q);
  a.k = static_cast<const T*>(p.k);
  a.v = static_cast<const T*>(p.v);
  a.o_part = static_cast<float*>(workspace);
  a.lse_part = reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.o_part_bytes);
  a.q_row_stride = p.q_row_stride;
  a.q_head_stride = p.q_head_stride;
  a.k_row_stride = p.k_row_stride;
  a.k_head_stride = p.k_head_stride;
  a.v_row_stride = p.v_row_stride;
  a.v_head_stride = p.v_head_stride;
  a.delta = p.q_start - p.kv_start;
  a.n_q = p.n_q;
  a.n_kv = p.n_kv;
  a.heads = p.heads;
  a.group = p.heads / p.kv_heads;
  a.causal = p.mask == MaskKind::kCausal ? 1 : 0;
  a.keys_per_split = plan.keys_per_split;
  a.scale_log2 = p.scale * kLog2e;
  a.pages = p.kv_pages;
  a.page_size = p.page_size;
  a.row_kv_len = p.row_kv_len;
  a.row_page_offset = p.row_page_offset;
  const dim3 grid(plan.splits, p.kv_heads, plan.row_chunks);
  auto* kernel = decode_split_kernel<T, kD>;
  constexpr int kSmemBytes = sizeof(DecodeSmem<kD>);
  // Above 48 KiB a kernel must opt in to dynamic shared memory (per device, so every call).
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<grid, DecodeTile<kD>::kThreads, kSmemBytes, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  decode_combine_kernel<OutT, kD><<<p.n_q * p.heads, kD, 0, stream>>>(
      a.o_part, a.lse_part, static_cast<OutT*>(p.o), p.lse, p.o_row_stride, p.o_head_stride,
      p.lse_head_stride, p.n_q, p.heads, plan.splits);
  return cudaGetLastError();
}

// Every instantiation, in one place: {bf16, fp16} x {o = input, o = fp32} x head_dim {64, 128}.
template <typename T>
cudaError_t dispatch(const AttnParams& p, const DecodePlan& plan, void* ws, cudaStream_t s) {
  const bool o_f32 = output_dtype(p) == DType::kF32;
  if (p.head_dim == 128) {
    return o_f32 ? launch<T, float, 128>(p, plan, ws, s) : launch<T, T, 128>(p, plan, ws, s);
  }
  return o_f32 ? launch<T, float, 64>(p, plan, ws, s) : launch<T, T, 64>(p, plan, ws, s);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

size_t attention_decode_workspace_bytes(const AttnParams& p) {
  DecodePlan plan;
  if (!validate(p).empty() || make_plan(p, plan) != cudaSuccess) return 0;
  return plan.workspace_bytes;
}

cudaError_t attention_decode_cuda(const AttnParams& p, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (!validate(p).empty()) return cudaErrorInvalidValue;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return cudaErrorInvalidValue;
  const DType od = output_dtype(p);
  if (od != p.dtype && od != DType::kF32) return cudaErrorInvalidValue;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
  if (p.n_q == 0) return cudaSuccess;
  const int64_t strides[] = {p.k_row_stride, p.k_head_stride, p.v_row_stride, p.v_head_stride};
  for (int64_t s : strides) {
    if (s % 8 != 0) return cudaErrorInvalidValue;  // 16-byte K loads, 8-byte V loads
  }
  if (p.n_kv > 0 && (!aligned16(p.k) || !aligned16(p.v))) return cudaErrorInvalidValue;
  if (!aligned16(workspace)) return cudaErrorInvalidValue;
  // Paged K/V: a warp tile (kKeys rows from a multiple of kKeys) must lie in one page.
  if (p.kv_pages && p.page_size % DecodeTile<128>::kKeys != 0) return cudaErrorInvalidValue;
  // Per-row K/V: a CTA holds one query's group of heads.
  if (p.row_kv_len && p.heads / p.kv_heads > DecodeTile<128>::kRows) return cudaErrorInvalidValue;
  static_assert(DecodeTile<128>::kKeys == DecodeTile<64>::kKeys, "one tile height");
  DecodePlan plan;
  cudaError_t err = make_plan(p, plan);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < plan.workspace_bytes) return cudaErrorInvalidValue;
  if (p.kv_heads > 65535 || plan.row_chunks > 65535 || int64_t{p.n_q} * p.heads > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  return p.dtype == DType::kBF16 ? dispatch<__nv_bfloat16>(p, plan, workspace, stream)
                                 : dispatch<__half>(p, plan, workspace, stream);
}

}  // namespace burst::kernels
