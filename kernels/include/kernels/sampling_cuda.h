// Token sampling on the GPU with the contract of the host sampler (engine/sampler.h,
// burst::engine::sample_with_uniform), so a server samples without copying logits to the host.
// One token per row of logits:
//   temperature 0: argmax of the raw logits, ties to the lowest id (no uniform is read);
//   temperature > 0: s = logit / T (fp32, correctly rounded as on the host); keep the top_k
//   largest s (0: all) in the order (s descending, id ascending); if min_p > 0 keep, of those,
//   the ids with exp(s - s_max) >= min_p in fp64 (counted; they lead the order); masses
//   p = exp(s - s_max) in fp64, truncated to 2^-96 fixed point and summed exactly in 128 bits;
//   if top_p < 1 keep the shortest prefix whose share of the total (in fp64) reaches top_p;
//   return the first kept id whose cumulative mass (in fp64) exceeds u * (kept mass), the last
//   kept id if none does.
// Exact prefix sums make the GPU's summation order irrelevant: host and GPU agree bit for bit
// except where the host's and CUDA's fp64 exp differ by an ulp and u * mass falls within that
// ulp of a prefix. Logits must be finite except for -inf masks (at least one finite per row
// when T > 0); NaN logits give an unspecified id.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/attention.h"  // DType

namespace burst::kernels {

// One row's settings, for calls whose rows differ (SampleParams::row_params).
struct SampleRowParams {
  float temperature = 0.f;  // finite, >= 0; 0: greedy (top_k, top_p and the uniform unread)
  int32_t top_k = 0;        // >= 0; 0: off
  float top_p = 1.f;        // in (0, 1]; 1: off
  float min_p = 0.f;        // in [0, 1]; 0: off
};

// The kernel ABI: one flat struct. All pointers are device pointers.
struct SampleParams {
  const void* logits = nullptr;  // [rows, vocab], row r at logits + r * row_stride elements
  DType dtype = DType::kF32;     // kF32 or kBF16 (kF16 is rejected)
  int64_t rows = 0;              // >= 1; one token per row
  int64_t vocab = 0;             // >= 1; rows * vocab <= INT32_MAX
  int64_t row_stride = 0;        // elements, >= vocab
  float temperature = 0.f;       // finite, >= 0; 0: greedy
  int top_k = 0;                 // >= 0; 0: off
  float top_p = 1.f;             // in (0, 1]; 1: off
  float min_p = 0.f;             // in [0, 1]; 0: off
  // Or per row: [rows] settings that replace the four above row by row, so the rows of a
  // batch's requests sample in one call. Validated by the caller (engine::validate), not here:
  // they live on the device. A greedy row (temperature 0) among them is the argmax of its raw
  // logits, ties to the lowest id, as with the scalar temperature 0, but it runs through the
  // sort with the other rows; uniforms and workspace are required whenever row_params is set.
  const SampleRowParams* row_params = nullptr;
  // [rows] fp64 uniforms in [0, 1), one per row, drawn by the host from its seeded generator
  // (Sampler::next_uniform) so that a seed replays and host and GPU consume the same stream.
  // Read only for rows with temperature > 0 (the host draws none for greedy either). u >= 1
  // gives the last kept id, u <= 0 the first.
  const double* uniforms = nullptr;
  int32_t* out_ids = nullptr;    // [rows] int32
  // Scratch of at least sample_cuda_workspace_bytes(vocab, rows) bytes, 256-byte aligned (as
  // from cudaMalloc); unused (may be null) when temperature == 0 and row_params is null. Not
  // shared between calls in flight on different streams.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of workspace sample_cuda needs for `rows` rows of `vocab` logits (keys and ids, sorted
// copies, segment offsets and CUB's radix-sort scratch); 0 for invalid sizes or when CUB cannot
// size its scratch (no device).
size_t sample_cuda_workspace_bytes(int64_t vocab, int64_t rows);

// Writes p.out_ids[r] for every row, asynchronously on `stream`. Returns the first CUDA error,
// cudaErrorInvalidValue for bad params (sizes, null pointers, dtype, temperature, top_k, top_p,
// min_p, a workspace smaller than sample_cuda_workspace_bytes). The scalar settings are not checked
// when row_params is set.
cudaError_t sample_cuda(const SampleParams& p, cudaStream_t stream);

}  // namespace burst::kernels
