// burst-bench-kernels: times the CUDA attention kernels (kernels/attention_cuda.h) at LLaMA-2-7B
// attention shapes and prints a table; --out PATH also writes the numbers as JSON (read by
// bench/gpu/bench_kernels.py, which times torch SDPA at the same shapes).
//
// Prefill: 4096 / head_dim heads (32 x 128, the 7B's; 64 x 64 with --head-dims 64), bf16,
// q = kv = S tokens, full and causal, TFLOP/s by the FlashAttention convention
// (4 * S * S * head_dim * heads, halved for causal). On Hopper both kernels are timed: the one
// the engine runs ("attention") and the mma.sync one ("attention_sm80", what an A100 runs).
// Decode: one token, 32 query / 8 kv heads, against S keys, GB/s of K and V read, for one
// sequence and for a batched step of 16 paged sequences; beside it the device-to-device copy
// bandwidth of this GPU (the floor decode is judged against). GEMV: the 7B's decode GEMMs at
// m = 1 and 4 rows by gemv_cuda and by cuBLAS, GB/s of weights read; and 32 layers' chain of
// them (bench_layers).
// Timing: CUDA events around each call, one warm-up call, then the median of several calls
// (at least 3, more while they take under ~2 s in total). Each timed call is queued behind a
// ~1 ms spin kernel, so the host's launch work (a decode call plans and launches two kernels)
// never shows as GPU time: without it a 128K decode read 0.222 ms here and 0.186 ms queued
// (docs/benchmarks.md). Inputs are random, never zero.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cublas_v2.h>

#include "kernels/attention_cuda.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops_cuda.h"

namespace {

using burst::kernels::AttnParams;
using burst::kernels::DType;
using burst::kernels::MaskKind;

#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,           \
                   cudaGetErrorString(err_));                                             \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

// Uniform magnitude in [0.05, 1] with a random sign, from a counter hash: never zero.
// Keeps the GPU busy for `cycles` SM clocks while the host queues what follows.
__global__ void spin(int64_t cycles) {
  const int64_t t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float mag = 0.05f + 0.95f * static_cast<float>(h >> 8) * (1.f / 16777216.f);
    x[i] = __float2bfloat16_rn((h & 1u) ? -mag : mag);
  }
}

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void fill(void* p, int64_t n, uint32_t seed) {
  fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  CUDA_CHECK(cudaGetLastError());
}

// Median milliseconds of fn() over several calls, after one warm-up call.
template <typename Fn>
double median_ms(Fn fn, int* runs_out) {
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  fn();  // warm-up: module load, smem attribute, clocks
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> times;
  double total = 0;
  while (times.size() < 3 || (times.size() < 20 && total < 2000.0)) {
    spin<<<1, 1>>>(int64_t{2} << 20);  // ~1 ms at 2 GHz
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(start));
    fn();
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
    total += ms;
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  *runs_out = static_cast<int>(times.size());
  return times[times.size() / 2];
}

struct Row {
  std::string op, mask;
  int64_t s;
  int heads, kv_heads, head_dim, runs;
  double ms, tflops, gbps;
};

AttnParams base_params(int64_t n_q, int64_t n_kv, int heads, int kv_heads, int d, MaskKind m) {
  AttnParams p;
  p.n_q = static_cast<int32_t>(n_q);
  p.n_kv = static_cast<int32_t>(n_kv);
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = d;
  p.mask = m;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  p.dtype = DType::kBF16;
  burst::kernels::set_packed_strides(p);
  return p;
}

