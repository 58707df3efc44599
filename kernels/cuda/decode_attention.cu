// Split-KV flash-decoding (kernels/attention_cuda.h): a few query rows against a long KV.
//
// Decode is bound by reading K and V once, so the work is cut along the keys, and the kernel's
// job is to keep enough bytes in flight while spending few instructions per byte. CTA (split,
// kv head, row chunk) takes one range of keys and up to kRows = 16 query rows that share the
// kv head (GQA: the heads of a group and the n_q tokens are all rows of it, so K/V are read once
// per group, not once per query head): one m16 tensor-core atom. The keys stream through
// shared memory in stages of kBlockN = 64 keys (K and V of a stage copied together by cp.async,
// kStages stages in flight); warp w of 4 takes keys [16w, 16w + 16) of every stage: S = Q.K^T
// is 2 x head_dim/16 mma.sync, O += P.V is head_dim/8 more, with K and V fragments read by
// ldmatrix (V transposed), Q kept in registers for the whole range.
// P enters the tensor cores as two 16-bit terms, P = hi + lo (hi = P rounded, lo = the rest
// rounded), so P.V keeps ~16 bits of P instead of 8: the result does not depend on where the
// split and stage boundaries fall (which move the running maximum P is taken against) beyond
// fp32 rounding, as with the fp32 CUDA-core kernel this one replaced.
// Each warp keeps its own online softmax; at the end the 4 warps' partials are combined in
// shared memory and each split writes a normalised partial (o, lse) in fp32 to the workspace; a
// second kernel merges the splits in a fixed order, so the result does not depend on scheduling.
// Where the device runs this file's sm_90+ code, the merge is a programmatic dependent launch:
// each split CTA releases it as it starts (griddepcontrol.launch_dependents), so the merge's CTAs
// are launched while the splits stream and wait (griddepcontrol.wait) only for the split grid to
// complete and flush its memory; the second launch's latency leaves the critical path (the merge
// starts ~1 us after the last split CTA ends). The split kernel is itself launched chained after
// the step's other kernels (cuda_dispatch.cuh), waiting for them before it reads q or K/V.
// What is left between this kernel and the bytes floor at 32K-64K keys (docs/benchmarks.md):
// launch latency, the first stage under a full memory queue, and SMs that finish their static
// share of the splits early and then idle. (A plan of one CTA per multiprocessor, whose CTAs
// end together when the kernel runs alone, read 1.5-3 % faster alone and made the server's
// 2 x H200 128K step 25 % slower, chained behind the step's other kernels: judge a change here
// by the server's TPOT.)
// Scores are scaled into log2 units (scale * log2(e)) in fp32 after the mma; softmax and
// accumulation in fp32.
// FP8 KV rows (AttnParams::kv_fp8, the KV cache under --kv-cache-dtype fp8): the stages carry
// the rows' e4m3 bytes (half the bytes of bf16) and each key's K and V scales, and the mma
// fragments are made from those bytes in registers (every e4m3 value is exact in bf16 and
// fp16), with no 16-bit copy of the tile in shared memory:
// - K: ldmatrix reads the byte rows as 16-bit pairs, so a lane gets 4 consecutive values of
//   one key, d0 + 4c .. d0 + 4c + 3 (c = lane % 4); widened, they are its B fragment of S for
//   the k16 slice d0 if the slice's head_dim order is taken as 0 1 4 5 8 9 12 13 2 3 6 7 10 11
//   14 15 (fragment k = 2c, 2c + 1, 2c + 8, 2c + 9). Q is stored in that order, so S is
//   unchanged (a dot product does not depend on the order of its terms).
// - V: a lane reads one 32-bit word (4 values of head_dim) from each of its 4 keys of P's A
//   fragment (2c, 2c + 1, 2c + 8, 2c + 9 of the warp's 16) and transposes the 4 x 4 bytes by
//   byte permutes: each word is then one head_dim value of those 4 keys, its B fragment of
//   P.V. Lane group g's words are values 32m + 4g .. 32m + 4g + 3, so O's n8 atom 4m + j holds
//   head_dim 32m + 4n + j in its column n; the combine writes O back in head_dim order.
// - The byte rows' 16-byte chunks are XOR-swizzled by row so that both reads are free of bank
//   conflicts at head_dim 128 (8 rows of one chunk for ldmatrix, 4 rows' 32-byte runs for V).
// - The mma runs in fp16 whatever q's dtype: e4m3 widens to fp16 in one instruction a pair,
//   to bf16 in four, and the kernel issues more instructions than the memory needs otherwise.
//   Q is stored times 2^q_exp, which puts the CTA's largest |q| in [2^14, 2^15): bf16 values
//   are exact in fp16 there (3 more mantissa bits), only values 2^-38 below the largest fall to
//   fp16's subnormals; the softmax's scale is divided by it. P.V takes p times the key's V
//   scale times 2^-v_exp, v_exp (per warp, only growing) the exponent of the largest V scale
//   the warp has met, so the products lie in [0, 2); acc holds O times 2^-v_exp and is
//   rescaled exactly when v_exp grows. A key's term is exact to 2^-25 of the largest V scale
//   met (fp16's subnormal step), hi + lo as in the 16-bit path otherwise.
// Without the 16-bit tile a CTA needs a third less shared memory, and a multiprocessor holds 3.
// A key's K scale multiplies its column of S after the mma, its V scale its column of P before
// P.V (the softmax sum takes P unscaled): q.(s k) = s (q.k) and sum p (s v) = sum (p s) v, so
// the products stay exact.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"
#include "kernels/attention_cuda.h"
#include "kernels/cuda_dispatch.cuh"
#include "kernels/kv_fp8.h"

