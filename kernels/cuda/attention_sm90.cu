// Flash attention forward for one ring step (LAO) on Hopper (sm_90a): the contract of
// kernels/attention_cuda.h, for head_dim 128, with warpgroup MMAs (wgmma.mma_async).
//
// One CTA of two warpgroups (256 threads) computes a 128-row query block of one head; each
// warpgroup owns 64 rows and runs S = Q.K^T as m64n128k16 wgmmas with both operands in shared
// memory, then O += P.V with P (the softmax of S, rounded to the input dtype) straight from
// registers: the S accumulator fragment of a wgmma is the A-operand fragment of the next.
// The two warpgroups are independent between barriers, so one's softmax overlaps the other's
// MMAs on the tensor cores.
// Shared memory holds Q and two stages of K and V, every tile in the 128-byte-swizzled layout
// wgmma reads (see load_tile): K[n-1] and V[n-1] stream in by cp.async while block n computes.
// Key blocks run from the last to the first, so the blocks that need masking (the causal
// diagonal, the n_kv tail) come first and the rest run without per-element checks.
#include "attention_common.cuh"

#include <algorithm>
#include <cmath>

namespace burst::kernels::detail {
namespace {

constexpr int kD = 128;
constexpr int kBlockM = 128;  // query rows per CTA: two warpgroups of 64
constexpr int kBlockN = 128;  // keys per pipeline stage
constexpr int kThreads = 256;
// A [128 rows][128] tile of 16-bit values is stored as two column halves [128 rows][64]: one
// row of a half is 128 bytes, the width of the 128-byte swizzle.
constexpr int kRowBytes = 128;
constexpr int kHalfBytes = 128 * kRowBytes;
constexpr int kTileBytes = 2 * kHalfBytes;
// Q, K stage 0/1, V stage 0/1, plus slack to align the tiles to 1024 bytes (the swizzle
// repeats every 8 rows = 1024 bytes and is applied to absolute shared-memory addresses).
constexpr int kSmemBytes = 5 * kTileBytes + 1024;
// 16-byte chunks of one tile row and the rows a pass of all threads copies.
constexpr int kRowChunks = kD / 8;
constexpr int kRowsPerPass = kThreads / kRowChunks;

static_assert(kBlockM == 2 * 64 && kThreads == 2 * 128, "one warpgroup per 64 query rows");
static_assert(kBlockM == 128 && kBlockN == 128, "tiles share load_tile and kTileBytes");
static_assert(kRowsPerPass % 8 == 0, "every pass keeps a thread on the same row % 8");
static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared-memory limit");

// The device code exists only in the sm_90a pass; the sm_80 pass and the host pass see a stub.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BURST_SM90_KERNEL 1
#endif

#ifdef BURST_SM90_KERNEL

// Shared-memory matrix descriptor of a 128-byte-swizzled operand (PTX ISA, "Matrix
// Descriptor"): start address, leading and stride byte offsets (all >> 4), swizzle mode 1.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t{(addr & 0x3FFFFu) >> 4} | (uint64_t{lbo >> 4} << 16) |
         (uint64_t{sbo >> 4} << 32) | (uint64_t{1} << 62);
}
// K-major (rows of 128 bytes, the reduction dimension contiguous): 8-row groups are 1024
// bytes apart; the leading offset is unused with a swizzle (PTX: "assumed 1").
__device__ __forceinline__ uint64_t k_major_desc(uint32_t addr) {
  return sw128_desc(addr, 16, 1024);
}
// MN-major (V as the B operand of P.V: the output dimension d contiguous): the two 64-column
// halves are kHalfBytes apart (leading offset), 8-key groups 1024 bytes apart (stride offset).
__device__ __forceinline__ uint64_t mn_major_desc(uint32_t addr) {
  return sw128_desc(addr, kHalfBytes, 1024);
}

// ---- wgmma wrappers --------------------------------------------------------------------------

// Registers the compiler must not move across the asynchronous MMA (they are read and written
// by the tensor cores between the wgmma and its wait).
template <int kN>
__device__ __forceinline__ void reg_fence(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Orders this warpgroup's earlier register and shared-memory accesses before its next wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written through the generic proxy (cp.async) is read by wgmma through the async
// proxy: each writer fences before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define BURST_D8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define BURST_D64                                                                       \
  BURST_D8(0), BURST_D8(8), BURST_D8(16), BURST_D8(24), BURST_D8(32), BURST_D8(40), \
      BURST_D8(48), BURST_D8(56)
#define BURST_R64                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d[64] += A.B for a 64 x 128 x 16 slice: A (64 x 16) and B (128 x 16) K-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BURST_R64
                 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : BURST_D64
                 : "l"(desc_a), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BURST_R64
                 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : BURST_D64
                 : "l"(desc_a), "l"(desc_b));
  }
}

// d[64] += A.B for a 64 x 128 x 16 slice: A (64 x 16) in registers (the m16n8k16 A fragment
// of each warp's 16 rows), B (16 x 128) MN-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BURST_R64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : BURST_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BURST_R64
                 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : BURST_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