// kernel kAuto is reported as "attention" (what the engine runs), kSm80 as "attention_sm80",
// the wgmma kernel with its query tile forced as "attention_r128" / "attention_r192".
Row bench_prefill(int64_t s, int d, MaskKind mask, burst::kernels::AttnKernel kernel) {
  const int heads = 4096 / d;
  const int64_t n = s * heads * d;
  Buffer q(n * 2), k(n * 2), v(n * 2), o(n * 2), lse(heads * s * 4);
  fill(q.ptr, n, 1);
  fill(k.ptr, n, 2);
  fill(v.ptr, n, 3);
  AttnParams p = base_params(s, s, heads, heads, d, mask);
  p.q = q.ptr;
  p.k = k.ptr;
  p.v = v.ptr;
  p.o = o.ptr;
  p.lse = static_cast<float*>(lse.ptr);
  int runs = 0;
  const double ms =
      median_ms([&] { CUDA_CHECK(burst::kernels::attention_cuda(p, nullptr, kernel)); }, &runs);
  double flops = 4.0 * double(s) * double(s) * d * heads;
  if (mask == MaskKind::kCausal) flops /= 2;
  using burst::kernels::AttnKernel;
  const char* op = kernel == AttnKernel::kSm80          ? "attention_sm80"
                   : kernel == AttnKernel::kSm90Rows128 ? "attention_r128"
                   : kernel == AttnKernel::kSm90Rows192 ? "attention_r192"
                                                        : "attention";
  return {op, mask == MaskKind::kCausal ? "causal" : "full",
          s,  heads, heads, d, runs, ms, flops / (ms * 1e-3) / 1e12, 0.0};
}

