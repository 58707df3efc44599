// Counter-based random numbers (splitmix64 of seed and index): the same value for element i on
// every backend and thread count, so random-weight presets are reproducible on CPU and GPU.
// Host and device (the CUDA fill kernel, kernels/cuda/ops.cu, draws the same values).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define BURST_HD __host__ __device__
#else
#define BURST_HD
#endif

namespace burst::kernels {

BURST_HD inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-scale, scale).
BURST_HD inline float uniform_at(uint64_t seed, int64_t i, float scale) {
  const uint64_t r = splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<uint64_t>(i));
  const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // 24 bits in [0, 1)
  return (2.f * u - 1.f) * scale;
}

}  // namespace burst::kernels
