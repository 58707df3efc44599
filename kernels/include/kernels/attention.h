// Attention for one ring step (LAO) and the (O, LSE) merge (GAO): the contract shared by the
// CPU reference, the CUDA kernels, BurstAttention ring prefill and distributed decode.
//
// Layout (all strides in elements, so a [tokens, heads * head_dim] GEMM output is used as is):
//   q  [n_q,  heads,    head_dim]   q[i * q_row_stride + h * q_head_stride + d]
//   k  [n_kv, kv_heads, head_dim]   k[j * k_row_stride + g * k_head_stride + d]
//   v  [n_kv, kv_heads, head_dim]   like k
//   o  [n_q,  heads,    head_dim]   like q; normalised (divided by the row's softmax sum)
//   lse[heads, n_q] fp32            lse[h * lse_head_stride + i]
// GQA: query head h reads kv head h / (heads / kv_heads).
// Masks come from absolute token positions, never from rank arithmetic: query i sits at position
// q_start + i, key j at kv_start + j. kCausal lets query i see key j iff kv_start + j <=
// q_start + i; kNone sees every key.
// LSE is the natural log of the row's sum of exp(scale * q.k). A row that sees no key (all of
// its keys lie after it) is "empty": its LSE is -inf and its O is 0, so merging it changes
// nothing and produces no NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace burst::kernels {

enum class MaskKind : int32_t { kNone = 0, kCausal = 1 };
// kFP8E4M3 is the FP8 KV cache's element (kernels/kv_fp8.h): a tensor of it holds FP8 KV rows
// (e4m3 values and their scales), one element per byte; no op computes in it. kI32 holds
// tables (page tables, row indices: int32 pointers of the kernels' parameters); no op computes
// in it either.
enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8E4M3 = 3, kI32 = 4 };

struct AttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  int64_t q_row_stride = 0, q_head_stride = 0;
  int64_t k_row_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_head_stride = 0;
  int64_t o_row_stride = 0, o_head_stride = 0;
  int64_t lse_head_stride = 0;
  int32_t n_q = 0, n_kv = 0;
  int32_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t q_start = 0, kv_start = 0;  // absolute position of q row 0 / kv row 0
  MaskKind mask = MaskKind::kCausal;
  float scale = 0.f;                  // usually 1 / sqrt(head_dim)
  DType dtype = DType::kF32;          // of q, k, v (and o unless o_dtype says otherwise)
  // Of o; unset means dtype. The ring asks for kF32 so partial results merge (merge_cpu,
  // merge_cuda are fp32) without a rounding step per ring hop. lse is always fp32.
  std::optional<DType> o_dtype;
  // Paged K/V (a sequence's shard in a paged KV cache): when kv_pages is set, key j and value j
  // are row kv_pages[j / page_size] * page_size + j % page_size of k and v (strides as above);
  // null means row j. attention_cpu, the CUDA decode kernel (n_q == 1) and FP8 attention
  // (qkv_fp8: its quantizer) read pages; the other CUDA prefill kernels refuse them (the ring
  // gathers a sequence's pages into one block first).
  const int32_t* kv_pages = nullptr;
  int32_t page_size = 0;
  // Per-row K/V (batched decode: several sequences in one launch): when row_kv_len is set, query
  // row i has keys of its own: row_kv_len[i] of them (n_kv is at least their maximum), paged by
  // the page table at kv_pages + row_page_offset[i]. Needs kv_pages, row_page_offset and
  // mask kNone; each row's output is exactly that of a launch with n_q 1 for it alone.
  const int32_t* row_kv_len = nullptr;
  const int32_t* row_page_offset = nullptr;
  // K and V are FP8 KV rows (kernels/kv_fp8.h: e4m3 values with one fp32 scale per row and kv
  // head), the paged KV cache's rows under --kv-cache-dtype fp8: k_row_stride and v_row_stride
  // are the row's bytes, head g's values start at byte g * head_dim and its scale at byte
  // kv_heads * head_dim + 4 g (the head strides are not read). Key j of head g is its e4m3
  // values times its scale, in fp32. attention_cpu, the CUDA decode kernel and FP8 attention
  // (qkv_fp8: its quantizer, which rounds each value to dtype as dequantize_kv_cuda does) read
  // them; the other CUDA prefill kernels refuse them (the ring dequantizes a block first).
  bool kv_fp8 = false;
  // Other work (the ring's transfer of the next block: NCCL kernels) runs beside this launch on
  // some multiprocessors. The Hopper prefill kernel then hands its tiles out one CTA a tile,
  // never a fixed share per multiprocessor (its persistent schedule for few tiles): there a
  // multiprocessor held by the transfer delays its whole share, so the step ends a transfer
  // later. Scheduling only: the results are bit for bit the same, except where the launch
  // without it cuts its last round's tiles over keys (attention_cuda.h:
  // attention_sm90_split_parts), which rounds differently.
  bool beside_transfer = false;
  // Decode (attention_is_decode): every key but each row's last was written before the kernels
  // still running (the KV pool as earlier steps left it; this step writes only the new token's
  // row). The CUDA decode kernel then starts loading a split's first keys (16-bit rows) before
  // it waits for the kernels before it, overlapping their end. Leave false where K/V were
  // written by this step's kernels (a ring block, a gathered prefix).
  bool kv_settled = false;
  // o (fp32) and lse already hold a normalised partial result of these rows (against other
  // keys): the launch merges its own into them, as merge_cuda with (o_a, lse_a) = (o, lse)
  // would, instead of overwriting them (one pass over o instead of a partial written, read back
  // and merged). attention_cpu and the CUDA prefill kernels do this (attention_cuda.h:
  // attention_merges_into_o: an fp32 o); the CUDA decode kernel refuses it.
  bool merge_into_o = false;
  // FP8 attention (--attention-dtype fp8): q, k and v are rounded to e4m3 for the products,
  // with a scale per 64 query rows and head (counted from the end of the rows, as the Hopper
  // kernel cuts its 128-row tiles), per 128 keys and kv head, and per V column and kv head; Q
  // and K are first rotated by the same orthogonal Hadamard matrix (a power-of-two head_dim);
  // P is rounded to e4m3 (x 2^8) before P.V. The CUDA prefill runs it through
  // attention_fp8_cuda (Hopper, head_dim 128 or 64; kernels/cuda/attention_fp8.cu says why each
  // choice); attention_cpu emulates the same roundings (the reference, and CPU workers).
  // Decode launches (n_q small, memory-bound) ignore it.
  bool qkv_fp8 = false;
};

