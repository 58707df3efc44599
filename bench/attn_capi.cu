// libburst_attn.so: our attention kernels behind a C ABI, so a Python process that also holds
// torch can time them launch by launch against torch SDPA's FlashAttention-2 and cuDNN
// (bench/gpu/bench_interleaved.py, ctypes). Timing ours and a baseline in two processes, one
// after the other, left an H100 at its power cap moving a row 10-20 % between them
// (docs/benchmarks.md); alternating single launches in one process puts both under the same
// clocks. A benchmark aid, not an API of the product: the engine calls kernels/ directly.
//
// Every tensor is a device pointer laid out as AttnParams says (kernels/attention.h), with the
// strides given in elements; dtype 0 = bf16, 1 = fp16, o written in the input dtype; 2 = bf16,
// 3 = fp16 with o in fp32 (what the ring's steps write: AttnParams::o_dtype); stream
// is a cudaStream_t (torch.cuda.current_stream().cuda_stream). The return value is a
// cudaError_t (0 = launched); a parameter outside the kernels' contract gives 1
// (cudaErrorInvalidValue) and burst_attn_last_error() says why.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "../kernels/cuda/attention_common.cuh"  // the mma.sync / ldmatrix wrappers
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"

namespace {

using burst::kernels::AttnKernel;
using burst::kernels::AttnParams;
using burst::kernels::DType;
using burst::kernels::MaskKind;

thread_local std::string g_error;

struct Strides {
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head, lse_head;
};

bool make_params(AttnParams& p, const void* q, const void* k, const void* v, void* o,
                 float* lse, int n_q, int n_kv, int heads, int kv_heads, int head_dim,
                 int causal, int dtype, const Strides& s) {
  if (dtype < 0 || dtype > 3) {
    g_error = "dtype must be 0 (bf16), 1 (fp16), or 2, 3 (the same with an fp32 o)";
    return false;
  }
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.n_q = n_q;
  p.n_kv = n_kv;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  if (causal < 0 || causal > 2) {
    g_error = "causal must be 0 (none), 1 (from position 0) or 2 (the queries the last n_q keys)";
    return false;
  }
  p.mask = causal ? MaskKind::kCausal : MaskKind::kNone;
  if (causal == 2) p.q_start = int64_t{n_kv} - n_q;  // a chunk of prefill after a prefix
  p.scale = head_dim > 0 ? 1.f / std::sqrt(static_cast<float>(head_dim)) : 0.f;
  p.dtype = dtype % 2 == 0 ? DType::kBF16 : DType::kF16;
  if (dtype >= 2) p.o_dtype = DType::kF32;
  p.q_row_stride = s.q_row;
  p.q_head_stride = s.q_head;
  p.k_row_stride = s.k_row;
  p.k_head_stride = s.k_head;
  p.v_row_stride = s.v_row;
  p.v_head_stride = s.v_head;
  p.o_row_stride = s.o_row;
  p.o_head_stride = s.o_head;
  p.lse_head_stride = s.lse_head;
  g_error = burst::kernels::validate(p);
  return g_error.empty();
}

// The tensor-core ceiling the mma.sync (sm_80) kernel is judged against: every warp issues
// m16n8k16 bf16 MMAs with fp32 accumulators and nothing else, kPeakAcc independent accumulators
// so that no MMA waits on the one before. ldsm = 0: all operands in registers; ldsm = 1: each
// k16 step's B fragments come from shared memory by one ldmatrix.x4 that feeds 4 MMAs (2 m16
// atoms x 2 n8 atoms), the attention kernel's Q.K^T with Q in registers. Inputs are non-zero
// bf16 bit patterns from the thread index; the sums go to sink so nothing is dead code.
constexpr int kPeakAcc = 8;
constexpr int kPeakMmasPerIter = 16;

__global__ void mma_peak_kernel(float* sink, int iters, int ldsm) {
  // 8 k16 steps of four 8 x 8 bf16 matrices, each row 16 contiguous bytes: lane l's ldmatrix
  // row address is l * 16 bytes, so the 8 rows a phase reads hit 32 different banks.
  __shared__ alignas(16) uint16_t tile[8][32 * 8];
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < 8 * 32 * 8; i += blockDim.x) {
    (&tile[0][0])[i] = static_cast<uint16_t>(0x3f80 + (i * 37 & 0x7f));  // bf16 in [1, 2)
  }
  __syncthreads();
  uint32_t a[2][4], b[4];
  for (int r = 0; r < 4; ++r) {
    a[0][r] = 0x3f803f80u + (threadIdx.x + r) * 0x00010001u;
    a[1][r] = a[0][r] ^ 0x00100010u;
    b[r] = 0x3f813f81u + lane * 0x00020002u;
  }
  float acc[kPeakAcc][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int step = 0; step < kPeakMmasPerIter / 4; ++step) {
      if (ldsm) {
        const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(
            &tile[(it * 4 + step) & 7][lane * 8]));
        burst::kernels::detail::ldmatrix_x4(b, addr);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float(&c)[4] = acc[(step * 4 + j) % kPeakAcc];
        burst::kernels::detail::mma_16816<__nv_bfloat16>(c, a[j >> 1], b[(j & 1) * 2],
                                                          b[(j & 1) * 2 + 1]);
      }
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kPeakAcc; ++j) sum += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  if (sum == 0.f) sink[threadIdx.x] = sum;  // never true for these inputs; keeps the MMAs live
}

