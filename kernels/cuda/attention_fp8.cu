// FP8 prefill attention (kernels/attention_cuda.h: attention_fp8_cuda): q, k and v (bf16 or
// f16) are quantized to e4m3 into a workspace, then the Hopper kernel runs over those bytes
// (attention_sm90.cu, Sm90Tile with one-byte elements: twice the tensor-core rate of bf16).
//
// Quantization (what FlashAttention-3 calls block quantization, with its incoherent processing):
// - Q: one scale per head and 64 query rows (a consumer warpgroup's rows of a 128-row tile;
//   groups are counted from the first tile's start, q_pad rows before row 0, as the kernel
//   cuts its tiles from the end of the rows). K: one scale per KV head and 128 keys (a
//   pipeline stage). Both fold into the score's scale, one multiply a block.
// - Before quantizing, each row of Q and of K (head_dim 128 or 64 values) is multiplied by the
//   same orthogonal matrix H = diag(random signs) x Hadamard / sqrt(head_dim) (by tensor cores,
//   see rotate_tile): (qH).(kH) = q.k, but an outlier channel, which would
//   set the scale of its whole block, is spread over the whole row (Fp8AttnOptions::hadamard;
//   on by default).
// - V: one scale per KV head and column (O's column d is (P.v8)[d] x scale[d], applied in the
//   epilogue), so an outlier channel of V costs only its own column. The scale is the column's
//   max |v| over all keys of the launch (a first pass), and V is written transposed, since
//   fp8 wgmma reads its B operand K-major only: vt8[g][d][key].
// - Scales are max |x| / 448 (e4m3's largest finite value), never below 1e-6 / 448, so that a
//   zero block gives zeros and no product of scales underflows to 0 (a 0 x -inf score is NaN).
// - K and V may be paged (AttnParams::kv_pages) and may be FP8 KV rows (kv_fp8, the FP8 KV
//   cache's format): the quantizer reads them where they lie, each value rounded to q's dtype
//   as dequantize_kv_cuda rounds it, so the result is bit for bit that of dequantizing the rows
//   into one block first (KvSource). A later chunk of a prompt thus reads its cached prefix
//   from the pool in place: no gather and no dequantized copy.
#include <cuda_fp8.h>

#include <cmath>

#include "attention_common.cuh"
#include "kernels/attention_cuda.h"
#include "kernels/cuda_chunks.cuh"
#include "kernels/cuda_dispatch.cuh"
#include "kernels/kv_fp8.h"

