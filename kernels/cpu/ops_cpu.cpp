// CPU references of kernels/ops.h, fp32 with fp32 accumulation; OpenMP over rows where a call
// has enough work to pay for the threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

namespace {

// Columns [j0, n) of out, one dot product per output: each sums x[i, c] * w[j, c] for c = 0, 1,
// ... in order, a multiply then an add (no fused multiply-add), which is what the AVX2 path
// below reproduces bit for bit.
void gemm_columns(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
                  bool accumulate, int64_t j0) {
  // Four x rows at a time share every load of a w row (m is the token count).
  constexpr int64_t kRows = 4;
#pragma omp parallel for schedule(static)
  for (int64_t j = j0; j < n; ++j) {
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

#if defined(__x86_64__) && defined(__GNUC__)
#define BURST_GEMM_AVX2 1
// Eight output columns at a time in the lanes of a 256-bit register: the block's eight w rows
// are packed as [k][8] (so lane t holds w[j + t, c]) and each x element is broadcast; per lane
// the same multiply, round, add, round in the same order as gemm_columns, so results are
// identical to the bit (AVX2 only, without FMA: the compiler cannot fuse what it has no
// instruction for). Four x rows share each packed load. Columns past the last full block of 8
// go to gemm_columns.
// out[0..8) = acc, or out + acc (one add per element, as gemm_columns does).
__attribute__((target("avx2"))) inline void store8(float* dst, __m256 acc, bool accumulate) {
  if (accumulate) acc = _mm256_add_ps(_mm256_loadu_ps(dst), acc);
  _mm256_storeu_ps(dst, acc);
}

__attribute__((target("avx2"))) void gemm_avx2(const float* x, const float* w, float* out,
                                               int64_t m, int64_t n, int64_t k,
                                               bool accumulate) {
  const int64_t blocks = n / 8;
#pragma omp parallel
  {
    // Kept per thread between calls: a decode step runs dozens of GEMMs.
    thread_local std::vector<float> packed;
    if (packed.size() < static_cast<size_t>(k) * 8) packed.resize(static_cast<size_t>(k) * 8);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j = b * 8;
      for (int64_t t = 0; t < 8; ++t) {
        const float* wr = w + (j + t) * k;
        for (int64_t c = 0; c < k; ++c) packed[static_cast<size_t>(c * 8 + t)] = wr[c];
      }
      const float* pw = packed.data();
      int64_t i = 0;
      for (; i + 4 <= m; i += 4) {
        const float* x0 = x + i * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < k; ++c) {
          const __m256 wc = _mm256_loadu_ps(pw + c * 8);
          a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_set1_ps(x0[c]), wc));
          a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_set1_ps(x0[k + c]), wc));
          a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_set1_ps(x0[2 * k + c]), wc));
          a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_set1_ps(x0[3 * k + c]), wc));
        }
        store8(out + i * n + j, a0, accumulate);
        store8(out + (i + 1) * n + j, a1, accumulate);
        store8(out + (i + 2) * n + j, a2, accumulate);
        store8(out + (i + 3) * n + j, a3, accumulate);
      }
      for (; i < m; ++i) {
        const float* xi = x + i * k;
        __m256 a = _mm256_setzero_ps();
        for (int64_t c = 0; c < k; ++c) {
          a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(xi[c]), _mm256_loadu_ps(pw + c * 8)));
        }
        store8(out + i * n + j, a, accumulate);
      }
    }
  }
  if (blocks * 8 < n) gemm_columns(x, w, out, m, n, k, accumulate, blocks * 8);
}
#endif

}  // namespace

void gemm_cpu(const float* x, const float* w, float* out, int64_t m, int64_t n, int64_t k,
              bool accumulate) {
  // Both operands are contiguous along k, so each output is one dot product.
#ifdef BURST_GEMM_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n >= 8) return gemm_avx2(x, w, out, m, n, k, accumulate);
#endif
  gemm_columns(x, w, out, m, n, k, accumulate, 0);
}

void gemm_cpu_reference(const float* x, const float* w, float* out, int64_t m, int64_t n,
                        int64_t k, bool accumulate) {
  gemm_columns(x, w, out, m, n, k, accumulate, 0);
}

void add_cpu(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace burst::kernels
