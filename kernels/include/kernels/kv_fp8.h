// The FP8 KV cache's rows (--kv-cache-dtype fp8): half the bytes of a bf16 row per token.
// A row holds one token's K (or V) of one layer:
//   bytes [0, kv_heads * head_dim)                 e4m3 values, head g's from g * head_dim
//   bytes [kv_heads * head_dim, + 4 * kv_heads)    fp32 scales, head g's at + 4 g
//   then zeros up to a multiple of 16 bytes (rows are copied 16 bytes at a time).
// Each (token, head) has its own scale, max |x| over the head's values / 448 (e4m3's largest
// finite value): every head of every token uses the format's whole range, and an outlier
// channel costs only its own head's precision. The value is e4m3 x scale, in fp32.
// e4m3 (the "fn" variant): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinity,
// 0x7f and 0xff are NaN, the largest finite value 448, the smallest subnormal 2^-9.
// Quantizing rounds x * (448 / max |x|) to the nearest e4m3 (ties to even), saturating at
// +-448; NaN stays NaN. The CUDA twins (kernels/attention_cuda.h) give the same bytes.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define BURST_HOST_DEVICE __host__ __device__
#else
#define BURST_HOST_DEVICE
#endif

namespace burst::kernels {

constexpr float kFp8E4M3Max = 448.f;

// Where a row's scales start, and a row's bytes.
BURST_HOST_DEVICE constexpr int64_t kv_fp8_scale_offset(int kv_heads, int head_dim) {
  return int64_t{kv_heads} * head_dim;
}
BURST_HOST_DEVICE constexpr int64_t kv_fp8_row_bytes(int kv_heads, int head_dim) {
  return (kv_fp8_scale_offset(kv_heads, head_dim) + 4 * int64_t{kv_heads} + 15) / 16 * 16;
}
// A head's scale, and the factor its values are multiplied by before rounding, from max |x|.
BURST_HOST_DEVICE inline float kv_fp8_scale(float amax) { return amax / kFp8E4M3Max; }
BURST_HOST_DEVICE inline float kv_fp8_inverse(float amax) {
  return amax > 0.f ? kFp8E4M3Max / amax : 0.f;
}

// One value to e4m3 and back (host; the tables above).
uint8_t fp8_e4m3_from_float(float x);
float fp8_e4m3_to_float(uint8_t b);

// src [rows, kv_heads * head_dim] (fp32) into FP8 rows of dst: row i into dst row dst_rows[i]
// (negative: skipped, a token another rank caches), or row i with dst_rows null.
void quantize_kv_cpu(const float* src, int64_t rows, int kv_heads, int head_dim,
                     const int32_t* dst_rows, void* dst);
// dst [rows, kv_heads * head_dim] (fp32) = the values of FP8 rows [0, rows) of src.
void dequantize_kv_cpu(const void* src, int64_t rows, int kv_heads, int head_dim, float* dst);

}  // namespace burst::kernels
