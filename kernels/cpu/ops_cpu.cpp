// CPU references of kernels/ops.h, fp32 with fp32 accumulation; OpenMP over rows where a call
// has enough work to pay for the threads.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/ops.h"

namespace burst::kernels {

void rms_norm_cpu(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float ss = 0.f;
    for (int64_t c = 0; c < dim; ++c) ss += xr[c] * xr[c];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    float* outr = out + r * dim;
    for (int64_t c = 0; c < dim; ++c) outr[c] = w[c] * (xr[c] * inv);
  }
}

void rope_cpu(float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
              const int64_t* positions, const float* inv_freq) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; ++r) {
    // HF computes the angle in fp32 as pos * inv_freq, then cos/sin in fp32.
    const float pos = static_cast<float>(positions[r]);
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + r * row_stride + h * head_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float ang = pos * inv_freq[d];
        const float c = std::cos(ang), s = std::sin(ang);
        const float a = xh[d], b = xh[d + half];
        xh[d] = a * c - b * s;
        xh[d + half] = b * c + a * s;
      }
    }
  }
}

void gather_rows_cpu(const void* pool, const int32_t* pages, int64_t page_size, int64_t rows,
                     int64_t row_bytes, void* dst) {
  // A page's rows are contiguous in the pool: one copy per page run.
  for (int64_t r = 0; r < rows; r += page_size - r % page_size) {
    const int64_t n = std::min(rows - r, page_size - r % page_size);
    const int64_t src = int64_t{pages[r / page_size]} * page_size + r % page_size;
    std::memcpy(static_cast<char*>(dst) + r * row_bytes,
                static_cast<const char*>(pool) + src * row_bytes, static_cast<size_t>(n * row_bytes));
  }
}

void scatter_rows_cpu(const void* src, const int32_t* dst_rows, int64_t rows, int64_t row_bytes,
                      void* pool) {
  for (int64_t r = 0; r < rows; ++r) {
    if (dst_rows[r] < 0) continue;
    std::memcpy(static_cast<char*>(pool) + int64_t{dst_rows[r]} * row_bytes,
                static_cast<const char*>(src) + r * row_bytes, static_cast<size_t>(row_bytes));
  }
}

void silu_mul_cpu(const float* gate, const float* up, float* out, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.f + std::exp(-g)) * up[i];
  }
}

void embedding_cpu(const float* table, const int32_t* ids, float* out, int64_t rows,
                   int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = table + static_cast<int64_t>(ids[r]) * dim;
    for (int64_t c = 0; c < dim; ++c) out[r * dim + c] = src[c];
  }
}

void gemm_cpu(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
              bool accumulate) {
  // Both operands are contiguous along k, so each output is one dot product. Four x rows at a
  // time share every load of a w row (m is the token count; n is large for every LLaMA GEMM).
  constexpr int64_t kRows = 4;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    const float* wj = w + j * k;
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      float acc[kRows] = {0.f, 0.f, 0.f, 0.f};
      const float* x0 = x + i * k;
      for (int64_t c = 0; c < k; ++c) {
        const float wc = wj[c];
        for (int64_t r = 0; r < kRows; ++r) acc[r] += x0[r * k + c] * wc;
      }
      for (int64_t r = 0; r < kRows; ++r) {
        float* dst = out + (i + r) * n + j;
        *dst = accumulate ? *dst + acc[r] : acc[r];
      }
    }
    for (; i < m; ++i) {
      const float* xi = x + i * k;
      float acc = 0.f;
      for (int64_t c = 0; c < k; ++c) acc += xi[c] * wj[c];
      float* dst = out + i * n + j;
      *dst = accumulate ? *dst + acc : acc;
    }
  }
}

void add_cpu(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace burst::kernels
