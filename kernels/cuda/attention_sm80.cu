// Flash attention forward for one ring step (LAO), the contract of kernels/attention_cuda.h.
// Ampere-style tensor-core path (mma.sync m16n8k16, ldmatrix, cp.async): what runs on sm_80
// (A100). On Hopper the wgmma kernel (attention_sm90.cu) runs instead, this one only where the
// driver refuses a TMA layout of the strides (and in tests and benchmarks, AttnKernel::kSm80).
//
// One CTA of 4 warps computes a 128-row query block of one head; each warp owns 32 rows (two
// m16 atoms), so every K/V fragment read from shared memory feeds two MMAs. Key blocks of 64
// run from the last to the first, so the blocks that need masking (the causal diagonal, the
// n_kv tail) come first and the rest run without per-element checks. 2 CTAs per SM (registers:
// up to 255 per thread); shared memory stays within an A100's 164 KB for both.
//
// head_dim 128: Q stays in shared memory (re-read with ldmatrix each key block; in registers
// it would not fit beside the 128 fp32 accumulators of O). K and V share a ring of three
// tiles (Q and the ring: 80 KB, twice within an A100's 164 KB; two of each would not fit),
// loaded in a cp.async pipeline a whole block ahead: K[n-1] streams in while S = Q.K[n]^T and
// the softmax run, V[n-1] while O += P.V[n] runs.
// head_dim 64: Q fragments in registers (loaded once), two K and two V buffers: block n-1
// streams in while block n is computed, one barrier per block (48 KB).
//
// Online softmax: the running row max (log2 units) moves only when a block's max exceeds it by
// more than kRescaleSlack (bf16 with a 16-bit O; the others keep the exact max), so P <= 2^8
// and most blocks need no rescale of O and the sum; the rescale of O is skipped when no row of
// the warp moved (at head_dim 128 the multiply cost 6 % on an H100 when always done).
#include "attention_common.cuh"

#include <algorithm>
#include <cmath>

namespace burst::kernels::detail {
namespace {

// A row's running max (log2 units) moves only when a block's max exceeds it by more than this:
// P = exp2(score - max) then stays <= 2^8 (bf16/fp16 rounding is relative, so no precision is
// lost), and O and the sum need no rescale for most blocks (O / sum and the LSE use the same,
// possibly stale, max).
// Only for bf16 inputs with a 16-bit O (what the engine's single-GPU prefill and the benchmark
// run); the others keep the exact max (slack 0). Under a stale max the row's largest P, exactly
// 1 under the exact max, is rounded to the input dtype too: that error alone took the kernel
// past twice the naive same-precision error with fp16 inputs (11-bit P) and fp32 O, 2000 x 3000
// keys, head_dim 128: 2.08x, and with bf16 inputs and fp32 O at 1024 x 1700 keys
// (GpuAttention.SplitTailOverKeys*); a 16-bit O's own rounding is the larger error there.
template <typename T, typename OutT>
constexpr float kRescaleSlack =
    std::is_same_v<T, __half> || std::is_same_v<OutT, float> ? 0.f : 8.f;

// Tile shape and pipeline of the kernel for one head_dim. All constants derive from these.
template <int kHeadDim>
struct Tile {
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockM = 128;  // query rows per CTA
  static constexpr int kBlockN = 64;   // keys per pipeline stage
  static constexpr int kWarps = 4;
  static constexpr int kMinBlocks = 2;  // CTAs per SM
  // Head_dim 64: Q fragments in registers, two buffers of K and of V. Head_dim 128: neither
  // fits (registers, an A100's shared memory: K and V share a ring of three buffers instead,
  // s_k = s_v); there the K and V head bases are recomputed from the kernel parameters at
  // every load instead of held in registers through the main loop: the 4 registers that frees
  // are what the rescale skip needs (held, ptxas spilled 8 bytes for sm_90a, reloaded every
  // key block, and the skip gained nothing).
  static constexpr bool kSmallHead = kD == 64;
  static constexpr bool kRing = !kSmallHead;
  static constexpr int kKvTiles = kRing ? 3 : 4;
  static constexpr bool kQInRegs = kSmallHead;
  static constexpr bool kKvBaseInRegs = kSmallHead;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;  // 32
  static constexpr int kMAtoms = kWarpRows / 16;      // m16 atoms per warp
  static constexpr int kSAtoms = kBlockN / 8;         // n8 atoms of S per m atom
  static constexpr int kOAtoms = kD / 8;              // n8 atoms of O per m atom
  static constexpr int kChunks = kD / 8;              // 16-byte chunks per smem row
  static constexpr int kTileElems = kBlockN * kD;
  static constexpr int kSmemElems = kBlockM * kD + kKvTiles * kTileElems;

