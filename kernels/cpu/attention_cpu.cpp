// CPU reference of the attention contract in kernels/attention.h: key tiles with an online
// softmax in fp32, exactly the recurrence the CUDA kernel and the ring use.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/kv_fp8.h"

namespace burst::kernels {

namespace {
constexpr int kKeyTile = 64;
constexpr int kDots = 8;  // keys whose scores are summed together (kKeyTile is a multiple)
static_assert(kKeyTile % kDots == 0, "whole groups of keys per tile");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// FP8 attention (AttnParams::qkv_fp8), as kernels/cuda/attention_fp8.cu quantizes.
constexpr int kFp8QGroup = 64, kFp8QTile = 128, kFp8KBlock = 128;
constexpr float kFp8MinAmax = 1e-6f;
}  // namespace

void set_packed_strides(AttnParams& p) {
  p.q_row_stride = p.o_row_stride = int64_t{p.heads} * p.head_dim;
  p.q_head_stride = p.o_head_stride = p.head_dim;
  p.k_row_stride = p.v_row_stride = int64_t{p.kv_heads} * p.head_dim;
  p.k_head_stride = p.v_head_stride = p.head_dim;
  p.lse_head_stride = p.n_q;
}

std::string validate(const AttnParams& p) {
  if (p.n_q < 0 || p.n_kv < 0) return "negative n_q or n_kv";
  if (p.heads <= 0 || p.kv_heads <= 0 || p.head_dim <= 0) return "heads, kv_heads, head_dim must be > 0";
  if (p.heads % p.kv_heads != 0) return "heads must be a multiple of kv_heads (GQA)";
  if (p.n_q > 0 && (!p.q || !p.o || !p.lse)) return "null q, o or lse";
  if (p.n_q > 0 && p.n_kv > 0 && (!p.k || !p.v)) return "null k or v";
  if (!(p.scale > 0.f)) return "scale must be > 0";
  if (p.mask != MaskKind::kNone && p.mask != MaskKind::kCausal) return "unknown mask kind";
  if (p.kv_pages && p.page_size <= 0) return "kv_pages needs page_size > 0";
  if (p.row_kv_len && (!p.kv_pages || !p.row_page_offset || p.mask != MaskKind::kNone)) {
    return "row_kv_len needs kv_pages, row_page_offset and mask kNone";
  }
  return {};
}

BlockRelation block_relation(int64_t q_start, int64_t n_q, int64_t kv_start, int64_t n_kv) {
  if (n_q <= 0 || n_kv <= 0) return BlockRelation::kSkip;
  const int64_t q_last = q_start + n_q - 1;
  const int64_t kv_last = kv_start + n_kv - 1;
  if (kv_start > q_last) return BlockRelation::kSkip;   // every key after every query
  if (kv_last <= q_start) return BlockRelation::kFull;  // every key at or before every query
  return BlockRelation::kPartial;
}

namespace {

// (o_a, *la) <- the merge of (o_a, *la) and (o_b, lb), o into dst (o_a itself or elsewhere).
void merge_row(const float* oa, float* la, const float* ob, float lb, int d, float* dst) {
  const float a = *la;
  if (lb == kNegInf) {  // b saw nothing: a is already the answer
    if (dst != oa) std::copy(oa, oa + d, dst);
    return;
  }
  if (a == kNegInf) {  // a saw nothing: take b (avoids -inf - -inf)
    std::copy(ob, ob + d, dst);
    *la = lb;
    return;
  }
  const float mx = std::max(a, lb);
  const float lse = mx + std::log1p(std::exp(-std::fabs(a - lb)));
  const float wa = std::exp(a - lse), wb = std::exp(lb - lse);
  for (int c = 0; c < d; ++c) dst[c] = oa[c] * wa + ob[c] * wb;
  *la = lse;
}

// Row r of K or V, kv head g, as fp32: a pointer into the tensor itself, or (FP8 KV rows,
// AttnParams::kv_fp8) its values dequantized into buf [head_dim].
struct KvRows {
  const void* base;
  int64_t row_stride, head_stride;
  bool fp8;
  int kv_heads, head_dim;
  const float* row(int64_t r, int g, float* buf) const {
    if (!fp8) return static_cast<const float*>(base) + r * row_stride + g * head_stride;
    const auto* bytes = static_cast<const uint8_t*>(base) + r * row_stride;
    float scale = 0.f;
    std::memcpy(&scale, bytes + kv_fp8_scale_offset(kv_heads, head_dim) + 4 * g, 4);
    const uint8_t* x = bytes + int64_t{g} * head_dim;
    for (int c = 0; c < head_dim; ++c) buf[c] = fp8_e4m3_to_float(x[c]) * scale;
    return buf;
  }
};

// Scores of keys j0 .. j0 + jn - 1 (at most kKeyTile) against query row qi, kv head g, times
// p.scale, into s [jn]; returns their max. buf: room for kDots FP8 rows read [kDots * d].
float tile_scores(const AttnParams& p, const KvRows& k, const int32_t* pages, const float* qi,
                  int g, int64_t j0, int64_t jn, float* s, float* buf) {
  const int d = p.head_dim;
  float tile_max = kNegInf;
  // kDots keys at a time: independent sums the CPU overlaps (one sum's chain of dependent
  // adds is latency-bound), each still q[0] k[0] + q[1] k[1] + ... in order, so the
  // scores are the same to the bit as one key at a time.
  int64_t t = 0;
  for (; t + kDots <= jn; t += kDots) {
    const float* kt[kDots];
    for (int u = 0; u < kDots; ++u) {
      kt[u] = k.row(kv_row(pages, p.page_size, j0 + t + u), g, buf + u * d);
    }
    float dot[kDots] = {};
    for (int c = 0; c < d; ++c) {
      const float qc = qi[c];
      for (int u = 0; u < kDots; ++u) dot[u] += qc * kt[u][c];
    }
    for (int u = 0; u < kDots; ++u) {
      s[t + u] = dot[u] * p.scale;
      tile_max = std::max(tile_max, s[t + u]);
    }
  }
  for (; t < jn; ++t) {
    const float* kj = k.row(kv_row(pages, p.page_size, j0 + t), g, buf);
    float dot = 0.f;
    for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
    s[t] = dot * p.scale;
    tile_max = std::max(tile_max, s[t]);
  }
  return tile_max;
}

// A row's end: acc [d] (the unnormalized sum of P.V) with running max m and sum l over
// `visible` keys becomes o oi and lse *lse, or is merged into them (p.merge_into_o).
void finish_row(const AttnParams& p, int64_t visible, float m, float l, float* acc, float* oi,
                float* lse) {
  const int d = p.head_dim;
  if (visible == 0) {  // empty row: contributes nothing to a later merge
    if (!p.merge_into_o) {
      for (int c = 0; c < d; ++c) oi[c] = 0.f;
      *lse = kNegInf;
    }
    return;
  }
  const float inv = 1.f / l;
  for (int c = 0; c < d; ++c) acc[c] *= inv;
  if (p.merge_into_o) {
    merge_row(oi, lse, acc, m + std::log(l), d, oi);
  } else {
    std::copy(acc, acc + d, oi);
    *lse = m + std::log(l);
  }
}

// Row i of head h: its keys in tiles with an online softmax, then o and lse (or their merge).
// fp8_p: P as FP8 attention makes it (kernels/attention.h: kFp8PCodeRound), e4m3 codes against
// a running max in log2 units on the codes' lattice, and the sum of the codes' values.
void attention_row(const AttnParams& p, const KvRows& k, const KvRows& v, int h, int i,
                   bool fp8_p) {
  const auto* q = static_cast<const float*>(p.q);
  auto* o = static_cast<float*>(p.o);
  const int group = p.heads / p.kv_heads;
  const int d = p.head_dim;
  const int g = h / group;
  const float* qi = q + i * p.q_row_stride + h * p.q_head_stride;
  float* oi = o + i * p.o_row_stride + h * p.o_head_stride;
  // Row i's keys: its own under per-row K/V, else the shared ones.
  const int64_t n_kv = p.row_kv_len ? p.row_kv_len[i] : p.n_kv;
  const int32_t* pages = p.kv_pages ? p.kv_pages + (p.row_page_offset ? p.row_page_offset[i] : 0)
                                    : nullptr;
  // Keys visible to row i: all under kNone; under kCausal those with position <= q's.
  int64_t visible = n_kv;
  if (p.mask == MaskKind::kCausal) {
    visible = std::clamp<int64_t>(p.q_start + i - p.kv_start + 1, 0, n_kv);
  }
  std::vector<float> acc(d, 0.f), s(kKeyTile);
  std::vector<float> buf(p.kv_fp8 ? static_cast<size_t>(kDots) * d : 0);  // FP8 rows read
  // m: the running max, natural-log units (fp8_p: log2 units, on the lattice); l: the sum.
  const float unbias = std::exp2(-kFp8PBias);  // a P code's value is P x 2^kFp8PBias (exact)
  float m = kNegInf, l = 0.f;
  for (int64_t j0 = 0; j0 < visible; j0 += kKeyTile) {
    const int64_t jn = std::min<int64_t>(kKeyTile, visible - j0);
    const float tile_max = tile_scores(p, k, pages, qi, g, j0, jn, s.data(), buf.data());
    // Online softmax: rescale what was accumulated under the old max (m = -inf on the first
    // tile: corr = 0).
    float m_new = 0.f, corr = 0.f, shift = 0.f;
    if (fp8_p) {
      const float lattice = fp8_p_lattice(std::max(m, tile_max * kLog2e));
      m_new = fp8_p_offset(lattice);
      corr = std::exp2(m - m_new);
      shift = fp8_p_code_shift(lattice);
    } else {
      m_new = std::max(m, tile_max);
      corr = std::exp(m - m_new);
    }
    l *= corr;
    for (int c = 0; c < d; ++c) acc[c] *= corr;
    for (int64_t t = 0; t < jn; ++t) {
      float pt = 0.f;
      if (fp8_p) {
        // The code, clamped below at 0 (far-below scores; NaN too); never above 120 by the
        // lattice, kept below e4m3's NaN code all the same.
        const float code =
            std::fmin(std::fmax(std::nearbyint(std::fma(8.f * kLog2e, s[t], shift)), 0.f), 126.f);
        pt = fp8_e4m3_to_float(static_cast<uint8_t>(code)) * unbias;
      } else {
        pt = std::exp(s[t] - m_new);
      }
      l += pt;
      const float* vj = v.row(kv_row(pages, p.page_size, j0 + t), g, buf.data());
      for (int c = 0; c < d; ++c) acc[c] += pt * vj[c];
    }
    m = m_new;
  }
  finish_row(p, visible, fp8_p ? m * kLn2 : m, l, acc.data(), oi,
             p.lse + h * p.lse_head_stride + i);
}

void attention_rows(const AttnParams& p, bool fp8_p) {
  const KvRows k{p.k, p.k_row_stride, p.k_head_stride, p.kv_fp8, p.kv_heads, p.head_dim};
  const KvRows v{p.v, p.v_row_stride, p.v_head_stride, p.kv_fp8, p.kv_heads, p.head_dim};
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < p.heads; ++h) {
    for (int i = 0; i < p.n_q; ++i) attention_row(p, k, v, h, i, fp8_p);
  }
}

float e4m3_round(float x, float inv, float scale) {
  return fp8_e4m3_to_float(fp8_e4m3_from_float(x * inv)) * scale;
}

// x [d] times FP8 attention's rotation: the column signs, the Walsh-Hadamard transform, then
// 1 / sqrt(d) (orthogonal). d a power of two.
void rotate(float* x, int d) {
  for (int c = 0; c < d; ++c) {
    if (fp8_rotation_negates(static_cast<uint32_t>(c))) x[c] = -x[c];
  }
  for (int half = 1; half < d; half <<= 1) {
    for (int i = 0; i < d; i += 2 * half) {
      for (int j = i; j < i + half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a + b;
        x[j + half] = a - b;
      }
    }
  }
  const float norm = 1.f / std::sqrt(static_cast<float>(d));
  for (int c = 0; c < d; ++c) x[c] *= norm;
}

// Rows [0, n) of x ([n][heads][d] at the given strides), rotated (rotate_rows) and rounded to
// e4m3 with one scale per head and group of `group` rows, groups starting `pad` rows before row
// 0; packed [n][heads][d].
std::vector<float> fp8_rows(const float* x, int64_t row_stride, int64_t head_stride, int n,
                            int heads, int d, int group, int pad, bool rotate_rows) {
  std::vector<float> out(static_cast<size_t>(n) * heads * d);
  for (int h = 0; h < heads; ++h) {
    for (int first = -pad; first < n; first += group) {
      const int lo = std::max(first, 0), hi = std::min(first + group, n);
      float amax = kFp8MinAmax;
      for (int r = lo; r < hi; ++r) {
        float* dst = &out[(static_cast<size_t>(r) * heads + h) * d];
        std::copy_n(x + r * row_stride + h * head_stride, d, dst);
        if (rotate_rows) rotate(dst, d);
        for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(dst[c]));
      }
      const float scale = amax / kFp8E4M3Max, inv = kFp8E4M3Max / amax;
      for (int r = lo; r < hi; ++r) {
        float* dst = &out[(static_cast<size_t>(r) * heads + h) * d];
        for (int c = 0; c < d; ++c) dst[c] = e4m3_round(dst[c], inv, scale);
      }
    }
  }
  return out;
}