namespace burst::kernels {
namespace {

constexpr int kQGroupRows = 64;     // query rows a scale
constexpr int kKBlockRows = 128;    // keys a scale (kBlockN of the kernel)
constexpr float kE4m3Max = 448.f;
constexpr float kMinAmax = 1e-6f;
constexpr int kVtKeys = 128;        // keys a CTA of the V transpose writes
constexpr int kVtThreads = 256;     // its threads
constexpr size_t kAlign = 256;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Where each operand lies in the workspace.
struct Layout {
  int q_groups = 0, k_blocks = 0, q_pad = 0;
  int64_t vt_keys = 0;
  size_t q8 = 0, k8 = 0, vt8 = 0, q_scale = 0, k_scale = 0, v_amax = 0, v_scale = 0, end = 0;
};

Layout layout_of(const AttnParams& p) {
  Layout l;
  const int m_blocks = (p.n_q + 127) / 128;  // the kernel's 128-row query tiles
  l.q_groups = m_blocks * (128 / kQGroupRows);
  l.q_pad = m_blocks * 128 - p.n_q;
  l.k_blocks = (p.n_kv + kKBlockRows - 1) / kKBlockRows;
  l.vt_keys = int64_t{l.k_blocks} * kKBlockRows;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  const size_t d = static_cast<size_t>(p.head_dim);
  l.q8 = take(size_t(p.n_q) * p.heads * d);
  l.k8 = take(size_t(p.n_kv) * p.kv_heads * d);
  l.vt8 = take(size_t(p.kv_heads) * d * l.vt_keys);
  l.q_scale = take(sizeof(float) * p.heads * l.q_groups);
  l.k_scale = take(sizeof(float) * p.kv_heads * l.k_blocks);
  l.v_amax = take(sizeof(float) * p.kv_heads * d);
  l.v_scale = take(sizeof(float) * p.kv_heads * d);
  l.end = at;
  return l;
}

// The rotation by tensor cores. A warp holds 16 rows (one m16n8k16 A tile) and computes
// x.diag(signs).W, W the 128 x 128 (or 64 x 64) Walsh-Hadamard matrix, W[c][n] = (-1)^popc(c & n).
// Its lane (g = lane / 4, t = lane % 4) loads the 16-byte chunks of columns 32 a + 8 t .. + 7 of
// rows g and g + 8 (a < kD / 32): a load instruction reads 64 contiguous bytes of each row.
// Read as A fragments, chunk a's words 0..3 are slices kb = 2 a, 2 a + 1 of the reduction: the
// column c held at w (0..15) of slice kb is c = 32 (kb / 2) + 8 t_w + 4 (kb % 2) + 2 (w / 8) +
// w % 2, with t_w = (w / 2) % 4. Outputs are numbered the same way from an n-tile index
// (ntl < kD / 16, h < 2) and its column nn (0..7): n = 32 (ntl / 2) + 8 (nn / 2) + 4 (ntl % 2) +
// 2 h + nn % 2. Then popc(c & n) splits into popc(kb & ntl) + h (w / 8) + popc((w % 8) & nn), so
//   x.W[:, n] = sum_kb (-1)^popc(kb & ntl) Z[kb][h],   Z[kb][h] = A[kb].B_h(kb),
// B_h(kb)[w][nn] = signs[c] (-1)^(h (w / 8) + popc((w % 8) & nn)): kD / 16 x 2 mma.sync with
// +-1 operands (exact products, fp32 sums), then a Walsh-Hadamard butterfly over kb in fp32.
// Where the C fragment leaves output n (rows g, g + 8; nn = 2 t + 0, 1) is again columns
// 32 a + 8 t .. + 7: the rotated row lands in the natural order (the CPU emulation's), stored
// 8 bytes a lane, 32 contiguous bytes of a row a store instruction. (The shuffle butterflies
// this replaces took ~144 instructions a row a warp, 20 of them shuffles: 128K rows x 32 heads
// of Q in 1.10 ms on an H200, now 0.53 ms, against ~0.36 ms for its bytes.)
constexpr int kTileRows = 16;  // rows a warp: one m16n8k16 A tile
// Warps a multiprocessor keeps of the Q / K quantizer (registers capped to fit them). At 128K
// rows x 32 heads on an H200 (Nsight Compute), uncapped: Q's 4-warp blocks at 86 registers fit
// 5 (20 warps), 466 us at 71 % of DRAM bandwidth; K's 8-warp blocks at 97 fit 2 (16 warps),
// 562 us at 59 %. Capped (80 registers): Q 474 us, K 512 us at 65 %.
constexpr int kQuantizeWarpsPerSm = 24;

// A row half's values: y[a][j] = rotated (or plain) column 32 a + 8 t + j of the lane's row.
template <int kD>
using RowValues = float[kD / 32][8];

// The lane's B fragments of B_0(kb) (b[kb][f]: reduction rows w = 2 t, 2 t + 1, + 8 f; column
// nn = g) as T's +-1; B_1(kb) is B_0(kb) with its f = 1 register negated.
template <typename T, int kD>
struct RotationB {
  uint32_t b[kD / 16][2];
  __device__ __forceinline__ RotationB(int g, int t) {
    const uint32_t one = std::is_same_v<T, __nv_bfloat16> ? 0x3F80u : 0x3C00u;
#pragma unroll
    for (int kb = 0; kb < kD / 16; ++kb) {
#pragma unroll
      for (int f = 0; f < 2; ++f) {
        uint32_t word = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t c = 32 * (kb / 2) + 8 * t + 4 * (kb % 2) + 2 * f + e;
          const bool neg = fp8_rotation_negates(c) != ((__popc((2 * t + e) & g) & 1) != 0);
          word |= (one | (neg ? 0x8000u : 0u)) << (16 * e);
        }
        b[kb][f] = word;
      }
    }
  }
};

// Rows g and g + 8 of the tile, loaded as raw[r][a] (chunk a of row g + 8 r), rotated into
// y[r] (unnormalised: times sqrt(kD)).
template <typename T, int kD>
__device__ __forceinline__ void rotate_tile(const uint4 (&raw)[2][kD / 32],
                                            const RotationB<T, kD>& rb, RowValues<kD> (&y)[2]) {
  constexpr int kSlices = kD / 16;
  float z[kSlices][2][4];
#pragma unroll
  for (int kb = 0; kb < kSlices; ++kb) {
    const uint4& lo = raw[0][kb / 2];
    const uint4& hi = raw[1][kb / 2];
    const uint32_t a[4] = {kb % 2 ? lo.z : lo.x, kb % 2 ? hi.z : hi.x, kb % 2 ? lo.w : lo.y,
                           kb % 2 ? hi.w : hi.y};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) z[kb][h][i] = 0.f;
      detail::mma_16816<T>(z[kb][h], a, rb.b[kb][0], h ? rb.b[kb][1] ^ 0x80008000u : rb.b[kb][1]);
    }
  }
