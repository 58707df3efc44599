// GPU token sampling (contract in kernels/sampling_cuda.h), the twin of the host sampler
// burst::engine::sample_with_uniform. Greedy is one block-wide argmax per row. Sampling is
// three steps: (1) a flat kernel writes, per logit, an order-preserving uint32 key of
// logit / T and its id; (2) CUB's segmented radix sort (stable, so equal keys keep ascending
// ids) orders each row by (key descending, id ascending), the host's order; (3) one block per
// row walks the sorted row in chunks with a block scan of the masses exp(s - s_max) in exact
// 128-bit fixed point (the host's representation), after min_p (a block-wide count of the
// leading ids with exp(s - s_max) >= min_p) cut the kept prefix: once for the total, once
// (top_p < 1) for
// the nucleus cut, once for the first cumulative mass above u * kept mass. Exact prefix sums
// make the walk order irrelevant; only a 1-ulp difference between the host's and CUDA's fp64
// exp can move a choice, and only when u * mass falls within that ulp of a prefix. With
// per-row settings (SampleParams::row_params) steps 1 and 3 read each row's own; greedy rows
// then go through the sort too (one call for a whole mixed batch), their keys unscaled.
#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda_dispatch.cuh"
#include "kernels/sampling_cuda.h"
#include "kernels/sampling_mass.h"

