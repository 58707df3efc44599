// CUDA attention kernels of the kernels/attention.h contract: one ring step of prefill (LAO),
// the (O, LSE) merge (GAO) and split-KV flash-decoding. All launchers are asynchronous on
// `stream`, never synchronise, and return the first CUDA error (cudaErrorInvalidValue for
// parameters outside what is listed here); no exception leaves them.
//
// Shapes and strides (in elements) are those of AttnParams:
//   q  [n_q,  heads,    head_dim]   q[i * q_row_stride + h * q_head_stride + d]
//   k  [n_kv, kv_heads, head_dim]   k[j * k_row_stride + g * k_head_stride + d]   (v alike)
//   o  [n_q,  heads,    head_dim]   like q, normalised (divided by the row's softmax sum)
//   lse[heads, n_q] fp32            lse[h * lse_head_stride + i]
// GQA: query head h reads kv head h / (heads / kv_heads).
// Supported: dtype kBF16 or kF16 (q, k, v); output_dtype(p) equal to dtype or kF32; head_dim
// 64 or 128; heads <= 65535; q, k, v, o 16-byte aligned and every stride except
// lse_head_stride a multiple of 8 elements (16-byte vector loads); the innermost dimension
// (head_dim) contiguous.
// Numerics: scores and softmax in fp32 (the scale is folded into exp2 as scale * log2(e)), P
// rounded to the input dtype for the P.V product, fp32 accumulation.
// LSE is the natural log of the row's sum of exp(scale * q.k), fp32. Masks come from absolute
// positions (q_start, kv_start); a row that sees no key is empty: LSE = -inf, O = 0.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kernels/attention.h"