namespace burst::kernels {
namespace {

using detail::cp_async_16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::exp2_approx;
using detail::LdmBases;
using detail::ldmatrix_x4;
using detail::ldmatrix_x4_trans;
using detail::mma_16816;
using detail::quad_sum;
using detail::swz;
constexpr int kMinKeysPerSplit = 256;  // below this a split's fixed cost dominates

template <int kHeadDim>
struct DecodeTile {
  static constexpr int kD = kHeadDim;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16;                  // query rows per CTA: one m16 atom
  static constexpr int kBlockN = 64;                // keys per stage
  static constexpr int kWarpKeys = kBlockN / kWarps;  // 16: one k16 slice of P.V
  static constexpr int kStages = 3;                 // stages in flight
  static constexpr int kPageRun = 32;               // keys that share a page-table read
  static constexpr int kChunks = kD / 8;            // 16-byte chunks per K/V row
  static constexpr int kRowStep = kThreads / kChunks;  // rows one pass of the CTA copies
  static constexpr int kOAtoms = kD / 8;            // n8 atoms of O
  static constexpr int kKSlices = kD / 16;          // k16 slices of head_dim in S = Q.K^T
  static constexpr int kStageElems = 2 * kBlockN * kD;  // K then V
  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  static_assert(kWarpKeys == 16, "a warp's keys are one k16 slice of P.V");
  static_assert(kBlockN % kPageRun == 0 && kPageRun % kRowStep == 0,
                "a thread's rows of one page run share its page-table read");
  static_assert(kRowStep % 8 == 0, "the swizzle repeats every kRowStep rows");
};

template <int kD, bool kFp8>
struct DecodeSmem {
  using Tl = DecodeTile<kD>;
  // Q, then the stages; the combine area aliases the stages once the key loop is done. FP8:
  // Q, the stages of e4m3 bytes, the stages' scales (K then V, one fp32 per key).
  static constexpr size_t kQBytes = Tl::kRows * kD * 2;
  static constexpr size_t kStageBytes = Tl::kStageElems * (kFp8 ? 1 : 2);
  static constexpr size_t kScaleBytes = kFp8 ? 2 * Tl::kBlockN * sizeof(float) : 0;
  static constexpr size_t kCombineBytes =
      (size_t(Tl::kWarps) * Tl::kRows * kD + 2 * Tl::kWarps * Tl::kRows) * sizeof(float);
  static_assert(kCombineBytes <= Tl::kStages * kStageBytes, "the combine area fits the stages");
  static constexpr size_t kBytes = kQBytes + Tl::kStages * (kStageBytes + kScaleBytes);
};

// Byte offset of (row, 16-byte chunk) in an FP8 stage's [kBlockN, kD] bytes. The XOR makes the
// 8 rows an ldmatrix phase reads (one chunk each) and the 4 rows of a V word load (2 chunks
// each) fall in different banks; at head_dim 64 two rows share a 128-byte bank line.
template <int kD>
__device__ __forceinline__ int swz8(int row, int chunk) {
  const int x = kD == 128 ? (row & 7) : ((row >> 1) & 3);
  return row * kD + ((chunk ^ x) << 4);
}

// Where logical position k of a k16 slice of S's contraction reads head_dim from (the order
// the K bytes' ldmatrix gives, above): 2c + e -> 4c + e, 8 + 2c + e -> 4c + 2 + e.
__device__ __forceinline__ int fp8_slice_source(int k) {
  return k < 8 ? 4 * (k >> 1) + (k & 1) : 4 * ((k - 8) >> 1) + 2 + (k & 1);
}

// Four e4m3 values (the bytes of `four`, low first) as two fp16 pairs: bytes 0-1 in lo, 2-3 in
// hi. Exact: every e4m3 value is an fp16 value. One instruction a pair from sm_89 on.
__device__ __forceinline__ void widen_fp8x4(uint32_t four, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
#else
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(four & 0xffffu), __NV_E4M3);
  const __half2_raw b =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(four >> 16), __NV_E4M3);
  lo = uint32_t{a.x} | (uint32_t{a.y} << 16);
  hi = uint32_t{b.x} | (uint32_t{b.y} << 16);
#endif
}

// The power of two 2^e that puts x's magnitude in [2^(top - 1), 2^top), e clamped to
// [-100, 100] (subnormal x: the clamp); 0 for 0 and for values that are not finite.
__device__ __forceinline__ int exponent_to(float x, int top) {
  if (!(x > 0.f && x <= FLT_MAX)) return 0;
  const int e = ((__float_as_int(x) >> 23) & 0xff) - 126;  // x = f 2^e, f in [0.5, 1)
  return max(-100, min(100, top - e));
}

// 2^n for n <= 127, exactly; 0 below the normal range (n < -126).
__device__ __forceinline__ float pow2(int n) {
  return n < -126 ? 0.f : __int_as_float((n + 127) << 23);
}

__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(detail::smem_addr(dst)),
               "l"(src), "r"(src_bytes));
}

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
  int32_t kv_settled;      // AttnParams::kv_settled
  int32_t keys_per_split;  // a multiple of kBlockN
  float scale_log2;
  const int32_t* pages;  // paged K/V (AttnParams::kv_pages), or null
  int32_t page_size;
  // Per-row K/V (AttnParams::row_kv_len): blockIdx.z is the query, its keys and page table
  // are its own; null: every row shares n_kv keys and `pages`.
  const int32_t* row_kv_len;
  const int32_t* row_page_offset;
  // FP8 KV rows (kv_fp8): k and v point at rows of bytes (row strides in bytes), a head's
  // values from byte kvh * head_dim, its scale at byte scale_offset + 4 kvh.
  int64_t scale_offset;
};

// The physical row of logical key t0, the first of a run of kPageRun keys. A run never crosses
// a page (page_size is a multiple of kPageRun and runs start at multiples of it, checked at
// launch), so one page-table read maps all of its rows: row t0 + i is key_row(t0) + i.
__device__ __forceinline__ int64_t run_row(const int32_t* pages, int page_size, int t0) {
  return pages ? int64_t{__ldg(pages + t0 / page_size)} * page_size + t0 % page_size : t0;
}