namespace burst::kernels {
namespace {

// Order-preserving map float -> uint32 (unsigned order of keys = numeric order of floats).
// -0 maps to the key of +0: the host compares them equal, so they must tie and go by id.
__device__ __forceinline__ uint32_t order_key(float s) {
  uint32_t b = __float_as_uint(s);
  if ((b << 1) == 0u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float from_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// ---------------------------------------------------------------------------------------------
// Greedy: one block per row.

constexpr int kArgmaxThreads = 256;
static_assert(kArgmaxThreads % 32 == 0 && kArgmaxThreads <= 1024, "whole warps per block");

struct Best {
  float v;
  int32_t id;  // -1: this thread saw no element
};

// The better of two candidates: the larger value, on equal values the lower id (the host's
// strict `>` scan keeps the first maximum).
__device__ __forceinline__ Best better(Best a, Best b) {
  if (b.id < 0) return a;
  if (a.id < 0) return b;
  if (b.v > a.v || (b.v == a.v && b.id < a.id)) return b;
  return a;
}

template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const T* logits, int64_t vocab, int64_t row_stride, int32_t* out) {
  __shared__ Best warp_best[kArgmaxThreads / 32];
  const T* row = logits + int64_t{blockIdx.x} * row_stride;
  // Each thread scans ids in ascending order and replaces only on strictly greater, so its
  // candidate is already the lowest id of its maximum.
  Best best{0.f, -1};
  for (int64_t c = threadIdx.x; c < vocab; c += kArgmaxThreads) {
    const float v = load_f32(row + c);
    if (best.id < 0 || v > best.v) best = Best{v, static_cast<int32_t>(c)};
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Best o{__shfl_xor_sync(0xffffffffu, best.v, off),
                 __shfl_xor_sync(0xffffffffu, best.id, off)};
    best = better(best, o);
  }
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  // The per-warp winners written above are read by thread 0 below.
  __syncthreads();
  if (threadIdx.x == 0) {
    Best b = warp_best[0];
#pragma unroll
    for (int w = 1; w < kArgmaxThreads / 32; ++w) b = better(b, warp_best[w]);
    out[blockIdx.x] = b.id;
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling step 1: keys of logit / T and ids, plus the segment offsets of the sort.

constexpr int kThreads = kGridStrideThreads;  // grid_for assumes it

// The temperature a row's keys are divided by: its own with per-row settings, where a greedy
// row (0) keeps its raw logits (x / 1 is x exactly), so that its first sorted id is the argmax
// with ties to the lowest id.
__device__ __forceinline__ float key_temperature(const SampleRowParams* row_params, int64_t r,
                                                 float temperature) {
  if (!row_params) return temperature;
  const float t = row_params[r].temperature;
  return t > 0.f ? t : 1.f;
}

template <typename T>
__global__ void keys_kernel(const T* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                            float temperature, const SampleRowParams* row_params, uint32_t* keys,
                            int32_t* ids, int32_t* offsets) {
  const int64_t total = rows * vocab;
  // total + 1 items: the offsets array has rows + 1 entries, one more than there are logits
  // when vocab == 1.
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i <= total;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (i <= rows) offsets[i] = static_cast<int32_t>(i * vocab);
    if (i == total) continue;
    const int64_t r = i / vocab, c = i % vocab;
    // Correctly rounded fp32 division, as the host's `logits[i] / temperature`, whatever
    // -prec-div says: logits that differ may round to the same s and must then tie here too.
    keys[i] = order_key(__fdiv_rn(load_f32(logits + r * row_stride + c),
                                  key_temperature(row_params, r, temperature)));
    ids[i] = static_cast<int32_t>(c);
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling step 3: one block per sorted row, chunked fp64 scans.

constexpr int kPickThreads = 512;
constexpr int kItems = 8;  // consecutive sorted elements per thread and chunk
constexpr int kChunk = kPickThreads * kItems;
constexpr int kPickWarps = kPickThreads / 32;
static_assert(kPickThreads % 32 == 0 && kPickThreads <= 1024, "whole warps per block");

// Masses in 2^-96 units, exact prefix sums: kernels/sampling_mass.h (shared with the host).

__device__ __forceinline__ Mass shfl_up_mass(Mass v, int d) {
  const auto lo = __shfl_up_sync(0xffffffffu, static_cast<unsigned long long>(v), d);
  const auto hi = __shfl_up_sync(0xffffffffu, static_cast<unsigned long long>(v >> 64), d);
  return (Mass{hi} << 64) | lo;
}

struct ScanSmem {
  Mass warp_sums[kPickWarps];
  int found;      // lowest index satisfying the predicate in the current chunk, INT_MAX: none
  Mass found_q;   // cumulative mass through `found`
};

// Exclusive block-wide sum of one mass per thread (exact, so the order of addition is free);
// `total` gets the block's sum.
__device__ __forceinline__ Mass block_exclusive_sum(Mass v, ScanSmem& sm, Mass& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Mass incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const Mass o = shfl_up_mass(incl, d);
    if (lane >= d) incl += o;
  }
  if (lane == 31) sm.warp_sums[warp] = incl;
  // The warp totals written above are read by every thread below.
  __syncthreads();
  Mass before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kPickWarps; ++w) {
    if (w < warp) before += sm.warp_sums[w];
    all += sm.warp_sums[w];
  }
  total = all;
  return before + incl - v;
}

// Walks sorted elements [0, keep) chunk by chunk, stopping after the chunk that holds
// `stop - 1` or the first index i with pred(i, Q_i), Q_i = sum_{j <= i} to_mass(exp(s_j - mx)).
// Returns that index with Q_i in q, or -1 with the mass of everything walked in q.
template <typename Pred>
__device__ int scan_find(const uint32_t* keys, int keep, int stop, double mx, Pred pred,
                         ScanSmem& sm, Mass& q) {
  // All threads are done reading sm from the previous walk before it is reset.
  __syncthreads();
  if (threadIdx.x == 0) sm.found = INT_MAX;
  // The reset is visible before any thread's atomicMin below.
  __syncthreads();
  Mass carry = 0;
  for (int base = 0; base < stop; base += kChunk) {
    const int first = base + static_cast<int>(threadIdx.x) * kItems;
    Mass incl[kItems];
    Mass run = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = first + j;
      // Widened to fp64 before the subtraction, as on the host. -inf (masked) logits give
      // exp(-inf) = 0: no mass, never picked.
      run += i < keep ? to_mass(exp(static_cast<double>(from_key(keys[i])) - mx)) : Mass{0};
      incl[j] = run;
    }
    Mass chunk_total;
    const Mass excl = carry + block_exclusive_sum(run, sm, chunk_total);
    int mine = INT_MAX;
    Mass mine_q = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = first + j;
      if (i >= keep || mine != INT_MAX) continue;
      if (pred(i, excl + incl[j])) {
        mine = i;
        mine_q = excl + incl[j];
      }
    }
    if (mine != INT_MAX) atomicMin(&sm.found, mine);
    // Makes every atomicMin visible, tells all threads alike whether this chunk holds the
    // answer, and keeps the next chunk from overwriting warp_sums that slower threads may still
    // be reading. sm.found changes only in the chunk we return from.
    if (__syncthreads_or(mine != INT_MAX)) {
      const int f = sm.found;
      if (mine == f) sm.found_q = mine_q;
      // found_q, written by its one owner above, is read by every thread below.
      __syncthreads();
      q = sm.found_q;
      return f;
    }
    carry += chunk_total;
  }
  q = carry;
  return -1;
}

// How many sorted ids top_k keeps (0 or >= vocab: all).
__host__ __device__ __forceinline__ int kept_ids(int top_k, int64_t vocab) {
  return top_k > 0 && top_k < vocab ? top_k : static_cast<int>(vocab);
}

// How many of the first `keep` sorted ids min_p keeps: those with exp(s - mx) >= min_p, counted
// as the host counts them (in fp64). Every thread gets the count; keep is the same in all.
__device__ __forceinline__ int min_p_kept(const uint32_t* keys, int keep, double mx,
                                          float min_p) {
  const double floor = static_cast<double>(min_p);
  int count = 0;
  for (int base = 0; base < keep; base += kPickThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    count += __syncthreads_count(
        i < keep && exp(static_cast<double>(from_key(keys[i])) - mx) >= floor);
  }
  return count;
}

__global__ void __launch_bounds__(kPickThreads)
    pick_kernel(const uint32_t* sorted_keys, const int32_t* sorted_ids, int64_t vocab, int keep,
                float top_p, float min_p, const SampleRowParams* row_params,
                const double* uniforms, int32_t* out) {
  __shared__ ScanSmem sm;
  const uint32_t* keys = sorted_keys + int64_t{blockIdx.x} * vocab;
  const int32_t* ids = sorted_ids + int64_t{blockIdx.x} * vocab;
  if (row_params) {
    const SampleRowParams rp = row_params[blockIdx.x];
    // A greedy row keeps its first sorted id: the argmax of its raw keys (key_temperature).
    keep = rp.temperature > 0.f ? kept_ids(rp.top_k, vocab) : 1;
    top_p = rp.top_p;
    min_p = rp.min_p;
  }
  // The host's max is the first sorted s, widened to fp64.
  const double mx = static_cast<double>(from_key(keys[0]));
  // s_max's own ratio is 1 >= min_p, so at least one id stays.
  if (keep > 1 && min_p > 0.f) keep = min_p_kept(keys, keep, mx, min_p);
  if (keep == 1) {
    // One kept id: the host returns it for every u too.
    if (threadIdx.x == 0) out[blockIdx.x] = ids[0];
    return;
  }
  int cut = keep - 1;
  Mass kept;
  scan_find(keys, keep, keep, mx, [](int, Mass) { return false; }, sm, kept);
  if (top_p < 1.f) {
    // The first prefix whose share of the total reaches top_p, in the host's fp64 arithmetic.
    const double total = to_double(kept), tp = static_cast<double>(top_p);
    Mass q;
    const int f = scan_find(keys, keep, keep, mx,
                            [=](int, Mass c) { return __ddiv_rn(to_double(c), total) >= tp; },
                            sm, q);
    if (f >= 0) {
      cut = f;
      kept = q;
    }
  }
  const double target = __dmul_rn(uniforms[blockIdx.x], to_double(kept));
  Mass q;
  const int f = scan_find(keys, keep, cut + 1, mx,
                          [=](int i, Mass c) { return i <= cut && target < to_double(c); }, sm,
                          q);
  // No prefix above target (u * kept rounded up to kept): the last kept id, as on the host.
  if (threadIdx.x == 0) out[blockIdx.x] = ids[f >= 0 ? f : cut];
}

// ---------------------------------------------------------------------------------------------
// Host side.

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

bool sizes_ok(int64_t vocab, int64_t rows) {
  return vocab >= 1 && rows >= 1 && rows <= INT32_MAX && vocab <= INT32_MAX / rows;
}

// CUB's scratch for sorting rows segments of vocab (key, id) pairs; the query launches nothing.
cudaError_t sort_scratch_bytes(int64_t vocab, int64_t rows, size_t& bytes) {
  bytes = 0;
  const int n = static_cast<int>(rows * vocab);
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n,
      static_cast<int>(rows), static_cast<const int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr) + 1, 0, 32, cudaStream_t{});
}

