// Flash attention forward for one ring step (LAO) on Hopper (sm_90a): the contract of
// kernels/attention_cuda.h, for head_dim 128 and 64, with warpgroup MMAs (wgmma.mma_async).
//
// A CTA computes query blocks of one head ("tiles" of 128 rows, or 192 at head_dim 64; a few
// in turn where there are few a multiprocessor, see TileOrder) with two (three) consumer
// warpgroups and a producer warpgroup that only loads. Each consumer warpgroup owns 64 rows
// and runs S = Q.K^T as
// m64n128k16 wgmmas with both operands in shared memory, then O += P.V with P (the softmax of
// S, rounded to the input dtype) straight from registers: the S accumulator fragment of a wgmma
// is the A-operand fragment of the next.
// The code issues the P.V of block i - 1 before the softmax of block i and waits for it after,
// but ptxas moves that wait to the top of its basic block, ahead of the softmax (the SASS shows
// it): a warpgroup's softmax overlaps the other warpgroup's MMAs, not its own. Moving the wait
// past a block boundary (after the next block's full-barrier wait) restored the overlap and
// ran slower (H200: bf16 0.82-0.86x, fp8 0.86-1.00x; the second P buffer it needs spilled).
// Loads are TMA (cp.async.bulk.tensor) issued by one thread of the producer warpgroup into a
// ring of K+V tiles (3 stages at head_dim 128, 6 at 64) in the 128-byte-swizzled layout wgmma
// reads; mbarriers say when a stage is full (TMA bytes arrived) and empty (all consumer warps
// done reading it), so the warpgroups are not held in lockstep by CTA-wide barriers and one's
// softmax overlaps the other's MMAs. The producer gives its registers to the consumers
// (setmaxnreg 24 / 240): with the loads issued by a consumer thread instead, that thread's warp
// waited for the slower warpgroup before every refill (H100: 547-567 TFLOP/s then, 512-642
// now). Ping-pong turns between the two consumer warpgroups (named barriers around their MMA
// issue) were measured on top of this and gained nothing (626-646 TFLOP/s), so they are not
// used. At head_dim 64 the exp2s of the softmax (MUFU) take as long as the MMAs; computing a
// share of them with a polynomial on the FMA units instead (1/16 to 1/4 of them) was measured
// slower at every share (H100: 460 -> 445, 425, 375 TFLOP/s at 64K causal), ping-pong lost
// 2-3 % there too, and a third consumer warpgroup (192-row tiles, one P fragment on 160
// registers) gained 6-11 %: that is the head_dim 64 shape (Sm90Tile, attention_sm90()).
// Key blocks run from the last to the first, so the blocks that need masking (the causal
// diagonal, the n_kv tail) come first and the rest run without per-element checks.
#include <cuda.h>  // CUtensorMap (types only: the encoder comes from the runtime)
#include <cudaTypedefs.h>

#include "attention_common.cuh"

#include <algorithm>
#include <cmath>

