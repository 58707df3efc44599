// References for FP8 attention tests (AttnParams::qkv_fp8), CPU and GPU: an fp64 attention over
// the inputs, and the naive FP8 attention the tolerance rule is measured against (q, k and v
// each rounded to e4m3 with one scale for the whole tensor, scores in fp32 from those values,
// P = exp(s - max) rounded to e4m3 before P.V, the sum over unrounded P). Tensors are packed
// [rows][heads][head_dim] host fp32 values; LSE [heads][n_q], natural log.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/attention.h"
#include "kernels/kv_fp8.h"

namespace burst::testing {

// Runs fn(h, i) over all (head, row) pairs on all host threads.
template <typename Fn>
void parallel_rows(int heads, int rows, Fn fn) {
  const int64_t total = int64_t{heads} * rows;
  const int n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 0; t < n_threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t it = t; it < total; it += n_threads) {
        fn(static_cast<int>(it / rows), static_cast<int>(it % rows));
      }
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace burst::testing

namespace burst::testing::fp8_attention {

using kernels::MaskKind;

struct Shape {
  int n_q, n_kv, heads, kv_heads, head_dim;
  MaskKind mask;
  int64_t q_start = 0, kv_start = 0;
};

struct Inputs {
  std::vector<float> q, k, v;
};

struct Result {
  std::vector<float> o, lse;
};

// Random values never zero, magnitude in [lo, hi], random sign; with outliers, 4 channels (of
// every head) 20x the rest, as LLaMA activations have. round: applied to every value (the
// input dtype's rounding).
template <typename Round>
std::vector<float> draw(size_t rows, int heads, int d, float lo, float hi, bool outliers,
                        std::mt19937& rng, Round round) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> x(rows * heads * d);
  for (size_t i = 0; i < x.size(); ++i) {
    const int c = static_cast<int>(i % d);
    const bool big = outliers && (c == 3 % d || c == 40 % d || c == 77 % d || c == 120 % d);
    x[i] = round((neg(rng) ? -1.f : 1.f) * mag(rng) * (big ? 20.f : 1.f));
  }
  return x;
}

// q and k of the magnitudes of LLaMA's after RoPE (scores spread over several units), and v.
template <typename Round>
Inputs draw_inputs(const Shape& s, bool outliers, uint32_t seed, Round round) {
  std::mt19937 rng(seed);
  Inputs in;
  in.q = draw(s.n_q, s.heads, s.head_dim, 0.2f, 1.6f, outliers, rng, round);
  in.k = draw(s.n_kv, s.kv_heads, s.head_dim, 0.2f, 1.6f, outliers, rng, round);
  in.v = draw(s.n_kv, s.kv_heads, s.head_dim, 0.05f, 1.f, outliers, rng, round);
  return in;
}

inline int64_t visible_keys(const Shape& s, int i) {
  if (s.mask != MaskKind::kCausal) return s.n_kv;
  return std::clamp<int64_t>(s.q_start + i - s.kv_start + 1, 0, s.n_kv);
}

// Attention over in as given: fp64 throughout (naive_fp8 false, the reference), or scores in
// fp32 and P rounded to e4m3 before P.V (the naive FP8 one, over rounded inputs).
inline Result attend(const Shape& s, const Inputs& in, bool naive_fp8) {
  const int d = s.head_dim;
  const double scale = 1.0 / std::sqrt(double(d));
  Result r;
  r.o.assign(size_t(s.n_q) * s.heads * d, 0.f);
  r.lse.assign(size_t(s.heads) * s.n_q, -std::numeric_limits<float>::infinity());
  const int group = s.heads / s.kv_heads;
  parallel_rows(s.heads, s.n_q, [&](int h, int i) {
    const int g = h / group;
    const int64_t n = visible_keys(s, i);
    if (n == 0) return;
    const float* qi = &in.q[(size_t(i) * s.heads + h) * d];
    std::vector<double> sc(n);
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = &in.k[(size_t(j) * s.kv_heads + g) * d];
      double dot = 0;
      if (naive_fp8) {
        float f = 0.f;
        for (int c = 0; c < d; ++c) f += qi[c] * kj[c];
        dot = f;
      } else {
        for (int c = 0; c < d; ++c) dot += double(qi[c]) * kj[c];
      }
      sc[j] = dot * scale;
      mx = std::max(mx, sc[j]);
    }
    std::vector<double> acc(d, 0.0);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double p = std::exp(sc[j] - mx);
      sum += p;
      const double pr =
          naive_fp8 ? kernels::fp8_e4m3_to_float(kernels::fp8_e4m3_from_float(float(p))) : p;
      const float* vj = &in.v[(size_t(j) * s.kv_heads + g) * d];
      for (int c = 0; c < d; ++c) acc[c] += pr * vj[c];
    }
    float* oi = &r.o[(size_t(i) * s.heads + h) * d];
    for (int c = 0; c < d; ++c) oi[c] = float(acc[c] / sum);
    r.lse[size_t(h) * s.n_q + i] = float(mx + std::log(sum));
  });
  return r;
}