// P as the A operand of P.V in two 16-bit terms: hi = p rounded to T, lo = p - hi rounded.
template <typename T>
__device__ __forceinline__ void split2(float p0, float p1, uint32_t& hi, uint32_t& lo) {
  hi = detail::pack2<T>(p0, p1);
  const T* h = reinterpret_cast<const T*>(&hi);
  float h0, h1;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    h0 = __bfloat162float(h[0]);
    h1 = __bfloat162float(h[1]);
  } else {
    h0 = __half2float(h[0]);
    h1 = __half2float(h[1]);
  }
  lo = detail::pack2<T>(p0 - h0, p1 - h1);
}

// The CTAs of this kernel a multiprocessor should hold: the launch bounds keep the registers
// within that; shared memory decides the rest (16-bit stages allow 2, FP8 ones 3).
template <bool kFp8>
constexpr int kMinCtasPerSm = kFp8 ? 3 : 2;

template <typename T, int kD, bool kFp8>
__global__ void __launch_bounds__(DecodeTile<kD>::kThreads, kMinCtasPerSm<kFp8>)
    decode_split_kernel(const DecodeArgs<T> a) {
  using Tl = DecodeTile<kD>;
  using Sm = DecodeSmem<kD, kFp8>;
  constexpr int kRows = Tl::kRows, kBlockN = Tl::kBlockN, kOA = Tl::kOAtoms;
  constexpr int kStages = Tl::kStages;
  extern __shared__ uint4 smem_raw[];  // 16-byte aligned for cp.async and ldmatrix
  using TM = std::conditional_t<kFp8, __half, T>;  // the mma's inputs
  TM* s_q = reinterpret_cast<TM*>(smem_raw);
  char* s_stages = reinterpret_cast<char*>(smem_raw) + Sm::kQBytes;
  T* s_stage = reinterpret_cast<T*>(s_stages);  // 16-bit stage buffer 0 (the others follow)
  // FP8: each stage's K scales then V scales, one per key.
  float* s_scale = reinterpret_cast<float*>(s_stages + kStages * Sm::kStageBytes);
  // The kv heads of one split are neighbours in the grid: they read the same K/V rows.
  const int kvh = blockIdx.x, split = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // Per-row K/V: this CTA serves the `group` rows of query blockIdx.z (group <= kRows, checked
  // at launch) against that query's own keys.
  const bool per_row = a.row_kv_len != nullptr;
  const int row0 = per_row ? blockIdx.z * a.group : blockIdx.z * kRows;
  const int rows_total = per_row ? row0 + a.group : a.n_q * a.group;
  const int n_kv = per_row ? __ldg(a.row_kv_len + blockIdx.z) : a.n_kv;
  const int32_t* pages = per_row ? a.pages + __ldg(a.row_page_offset + blockIdx.z) : a.pages;
  const int kb = split * a.keys_per_split;
  const int ke = min(n_kv, kb + a.keys_per_split);
  const int n_stages = ke > kb ? (ke - kb + kBlockN - 1) / kBlockN : 0;
  // K and V rows [t0, t0 + kBlockN) of the split into stage buffer `buf`; rows at or past ke
  // are zero-filled (their P is 0, and 0 * V must not meet stale NaN bits). Thread tid copies
  // chunk tid % kChunks of rows tid / kChunks + j * kRowStep.
  const T* k_head = a.k + int64_t{kvh} * a.k_head_stride;
  const T* v_head = a.v + int64_t{kvh} * a.v_head_stride;
  const int copy_row = tid / Tl::kChunks, copy_chunk = tid % Tl::kChunks;
  // FP8 rows: bytes; a head's values from kvh * kD, 16-byte chunks of 16 values.
  constexpr int kChunks8 = kD / 16, kRowStep8 = Tl::kThreads / kChunks8;
  static_assert(Tl::kPageRun % kRowStep8 == 0, "a thread's FP8 rows of a run share its read");
  const auto* k8 = reinterpret_cast<const uint8_t*>(a.k);
  const auto* v8 = reinterpret_cast<const uint8_t*>(a.v);
  auto load_stage8 = [&](int stage, int buf) {
    const int t0 = kb + stage * kBlockN;
    char* sk = s_stages + buf * Sm::kStageBytes;
    char* sv = sk + kBlockN * kD;
    const int row8 = tid / kChunks8, chunk8 = tid % kChunks8;
#pragma unroll
    for (int run = 0; run < kBlockN / Tl::kPageRun; ++run) {
      const int r0 = t0 + run * Tl::kPageRun;
      const int64_t base = r0 < ke ? run_row(pages, a.page_size, r0) : 0;
#pragma unroll
      for (int j = 0; j < Tl::kPageRun / kRowStep8; ++j) {
        const int row = run * Tl::kPageRun + j * kRowStep8 + row8;
        const bool ok = t0 + row < ke;
        const int64_t src = (ok ? base + row - run * Tl::kPageRun : 0) * a.k_row_stride +
                            int64_t{kvh} * kD + chunk8 * 16;
        cp_async_16(sk + swz8<kD>(row, chunk8), k8 + src, ok ? 16 : 0);
        cp_async_16(sv + swz8<kD>(row, chunk8), v8 + src, ok ? 16 : 0);
      }
    }
    // Thread tid copies the K (tid < kBlockN) or V scale of key tid % kBlockN.
    static_assert(Tl::kThreads == 2 * kBlockN, "one scale per thread");
    const int key = tid % kBlockN, run = key / Tl::kPageRun;
    const bool ok = t0 + key < ke;
    const int64_t row = ok ? run_row(pages, a.page_size, t0 + run * Tl::kPageRun) +
                                 key % Tl::kPageRun
                           : 0;
    cp_async_4(s_scale + (buf * 2 + tid / kBlockN) * kBlockN + key,
               (tid < kBlockN ? k8 : v8) + row * a.k_row_stride + a.scale_offset + 4 * kvh,
               ok ? 4 : 0);
  };
  auto load_stage16 = [&](int stage, int buf) {
    const int t0 = kb + stage * kBlockN;
    T* sk = s_stage + buf * Tl::kStageElems;
    T* sv = sk + kBlockN * kD;
#pragma unroll
    for (int run = 0; run < kBlockN / Tl::kPageRun; ++run) {
      const int r0 = t0 + run * Tl::kPageRun;
      const int64_t base = r0 < ke ? run_row(pages, a.page_size, r0) : 0;
#pragma unroll
      for (int j = 0; j < Tl::kPageRun / Tl::kRowStep; ++j) {
        const int row = run * Tl::kPageRun + j * Tl::kRowStep + copy_row;
        const bool ok = t0 + row < ke;
        const int64_t src = ok ? base + row - run * Tl::kPageRun : 0;
        const int off = swz<kD>(row, copy_chunk);
        cp_async_16(sk + off, k_head + src * a.k_row_stride + copy_chunk * 8, ok ? 16 : 0);
        cp_async_16(sv + off, v_head + src * a.v_row_stride + copy_chunk * 8, ok ? 16 : 0);
      }
    }
  };
  auto load_stage = [&](int stage, int buf) {
    if constexpr (kFp8) {
      load_stage8(stage, buf);
    } else {
      load_stage16(stage, buf);
    }
  };
  auto first_stages = [&] {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_stages) load_stage(s, s);
      cp_async_commit();  // empty groups keep the wait counts uniform
    }
  };
  // Settled K/V (the pool in decode): the first stages' keys, none of them this step's new
  // (last) key, were written by earlier steps, so their loads go out before the wait and
  // overlap the kernels before this one. 16-bit rows only: over FP8 rows (3 CTAs a
  // multiprocessor) a 7B step at 128K on an H200 was 0.6-1.3 % slower with them, at 32K 0.4 %
  // faster (benchmarks/2026-11-29.md).
  const bool early = !kFp8 && a.kv_settled &&
                     min(ke, kb + (kStages - 1) * kBlockN) <= n_kv - 1 && n_stages > 0;
  if (early) first_stages();
  // The merge kernel may start now: it reads nothing of ours before griddepcontrol.wait, which
  // waits for this whole grid. (Earliest is best: its CTAs then sit resident, launched, while
  // ours stream; they take few registers and little shared memory beside ours.)
  pdl_launch_dependents();
  // Launched chained itself: q and this step's K/V rows are the kernels before's.
  pdl_wait();

  // Row r is query i = R / group of head kvh * group + R % group, R = row0 + r; rows past
  // rows_total are zero (and masked below). FP8: each k16 slice in the K bytes' order, in fp16
  // times 2^q_exp (above).
  auto q_at = [&](int idx) -> float {
    const int r = idx / kD, d = idx % kD, rr = row0 + r;
    if (rr >= rows_total) return 0.f;
    const int i = rr / a.group, h = kvh * a.group + rr % a.group;
    const int from = kFp8 ? (d & ~15) | fp8_slice_source(d & 15) : d;
    return static_cast<float>(
        a.q[int64_t{i} * a.q_row_stride + int64_t{h} * a.q_head_stride + from]);
  };
  int q_exp = 0;
  if constexpr (kFp8) {
    __shared__ float s_qmax[Tl::kWarps];
    float amax = 0.f;
    for (int idx = tid; idx < kRows * kD; idx += Tl::kThreads) amax = fmaxf(amax, fabsf(q_at(idx)));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    if (lane == 0) s_qmax[warp] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < Tl::kWarps; ++w) amax = fmaxf(amax, s_qmax[w]);
    q_exp = exponent_to(amax, 15);
  }
  const float q_mul = pow2(q_exp), scale_log2 = a.scale_log2 * pow2(-q_exp);
  for (int idx = tid; idx < kRows * kD; idx += Tl::kThreads) {
    const int r = idx / kD, d = idx % kD;
    s_q[swz<kD>(r, d / 8) + d % 8] = static_cast<TM>(q_at(idx) * q_mul);
  }

  if (!early) first_stages();

  // This thread's rows: lane / 4 and lane / 4 + 8 of the atom. limit is the last key the row
  // may see (-1: none; rows past rows_total see none).
  int limit[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int rr = row0 + (lane >> 2) + hf * 8;
    const int64_t i = rr / a.group;
    limit[hf] = rr >= rows_total ? -1
                : a.causal       ? static_cast<int>(std::clamp<int64_t>(i + a.delta, -1,
                                                                        n_kv - 1))
                                 : n_kv - 1;
  }

  // Q copied by all threads is visible to all; its fragments stay in registers.
  __syncthreads();
  uint32_t qa[Tl::kKSlices][4];
  {
    const LdmBases<kD, TM> q_ldm(s_q, lane & 15, lane >> 4, lane);
#pragma unroll
    for (int ks = 0; ks < Tl::kKSlices; ++ks) ldmatrix_x4(qa[ks], q_ldm.at(ks, 0));
  }
  // K: matrices keys 0-7 x d 0-7, keys 0-7 x d 8-15, keys 8-15 x d 0-7, keys 8-15 x d 8-15 of
  // this warp's 16 keys = (b0, b1) of key atom 0, then of atom 1. V (transposed): keys 0-7 x
  // d 0-7, keys 8-15 x d 0-7, keys 0-7 x d 8-15, keys 8-15 x d 8-15 = (b0, b1) of d atom 2dp,
  // then of 2dp + 1. Offsets from stage buffer 0; buffer b adds b * kStageElems elements.
  const int wk = warp * Tl::kWarpKeys;
  const LdmBases<kD, T> k_ldm(s_stage, wk + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1,
                              lane);
  const LdmBases<kD, T> v_ldm(s_stage + kBlockN * kD, wk + (lane & 7) + (((lane >> 3) & 1) << 3),
                              lane >> 4, lane);
  // FP8 (offsets in a stage's bytes): K's ldmatrix matrices are keys 0-7 and 8-15 of this
  // warp's 16, in k16 slices 2p then 2p + 1; lane l gives the row of key (l % 8) + 8 ((l / 8)
  // % 2), chunk 2p + l / 16. V: this lane's 4 keys of P's A fragment, rows 2c + {0, 1, 8, 9},
  // and its word within chunk 2m + g / 4 (g = lane / 4), 4 (g % 4) bytes in.
  constexpr int kPairs8 = kD / 32;  // FP8 K: ldmatrix_x4 per stage; V: 32-value groups of d
  int k8_off[kPairs8];
