// The FP8 KV rows on the GPU (kernels/kv_fp8.h): quantize_kv_cuda and dequantize_kv_cuda, the
// twins of quantize_kv_cpu and dequantize_kv_cpu (the same bytes and values).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda_chunks.cuh"
#include "kernels/cuda_dispatch.cuh"
#include "kernels/ops_cuda.h"
#include "kernels/kv_fp8.h"

namespace burst::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

// One warp per (row, kv head), the warps striding over them: max |x| over the head's values by
// shuffles, then each lane rounds its values (e4m3, ties to even, saturating) and stores the
// bytes; lane 0 the scale. The warp of head 0 also zeroes the row's padding. kVec4: head_dim is
// a multiple of 4 and src aligned to 4 elements, so a lane reads 4 values and writes 4 bytes at
// a time. (One value a lane and a block for every 8 items: 207 ms of a 7B 128K prefill on an
// H200, against 174 ms.)
template <typename T, bool kVec4>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    quantize_kv_kernel(const T* src, int64_t rows, int kv_heads, int head_dim,
                       const int32_t* dst_rows, uint8_t* dst) {
  pdl_begin();
  const int lane = threadIdx.x % 32;
  const int64_t items = rows * kv_heads;
  const int64_t row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  const int64_t scales = kv_fp8_scale_offset(kv_heads, head_dim);
  for (int64_t item = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32; item < items;
       item += int64_t{gridDim.x} * kWarpsPerBlock) {
    const int64_t i = item / kv_heads;
    const int g = static_cast<int>(item % kv_heads);
    const int64_t to = dst_rows ? dst_rows[i] : i;
    if (to < 0) continue;  // the same for every lane of the warp
    const T* x = src + i * kv_heads * head_dim + int64_t{g} * head_dim;
    uint8_t* row = dst + to * row_bytes;
    float amax = 0.f;
    if constexpr (kVec4) {
      for (int c = 4 * lane; c < head_dim; c += 128) {
        float v[4];
        load_n<4>(x + c, v);
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
      }
    } else {
      for (int c = lane; c < head_dim; c += 32) amax = fmaxf(amax, fabsf(load_f32(x + c)));
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    const float inverse = kv_fp8_inverse(amax);
    if constexpr (kVec4) {
      for (int c = 4 * lane; c < head_dim; c += 128) {
        float v[4];
        load_n<4>(x + c, v);  // again: from L1, this warp read it just now
        *reinterpret_cast<uint32_t*>(row + int64_t{g} * head_dim + c) =
            e4m3x4(v[0] * inverse, v[1] * inverse, v[2] * inverse, v[3] * inverse);
      }
    } else {
      for (int c = lane; c < head_dim; c += 32) {
        row[int64_t{g} * head_dim + c] =
            __nv_cvt_float_to_fp8(load_f32(x + c) * inverse, __NV_SATFINITE, __NV_E4M3);
      }
    }
    if (lane == 0) *reinterpret_cast<float*>(row + scales + 4 * g) = kv_fp8_scale(amax);
    if (g == 0) {
      for (int64_t b = scales + 4 * kv_heads + lane; b < row_bytes; b += 32) row[b] = 0;
    }
  }
}

// The same for head_dim 16 kLanes (64: 4 lanes, 128: 8) where src and dst are 16-byte aligned:
// the (row, head) items lie end to end in src, kLanes lanes an item and 16 values a lane (two
// or four 16-byte loads, all issued before any wait), max |x| over the item's lanes by
// log2(kLanes) shuffles, and 16 bytes stored a lane. Indices are 32-bit (the launch checks that
// they fit). The one-warp-an-item kernel above took a 64-bit division and a five-shuffle chain
// per item with 256 bytes in flight a warp: 174 ms of a 7B 128K prefill on an H200, ~7x its
// bytes.
template <typename T, int kLanes>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    quantize_kv_heads_kernel(const T* src, uint32_t chunks, uint32_t kv_heads,
                             const int32_t* dst_rows, uint8_t* dst) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "a power of two");
  constexpr int kHeadDim = 16 * kLanes;
  pdl_begin();
  const uint32_t lane = threadIdx.x % 32, part = lane % kLanes;
  const uint32_t row_bytes = static_cast<uint32_t>(kv_fp8_row_bytes(kv_heads, kHeadDim));
  const uint32_t scales = static_cast<uint32_t>(kv_fp8_scale_offset(kv_heads, kHeadDim));
  const uint32_t stride = gridDim.x * blockDim.x;
  // Every lane runs every trip (the shuffles take the whole warp); lanes past the end load
  // nothing and store nothing.
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x - lane; base < chunks;
       base += stride) {
    const uint32_t c = base + lane;
    const bool in = c < chunks;
    const uint32_t item = c / kLanes, i = item / kv_heads, g = item - i * kv_heads;
    float x[16];
    if (in) {
      load_n<16>(src + size_t{c} * 16, x);
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) x[j] = 0.f;
    }
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(x[j]));
#pragma unroll
    for (int off = kLanes / 2; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    }
    const int64_t to = !in ? -1 : dst_rows ? dst_rows[i] : int64_t{i};
    if (to < 0) continue;
    const float inverse = kv_fp8_inverse(amax);
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = e4m3x4(x[4 * q] * inverse, x[4 * q + 1] * inverse, x[4 * q + 2] * inverse,
                    x[4 * q + 3] * inverse);
    }
    uint8_t* row = dst + to * row_bytes;
    *reinterpret_cast<uint4*>(row + g * kHeadDim + 16 * part) = make_uint4(w[0], w[1], w[2], w[3]);
    if (part == 0) {
      *reinterpret_cast<float*>(row + scales + 4 * g) = kv_fp8_scale(amax);
      if (g == 0) {
        for (uint32_t b = scales + 4 * kv_heads; b < row_bytes; ++b) row[b] = 0;
      }
    }
  }
}

