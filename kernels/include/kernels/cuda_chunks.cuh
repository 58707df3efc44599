// 16-byte chunks of a float, bf16 or fp16 tensor widened to fp32 and rounded back, and fp32
// values packed as e4m3: the element-wise kernels (ops.cu), the FP8 attention quantizer
// (attention_fp8.cu) and the FP8 KV quantizer (kv_fp8.cu) read and write whole chunks, or
// parts of one, in one access each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// The value of a bf16 or f16 element held as its 16 bits.
template <typename T>
__device__ __forceinline__ float bits_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(uint32_t{bits} << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

// kCount values from p widened to fp32, and their rounded store: one value, or whole 16-byte
// chunks of T (8 values of bf16 / f16, 4 of float a chunk). load_n also reads part of a chunk
// in one access: 2 or 4 16-bit values (4 or 8 bytes, p aligned to them).
template <int kCount, typename T>
__device__ __forceinline__ void load_n(const T* p, float (&f)[kCount]) {
  if constexpr (kCount == 1) {
    f[0] = load_f32(p);
  } else if constexpr (kCount * sizeof(T) == 4 || kCount * sizeof(T) == 8) {
    static_assert(sizeof(T) == 2, "part of a chunk: 16-bit values");
    uint32_t w[kCount / 2];
    if constexpr (kCount == 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(p);
      w[0] = raw.x;
      w[1] = raw.y;
    } else {
      w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
#pragma unroll
    for (int i = 0; i < kCount / 2; ++i) {
      f[2 * i] = bits_to_float<T>(w[i] & 0xFFFFu);
      f[2 * i + 1] = bits_to_float<T>(w[i] >> 16);
    }
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

// Eight e4m3 values (the first in the lowest byte) times scale, in fp32: an FP8 KV row's
// values (kernels/kv_fp8.h; the e4m3 to fp32 step is exact).
__device__ __forceinline__ void fp8_values8(uint2 bytes, float scale, float (&f)[8]) {
  const uint32_t w[2] = {bytes.x, bytes.y};
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    const auto two = static_cast<__nv_fp8x2_storage_t>(w[e / 4] >> (8 * (e % 4)));
    const float2 x = __half22float2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3));
    f[e] = x.x * scale;
    f[e + 1] = x.y * scale;
  }
}

// Two and four fp32 values as e4m3 (round to nearest even, saturating to +-448), the first in
// the lowest byte.
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  return e4m3x2(a, b) | (e4m3x2(c, d) << 16);
}

}  // namespace burst::kernels
