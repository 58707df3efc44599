// Launch helpers shared by every CUDA file (kernels/cuda/*.cu, engine/cuda/cuda_backend.cu):
// the dtype -> element type dispatch and the grid size of grid-stride element-wise kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace burst::kernels