// One thread per 8 values of a head: 8 bytes in, 8 elements of T out (their scale read once).
template <typename T>
__global__ void dequantize_kv_kernel(const uint8_t* src, int64_t rows, int kv_heads,
                                     int head_dim, T* dst) {
  pdl_begin();
  const int per_row = kv_heads * head_dim / 8;
  const int64_t row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  const int64_t scales = kv_fp8_scale_offset(kv_heads, head_dim);
  const int64_t n = rows * per_row;
  for (int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx / per_row;
    const int c8 = static_cast<int>(idx % per_row) * 8;  // the first value's column
    const uint8_t* row = src + i * row_bytes;
    const float scale = *reinterpret_cast<const float*>(row + scales + 4 * (c8 / head_dim));
    float f[8];
    fp8_values8(*reinterpret_cast<const uint2*>(row + c8), scale, f);
    T out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) store_f32(out + e, f[e]);
    T* to = dst + i * kv_heads * head_dim + c8;
    if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(out);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) to[e] = out[e];
    }
  }
}

}  // namespace

cudaError_t quantize_kv_cuda(const void* src, DType dtype, int64_t rows, int kv_heads,
                             int head_dim, const int32_t* dst_rows, void* dst,
                             cudaStream_t stream) {
  if (rows < 0 || kv_heads <= 0 || head_dim <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (!src || !dst || kv_fp8_scale_offset(kv_heads, head_dim) % 4 != 0) {
    return cudaErrorInvalidValue;  // the fp32 scales are stored as words
  }
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* in = static_cast<const T*>(src);
    auto* out = static_cast<uint8_t*>(dst);
    const dim3 block(kWarpsPerBlock * 32);
    // 16 values a lane where head_dim is 64 or 128, the pointers 16-byte aligned and the
    // chunk indices 32-bit.
    const int64_t chunks = rows * kv_heads * head_dim / 16;
    const bool heads = (head_dim == 64 || head_dim == 128) && aligned16(src) && aligned16(dst) &&
                       chunks < (int64_t{1} << 31);
    if (heads) {
      const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(
          (chunks + block.x - 1) / block.x, 1, int64_t{1} << 16)));
      const auto n = static_cast<uint32_t>(chunks), h = static_cast<uint32_t>(kv_heads);
      return head_dim == 128 ? launch_chained<quantize_kv_heads_kernel<T, 8>>(
                                   grid, block, 0, stream, in, n, h, dst_rows, out)
                             : launch_chained<quantize_kv_heads_kernel<T, 4>>(
                                   grid, block, 0, stream, in, n, h, dst_rows, out);
    }
    // A few waves of blocks; each warp strides over (row, head) items.
    const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(
        (rows * kv_heads + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, int64_t{1} << 12)));
    const bool vec4 =
        head_dim % 4 == 0 && reinterpret_cast<uintptr_t>(src) % (4 * sizeof(T)) == 0;
    return vec4 ? launch_chained<quantize_kv_kernel<T, true>>(grid, block, 0, stream, in, rows,
                                                              kv_heads, head_dim, dst_rows, out)
                : launch_chained<quantize_kv_kernel<T, false>>(grid, block, 0, stream, in, rows,
                                                               kv_heads, head_dim, dst_rows, out);
  });
}

cudaError_t dequantize_kv_cuda(const void* src, int64_t rows, int kv_heads, int head_dim,
                               void* dst, DType dtype, cudaStream_t stream) {
  if (rows < 0 || kv_heads <= 0 || head_dim <= 0 || head_dim % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (!src || !dst || !aligned16(src) || !aligned16(dst)) return cudaErrorInvalidValue;
  const int64_t n = rows * kv_heads * head_dim / 8;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_chained<dequantize_kv_kernel<T>>(
        dim3(grid_for(n)), dim3(kGridStrideThreads), 0, stream, static_cast<const uint8_t*>(src),
        rows, kv_heads, head_dim, static_cast<T*>(dst));
  });
}

}  // namespace burst::kernels
