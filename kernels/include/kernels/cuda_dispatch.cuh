// Helpers shared by every CUDA file (kernels/cuda/*.cu, engine/cuda/cuda_backend.cu): the dtype
// -> element type dispatch, the grid size of grid-stride element-wise kernels, one element
// read as / written from fp32, and programmatic dependent launch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "kernels/attention.h"
#include "kernels/ops_cuda.h"  // launch_switches

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
    case DType::kFP8E4M3: break;  // FP8 KV rows: only their own kernels read them
    case DType::kI32: break;      // tables: read as int32 pointers, never through with_type
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

// Whether p may be read or written 16 bytes at a time (uint4, cp.async, ldmatrix, TMA).
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

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

// SwiGLU's silu(g) * u in fp32 from the rounded gate and up values (ops.cu's silu_mul and
// gemv.cu's fused gate/up product compute it in this one way, so they agree bit for bit).
// expf(-g) overflows to inf for g < -88: g / inf = -0, the right limit of silu.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }

// Rotate-half RoPE of one pair (a, b) = (x[d], x[d + head_dim / 2]) at absolute position pos
// with frequency f: (a cos - b sin, b cos + a sin). As HF (and rope_cpu): the angle in fp32
// from the position converted to fp32; sincosf (not __sincosf) reduces large angles (position
// ~1e5 rad) exactly. One function for ops.cu's rope kernel and gemv.cu's rotating store, its
// roundings spelled out, so the compiler cannot contract them differently in the two places:
// x = a c - round(b s) and y = a s + round(b c), each one fma.
// rope_sin_cos is the angle's (sin, cos), which the prefill kernel computes once a row and
// frequency for all of the row's heads; rope_apply the rotation by it.
__device__ __forceinline__ float2 rope_sin_cos(int64_t pos, float f) {
  const float ang = __fmul_rn(static_cast<float>(pos), f);
  float s, c;
  sincosf(ang, &s, &c);
  return make_float2(s, c);
}
__device__ __forceinline__ float2 rope_apply(float a, float b, float2 sc) {
  return make_float2(__fmaf_rn(a, sc.y, -__fmul_rn(b, sc.x)),
                     __fmaf_rn(a, sc.x, __fmul_rn(b, sc.y)));
}
__device__ __forceinline__ float2 rope_rotate(float a, float b, int64_t pos, float f) {
  return rope_apply(a, b, rope_sin_cos(pos, f));
}

// Programmatic dependent launch (PDL, sm_90+). A decode step is a chain of ~20 small kernels a
// layer, each waiting for the one before; launched as a programmatic dependent (launch_chained)
// a kernel's CTAs are scheduled while its predecessor still runs (once every predecessor CTA
// has called pdl_launch_dependents or exited) and its launch latency leaves the critical path.
// The contract of a kernel launched that way: before pdl_wait() it may only read what no
// kernel still running may write (weights: written at load, and every forward starts with an
// ordinary launch, the embedding, which waits for all earlier work), and it writes nothing;
// pdl_wait() returns once the predecessor grid has completed and its writes are visible (at
// once in a kernel launched normally). Waiting is transitive: the predecessor waited for its
// own. A memcpy or an event wait between two launches serialises them as before.
// Compiled out below sm_90, where launches stay serialised.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The start of a kernel launched with launch_chained that has nothing to do before its wait.
__device__ __forceinline__ void pdl_begin() {
  pdl_launch_dependents();
  pdl_wait();
}

// Whether `kernel` may be launched as a programmatic dependent on `device`: only where the code
// the device runs was compiled for sm_90+ (PTX version >= 9.0) does it carry griddepcontrol (a
// Hopper JIT-compiling compute_80 PTX would run it without the wait: a race). LaunchSwitches::pdl
// false (BURST_PDL=0, read in main) turns it off (for A/B timing).
inline cudaError_t pdl_capable(const void* kernel, int device, bool& capable) {
  const bool off = !launch_switches().pdl;
  int major = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr{};
  if (major >= 9 && !off) {
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err != cudaSuccess) return err;
  }
  capable = major >= 9 && !off && attr.ptxVersion >= 90;
  return cudaSuccess;
}

// Kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the kernel
// before it in the stream where pdl_capable (decided once per device and kernel). Kernel must
// keep the contract above: pdl_wait() before touching anything an earlier launch writes.
template <auto Kernel, typename... Args>
cudaError_t launch_chained(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           Args... args) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int8_t>, kMaxDevices> cache{};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int8_t known = cache[size_t(device)].load(std::memory_order_acquire);
  if (known == 0) {
    bool capable = false;
    err = pdl_capable(reinterpret_cast<const void*>(Kernel), device, capable);
    if (err != cudaSuccess) return err;
    known = capable ? 2 : 1;
    cache[size_t(device)].store(known, std::memory_order_release);
  }
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &dependent;
  cfg.numAttrs = known == 2 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, Kernel, args...);
}

}  // namespace burst::kernels
