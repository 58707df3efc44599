// attention_cuda(): validates AttnParams against what the CUDA prefill kernels support and
// picks the kernel for the current device (kernels/attention_cuda.h).
#include <array>
#include <atomic>

#include "attention_common.cuh"
#include "kernels/attention_cuda.h"
#include "kernels/cuda_dispatch.cuh"

namespace burst::kernels {
namespace {

// Whether the current device runs the sm_90a build (compute capability 9.0), cached per
// device: the query costs more than a launch.
bool device_is_sm90() {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return false;
  int known = cache[dev].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    known = ok && major == 9 && minor == 0 ? 2 : 1;
    cache[dev].store(known, std::memory_order_relaxed);
  }
  return known == 2;
}

}  // namespace

bool attention_sm90_supported(const AttnParams& p) {
  return (p.head_dim == 128 || p.head_dim == 64) && device_is_sm90();
}

bool attention_merges_into_o(const AttnParams& p) {
  return output_dtype(p) == DType::kF32 && prefill_reads_kv(p) &&
         (p.head_dim == 64 || p.head_dim == 128) &&
         (p.dtype == DType::kBF16 || p.dtype == DType::kF16);
}

namespace {
// The query tile a Hopper kernel choice forces (0: the launch picks it).
int sm90_rows(AttnKernel kernel) {
  return kernel == AttnKernel::kSm90Rows128   ? 128
         : kernel == AttnKernel::kSm90Rows192 ? 192
                                              : 0;
}
}  // namespace

int attention_sm90_split_parts(const AttnParams& p, AttnKernel kernel) {
  if (kernel == AttnKernel::kSm80 || !validate(p).empty() || !attention_sm90_supported(p)) {
    return 1;
  }
  return detail::attention_sm90_split_parts(p, sm90_rows(kernel));
}

Sm90Schedule attention_sm90_schedule(const AttnParams& p, AttnKernel kernel, int sms) {
  Sm90Schedule schedule;
  if (kernel == AttnKernel::kSm80 || !validate(p).empty()) return schedule;
  if (detail::attention_sm90_schedule(p, sm90_rows(kernel), sms, schedule) != cudaSuccess) {
    return Sm90Schedule{};
  }
  return schedule;
}

bool attention_sm80_heads_first(const AttnParams& p, int sms) {
  return validate(p).empty() && detail::attention_sm80_heads_first(p, sms);
}

cudaError_t attention_cuda(const AttnParams& p, cudaStream_t stream, AttnKernel kernel) {
  if (!detail::prefill_params_ok(p)) return cudaErrorInvalidValue;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
  const bool sm90 = attention_sm90_supported(p);
  const bool sm90_only = kernel == AttnKernel::kSm90 || kernel == AttnKernel::kSm90Rows128 ||
                         kernel == AttnKernel::kSm90Rows192;
  if (sm90_only && !sm90) return cudaErrorInvalidDeviceFunction;
  if (kernel == AttnKernel::kSm90Rows192 && p.head_dim != 64) return cudaErrorInvalidValue;
  if (p.merge_into_o && !attention_merges_into_o(p)) return cudaErrorInvalidValue;
  if (p.n_q == 0) return cudaSuccess;
  if (sm90_only || (kernel == AttnKernel::kAuto && sm90)) {
    const cudaError_t err = detail::attention_sm90(p, stream, sm90_rows(kernel));
    // cudaErrorInvalidValue: the driver refused a TMA layout of these strides, before any
    // launch; kAuto then runs the kernel without that constraint.
    if (err != cudaErrorInvalidValue || sm90_only) return err;
  }
  return detail::attention_sm80(p, stream);
}

}  // namespace burst::kernels