#pragma unroll
  for (int pp = 0; pp < kPairs8; ++pp) {
    k8_off[pp] = swz8<kD>(wk + (lane & 7) + (((lane >> 3) & 1) << 3), 2 * pp + (lane >> 4));
  }
  int v8_row[4];
  {
    const int keys[4] = {0, 1, 8, 9};
#pragma unroll
    for (int e = 0; e < 4; ++e) v8_row[e] = wk + (lane & 3) * 2 + keys[e];
  }

  float acc[kOA][4];
#pragma unroll
  for (int na = 0; na < kOA; ++na) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[na][e] = 0.f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};  // raw score units (before scale)
  int v_exp = -126;  // FP8: acc holds O times 2^-v_exp
  float row_sum[2] = {0.f, 0.f};              // per thread until the end's quad reduction

  for (int it = 0; it < n_stages; ++it) {
    cp_async_wait<kStages - 2>();
    // Stage it (copied by all threads) is visible to all, and every warp is done with the
    // buffer of stage it - 1, which the copy below overwrites.
    __syncthreads();
    if (it + kStages - 1 < n_stages) load_stage(it + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();
    // This stage's offset from stage buffer 0.
    const uint32_t buf_bytes = (it % kStages) * Sm::kStageBytes;
    // FP8: this stage's scales of this thread's keys (K then V), kl(na, e) = k_lane + na * 8 + e.
    const int k_lane = wk + (lane & 3) * 2;
    const float* k_scale = s_scale + (it % kStages) * 2 * kBlockN;
    const float* v_scale = k_scale + kBlockN;

    float s[2][4] = {};
    if constexpr (kFp8) {
      const uint32_t k_base = detail::smem_addr(s_stages) + buf_bytes;
#pragma unroll
      for (int pp = 0; pp < kPairs8; ++pp) {
        uint32_t kb8[4];  // (key atom 0, slice 2pp), (1, 2pp), (0, 2pp + 1), (1, 2pp + 1)
        ldmatrix_x4(kb8, k_base + k8_off[pp]);
#pragma unroll
        for (int mtx = 0; mtx < 4; ++mtx) {
          uint32_t b0, b1;
          widen_fp8x4(kb8[mtx], b0, b1);
          mma_16816<TM>(s[mtx & 1], qa[2 * pp + (mtx >> 1)], b0, b1);
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < Tl::kKSlices; ++ks) {
        uint32_t kf[4];
        ldmatrix_x4(kf, k_ldm.at(ks, 0) + buf_bytes);
        mma_16816<T>(s[0], qa[ks], kf[0], kf[1]);
        mma_16816<T>(s[1], qa[ks], kf[2], kf[3]);
      }
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int na = 0; na < 2; ++na) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[na][e] *= k_scale[k_lane + na * 8 + (e & 1)];
      }
    }
    // Mask keys past the range (zero-filled) or past a row's limit: -inf, so exp2 gives 0.
    const int key0 = kb + it * kBlockN + wk + (lane & 3) * 2;
#pragma unroll
    for (int na = 0; na < 2; ++na) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + na * 8 + (e & 1);
        if (key >= ke || key > limit[e >> 1]) s[na][e] = -INFINITY;
      }
    }
    // FP8: this stage's V scales of this thread's keys times 2^-v_exp, and the factor that
    // moves acc to a grown v_exp (above).
    float v_mul[2][2] = {{1.f, 1.f}, {1.f, 1.f}}, v_shift = 1.f;
    if constexpr (kFp8) {
      float vmax = 0.f;
#pragma unroll
      for (int na = 0; na < 2; ++na) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v_mul[na][e] = v_scale[k_lane + na * 8 + e];
          vmax = fmaxf(vmax, v_mul[na][e]);
        }
      }
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 1));  // the warp's 16 keys
      vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, 2));
      if (vmax > 0.f) {
        const int grown = max(v_exp, -exponent_to(vmax, 0));  // vmax <= 2^grown
        v_shift = pow2(v_exp - grown);
        v_exp = grown;
      }
      const float inv = pow2(-v_exp);
