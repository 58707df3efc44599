// CUDA twins of kernels/ops.h (contract in kernels/ops_cuda.h): RMSNorm, rotate-half RoPE,
// SwiGLU's silu(gate) * up, the embedding gather, and the element-wise conversion, add and
// fills (random and constant) the CUDA backend needs. All are memory-bound: each reads its
// inputs once and writes once, converting to fp32 in registers and rounding once at the store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda_chunks.cuh"
#include "kernels/cuda_dispatch.cuh"
#include "kernels/cuda_norm.cuh"
#include "kernels/ops_cuda.h"
#include "kernels/random.h"

namespace burst::kernels {
namespace {

// One block per row: fp32 sum of squares (per-thread partials, then warp and block tree),
// then a second pass over the row (in L1/L2 by then) that scales and stores.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(const T* x, const T* w, T* out, int64_t dim, float eps) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const T* xr = x + int64_t{blockIdx.x} * dim;
  T* outr = out + int64_t{blockIdx.x} * dim;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
    const float v = load_f32(xr + c);
    ss = fmaf(v, v, ss);
  }
  const float inv = rms_inverse(ss, dim, eps);
  for (int64_t c = threadIdx.x; c < dim; c += kNormThreads) {
    store_f32(outr + c, load_f32(w + c) * (load_f32(xr + c) * inv));
  }
}

// The same where a row is whole 16-byte chunks (16-byte aligned) and fits kNormVecChunks of
// them a thread: every load of x and w is issued before the first is used and x stays in
// registers for the second pass, so the kernel costs about one memory latency. A decode step
// runs it between two GEMVs, where nothing overlaps it: the 32-layer GEMV chain of the 7B
// (burst-bench-kernels "layers_fused") went from 82.5-83.7 % to 85.5-86.9 % of copy on an H100.
// Same formula and rounding per element; the sum of squares is added in another order.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_vec_kernel(const T* x, const T* w, T* out, int64_t dim, float eps) {
  constexpr int kPer = kPerChunk<T>;
  const uint4* xr = reinterpret_cast<const uint4*>(x + int64_t{blockIdx.x} * dim);
  const uint4* wr = reinterpret_cast<const uint4*>(w);
  uint4* outr = reinterpret_cast<uint4*>(out + int64_t{blockIdx.x} * dim);
  const int chunks = static_cast<int>(dim / kPer);
  uint4 wv[kNormVecChunks], xv[kNormVecChunks];
  // The weights before the wait (no kernel writes them: cuda_dispatch.cuh), x after it.
  load_held<true>(wr, chunks, wv);
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  load_held<false>(xr, chunks, xv);
  rms_norm_held<T>(xv, wv, chunks, dim, eps, outr);
}

// One thread per rotated pair (row, head, d < half) of x0 (heads0 heads), then of x1 (heads1:
// a layer's k beside its q, one launch); consecutive threads take consecutive d, so both halves
// are read and written coalesced. Any shape and alignment (rope_vec_kernel takes the usual).
template <typename T>
__global__ void rope_kernel(T* x0, int64_t heads0, int64_t stride0, T* x1, int64_t heads1,
                            int64_t stride1, int64_t rows, int64_t half, const int64_t* positions,
                            const float* inv_freq) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t total0 = rows * heads0 * half, total = total0 + rows * heads1 * half;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const bool first = i < total0;
    const int64_t j = first ? i : i - total0, heads = first ? heads0 : heads1;
    const int64_t d = j % half, rh = j / half, h = rh % heads, r = rh / heads;
    T* xh = (first ? x0 + r * stride0 : x1 + r * stride1) + h * 2 * half;
    const float2 y = rope_rotate(load_f32(xh + d), load_f32(xh + d + half), positions[r],
                                 inv_freq[d]);
    store_f32(xh + d, y.x);
    store_f32(xh + d + half, y.y);
  }
}