#undef BURST_D8
#undef BURST_D64
#undef BURST_R64

// Copies rows [0, 128) of a [rows, 128] tile starting at g into the swizzled layout at s: row r,
// 16-byte chunk c (8 values) goes to half c / 8, byte r * 128 + ((c % 8) ^ (r % 8)) * 16 (the
// 128-byte swizzle wgmma expects, which also keeps cp.async stores conflict-free). Rows >=
// rows_valid are zero-filled without reading global memory (g itself is always a valid row).
template <typename T>
__device__ __forceinline__ void load_tile(uint8_t* s, const T* g, int64_t row_stride,
                                          int rows_valid, int tid) {
  const int row0 = tid / kRowChunks, c = tid % kRowChunks;  // 16 threads: one 256-byte row
  const T* src = g + row0 * row_stride + c * 8;
  uint8_t* dst = s + (c >> 3) * kHalfBytes + row0 * kRowBytes + (((c & 7) ^ (row0 & 7)) << 4);
#pragma unroll
  for (int i = 0; i < 128 / kRowsPerPass; ++i) {
    const bool ok = row0 + i * kRowsPerPass < rows_valid;
    cp_async_16(dst + i * kRowsPerPass * kRowBytes, ok ? src : g, ok ? 16 : 0);
    src += kRowsPerPass * row_stride;
  }
}

#endif  // BURST_SM90_KERNEL

// ---- the kernel ------------------------------------------------------------------------------

