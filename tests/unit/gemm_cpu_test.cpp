// gemm_cpu (AVX2 where the CPU has it) against the portable scalar loop, bit for bit, and both
// against a double-precision product within the fp32 accumulation bound. Random inputs (never
// zero), odd shapes: m of 1 (decode), 3, 4 (one register block), 5 and 13 rows; n below, at
// and past a multiple of 8 (the AVX2 block) with a scalar tail; k from 1 to 131.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/ops.h"

namespace burst::kernels {
namespace {

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = u(gen);
    } while (x == 0.f);
  }
  return v;
}

TEST(GemmCpu, FastPathEqualsScalarLoopBitForBitAndDoubleWithinBound) {
  uint32_t seed = 1;
  for (int64_t m : {1, 3, 4, 5, 13}) {
    for (int64_t n : {1, 7, 8, 9, 33, 261}) {
      for (int64_t k : {1, 17, 131}) {
        for (bool accumulate : {false, true}) {
          const auto x = random_values(static_cast<size_t>(m * k), seed++);
          const auto w = random_values(static_cast<size_t>(n * k), seed++);
          const auto init = random_values(static_cast<size_t>(m * n), seed++);
          std::vector<float> fast = init, ref = init;
          gemm_cpu(x.data(), w.data(), fast.data(), m, n, k, accumulate);
          gemm_cpu_reference(x.data(), w.data(), ref.data(), m, n, k, accumulate);
          ASSERT_EQ(std::memcmp(fast.data(), ref.data(), fast.size() * sizeof(float)), 0)
              << "m " << m << " n " << n << " k " << k << " accumulate " << accumulate;
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              double exact = accumulate ? init[static_cast<size_t>(i * n + j)] : 0.0, mag = 0;
              for (int64_t c = 0; c < k; ++c) {
                const double p = double(x[static_cast<size_t>(i * k + c)]) *
                                 double(w[static_cast<size_t>(j * k + c)]);
                exact += p;
                mag += std::fabs(p);
              }
              // Sequential fp32 summation: at most (k + 1) roundings of partial sums bounded by
              // the sum of magnitudes (plus the accumulated value).
              const double bound = (k + 2) * 6e-8 * (mag + 1.0);
              ASSERT_NEAR(fast[static_cast<size_t>(i * n + j)], exact, bound)
                  << "m " << m << " n " << n << " k " << k << " at " << i << "," << j;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace burst::kernels