namespace burst::kernels::detail {
namespace {

constexpr int kBlockN = 128;  // keys per pipeline stage
// A [rows][head_dim] tile of 16-bit values is stored as head_dim / 64 column halves
// [rows][64]: one row of a half is 128 bytes, the width of the 128-byte swizzle.
constexpr int kRowBytes = 128;
constexpr int kHalfBytes = kBlockN * kRowBytes;  // a half of a K or V tile
constexpr int kQBoxRows = 64;                    // Q arrives in boxes of one warpgroup's rows

// The shape of the kernel for one head_dim (64 or 128) and number of consumer warpgroups (2 or
// 3, each owning 64 query rows); everything else derives from it.
// kElemBytes: 2 for bf16 / f16 operands, 1 for e4m3 (attention_sm90_fp8: a row of Q or K is one
// 128-byte swizzle row at head_dim 128, one 64-byte row with the 64-byte swizzle at head_dim 64,
// and V arrives transposed, see there).
template <int kHeadDim, int kWarpgroups, int kElemBytes = 2>
struct Sm90Tile {
  static constexpr int kD = kHeadDim;
  static constexpr int kWG = kWarpgroups;
  static constexpr bool kFp8 = kElemBytes == 1;
  static constexpr int kBlockM = 64 * kWG;  // query rows per tile
  static constexpr int kConsumerThreads = 128 * kWG;
  // Warp specialisation: one more warpgroup only issues the TMA loads, on 24 registers; the
  // consumers get the rest (setmaxnreg: 128 x 24 + 256 x 240 or 384 x 160 <= 64K).
  static constexpr int kThreads = kConsumerThreads + 128;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kWG == 2 ? 240 : 160;
  // With 160 registers there is room for one P fragment only (O 32 + S 64 + P 32 at head_dim
  // 64): the softmax leaves exp2 values in S and they become P once the last P.V is done.
  // fp8 keeps one: its softmax leaves P's codes in S (softmax_fp8), and O's wgmma also sums
  // P's rows (4 more accumulators), which with a second P buffer left ptxas too few registers
  // (it serialised the wgmmas).
  static constexpr bool kTwoP = kWG == 2 && !kFp8;
  // The bytes of a row of a Q or K column half, which is also the swizzle's width: 128, or 64
  // for fp8 at head_dim 64 (wgmma and TMA then use the 64-byte swizzle).
  static constexpr int kQKRowBytes = kD * kElemBytes >= kRowBytes ? kRowBytes : kD * kElemBytes;
  // Column halves a row of Q, K or V spans (fp8: one).
  static constexpr int kHalves = kD * kElemBytes / kQKRowBytes;
  static constexpr int kTileBytes = kHalves * kBlockN * kQKRowBytes;
  static constexpr int kQHalfBytes = kBlockM * kQKRowBytes;
  static constexpr int kQBytes = kHalves * kQHalfBytes;
  // K+V tiles in flight: head_dim 64 tiles are half the size, so twice as many fit.
  // fp8 tiles are half the bytes of bf16 ones at head_dim 128: 5 stages fit where 3 did; at
  // head_dim 64 a quarter, and a block's MMAs take half the time: 8.
  static constexpr int kStages = kFp8 ? (kD == 64 ? 8 : 5) : kD == 64 ? 6 : 3;
  // P as the A operand of P.V: 32 registers of two 16-bit values, or 16 of four e4m3.
  static constexpr int kPRegs = kFp8 ? 16 : 32;
  // K, then V (fp8: V^T, then 8 rows of e4m3 ones: the wgmma that adds P.V^T also sums P's
  // rows into its columns kD..kD + 7; wgmma_rs_fp8).
  static constexpr int kOnesBytes = kFp8 ? 1024 : 0;
  static constexpr int kStageBytes = 2 * kTileBytes + kOnesBytes;
  // Q, the stages, 1024 bytes of slack to align the tiles to 1024 (the swizzle repeats every 8
  // rows = 1024 bytes and is applied to absolute shared-memory addresses), then the mbarriers.
  static constexpr int kBarrierBytes = 8 * (2 + 2 * kStages);
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + 1024 + kBarrierBytes;

  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  static_assert(!kFp8 || kTileBytes == kD * kBlockN, "fp8: the V^T tile is the K tile's size");
  static_assert(kWG == 2 || (kWG == 3 && kD == 64), "3 warpgroups fit 160 registers at 64 only");
  static_assert(!kTwoP || kConsumerRegs >= 240, "two P fragments need 240 registers");
  static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumerThreads <= 65536, "registers");
  static_assert(kQHalfBytes % 1024 == 0, "Q halves keep the swizzle's 1024-byte alignment");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared-memory limit");
};

// The device code exists only in the sm_90a pass; the sm_80 pass and the host pass see a stub.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BURST_SM90_KERNEL 1
#endif

#ifdef BURST_SM90_KERNEL

// Shared-memory matrix descriptor of a swizzled operand (PTX ISA, "Matrix Descriptor"): start
// address, leading and stride byte offsets (all >> 4), swizzle mode 1 (128 bytes) or 2 (64).
__device__ __forceinline__ uint64_t sw_desc(uint32_t addr, uint32_t lbo, uint32_t sbo,
                                            uint32_t mode) {
  return uint64_t{(addr & 0x3FFFFu) >> 4} | (uint64_t{lbo >> 4} << 16) |
         (uint64_t{sbo >> 4} << 32) | (uint64_t{mode} << 62);
}
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return sw_desc(addr, lbo, sbo, 1);
}
// K-major (rows of kSwizzle = 128 or 64 bytes, the swizzle's width, the reduction dimension
// contiguous): 8-row groups are 8 rows apart; the leading offset is unused with a swizzle (PTX:
// "assumed 1").
template <int kSwizzle = 128>
__device__ __forceinline__ uint64_t k_major_desc(uint32_t addr) {
  static_assert(kSwizzle == 128 || kSwizzle == 64, "the 128- or 64-byte swizzle");
  return sw_desc(addr, 16, 8 * kSwizzle, kSwizzle == 128 ? 1 : 2);
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
template <int kN>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Descriptors computed before the wgmmas that use them, not between (ptxas serialises a wgmma
// pipeline stage in which other instructions define wgmma inputs).
template <int kN>
__device__ __forceinline__ void desc_fence(uint64_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+l"(r[i])::"memory");
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

#define BURST_D8(i)                                                                          \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define BURST_D64                                                                       \
  BURST_D8(0), BURST_D8(8), BURST_D8(16), BURST_D8(24), BURST_D8(32), BURST_D8(40), \
      BURST_D8(48), BURST_D8(56)
#define BURST_D32 BURST_D8(0), BURST_D8(8), BURST_D8(16), BURST_D8(24)
#define BURST_R32_BODY                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define BURST_R32 "{" BURST_R32_BODY "}"
#define BURST_R64_BODY                                                                       \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define BURST_R64 "{" BURST_R64_BODY "}"

// d[64] = A.B (+ d[64] if accumulate) for a 64 x 128 x 16 slice: A (64 x 16) and B (128 x 16)
// K-major in shared memory. accumulate = 0 ignores d's old contents (no zeroing needed).
// For e4m3 the slice is 64 x 128 x 32 (32 bytes of the reduction dimension, as 16 bf16 are).
template <typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                         int accumulate) {
  if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
    // fp8 operands have no transpose immediates: both must be K-major (they are).
    asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " BURST_R64
                 ", %64, %65, acc, 1, 1;\n}\n"
                 : BURST_D64
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " BURST_R64
                 ", %64, %65, acc, 1, 1, 0, 0;\n}\n"
                 : BURST_D64
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred acc;\nsetp.ne.b32 acc, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " BURST_R64
                 ", %64, %65, acc, 1, 1, 0, 0;\n}\n"
                 : BURST_D64
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

// d[kN / 2] += A.B for a 64 x kN x 16 slice (kN = head_dim, 64 or 128): A (64 x 16) in
// registers (the m16n8k16 A fragment of each warp's 16 rows), B (16 x kN) MN-major in shared
// memory.
template <typename T, int kN>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  static_assert(kN == 64 || kN == 128, "n64 or n128");
  if constexpr (kN == 64 && std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " BURST_R32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : BURST_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else if constexpr (kN == 64) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " BURST_R32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : BURST_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
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

// [d, sum][kD / 2 + 4] += P.[V^T; ones]-slice for e4m3, m64n(kD + 8)k32: A (64 x 32 keys) in
// registers, four e4m3 a register (the k32 A fragment: rows lane / 4 (+ 8 in registers 1 and
// 3), keys 4 (lane % 4) + byte, + 16 in registers 2 and 3); B (head_dim rows, then 8 rows of
// ones, x 32 keys) K-major in shared memory: the V tile arrives transposed, since fp8 wgmma reads
// no MN-major operand. Columns kD..kD + 7 (sum) are P's row sums.
template <int kD>
__device__ __forceinline__ void wgmma_rs_fp8(float (&d)[kD / 2], float (&sum)[4],
                                             const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(kD == 64 || kD == 128, "n72 or n136");
  if constexpr (kD == 128) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n136k32.f32.e4m3.e4m3 {" BURST_R64_BODY
                 ", %64, %65, %66, %67}, {%68, %69, %70, %71}, %72, 1, 1, 1;\n"
                 : BURST_D64, "+f"(sum[0]), "+f"(sum[1]), "+f"(sum[2]), "+f"(sum[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 {" BURST_R32_BODY
                 ", %32, %33, %34, %35}, {%36, %37, %38, %39}, %40, 1, 1, 1;\n"
                 : BURST_D32, "+f"(sum[0]), "+f"(sum[1]), "+f"(sum[2]), "+f"(sum[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}

#undef BURST_D8
#undef BURST_D32
#undef BURST_D64
#undef BURST_R32
#undef BURST_R32_BODY
#undef BURST_R64
#undef BURST_R64_BODY

// mbarriers (PTX "mbarrier"): a phase completes when `count` arrivals and the expected TMA
// bytes have come; waiters name the parity of the phase they wait for.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// One [box rows][64 columns] box of a [rows][heads][head_dim] tensor into shared memory at dst,
// swizzled by the tensor map (128B); rows past the tensor's end arrive as zeros. Completion is
// counted in bytes on bar.
__device__ __forceinline__ void tma_load_box(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                             int col, int head, int row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(col), "r"(head), "r"(row)
      : "memory");
}
// A whole [128][kD] K or V tile: its kHalves 128-byte column halves (64 16-bit columns each;
// an fp8 row is one, of 128 or 64 bytes).
template <int kHalves>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                              int head, int row) {
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    tma_load_box(dst + half * kHalfBytes, map, bar, half * 64, head, row);
  }
}

template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

#endif  // BURST_SM90_KERNEL

// ---- the kernel ------------------------------------------------------------------------------

// With more tiles than these a multiprocessor (causal, full), the kernel runs one CTA a tile
// (launch()). Measured (docs/benchmarks.md, H100 and H200): persistent, 4K tokens gained 1-8 %
// (head_dim 64 and 128, both masks) and 16K full 1-2 %; 16K causal at head_dim 128 (31 tiles a
// multiprocessor) lost 5-8 % and 64K 0.3-1 % to the one-CTA-a-tile launch.
constexpr int kPersistentCausalTiles = 16;
constexpr int kPersistentFullTiles = 64;

// The split tail (TileOrder): a tile is cut into at most kMaxSplitParts key ranges, a CTA's
// share of the tail is at least kMinSplitBlocks key blocks, and a launch's pieces (a tile's
// key range computed by one CTA) number fewer than kSplitSlots (the workspace: a piece's rows,
// kBlockM x kD fp32, and their LSE; a count a split tile and warp). Pieces number at most
// tail tiles + tail CTAs, both under the multiprocessor count (132 on an H100 or H200).
constexpr int kMaxSplitParts = 4;
constexpr int kMinSplitBlocks = 4;
constexpr int kSplitSlots = 264;
constexpr int kSplitPartFloats = 128 * 128;
constexpr int kSplitPartRows = 192;
constexpr int kMaxConsumerWarps = 12;
static_assert(Sm90Tile<64, 3>::kBlockM * 64 <= kSplitPartFloats &&
                  Sm90Tile<128, 2>::kBlockM * 128 <= kSplitPartFloats &&
                  Sm90Tile<64, 3>::kBlockM <= kSplitPartRows &&
                  Sm90Tile<64, 3>::kConsumerThreads / 32 <= kMaxConsumerWarps,
              "a split part's rows fit the workspace");
}  // namespace
// (Declared in every pass, the host registers them, outside the anonymous namespace, where the
// sm_80 pass, which never reads them, would warn; 17.5 MB a device, allocated when the module
// loads.)
__device__ float g_split_o[kSplitSlots * kSplitPartFloats];
__device__ float g_split_lse[kSplitSlots * kSplitPartRows];
__device__ unsigned g_split_count[kSplitSlots * kMaxConsumerWarps];  // zero between launches
namespace {

// Which (head, query block) tiles a CTA computes, and in what order. Where there are few tiles
// a multiprocessor the kernel is persistent: one CTA per multiprocessor, each looping over its
// tiles, so a tile's first loads (Q, K/V) are issued while the tile before finishes (its last
// softmax, P.V and epilogue) instead of after a new CTA starts (at 4K tokens a tile is only ~32
// key blocks, so those costs show). Otherwise one CTA per tile (the grid is `tiles` CTAs: each
// CTA's loop runs once). Tiles are numbered head-major (t = head * m_blocks + pos, query block
// m_blocks - 1 - pos: the last, under a causal mask the longest, first), and round r gives CTA
// c tile r * gridDim.x + c, so the CTAs working at one time share a few heads' K/V in L2.
// A persistent causal launch ("snake") instead takes the tiles longest first across all heads
// (index i = pos * heads + head) and deals them out in rounds whose direction alternates: CTA c
// gets index r * gridDim.x + c in even rounds and r * gridDim.x + gridDim.x - 1 - c in odd ones,
// so the CTA that took the longest tile of one round takes the shortest of the next and every
// CTA's key blocks add up to within about one tile's of the mean. (The pairs it replaced, the
// longest and the shortest query block of a head in each round, all cost m_blocks + 1 blocks:
// 4K tokens at head_dim 64 made 7.8 rounds of them on 132 multiprocessors, the last a quarter
// idle, and 192-row tiles lost there; dealt as a snake they gain 5-9 %: docs/benchmarks.md.)
// A persistent full launch whose full tiles leave the last round short of a whole one ("split
// tail") runs the whole rounds of full tiles as above (head-major), then deals the key blocks
// of the full tiles left over out evenly, as one run (tile after tile), to `tail_ctas` CTAs,
// beside the short first blocks (n_q not a multiple of the tile) on the CTAs after those: CTA
// c takes blocks [c U / tail_ctas, (c + 1) U / tail_ctas) of the U, a range that may end in
// one tile and go on in the next ("stream-K"), so the last round costs about U / tail_ctas
// blocks instead of a whole tile. 4K tokens at head_dim 128 are 32 tiles a head: 32 heads make
// 1024 on 132 multiprocessors, seven rounds and 100 tiles over, about 24 of a tile's 32 key
// blocks a CTA; at head_dim 64, 21 full tiles of 192 rows and a short one a head, 1344 full
// tiles, ten rounds and 24 over, cut in 68 ranges of 11-12 blocks beside the 64 short blocks.
// (Where tail_ctas is a multiple of the tiles left over, each is cut into that many equal
// parts.) Each piece of a cut tile writes its normalised rows (fp32) and LSE to a workspace;
// the last piece of a warp's rows to arrive merges them all in key order (so the result does
// not depend on which arrives last) and writes O. Nothing waits for another CTA.
struct TileOrder {
  int m_blocks;  // query blocks per head
  int tiles;     // m_blocks x heads
  int heads;     // query heads
  int snake;     // persistent causal: the order above
  // Split tail (tail_ctas > 0; 0 otherwise): `whole` full tiles run whole (a multiple of the
  // CTA count), then the key blocks of `split` full tiles (`tail_blocks` each) dealt out to
  // CTAs [0, tail_ctas), and `short_tiles` short blocks to the CTAs after them.
  int tail_ctas, tail_blocks, tail_units, whole, split, short_tiles;
  int full_per_head;  // m_blocks, less the short first block where there is one
  // CTA c's share of the tail's tail_units = split x tail_blocks key blocks starts at block
  // tail_start(c) (tail_start(tail_ctas) = tail_units); the products fit an int (plan_launch).
  // tail_units is kept, not recomputed: recomputed in the kernel it took a register, and the
  // two-warpgroup kernels spilled 4 bytes.
  __host__ __device__ int tail_start(int c) const { return c * tail_units / tail_ctas; }
  // The CTA whose share holds tail block u.
  __host__ __device__ int tail_cta(int u) const {
    return ((u + 1) * tail_ctas - 1) / tail_units;
  }
  // How many CTAs compute a piece of tail tile t (1: one computes it whole).
  __host__ __device__ int tail_parts(int t) const {
    return tail_cta((t + 1) * tail_blocks - 1) - tail_cta(t * tail_blocks) + 1;
  }
  // A CTA's work in one round: a tile (t = head * m_blocks + pos) whole (part -1), or key
  // blocks [lo, hi) of it, piece `part` of `parts` (in key order) of a split tile, whose pieces
  // have workspace slots slot, slot + 1, ... (and whose warps count their pieces at slot);
  // tile -1: no more work.
  struct Work {
    int tile, part, parts, slot, lo, hi;
  };
  // Tile number of snake index i: i = pos * heads + head.
  __host__ __device__ int tile_of(int i) const { return (i % heads) * m_blocks + i / heads; }
  // Full tile f (head-major, short blocks left out) and short block of head j.
  __host__ __device__ int full_tile(int f) const {
    return f / full_per_head * m_blocks + f % full_per_head;
  }
  // The work of CTA c of the launch's g in round r (the kernel's: at(r, gridDim.x, blockIdx.x);
  // the host lists a launch's for tests, attention_sm90_schedule).
  __host__ __device__ Work at(int r, int g, int c) const {
    constexpr Work kNone{-1, -1, 0, 0, 0, 0};
    const int i = r * g + (snake && (r & 1) ? g - 1 - c : c);
    if (tail_ctas == 0) {
      if (i >= tiles) return kNone;
      return {snake ? tile_of(i) : i, -1, 0, 0, 0, 0};
    }
    if (i < whole) return {full_tile(i), -1, 0, 0, 0, 0};
    const int k = r - whole / g;  // the CTA's k-th piece of the tail (whole is a multiple of g)
    if (c >= tail_ctas) {
      const int j = c - tail_ctas;
      return k == 0 && j < short_tiles ? Work{j * m_blocks + m_blocks - 1, -1, 0, 0, 0, 0}
                                       : kNone;
    }
    const int b0 = tail_start(c), b1 = tail_start(c + 1);
    const int t = b0 / tail_blocks + k, t0 = t * tail_blocks;
    if (t0 >= b1) return kNone;
    const int lo = std::max(b0, t0) - t0, hi = std::min(b1, t0 + tail_blocks) - t0;
    const int tile = full_tile(whole + t);
    if (lo == 0 && hi == tail_blocks) return {tile, -1, 0, 0, 0, 0};
    const int first = tail_cta(t0);
    return {tile, c - first, tail_parts(t), t + first, lo, hi};
  }
#ifdef BURST_SM90_KERNEL
  __device__ int m_block(int pos) const { return m_blocks - 1 - pos; }
#endif
};

// kPingPong (two warpgroups): the warpgroups take turns to issue their MMAs (named barriers
// 1 and 2), so that one's softmax runs while the other's MMAs do (FlashAttention-3's
// scheduling); see turn_wait.
template <typename T, typename OutT, int kD, int kWG, bool kPingPong = false>
__global__ void __launch_bounds__(Sm90Tile<kD, kWG>::kThreads, 1)
    attention_sm90_kernel(const KernelArgs<T, OutT> a, const __grid_constant__ CUtensorMap q_map,
                          const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const TileOrder order) {
#ifdef BURST_SM90_KERNEL
  using Tl = Sm90Tile<kD, kWG, sizeof(T)>;
  constexpr bool kFp8 = Tl::kFp8;
  constexpr int kPRegs = Tl::kPRegs;
  constexpr int kTileBytes = Tl::kTileBytes, kStages = Tl::kStages, kStageBytes = Tl::kStageBytes;
  constexpr int kBlockM = Tl::kBlockM, kConsumerThreads = Tl::kConsumerThreads;
  constexpr int kQBytes = Tl::kQBytes, kQHalfBytes = Tl::kQHalfBytes;
  constexpr int kQKRowBytes = Tl::kQKRowBytes;  // 128, or 64 for fp8 at head_dim 64
  constexpr int kOAcc = kD / 2;  // fp32 O accumulators per thread (m64 x kD wgmma)
  constexpr float kNegInf = -INFINITY;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  // Shared memory: Q, stage 0 (K, V), stage 1, stage 2, mbarriers. Addresses as wgmma, TMA and
  // mbarrier take them (shared window, 32 bits).
  const uint32_t q_addr0 = base;
  auto k_tile = [&](int stage) { return base + kQBytes + stage * kStageBytes; };
  auto v_tile = [&](int stage) { return k_tile(stage) + kTileBytes; };
  const uint32_t bar_q = base + kQBytes + kStages * kStageBytes;
  const uint32_t bar_q_empty = bar_q + 8;
  auto bar_full = [&](int stage) { return bar_q + 8 * (2 + stage); };
  auto bar_empty = [&](int stage) { return bar_q + 8 * (2 + kStages + stage); };

  // With three warpgroups (head_dim 64) the warpgroup is broadcast from lane 0, so that the
  // compiler knows it is the same across the warp: a branch on it (an idle warpgroup's, below)
  // then leaves the consumers' address arithmetic on the uniform datapath (without, ptxas moved
  // it to vector registers and every launch ran 3-9 % slower). At head_dim 128 the broadcast
  // alone cost 1-3 % and no warpgroup idles (docs/benchmarks.md, 2026-11-27 session 19).
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int wg = kWG == 3 ? __shfl_sync(0xffffffffu, tid >> 7, 0) : tid >> 7;
  if constexpr (kFp8) {
    // Each stage's ones rows (e4m3 1.0 = 0x38; TMA never writes them), written once, then made
    // visible to the async proxy that wgmma reads shared memory through (the __syncthreads
    // below orders the threads).
    for (int w = tid; w < kStages * Tl::kOnesBytes / 4; w += blockDim.x) {
      const int st = w / (Tl::kOnesBytes / 4), at = w % (Tl::kOnesBytes / 4);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(v_tile(st) + kTileBytes + 4 * at),
                   "r"(0x38383838u)
                   : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  if (tid == 0) {
    mbar_init(bar_q, 1);
    mbar_init(bar_q_empty, kConsumerThreads / 32);  // one arrival per consumer warp
    for (int st = 0; st < kStages; ++st) {
      mbar_init(bar_full(st), 1);                 // the loading thread's expect_tx
      mbar_init(bar_empty(st), kConsumerThreads / 32);  // one arrival per consumer warp
    }
    // Makes the initialised barriers visible to the async proxy (TMA) and the other threads.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The CTA's tiles (TileOrder): head h, query rows [m0, m0 + rows_valid), n_blocks key blocks
  // ending before block top (top = n_blocks but for a part of a split tile). Key blocks past
  // n_end are skipped; blocks n with (n + 1) * kBlockN - 1 <= min_limit are fully visible to
  // every row: no mask. limit[hf] is the last key this thread's row hf may see (-1: none;
  // it also excludes the zero-filled n_kv tail); its rows are m0 + wg * 64 + warp * 16 +
  // lane / 4 + hf * 8.
  int h = 0, g = 0, m0 = 0, rows_valid = 0, n_blocks = 0, top = 0, min_limit = 0;
  int limit[2] = {-1, -1};
  auto set_tile = [&](const TileOrder::Work& w) {
    const int t = w.tile, pos = t % order.m_blocks;
    h = t / order.m_blocks;
    g = h / a.group;
    // Query blocks end at n_q: where n_q is not a multiple of kBlockM the first block starts
    // before row 0 (those rows load as zeros and are not written), so the short block is the
    // one that sees the fewest keys under a causal mask rather than the one that sees the most.
    m0 = order.m_block(pos) * kBlockM - (order.m_blocks * kBlockM - a.n_q);
    rows_valid = min(kBlockM, a.n_q - m0);
    const auto [n_end, min_visible] = visible_keys(a, m0, rows_valid);
    n_blocks = top = (n_end + kBlockN - 1) / kBlockN;
    if (w.part >= 0) {  // a piece of a split tile: key blocks [lo, hi)
      top = w.hi;
      n_blocks = w.hi - w.lo;
    }
    min_limit = min_visible;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
      limit[hf] = a.causal
                      ? static_cast<int>(std::clamp<int64_t>(row + a.delta, -1, a.n_kv - 1))
                      : a.n_kv - 1;
    }
  };
  // This CTA's work in round r (TileOrder).
  auto work_of = [&](int r) {
    return order.at(r, static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x));
  };
  // Key blocks and Q tiles are counted across the CTA's tiles: block i of a tile is the
  // (done + i)-th the CTA loads, into stage (done + i) % kStages on that stage's
  // ((done + i) / kStages)-th fill; the q-th Q tile is bar_q's q-th phase.
  int done = 0, q_loads = 0;

  // Accumulator fragments (m64 x kD, fp32): element 4j + e is row hf = e / 2, column
  // 8j + 2 * (lane % 4) + e % 2 of this thread's rows.
  float o[kOAcc];
  float row_max[2], row_sum[2];  // max in raw score units
  // fp8: a block's P row sums, by the tensor cores as O's columns kD..kD + 7 (wgmma_rs_fp8):
  // columns 2 (lane % 4) + {0, 1} of rows hf = 0 (elements 0, 1) and hf = 1 (2, 3), all equal.
  // They are added into row_sum (fp32) block by block and zeroed: summed over many blocks in the
  // accumulator they drifted low (fp8 wgmma adds with fewer bits than fp32; measured: the LSE's
  // error doubled while O's, whose terms have both signs, did not move).
  float osum[4];
  // row_sum += osum (the block whose P.V is done), then x factor; osum = 0 for the next block.
  auto fold_sums = [&](const float(&factor)[2]) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) row_sum[hf] = (row_sum[hf] + osum[2 * hf]) * factor[hf];
#pragma unroll
    for (int e = 0; e < 4; ++e) osum[e] = 0.f;
  };

  // Block i of a tile is key block top - 1 - i.
  auto key_block = [&](int i) { return top - 1 - i; };
  auto stage_of = [&](int i) { return (done + i) % kStages; };
  auto fill_of = [&](int i) { return (done + i) / kStages; };
  if (wg == kWG) {
    // The producer: per tile, the first blocks whose stages are free, then Q once all
    // consumer warpgroups have issued the last S of the tile before (so its load overlaps their
    // last softmax, P.V and epilogue), then the rest; block i once every consumer warp has
    // released the block kStages before it. It leaves when its last load is issued (no
    // CTA-wide barrier follows).
    regs_dec<Tl::kProducerRegs>();
    if (tid == kConsumerThreads) {
      constexpr int kBeforeQ = kStages > 3 ? kStages - 2 : 1;
      auto load_q = [&] {
        if (q_loads > 0) mbar_wait(bar_q_empty, (q_loads - 1) & 1);
        mbar_expect_tx(bar_q, kQBytes);
#pragma unroll
        for (int half = 0; half < Tl::kHalves; ++half) {
#pragma unroll
          for (int r = 0; r < kBlockM; r += kQBoxRows) {
            tma_load_box(q_addr0 + half * kQHalfBytes + r * kQKRowBytes, &q_map, bar_q,
                         half * 64, h, m0 + r);
          }
        }
        ++q_loads;
      };
      for (int r = 0;; ++r) {
        const TileOrder::Work w = work_of(r);
        if (w.tile < 0) break;
        set_tile(w);
        if (n_blocks == 0) continue;  // no keys: the consumers write the empty rows alone
        const int before_q = min(kBeforeQ, n_blocks);
        for (int i = 0; i < n_blocks; ++i) {
          if (i == before_q) load_q();
          const int st = stage_of(i), row = key_block(i) * kBlockN;
          if (done + i >= kStages) mbar_wait(bar_empty(st), (fill_of(i) - 1) & 1);
          mbar_expect_tx(bar_full(st), 2 * kTileBytes);  // K and V (not the ones rows)
          tma_load_tile<Tl::kHalves>(k_tile(st), &k_map, bar_full(st), g, row);
          if constexpr (kFp8) {
            // V^T [kv_heads][128][keys]: the box of keys [row, row + 128), all 128 columns.
            tma_load_box(v_tile(st), &v_map, bar_full(st), row, 0, g);
          } else {
            tma_load_tile<Tl::kHalves>(v_tile(st), &v_map, bar_full(st), g, row);
          }
        }
        if (before_q == n_blocks) load_q();
        done += n_blocks;
      }
    }
    return;
  }
  regs_inc<Tl::kConsumerRegs>();
  // Q rows of this warpgroup: 64 rows = 8 groups of 8 rows (1024 bytes, or 512 with 64-byte
  // rows).
  const uint32_t q_addr = q_addr0 + wg * 64 * kQKRowBytes;
  // P of a block, rounded to T: element 2j + hf packs columns 8j + 2 * (lane % 4) + {0, 1} of
  // row hf. With two buffers (Tl::kTwoP), used alternately, the P.V of block i - 1 reads one on
  // the tensor cores while the softmax of block i writes the other (with a single buffer and a
  // copy, the compiler merges the two and ptxas must serialise the wgmmas). With one (pa), the
  // softmax leaves its exp2 values in s and they are rounded into pa once that P.V is done.
  uint32_t pa[kPRegs], pb[kPRegs];

  // O += P.V for block i: k16 slice kk covers keys 16kk..16kk+15, i.e. S column blocks 2kk and
  // 2kk+1, whose C fragments are exactly the A fragment (rows r, r+8 x keys 2t, 2t+1, then +8).
  // V's slice kk starts 16 rows (2048 bytes, a whole number of swizzle repeats) further.
  // Its descriptors come first (pv_descs), before any wgmma of the pipeline stage is issued.
  // fp8: k32 slice kk covers keys 32kk..32kk+31, 32 bytes into each row of the V^T tile (K-major,
  // like K in S = Q.K^T). P's registers 4kk..4kk+3 are its A fragment as they are (see
  // softmax): that fragment's byte order is not the accumulator's column order, and V^T's keys
  // were permuted to match when it was written (attention_fp8.cu: vt_key).
  constexpr int kPvSlices = kBlockN * int(sizeof(T)) / 32;
  uint64_t dv[kPvSlices];
  // The descriptors of stage 0's K and V tiles; stage st's are these plus st times a stage's
  // bytes >> 4 in the address field (shared addresses stay below 2^18, so the field never
  // carries), and a slice's a constant more: added, not encoded again each block. That took
  // ~30 instructions out of a block's ~450 and ran 0.4-2.5 % faster at head_dim 128 and
  // 5-6 % at 64 in bf16, 1.5 % in fp8 at 64 (4K-16K on an H200); fp8 at head_dim 128 ran
  // 0.7-2 % slower with it (ptxas scheduled that kernel's block differently), so it encodes
  // each descriptor as before.
  constexpr bool kAddDescs = !(kFp8 && kD == 128);
  const uint64_t k_desc0 = k_major_desc<kQKRowBytes>(k_tile(0));
  const uint64_t v_desc0 = kFp8 ? k_major_desc(v_tile(0)) : mn_major_desc(v_tile(0));
  auto stage_desc = [](int st) { return uint64_t(st) * (kStageBytes >> 4); };
  auto pv_descs = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < kPvSlices; ++kk) {
      if constexpr (kAddDescs) {
        dv[kk] = v_desc0 + stage_desc(st) + (kFp8 ? kk * 32 : kk * 16 * kRowBytes) / 16;
      } else {
        dv[kk] = k_major_desc(v_tile(st) + kk * 32);
      }
    }
    desc_fence(dv);
  };
  auto issue_pv = [&](const uint32_t(&p)[kPRegs]) {
#pragma unroll
    for (int kk = 0; kk < kPvSlices; ++kk) {
      const uint32_t pf[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      if constexpr (kFp8) {
        wgmma_rs_fp8<kD>(o, osum, pf, dv[kk]);
      } else {
        wgmma_rs<T, kD>(o, pf, dv[kk]);
      }
    }
    wgmma_commit();
  };
  // S = Q.K^T for the block in stage st into s (issued, committed, not waited for): kD / 16
  // k16 slices of head_dim; slice ks is half ks / 4, bytes 32 * (ks % 4) into each 128-byte row
  // (the hardware applies the swizzle to the advanced address).
  float s[64];
  constexpr int kSSlices = kD * int(sizeof(T)) / 32;  // 32 bytes of head_dim a slice
  auto issue_s = [&](int st) {
    uint64_t dq[kSSlices], dk[kSSlices];
#pragma unroll
    for (int ks = 0; ks < kSSlices; ++ks) {
      const uint32_t off = (ks & 3) * 32;
      dq[ks] = k_major_desc<kQKRowBytes>(q_addr + (ks >> 2) * kQHalfBytes + off);
      dk[ks] = kAddDescs ? k_desc0 + stage_desc(st) + ((ks >> 2) * kHalfBytes + off) / 16
                         : k_major_desc<kQKRowBytes>(k_tile(st) + (ks >> 2) * kHalfBytes + off);
    }
    desc_fence(dq);
    desc_fence(dk);
    reg_fence(o);
    if constexpr (kFp8) reg_fence(osum);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kSSlices; ++ks) wgmma_ss<T>(s, dq[ks], dk[ks], ks > 0);
    wgmma_commit();
  };
  // Mask and online softmax of block i's s: new row max, P = exp2(scaled - max) into p, the
  // factor corr that rescales what O accumulated so far.
  float corr[2];
  // fp8: this warpgroup's query scale (per tile) and block i's key scale (read at the start of
  // its step, ahead of the wait for its S, so the load is off the softmax's path).
  float q_scale = 1.f, k_scale = 1.f;
  const float* k_scales = nullptr;  // the tile's key block 0's scale (set per tile)
  auto load_k_scale = [&](int i) {
    if constexpr (kFp8) k_scale = __ldg(k_scales + key_block(i));
  };
  // The fp8 softmax of a masked block in s: P as e4m3 codes made by FFMAs, without exp2
  // (kernels/attention.h: kFp8PCodeRound). The block's scores in log2 units are s x c; row_max
  // is kept in those units (each key block has its own scale), on the lattice
  // fp8_p_offset(m) = (m - kFp8PCodeRound) / 8 at or above the row's max. A code is
  // round(8 s c + K) with K = fp8_p_code_shift(m) an integer (the lattice makes it one): one FFMA
  // whose result, plus 1.5 x 2^23 (kMagic), holds the code in its low bits; an FMNMX clamps the
  // codes below 0 (values below 2^-14: masked -inf, any score far below the max) to 0. Codes
  // never exceed 120 (2^8: P x 2^kFp8PBias). They stay in s as float bits until the P.V that
  // reads p is done; pack_s then takes their low bytes. P's row sums are of the codes' values,
  // summed by the tensor cores as O's columns kD..kD + 7 (osum) a block at a time, then in
  // fp32 (fold_sums), so that O's numerator and denominator weigh each key alike. Why: the exp2
  // of the 16-bit kernel (MUFU, 16 a cycle an SM) took as long as the block's fp8 MMAs; this
  // softmax is FMA and ALU work only.
  // Packing: registers 2 j2 + hf of p hold row hf's columns of accumulator groups 2 j2 and
  // 2 j2 + 1 (8 values, keys 16 j2 + {2t, 2t+1, 8+2t, 9+2t} of that group pair, t = lane % 4),
  // low byte first; the A fragment reads them as keys 16 j2 + 4t + {0, 1, 2, 3} (+ 16 for the
  // second register pair of a slice): vt_key in attention_fp8.cu writes V^T's keys in that order.
  auto softmax_fp8 = [&] {
    constexpr float kMagic = 12582912.f;  // 1.5 x 2^23
    const float c = a.scale_log2 * q_scale * k_scale;  // > 0: scales are never 0
    const float c8 = 8.f * c;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = kNegInf;
#pragma unroll
      for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_max = fmaxf(row_max[hf], mx * c);
      // Only masked keys so far: m = 0, every score is -inf and its code 0; row_max stays -inf.
      const float m = new_max == kNegInf ? 0.f : fp8_p_lattice(new_max);
      const float offset = fp8_p_offset(m);
      corr[hf] = exp2_approx(row_max[hf] - offset);
      row_max[hf] = new_max == kNegInf ? kNegInf : offset;
      const float k = kMagic + fp8_p_code_shift(m);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 4 * j + 2 * hf; e < 4 * j + 2 * hf + 2; ++e) {
          s[e] = fmaxf(fmaf(s[e], c8, k), kMagic);
        }
      }
    }
  };
  auto softmax_16 = [&](uint32_t(&p)[kPRegs]) {
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
      corr[hf] = exp2_approx(row_max[hf] * a.scale_log2 - offset);
      row_max[hf] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float p0 = exp2_approx(fmaf(s[4 * j + 2 * hf], a.scale_log2, -offset));
        const float p1 = exp2_approx(fmaf(s[4 * j + 2 * hf + 1], a.scale_log2, -offset));
        sum += p0 + p1;
        if constexpr (Tl::kTwoP && !kFp8) {
          p[2 * j + hf] = pack2<T>(p0, p1);
        } else {
          s[4 * j + 2 * hf] = p0;
          s[4 * j + 2 * hf + 1] = p1;
        }
      }
      // The sum keeps the unrounded P (as the fp32 reference does); it stays per thread until
      // the epilogue's quad reduction.
      row_sum[hf] = row_sum[hf] * corr[hf] + sum;
    }
  };

  auto softmax = [&](int i, uint32_t(&p)[kPRegs]) {
    const int n = key_block(i);
    // Mask only the blocks that need it: the causal diagonal and the n_kv tail (whose keys
    // were zero-filled and must not count). Masked scores become -inf, so exp2 gives 0.
    if ((n + 1) * kBlockN - 1 > min_limit) {
#pragma unroll
      for (int e = 0; e < 64; ++e) {
        const int key = n * kBlockN + (e >> 2) * 8 + (lane & 3) * 2 + (e & 1);
        if (key > limit[(e >> 1) & 1]) s[e] = kNegInf;
      }
    }
    if constexpr (kFp8) {
      softmax_fp8();
    } else {
      softmax_16(p);
    }
  };

  // One P buffer: P rounded from the exp2 values the softmax left in s (fp8: the codes'
  // low bytes, four a register in the order softmax_fp8 describes).
  auto pack_s = [&](uint32_t(&p)[kPRegs]) {
    if constexpr (kFp8) {
#pragma unroll
      for (int j2 = 0; j2 < 8; ++j2) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int e0 = 4 * (2 * j2) + 2 * hf, e1 = e0 + 4;
          const uint32_t lo =
              __byte_perm(__float_as_uint(s[e0]), __float_as_uint(s[e0 + 1]), 0x0040);
          const uint32_t hi =
              __byte_perm(__float_as_uint(s[e1]), __float_as_uint(s[e1 + 1]), 0x4000);
          p[2 * j2 + hf] = __byte_perm(lo, hi, 0x7610);
        }
      }
    } else {
      static_assert(kPRegs == 32, "16-bit P: two values a register");
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          p[2 * j + hf] = pack2<T>(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]);
        }
      }
    }
  };

  // The consumers' place in the ring of stages: the block they take now lies in stage cur_stage
  // on a fill of parity cur_parity (set from `done` at each tile's start, then counted on a
  // block at a time: (done + i) % kStages each block had cost a division's dozen uniform
  // instructions twice over).
  int cur_stage = 0, cur_parity = 0;
  auto next_stage = [&] {
    if (++cur_stage == kStages) {
      cur_stage = 0;
      cur_parity ^= 1;
    }
  };
  // Waits until the K and V of the block in stage st, fill parity `parity`, have arrived.
  auto wait_full = [&](int st, int parity) { mbar_wait(bar_full(st), parity); };
  // Ping-pong (kPingPong): before issuing its MMAs of a block a warpgroup waits on its named
  // barrier (1 + wg) for the other's arrival, which comes once the other has issued its own;
  // then it arrives on the other's. Both warpgroups issue the same number of times (they share
  // every tile), warpgroup 1 arrives once first to start the turns, and warpgroup 0 takes that
  // extra arrival after its last tile.
  auto turn_wait = [&] {
    if constexpr (kPingPong) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
  };
  auto turn_pass = [&] {
    if constexpr (kPingPong) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
  };
  // After this warp's wgmmas that read the block in stage st have completed: release the stage
  // (the producer refills it with the block kStages later once all consumer warps have).
  auto release = [&](int st) {
    if (lane == 0) mbar_arrive(bar_empty(st));
  };

  // After this warp's last S of the tile (the last read of Q): the producer may load the next
  // tile's Q.
  auto release_q = [&] {
    if (lane == 0) mbar_arrive(bar_q_empty);
  };

  // Block i >= 1: S of block i, then the P.V of block i - 1 (p_prev) on the tensor cores while
  // block i's softmax writes p_next; then O is rescaled to block i's row max.
  auto step = [&](int i, uint32_t(&p_prev)[kPRegs], uint32_t(&p_next)[kPRegs]) {
    load_k_scale(i);
    const int prev_stage = cur_stage;  // block i - 1's
    next_stage();
    wait_full(cur_stage, cur_parity);
    pv_descs(prev_stage);
    turn_wait();
    issue_s(cur_stage);
    issue_pv(p_prev);
    turn_pass();
    wgmma_wait<1>();  // groups complete in order: S is done, P.V may still run
    reg_fence(s);
    if (i == n_blocks - 1) release_q();
    softmax(i, p_next);
    // fp8: a basic block ends here, so that the softmax above runs while the tensor cores
    // still compute the P.V of block i - 1. ptxas places a wgmma wait at the top of its basic
    // block, ahead of the softmax, whatever the source order; a branch it cannot resolve (n_q
    // is never negative) keeps the wait below. The softmax's codes are fenced first so that it
    // cannot sink them past the branch. Measured on an H200: fp8 1.5-2.2 % faster at 4K-16K
    // (head_dim 128 and 64); bf16 unchanged at head_dim 128 16K and 0.95-0.97x at 64K, so it
    // keeps its schedule (docs/kernel-notes.md, "FP8: the softmax beside P.V").
    if constexpr (kFp8) {
      reg_fence(s);
      if (a.n_q < 0) asm volatile("trap;");
    }
    wgmma_wait<0>();
    // The tensor cores read p_prev and wrote o until here: keep the compiler from reusing
    // p_prev's registers or touching o earlier.
    reg_fence(p_prev);
    reg_fence(o);
    if constexpr (kFp8) reg_fence(osum);
#pragma unroll
    for (int e = 0; e < kOAcc; ++e) o[e] *= corr[(e >> 1) & 1];
    if constexpr (kFp8) fold_sums(corr);
    release(prev_stage);
    if constexpr (!Tl::kTwoP) pack_s(p_next);
  };
  // The last block's P.V (its tiles arrived before its S).
  auto last_pv = [&](uint32_t(&p)[kPRegs]) {
    pv_descs(cur_stage);
    reg_fence(o);
    if constexpr (kFp8) reg_fence(osum);
    wgmma_fence();
    turn_wait();
    issue_pv(p);
    turn_pass();
    wgmma_wait<0>();
    reg_fence(p);
    reg_fence(o);
    if constexpr (kFp8) reg_fence(osum);
  };
  static_assert(!kPingPong || kWG == 2, "turns between two warpgroups");
  if (wg == 1) turn_pass();  // warpgroup 0 goes first

  for (int r = 0;; ++r) {
    {
      const TileOrder::Work w = work_of(r);
      if (w.tile < 0) break;
      set_tile(w);
    }
    if constexpr (kFp8) {
      // The warpgroup's 64-row group of the quantizer's layout (counted from the start of its
      // 128-row tiles, q_pad rows before row 0; a 192-row tile starts on the same 64-row
      // boundaries). A warpgroup with no rows (idle) may lie before the first group: it reads
      // the first, and uses nothing.
      q_scale = __ldg(a.q_scale + int64_t{h} * a.q_groups + max(0, (m0 + a.q_pad) / 64 + wg));
      k_scales = a.k_scale + int64_t{g} * a.k_blocks;
    }
#pragma unroll
    for (int e = 0; e < kOAcc; ++e) o[e] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) osum[e] = 0.f;
    row_max[0] = row_max[1] = kNegInf;
    row_sum[0] = row_sum[1] = 0.f;
    // All of this warpgroup's rows lie before row 0 (the short first block of a head; three
    // warpgroups only, see wg): it computes nothing and writes nothing, but keeps the barriers'
    // phases, waiting for each load before it releases it as the others do (an arrival ahead
    // of its phase would count toward the one before). A 4K-token head's short block of 64
    // rows then costs about a third of a tile instead of a whole one.
    const bool idle = kWG == 3 && m0 + wg * 64 + 63 < 0;
    if (n_blocks > 0 && idle) {
      mbar_wait(bar_q, q_loads & 1);
      for (int i = 0; i < n_blocks; ++i) {
        wait_full(stage_of(i), fill_of(i) & 1);
        release(stage_of(i));
      }
      release_q();
      done += n_blocks;
      ++q_loads;
    } else if (n_blocks > 0) {
      mbar_wait(bar_q, q_loads & 1);
      // Block 0: nothing accumulated yet, so nothing to overlap or rescale.
      cur_stage = stage_of(0);
      cur_parity = fill_of(0) & 1;
      load_k_scale(0);
      wait_full(cur_stage, cur_parity);
      turn_wait();
      issue_s(cur_stage);
      turn_pass();
      wgmma_wait<0>();
      reg_fence(s);
      if (n_blocks == 1) release_q();
      softmax(0, pa);
      if constexpr (Tl::kTwoP) {
        // Blocks 1, 2, ... alternate the P buffers (unrolled by two so both stay in registers).
        int i = 1;
        for (; i + 1 < n_blocks; i += 2) {
          step(i, pa, pb);
          step(i + 1, pb, pa);
        }
        if (i < n_blocks) {
          step(i, pa, pb);
          last_pv(pb);
        } else {
          last_pv(pa);
        }
      } else {
        pack_s(pa);
        for (int i = 1; i < n_blocks; ++i) step(i, pa, pa);
        last_pv(pa);
      }
      release(cur_stage);  // block n_blocks - 1's
      done += n_blocks;
      ++q_loads;
    }

    if (idle) continue;
    if constexpr (kFp8) {
      // The last block's sums. Each of the row's 4 threads holds the whole sum; the epilogues
      // quad-sum row_sum, which a quarter of it each makes exact.
      fold_sums({0.25f, 0.25f});
      // O's column d times V's scale for it (the P.V above used V's e4m3 values).
      const float* const vs = a.v_scale + int64_t{g} * kD + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        const float2 sv = __ldg(reinterpret_cast<const float2*>(vs + 8 * j));
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          o[4 * j + 2 * hf] *= sv.x;
          o[4 * j + 2 * hf + 1] *= sv.y;
        }
      }
    }
    // The work again, for the split tail's epilogue: recomputed (from an opaque copy of r, so
    // the compiler cannot keep it instead) rather than held in registers through the key
    // blocks, where the three-warpgroup kernel has none to spare (held, ptxas spilled).
    int r_again = r;
    asm volatile("" : "+r"(r_again));
    const TileOrder::Work w = work_of(r_again);
    // Epilogue: normalise and write this thread's rows. A row that saw a key has sum >= 1 (its
    // max term is exp2(0)); sum == 0 means it saw none: O = 0, LSE = -inf.
    OutT* o_base = a.o + int64_t{h} * a.o_head_stride;
    // The natural-log LSE of row hf whose quad-summed softmax sum is sum (> 0).
    // (fp8: row_max in log2 units, and the sum carries P's 2^kFp8PBias.)
    auto row_lse = [&](int hf, float sum) {
      return kFp8 ? (row_max[hf] - kFp8PBias) * kLn2 + logf(sum)
                  : row_max[hf] * a.scale + logf(sum);
    };
    if (w.part >= 0) {
      // A piece of a split tile (TileOrder): its rows, normalised, and their LSE into the
      // workspace; the last piece of this warp's rows to arrive merges every piece's into O.
      const int rt = wg * 64 + warp * 16 + (lane >> 2);  // the thread's first row in the tile
      float* const ws_o = g_split_o + w.slot * kBlockM * kD;
      float* const ws_lse = g_split_lse + w.slot * kBlockM;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float sum = quad_sum(row_sum[hf]);
        const bool empty = !(sum > 0.f);
        const float inv = empty ? 0.f : 1.f / sum;
        const int r = w.part * kBlockM + rt + hf * 8;
        float* const dst = ws_o + r * kD + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
          __stcg(reinterpret_cast<float2*>(dst + 8 * j),
                 make_float2(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv));
        }
        if ((lane & 3) == 0) {
          __stcg(ws_lse + r, empty ? kNegInf : row_lse(hf, sum));
        }
      }
      // The CUDA guide's fence-then-count: the part's writes are visible to whichever part
      // counts last, and that one reads only after its count.
      __threadfence();
      __syncwarp();
      unsigned* const count = g_split_count + w.slot * kMaxConsumerWarps + wg * 4 + warp;
      unsigned arrived = 0;
      if (lane == 0) arrived = atomicAdd(count, 1u);
      arrived = __shfl_sync(0xffffffffu, arrived, 0);
      if (static_cast<int>(arrived) + 1 < w.parts) continue;
      if (lane == 0) *count = 0;  // every part has counted: zero for the next launch
      __threadfence();
      // lse = log sum_q exp(lse_q), O = sum_q exp(lse_q - lse) O_q, summed in part order. Every
      // piece's rows are loaded before O is written: the compiler cannot move a load above a
      // store to O (it cannot tell the workspace from O), so loading 8 columns at a time beside
      // their stores cost an L2 round trip per 8 columns.
      float wt[2][kMaxSplitParts], mx[2], total[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = kNegInf;
        total[hf] = 0.f;
#pragma unroll
        for (int q = 0; q < kMaxSplitParts; ++q) {
          wt[hf][q] = q < w.parts ? __ldcg(ws_lse + q * kBlockM + rt + hf * 8) : kNegInf;
          mx[hf] = fmaxf(mx[hf], wt[hf][q]);
        }
#pragma unroll
        for (int q = 0; q < kMaxSplitParts; ++q) {
          wt[hf][q] = mx[hf] == kNegInf ? 0.f : expf(wt[hf][q] - mx[hf]);
          total[hf] += wt[hf][q];
        }
      }
      float2 acc[2][kD / 8];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) acc[hf][j] = make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int q = 0; q < kMaxSplitParts; ++q) {
        if (q >= w.parts) break;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float* const src = ws_o + (q * kBlockM + rt + hf * 8) * kD + 2 * (lane & 3);
#pragma unroll
          for (int j = 0; j < kD / 8; ++j) {
            const float2 v = __ldcg(reinterpret_cast<const float2*>(src + 8 * j));
            acc[hf][j].x += wt[hf][q] * v.x;
            acc[hf][j].y += wt[hf][q] * v.y;
          }
        }
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + rt + hf * 8;
        const bool in = row >= 0 && row < a.n_q;
        store_row<kD / 8>(in ? o_base + int64_t{row} * a.o_row_stride : nullptr, lane,
                          total[hf] > 0.f ? 1.f / total[hf] : 0.f,
                          [&](int j) { return acc[hf][j]; });
        if (in && (lane & 3) == 0) {
          a.lse[int64_t{h} * a.lse_head_stride + row] =
              mx[hf] == kNegInf ? kNegInf : mx[hf] + logf(total[hf]);
        }
      }
      continue;
    }
    if constexpr (std::is_same_v<OutT, float>) {
      if (a.merge) {
        // Into a partial result (a) of these rows: merge_cuda's arithmetic with this tile's
        // rows as b. Kept apart from the plain epilogue below, whose code it would otherwise
        // change for every launch (measured: 8-11 % slower at 4K, head_dim 128).
        float sums[2], old_lse[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float sum = quad_sum(row_sum[hf]);
          sums[hf] = sum;
          const int row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
          // The 4 threads of a row read its old LSE before the first of them writes it.
          old_lse[hf] = row >= 0 && row < a.n_q ? a.lse[int64_t{h} * a.lse_head_stride + row]
                                                : kNegInf;
        }
        __syncwarp();
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float sum = sums[hf];
          const int row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
          if (row < 0 || row >= a.n_q || !(sum > 0.f)) continue;  // b saw nothing: a stays
          merge_row_into<kD / 8>(
              o_base + int64_t{row} * a.o_row_stride, a.lse + int64_t{h} * a.lse_head_stride + row,
              lane, old_lse[hf], row_lse(hf, sum), 1.f / sum,
              [&](int j) { return make_float2(o[4 * j + 2 * hf], o[4 * j + 2 * hf + 1]); });
        }
        continue;
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float sum = quad_sum(row_sum[hf]);
      const int row = m0 + wg * 64 + warp * 16 + (lane >> 2) + hf * 8;
      const bool in = row >= 0 && row < a.n_q, empty = !(sum > 0.f);
      store_row<kD / 8>(in ? o_base + int64_t{row} * a.o_row_stride : nullptr,
                        lane, empty ? 0.f : 1.f / sum, [&](int j) {
                          return make_float2(o[4 * j + 2 * hf], o[4 * j + 2 * hf + 1]);
                        });
      if (in && (lane & 3) == 0) {
        a.lse[int64_t{h} * a.lse_head_stride + row] =
            empty ? kNegInf : row_lse(hf, sum);
      }
    }
  }
  if (wg == 0) turn_wait();  // warpgroup 1's last arrival (ping-pong)