#pragma unroll
  for (int m = 1; m < kSlices; m <<= 1) {
#pragma unroll
    for (int kb = 0; kb < kSlices; ++kb) {
      if (kb & m) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float u = z[kb][h][i], v = z[kb | m][h][i];
          z[kb][h][i] = u + v;
          z[kb | m][h][i] = u - v;
        }
      }
    }
  }
#pragma unroll
  for (int ntl = 0; ntl < kSlices; ++ntl) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int e = 0; e < 2; ++e) y[r][ntl / 2][4 * (ntl % 2) + 2 * h + e] = z[ntl][h][2 * r + e];
      }
    }
  }
}

// K or V as the quantizer reads it: key j is row kv_row(pages, page_size, j) of rows of T
// (kFp8Rows false: strides in elements), or of FP8 KV rows (kFp8Rows: row_stride in bytes,
// head g's e4m3 values at byte g * head_dim, its scale at scale_offset + 4 g; each value is
// e4m3 x scale rounded to T, as dequantize_kv_cuda writes it).
template <typename T, bool kFp8Rows>
struct KvSource {
  const uint8_t* base = nullptr;
  int64_t row_stride = 0, head_stride = 0;  // elements of T, or (FP8 rows) bytes
  int64_t scale_offset = 0;                 // FP8 rows: where a row's scales start
  const int32_t* pages = nullptr;
  int page_size = 0;

  __device__ __forceinline__ const uint8_t* row(int64_t j) const {
    const int64_t r = pages ? int64_t{pages[j / page_size]} * page_size + j % page_size : j;
    return base + r * row_stride * (kFp8Rows ? 1 : int64_t{sizeof(T)});
  }
  // Columns a 16-byte load of a row holds: 8 values of T, or 16 bytes of an FP8 row.
  static constexpr int kUnitCols = kFp8Rows ? 16 : 8;

  // Rows of T: columns col .. col + 7 of head h of key j, a 16-byte chunk (col a multiple of 8).
  __device__ __forceinline__ uint4 chunk(int64_t j, int h, int col) const {
    static_assert(!kFp8Rows, "FP8 rows are read a unit at a time");
    return *reinterpret_cast<const uint4*>(row(j) + (h * head_stride + col) * int64_t{sizeof(T)});
  }
  // Columns col .. col + kUnitCols - 1 (col a multiple of kUnitCols) of head h of key j, one
  // 16-byte load, as chunks of 8 values of T.
  __device__ __forceinline__ void unit(int64_t j, int h, int col,
                                       uint4 (&out)[kUnitCols / 8]) const {
    if constexpr (!kFp8Rows) {
      out[0] = chunk(j, h, col);
    } else {
      const uint8_t* r = row(j);
      const uint4 b = *reinterpret_cast<const uint4*>(r + h * head_stride + col);
      const float scale = scale_of(r, h);
      float f[8];
      fp8_values8(make_uint2(b.x, b.y), scale, f);
      out[0] = to_t8(f);
      fp8_values8(make_uint2(b.z, b.w), scale, f);
      out[1] = to_t8(f);
    }
  }
  // |value| of the same columns in fp32, FP8 rows' not yet rounded to T: rounding is monotonic,
  // so the max of these rounded (round_max) is the max of the rounded values, at one rounding
  // instead of one a value.
  __device__ __forceinline__ void unit_magnitudes(int64_t j, int h, int col,
                                                  float (&x)[kUnitCols]) const {
    const uint8_t* r = row(j);
    if constexpr (!kFp8Rows) {
      load_n<kUnitCols>(reinterpret_cast<const T*>(r) + h * head_stride + col, x);
#pragma unroll
      for (int i = 0; i < kUnitCols; ++i) x[i] = fabsf(x[i]);
    } else {
      const uint4 b = *reinterpret_cast<const uint4*>(r + h * head_stride + col);
      const float scale = scale_of(r, h);
      // e4m3 sign bits cleared: |x| = |e4m3| x scale (scales are positive).
      constexpr uint32_t kMag = 0x7f7f7f7fu;
      float lo[8], hi[8];
      fp8_values8(make_uint2(b.x & kMag, b.y & kMag), scale, lo);
      fp8_values8(make_uint2(b.z & kMag, b.w & kMag), scale, hi);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[i] = lo[i];
        x[8 + i] = hi[i];
      }
    }
  }
  // A max of unit_magnitudes() as the max of the values T holds.
  __device__ __forceinline__ static float round_max(float m) {
    if constexpr (!kFp8Rows) return m;
    T rounded;
    store_f32(&rounded, m);
    return load_f32(&rounded);
  }

  // FP8 rows: head h's scale in row r (row(j)).
  __device__ __forceinline__ float scale_of(const uint8_t* r, int h) const {
    return *reinterpret_cast<const float*>(r + scale_offset + 4 * h);
  }
  // Eight fp32 values rounded to T (two at a time: one conversion instruction a pair).
  __device__ __forceinline__ static uint4 to_t8(const float (&f)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        const __nv_bfloat162 two = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&two);
      } else {
        const __half2 two = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&two);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <typename T>