// The column signs of the Hadamard rotation of FP8 attention (AttnParams::qkv_fp8): column c is
// negated when this is true, before the Walsh-Hadamard transform. Shared by the CPU emulation
// and the CUDA quantizer so both rotate alike.
#ifdef __CUDACC__
__host__ __device__
#endif
inline bool fp8_rotation_negates(uint32_t c) { return (((c + 1) * 0x9E3779B9u) >> 31) != 0; }

// log2(e), and its inverse: natural-log units to log2 units and back (the kernels' exp2).
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// FP8 attention's P (AttnParams::qkv_fp8) as e4m3 codes made without exp2: the Hopper kernel
// makes them this way (attention_sm90.cu, softmax_fp8 says how) and attention_cpu emulates it.
// P is stored x 2^kFp8PBias (its values of [2^-8, 1] stay normal e4m3 numbers). An e4m3 code b
// stands for about 2^(b / 8 - 7) (linear between powers of two), so the code of a score
// s (log2 units) against a running max on the lattice (m - kFp8PCodeRound) / 8 is
// round(8 s + fp8_p_code_shift(m)), clamped to [0, 120]; kFp8PCodeRound centres the error
// to a mean of +0.03 % (each value within -7.9 % / +6.5 % of 2^x, rms 3.1 %; exp2 rounded to
// e4m3 is within +-6.25 %, rms 2.7 %). It and the lattice are exact in binary.
inline constexpr float kFp8PBias = 8.f;
inline constexpr float kFp8PCodeRound = 0.453125f;  // 29 / 64
// The lattice index m of a running max (log2 units): the least (m - kFp8PCodeRound) / 8 at or
// above it. Exact on the lattice: a max already on it maps to itself.
#ifdef __CUDACC__
__host__ __device__
#endif
inline float fp8_p_lattice(float max_log2) {
  return std::ceil(std::fma(8.f, max_log2, kFp8PCodeRound));
}
// The running max the lattice index m stands for (log2 units).
#ifdef __CUDACC__
__host__ __device__
#endif
inline float fp8_p_offset(float m) { return (m - kFp8PCodeRound) * 0.125f; }
// The integer added to 8 s to make a code, for lattice index m: 8 (kFp8PBias + 7) - m.
#ifdef __CUDACC__
__host__ __device__
#endif
inline float fp8_p_code_shift(float m) { return 8.f * kFp8PBias + 56.f - m; }

// The physical row of logical key j under the page table `pages` (null: row j).
inline int64_t kv_row(const int32_t* pages, int32_t page_size, int64_t j) {
  return pages ? int64_t{pages[j / page_size]} * page_size + j % page_size : j;
}

// The dtype o is written in.
inline DType output_dtype(const AttnParams& p) { return p.o_dtype.value_or(p.dtype); }

// Fills the strides of a packed [n, heads, head_dim] layout for q/o and [n, kv_heads, head_dim]
// for k/v, and lse_head_stride = n_q.
void set_packed_strides(AttnParams& p);

// Empty string when p is usable, otherwise what is wrong with it.
std::string validate(const AttnParams& p);

// The relation of a (q block, kv block) pair under kCausal, from absolute positions.
enum class BlockRelation { kSkip, kFull, kPartial };
BlockRelation block_relation(int64_t q_start, int64_t n_q, int64_t kv_start, int64_t n_kv);

// CPU reference (fp32 only): tiled over keys with an online softmax, the same algorithm the
// CUDA kernel runs, accumulating in fp32. Parallel over heads (OpenMP).
void attention_cpu(const AttnParams& p);

// Merges (o_b, lse_b) into (o_a, lse_a) in place, fp32: lse = max + log1p(exp(-|a - b|)),
// o = o_a * exp(a - lse) + o_b * exp(b - lse). Both -inf: unchanged (o stays 0, lse -inf).
// o_* are [rows, heads, head_dim] with the given row stride; lse_* are [heads, rows] with the
// given head stride. With `out` set, the merged o goes there instead of into o_a, rounded once to
// out_dtype ([rows, heads * head_dim], row stride out_row_stride elements; the CPU reference
// takes kF32 only): the decode's last rank merge writes the layer's attention output so, without
// a conversion after it. lse_a is updated either way. (The CUDA kernel computes the merged
// value once, the same way for both destinations, so out holds what o_a would, rounded once.)
struct MergeParams {
  float* o_a = nullptr;
  float* lse_a = nullptr;
  const float* o_b = nullptr;
  const float* lse_b = nullptr;
  int64_t o_row_stride = 0, o_head_stride = 0;  // shared by o_a and o_b
  int64_t lse_head_stride = 0;                  // shared by lse_a and lse_b
  int32_t rows = 0, heads = 0, head_dim = 0;
  void* out = nullptr;
  DType out_dtype = DType::kF32;
  int64_t out_row_stride = 0;
};
void merge_cpu(const MergeParams& p);

}  // namespace burst::kernels
