// Helpers shared by every CUDA file (kernels/cuda/*.cu, engine/cuda/cuda_backend.cu): the dtype
// -> element type dispatch, the grid size of grid-stride element-wise kernels, and one element
// read as / written from fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/attention.h"

namespace burst::kernels {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the element type of dtype (use `typename decltype(tag)::type`).
template <typename F>
cudaError_t with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(TypeTag<float>{});
    case DType::kBF16: return f(TypeTag<__nv_bfloat16>{});
    case DType::kF16: return f(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

// Threads per block of the grid-stride element-wise kernels.
constexpr int kGridStrideThreads = 256;

// Enough blocks to fill the device several times over, capped so the grid stays small for huge
// n (each thread then loops), and at least one (a zero-block launch is an error).
inline unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>(
      (n + kGridStrideThreads - 1) / kGridStrideThreads, 1, int64_t{1} << 16));
}

// One element of a float, bf16 or fp16 tensor read as fp32 (exact).
template <typename T>
__device__ __forceinline__ float load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *p;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(*p);
  } else {
    return __half2float(*p);
  }
}

// v rounded to nearest (even) into one element of a float, bf16 or fp16 tensor.
template <typename T>
__device__ __forceinline__ void store_f32(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *p = v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *p = __float2bfloat16_rn(v);
  } else {
    *p = __float2half_rn(v);
  }
}

}  // namespace burst::kernels