KvSource<T, false> rows_of(const void* x, int64_t row_stride, int64_t head_stride) {
  KvSource<T, false> s;
  s.base = static_cast<const uint8_t*>(x);
  s.row_stride = row_stride;
  s.head_stride = head_stride;
  return s;
}

// K (or V) of p as the quantizer reads it.
template <typename T, bool kFp8Rows>
KvSource<T, kFp8Rows> kv_source(const AttnParams& p, const void* x, int64_t row_stride,
                                int64_t head_stride) {
  KvSource<T, kFp8Rows> s;
  s.base = static_cast<const uint8_t*>(x);
  s.row_stride = row_stride;
  s.head_stride = kFp8Rows ? p.head_dim : head_stride;
  s.scale_offset = kv_fp8_scale_offset(p.kv_heads, p.head_dim);
  s.pages = p.kv_pages;
  s.page_size = p.page_size;
  return s;
}

// Rows [first, first + kWarps * 16) of head blockIdx.y (rows outside [0, rows) read as zero and
// are not written) into out [rows][heads][kD] e4m3, with one scale for the group:
// scale[head * gridDim.x + blockIdx.x]. first = blockIdx.x * kWarps * 16 - pad.
template <typename T, bool kFp8Rows, int kWarps, int kD>
__global__ void __launch_bounds__(kWarps * 32, kQuantizeWarpsPerSm / kWarps)
    quantize_rows_kernel(const KvSource<T, kFp8Rows> x, int rows, int pad, int heads,
                         int hadamard_on, uint8_t* __restrict__ out, float* __restrict__ scale) {
  constexpr int kChunks = kD / 32;
  __shared__ float warp_max[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, h = blockIdx.y;
  const int g = lane >> 2, t = lane & 3;
  const int first = blockIdx.x * kWarps * kTileRows - pad + warp * kTileRows + g;
  uint4 raw[2][kChunks];
  if constexpr (!kFp8Rows) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = first + 8 * r;
      const bool in = row >= 0 && row < rows;
#pragma unroll
      for (int a = 0; a < kChunks; ++a) {
        raw[r][a] = in ? x.chunk(row, h, 32 * a + 8 * t) : make_uint4(0, 0, 0, 0);
      }
    }
  } else {
    // FP8 rows: a lane's pieces of a row are 8 bytes (32 a + 8 t), a quarter of a sector; read
    // so, one request each, the K passes of a 7B 128K prefill in 8K chunks took 228 ms on an
    // H200 (~157 ms over bf16 rows). The warp loads its 16 rows whole instead, 16 bytes a lane
    // (every load issued before any store), into shared memory, and each lane takes its pieces
    // from there: 180 ms. Rows of kD + 32 bytes: the 8 bytes the lanes of a half-warp read
    // (rows g 0..3 or 4..7, pieces t) fall in 32 banks. The lane that loads a row's first unit
    // also loads its scale, into the row's padding (one page lookup a row and load).
    constexpr int kRowBytes = kD + 32, kUnits = kD / 16, kLoads = kTileRows * kUnits / 32;
    __shared__ __align__(16) uint8_t stage[kWarps][kTileRows][kRowBytes];
    const int tile0 = first - g;
    uint4 unit[kLoads];
    float unit_scale[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = (k * 32 + lane) / kUnits, u = lane % kUnits, row = tile0 + i;
      const bool in = row >= 0 && row < rows;
      const uint8_t* r = in ? x.row(row) : nullptr;
      unit[k] = in ? *reinterpret_cast<const uint4*>(r + h * x.head_stride + 16 * u)
                   : make_uint4(0, 0, 0, 0);
      unit_scale[k] = in && u == 0 ? x.scale_of(r, h) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = (k * 32 + lane) / kUnits, u = lane % kUnits;
      *reinterpret_cast<uint4*>(&stage[warp][i][16 * u]) = unit[k];
      if (u == 0) *reinterpret_cast<float*>(&stage[warp][i][kD]) = unit_scale[k];
    }
    __syncwarp();  // the warp's rows are in shared memory before its lanes read across them
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sc = *reinterpret_cast<const float*>(&stage[warp][g + 8 * r][kD]);
#pragma unroll
      for (int a = 0; a < kChunks; ++a) {
        float f[8];
        fp8_values8(*reinterpret_cast<const uint2*>(&stage[warp][g + 8 * r][32 * a + 8 * t]), sc,
                    f);
        raw[r][a] = KvSource<T, kFp8Rows>::to_t8(f);
      }
    }
  }
  RowValues<kD> y[2];
  float norm = 1.f;
  if (hadamard_on) {
    rotate_tile<T, kD>(raw, RotationB<T, kD>(g, t), y);
    // 1 / sqrt(head_dim) rounded to fp32, as the CPU emulation's 1 / std::sqrt(d).
    norm = kD == 128 ? 0.08838834764831845f : 0.125f;
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int a = 0; a < kChunks; ++a) {
        const uint32_t w[4] = {raw[r][a].x, raw[r][a].y, raw[r][a].z, raw[r][a].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          y[r][a][j] = bits_to_float<T>(static_cast<uint16_t>(w[j / 2] >> (16 * (j % 2))));
        }
      }
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int a = 0; a < kChunks; ++a) {
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(y[r][a][j]));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();  // every warp's max is in shared memory before any reads them
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_max[w]);
  amax = fmaxf(amax * norm, kMinAmax);  // the max of the normalised rows
  if (threadIdx.x == 0) scale[int64_t{h} * gridDim.x + blockIdx.x] = amax / kE4m3Max;
  const float k = norm * (kE4m3Max / amax);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first + 8 * r;
    if (row < 0 || row >= rows) continue;
    uint8_t* dst = out + (int64_t{row} * heads + h) * kD + 8 * t;