  static_assert(kD == 64 || kD == 128, "head_dim 64 or 128");
  // The XOR swizzle permutes 8 chunks of a row: rows need at least 8 chunks of 16 bytes.
  static_assert(kChunks >= 8 && kChunks % 8 == 0, "swizzle needs rows of 8k 16-byte chunks");
  static_assert(kWarpRows % 16 == 0, "a warp owns whole m16 atoms");
  static_assert(kBlockN % 16 == 0 && kD % 16 == 0, "k16 slices of keys and of head_dim");
  static_assert(kSAtoms % 2 == 0 && kOAtoms % 2 == 0, "ldmatrix.x4 loads two n8 atoms");
  static_assert((kBlockM * kChunks) % kThreads == 0 && (kBlockN * kChunks) % kThreads == 0,
                "every thread copies the same number of chunks");
  // An A100 has 164 KB of shared memory per SM, 1 KB of it reserved per CTA.
  static_assert(kMinBlocks * (kSmemElems * 2 + 1024) <= 164 * 1024, "CTAs per SM on an A100");
};

// Copies rows [0, kRows) of a tile starting at g into s; rows >= rows_valid are zero-filled
// without touching global memory (g itself always points at a valid row). A thread copies the
// same chunk column of rows r, r + kRowStep, ...: one pointer that steps, rather than a 64-bit
// offset per row that the compiler would keep live in registers across the main loop.
template <int kRows, int kD, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t row_stride, int rows_valid,
                                          int tid) {
  constexpr int kChunks = kD / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowStep == 0, "whole rows per step");
  const int row0 = tid / kChunks, chunk = tid % kChunks;  // consecutive threads: one row
  const T* src = g + row0 * row_stride + chunk * 8;
  T* dst = s + swz<kD>(row0, chunk);  // row0 + i * kRowStep has the same row % 8 for all i
  static_assert(kRowStep % 8 == 0, "the swizzle pattern repeats every kRowStep rows");
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const bool ok = row0 + i * kRowStep < rows_valid;
    cp_async_16(dst + i * kRowStep * kD, ok ? src : g, ok ? 16 : 0);
    src += kRowStep * row_stride;
  }
}

// ---- the kernel ------------------------------------------------------------------------------