// The same, one block a row, where half is whole 16-byte chunks and rows and pointers are
// 16-byte aligned (a prefill's q and k): the row's sin and cos, which all its heads share, once
// per frequency into shared memory (the scalar kernel took a sincosf, with its reduction of
// angles up to ~1e5 rad, and 64-bit divisions for every pair: 4.1 ms a 7B layer at 128K
// tokens on an H200), then a chunk of each half a thread and item, every item's loads issued
// before the first store. The same rope_apply per pair, so the bits equal the scalar kernel's.
constexpr int kRopeThreads = 128;
constexpr int kRopeItems = 4;  // (head, chunk) items a thread has in flight
template <typename T>
__global__ void __launch_bounds__(kRopeThreads)
    rope_vec_kernel(T* x0, int64_t heads0, int64_t stride0, T* x1, int64_t heads1,
                    int64_t stride1, int half, const int64_t* positions, const float* inv_freq) {
  constexpr int kPer = kPerChunk<T>;
  extern __shared__ float2 sin_cos[];  // [half]
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t r = blockIdx.x;
  const int64_t pos = positions[r];
  for (int d = threadIdx.x; d < half; d += kRopeThreads) {
    sin_cos[d] = rope_sin_cos(pos, inv_freq[d]);
  }
  __syncthreads();  // the row's angles are in shared memory before any thread rotates
  const int chunks = half / kPer;  // a head's chunks of each half
  const int items = static_cast<int>(heads0 + heads1) * chunks;
  T* const row0 = heads0 == 0 ? nullptr : x0 + r * stride0;
  T* const row1 = heads1 == 0 ? nullptr : x1 + r * stride1;
  for (int base = 0; base < items; base += kRopeItems * kRopeThreads) {
    uint4 a[kRopeItems], b[kRopeItems];
    T* at[kRopeItems];
    int d0[kRopeItems];
#pragma unroll
    for (int k = 0; k < kRopeItems; ++k) {
      const int i = base + k * kRopeThreads + static_cast<int>(threadIdx.x);
      at[k] = nullptr;
      if (i >= items) continue;
      const int h = i / chunks;
      d0[k] = (i % chunks) * kPer;
      at[k] = (h < heads0 ? row0 + int64_t{h} * 2 * half : row1 + (h - heads0) * 2 * half) + d0[k];
      a[k] = *reinterpret_cast<const uint4*>(at[k]);
      b[k] = *reinterpret_cast<const uint4*>(at[k] + half);
    }
#pragma unroll
    for (int k = 0; k < kRopeItems; ++k) {
      if (at[k] == nullptr) continue;
      float fa[kPer], fb[kPer];
      unpack_chunk<T>(a[k], fa);
      unpack_chunk<T>(b[k], fb);
      T* ea = reinterpret_cast<T*>(&a[k]);
      T* eb = reinterpret_cast<T*>(&b[k]);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const float2 y = rope_apply(fa[j], fb[j], sin_cos[d0[k] + j]);
        store_f32(ea + j, y.x);
        store_f32(eb + j, y.y);
      }
      *reinterpret_cast<uint4*>(at[k]) = a[k];
      *reinterpret_cast<uint4*>(at[k] + half) = b[k];
    }
  }
}

// Element-wise kernels over n values: a 16-byte chunk of each operand a thread and step where
// every pointer is 16-byte aligned (vec), the scalar tail and the unaligned case one value at
// a time (a value a thread and step had reached ~2 TB/s on an H200). op(i, count) is called for
// chunk starts i (count = kPerChunk of the widest type) and single values (count = 1).
template <int kPer, typename Op>
__device__ __forceinline__ void for_each_chunk(int64_t n, bool vec, Op op) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t whole = vec ? n / kPer * kPer : 0;
  for (int64_t i = tid * kPer; i < whole; i += stride * kPer) {
    op(i, std::integral_constant<int, kPer>{});
  }
  for (int64_t i = whole + tid; i < n; i += stride) op(i, std::integral_constant<int, 1>{});
}