#pragma unroll
      for (int na = 0; na < 2; ++na) {
#pragma unroll
        for (int e = 0; e < 2; ++e) v_mul[na][e] *= inv;
      }
    }
    uint32_t p_hi[4], p_lo[4];  // the A fragment of P (16 rows x this warp's 16 keys)
    float corr[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = fmaxf(row_max[hf], fmaxf(fmaxf(s[0][2 * hf], s[0][2 * hf + 1]),
                                          fmaxf(s[1][2 * hf], s[1][2 * hf + 1])));
      // The 4 threads of a quad hold the same row.
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // Nothing seen yet (max -inf): offset 0 keeps exp2(-inf - offset) = 0, never NaN, and
      // the row's acc (0) needs no factor.
      const float offset = mx == -INFINITY ? 0.f : mx * scale_log2;
      corr[hf] = mx == -INFINITY ? 1.f : exp2_approx(row_max[hf] * scale_log2 - offset);
      row_max[hf] = mx;
      float p[2][2];
#pragma unroll
      for (int na = 0; na < 2; ++na) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          p[na][e] = exp2_approx(fmaf(s[na][2 * hf + e], scale_log2, -offset));
        }
      }
      row_sum[hf] = row_sum[hf] * corr[hf] + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
      if constexpr (kFp8) {  // P.V takes p times each key's V scale (times 2^-v_exp)
#pragma unroll
        for (int na = 0; na < 2; ++na) {
#pragma unroll
          for (int e = 0; e < 2; ++e) p[na][e] *= v_mul[na][e];
        }
        corr[hf] *= v_shift;
      }
      // A fragment order: (rows g, keys 0-7), (rows g+8, keys 0-7), (g, 8-15), (g+8, 8-15).
      split2<TM>(p[0][0], p[0][1], p_hi[hf], p_lo[hf]);
      split2<TM>(p[1][0], p[1][1], p_hi[2 + hf], p_lo[2 + hf]);
    }
    // Rescale O unless no row's factor moved anywhere in the warp (most stages, once the
    // maxima settle): a warp-uniform branch.
    if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {
#pragma unroll
      for (int na = 0; na < kOA; ++na) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[na][e] *= corr[e >> 1];
      }
    }
    if constexpr (kFp8) {
      const char* v_stage = s_stages + buf_bytes + kBlockN * kD;
#pragma unroll
      for (int m = 0; m < kPairs8; ++m) {
        uint32_t w[4];  // keys 2c, 2c + 1, 2c + 8, 2c + 9; head_dim 32m + 4g + 0..3
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          w[e] = *reinterpret_cast<const uint32_t*>(
              v_stage + swz8<kD>(v8_row[e], 2 * m + (lane >> 4)) + 4 * ((lane >> 2) & 3));
        }
        // Transposed: t[j] = head_dim 32m + 4g + j of the 4 keys, low byte first.
        const uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
        const uint32_t lo89 = __byte_perm(w[2], w[3], 0x5140), hi89 = __byte_perm(w[2], w[3], 0x7362);
        const uint32_t t[4] = {__byte_perm(lo01, lo89, 0x5410), __byte_perm(lo01, lo89, 0x7632),
                               __byte_perm(hi01, hi89, 0x5410), __byte_perm(hi01, hi89, 0x7632)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t b0, b1;
          widen_fp8x4(t[j], b0, b1);
          mma_16816<TM>(acc[4 * m + j], p_hi, b0, b1);
          mma_16816<TM>(acc[4 * m + j], p_lo, b0, b1);
        }
      }
    } else {
#pragma unroll
      for (int dp = 0; dp < kOA / 2; ++dp) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, v_ldm.at(dp, 0) + buf_bytes);
        mma_16816<T>(acc[2 * dp], p_hi, vf[0], vf[1]);
        mma_16816<T>(acc[2 * dp + 1], p_hi, vf[2], vf[3]);
        mma_16816<T>(acc[2 * dp], p_lo, vf[0], vf[1]);
        mma_16816<T>(acc[2 * dp + 1], p_lo, vf[2], vf[3]);
      }
    }
  }

  // The combine area aliases the stages: no copy may still be landing and every warp must be
  // done reading them.
  cp_async_wait<0>();
  __syncthreads();
  float* c_acc = reinterpret_cast<float*>(s_stages);            // [warps][kRows][kD]
  float* c_m = c_acc + Tl::kWarps * kRows * kD;                  // [warps][kRows], log2 units
  float* c_l = c_m + Tl::kWarps * kRows;                         // [warps][kRows]
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float sum = quad_sum(row_sum[hf]);
    const int r = (lane >> 2) + hf * 8;
    float* dst = c_acc + (warp * kRows + r) * kD;
    const float o_mul = pow2(v_exp);  // FP8: acc is O times 2^-v_exp