template <typename T, typename OutT, int kHeadDim>
__global__ void __launch_bounds__(Tile<kHeadDim>::kThreads, Tile<kHeadDim>::kMinBlocks)
    attention_fwd_kernel(const KernelArgs<T, OutT> a) {
  using Tl = Tile<kHeadDim>;
  constexpr int kD = Tl::kD, kBlockM = Tl::kBlockM, kBlockN = Tl::kBlockN;
  constexpr int kMA = Tl::kMAtoms, kSA = Tl::kSAtoms, kOA = Tl::kOAtoms;
  constexpr int kThreads = Tl::kThreads, kTile = Tl::kTileElems;
  constexpr uint32_t kTileBytes = kTile * sizeof(T);
  constexpr float kNegInf = -INFINITY;

  extern __shared__ uint4 smem_raw[];  // uint4: 16-byte alignment for cp.async and ldmatrix
  T* s_q = reinterpret_cast<T*>(smem_raw);
  T* s_k = s_q + kBlockM * kD;
  T* s_v = Tl::kRing ? s_k : s_k + 2 * kTile;

  // The grid is (query blocks, heads, 1) or, heads first, (1, heads, query blocks) (see
  // launch()); query blocks from the last, which see the most keys under a causal mask. Read
  // from the special registers without a select, so that the compiler may read them again
  // where needed instead of holding them (head_dim 128 has no register to spare: a select on
  // a kernel parameter cost it 3 % on an H100).
  const int m_block = (gridDim.x - 1 - blockIdx.x) + (gridDim.z - 1 - blockIdx.z);
  const int h = blockIdx.y;
  const int g = h / a.group;
  const int m0 = m_block * kBlockM;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rows_valid = min(kBlockM, a.n_q - m0);

  // Key blocks past n_end are skipped; blocks n with (n + 1) * kBlockN - 1 <= min_limit are
  // fully visible to every row: no mask.
  const auto [n_end, min_limit] = visible_keys(a, m0, rows_valid);
  const int n_blocks = (n_end + kBlockN - 1) / kBlockN;

  // This thread's rows: atom mi, half hf -> row m0 + warp*kWarpRows + mi*16 + lane/4 + hf*8.
  const int row_base = m0 + warp * Tl::kWarpRows + (lane >> 2);

  float acc[kMA][kOA][4];
  // row_max in log2 units (score * scale_log2); corr: the factor that moves acc and row_sum
  // from the previous max to the current one.
  float row_max[kMA][2], row_sum[kMA][2], corr[kMA][2];
#pragma unroll
  for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
    for (int na = 0; na < kOA; ++na) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][na][e] = 0.f;
    }
    row_max[mi][0] = row_max[mi][1] = kNegInf;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
    corr[mi][0] = corr[mi][1] = 1.f;
  }

  // Lane-fixed parts of the ldmatrix addresses (see LdmBases and the fragment comments below).
  const LdmBases<kD, T> q_ldm(s_q, warp * Tl::kWarpRows + (lane & 15), lane >> 4, lane);
  const LdmBases<kD, T> k_ldm(s_k, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1, lane);
  const LdmBases<kD, T> v_ldm(s_v, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4, lane);

  const T* q_base = a.q + int64_t{m0} * a.q_row_stride + int64_t{h} * a.q_head_stride;
  // Key block n of K (or V) of this head's group. Not kKvBaseInRegs: the group index passes
  // through an opaque move, so the compiler recomputes the head base at each load instead of
  // hoisting it out of the loop into registers.
  auto kv_block = [&](const T* tensor, int64_t head_stride, int64_t row_stride, int n) {
    int group = g;
    if constexpr (!Tl::kKvBaseInRegs) asm volatile("mov.b32 %0, %1;" : "=r"(group) : "r"(g));
    return tensor + int64_t{group} * head_stride + int64_t{n} * kBlockN * row_stride;
  };
  auto load_k = [&](int n, int st) {
    load_tile<kBlockN, kD, kThreads>(s_k + st * kTile,
                                     kv_block(a.k, a.k_head_stride, a.k_row_stride, n),
                                     a.k_row_stride, a.n_kv - n * kBlockN, tid);
  };
  auto load_v = [&](int n, int st) {
    load_tile<kBlockN, kD, kThreads>(s_v + st * kTile,
                                     kv_block(a.v, a.v_head_stride, a.v_row_stride, n),
                                     a.v_row_stride, a.n_kv - n * kBlockN, tid);
  };

  // Q fragments in registers (kQInRegs), loaded once after Q has arrived.
  constexpr int kQRegM = Tl::kQInRegs ? kMA : 1, kQRegK = Tl::kQInRegs ? kD / 16 : 1;
  uint32_t qf[kQRegM][kQRegK][4];
  auto load_q_regs = [&] {
    if constexpr (Tl::kQInRegs) {
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) ldmatrix_x4(qf[mi][ks], q_ldm.at(ks, mi * 16));
      }
    }
  };

  // S = Q.K^T for this warp's rows and the kBlockN keys in K buffer st.
  auto compute_s = [&](float(&s)[kMA][kSA][4], int st) {
#pragma unroll
    for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
      for (int na = 0; na < kSA; ++na) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][na][e] = 0.f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      uint32_t qa[kMA][4];
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
        if constexpr (Tl::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) qa[mi][r] = qf[mi][ks][r];
        } else {
          // Matrices 0..3 = rows 0-7/8-15 x cols 0-7, then x cols 8-15: the A fragment order.
          ldmatrix_x4(qa[mi], q_ldm.at(ks, mi * 16));
        }
      }