#pragma unroll
    for (int a = 0; a < kChunks; ++a) {
      const float(&v)[8] = y[r][a];
      *reinterpret_cast<uint2*>(dst + 32 * a) =
          make_uint2(e4m3x4(v[0] * k, v[1] * k, v[2] * k, v[3] * k),
                     e4m3x4(v[4] * k, v[5] * k, v[6] * k, v[7] * k));
    }
  }
}

// Column maxima of |v| for kv head blockIdx.y over keys [blockIdx.x * 256, + 256): atomicMax
// on the bits of non-negative floats (which order as their bits do) into amax[g][kD], zeroed
// before.
template <typename T, bool kFp8Rows, int kD>
__global__ void __launch_bounds__(128)
    v_amax_kernel(const KvSource<T, kFp8Rows> v, int n_kv, float* __restrict__ amax) {
  // A lane loads 16 bytes of a row at a time (kCols columns); a warp's load covers kRows rows,
  // the block's four warps 4 x kRows, two such loads in flight a warp. (A lane's 4 bytes of an
  // FP8 row a load, one row a warp at a time, held twice the requests in flight for the bytes:
  // 1.0 TB/s on an H200 against 3.1 for bf16 rows.)
  using Src = KvSource<T, kFp8Rows>;
  constexpr int kCols = Src::kUnitCols, kLanesPerRow = kD / kCols, kRows = 32 / kLanesPerRow;
  constexpr int kStep = 4 * kRows, kUnroll = 2;
  __shared__ float part[4][kD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = blockIdx.y;
  const int sub = lane / kLanesPerRow, c0 = (lane % kLanesPerRow) * kCols;
  float m[kCols] = {};
  const int end = min(n_kv, (blockIdx.x + 1) * 256);
  for (int row0 = blockIdx.x * 256 + warp * kRows + sub; row0 < end; row0 += kStep * kUnroll) {
    float x[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int row = row0 + u * kStep;
      if (row < end) {
        v.unit_magnitudes(row, g, c0, x[u]);
      } else {
#pragma unroll
        for (int e = 0; e < kCols; ++e) x[u][e] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < kCols; ++e) m[e] = fmaxf(m[e], x[u][e]);
    }
  }
  // The lanes of one column range held different rows: their maxima into the first's.
#pragma unroll
  for (int off = kLanesPerRow; off < 32; off <<= 1) {
#pragma unroll
    for (int e = 0; e < kCols; ++e) m[e] = fmaxf(m[e], __shfl_xor_sync(0xffffffffu, m[e], off));
  }
  if (sub == 0) {
#pragma unroll
    for (int e = 0; e < kCols; ++e) part[warp][c0 + e] = Src::round_max(m[e]);
  }
  __syncthreads();  // the four warps' column maxima are in shared memory
  const int d = threadIdx.x;
  if (d >= kD) return;
  const float col = fmaxf(fmaxf(part[0][d], part[1][d]), fmaxf(part[2][d], part[3][d]));
  atomicMax(reinterpret_cast<unsigned*>(amax) + g * kD + d, __float_as_uint(col));
}

// The key that lands at position q (0..31) of its 32-key group in V^T: the P.V A fragment
// (four e4m3 a register) reads the accumulator's values of keys 2t, 2t+1, 8+2t, 9+2t as keys
// 4t .. 4t+3 (t = lane % 4; the same + 16 for the group's second half), see softmax_fp8.
__device__ __forceinline__ int vt_key(int q) {
  const int half = q & 16, r = q & 15, t = r >> 2, b = r & 3;
  return half + 2 * t + (b & 1) + 8 * (b >> 1);
}

// V^T of keys [blockIdx.x * 128, + 128) of kv head blockIdx.y: vt8[g][d][position] = v[key][g][d]
// / v_scale[g][d] in e4m3, keys at their vt_key positions, keys past n_kv zero. Block (0, g)
// writes v_scale[g].
template <typename T, bool kFp8Rows, int kD>
__global__ void __launch_bounds__(kVtThreads)
    vt_kernel(const KvSource<T, kFp8Rows> v, int n_kv, int64_t vt_keys,
              const float* __restrict__ amax, uint8_t* __restrict__ vt8,
              float* __restrict__ v_scale) {
  // The tile as 32-bit words, two 16-bit values each: a key's row is kD / 2 + 1 words (odd, so
  // rows step one bank) and each 32-key group is skewed by 0, 1, 8, 9 words, so the 32 keys a
  // warp reads for one column (4 lane + b's vt_key, b fixed) fall in 32 banks. (With rows of
  // kD + 8 values they fell in 2: 16-way conflicts, 127 us for 16K x 32 heads on an H200 with
  // shared memory 81 % busy and DRAM 30 %; now 93 us, DRAM 42 %.) The chunks' stores are 4
  // words (rows are not 16-byte aligned), their banks all but 2-way distinct.
  constexpr int kRowWords = kD / 2 + 1;
  __shared__ uint32_t tile[kVtKeys * kRowWords + 10];
  auto at = [](int key) { return key * kRowWords + ((key >> 5) & 1) + 8 * (key >> 6); };
  const int g = blockIdx.y, key0 = blockIdx.x * kVtKeys;
  // A thread's 16-byte chunks, all loaded before any is stored (a loop of load-then-store had
  // one load in flight a thread: 657 us for 128K keys x 32 heads on an H200, 2.3 TB/s).
  // A 16-byte load a unit: 8 columns of T, or 16 of an FP8 row (two chunks of T).
  constexpr int kCols = KvSource<T, kFp8Rows>::kUnitCols, kPer = kCols / 8;
  constexpr int kUnits = kVtKeys * kD / kCols / kVtThreads;
  uint4 raw[kUnits][kPer];
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int u = threadIdx.x + i * kVtThreads, key = u / (kD / kCols);
    const int col = (u % (kD / kCols)) * kCols;
#pragma unroll
    for (int s = 0; s < kPer; ++s) raw[i][s] = make_uint4(0, 0, 0, 0);
    if (key0 + key < n_kv) v.unit(key0 + key, g, col, raw[i]);
  }
#pragma unroll
  for (int i = 0; i < kUnits; ++i) {
    const int u = threadIdx.x + i * kVtThreads, key = u / (kD / kCols);
    const int col = (u % (kD / kCols)) * kCols;
#pragma unroll
    for (int s = 0; s < kPer; ++s) {
      uint32_t* const dst = tile + at(key) + (col + 8 * s) / 2;
      dst[0] = raw[i][s].x;
      dst[1] = raw[i][s].y;
      dst[2] = raw[i][s].z;
      dst[3] = raw[i][s].w;
    }
  }
  __syncthreads();  // the tile is whole before any thread reads across keys
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Warp w writes the column pairs (2 c, 2 c + 1), c = w, w + 8, ...: one shared-memory word
  // holds both columns of a key, so a word is read once for two values (one a column, the
  // SM's load pipe was 83 % busy: 511 us for 128K keys x 32 heads on an H200). Their maxima
  // are all loaded first (loaded beside each column's stores, one at a time, they waited a
  // global load's latency each).
  constexpr int kPairs = kD / 2 / (kVtThreads / 32);
  float col_max[kPairs][2];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int c = warp + j * (kVtThreads / 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) col_max[j][h] = fmaxf(amax[g * kD + 2 * c + h], kMinAmax);
  }
  const int p = 4 * lane;  // positions p .. p + 3 of each row's 128
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int c = warp + j * (kVtThreads / 32);
    const float inv0 = kE4m3Max / col_max[j][0], inv1 = kE4m3Max / col_max[j][1];
    if (blockIdx.x == 0 && lane < 2) {
      v_scale[g * kD + 2 * c + lane] = (lane == 0 ? col_max[j][0] : col_max[j][1]) / kE4m3Max;
    }
    float x0[4], x1[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int q = p + b, key = (q & ~31) + vt_key(q & 31);
      const uint32_t word = tile[at(key) + c];
      x0[b] = bits_to_float<T>(static_cast<uint16_t>(word & 0xFFFFu)) * inv0;
      x1[b] = bits_to_float<T>(static_cast<uint16_t>(word >> 16)) * inv1;
    }
    uint8_t* const row = vt8 + (int64_t{g} * kD + 2 * c) * vt_keys + key0 + p;
    *reinterpret_cast<uint32_t*>(row) = e4m3x4(x0[0], x0[1], x0[2], x0[3]);
    *reinterpret_cast<uint32_t*>(row + vt_keys) = e4m3x4(x1[0], x1[1], x1[2], x1[3]);
  }
}