// out = op(a, b) element by element (out may be a): SwiGLU's product and the residual add.
template <typename T, typename Op>
__global__ void binary_kernel(const T* a, const T* b, T* out, int64_t n, bool vec, Op op) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  for_each_chunk<kPerChunk<T>>(n, vec, [&](int64_t i, auto count) {
    constexpr int c = decltype(count)::value;
    float x[c], y[c];
    load_n<c>(a + i, x);
    load_n<c>(b + i, y);
#pragma unroll
    for (int j = 0; j < c; ++j) x[j] = op(x[j], y[j]);
    store_n<c>(out + i, x);
  });
}
struct SiluTimes {
  __device__ float operator()(float gate, float up) const { return silu_times(gate, up); }
};
struct Plus {
  __device__ float operator()(float x, float y) const { return x + y; }
};

template <typename T>
__global__ void embedding_kernel(const T* table, const int32_t* ids, const int32_t* drawn,
                                 T* out, int64_t rows, int64_t dim) {
  const int64_t total = rows * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / dim, c = i % dim;
    const int32_t id = ids[r] >= 0 ? ids[r] : drawn[-1 - ids[r]];
    out[i] = table[int64_t{id} * dim + c];
  }
}

// Src -> Dst, a chunk of the narrower type's 16 bytes at a time (of float two 16-byte chunks).
template <typename Src, typename Dst>
__global__ void convert_kernel(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t n,
                               bool vec) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  constexpr int kPer = (kPerChunk<Src>) > (kPerChunk<Dst>) ? kPerChunk<Src> : kPerChunk<Dst>;
  for_each_chunk<kPer>(n, vec, [&](int64_t i, auto count) {
    constexpr int c = decltype(count)::value;
    float f[c];
    load_n<c>(src + i, f);
    store_n<c>(dst + i, f);
  });
}

template <typename T>
__global__ void fill_uniform_kernel(T* __restrict__ out, int64_t n, uint64_t seed, float scale,
                                    FillWindow w) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t counter = (w.row0 + i / w.local_cols) * w.cols + w.col0 + i % w.local_cols;
    store_f32(out + i, uniform_at(seed, counter, scale));
  }
}

template <typename T>
__global__ void fill_kernel(T* __restrict__ out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    store_f32(out + i, value);
  }
}

constexpr int kThreads = kGridStrideThreads;

std::atomic<bool> pdl_switch{true};  // LaunchSwitches::pdl

}  // namespace

void set_launch_switches(const LaunchSwitches& switches) {
  pdl_switch.store(switches.pdl, std::memory_order_relaxed);
}

LaunchSwitches launch_switches() { return {pdl_switch.load(std::memory_order_relaxed)}; }

cudaError_t rms_norm_cuda(const void* x, const void* w, void* out, int64_t rows, int64_t dim,
                          float eps, DType dtype, cudaStream_t stream) {
  if (rows < 0 || dim < 0 || !(eps >= 0.f) || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0 || dim == 0) return cudaSuccess;
  if (!x || !w || !out) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = norm_row_held<T>(dim) && aligned16(x) && aligned16(w) && aligned16(out);
    if (vec) {
      return launch_chained<rms_norm_vec_kernel<T>>(
          dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), 0, stream,
          static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out), dim, eps);
    }
    return launch_chained<rms_norm_kernel<T>>(
        dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), 0, stream,
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(out), dim, eps);
  });
}