#pragma unroll
    for (int na = 0; na < kOA; ++na) {
      if constexpr (kFp8) {  // atom 4m + j, column n: head_dim 32m + 4n + j
        const int d0 = 32 * (na >> 2) + 8 * (lane & 3) + (na & 3);
        dst[d0] = acc[na][2 * hf] * o_mul;
        dst[d0 + 4] = acc[na][2 * hf + 1] * o_mul;
      } else {
        *reinterpret_cast<float2*>(dst + na * 8 + (lane & 3) * 2) =
            make_float2(acc[na][2 * hf], acc[na][2 * hf + 1]);
      }
    }
    if ((lane & 3) == 0) {
      c_m[warp * kRows + r] = row_max[hf] == -INFINITY ? -INFINITY : row_max[hf] * scale_log2;
      c_l[warp * kRows + r] = sum;
    }
  }
  // Every warp's partial (m, l, acc) is visible to the threads that combine them.
  __syncthreads();

  for (int idx = tid; idx < kRows * kD; idx += Tl::kThreads) {
    const int r = idx / kD, d = idx % kD, rr = row0 + r;
    if (rr >= rows_total) continue;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tl::kWarps; ++w) mx = fmaxf(mx, c_m[w * kRows + r]);
    float o = 0.f, lse = -INFINITY;  // the split saw no key of this row: empty partial
    if (mx != -INFINITY) {
      float sum = 0.f, num = 0.f;
#pragma unroll
      for (int w = 0; w < Tl::kWarps; ++w) {
        const float wgt = exp2_approx(c_m[w * kRows + r] - mx);  // -inf warps weigh 0
        sum += c_l[w * kRows + r] * wgt;
        num += c_acc[(w * kRows + r) * kD + d] * wgt;
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

// Merges the splits of one (head, query): warp w of kCombineWarps takes splits w, w + 8, ...
// (each lane kD / 32 elements of head_dim) as an online softmax, then the warps' partials are
// merged in warp order. Deterministic: a fixed assignment and order, not scheduling. (One
// thread per element looping over every split twice made a chain of 2 x splits dependent
// loads: 0.157 against 0.154-0.156 ms at 128K keys on an H200, 0.022 against 0.019-0.021 at 8K.)
constexpr int kCombineWarps = 8;
constexpr int kCombineBatch = 8;  // splits a warp loads before merging them
template <typename OutT, int kD>
__global__ void __launch_bounds__(kCombineWarps * 32)
    decode_combine_kernel(const float* o_part, const float* lse_part, OutT* o, float* lse,
                               int64_t o_row_stride, int64_t o_head_stride,
                               int64_t lse_head_stride, int n_q, int heads, int splits) {
  constexpr int kPer = kD / 32;  // elements of head_dim per lane
  __shared__ float part_acc[kCombineWarps][kD];
  __shared__ float part_m[kCombineWarps], part_l[kCombineWarps];
  // Launched as a programmatic dependent of the split kernel: its partials are complete and
  // visible only after this wait. The kernel after ours may be scheduled meanwhile.
  pdl_launch_dependents();
  pdl_wait();
  const int h = blockIdx.x / n_q, i = blockIdx.x % n_q;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t stride = int64_t{heads} * n_q;  // between splits of one (head, query)
  const int64_t item = int64_t{h} * n_q + i;
  float m = -INFINITY, l = 0.f, acc[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
  // The loads of kCombineBatch splits are issued before the first is merged: a warp's splits
  // were a chain of dependent loads (lse, then o), ~5 us at 64 splits on an H200.
  for (int s0 = warp; s0 < splits; s0 += kCombineWarps * kCombineBatch) {
    float xs[kCombineBatch], vs[kCombineBatch][kPer];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int s = s0 + b * kCombineWarps;
      xs[b] = -INFINITY;
      if (s >= splits) continue;
      xs[b] = lse_part[s * stride + item];
      // An empty split's o is written too (zeros), so its load is in bounds either way.
      const float* src = o_part + (s * stride + item) * kD + lane * kPer;
      if constexpr (kPer == 4) {
        const float4 t = *reinterpret_cast<const float4*>(src);
        vs[b][0] = t.x, vs[b][1] = t.y, vs[b][2] = t.z, vs[b][3] = t.w;
      } else {
        const float2 t = *reinterpret_cast<const float2*>(src);
        vs[b][0] = t.x, vs[b][1] = t.y;
      }
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const float x = xs[b];
      if (x == -INFINITY) continue;  // an empty split (or none) weighs 0
      const float nm = fmaxf(m, x);
      const float keep = expf(m - nm), w = expf(x - nm);  // m = -inf: keep = 0
      l = l * keep + w;
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] = acc[e] * keep + w * vs[b][e];
      m = nm;
    }
  }
#pragma unroll
  for (int e = 0; e < kPer; ++e) part_acc[warp][lane * kPer + e] = acc[e];
  if (lane == 0) {
    part_m[warp] = m;
    part_l[warp] = l;
  }
  __syncthreads();
  if (threadIdx.x >= kD) return;
  const int d = threadIdx.x;
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) mx = fmaxf(mx, part_m[w]);
  float out = 0.f, out_lse = -INFINITY;  // every split empty: the row saw no key
  if (mx != -INFINITY) {
    float sum = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) {
      const float f = expf(part_m[w] - mx);  // a warp without splits: 0
      sum += f * part_l[w];
      num += f * part_acc[w][d];
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

// Readies the split kernel of (T, kD) on the current device (above 48 KiB a kernel must opt
// in to dynamic shared memory, per device) and returns how many of its CTAs one multiprocessor
// holds; cached per device, since the queries cost more than a launch.
template <typename T, int kD, bool kFp8>
cudaError_t split_kernel_ctas(int device, int& ctas) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // 0: not readied yet
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  ctas = cache[size_t(device)].load(std::memory_order_acquire);
  if (ctas == 0) {
    auto* kernel = decode_split_kernel<T, kD, kFp8>;
    constexpr int kSmem = static_cast<int>(DecodeSmem<kD, kFp8>::kBytes);
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kSmem);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, DecodeTile<kD>::kThreads,
                                                        kSmem);
    if (err != cudaSuccess) return err;
    if (ctas < 1) return cudaErrorInvalidConfiguration;
    cache[size_t(device)].store(ctas, std::memory_order_release);
  }
  return cudaSuccess;
}

