// (O, LSE) merge on the GPU (GAO): the merge_cpu contract of kernels/attention.h, fp32, in
// place into (o_a, lse_a), or o into p.out in its dtype. One warp per (row, head): the lanes
// read both LSEs, then stride over head_dim; lane 0 writes the new LSE only after every lane
// has read the old one.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_cuda.h"
#include "kernels/cuda_dispatch.cuh"

namespace burst::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

// kPer head_dim elements a lane, loaded by one vector load each from o_a and o_b together
// with the two LSEs (kPer = head_dim / 32: 4 at head_dim 128, 2 at 64), or 0: any head_dim,
// lanes striding over it (then, o_a possibly being dst, each load waits for the store before).
template <int kPer>
struct Lanes {
  float v[kPer > 0 ? kPer : 1];
};

template <int kPer>
__device__ __forceinline__ Lanes<kPer> load_lanes(const float* p) {
  Lanes<kPer> l{};
  if constexpr (kPer == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    l.v[0] = t.x, l.v[1] = t.y, l.v[2] = t.z, l.v[3] = t.w;
  } else if constexpr (kPer == 2) {
    const float2 t = *reinterpret_cast<const float2*>(p);
    l.v[0] = t.x, l.v[1] = t.y;
  }
  return l;
}

template <typename OutT, int kPer>
__device__ __forceinline__ void store_lanes(OutT* p, const float (&v)[kPer]) {
  if constexpr (std::is_same_v<OutT, float>) {
    if constexpr (kPer == 4) {
      *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    }
  } else {
    OutT e[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) store_f32(e + i, v[i]);
    if constexpr (kPer == 4) {
      *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
    } else {
      *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(e);
    }
  }
}

// OutT: where the merged o goes, o_a itself (float) or p.out (its dtype).
template <typename OutT, int kPer>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) merge_kernel(const MergeParams p) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t item = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= int64_t{p.rows} * p.heads) return;  // whole warps leave together
  const int h = static_cast<int>(item / p.rows);
  const int r = static_cast<int>(item % p.rows);
  float* lse_a = p.lse_a + int64_t{h} * p.lse_head_stride + r;
  float* oa = p.o_a + int64_t{r} * p.o_row_stride + int64_t{h} * p.o_head_stride;
  const float* ob = p.o_b + int64_t{r} * p.o_row_stride + int64_t{h} * p.o_head_stride;
  OutT* dst = p.out ? static_cast<OutT*>(p.out) + int64_t{r} * p.out_row_stride +
                          int64_t{h} * p.head_dim
                    : reinterpret_cast<OutT*>(oa);
  // Every load of the lane before any use: one round trip to memory.
  const Lanes<kPer> la = load_lanes<kPer>(oa + lane * kPer);
  const Lanes<kPer> lb = load_lanes<kPer>(ob + lane * kPer);
  const float a = *lse_a;
  const float b = p.lse_b[int64_t{h} * p.lse_head_stride + r];
  if (b == -INFINITY) {  // b saw nothing: a is already the answer (also when both are)
    if (p.out) {
      if constexpr (kPer > 0) {
        store_lanes<OutT, kPer>(dst + lane * kPer, la.v);
      } else {
        for (int c = lane; c < p.head_dim; c += 32) store_f32(dst + c, oa[c]);
      }
    }
    return;
  }
  // a saw nothing: take b as is (max + log1p(exp(-|a - b|)) would meet inf - inf = NaN).
  const bool take_b = a == -INFINITY;
  const float lse = take_b ? b : fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
  const float wa = take_b ? 0.f : expf(a - lse), wb = take_b ? 1.f : expf(b - lse);
  if constexpr (kPer > 0) {
    float v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = take_b ? lb.v[i] : la.v[i] * wa + lb.v[i] * wb;
    store_lanes<OutT, kPer>(dst + lane * kPer, v);
  } else if (take_b) {
    for (int c = lane; c < p.head_dim; c += 32) store_f32(dst + c, ob[c]);
  } else {
    for (int c = lane; c < p.head_dim; c += 32) store_f32(dst + c, oa[c] * wa + ob[c] * wb);
  }
  // Every lane read *lse_a above; the warp-wide barrier orders those reads before the write.
  __syncwarp();
  if (lane == 0) *lse_a = lse;
}

}  // namespace

cudaError_t merge_cuda(const MergeParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.heads < 0 || p.head_dim < 0) return cudaErrorInvalidValue;
  const int64_t items = int64_t{p.rows} * p.heads;
  if (items == 0) return cudaSuccess;
  if (!p.o_a || !p.lse_a || !p.o_b || !p.lse_b) return cudaErrorInvalidValue;
  const int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.out != nullptr && p.out_row_stride < int64_t{p.heads} * p.head_dim) {
    return cudaErrorInvalidValue;
  }
  // A lane's kPer elements are one vector of o_a, o_b and (kPer x its size) of the output.
  auto fits = [&](int per, size_t out_bytes) {
    auto aligned = [](const void* q, size_t n) { return reinterpret_cast<uintptr_t>(q) % n == 0; };
    return p.head_dim == 32 * per && p.o_row_stride % per == 0 && p.o_head_stride % per == 0 &&
           aligned(p.o_a, 4 * per) && aligned(p.o_b, 4 * per) &&
           (p.out == nullptr || (p.out_row_stride % per == 0 && aligned(p.out, out_bytes * per)));
  };
  return with_type(p.out ? p.out_dtype : DType::kF32, [&](auto tag) {
    using OutT = typename decltype(tag)::type;
    const dim3 grid(static_cast<unsigned>(blocks)), block(kWarpsPerBlock * 32);
    if (fits(4, sizeof(OutT))) {
      return launch_chained<merge_kernel<OutT, 4>>(grid, block, 0, stream, p);
    }
    if (fits(2, sizeof(OutT))) {
      return launch_chained<merge_kernel<OutT, 2>>(grid, block, 0, stream, p);
    }
    return launch_chained<merge_kernel<OutT, 0>>(grid, block, 0, stream, p);
  });
}

}  // namespace burst::kernels