// Decode of `seqs` sequences of s keys each, one token each, 32 query / kv_heads kv heads x 128
// (8: GQA as LLaMA-3; 32: the LLaMA-2-7B preset, "decode_mha"): seqs == 1 is one sequence in
// contiguous K/V; seqs > 1 is the server's batched step ("..._batched16"): every sequence's
// K/V in shuffled 256-row pages of one pool, one launch with per-row K/V. fp8: K and V are the
// FP8 KV cache's rows (kernels/kv_fp8.h; "..._fp8"), quantized from the same random values.
// GB/s counts the K and V bytes read (FP8: each head's values and its scale).
Row bench_decode(int64_t s, int seqs, int kv_heads, bool fp8 = false) {
  constexpr int kHeads = 32, kD = 128, kPage = 256;
  const int64_t row_elems = int64_t{kv_heads} * kD;
  const int64_t pages_per_seq = (s + kPage - 1) / kPage;
  const int64_t rows = seqs == 1 ? s : pages_per_seq * seqs * kPage;
  const int64_t row_bytes =
      fp8 ? burst::kernels::kv_fp8_row_bytes(kv_heads, kD) : row_elems * 2;
  Buffer q(int64_t{seqs} * kHeads * kD * 2), k(rows * row_bytes), v(rows * row_bytes),
      o(int64_t{seqs} * kHeads * kD * 2), lse(int64_t{seqs} * kHeads * 4);
  fill(q.ptr, int64_t{seqs} * kHeads * kD, 4);
  if (fp8) {
    Buffer values(rows * row_elems * 2);
    for (auto [dst, seed] : {std::pair<void*, uint32_t>{k.ptr, 5}, {v.ptr, 6}}) {
      fill(values.ptr, rows * row_elems, seed);
      CUDA_CHECK(burst::kernels::quantize_kv_cuda(values.ptr, DType::kBF16, rows, kv_heads, kD,
                                                  nullptr, dst, nullptr));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
  } else {
    fill(k.ptr, rows * row_elems, 5);
    fill(v.ptr, rows * row_elems, 6);
  }
  AttnParams p = base_params(seqs, s, kHeads, kv_heads, kD, MaskKind::kNone);
  p.q = q.ptr;
  p.k = k.ptr;
  p.v = v.ptr;
  if (fp8) {
    p.kv_fp8 = true;
    p.k_row_stride = p.v_row_stride = row_bytes;
  }
  p.o = o.ptr;
  p.lse = static_cast<float*>(lse.ptr);
  std::unique_ptr<Buffer> meta;
  if (seqs > 1) {
    // Page tables (a shuffled pool), then row_kv_len[seqs], then row_page_offset[seqs].
    std::vector<int32_t> table(static_cast<size_t>(pages_per_seq * seqs));
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    uint32_t h = 12345;
    for (size_t i = table.size(); i > 1; --i) {
      h = h * 1664525u + 1013904223u;
      std::swap(table[i - 1], table[h % i]);
    }
    const size_t lens_at = table.size();
    for (int b = 0; b < seqs; ++b) table.push_back(static_cast<int32_t>(s));
    for (int b = 0; b < seqs; ++b) table.push_back(static_cast<int32_t>(b * pages_per_seq));
    meta = std::make_unique<Buffer>(table.size() * 4);
    CUDA_CHECK(cudaMemcpy(meta->ptr, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    const auto* m = static_cast<const int32_t*>(meta->ptr);
    p.kv_pages = m;
    p.page_size = kPage;
    p.row_kv_len = m + lens_at;
    p.row_page_offset = m + lens_at + seqs;
  }
  const size_t ws_bytes = burst::kernels::attention_decode_workspace_bytes(p);
  if (ws_bytes == 0) {
    std::fprintf(stderr, "decode: no workspace size for S=%lld x %d\n",
                 static_cast<long long>(s), seqs);
    std::exit(1);
  }
  Buffer ws(ws_bytes);
  int runs = 0;
  const double ms = median_ms(
      [&] {
        CUDA_CHECK(burst::kernels::attention_decode_cuda(p, ws.ptr, ws_bytes, nullptr));
      },
      &runs);
  const double bytes =  // K and V
      2.0 * double(s) * seqs * (fp8 ? kv_heads * (kD + 4.0) : row_elems * 2.0);
  const std::string op = kv_heads == kHeads ? "decode_mha" : "decode";
  const std::string kind = fp8 ? "_fp8" : "";
  return {(seqs == 1 ? op : op + "_batched" + std::to_string(seqs)) + kind, "full", s, kHeads,
          kv_heads, kD, runs, ms, 4.0 * s * kD * kHeads * seqs / (ms * 1e-3) / 1e12,
          bytes / (ms * 1e-3) / 1e9};
}

// Device-to-device copy of 2 GiB: the bandwidth a memory-bound kernel can hope for, measured
// here (GB/s counts the bytes read plus the bytes written).
Row bench_copy() {
  const int64_t bytes = int64_t{1} << 31;
  Buffer a(bytes), b(bytes);
  fill(a.ptr, bytes / 2, 7);
  int runs = 0;
  const double ms = median_ms(
      [&] { CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); },
      &runs);
  return {"copy", "-", bytes, 0, 0, 0, runs, ms, 0.0, 2.0 * bytes / (ms * 1e-3) / 1e9};
}

// A decode step's GEMM, out[m, n] = x[m, k] . w[n, k]^T in bf16, by gemv_cuda (what the CUDA
// backend runs at m <= kGemvMaxRows) and by cuBLAS (cublasGemmEx, fp32 compute, as the backend
// calls it for larger m): GB/s of the weights read.
Row bench_gemv(int64_t m, int64_t n, int64_t k, bool cublas) {
  Buffer x(m * k * 2), w(n * k * 2), out(m * n * 2);
  fill(x.ptr, m * k, 8);
  fill(w.ptr, n * k, 9);
  cublasHandle_t handle = nullptr;
  if (cublas && cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    std::exit(1);
  }
  const float alpha = 1.f, beta = 0.f;
  int runs = 0;
  const double ms = median_ms(
      [&] {
        if (!cublas) {
          CUDA_CHECK(burst::kernels::gemv_cuda(x.ptr, w.ptr, out.ptr, m, n, k, DType::kBF16,
                                               false, nullptr));
          return;
        }
        const cublasStatus_t st = cublasGemmEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
            static_cast<int>(k), &alpha, w.ptr, CUDA_R_16BF, static_cast<int>(k), x.ptr,
            CUDA_R_16BF, static_cast<int>(k), &beta, out.ptr, CUDA_R_16BF, static_cast<int>(n),
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "%s:%d: cublasGemmEx failed: %d\n", __FILE__, __LINE__,
                       static_cast<int>(st));
          std::exit(1);
        }
      },
      &runs);
  if (handle) cublasDestroy(handle);
  const std::string shape = std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  return {cublas ? "gemm_cublas" : "gemv", shape, n * k, 0, 0, 0, runs, ms,
          2.0 * m * n * k / (ms * 1e-3) / 1e12, double(n) * k * 2 / (ms * 1e-3) / 1e9};
}

