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

// Row i of head h: its keys in tiles with an online softmax, then o and lse (or their merge).
void attention_row(const AttnParams& p, const KvRows& k, const KvRows& v, int h, int i) {
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
  float m = kNegInf, l = 0.f;
  for (int64_t j0 = 0; j0 < visible; j0 += kKeyTile) {
    const int64_t jn = std::min<int64_t>(kKeyTile, visible - j0);
    float tile_max = kNegInf;
    // kDots keys at a time: independent sums the CPU overlaps (one sum's chain of dependent
    // adds is latency-bound), each still q[0] k[0] + q[1] k[1] + ... in order, so the
    // scores are the same to the bit as one key at a time.
    int64_t t = 0;
    for (; t + kDots <= jn; t += kDots) {
      const float* kt[kDots];
      for (int u = 0; u < kDots; ++u) {
        kt[u] = k.row(kv_row(pages, p.page_size, j0 + t + u), g, buf.data() + u * d);
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
      const float* kj = k.row(kv_row(pages, p.page_size, j0 + t), g, buf.data());
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
      s[t] = dot * p.scale;
      tile_max = std::max(tile_max, s[t]);
    }
    // Online softmax: rescale what was accumulated under the old max.
    const float m_new = std::max(m, tile_max);
    const float corr = std::exp(m - m_new);  // m = -inf on the first tile: corr = 0
    l *= corr;
    for (int c = 0; c < d; ++c) acc[c] *= corr;
    for (int64_t t = 0; t < jn; ++t) {
      const float pt = std::exp(s[t] - m_new);
      l += pt;
      const float* vj = v.row(kv_row(pages, p.page_size, j0 + t), g, buf.data());
      for (int c = 0; c < d; ++c) acc[c] += pt * vj[c];
    }
    m = m_new;
  }
  float* lse = p.lse + h * p.lse_head_stride + i;
  if (visible == 0) {  // empty row: contributes nothing to a later merge
    if (!p.merge_into_o) {
      for (int c = 0; c < d; ++c) oi[c] = 0.f;
      *lse = kNegInf;
    }
  } else {
    const float inv = 1.f / l;
    for (int c = 0; c < d; ++c) acc[c] *= inv;
    if (p.merge_into_o) {
      merge_row(oi, lse, acc.data(), m + std::log(l), d, oi);
    } else {
      std::copy(acc.begin(), acc.end(), oi);
      *lse = m + std::log(l);
    }
  }
}

}  // namespace

void attention_cpu(const AttnParams& p) {
  const KvRows k{p.k, p.k_row_stride, p.k_head_stride, p.kv_fp8, p.kv_heads, p.head_dim};
  const KvRows v{p.v, p.v_row_stride, p.v_head_stride, p.kv_fp8, p.kv_heads, p.head_dim};
#pragma omp parallel for collapse(2) schedule(static)
  for (int h = 0; h < p.heads; ++h) {
    for (int i = 0; i < p.n_q; ++i) attention_row(p, k, v, h, i);
  }
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
