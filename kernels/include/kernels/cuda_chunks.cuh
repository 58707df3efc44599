// 16-byte chunks of a float, bf16 or fp16 tensor widened to fp32 and rounded back: the
// element-wise kernels (ops.cu) and the FP8 KV quantizer (kv_fp8.cu) read and write whole
// chunks where every pointer is 16-byte aligned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda_dispatch.cuh"  // load_f32, store_f32

namespace burst::kernels {

template <typename T>
constexpr int kPerChunk = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk

template <typename T>
__device__ __forceinline__ void unpack_chunk(const uint4& v, float (&f)[kPerChunk<T>]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int j = 0; j < kPerChunk<T>; ++j) f[j] = load_f32(e + j);
}

// kCount values from p widened to fp32, and their rounded store: one value, or whole 16-byte
// chunks of T (8 values of bf16 / f16, 4 of float a chunk).
template <int kCount, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&f)[kCount]) {
  if constexpr (kCount == 1) {
    f[0] = load_f32(p);
  } else {
    constexpr int kPer = kPerChunk<T>;
    static_assert(kCount % kPer == 0, "whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < kCount / kPer; ++c) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[c];
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int j = 0; j < kPer; ++j) f[c * kPer + j] = load_f32(e + j);
    }
  }
}
template <int kCount, typename T>
__device__ __forceinline__ void store_n(T* p, const float (&f)[kCount]) {
  if constexpr (kCount == 1) {
    store_f32(p, f[0]);
  } else {
    constexpr int kPer = kPerChunk<T>;
    static_assert(kCount % kPer == 0, "whole 16-byte chunks");
#pragma unroll
    for (int c = 0; c < kCount / kPer; ++c) {
      uint4 v;
      T* e = reinterpret_cast<T*>(&v);
#pragma unroll
      for (int j = 0; j < kPer; ++j) store_f32(e + j, f[c * kPer + j]);
      reinterpret_cast<uint4*>(p)[c] = v;
    }
  }
}

}  // namespace burst::kernels