// The GEMV chain of 32 decode layers of the 7B at m = 1 (attention left out): RMSNorm, q/k/v,
// o (accumulated into x), RMSNorm, gate/up + SwiGLU, down (accumulated), queued back to back as
// the backend queues them, timed as one: "layers_fused" with the one-launch q/k/v and gate/up
// products, "layers_split" with one launch per product and silu_mul apart, "layers_graph" the
// fused chain captured once into a CUDA graph and replayed (one cudaGraphLaunch a pass: what a
// graph of the decode step could save on the device beside the chained stream launches),
// "layers_nonorm" the fused chain without its two RMSNorm launches (what folding the norm into
// its neighbours could reach; the products then read a stale h, so only its time means
// anything). GB/s = the weights read (one layer's set, reused: 386 MB a pass, far beyond L2).
// Kernels are chained (PDL) on sm_90+ unless BURST_PDL=0 (in the graph too: captured as
// programmatic edges).
// With m > 1 rows (a step decoding m sequences) the row is suffixed "_m<m>", and "layers_cublas"
// runs every product by cublasGemmEx (fp32 compute, as the backend calls it beyond
// kGemvMaxRows) with silu_mul apart: what the step would run with the GEMV limited to fewer rows.
enum class Chain { kSplit, kFused, kGraph, kNoNorm, kCublas };

// out [m, n] (+)= in [m, k] . w [n, k]^T in bf16 on stream st: by gemv_cuda, or with a cuBLAS
// handle by cublasGemmEx (fp32 compute).
void product(cublasHandle_t handle, const void* in, const void* w, void* out, int64_t m,
             int64_t n, int64_t k, bool acc, cudaStream_t st) {
  if (!handle) {
    CUDA_CHECK(burst::kernels::gemv_cuda(in, w, out, m, n, k, DType::kBF16, acc, st));
    return;
  }
  const float alpha = 1.f, beta = acc ? 1.f : 0.f;
  const cublasStatus_t cs =
      cublasSetStream(handle, st) != CUBLAS_STATUS_SUCCESS
          ? CUBLAS_STATUS_INTERNAL_ERROR
          : cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                         static_cast<int>(m), static_cast<int>(k), &alpha, w, CUDA_R_16BF,
                         static_cast<int>(k), in, CUDA_R_16BF, static_cast<int>(k), &beta, out,
                         CUDA_R_16BF, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s:%d: cublas failed: %d\n", __FILE__, __LINE__, static_cast<int>(cs));
    std::exit(1);
  }
}

// What enqueue(stream) queues, captured once into a CUDA graph and replayed: the median ms of
// a replay. Captured on a stream of its own (the legacy stream cannot be captured), replayed in
// the legacy stream the other rows and the timing events use.
template <typename Enqueue>
double graph_median_ms(Enqueue enqueue, int* runs) {
  cudaStream_t cs = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal));
  enqueue(cs);
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(cs, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = median_ms([&] { CUDA_CHECK(cudaGraphLaunch(exec, nullptr)); }, runs);
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(cs));
  return ms;
}