#else
  // Built for another architecture: attention_sm90 never launches this (it checks the device).
  __trap();
#endif
}

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                             cudaEnableDefault, &found);
#else
    // CUDA 12.0-12.4 (A100 fleets on CUDA 12 drivers): the by-version query arrived in 12.5;
    // the plain query returns the same 12.0 ABI of cuTensorMapEncodeTiled.
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The TMA map of a 3-d tensor (dims innermost first, strides of the outer two in bytes) read
// in boxes of `box` with the 128-byte swizzle (the box's inner extent is 128 bytes), or the
// 64-byte one where swizzle_bytes is 64 (an inner extent of 64 bytes). False if the driver
// refuses it.
bool encode_3d(CUtensorMap& map, CUtensorMapDataType type, const void* ptr,
               const cuuint64_t (&dims)[3], const cuuint64_t (&strides)[2],
               const cuuint32_t (&box)[3], int swizzle_bytes = kRowBytes) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || dims[2] == 0) return false;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(&map, type, 3, const_cast<void*>(ptr), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The TMA map of a [rows][heads][d] tensor (strides in elements) of 16-bit values (dtype) or
// e4m3 bytes (DType::kFP8E4M3), read in boxes of [box_rows][1 head][box_bytes] (128 bytes, or
// 64 with the 64-byte swizzle).
bool encode_map(CUtensorMap& map, DType dtype, const void* ptr, int64_t rows, int heads, int d,
                int64_t row_stride, int64_t head_stride, int box_rows,
                int box_bytes = kRowBytes) {
  if (rows <= 0) return false;
  const int bytes = dtype == DType::kFP8E4M3 ? 1 : 2;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * bytes,
                                 static_cast<cuuint64_t>(row_stride) * bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_bytes / bytes), 1,
                             static_cast<cuuint32_t>(box_rows)};
  const CUtensorMapDataType type = dtype == DType::kBF16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dtype == DType::kF16  ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  return encode_3d(map, type, ptr, dims, strides, box, box_bytes);
}