template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads, 1) attention_sm90_kernel(const KernelArgs<T, OutT> a) {
#ifdef BURST_SM90_KERNEL
  constexpr float kNegInf = -INFINITY;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_addr);
  // Tiles: Q, K stage 0, K stage 1, V stage 0, V stage 1.
  uint8_t* s_q = smem;
  auto s_k = [&](int stage) { return smem + (1 + stage) * kTileBytes; };
  auto s_v = [&](int stage) { return smem + (3 + stage) * kTileBytes; };

  // Causal: the last query blocks see the most keys; launching them first shortens the tail.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int g = h / a.group;
  const int m0 = m_block * kBlockM;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int rows_valid = min(kBlockM, a.n_q - m0);

  // Keys [0, n_end) are visible to at least one row of the block; all others are skipped.
  int n_end = a.n_kv;
  if (a.causal) {
    const int64_t last_row = m0 + rows_valid - 1;
    n_end = static_cast<int>(std::clamp<int64_t>(last_row + a.delta + 1, 0, a.n_kv));
  }
  // Blocks n with (n + 1) * kBlockN - 1 <= min_limit are fully visible to every row: no mask.
  const int min_limit =
      a.causal ? static_cast<int>(std::clamp<int64_t>(m0 + a.delta, -1, a.n_kv - 1))
               : a.n_kv - 1;
  const int n_blocks = (n_end + kBlockN - 1) / kBlockN;

  // This thread's two rows (hf = 0, 1): m0 + wg * 64 + warp * 16 + lane / 4 + hf * 8. limit is
  // the last key the row may see (-1: none); it also excludes the zero-filled n_kv tail.
  int limit[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int64_t row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
    limit[hf] = a.causal
                    ? static_cast<int>(std::clamp<int64_t>(row + a.delta, -1, a.n_kv - 1))
                    : a.n_kv - 1;
  }

  // Accumulator fragments (m64n128, fp32): element 4j + e is row hf = e / 2, column
  // 8j + 2 * (lane % 4) + e % 2 of this thread's rows.
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.f, 0.f};  // max in raw score units

  const T* q_base = a.q + int64_t{m0} * a.q_row_stride + int64_t{h} * a.q_head_stride;
  const T* k_base = a.k + int64_t{g} * a.k_head_stride;
  const T* v_base = a.v + int64_t{g} * a.v_head_stride;

  if (n_blocks > 0) {
    load_tile(s_q, q_base, a.q_row_stride, rows_valid, tid);
    const int n = n_blocks - 1;
    load_tile(s_k(0), k_base + int64_t{n} * kBlockN * a.k_row_stride, a.k_row_stride,
              a.n_kv - n * kBlockN, tid);
    load_tile(s_v(0), v_base + int64_t{n} * kBlockN * a.v_row_stride, a.v_row_stride,
              a.n_kv - n * kBlockN, tid);
    cp_async_commit();
  }
  // Q rows of this warpgroup: 64 rows = 8 groups of 8 at 1024 bytes.
  const uint32_t q_addr = smem_addr(s_q) + wg * 64 * kRowBytes;

  for (int it = 0; it < n_blocks; ++it) {
    const int n = n_blocks - 1 - it, st = it & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    // Block n (stage st) copied by all threads is now visible to every warpgroup's wgmma; and
    // every warpgroup has finished iteration it - 1 (its wgmmas waited for), so stage st ^ 1
    // that it read may be overwritten by block n - 1.
    __syncthreads();
    if (n > 0) {
      load_tile(s_k(st ^ 1), k_base + int64_t{n - 1} * kBlockN * a.k_row_stride,
                a.k_row_stride, a.n_kv - (n - 1) * kBlockN, tid);
      load_tile(s_v(st ^ 1), v_base + int64_t{n - 1} * kBlockN * a.v_row_stride,
                a.v_row_stride, a.n_kv - (n - 1) * kBlockN, tid);
      cp_async_commit();
    }

    // S = Q.K^T: 8 k16 slices of head_dim; slice ks is half ks / 4, bytes 32 * (ks % 4) into
    // each 128-byte row (the hardware applies the swizzle to the advanced address).
    float s[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) s[i] = 0.f;
    const uint32_t k_addr = smem_addr(s_k(st));
    reg_fence(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks >> 2) * kHalfBytes + (ks & 3) * 32;
      wgmma_ss<T>(s, k_major_desc(q_addr + off), k_major_desc(k_addr + off));
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);

    // Mask only the blocks that need it: the causal diagonal and the n_kv tail (whose keys
    // were zero-filled and must not count). Masked scores become -inf, so exp2 gives 0.
    if ((n + 1) * kBlockN - 1 > min_limit) {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        const int key = n * kBlockN + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
        if (key > limit[(i >> 1) & 1]) s[i] = kNegInf;
      }
    }

    // Online softmax, per row: new max, rescale what was accumulated, P = exp2(scaled - max).
    uint32_t pa[32];  // P rounded to T: element 2j + hf packs columns 8j + 2 * (lane % 4) + {0,1}
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = row_max[hf];
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
      // The 4 threads of a quad hold the same row.
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen only masked keys keeps max -inf: use 0 as the offset so that
      // exp2(-inf - offset) = 0 instead of exp2(-inf + inf) = NaN, and leave o (all 0).
      const float offset = mx == kNegInf ? 0.f : mx * a.scale_log2;
      const float corr = exp2_approx(row_max[hf] * a.scale_log2 - offset);
      row_max[hf] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float p0 = exp2_approx(fmaf(s[4 * j + 2 * hf], a.scale_log2, -offset));
        const float p1 = exp2_approx(fmaf(s[4 * j + 2 * hf + 1], a.scale_log2, -offset));
        sum += p0 + p1;
        pa[2 * j + hf] = pack2<T>(p0, p1);
      }
      // The sum keeps the unrounded P (as the fp32 reference does); it stays per thread until
      // the epilogue's quad reduction.
      row_sum[hf] = row_sum[hf] * corr + sum;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j + 2 * hf] *= corr;
        o[4 * j + 2 * hf + 1] *= corr;
      }
    }

    // O += P.V: k16 slice kk covers keys 16kk..16kk+15, i.e. S column blocks 2kk and 2kk+1,
    // whose C fragments are exactly the A fragment (rows r, r+8 x keys 2t, 2t+1, then +8).
    // V's slice kk starts 16 rows (2048 bytes, a whole number of swizzle repeats) further.
    const uint32_t v_addr = smem_addr(s_v(st));
    reg_fence(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t pf[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma_rs<T>(o, pf, mn_major_desc(v_addr + kk * 16 * kRowBytes));
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
  }

  // Epilogue: normalise and write this thread's rows. A row that saw a key has sum >= 1 (its
  // max term is exp2(0)); sum == 0 means it saw none: O = 0, LSE = -inf.
  OutT* o_base = a.o + int64_t{h} * a.o_head_stride;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = row_sum[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
    if (row >= a.n_q) continue;
    const bool empty = !(sum > 0.f);
    const float inv = empty ? 0.f : 1.f / sum;
    OutT* o_row = o_base + int64_t{row} * a.o_row_stride;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      store2(o_row + j * 8 + (lane & 3) * 2, o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
    }
    if ((lane & 3) == 0) {
      a.lse[int64_t{h} * a.lse_head_stride + row] =
          empty ? kNegInf : row_max[hf] * a.scale + logf(sum);
    }
  }
#else
  // Built for another architecture: attention_sm90 never launches this (it checks the device).
  __trap();
#endif
}

template <typename T, typename OutT>
cudaError_t launch(const AttnParams& p, cudaStream_t stream) {
  const KernelArgs<T, OutT> a = make_kernel_args<T, OutT>(p);
  auto* kernel = attention_sm90_kernel<T, OutT>;
  // Above 48 KiB a kernel must opt in to dynamic shared memory (per device, so every call).
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.n_q + kBlockM - 1) / kBlockM, p.heads);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_out(const AttnParams& p, cudaStream_t stream) {
  return output_dtype(p) == DType::kF32 ? launch<T, float>(p, stream) : launch<T, T>(p, stream);
}

}  // namespace

cudaError_t attention_sm90(const AttnParams& p, cudaStream_t stream) {
  if (p.head_dim != kD) return cudaErrorInvalidValue;
  return p.dtype == DType::kBF16 ? dispatch_out<__nv_bfloat16>(p, stream)
                                 : dispatch_out<__half>(p, stream);
}

}  // namespace burst::kernels::detail