#pragma unroll
      for (int np = 0; np < kSA / 2; ++np) {
        // Matrices: keys 0-7 x d 0-7, keys 0-7 x d 8-15, keys 8-15 x d 0-7, keys 8-15 x d 8-15
        // = (b0, b1) of key atom 2np, then of 2np+1 (K row-major is B column-major).
        uint32_t kb[4];
        ldmatrix_x4(kb, k_ldm.at(ks, np * 16) + st * kTileBytes);
#pragma unroll
        for (int mi = 0; mi < kMA; ++mi) {
          mma_16816<T>(s[mi][2 * np], qa[mi], kb[0], kb[1]);
          mma_16816<T>(s[mi][2 * np + 1], qa[mi], kb[2], kb[3]);
        }
      }
    }
  };

  // Mask only the blocks that need it: the causal diagonal and the n_kv tail (whose keys
  // were zero-filled and must not count). Masked scores become -inf, so exp2 gives 0.
  // limit is the last key a row may see (-1: none); it also excludes the zero-filled tail.
  auto mask = [&](float(&s)[kMA][kSA][4], int n) {
    if ((n + 1) * kBlockN - 1 > min_limit) {
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int64_t row = row_base + mi * 16 + hf * 8;
          const int limit =
              a.causal ? static_cast<int>(std::clamp<int64_t>(row + a.delta, -1, a.n_kv - 1))
                       : a.n_kv - 1;
          // Relative to this thread's first key of the block.
          const int rel = limit - (n * kBlockN + (lane & 3) * 2);
#pragma unroll
          for (int na = 0; na < kSA; ++na) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (na * 8 + e > rel) s[mi][na][2 * hf + e] = kNegInf;
            }
          }
        }
      }
    }
  };

  // Online softmax of one block, in two parts. new_max: per row, the block max; the running
  // max moves only past the slack (then corr != 1); returns whether any row of this warp moved
  // (otherwise corr is 1 for all its rows). exponentiate: P = exp2(scaled - max) into p, and the
  // row sums. O's rescale (a branch, when moved) goes before the exp2s or after the barrier that
  // follows them, never between them and P.V: there (head_dim 64) it kept ptxas from
  // interleaving the exp2s with P.V's MMAs, -3.5 % on an H100.
  auto new_max = [&](const float(&s)[kMA][kSA][4]) {
    bool moved = false;
#pragma unroll
    for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float mx = kNegInf;
#pragma unroll
        for (int na = 0; na < kSA; ++na) {
          mx = fmaxf(mx, fmaxf(s[mi][na][2 * hf], s[mi][na][2 * hf + 1]));
        }
        // The 4 threads of a quad hold the same row.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx *= a.scale_log2;
        // From -inf (no key seen yet) any visible key moves the max: corr = exp2(-inf) = 0.
        const bool move = mx > row_max[mi][hf] + kRescaleSlack<T, OutT>;
        corr[mi][hf] = move ? exp2_approx(row_max[mi][hf] - mx) : 1.f;
        if (move) row_max[mi][hf] = mx;
        moved |= move;
      }
    }
    return __any_sync(0xffffffffu, moved);
  };
  auto exponentiate = [&](const float(&s)[kMA][kSA][4], uint32_t(&p)[kMA][kSA][2]) {
#pragma unroll
    for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        // A row that has seen only masked keys keeps max -inf: use 0 as the offset so that
        // exp2(-inf - offset) = 0 instead of exp2(-inf + inf) = NaN.
        const float offset = row_max[mi][hf] == kNegInf ? 0.f : row_max[mi][hf];
        float sum = 0.f;
#pragma unroll
        for (int na = 0; na < kSA; ++na) {
          const float p0 = exp2_approx(fmaf(s[mi][na][2 * hf], a.scale_log2, -offset));
          const float p1 = exp2_approx(fmaf(s[mi][na][2 * hf + 1], a.scale_log2, -offset));
          sum += p0 + p1;
          p[mi][na][hf] = pack2<T>(p0, p1);
        }
        // The sum keeps the unrounded P (as the fp32 reference does); it stays per thread
        // until the epilogue's quad reduction.
        row_sum[mi][hf] = row_sum[mi][hf] * corr[mi][hf] + sum;
      }
    }
  };

  auto rescale = [&] {
#pragma unroll
    for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
      for (int na = 0; na < kOA; ++na) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][na][e] *= corr[mi][e >> 1];
      }
    }
  };

  // O += P.V with V buffer st. The C fragment of S (rows g, g+8 x keys 2t, 2t+1 of an n8
  // atom) is the A fragment of a k16 slice when two key atoms are paired: no shuffles needed.
  auto pv = [&](const uint32_t(&p)[kMA][kSA][2], int st) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t pf[kMA][4];
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
        pf[mi][0] = p[mi][2 * kk][0];
        pf[mi][1] = p[mi][2 * kk][1];
        pf[mi][2] = p[mi][2 * kk + 1][0];
        pf[mi][3] = p[mi][2 * kk + 1][1];
      }
