// The element-wise and row-wise LLaMA ops (CPU references, fp32). The CUDA twins in
// kernels/cuda keep the same contracts with bf16/fp16 activations and fp32 accumulation.
#pragma once

#include <cstdint>
#include <vector>

namespace burst::kernels {

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, fp32 accumulation. x, out: [rows, dim].
void rms_norm_cpu(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                  float eps);

// Rotary embedding as HF transformers applies it to LLaMA checkpoints ("rotate half"): for
// each head, pairs (d, d + head_dim/2) rotate by angle pos * inv_freq[d]. x: [rows, heads,
// head_dim] with row stride row_stride; positions are absolute. inv_freq has head_dim / 2
// entries (scaling already folded in, see models/rope.h).
void rope_cpu(float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
              const int64_t* positions, const float* inv_freq);

// out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)).
void silu_mul_cpu(const float* gate, const float* up, float* out, int64_t n);

// out[r, :] = table[ids[r], :]; ids must be in range (checked by the caller).
void embedding_cpu(const float* table, const int32_t* ids, float* out, int64_t rows,
                   int64_t dim);

// out[m, n] = sum_k x[m, k] * w[n, k] (+ out[m, n] when accumulate). x: [m, k] row-major,
// w: [n, k] row-major (the HF nn.Linear weight layout), fp32 accumulation.
void gemm_cpu(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
              bool accumulate);
// The same product with the portable scalar loop only (gemm_cpu takes an AVX2 path where the
// CPU has it, equal to this bit for bit): for tests.
void gemm_cpu_reference(const float* x, const float* w, float* out, int64_t m, int64_t n,
                        int64_t k, bool accumulate);

// x[i] += y[i]
void add_cpu(float* x, const float* y, int64_t n);

// Paged row gather (a paged KV cache's rows of one sequence into one block): dst row i =
// pool row pages[i / page_size] * page_size + i % page_size, rows of row_bytes bytes, any dtype.
void gather_rows_cpu(const void* pool, const int32_t* pages, int64_t page_size, int64_t rows,
                     int64_t row_bytes, void* dst);

// Row scatter (new tokens' keys and values into a paged KV cache): pool row dst_rows[i] = src
// row i for i < rows; a negative dst_rows[i] skips row i (a token another rank caches).
void scatter_rows_cpu(const void* src, const int32_t* dst_rows, int64_t rows, int64_t row_bytes,
                      void* pool);

}  // namespace burst::kernels