Row bench_layers(Chain chain, int64_t m = 1) {
  using burst::kernels::GemvOut;
  const int64_t d = 4096, f = 11008, layers = 32;
  Buffer x(m * d * 2), h(m * d * 2), q(m * d * 2), kk(m * d * 2), vv(m * d * 2);
  Buffer gate(m * f * 2), up(m * f * 2);
  Buffer norm(d * 2), wq(d * d * 2), wk(d * d * 2), wv(d * d * 2), wo(d * d * 2);
  Buffer wg(f * d * 2), wu(f * d * 2), wd(d * f * 2);
  fill(x.ptr, m * d, 10);
  fill(norm.ptr, d, 11);
  for (auto [b, n] : {std::pair<Buffer*, int64_t>{&wq, d * d}, {&wk, d * d}, {&wv, d * d},
                      {&wo, d * d}, {&wg, f * d}, {&wu, f * d}, {&wd, d * f}}) {
    fill(b->ptr, n, static_cast<uint32_t>(n % 97));
  }
  const DType t = DType::kBF16;
  using namespace burst::kernels;
  const bool cublas = chain == Chain::kCublas;
  const bool fused = chain != Chain::kSplit && !cublas, norms = chain != Chain::kNoNorm;
  cublasHandle_t handle = nullptr;
  if (cublas && cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    std::exit(1);
  }
  // out [m, n] (+)= in [m, k] . w [n, k]^T: by gemv_cuda, or by cuBLAS in the cuBLAS chain
  auto prod = [&](const void* in, const void* w, void* out, int64_t n, int64_t k, bool acc,
                  cudaStream_t st) { product(handle, in, w, out, m, n, k, acc, st); };
  auto enqueue = [&](cudaStream_t st) {
    for (int64_t l = 0; l < layers; ++l) {
      if (norms) CUDA_CHECK(rms_norm_cuda(x.ptr, norm.ptr, h.ptr, m, d, 1e-5f, t, st));
      if (fused) {
        const GemvOut qkv[3] = {{wq.ptr, q.ptr, d}, {wk.ptr, kk.ptr, d}, {wv.ptr, vv.ptr, d}};
        CUDA_CHECK(gemv_multi_cuda(h.ptr, qkv, 3, m, d, t, st));
      } else {
        prod(h.ptr, wq.ptr, q.ptr, d, d, false, st);
        prod(h.ptr, wk.ptr, kk.ptr, d, d, false, st);
        prod(h.ptr, wv.ptr, vv.ptr, d, d, false, st);
      }
      prod(q.ptr, wo.ptr, x.ptr, d, d, true, st);
      if (norms) CUDA_CHECK(rms_norm_cuda(x.ptr, norm.ptr, h.ptr, m, d, 1e-5f, t, st));
      if (fused) {
        CUDA_CHECK(gemv_swiglu_cuda(h.ptr, wg.ptr, wu.ptr, gate.ptr, m, f, d, t, st));
      } else {
        prod(h.ptr, wg.ptr, gate.ptr, f, d, false, st);
        prod(h.ptr, wu.ptr, up.ptr, f, d, false, st);
        CUDA_CHECK(silu_mul_cuda(gate.ptr, up.ptr, gate.ptr, m * f, t, st));
      }
      prod(gate.ptr, wd.ptr, x.ptr, d, f, true, st);
    }
  };
  int runs = 0;
  const double ms = chain == Chain::kGraph ? graph_median_ms(enqueue, &runs)
                                           : median_ms([&] { enqueue(nullptr); }, &runs);
  if (handle) cublasDestroy(handle);
  const double bytes = double(layers) * (4 * d * d + 3 * f * d) * 2;
  std::string op = chain == Chain::kSplit    ? "layers_split"
                   : chain == Chain::kFused  ? "layers_fused"
                   : chain == Chain::kGraph  ? "layers_graph"
                   : chain == Chain::kNoNorm ? "layers_nonorm"
                                             : "layers_cublas";
  if (m > 1) op += "_m" + std::to_string(m);
  return {op, "-", layers, 0, 0, 0, runs, ms, 0.0, bytes / (ms * 1e-3) / 1e9};
}