template <bool kFp8>
cudaError_t split_ctas(const AttnParams& p, int device, int& ctas) {
  const bool bf16 = p.dtype == DType::kBF16;
  if (p.head_dim == 128) {
    return bf16 ? split_kernel_ctas<__nv_bfloat16, 128, kFp8>(device, ctas)
                : split_kernel_ctas<__half, 128, kFp8>(device, ctas);
  }
  return bf16 ? split_kernel_ctas<__nv_bfloat16, 64, kFp8>(device, ctas)
              : split_kernel_ctas<__half, 64, kFp8>(device, ctas);
}

// The same plan for the workspace query and the launch (both read the current device).
cudaError_t make_plan(const AttnParams& p, DecodePlan& plan) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  int ctas_per_sm = 0;
  err = p.kv_fp8 ? split_ctas<true>(p, device, ctas_per_sm)
                 : split_ctas<false>(p, device, ctas_per_sm);
  if (err != cudaSuccess) return err;
  constexpr int kRows = DecodeTile<128>::kRows, kBlockN = DecodeTile<128>::kBlockN;
  static_assert(kRows == DecodeTile<64>::kRows && kBlockN == DecodeTile<64>::kBlockN,
                "one plan for both head dims");
  const int64_t rows_total = int64_t{p.n_q} * (p.heads / p.kv_heads);
  // Per-row K/V: one query (its group of heads) per row chunk, since its keys are its own.
  plan.row_chunks = p.row_kv_len ? p.n_q : static_cast<int>((rows_total + kRows - 1) / kRows);
  // The split count that finishes first: CTAs run in waves of `slots` (as many as the
  // multiprocessors hold at once), each CTA's time grows with its keys, so minimise
  // waves x keys per split; ties go to fewer splits. Splits are never shorter than
  // kMinKeysPerSplit (a split's fixed cost), and their lengths are whole stages (so stages
  // and page runs stay aligned).
  const int64_t base = int64_t{p.kv_heads} * plan.row_chunks;
  const int64_t slots = int64_t{ctas_per_sm} * sms;
  const int64_t most = std::max<int64_t>(1, (int64_t{p.n_kv} + kMinKeysPerSplit - 1) /
                                                kMinKeysPerSplit);
  auto per_split = [&](int64_t n) {
    const int64_t per = (int64_t{p.n_kv} + n - 1) / n;
    return std::max<int64_t>(kBlockN, (per + kBlockN - 1) / kBlockN * kBlockN);
  };
  // Beyond two waves more splits only add fixed costs.
  const int64_t last = std::min<int64_t>(most, std::max<int64_t>(1, (2 * slots + base - 1) / base));
  int64_t splits = 1, best = -1;
  for (int64_t n = 1; n <= last; ++n) {
    const int64_t per = per_split(n), used = (int64_t{p.n_kv} + per - 1) / per;
    if (used != n) continue;  // rounding made some splits empty: the same as fewer splits
    const int64_t cost = (base * n + slots - 1) / slots * per;
    if (best < 0 || cost < best) {
      best = cost;
      splits = n;
    }
  }
  const int64_t per = per_split(splits);
  plan.splits = static_cast<int>(splits);
  plan.keys_per_split = static_cast<int>(per);
  const size_t items = size_t(plan.splits) * p.heads * p.n_q;
  plan.o_part_bytes = items * p.head_dim * sizeof(float);
  plan.workspace_bytes = plan.o_part_bytes + items * sizeof(float);
  return cudaSuccess;
}