struct Layout {
  size_t keys_in, keys_out, ids_in, ids_out, offsets, scratch, scratch_bytes, total;
};

cudaError_t layout_for(int64_t vocab, int64_t rows, Layout& l) {
  const size_t n = static_cast<size_t>(rows * vocab);
  const cudaError_t err = sort_scratch_bytes(vocab, rows, l.scratch_bytes);
  if (err != cudaSuccess) return err;
  l.keys_in = 0;
  l.keys_out = l.keys_in + align_up(n * sizeof(uint32_t));
  l.ids_in = l.keys_out + align_up(n * sizeof(uint32_t));
  l.ids_out = l.ids_in + align_up(n * sizeof(int32_t));
  l.offsets = l.ids_out + align_up(n * sizeof(int32_t));
  l.scratch = l.offsets + align_up(static_cast<size_t>(rows + 1) * sizeof(int32_t));
  l.total = l.scratch + align_up(l.scratch_bytes);
  return cudaSuccess;
}


}  // namespace

size_t sample_cuda_workspace_bytes(int64_t vocab, int64_t rows) {
  if (!sizes_ok(vocab, rows)) return 0;
  Layout l{};
  return layout_for(vocab, rows, l) == cudaSuccess ? l.total : 0;
}

cudaError_t sample_cuda(const SampleParams& p, cudaStream_t stream) {
  if (!sizes_ok(p.vocab, p.rows) || p.row_stride < p.vocab) return cudaErrorInvalidValue;
  if (!p.logits || !p.out_ids) return cudaErrorInvalidValue;
  if (!p.row_params) {
    if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature)) return cudaErrorInvalidValue;
    if (p.top_k < 0 || !(p.top_p > 0.f && p.top_p <= 1.f)) return cudaErrorInvalidValue;
    if (!(p.min_p >= 0.f && p.min_p <= 1.f)) return cudaErrorInvalidValue;
  }
  if (p.dtype != DType::kF32 && p.dtype != DType::kBF16) return cudaErrorInvalidValue;
  const unsigned rows = static_cast<unsigned>(p.rows);
  if (p.temperature == 0.f && !p.row_params) {
    return with_type(p.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      argmax_kernel<T><<<rows, kArgmaxThreads, 0, stream>>>(static_cast<const T*>(p.logits),
                                                             p.vocab, p.row_stride, p.out_ids);
      return cudaGetLastError();
    });
  }
  if (!p.uniforms || !p.workspace) return cudaErrorInvalidValue;
  Layout l{};
  cudaError_t err = layout_for(p.vocab, p.rows, l);
  if (err != cudaSuccess) return err;
  if (p.workspace_bytes < l.total) return cudaErrorInvalidValue;
  auto* ws = static_cast<unsigned char*>(p.workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + l.keys_out);
  auto* ids_in = reinterpret_cast<int32_t*>(ws + l.ids_in);
  auto* ids_out = reinterpret_cast<int32_t*>(ws + l.ids_out);
  auto* offsets = reinterpret_cast<int32_t*>(ws + l.offsets);
  const int64_t n = p.rows * p.vocab;
  err = with_type(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    keys_kernel<T><<<grid_for(n + 1), kThreads, 0, stream>>>(
        static_cast<const T*>(p.logits), p.rows, p.vocab, p.row_stride, p.temperature,
        p.row_params, keys_in, ids_in, offsets);
    return cudaGetLastError();
  });
  if (err != cudaSuccess) return err;
  size_t scratch_bytes = l.scratch_bytes;
  err = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      ws + l.scratch, scratch_bytes, keys_in, keys_out, ids_in, ids_out, static_cast<int>(n),
      static_cast<int>(p.rows), offsets, offsets + 1, 0, 32, stream);
  if (err != cudaSuccess) return err;
  pick_kernel<<<rows, kPickThreads, 0, stream>>>(keys_out, ids_out, p.vocab,
                                                 kept_ids(p.top_k, p.vocab), p.top_p,
                                                 p.min_p, p.row_params, p.uniforms, p.out_ids);
  return cudaGetLastError();
}

}  // namespace burst::kernels