std::vector<int64_t> parse_sizes(const char* arg) {
  std::vector<int64_t> out;
  for (const char* c = arg; *c;) {
    char* end = nullptr;
    out.push_back(std::strtoll(c, &end, 10));
    c = (*end == ',') ? end + 1 : end;
    if (end == c && *c) break;
  }
  return out;
}

// What to time: prefill sizes and head dims, decode sizes; where to write the JSON.
struct Options {
  std::string out_path;
  std::vector<int64_t> sizes = {4096, 16384, 65536};
  std::vector<int64_t> decode_sizes = {8192, 32768, 65536, 131072};
  std::vector<int64_t> head_dims = {128};
  bool decode_attention_only = false;  // the copy and decode attention rows, nothing else
};

// 0, or the exit status of a usage error (said on stderr).
int parse_options(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      o->out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) {
      o->sizes = parse_sizes(argv[++i]);
    } else if (!std::strcmp(argv[i], "--decode-sizes") && i + 1 < argc) {
      o->decode_sizes = parse_sizes(argv[++i]);
    } else if (!std::strcmp(argv[i], "--decode-attention-only")) {
      o->decode_attention_only = true;
    } else if (!std::strcmp(argv[i], "--head-dims") && i + 1 < argc) {
      o->head_dims = parse_sizes(argv[++i]);
      for (int64_t d : o->head_dims) {
        if (d != 64 && d != 128) {
          std::fprintf(stderr, "--head-dims: 64 or 128, not %lld\n", static_cast<long long>(d));
          return 2;
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--out results.json] [--sizes 4096,16384,65536] "
                   "[--head-dims 128,64] [--decode-sizes 8192,32768,65536,131072] "
                   "[--decode-attention-only]\n",
                   argv[0]);
      return 2;
    }
  }
  return 0;
}

// The prefill rows: every head dim and size, full and causal, by the engine's kernel and (on
// Hopper) by the mma.sync one beside it.
void bench_prefills(const Options& o, std::vector<Row>* rows) {
  for (int64_t d64 : o.head_dims) {
    const int d = static_cast<int>(d64);
    for (int64_t s : o.sizes) {
      for (MaskKind m : {MaskKind::kNone, MaskKind::kCausal}) {
        rows->push_back(bench_prefill(s, d, m, burst::kernels::AttnKernel::kAuto));
        // On Hopper kAuto is the wgmma kernel: time the mma.sync one beside it.
        AttnParams probe = base_params(s, s, 4096 / d, 4096 / d, d, m);
        if (burst::kernels::attention_sm90_supported(probe)) {
          rows->push_back(bench_prefill(s, d, m, burst::kernels::AttnKernel::kSm80));
          // At head_dim 64 the launch picks 128- or 192-row query tiles: time both.
          if (d == 64) {
            rows->push_back(bench_prefill(s, d, m, burst::kernels::AttnKernel::kSm90Rows128));
            rows->push_back(bench_prefill(s, d, m, burst::kernels::AttnKernel::kSm90Rows192));
          }
        }
      }
    }
  }
}