cudaError_t rope_qk_cuda(void* q, int64_t heads, int64_t q_stride, void* k, int64_t kv_heads,
                         int64_t k_stride, int64_t rows, int64_t head_dim,
                         const int64_t* positions, const float* inv_freq, DType dtype,
                         cudaStream_t stream) {
  if (rows < 0 || heads < 0 || kv_heads < 0 || head_dim < 0 || head_dim % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  if (q_stride < heads * head_dim || (kv_heads > 0 && k_stride < kv_heads * head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = rows * (heads + kv_heads) * (head_dim / 2);
  if (total == 0) return cudaSuccess;
  if ((heads > 0 && !q) || (kv_heads > 0 && !k) || !positions || !inv_freq) {
    return cudaErrorInvalidValue;
  }
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t per = kPerChunk<T>, half = head_dim / 2;
    const bool vec = half % per == 0 && half <= 4096 && rows <= 0x7fffffff &&
                     (heads == 0 || (aligned16(q) && q_stride % per == 0)) &&
                     (kv_heads == 0 || (aligned16(k) && k_stride % per == 0)) &&
                     (heads + kv_heads) * (half / per) <= 0x7fffffff;
    if (vec) {
      return launch_chained<rope_vec_kernel<T>>(
          dim3(static_cast<unsigned>(rows)), dim3(kRopeThreads), half * sizeof(float2), stream,
          static_cast<T*>(q), heads, q_stride, static_cast<T*>(k), kv_heads, k_stride,
          static_cast<int>(half), positions, inv_freq);
    }
    return launch_chained<rope_kernel<T>>(dim3(grid_for(total)), dim3(kThreads), 0, stream,
                                          static_cast<T*>(q), heads, q_stride, static_cast<T*>(k),
                                          kv_heads, k_stride, rows, head_dim / 2, positions,
                                          inv_freq);
  });
}

cudaError_t rope_cuda(void* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t row_stride,
                      const int64_t* positions, const float* inv_freq, DType dtype,
                      cudaStream_t stream) {
  return rope_qk_cuda(x, heads, row_stride, nullptr, 0, 0, rows, head_dim, positions, inv_freq,
                      dtype, stream);
}

namespace {
// 16-byte vectors, consecutive threads along a row: each row is one contiguous read and write.
__global__ void gather_rows_kernel(const uint4* pool, const int32_t* pages, int64_t page_size,
                                   int64_t rows, int64_t row_vecs, uint4* dst) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t total = rows * row_vecs;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / row_vecs, c = i % row_vecs;
    const int64_t src = int64_t{pages[r / page_size]} * page_size + r % page_size;
    dst[i] = pool[src * row_vecs + c];
  }
}
// Rows of src0 into pool0 and, where src1 is given, of src1 into pool1 (a step's k and v: the
// same destination rows), one launch.
__global__ void scatter_rows_kernel(const uint4* src0, uint4* pool0, const uint4* src1,
                                    uint4* pool1, const int32_t* dst_rows, int64_t rows,
                                    int64_t row_vecs) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t per = rows * row_vecs, total = src1 ? 2 * per : per;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const bool first = i < per;
    const int64_t j = first ? i : i - per, r = j / row_vecs, c = j % row_vecs;
    const int32_t d = dst_rows[r];
    if (d >= 0) (first ? pool0 : pool1)[int64_t{d} * row_vecs + c] = (first ? src0 : src1)[j];
  }
}
}  // namespace

cudaError_t scatter_rows_pair_cuda(const void* src0, void* pool0, const void* src1, void* pool1,
                                   const int32_t* dst_rows, int64_t rows, int64_t row_bytes,
                                   cudaStream_t stream) {
  if (rows < 0 || row_bytes <= 0 || row_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  auto bad = [](const void* p) { return !p || (reinterpret_cast<uintptr_t>(p) & 15u); };
  if (bad(src0) || bad(pool0) || !dst_rows || (src1 != nullptr) != (pool1 != nullptr) ||
      (src1 && (bad(src1) || bad(pool1)))) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = row_bytes / 16;
  return launch_chained<scatter_rows_kernel>(
      dim3(grid_for((src1 ? 2 : 1) * rows * vecs)), dim3(kThreads), 0, stream,
      static_cast<const uint4*>(src0), static_cast<uint4*>(pool0),
      static_cast<const uint4*>(src1), static_cast<uint4*>(pool1), dst_rows, rows, vecs);
}

cudaError_t scatter_rows_cuda(const void* src, const int32_t* dst_rows, int64_t rows,
                              int64_t row_bytes, void* pool, cudaStream_t stream) {
  return scatter_rows_pair_cuda(src, pool, nullptr, nullptr, dst_rows, rows, row_bytes, stream);
}

namespace {
__global__ void copy_kernel(const uint4* src, uint4* dst, int64_t vecs) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < vecs;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}
}  // namespace