#pragma unroll
      for (int dp = 0; dp < kOA / 2; ++dp) {
        // Transposed: matrices keys 0-7 x d 0-7, keys 8-15 x d 0-7, keys 0-7 x d 8-15, keys
        // 8-15 x d 8-15 = (b0, b1) of d atom 2dp, then of 2dp+1.
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_ldm.at(dp, kk * 16) + st * kTileBytes);
#pragma unroll
        for (int mi = 0; mi < kMA; ++mi) {
          mma_16816<T>(acc[mi][2 * dp], pf[mi], vb[0], vb[1]);
          mma_16816<T>(acc[mi][2 * dp + 1], pf[mi], vb[2], vb[3]);
        }
      }
    }
  };

  if (n_blocks > 0) {
    const int n0 = n_blocks - 1;
    load_tile<kBlockM, kD, kThreads>(s_q, q_base, a.q_row_stride, rows_valid, tid);
    load_k(n0, 0);
    if constexpr (Tl::kRing) {
      cp_async_commit();
      load_v(n0, 1);
    } else {
      load_v(n0, 0);
    }
    cp_async_commit();
    if constexpr (Tl::kQInRegs) {
      cp_async_wait<0>();
      __syncthreads();
      load_q_regs();
    }

    if constexpr (Tl::kRing) {
      // A ring of three tiles: K[n0], V[n0], K[n0-1], V[n0-1], ... take buffers 0, 1, 2, 0, ...
      // A block's loads go out a whole block before it runs: K[n-1] while S = Q.K[n]^T and
      // the softmax run, V[n-1] while O += P.V[n] runs (with one K and one V buffer, K[n-1]
      // had only P.V's time). Every step commits a group, empty at the end, so that waiting
      // for all but the newest group is always the tile needed next.
      // The buffers rotate at run time: unrolled by three so that they were constants, ptxas
      // spilled 80-116 bytes and the kernel ran 7 % slower on an H100. Against one K and one
      // V buffer (V[n] loaded during S, K[n-1] during P.V): +1.2 % at 4K-16K on an H100.
      auto step = [&](int n, int kb, int vb, int fb) {
        cp_async_wait<1>();
        // K[n] is visible to all; every warp has finished P.V of block n+1 (buffer fb).
        __syncthreads();
        if (n > 0) load_k(n - 1, fb);
        cp_async_commit();
        float s[kMA][kSA][4];
        compute_s(s, kb);
        mask(s, n);
        uint32_t p[kMA][kSA][2];
        const bool moved = new_max(s);
        exponentiate(s, p);
        cp_async_wait<1>();
        // V[n] is visible to all; every warp has finished S of block n (buffer kb).
        __syncthreads();
        if (n > 0) load_v(n - 1, kb);
        cp_async_commit();
        // O's rescale after the barrier, right before P.V (after the softmax it gained
        // nothing: ptxas then left the barrier after the exp2s instead of hoisting it).
        if (moved) rescale();  // else corr is 1 for every row of the warp
        pv(p, vb);
      };
      int kb = 0, vb = 1, fb = 2;
      for (int n = n0; n >= 0; --n) {
        step(n, kb, vb, fb);
        const int t = fb;
        fb = vb;
        vb = kb;
        kb = t;
      }
    } else {
      // Two buffers of each: block n-1 streams into buffer st^1 while block n is computed.
      // Unrolled by two, so that the buffer offsets are constants.
      auto step = [&](int n, int st) {
        cp_async_wait<0>();
        // Block n is visible to all; every warp has finished block n+1 (buffer st^1).
        __syncthreads();
        if (n > 0) {
          load_k(n - 1, st ^ 1);
          load_v(n - 1, st ^ 1);
          cp_async_commit();
        }
        float s[kMA][kSA][4];
        compute_s(s, st);
        mask(s, n);
        uint32_t p[kMA][kSA][2];
        if (new_max(s)) rescale();  // before the exp2s, which then run beside P.V's MMAs
        exponentiate(s, p);
        pv(p, st);
      };
      for (int n = n0;;) {
        step(n, 0);
        if (--n < 0) break;
        step(n, 1);
        if (--n < 0) break;
      }
    }
  }

  // Epilogue: normalise and write this thread's rows. A row that saw a key has sum >= 1 (its
  // max term is exp2(0)); sum == 0 means it saw none: O = 0, LSE = -inf.
  OutT* o_base = a.o + int64_t{h} * a.o_head_stride;
  if constexpr (std::is_same_v<OutT, float>) {
    if (a.merge) {
      // Into a partial result of these rows (AttnParams::merge_into_o); its own branch, so the
      // plain epilogue below keeps its code (folded together, the Hopper kernel lost 8-12 %).
      float sums[kMA][2], old_lse[kMA][2];
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float sum = quad_sum(row_sum[mi][hf]);
          sums[mi][hf] = sum;
          const int row = row_base + mi * 16 + hf * 8;
          old_lse[mi][hf] =
              row < a.n_q ? a.lse[int64_t{h} * a.lse_head_stride + row] : kNegInf;
        }
      }
      __syncwarp();  // the row's 4 threads have read its old LSE before one writes it
