// Helpers shared by the GPU tests: the no-GPU skip reason, CUDA asserts naming file and line,
// self-freeing device buffers, and host conversions of test data to and from bf16/fp16/fp32
// (round to nearest even, as the device conversions do).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace burst::testing {

using kernels::DType;

#define CUDA_ASSERT(expr)                                                                    \
  do {                                                                                       \
    const cudaError_t err_ = (expr);                                                         \
    ASSERT_EQ(err_, cudaSuccess) << #expr << " failed at " << __FILE__ << ":" << __LINE__    \
                                 << ": " << cudaGetErrorString(err_);                        \
  } while (0)

// True when a CUDA device can be used; otherwise why not (for GTEST_SKIP).
inline bool have_gpu(std::string& why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    why = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  return true;
}

// The source tree (models, fixtures): BURST_SOURCE_DIR from the environment when set (a test
// binary built here and run from a copy of the tree on the GPU machine), else the build's.
inline std::string source_root() {
  const char* env = std::getenv("BURST_SOURCE_DIR");
  return std::string(env != nullptr && *env != '\0' ? env : BURST_SOURCE_DIR);
}

// Device memory that frees itself.
struct DevBuf {
  void* ptr = nullptr;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() {
    if (ptr) cudaFree(ptr);
  }
};

inline size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// x rounded to t and back.
inline float round_to(DType t, float x) {
  if (t == DType::kBF16) return __bfloat162float(__float2bfloat16_rn(x));
  if (t == DType::kF16) return __half2float(__float2half_rn(x));
  return x;
}

// Host fp32 values -> bytes of dtype t.
inline std::vector<uint8_t> encode(DType t, const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * dtype_bytes(t));
  for (size_t i = 0; i < x.size(); ++i) {
    if (t == DType::kBF16) {
      const __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
      std::memcpy(&out[i * 2], &b, 2);
    } else if (t == DType::kF16) {
      const __half b = __float2half_rn(x[i]);
      std::memcpy(&out[i * 2], &b, 2);
    } else {
      std::memcpy(&out[i * 4], &x[i], 4);
    }
  }
  return out;
}

// Bytes of dtype t -> host fp32 values.
inline std::vector<float> decode(DType t, const std::vector<uint8_t>& b) {
  std::vector<float> out(b.size() / dtype_bytes(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == DType::kBF16) {
      __nv_bfloat16 v;
      std::memcpy(&v, &b[i * 2], 2);
      out[i] = __bfloat162float(v);
    } else if (t == DType::kF16) {
      __half v;
      std::memcpy(&v, &b[i * 2], 2);
      out[i] = __half2float(v);
    } else {
      std::memcpy(&out[i], &b[i * 4], 4);
    }
  }
  return out;
}

// n values uniform in [lo, hi], rounded to t, never zero (a zero is drawn again).
inline std::vector<float> random_values(size_t n, float lo, float hi, DType t,
                                        std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(n);
  for (auto& v : x) {
    do {
      v = round_to(t, u(rng));
    } while (v == 0.f);
  }
  return x;
}

}  // namespace burst::testing