// How a launch of query blocks of block_m rows runs: its tile order and CTA count.
struct Plan {
  TileOrder order{};
  int ctas = 0;
  // Tiles run per round, on average: a launch's time is its work over this and over the speed
  // of one tile's rows.
  double per_round() const {
    const int rounds = (order.tiles + ctas - 1) / ctas;
    return rounds == 0 ? 0.0 : static_cast<double>(order.tiles) / rounds;
  }
};

// How many CTAs share the split tail of `order` (whole, split, short_tiles and tail_blocks
// set): 0 for none. The tail's U = split x tail_blocks key blocks go to as many CTAs as are
// free beside the short blocks, but no CTA fewer than kMinSplitBlocks and no tile to more
// than kMaxSplitParts (every share at least a third of a tile: a tile's blocks then hold at
// most three share boundaries); or to exactly p CTAs a tile (equal parts), where that ends
// sooner. Cut only where a CTA's share, rounded up, is at most 5/8 of a tile: each piece costs
// a pipeline start, its rows' trip through the workspace (a fence and a count) and a merge. On
// an H100, 4K tokens at head_dim 128 (shares of 0.78 tile, the last round 0.22 tile shorter)
// ran 0.7 % slower cut than not, 8K (0.52) 0.8 % faster (docs/benchmarks.md, 2026-11-27
// session 20; launched back to back at the 700 W cap the cut 4K launch even ran at a higher
// SM clock, and still took longer).
int tail_ctas(const TileOrder& order, int sms) {
  const int free_ctas = sms - order.short_tiles;
  const int64_t units = int64_t{order.split} * order.tail_blocks;
  if (order.split == 0 || free_ctas <= 0 || units * sms >= (int64_t{1} << 31)) return 0;
  const int nb = order.tail_blocks, third = (nb + kMaxSplitParts - 2) / (kMaxSplitParts - 1);
  const int64_t stream = std::min<int64_t>({free_ctas, units / third, units / kMinSplitBlocks});
  const int64_t equal =
      order.split * std::min<int64_t>({kMaxSplitParts, free_ctas / order.split,
                                       nb / kMinSplitBlocks});
  // Blocks the busiest CTA of the tail computes with n CTAs.
  auto busiest = [&](int64_t n) { return n > 0 ? (units + n - 1) / n : int64_t{nb}; };
  const int64_t n = busiest(equal) <= busiest(stream) ? equal : stream;
  if (n <= 0 || busiest(n) * 8 > int64_t{nb} * 5 || order.split + n > kSplitSlots) return 0;
  return static_cast<int>(n);
}