// The FP8 KV cache's quantizer on a 7B layer's K at s tokens (32 heads x 128, bf16) into
// shuffled pool rows, as the prefill writes it. aligned: the 16-values-a-lane kernel; not:
// the same values 8 bytes past a 16-byte boundary, which take the one-warp-an-item kernel.
// GB/s counts the bf16 read and the FP8 rows written.
Row bench_kv_quantize(int64_t s, bool aligned) {
  constexpr int kKvHeads = 32, kD = 128;
  const int64_t elems = s * kKvHeads * kD;
  const int64_t row_bytes = burst::kernels::kv_fp8_row_bytes(kKvHeads, kD);
  Buffer values(elems * 2 + 16), pool(s * row_bytes), table(s * 4);
  fill(values.ptr, elems + 8, 7);
  std::vector<int32_t> rows(static_cast<size_t>(s));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i);
  uint32_t h = 4321;
  for (size_t i = rows.size(); i > 1; --i) {
    h = h * 1664525u + 1013904223u;
    std::swap(rows[i - 1], rows[h % i]);
  }
  CUDA_CHECK(cudaMemcpy(table.ptr, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
  const void* src = static_cast<const char*>(values.ptr) + (aligned ? 0 : 8);
  int runs = 0;
  const double ms = median_ms(
      [&] {
        CUDA_CHECK(burst::kernels::quantize_kv_cuda(src, DType::kBF16, s, kKvHeads, kD,
                                                    static_cast<const int32_t*>(table.ptr),
                                                    pool.ptr, nullptr));
      },
      &runs);
  const double bytes = double(elems) * 2 + double(s) * double(row_bytes);
  return {aligned ? "kv_quantize" : "kv_quantize_warp", "-", s, kKvHeads, kKvHeads, kD, runs,
          ms, 0.0, bytes / (ms * 1e-3) / 1e9};
}

// Its inverse on the same shape: FP8 rows back to bf16 (what the ring's attention reads of an
// FP8 block).
Row bench_kv_dequantize(int64_t s) {
  constexpr int kKvHeads = 32, kD = 128;
  const int64_t elems = s * kKvHeads * kD;
  const int64_t row_bytes = burst::kernels::kv_fp8_row_bytes(kKvHeads, kD);
  Buffer values(elems * 2), pool(s * row_bytes);
  fill(values.ptr, elems, 8);
  CUDA_CHECK(burst::kernels::quantize_kv_cuda(values.ptr, DType::kBF16, s, kKvHeads, kD, nullptr,
                                              pool.ptr, nullptr));
  int runs = 0;
  const double ms = median_ms(
      [&] {
        CUDA_CHECK(burst::kernels::dequantize_kv_cuda(pool.ptr, s, kKvHeads, kD, values.ptr,
                                                      DType::kBF16, nullptr));
      },
      &runs);
  const double bytes = double(elems) * 2 + double(s) * double(row_bytes);
  return {"kv_dequantize", "-", s, kKvHeads, kKvHeads, kD, runs, ms, 0.0,
          bytes / (ms * 1e-3) / 1e9};
}

// The decode rows: the copy bandwidth, decode attention, the decode GEMMs and layer chains.
void bench_decode_side(const Options& o, std::vector<Row>* rows) {
  rows->push_back(bench_copy());
  for (bool aligned : {true, false}) rows->push_back(bench_kv_quantize(131072, aligned));
  rows->push_back(bench_kv_dequantize(131072));
  // Each shape with 16-bit K/V, then with the FP8 KV cache's rows.
  for (bool fp8 : {false, true}) {
    for (int64_t s : o.decode_sizes) rows->push_back(bench_decode(s, 1, 8, fp8));
    // The 7B preset's shape (no GQA) at the largest size; the server's batched step: 16
    // sequences of 2K and of 8K keys in one launch.
    if (!o.decode_sizes.empty()) rows->push_back(bench_decode(o.decode_sizes.back(), 1, 32, fp8));
    for (int64_t s : {int64_t{2048}, int64_t{8192}}) rows->push_back(bench_decode(s, 16, 8, fp8));
  }
  if (o.decode_attention_only) return;
  // The 7B's decode GEMMs (q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down 4096 x 11008).
  // 4096 x 4096 (32 MB) stays in an H100's or H200's L2 between two timed launches, so its row
  // reads above what the memory gives.
  for (int64_t m : {int64_t{1}, int64_t{4}}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{4096, 4096}, {11008, 4096}, {4096, 11008}}) {
      rows->push_back(bench_gemv(m, n, k, false));
      rows->push_back(bench_gemv(m, n, k, true));
    }
  }
  // One long stream (512 MB of w): the GEMV's steady state, without a short kernel's ramp
  // and tail.
  rows->push_back(bench_gemv(1, 65536, 4096, false));

  rows->push_back(bench_layers(Chain::kFused));
  rows->push_back(bench_layers(Chain::kGraph));
  rows->push_back(bench_layers(Chain::kSplit));
  rows->push_back(bench_layers(Chain::kNoNorm));
  rows->push_back(bench_layers(Chain::kCublas));
  for (int64_t m : {int64_t{2}, int64_t{4}}) {
    rows->push_back(bench_layers(Chain::kFused, m));
    rows->push_back(bench_layers(Chain::kCublas, m));
  }
}

