// CPU reference of the FP8 KV rows (kernels/kv_fp8.h).
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/kv_fp8.h"

namespace burst::kernels {

uint8_t fp8_e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  // Past 448 lies 480, which e4m3 spends on NaN: everything from 448 on saturates to 448.
  if (a >= kFp8E4M3Max) return sign | 0x7e;
  if (a < 0x1p-6f) {
    // Subnormals are the multiples of 2^-9; 8 of them is the smallest normal's encoding.
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  }
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int exponent = e - 1;  // -6 .. 8
  // The mantissa's three bits, rounded to nearest even (the default rounding mode); 8 carries
  // into the exponent, which the sum below does by itself.
  const auto m = static_cast<int>(std::nearbyint(std::ldexp(a, -exponent) * 8.f - 8.f));
  const int code = ((exponent + 7) << 3) + m;
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

namespace {

std::array<float, 256> make_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xf, m = b & 7;
    float v = 0.f;
    if (exponent == 0xf && m == 7) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      v = std::ldexp(static_cast<float>(m), -9);
    } else {
      v = std::ldexp(static_cast<float>(8 + m), exponent - 10);  // (1 + m / 8) 2^(exponent - 7)
    }
    t[static_cast<size_t>(b)] = (b & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& table() {
  static const std::array<float, 256> t = make_table();
  return t;
}

}  // namespace

float fp8_e4m3_to_float(uint8_t b) { return table()[b]; }

void quantize_kv_cpu(const float* src, int64_t rows, int kv_heads, int head_dim,
                     const int32_t* dst_rows, void* dst) {
  const int64_t width = int64_t{kv_heads} * head_dim;
  const int64_t row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  const int64_t scales = kv_fp8_scale_offset(kv_heads, head_dim);
#pragma omp parallel for schedule(static) if (rows > 64)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t to = dst_rows ? dst_rows[i] : i;
    if (to < 0) continue;
    auto* row = static_cast<uint8_t*>(dst) + to * row_bytes;
    std::memset(row + scales, 0, static_cast<size_t>(row_bytes - scales));
    for (int g = 0; g < kv_heads; ++g) {
      const float* x = src + i * width + int64_t{g} * head_dim;
      float amax = 0.f;
      for (int c = 0; c < head_dim; ++c) amax = std::fmax(amax, std::fabs(x[c]));
      const float scale = kv_fp8_scale(amax), inverse = kv_fp8_inverse(amax);
      for (int c = 0; c < head_dim; ++c) {
        row[int64_t{g} * head_dim + c] = fp8_e4m3_from_float(x[c] * inverse);
      }
      std::memcpy(row + scales + 4 * g, &scale, 4);
    }
  }
}

void dequantize_kv_cpu(const void* src, int64_t rows, int kv_heads, int head_dim, float* dst) {
  const int64_t width = int64_t{kv_heads} * head_dim;
  const int64_t row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  const int64_t scales = kv_fp8_scale_offset(kv_heads, head_dim);
  const std::array<float, 256>& t = table();
#pragma omp parallel for schedule(static) if (rows > 64)
  for (int64_t i = 0; i < rows; ++i) {
    const auto* row = static_cast<const uint8_t*>(src) + i * row_bytes;
    for (int g = 0; g < kv_heads; ++g) {
      float scale = 0.f;
      std::memcpy(&scale, row + scales + 4 * g, 4);
      float* out = dst + i * width + int64_t{g} * head_dim;
      for (int c = 0; c < head_dim; ++c) out[c] = t[row[int64_t{g} * head_dim + c]] * scale;
    }
  }
}

}  // namespace burst::kernels