template <typename T, bool kFp8Rows, int kD>
cudaError_t quantize(const AttnParams& p, const Layout& l, uint8_t* ws, bool hadamard,
                     cudaStream_t stream) {
  quantize_rows_kernel<T, false, kQGroupRows / kTileRows, kD>
      <<<dim3(l.q_groups, p.heads), kQGroupRows / kTileRows * 32, 0, stream>>>(
          rows_of<T>(p.q, p.q_row_stride, p.q_head_stride), p.n_q, l.q_pad, p.heads,
          hadamard ? 1 : 0, ws + l.q8, reinterpret_cast<float*>(ws + l.q_scale));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.n_kv == 0) return err;
  quantize_rows_kernel<T, kFp8Rows, kKBlockRows / kTileRows, kD>
      <<<dim3(l.k_blocks, p.kv_heads), kKBlockRows / kTileRows * 32, 0, stream>>>(
          kv_source<T, kFp8Rows>(p, p.k, p.k_row_stride, p.k_head_stride), p.n_kv, 0,
          p.kv_heads, hadamard ? 1 : 0, ws + l.k8, reinterpret_cast<float*>(ws + l.k_scale));
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  float* amax = reinterpret_cast<float*>(ws + l.v_amax);
  err = cudaMemsetAsync(amax, 0, sizeof(float) * p.kv_heads * kD, stream);
  if (err != cudaSuccess) return err;
  const auto v = kv_source<T, kFp8Rows>(p, p.v, p.v_row_stride, p.v_head_stride);
  v_amax_kernel<T, kFp8Rows, kD><<<dim3((p.n_kv + 255) / 256, p.kv_heads), 128, 0, stream>>>(
      v, p.n_kv, amax);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const dim3 vt_grid(static_cast<unsigned>(l.vt_keys / kVtKeys), p.kv_heads);
  vt_kernel<T, kFp8Rows, kD><<<vt_grid, kVtThreads, 0, stream>>>(
      v, p.n_kv, l.vt_keys, amax, ws + l.vt8, reinterpret_cast<float*>(ws + l.v_scale));
  return cudaGetLastError();
}

