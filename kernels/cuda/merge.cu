// (O, LSE) merge on the GPU (GAO): the merge_cpu contract of kernels/attention.h, fp32, in
// place into (o_a, lse_a), or o into p.out in its dtype. One warp per (row, head): the lanes
// read both LSEs, then stride over head_dim; lane 0 writes the new LSE only after every lane
// has read the old one.
#include <cmath>
#include <cstdint>

#include "kernels/attention_cuda.h"
#include "kernels/cuda_dispatch.cuh"

namespace burst::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;

// OutT: where the merged o goes, o_a itself (float) or p.out (its dtype).
template <typename OutT>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) merge_kernel(const MergeParams p) {
  pdl_begin();  // launched chained (cuda_dispatch.cuh)
  const int64_t item = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= int64_t{p.rows} * p.heads) return;  // whole warps leave together
  const int h = static_cast<int>(item / p.rows);
  const int r = static_cast<int>(item % p.rows);
  float* lse_a = p.lse_a + int64_t{h} * p.lse_head_stride + r;
  const float a = *lse_a;
  const float b = p.lse_b[int64_t{h} * p.lse_head_stride + r];
  float* oa = p.o_a + int64_t{r} * p.o_row_stride + int64_t{h} * p.o_head_stride;
  const float* ob = p.o_b + int64_t{r} * p.o_row_stride + int64_t{h} * p.o_head_stride;
  OutT* dst = p.out ? static_cast<OutT*>(p.out) + int64_t{r} * p.out_row_stride +
                          int64_t{h} * p.head_dim
                    : reinterpret_cast<OutT*>(oa);
  if (b == -INFINITY) {  // b saw nothing: a is already the answer (also when both are)
    if (p.out) {
      for (int c = lane; c < p.head_dim; c += 32) store_f32(dst + c, oa[c]);
    }
    return;
  }
  // a saw nothing: take b as is (max + log1p(exp(-|a - b|)) would meet inf - inf = NaN).
  const bool take_b = a == -INFINITY;
  const float lse = take_b ? b : fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
  if (take_b) {
    for (int c = lane; c < p.head_dim; c += 32) store_f32(dst + c, ob[c]);
  } else {
    const float wa = expf(a - lse), wb = expf(b - lse);
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
  if (p.out == nullptr) {
    return launch_chained<merge_kernel<float>>(dim3(static_cast<unsigned>(blocks)),
                                               dim3(kWarpsPerBlock * 32), 0, stream, p);
  }
  if (p.out_row_stride < int64_t{p.heads} * p.head_dim) return cudaErrorInvalidValue;
  return with_type(p.out_dtype, [&](auto tag) {
    using OutT = typename decltype(tag)::type;
    return launch_chained<merge_kernel<OutT>>(dim3(static_cast<unsigned>(blocks)),
                                              dim3(kWarpsPerBlock * 32), 0, stream, p);
  });
}

}  // namespace burst::kernels