// False if the launch has too many tiles to number.
bool plan_launch(const AttnParams& p, int block_m, int sms, Plan& plan) {
  TileOrder& order = plan.order;
  order.m_blocks = (p.n_q + block_m - 1) / block_m;
  const int64_t tiles = int64_t{order.m_blocks} * p.heads;
  if (tiles > (int64_t{1} << 30)) return false;  // the tile numbers are ints
  order.tiles = static_cast<int>(tiles);
  // Many tiles a multiprocessor: one CTA a tile, longest first, and the hardware hands the next
  // tile to whichever multiprocessor frees first; a tile's start and end cost little beside
  // its length there.
  const bool causal = p.mask == MaskKind::kCausal;
  const bool persistent =
      !p.beside_transfer &&
      tiles <= int64_t{causal ? kPersistentCausalTiles : kPersistentFullTiles} * sms;
  order.heads = p.heads;
  order.snake = causal && persistent ? 1 : 0;
  plan.ctas = persistent ? std::min(order.tiles, sms) : order.tiles;
  // The split tail (TileOrder): a persistent full launch whose full tiles leave a last round
  // short of a whole one. Not into a partial result (merge_into_o): the merge of the pieces
  // writes O whole.
  if (persistent && !causal && !p.merge_into_o) {
    order.short_tiles = p.n_q % block_m != 0 ? p.heads : 0;
    order.full_per_head = order.m_blocks - (order.short_tiles > 0 ? 1 : 0);
    const int full = order.full_per_head * p.heads;
    order.whole = full / sms * sms;
    order.split = full - order.whole;
    order.tail_blocks = (p.n_kv + kBlockN - 1) / kBlockN;
    order.tail_ctas = tail_ctas(order, sms);
    order.tail_units = order.split * order.tail_blocks;
    if (order.tail_ctas > 0) {
      plan.ctas = std::min(order.whole + order.tail_ctas + order.short_tiles, sms);
    }
  }
  return true;
}