// The launch of shape s over packed q, k, v and o ([rows][heads][head_dim]), lse [heads][n_q],
// scale 1 / sqrt(head_dim); dtype left fp32 (the caller sets another).
inline kernels::AttnParams params_of(const Shape& s, const void* q, const void* k, const void* v,
                                     void* o, float* lse) {
  kernels::AttnParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.n_q = s.n_q;
  p.n_kv = s.n_kv;
  p.heads = s.heads;
  p.kv_heads = s.kv_heads;
  p.head_dim = s.head_dim;
  p.q_start = s.q_start;
  p.kv_start = s.kv_start;
  p.mask = s.mask;
  p.scale = 1.f / std::sqrt(float(s.head_dim));
  kernels::set_packed_strides(p);
  return p;
}

// attention_cpu over in (fp32), with AttnParams::qkv_fp8 = fp8 (the emulation of the FP8
// kernel). merge_split > 0: keys [0, split) first, then the rest merged into O (merge_into_o).
inline Result attention_cpu_of(const Shape& s, const Inputs& in, bool fp8, int merge_split = 0) {
  Result r;
  r.o.assign(size_t(s.n_q) * s.heads * s.head_dim, 0.f);
  r.lse.assign(size_t(s.heads) * s.n_q, 0.f);
  kernels::AttnParams p =
      params_of(s, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
  p.qkv_fp8 = fp8;
  if (merge_split == 0) {
    kernels::attention_cpu(p);
    return r;
  }
  kernels::AttnParams first = p, second = p;
  first.n_kv = merge_split;
  second.n_kv = s.n_kv - merge_split;
  second.kv_start = s.kv_start + merge_split;
  second.k = in.k.data() + int64_t{merge_split} * p.k_row_stride;
  second.v = in.v.data() + int64_t{merge_split} * p.v_row_stride;
  second.merge_into_o = true;
  kernels::attention_cpu(first);
  kernels::attention_cpu(second);
  return r;
}

// x rounded to e4m3 with one scale for the whole tensor.
inline std::vector<float> per_tensor_fp8(const std::vector<float>& x) {
  float amax = 0.f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float s = amax / kernels::kFp8E4M3Max;
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    y[i] = kernels::fp8_e4m3_to_float(kernels::fp8_e4m3_from_float(x[i] / s)) * s;
  }
  return y;
}

// The naive FP8 attention of in.
inline Result naive_fp8(const Shape& s, const Inputs& in) {
  return attend(s, Inputs{per_tensor_fp8(in.q), per_tensor_fp8(in.k), per_tensor_fp8(in.v)}, true);
}

struct Errors {
  double o_rmse = 0, lse_rmse = 0, lse_max = 0;
  int empty_rows = 0;      // (row, head) pairs that see no key
  int wrong_empty = 0;     // of those, not exactly O = 0, LSE = -inf
  int not_finite = 0;      // values of rows that see keys that are NaN or infinite
};

// got against ref over the rows that see keys; rows that see none must be O = 0, LSE = -inf.
inline Errors errors(const Shape& s, const Result& got, const Result& ref) {
  Errors e;
  double sq = 0, lse_sq = 0;
  size_t counted = 0, rows = 0;
  const int d = s.head_dim;
  for (int i = 0; i < s.n_q; ++i) {
    const bool empty = visible_keys(s, i) == 0;
    for (int h = 0; h < s.heads; ++h) {
      const float lse = got.lse[size_t(h) * s.n_q + i];
      const float* o = &got.o[(size_t(i) * s.heads + h) * d];
      const float* r = &ref.o[(size_t(i) * s.heads + h) * d];
      if (empty) {
        ++e.empty_rows;
        bool ok = lse == -std::numeric_limits<float>::infinity();
        for (int c = 0; c < d; ++c) ok = ok && o[c] == 0.f;
        if (!ok) ++e.wrong_empty;
        continue;
      }
      if (!std::isfinite(lse)) ++e.not_finite;
      const double lse_err = std::fabs(double(lse) - ref.lse[size_t(h) * s.n_q + i]);
      e.lse_max = std::max(e.lse_max, lse_err);
      lse_sq += lse_err * lse_err;
      ++rows;
      for (int c = 0; c < d; ++c) {
        if (!std::isfinite(o[c])) ++e.not_finite;
        sq += (double(o[c]) - r[c]) * (double(o[c]) - r[c]);
        ++counted;
      }
    }
  }
  e.o_rmse = counted ? std::sqrt(sq / counted) : 0.0;
  e.lse_rmse = rows ? std::sqrt(lse_sq / rows) : 0.0;
  return e;
}

}  // namespace burst::testing::fp8_attention