#pragma unroll
      for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float sum = sums[mi][hf];
          const int row = row_base + mi * 16 + hf * 8;
          if (row >= a.n_q || !(sum > 0.f)) continue;  // b saw nothing: a stays
          merge_row_into<kOA>(
              o_base + int64_t{row} * a.o_row_stride, a.lse + int64_t{h} * a.lse_head_stride + row,
              lane, old_lse[mi][hf], row_max[mi][hf] * kLn2 + logf(sum), 1.f / sum,
              [&](int na) {
                return make_float2(acc[mi][na][2 * hf], acc[mi][na][2 * hf + 1]);
              });
        }
      }
      return;
    }
  }
#pragma unroll
  for (int mi = 0; mi < kMA; ++mi) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float sum = quad_sum(row_sum[mi][hf]);
      const int row = row_base + mi * 16 + hf * 8;
      const bool in = row < a.n_q, empty = !(sum > 0.f);
      store_row<kOA>(in ? o_base + int64_t{row} * a.o_row_stride : nullptr, lane,
                     empty ? 0.f : 1.f / sum, [&](int na) {
                       return make_float2(acc[mi][na][2 * hf], acc[mi][na][2 * hf + 1]);
                     });
      if (in && (lane & 3) == 0) {
        a.lse[int64_t{h} * a.lse_head_stride + row] =
            empty ? kNegInf : row_max[mi][hf] * kLn2 + logf(sum);
      }
    }
  }
}

// ---- launch ----------------------------------------------------------------------------------