// quantize() for q's dtype, K and V's form and the head_dim.
template <typename T, bool kFp8Rows>
cudaError_t quantize_as(const AttnParams& p, const Layout& l, uint8_t* ws, bool hadamard,
                        cudaStream_t stream) {
  return p.head_dim == 128 ? quantize<T, kFp8Rows, 128>(p, l, ws, hadamard, stream)
                           : quantize<T, kFp8Rows, 64>(p, l, ws, hadamard, stream);
}

// p as the prefill checks know it, with K and V read as contiguous rows of values: paged K/V
// and FP8 KV rows are read by the quantizer alone (the kernel reads the workspace). FP8 rows
// need row strides of at least a row's bytes, in 16-byte multiples.
bool fp8_params_ok(const AttnParams& p) {
  if (!validate(p).empty() || p.row_kv_len) return false;
  AttnParams plain = p;
  plain.kv_pages = nullptr;
  plain.page_size = 0;
  plain.kv_fp8 = false;
  if (p.kv_fp8) {
    const int64_t need = kv_fp8_row_bytes(p.kv_heads, p.head_dim);
    if (p.k_row_stride < need || p.v_row_stride < need || p.k_row_stride % 16 != 0 ||
        p.v_row_stride % 16 != 0) {
      return false;
    }
    plain.k_row_stride = plain.v_row_stride = int64_t{p.kv_heads} * p.head_dim;
    plain.k_head_stride = plain.v_head_stride = p.head_dim;
  }
  return detail::prefill_params_ok(plain);
}

}  // namespace