template <typename T, typename OutT, int kD, int kWG>
cudaError_t launch(const AttnParams& p, const Plan& plan, cudaStream_t stream) {
  using Tl = Sm90Tile<kD, kWG>;
  constexpr int kSmemBytes = Tl::kSmemBytes;
  const KernelArgs<T, OutT> a = make_kernel_args<T, OutT>(p);
  CUtensorMap q_map{}, k_map{}, v_map{};
  if (!encode_map(q_map, p.dtype, p.q, p.n_q, p.heads, kD, p.q_row_stride, p.q_head_stride,
                  kQBoxRows)) {
    return cudaErrorInvalidValue;
  }
  // No keys: no key block is loaded, the maps are never read.
  if (p.n_kv > 0 &&
      (!encode_map(k_map, p.dtype, p.k, p.n_kv, p.kv_heads, kD, p.k_row_stride,
                   p.k_head_stride, kBlockN) ||
       !encode_map(v_map, p.dtype, p.v, p.n_kv, p.kv_heads, kD, p.v_row_stride,
                   p.v_head_stride, kBlockN))) {
    return cudaErrorInvalidValue;
  }
  auto* kernel = attention_sm90_kernel<T, OutT, kD, kWG>;
  // Above 48 KiB a kernel must opt in to dynamic shared memory (per device, so every call).
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<plan.ctas, Tl::kThreads, kSmemBytes, stream>>>(a, q_map, k_map, v_map, plan.order);
  return cudaGetLastError();
}