// The hardware starts CTAs in grid order. Causal CTAs differ in work (query block m sees
// 2 (m + 1) key blocks): head after head, the last head's heaviest blocks start in the last
// wave and the busy time grows by up to one of them. Heads first (every head's heaviest
// block, then every head's next: longest first) ends on the lightest blocks. Measured on an
// H100 (32 heads), heads first against head after head: head_dim 128 +22 % at 4K tokens, +10 %
// at 8K, +5 % at 16K; head_dim 64 +10 %, +5.5 %, +3 %; but at 64K head_dim 64 -8 % (128: no
// change): there each of the 264 CTA slots runs 31 heaviest blocks' worth of work, so the
// head-major tail is short beside it, while heads first the two CTAs of a multiprocessor
// start together with equal work. So heads first only where a slot's share, heads x m_count
// / (2 slots) heaviest blocks, is under kHeadsFirstShare (32K at 32 heads: 15.5 on an H100,
// 19 on an A100's 216 slots).
constexpr int kHeadsFirstShare = 20;
constexpr int kSlotsPerSm = Tile<128>::kMinBlocks;
static_assert(Tile<64>::kMinBlocks == kSlotsPerSm, "one CTA count a multiprocessor");

}  // namespace

bool attention_sm80_heads_first(const AttnParams& p, int sms) {
  if (p.mask != MaskKind::kCausal) return false;
  constexpr int64_t kBlockM = Tile<128>::kBlockM;
  static_assert(Tile<64>::kBlockM == kBlockM, "one query tile");
  // Only where the blocks' work differs: the last query block sees at least 1.5x the keys of
  // the first. A chunk after a longer prefix (the engine's chunked prefill) has blocks of
  // nearly equal work; heads first there measured -5 % to +2 % (8192 queries after 57K-123K
  // keys), and +4 to +11 % where the last block saw 2x the first's keys (bench/gpu/
  // bench_chunks.py, docs/benchmarks.md).
  const int64_t delta = p.q_start - p.kv_start;
  const int64_t first_keys = std::clamp<int64_t>(delta + kBlockM, 0, p.n_kv);
  const int64_t last_keys = std::clamp<int64_t>(delta + p.n_q, 0, p.n_kv);
  if (2 * last_keys < 3 * first_keys) return false;
  const int64_t m_count = (p.n_q + kBlockM - 1) / kBlockM;
  const int64_t slots = int64_t{sms} * kSlotsPerSm;
  return int64_t{p.heads} * m_count < 2 * kHeadsFirstShare * slots &&
         m_count <= 65535;  // a grid's z extent
}

namespace {

template <typename T, typename OutT, int kHeadDim>
cudaError_t launch(const AttnParams& p, cudaStream_t stream) {
  using Tl = Tile<kHeadDim>;
  const KernelArgs<T, OutT> a = make_kernel_args<T, OutT>(p);
  auto* kernel = attention_fwd_kernel<T, OutT, kHeadDim>;
  constexpr int kSmemBytes = Tl::kSmemElems * static_cast<int>(sizeof(T));
  // Above 48 KiB a kernel must opt in to dynamic shared memory (per device, so every call).
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  // Causal CTAs heaviest first over all heads where that shortens the tail (above).
  const int m_count = (p.n_q + Tl::kBlockM - 1) / Tl::kBlockM;
  bool heads_first = false;
  if (p.mask == MaskKind::kCausal) {
    int sms = 0;
    err = multiprocessors(sms);
    if (err != cudaSuccess) return err;
    heads_first = detail::attention_sm80_heads_first(p, sms);
  }
  const dim3 grid = heads_first ? dim3(1, p.heads, m_count) : dim3(m_count, p.heads, 1);
  kernel<<<grid, Tl::kThreads, kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

// Every instantiation of the kernel, in one place: {bf16, fp16} x {o = input, o = fp32} x
// head_dim {64, 128}.
template <typename T>
cudaError_t dispatch_out(const AttnParams& p, cudaStream_t stream) {
  const bool o_f32 = output_dtype(p) == DType::kF32;
  if (p.head_dim == 128) {
    return o_f32 ? launch<T, float, 128>(p, stream) : launch<T, T, 128>(p, stream);
  }
  return o_f32 ? launch<T, float, 64>(p, stream) : launch<T, T, 64>(p, stream);
}

}  // namespace

cudaError_t attention_sm80(const AttnParams& p, cudaStream_t stream) {
  return p.dtype == DType::kBF16 ? dispatch_out<__nv_bfloat16>(p, stream)
                                 : dispatch_out<__half>(p, stream);
}

}  // namespace burst::kernels::detail