template <typename T, typename OutT, int kD, bool kFp8>
cudaError_t launch(const AttnParams& p, const DecodePlan& plan, void* workspace,
                   cudaStream_t stream) {
  DecodeArgs<T> a{};
  detail::set_qkv_args<T>(a, p);
  a.o_part = static_cast<float*>(workspace);
  a.lse_part = reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.o_part_bytes);
  a.heads = p.heads;
  a.keys_per_split = plan.keys_per_split;
  a.kv_settled = p.kv_settled ? 1 : 0;
  a.pages = p.kv_pages;
  a.page_size = p.page_size;
  a.row_kv_len = p.row_kv_len;
  a.row_page_offset = p.row_page_offset;
  a.scale_offset = kv_fp8_scale_offset(p.kv_heads, p.head_dim);
  const dim3 grid(p.kv_heads, plan.splits, plan.row_chunks);
  // make_plan readied the kernel for this device (split_kernel_ctas).
  cudaError_t err = launch_chained<decode_split_kernel<T, kD, kFp8>>(
      grid, dim3(DecodeTile<kD>::kThreads), DecodeSmem<kD, kFp8>::kBytes, stream, a);
  if (err != cudaSuccess) return err;
  return launch_chained<decode_combine_kernel<OutT, kD>>(
      dim3(p.n_q * p.heads), dim3(kCombineWarps * 32), 0, stream,
      static_cast<const float*>(a.o_part), static_cast<const float*>(a.lse_part),
      static_cast<OutT*>(p.o), p.lse, p.o_row_stride, p.o_head_stride, p.lse_head_stride,
      int{p.n_q}, int{p.heads}, plan.splits);
}

// Every instantiation, in one place: {bf16, fp16} x {o = input, o = fp32} x head_dim {64, 128}
// x K/V {16-bit, FP8 rows}.
template <typename T, bool kFp8>
cudaError_t dispatch_kv(const AttnParams& p, const DecodePlan& plan, void* ws, cudaStream_t s) {
  const bool o_f32 = output_dtype(p) == DType::kF32;
  if (p.head_dim == 128) {
    return o_f32 ? launch<T, float, 128, kFp8>(p, plan, ws, s)
                 : launch<T, T, 128, kFp8>(p, plan, ws, s);
  }
  return o_f32 ? launch<T, float, 64, kFp8>(p, plan, ws, s)
               : launch<T, T, 64, kFp8>(p, plan, ws, s);
}
template <typename T>
cudaError_t dispatch(const AttnParams& p, const DecodePlan& plan, void* ws, cudaStream_t s) {
  return p.kv_fp8 ? dispatch_kv<T, true>(p, plan, ws, s) : dispatch_kv<T, false>(p, plan, ws, s);
}

}  // namespace

size_t attention_decode_workspace_bytes(const AttnParams& p) {
  DecodePlan plan;
  if (!validate(p).empty() || make_plan(p, plan) != cudaSuccess) return 0;
  return plan.workspace_bytes;
}

cudaError_t attention_decode_cuda(const AttnParams& p, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (!validate(p).empty()) return cudaErrorInvalidValue;
  if (p.merge_into_o) return cudaErrorInvalidValue;
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) return cudaErrorInvalidValue;
  const DType od = output_dtype(p);
  if (od != p.dtype && od != DType::kF32) return cudaErrorInvalidValue;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
  if (p.n_q == 0) return cudaSuccess;
  if (p.kv_fp8) {
    // FP8 rows: 16-byte copies of bytes, K and V rows alike (one row stride serves both).
    if (p.k_row_stride % 16 != 0 || p.v_row_stride != p.k_row_stride ||
        p.k_row_stride < kv_fp8_row_bytes(p.kv_heads, p.head_dim)) {
      return cudaErrorInvalidValue;
    }
  } else {
    const int64_t strides[] = {p.k_row_stride, p.k_head_stride, p.v_row_stride,
                               p.v_head_stride};
    for (int64_t s : strides) {
      if (s % 8 != 0) return cudaErrorInvalidValue;  // 16-byte K and V copies
    }
  }
  if (p.n_kv > 0 && (!aligned16(p.k) || !aligned16(p.v))) return cudaErrorInvalidValue;
  if (!aligned16(workspace)) return cudaErrorInvalidValue;
  // Paged K/V: a page run (kPageRun rows from a multiple of kPageRun) must lie in one page.
  if (p.kv_pages && p.page_size % DecodeTile<128>::kPageRun != 0) return cudaErrorInvalidValue;
  // Per-row K/V: a CTA holds one query's group of heads.
  if (p.row_kv_len && p.heads / p.kv_heads > DecodeTile<128>::kRows) return cudaErrorInvalidValue;
  static_assert(DecodeTile<128>::kPageRun == DecodeTile<64>::kPageRun, "one page run");
  DecodePlan plan;
  cudaError_t err = make_plan(p, plan);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < plan.workspace_bytes) return cudaErrorInvalidValue;
  if (plan.splits > 65535 || plan.row_chunks > 65535 || int64_t{p.n_q} * p.heads > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  return p.dtype == DType::kBF16 ? dispatch<__nv_bfloat16>(p, plan, workspace, stream)
                                 : dispatch<__half>(p, plan, workspace, stream);
}

}  // namespace burst::kernels