template <int kD, int kWG>
cudaError_t dispatch(const AttnParams& p, const Plan& plan, cudaStream_t stream) {
  const bool f32_out = output_dtype(p) == DType::kF32;
  if (p.dtype == DType::kBF16) {
    return f32_out ? launch<__nv_bfloat16, float, kD, kWG>(p, plan, stream)
                   : launch<__nv_bfloat16, __nv_bfloat16, kD, kWG>(p, plan, stream);
  }
  return f32_out ? launch<__half, float, kD, kWG>(p, plan, stream)
                 : launch<__half, __half, kD, kWG>(p, plan, stream);
}

// The e4m3 launch (attention_sm90_fp8): Q and K as [rows][heads][kD] bytes (rows of 128 or
// 64 bytes, swizzled as wide), V as V^T, one [128 keys][kD columns] box a stage.
template <typename OutT, bool kPingPong, int kD, int kWG>
cudaError_t launch_fp8(const AttnParams& p, const Fp8Operands& f, const Plan& plan,
                       cudaStream_t stream) {
  using T = __nv_fp8_e4m3;
  using Tl = Sm90Tile<kD, kWG, 1>;
  constexpr int kQK = Tl::kQKRowBytes;
  KernelArgs<T, OutT> a = make_kernel_args<T, OutT>(p);
  a.q = static_cast<const T*>(f.q8);
  a.k = static_cast<const T*>(f.k8);
  a.v = static_cast<const T*>(f.vt8);
  a.q_scale = f.q_scale;
  a.k_scale = f.k_scale;
  a.v_scale = f.v_scale;
  a.q_groups = f.q_groups;
  a.k_blocks = f.k_blocks;
  a.q_pad = f.q_pad;
  CUtensorMap q_map{}, k_map{}, v_map{};
  if (!encode_map(q_map, DType::kFP8E4M3, f.q8, p.n_q, p.heads, kD, int64_t{p.heads} * kD, kD,
                  kQBoxRows, kQK)) {
    return cudaErrorInvalidValue;
  }
  if (p.n_kv > 0) {
    const cuuint64_t vt_dims[3] = {static_cast<cuuint64_t>(f.vt_keys), kD,
                                   static_cast<cuuint64_t>(p.kv_heads)};
    const cuuint64_t vt_strides[2] = {static_cast<cuuint64_t>(f.vt_keys),
                                      static_cast<cuuint64_t>(f.vt_keys) * kD};
    const cuuint32_t vt_box[3] = {kBlockN, kD, 1};
    if (!encode_map(k_map, DType::kFP8E4M3, f.k8, p.n_kv, p.kv_heads, kD,
                    int64_t{p.kv_heads} * kD, kD, kBlockN, kQK) ||
        !encode_3d(v_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, f.vt8, vt_dims, vt_strides, vt_box)) {
      return cudaErrorInvalidValue;
    }
  }
  auto* kernel = attention_sm90_kernel<T, OutT, kD, kWG, kPingPong>;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<plan.ctas, Tl::kThreads, Tl::kSmemBytes, stream>>>(a, q_map, k_map, v_map,
                                                              plan.order);
  return cudaGetLastError();
}