// FP8 attention (kernel 4: with the Hadamard rotation, 5: without, 6: with, and ping-pong),
// timed whole: the
// quantization of q, k and v into the workspace and the e4m3 kernel. The workspace grows on
// demand (cudaMalloc, outside the timed launches after the warm-up).
int fp8_attention(const AttnParams& p, bool hadamard, bool pingpong, int rows,
                  cudaStream_t stream) {
  static void* ws = nullptr;
  static size_t ws_bytes = 0;
  const size_t need = burst::kernels::attention_fp8_workspace_bytes(p);
  if (need > ws_bytes) {
    if (ws != nullptr) cudaFree(ws);
    ws = nullptr;
    ws_bytes = 0;
    cudaError_t err = cudaMalloc(&ws, need);
    if (err != cudaSuccess) {
      g_error = cudaGetErrorString(err);
      return err;
    }
    ws_bytes = need;
  }
  burst::kernels::Fp8AttnOptions options;
  options.hadamard = hadamard;
  options.pingpong = pingpong;
  options.rows = rows;
  const cudaError_t err = burst::kernels::attention_fp8_cuda(p, ws, ws_bytes, stream, options);
  if (err != cudaSuccess) g_error = cudaGetErrorString(err);
  return err;
}


}  // namespace

extern "C" {

// Launches mma_peak_kernel on ctas_per_sm x (this device's SMs) CTAs of `warps` warps, each
// warp as many rounds of 16 MMAs as bring the launch nearest `target_flops` (at least one);
// *flops gets the launch's FLOPs (2 x 16 x 8 x 16 an MMA).
int burst_mma_peak(int ldsm, int ctas_per_sm, int warps, double target_flops, double* flops,
                   void* stream) {
  if (ctas_per_sm < 1 || warps < 1 || warps > 32 || !(target_flops > 0) || !flops) {
    g_error = "ctas_per_sm >= 1, warps 1-32, target_flops > 0, flops non-null";
    return cudaErrorInvalidValue;
  }
  int sms = 0;
  cudaError_t err = burst::kernels::detail::multiprocessors(sms);
  if (err != cudaSuccess) {
    g_error = cudaGetErrorString(err);
    return err;
  }
  static float* sink = nullptr;  // on the device of the first call (the benchmark uses one)
  if (!sink && (err = cudaMalloc(&sink, 32 * 32 * sizeof(float))) != cudaSuccess) {
    g_error = cudaGetErrorString(err);
    return err;
  }
  const int ctas = ctas_per_sm * sms;
  const double per_iter = 2.0 * 16 * 8 * 16 * kPeakMmasPerIter * warps * ctas;
  const int iters = static_cast<int>(std::clamp(std::round(target_flops / per_iter), 1.0, 1e9));
  mma_peak_kernel<<<ctas, warps * 32, 0, static_cast<cudaStream_t>(stream)>>>(sink, iters,
                                                                             ldsm ? 1 : 0);
  *flops = per_iter * iters;
  err = cudaGetLastError();
  if (err != cudaSuccess) g_error = cudaGetErrorString(err);
  return err;
}

const char* burst_attn_last_error() { return g_error.c_str(); }

// kernel: 0 what the engine runs (kAuto), 1 the mma.sync kernel (an A100's), 2 Hopper with
// 128-row tiles, 3 Hopper with 192-row tiles (head_dim 64); FP8 (attention_fp8_cuda): 4, 5
// without the Hadamard rotation, 6 with ping-pong, 7 with 128-row tiles, 8 with 192 (head_dim
// 64). causal: 0 no mask, 1 queries and
// keys both from position 0, 2 the queries the last n_q positions of the keys (a chunk of
// prefill after a prefix).
int burst_attention(const void* q, const void* k, const void* v, void* o, float* lse, int n_q,
                    int n_kv, int heads, int kv_heads, int head_dim, int causal, int dtype,
                    const int64_t* strides9, int kernel, void* stream) {
  if (!strides9 || kernel < 0 || kernel > 8) {
    g_error = "strides9 must hold 9 strides; kernel 0-8";
    return cudaErrorInvalidValue;
  }
  Strides s;
  std::memcpy(&s, strides9, sizeof s);
  AttnParams p;
  if (!make_params(p, q, k, v, o, lse, n_q, n_kv, heads, kv_heads, head_dim, causal, dtype, s)) {
    return cudaErrorInvalidValue;
  }
  if (kernel >= 4) {
    const int rows = kernel == 7 ? 128 : kernel == 8 ? 192 : 0;
    return fp8_attention(p, kernel != 5, kernel == 6, rows, static_cast<cudaStream_t>(stream));
  }
  constexpr AttnKernel kKernels[] = {AttnKernel::kAuto, AttnKernel::kSm80,
                                     AttnKernel::kSm90Rows128, AttnKernel::kSm90Rows192};
  const cudaError_t err =
      burst::kernels::attention_cuda(p, static_cast<cudaStream_t>(stream), kKernels[kernel]);
  if (err != cudaSuccess) g_error = cudaGetErrorString(err);
  return err;
}

// The decode kernel's workspace bytes for these parameters on the current device (0: refused).
size_t burst_attention_decode_workspace(int n_q, int n_kv, int heads, int kv_heads, int head_dim,
                                        int dtype, const int64_t* strides9) {
  if (!strides9) return 0;
  Strides s;
  std::memcpy(&s, strides9, sizeof s);
  AttnParams p;
  // Placeholder pointers: the size depends on the shape only.
  static float dummy[4];
  if (!make_params(p, dummy, dummy, dummy, dummy, dummy, n_q, n_kv, heads, kv_heads, head_dim,
                   0, dtype, s)) {
    return 0;
  }
  return burst::kernels::attention_decode_workspace_bytes(p);
}

int burst_attention_decode(const void* q, const void* k, const void* v, void* o, float* lse,
                           int n_q, int n_kv, int heads, int kv_heads, int head_dim, int dtype,
                           const int64_t* strides9, void* workspace, size_t workspace_bytes,
                           void* stream) {
  if (!strides9) {
    g_error = "strides9 must hold 9 strides";
    return cudaErrorInvalidValue;
  }
  Strides s;
  std::memcpy(&s, strides9, sizeof s);
  AttnParams p;
  if (!make_params(p, q, k, v, o, lse, n_q, n_kv, heads, kv_heads, head_dim, 0, dtype, s)) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t err = burst::kernels::attention_decode_cuda(
      p, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) g_error = cudaGetErrorString(err);
  return err;
}

}  // extern "C"