// V rounded to e4m3 with one scale per kv head and column (its max |v| over the n rows).
std::vector<float> fp8_columns(const float* x, int64_t row_stride, int64_t head_stride, int n,
                               int heads, int d) {
  std::vector<float> out(static_cast<size_t>(n) * heads * d);
  for (int h = 0; h < heads; ++h) {
    for (int c = 0; c < d; ++c) {
      float amax = kFp8MinAmax;
      for (int r = 0; r < n; ++r) amax = std::max(amax, std::fabs(x[r * row_stride + h * head_stride + c]));
      const float scale = amax / kFp8E4M3Max, inv = kFp8E4M3Max / amax;
      for (int r = 0; r < n; ++r) {
        out[(static_cast<size_t>(r) * heads + h) * d + c] =
            e4m3_round(x[r * row_stride + h * head_stride + c], inv, scale);
      }
    }
  }
  return out;
}

// AttnParams::qkv_fp8 on the CPU: the roundings of attention_fp8_cuda, then the fp32 recurrence
// with P rounded. The rotation needs a power-of-two head_dim; others are quantized unrotated.
void attention_fp8_cpu(const AttnParams& p) {
  if (p.kv_pages || p.kv_fp8) {
    // K and V where they lie (paged, or FP8 KV rows): their fp32 values in one block first, as
    // the CUDA quantizer reads them.
    const int d = p.head_dim;
    const int64_t kvw = int64_t{p.kv_heads} * d;
    std::vector<float> k(static_cast<size_t>(p.n_kv * kvw)), v(k.size());
    const KvRows kr{p.k, p.k_row_stride, p.k_head_stride, p.kv_fp8, p.kv_heads, d};
    const KvRows vr{p.v, p.v_row_stride, p.v_head_stride, p.kv_fp8, p.kv_heads, d};
    std::vector<float> buf(static_cast<size_t>(d));
    for (int64_t j = 0; j < p.n_kv; ++j) {
      const int64_t r = kv_row(p.kv_pages, p.page_size, j);
      for (int g = 0; g < p.kv_heads; ++g) {
        std::copy_n(kr.row(r, g, buf.data()), d, &k[static_cast<size_t>(j * kvw + g * d)]);
        std::copy_n(vr.row(r, g, buf.data()), d, &v[static_cast<size_t>(j * kvw + g * d)]);
      }
    }
    AttnParams c = p;
    c.kv_pages = nullptr;
    c.page_size = 0;
    c.kv_fp8 = false;
    c.k = k.data();
    c.v = v.data();
    c.k_row_stride = c.v_row_stride = kvw;
    c.k_head_stride = c.v_head_stride = d;
    attention_fp8_cpu(c);
    return;
  }
  const int d = p.head_dim;
  const bool rotated = (d & (d - 1)) == 0;
  const int q_tiles = (p.n_q + kFp8QTile - 1) / kFp8QTile;
  const auto q = fp8_rows(static_cast<const float*>(p.q), p.q_row_stride, p.q_head_stride,
                          p.n_q, p.heads, d, kFp8QGroup, q_tiles * kFp8QTile - p.n_q, rotated);
  const auto k = fp8_rows(static_cast<const float*>(p.k), p.k_row_stride, p.k_head_stride,
                          p.n_kv, p.kv_heads, d, kFp8KBlock, 0, rotated);
  const auto v = fp8_columns(static_cast<const float*>(p.v), p.v_row_stride, p.v_head_stride,
                             p.n_kv, p.kv_heads, d);
  AttnParams r = p;
  r.qkv_fp8 = false;
  r.q = q.data();
  r.k = k.data();
  r.v = v.data();
  r.q_row_stride = int64_t{p.heads} * d;
  r.k_row_stride = r.v_row_stride = int64_t{p.kv_heads} * d;
  r.q_head_stride = r.k_head_stride = r.v_head_stride = d;
  attention_rows(r, true);
}

}  // namespace

void attention_cpu(const AttnParams& p) {
  // FP8 attention applies to prefill launches (K and V contiguous, paged or FP8 KV rows);
  // batched decode launches (per-row K/V) run as they are.
  if (p.qkv_fp8 && !p.row_kv_len && p.n_q > 0) {
    attention_fp8_cpu(p);
    return;
  }
  attention_rows(p, false);
}

void merge_cpu(const MergeParams& p) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < p.heads; ++h) {
    for (int r = 0; r < p.rows; ++r) {
      float* oa = p.o_a + r * p.o_row_stride + h * p.o_head_stride;
      const float* ob = p.o_b + r * p.o_row_stride + h * p.o_head_stride;
      // Where the merged o goes: o_a in place, or out (fp32 here).
      float* dst = p.out ? static_cast<float*>(p.out) + r * p.out_row_stride + h * p.head_dim : oa;
      merge_row(oa, p.lse_a + h * p.lse_head_stride + r, ob, p.lse_b[h * p.lse_head_stride + r],
                p.head_dim, dst);
    }
  }
}

}  // namespace burst::kernels