// At head_dim 64, three consumer warpgroups (192-row tiles) run a key block 6-11 % faster than
// two (H100, docs/benchmarks.md): with a third warpgroup's softmax in flight the tensor cores
// and the exp2 unit, equally loaded at this head_dim, overlap better. A persistent causal launch
// whose 192-row tiles fill its rounds less (per_round: tiles a round, the last round counted
// whole) than the gain makes up for runs two warpgroups: a small one, where fewer tiles leave
// multiprocessors idle. (4K tokens x 64 heads fill them alike, 128 a round: three, measured 5-9 %
// faster there with the snake order.)
constexpr double kThreeWarpgroupGain = 1.06;

// The launch of p with `rows`-row tiles (0: chosen as above) on `sms` multiprocessors: its
// plan, and whether it runs three consumer warpgroups.
cudaError_t choose(const AttnParams& p, int rows, int sms, Plan& plan, bool& three) {
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
  if (rows != 0 && rows != 128 && !(rows == 192 && p.head_dim == 64)) return cudaErrorInvalidValue;
  if (sms <= 0) return cudaErrorInvalidValue;
  Plan two;
  if (!plan_launch(p, Sm90Tile<64, 2>::kBlockM, sms, two)) return cudaErrorInvalidValue;
  three = false;
  plan = two;
  if (p.head_dim == 128) return cudaSuccess;
  Plan p3;
  if (!plan_launch(p, Sm90Tile<64, 3>::kBlockM, sms, p3)) return cudaErrorInvalidValue;
  const bool use_two = rows == 0 ? p3.order.snake &&
                                       p3.per_round() * kThreeWarpgroupGain < two.per_round()
                                 : rows == 128;
  if (!use_two) {
    three = true;
    plan = p3;
  }
  return cudaSuccess;
}

// choose() on the current device.
cudaError_t choose_here(const AttnParams& p, int rows, Plan& plan, bool& three) {
  int sms = 0;
  const cudaError_t err = multiprocessors(sms);
  if (err != cudaSuccess) return err;
  return choose(p, rows, sms, plan, three);
}

}  // namespace

cudaError_t attention_sm90(const AttnParams& p, cudaStream_t stream, int rows) {
  Plan plan;
  bool three = false;
  const cudaError_t err = choose_here(p, rows, plan, three);
  if (err != cudaSuccess) return err;
  if (p.head_dim == 128) return dispatch<128, 2>(p, plan, stream);
  return three ? dispatch<64, 3>(p, plan, stream) : dispatch<64, 2>(p, plan, stream);
}

// fp8 at head_dim kD with kWG consumer warpgroups: ping-pong (an option for measuring, at
// head_dim 128 only), the output type.
template <int kD, int kWG, bool kPingPong>
cudaError_t dispatch_fp8(const AttnParams& p, const Fp8Operands& f, const Plan& plan,
                         cudaStream_t stream) {
  if (output_dtype(p) == DType::kF32) {
    return launch_fp8<float, kPingPong, kD, kWG>(p, f, plan, stream);
  }
  return p.dtype == DType::kBF16 ? launch_fp8<__nv_bfloat16, kPingPong, kD, kWG>(p, f, plan, stream)
                                 : launch_fp8<__half, kPingPong, kD, kWG>(p, f, plan, stream);
}

cudaError_t attention_sm90_fp8(const AttnParams& p, const Fp8Operands& f, cudaStream_t stream) {
  if (p.head_dim != 128 && p.head_dim != 64) return cudaErrorInvalidValue;
  if (f.pingpong && p.head_dim != 128) return cudaErrorInvalidValue;
  Plan plan;
  bool three = false;
  // head_dim 64 chooses its tile rows as the bf16 kernel does (choose()); 128 has 128.
  const cudaError_t err = choose_here(p, p.head_dim == 64 ? f.rows : 128, plan, three);
  if (err != cudaSuccess) return err;
  if (p.head_dim == 64) {
    return three ? dispatch_fp8<64, 3, false>(p, f, plan, stream)
                 : dispatch_fp8<64, 2, false>(p, f, plan, stream);
  }
  return f.pingpong ? dispatch_fp8<128, 2, true>(p, f, plan, stream)
                    : dispatch_fp8<128, 2, false>(p, f, plan, stream);
}

int attention_sm90_split_parts(const AttnParams& p, int rows) {
  Plan plan;
  bool three = false;
  if (choose_here(p, rows, plan, three) != cudaSuccess) return 1;
  const TileOrder& order = plan.order;
  int parts = 1;
  for (int t = 0; order.tail_ctas > 0 && t < order.split; ++t) {
    parts = std::max(parts, order.tail_parts(t));
  }
  return parts;
}

cudaError_t attention_sm90_schedule(const AttnParams& p, int rows, int sms, Sm90Schedule& out) {
  Plan plan;
  bool three = false;
  const cudaError_t err = choose(p, rows, sms, plan, three);
  if (err != cudaSuccess) return err;
  out = Sm90Schedule{};
  out.rows = three ? Sm90Tile<64, 3>::kBlockM : Sm90Tile<64, 2>::kBlockM;
  out.m_blocks = plan.order.m_blocks;
  out.ctas = plan.ctas;
  for (int c = 0; c < plan.ctas; ++c) {
    for (int r = 0;; ++r) {
      const TileOrder::Work w = plan.order.at(r, plan.ctas, c);
      if (w.tile < 0) break;
      out.work.push_back({c, r, w.tile, w.part, w.parts, w.slot, w.lo, w.hi});
    }
  }
  return cudaSuccess;
}

}  // namespace burst::kernels::detail