cudaError_t copy_chained_cuda(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes < 0 || bytes % 16 != 0) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  if (!src || !dst || (reinterpret_cast<uintptr_t>(src) & 15u) ||
      (reinterpret_cast<uintptr_t>(dst) & 15u)) {
    return cudaErrorInvalidValue;
  }
  return launch_chained<copy_kernel>(dim3(grid_for(bytes / 16)), dim3(kThreads), 0, stream,
                                     static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                     bytes / 16);
}

cudaError_t gather_rows_cuda(const void* pool, const int32_t* pages, int64_t page_size,
                             int64_t rows, int64_t row_bytes, void* dst, cudaStream_t stream) {
  if (rows < 0 || page_size <= 0 || row_bytes <= 0 || row_bytes % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (!pool || !pages || !dst || (reinterpret_cast<uintptr_t>(pool) & 15u) ||
      (reinterpret_cast<uintptr_t>(dst) & 15u)) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = row_bytes / 16;
  return launch_chained<gather_rows_kernel>(dim3(grid_for(rows * vecs)), dim3(kThreads), 0,
                                           stream, static_cast<const uint4*>(pool), pages,
                                           page_size, rows, vecs, static_cast<uint4*>(dst));
}

cudaError_t silu_mul_cuda(const void* gate, const void* up, void* out, int64_t n, DType dtype,
                          cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!gate || !up || !out) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = aligned16(gate) && aligned16(up) && aligned16(out);
    return launch_chained<binary_kernel<T, SiluTimes>>(
        dim3(grid_for(vec ? n / kPerChunk<T> : n)), dim3(kThreads), 0, stream,
        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n, vec,
        SiluTimes{});
  });
}

cudaError_t embedding_cuda(const void* table, const int32_t* ids, const int32_t* drawn, void* out,
                           int64_t rows, int64_t dim, DType dtype, cudaStream_t stream) {
  if (rows < 0 || dim < 0) return cudaErrorInvalidValue;
  if (rows == 0 || dim == 0) return cudaSuccess;
  if (!table || !ids || !out) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    embedding_kernel<T><<<grid_for(rows * dim), kThreads, 0, stream>>>(
        static_cast<const T*>(table), ids, drawn, static_cast<T*>(out), rows, dim);
    return cudaGetLastError();
  });
}

cudaError_t convert_cuda(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n,
                         cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!src || !dst) return cudaErrorInvalidValue;
  return with_type(src_dtype, [&](auto s) {
    using S = typename decltype(s)::type;
    return with_type(dst_dtype, [&](auto d) {
      using D = typename decltype(d)::type;
      constexpr int64_t kPer = std::max(kPerChunk<S>, kPerChunk<D>);
      const bool vec = aligned16(src) && aligned16(dst);
      return launch_chained<convert_kernel<S, D>>(
          dim3(grid_for(vec ? n / kPer : n)), dim3(kThreads), 0, stream,
          static_cast<const S*>(src), static_cast<D*>(dst), n, vec);
    });
  });
}

cudaError_t add_cuda(void* x, const void* y, int64_t n, DType dtype, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!x || !y) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool vec = aligned16(x) && aligned16(y);
    return launch_chained<binary_kernel<T, Plus>>(
        dim3(grid_for(vec ? n / kPerChunk<T> : n)), dim3(kThreads), 0, stream,
        static_cast<const T*>(x), static_cast<const T*>(y), static_cast<T*>(x), n, vec, Plus{});
  });
}

cudaError_t fill_uniform_cuda(void* out, int64_t n, DType dtype, uint64_t seed, float scale,
                              FillWindow window, cudaStream_t stream) {
  if (n < 0 || window.local_cols <= 0 || window.cols < window.local_cols) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (!out) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_uniform_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<T*>(out), n, seed,
                                                                  scale, window);
    return cudaGetLastError();
  });
}

cudaError_t fill_cuda(void* out, int64_t n, DType dtype, float value, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!out) return cudaErrorInvalidValue;
  return with_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<T*>(out), n, value);
    return cudaGetLastError();
  });
}

}  // namespace burst::kernels