// The table, then each memory-bound row against the copy bandwidth.
void print_rows(const cudaDeviceProp& prop, const std::vector<Row>& rows) {
  std::printf("burst attention kernels on %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  std::printf("%-15s %-7s %8s %6s %4s %10s %9s %8s %5s\n", "op", "mask", "S", "heads", "d",
              "ms", "TFLOP/s", "GB/s", "runs");
  for (const Row& r : rows) {
    std::printf("%-15s %-7s %8lld %3d/%-2d %4d %10.3f %9.1f %8.0f %5d\n", r.op.c_str(),
                r.mask.c_str(), static_cast<long long>(r.s), r.heads, r.kv_heads, r.head_dim,
                r.ms, r.tflops, r.gbps, r.runs);
  }
  double copy_gbps = 0;
  for (const Row& r : rows) {
    if (r.op == "copy") copy_gbps = r.gbps;
  }
  for (const Row& r : rows) {
    if ((r.op.rfind("decode", 0) == 0 || r.op.rfind("gemv", 0) == 0 ||
         r.op.rfind("kv_", 0) == 0 ||
         r.op.rfind("gemm", 0) == 0 || r.op.rfind("layers", 0) == 0) &&
        copy_gbps > 0) {
      std::printf("%s %s S=%lld: %.0f GB/s = %.1f%% of copy (%.0f GB/s)\n", r.op.c_str(),
                  r.mask.c_str(), static_cast<long long>(r.s), r.gbps, 100.0 * r.gbps / copy_gbps,
                  copy_gbps);
    }
  }
}

// The rows as JSON into path; false (said on stderr) when it cannot be written.
bool write_json(const std::string& path, const cudaDeviceProp& prop,
                const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return false;
  }
  std::fprintf(f, "{\"device\": \"%s\", \"results\": [\n", prop.name);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::fprintf(f,
                 "  {\"op\": \"%s\", \"mask\": \"%s\", \"S\": %lld, \"heads\": %d, "
                 "\"kv_heads\": %d, \"head_dim\": %d, \"dtype\": \"bf16\", \"ms\": %.4f, "
                 "\"tflops\": %.2f, \"gbps\": %.1f, \"runs\": %d}%s\n",
                 r.op.c_str(), r.mask.c_str(), static_cast<long long>(r.s), r.heads, r.kv_heads,
                 r.head_dim, r.ms, r.tflops, r.gbps, r.runs, i + 1 < rows.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // BURST_PDL=0 launches every kernel plainly (the switch is read here, once).
  if (const char* pdl = std::getenv("BURST_PDL"); pdl != nullptr && pdl[0] == '0') {
    burst::kernels::set_launch_switches({false});
  }
  Options o;
  if (const int usage = parse_options(argc, argv, &o)) return usage;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));

  std::vector<Row> rows;
  if (!o.decode_attention_only) bench_prefills(o, &rows);
  bench_decode_side(o, &rows);
  print_rows(prop, rows);
  if (!o.out_path.empty() && !write_json(o.out_path, prop, rows)) return 1;
  return 0;
}