bool attention_fp8_head_dim(int head_dim) { return head_dim == 128 || head_dim == 64; }

bool attention_fp8_supported(const AttnParams& p) {
  return attention_fp8_head_dim(p.head_dim) && attention_sm90_supported(p);
}

size_t attention_fp8_workspace_bytes(const AttnParams& p) {
  if (p.n_q < 0 || p.n_kv < 0 || p.heads <= 0 || p.kv_heads <= 0) return 0;
  return layout_of(p).end;
}

cudaError_t attention_fp8_cuda(const AttnParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, const Fp8AttnOptions& options) {
  if (!fp8_params_ok(p)) return cudaErrorInvalidValue;
  if (!attention_fp8_head_dim(p.head_dim)) return cudaErrorInvalidValue;
  if (options.pingpong && p.head_dim != 128) return cudaErrorInvalidValue;  // measured at 128 only
  if (options.rows != 0 && options.rows != 128 && !(options.rows == 192 && p.head_dim == 64)) {
    return cudaErrorInvalidValue;
  }
  if (p.merge_into_o && output_dtype(p) != DType::kF32) return cudaErrorInvalidValue;
  if (!attention_sm90_supported(p)) return cudaErrorInvalidDeviceFunction;
  const Layout l = layout_of(p);
  if (workspace == nullptr || workspace_bytes < l.end ||
      reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    return cudaErrorInvalidValue;
  }
  if (p.n_q == 0) return cudaSuccess;
  auto* ws = static_cast<uint8_t*>(workspace);
  const bool bf16 = p.dtype == DType::kBF16, h = options.hadamard;
  const cudaError_t err =
      p.kv_fp8 ? (bf16 ? quantize_as<__nv_bfloat16, true>(p, l, ws, h, stream)
                       : quantize_as<__half, true>(p, l, ws, h, stream))
               : (bf16 ? quantize_as<__nv_bfloat16, false>(p, l, ws, h, stream)
                       : quantize_as<__half, false>(p, l, ws, h, stream));
  if (err != cudaSuccess) return err;
  detail::Fp8Operands f{};
  f.q8 = ws + l.q8;
  f.k8 = ws + l.k8;
  f.vt8 = ws + l.vt8;
  f.q_scale = reinterpret_cast<const float*>(ws + l.q_scale);
  f.k_scale = reinterpret_cast<const float*>(ws + l.k_scale);
  f.v_scale = reinterpret_cast<const float*>(ws + l.v_scale);
  f.q_groups = l.q_groups;
  f.k_blocks = l.k_blocks;
  f.q_pad = l.q_pad;
  f.vt_keys = l.vt_keys;
  f.pingpong = options.pingpong;
  f.rows = options.rows;
  AttnParams launch = p;  // the kernel reads the workspace, never K and V where they lie
  launch.kv_pages = nullptr;
  launch.page_size = 0;
  launch.kv_fp8 = false;
  return detail::attention_sm90_fp8(launch, f, stream);
}

}  // namespace burst::kernels