namespace burst::kernels {

// The prefill kernels: kSm80 (mma.sync m16n8k16 + ldmatrix + cp.async; any sm_80+ device) and
// kSm90 (wgmma from shared memory, compute capability 9.0, head_dim 128 and 64). kAuto picks
// kSm90 where it runs, else kSm80; the explicit choices are for tests and benchmarks. kSm90
// picks its query tile per launch: 128 rows (two consumer warpgroups) or, at head_dim 64, 192
// (three); kSm90Rows128 and kSm90Rows192 force one (kSm90Rows192 at head_dim 128:
// cudaErrorInvalidValue).
enum class AttnKernel { kAuto, kSm80, kSm90, kSm90Rows128, kSm90Rows192 };

// Whether kSm90 runs p on the current device.
bool attention_sm90_supported(const AttnParams& p);
// Into how many key ranges (at most) attention_cuda(p, ..., kernel) cuts a full tile of its
// last round on the current device (the Hopper kernel's split tail: a persistent launch
// without a mask whose last round is short of whole deals that round's key blocks out evenly
// to its CTAs; the pieces of a tile are merged in a fixed order, so repeated launches give
// the same bits, but not those of a launch that cuts none, such as one beside a transfer); 1
// where it cuts none. For tests and benchmarks. The pieces meet in one workspace per device
// (static device memory, 17.5 MB): two launches that split must not run at the same time on
// one device (on two streams); launches on one stream, as the engine's, never do.
int attention_sm90_split_parts(const AttnParams& p, AttnKernel kernel = AttnKernel::kAuto);
// One CTA's work in one round of a Hopper launch (attention_sm90_schedule).
struct Sm90Work {
  int cta, round;
  // Query block m_blocks - 1 - tile % m_blocks of head tile / m_blocks (Sm90Schedule).
  int tile;
  // Part -1: the tile whole. Otherwise piece `part` of the `parts` (at most 4, in key order) a
  // split tile is cut into, key blocks [lo, hi) of 128 keys; the tile's pieces meet in
  // workspace slots slot .. slot + parts - 1 (fewer than 2 x the multiprocessors in a launch).
  int part, parts, slot, lo, hi;
};
struct Sm90Schedule {
  int rows = 0;      // query rows a tile
  int m_blocks = 0;  // query blocks a head: tiles = m_blocks x heads
  int ctas = 0;      // CTAs the launch starts
  std::vector<Sm90Work> work;  // by CTA, then round
};
// What attention_cuda(p, ..., kernel) would give each CTA of the Hopper kernel on a device with
// `sms` multiprocessors: every tile whole or cut into pieces, round by round (the tile order,
// its split tail). For tests of the schedule without a device; it lists every tile, so keep
// shapes small. Empty (ctas 0) where p is outside the Hopper kernel's contract or kernel is
// kSm80.
Sm90Schedule attention_sm90_schedule(const AttnParams& p, AttnKernel kernel, int sms);
// Whether the mma.sync kernel (kSm80, and kAuto off Hopper) on a device with `sms`
// multiprocessors starts p's CTAs heads first (every head's heaviest causal query block, then
// every head's next) rather than head after head: causal launches whose last query block sees
// at least 1.5x the keys of the first and whose CTA slots each get a short share of the work.
// Either order gives the same bits. For tests.
bool attention_sm80_heads_first(const AttnParams& p, int sms);
// Which launch reads p: the decode kernel (attention_decode_cuda) for one query row or per-row
// K/V, a prefill kernel otherwise.
inline bool attention_is_decode(const AttnParams& p) {
  return p.n_q == 1 || p.row_kv_len != nullptr;
}
// Whether a prefill launch reads p's K and V as they lie: contiguous rows of q's dtype always;
// paged K/V (kv_pages) and FP8 KV rows (kv_fp8) only under FP8 attention (qkv_fp8), whose
// quantizer reads them. The decode kernel reads all three.
inline bool prefill_reads_kv(const AttnParams& p) {
  return p.qkv_fp8 || (!p.kv_pages && !p.kv_fp8);
}
// Whether attention_cuda takes p with merge_into_o set: an fp32 o (both prefill kernels merge
// in their epilogue) and K/V it reads (prefill_reads_kv); attention_decode_cuda refuses it
// (cudaErrorInvalidValue).
bool attention_merges_into_o(const AttnParams& p);

// One ring step of prefill: flash attention (tensor cores) of q against k/v under p.mask,
// writing o and lse. Key blocks that the causal mask hides from a whole query block are never
// loaded or computed. n_q = 0 is a no-op; n_kv = 0 gives empty rows. kSm90 where it does not
// run: cudaErrorInvalidDeviceFunction.
cudaError_t attention_cuda(const AttnParams& p, cudaStream_t stream,
                           AttnKernel kernel = AttnKernel::kAuto);

// FP8 prefill on Hopper (compute capability 9.0, head_dim 128 or 64): attention_cuda's contract
// (bf16 or f16 q/k/v, any mask, o in that dtype or fp32, merge_into_o), computed by the
// Hopper kernel over e4m3 copies of q, k and v written into `workspace` first (kernels/cuda/
// attention_fp8.cu says how: a scale per 64 query rows and per 128 keys and head, a scale per
// V column, Q and K rotated by a Hadamard transform), with P rounded to e4m3 for P.V and fp32
// accumulation. The workspace (256-byte aligned) must hold attention_fp8_workspace_bytes(p):
// about (n_q x heads + 2 x n_kv x kv_heads) x head_dim bytes. K and V may be paged (kv_pages)
// and FP8 KV rows (kv_fp8, row strides in bytes, multiples of 16): read where they lie, with
// the result of dequantize_kv_cuda into one block first, bit for bit.
// cudaErrorInvalidDeviceFunction off Hopper.
struct Fp8AttnOptions {
  bool hadamard = true;  // rotate Q and K (incoherent processing); false: quantize as they are
  // The two consumer warpgroups take turns issuing their MMAs (one's softmax beside the
  // other's MMAs); false: each issues as soon as its data is in. Off: on an H200 it gained 5 %
  // at 4K tokens and lost 13-14 % at 64K (docs/benchmarks.md).
  bool pingpong = false;
  // Query rows a tile: 0 (chosen as for bf16: 192, three consumer warpgroups, at head_dim 64
  // where that fills the GPU as well), 128, or 192 (head_dim 64 only).
  int rows = 0;
};
// The head_dims the FP8 kernel runs (128 and 64), whatever the device.
bool attention_fp8_head_dim(int head_dim);
// That, on a device that runs it (Hopper).
bool attention_fp8_supported(const AttnParams& p);
size_t attention_fp8_workspace_bytes(const AttnParams& p);
cudaError_t attention_fp8_cuda(const AttnParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, const Fp8AttnOptions& options = {});

// Split-KV flash-decoding for a few query rows (decode: n_q = 1..a few) against a long KV:
// the keys are cut into splits that run in parallel, each writes a partial (o, lse) into
// `workspace`, and a second kernel merges them in split order (deterministic). Same contract
// and constraints as attention_cuda (kNone or kCausal). The workspace must hold
// attention_decode_workspace_bytes(p) bytes (it depends on p and on the current device: its
// multiprocessor count and how many CTAs one holds) and be 16-byte aligned. Paged K/V needs
// page_size a multiple of 32.
size_t attention_decode_workspace_bytes(const AttnParams& p);
cudaError_t attention_decode_cuda(const AttnParams& p, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

// Merges (o_b, lse_b) into (o_a, lse_a) in place, fp32, exactly as merge_cpu: lse = max +
// log1p(exp(-|a - b|)), o = o_a * exp(a - lse) + o_b * exp(b - lse); a row whose b is -inf is
// unchanged, a row whose a is -inf takes b (no -inf - -inf). Device pointers.
cudaError_t merge_cuda(const MergeParams& p, cudaStream_t stream);

}  // namespace burst::kernels
