// The CPU attention reference (tiled, online softmax) against a naive double-precision
// softmax(QK^T)V, and the (O, LSE) merge: shards of keys merged equal one call over all keys.
// Tolerance: at most 2x the error of a naive fp32 implementation (plus a few fp32 ulps).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "kernels/attention.h"

namespace burst::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Case {
  int n_q, n_kv, heads, kv_heads, head_dim;
  int64_t q_start, kv_start;
  MaskKind mask;
};

std::vector<float> random_vec(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng); while (x == 0.f);  // never zero
  }
  return v;
}

// Naive attention in T precision; o [n_q, heads, d] packed, lse [heads, n_q].
template <typename T>
void naive(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
           const std::vector<float>& v, float scale, std::vector<T>& o, std::vector<T>& lse) {
  const int d = c.head_dim, group = c.heads / c.kv_heads;
  o.assign(static_cast<size_t>(c.n_q) * c.heads * d, T(0));
  lse.assign(static_cast<size_t>(c.heads) * c.n_q, T(0));
  for (int h = 0; h < c.heads; ++h) {
    for (int i = 0; i < c.n_q; ++i) {
      std::vector<T> s;
      std::vector<int> idx;
      for (int j = 0; j < c.n_kv; ++j) {
        if (c.mask == MaskKind::kCausal && c.kv_start + j > c.q_start + i) continue;
        T dot = 0;
        for (int x = 0; x < d; ++x) {
          dot += T(q[(i * c.heads + h) * d + x]) * T(k[(j * c.kv_heads + h / group) * d + x]);
        }
        s.push_back(dot * T(scale));
        idx.push_back(j);
      }
      if (s.empty()) {
        lse[h * c.n_q + i] = -std::numeric_limits<T>::infinity();
        continue;
      }
      T mx = s[0];
      for (T x : s) mx = std::max(mx, x);
      T sum = 0;
      for (T& x : s) sum += (x = std::exp(x - mx));
      for (size_t t = 0; t < s.size(); ++t) {
        for (int x = 0; x < d; ++x) {
          o[(i * c.heads + h) * d + x] += s[t] / sum * T(v[(idx[t] * c.kv_heads + h / group) * d + x]);
        }
      }
      lse[h * c.n_q + i] = mx + std::log(sum);
    }
  }
}

AttnParams make_params(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                       const std::vector<float>& v, std::vector<float>& o,
                       std::vector<float>& lse) {
  AttnParams p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o.data();
  p.lse = lse.data();
  p.n_q = c.n_q;
  p.n_kv = c.n_kv;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  set_packed_strides(p);
  p.q_start = c.q_start;
  p.kv_start = c.kv_start;
  p.mask = c.mask;
  p.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  return p;
}

double max_err(const std::vector<float>& a, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(ref[i])) {
      EXPECT_EQ(a[i], static_cast<float>(ref[i])) << "at " << i;
      continue;
    }
    e = std::max(e, std::fabs(static_cast<double>(a[i]) - ref[i]));
  }
  return e;
}

class AttentionCpu : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionCpu, MatchesNaiveWithinTwiceNaiveFp32Error) {
  const Case c = GetParam();
  std::mt19937 rng(c.n_q * 131 + c.n_kv * 7 + c.heads);
  auto q = random_vec(static_cast<size_t>(c.n_q) * c.heads * c.head_dim, rng);
  auto k = random_vec(static_cast<size_t>(c.n_kv) * c.kv_heads * c.head_dim, rng);
  auto v = random_vec(static_cast<size_t>(c.n_kv) * c.kv_heads * c.head_dim, rng);
  // Scale q up so the softmax is peaked, where an unstable implementation would fail.
  for (auto& x : q) x *= 4.f;
  std::vector<float> o(q.size(), 7.f), lse(static_cast<size_t>(c.heads) * c.n_q, 7.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  attention_cpu(make_params(c, q, k, v, o, lse));
  std::vector<double> o_ref, lse_ref;
  naive<double>(c, q, k, v, scale, o_ref, lse_ref);
  std::vector<float> o_f, lse_f;
  naive<float>(c, q, k, v, scale, o_f, lse_f);
  const double naive_o = max_err(o_f, o_ref), naive_lse = max_err(lse_f, lse_ref);
  EXPECT_LE(max_err(o, o_ref), 2 * naive_o + 1e-6);
  EXPECT_LE(max_err(lse, lse_ref), 2 * naive_lse + 1e-5);
  for (int h = 0; h < c.heads; ++h) {
    for (int i = 0; i < c.n_q; ++i) {
      if (std::isinf(lse_ref[h * c.n_q + i])) {
        for (int x = 0; x < c.head_dim; ++x) {
          EXPECT_EQ(o[(i * c.heads + h) * c.head_dim + x], 0.f) << "empty row must hold 0";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    OddShapes, AttentionCpu,
    ::testing::Values(Case{1, 1, 1, 1, 16, 0, 0, MaskKind::kCausal},
                      Case{7, 37, 3, 1, 16, 30, 0, MaskKind::kCausal},
                      Case{37, 37, 6, 2, 32, 0, 0, MaskKind::kCausal},
                      Case{37, 127, 4, 2, 64, 0, 0, MaskKind::kNone},
                      // kv block starts inside the q block: the first rows see nothing
                      Case{127, 64, 4, 4, 16, 100, 120, MaskKind::kCausal},
                      Case{129, 131, 8, 2, 64, 1000, 0, MaskKind::kCausal}),
    [](const auto& info) {
      // ostringstream, not string +: GCC 12 warns (-Wrestrict, a false positive) on the latter.
      const Case& c = info.param;
      std::ostringstream os;
      os << "q" << c.n_q << "_kv" << c.n_kv << "_h" << c.heads << "x" << c.kv_heads << "_d"
         << c.head_dim << (c.mask == MaskKind::kCausal ? "_causal" : "_full") << "_at"
         << c.q_start << "_" << c.kv_start;
      return os.str();
    });

TEST(AttentionCpu, FullyMaskedBlockIsEmpty) {
  const Case c{5, 9, 2, 1, 8, 0, 10, MaskKind::kCausal};  // every key after every query
  std::mt19937 rng(3);
  auto q = random_vec(5 * 2 * 8, rng), k = random_vec(9 * 8, rng), v = random_vec(9 * 8, rng);
  std::vector<float> o(q.size(), 5.f), lse(10, 5.f);
  attention_cpu(make_params(c, q, k, v, o, lse));
  for (float x : lse) EXPECT_EQ(x, kNegInf);
  for (float x : o) EXPECT_EQ(x, 0.f);
  EXPECT_EQ(block_relation(0, 5, 10, 9), BlockRelation::kSkip);
  EXPECT_EQ(block_relation(10, 5, 0, 9), BlockRelation::kFull);
  EXPECT_EQ(block_relation(10, 5, 0, 11), BlockRelation::kFull);  // last key at the first query
  EXPECT_EQ(block_relation(10, 5, 0, 12), BlockRelation::kPartial);
}

// Splitting the keys into shards (including an empty-for-some-rows shard) and merging the
// partial (O, LSE) pairs in order must equal one call over all keys.
// Keys [lo, hi) of `whole` as a case of their own, with their rows of k and v.
struct Shard {
  Case c;
  std::vector<float> k, v;
};
Shard shard(const Case& whole, const std::vector<float>& k, const std::vector<float>& v, int lo,
            int hi) {
  const auto w = static_cast<ptrdiff_t>(whole.kv_heads) * whole.head_dim;
  Shard s{whole,
          {k.begin() + lo * w, k.begin() + hi * w},
          {v.begin() + lo * w, v.begin() + hi * w}};
  s.c.n_kv = hi - lo;
  s.c.kv_start = lo;
  return s;
}

TEST(MergeCpu, ShardsMergeToMonolithic) {
  const Case whole{33, 101, 4, 2, 16, 50, 0, MaskKind::kCausal};
  std::mt19937 rng(11);
  auto q = random_vec(33 * 4 * 16, rng), k = random_vec(101 * 2 * 16, rng),
       v = random_vec(101 * 2 * 16, rng);
  std::vector<float> o_ref(q.size()), lse_ref(4 * 33);
  attention_cpu(make_params(whole, q, k, v, o_ref, lse_ref));

  std::vector<float> o_acc(q.size(), 0.f), lse_acc(4 * 33, kNegInf);
  const int cuts[] = {0, 40, 70, 101};
  for (int s = 0; s < 3; ++s) {
    const Shard sh = shard(whole, k, v, cuts[s], cuts[s + 1]);
    std::vector<float> o(q.size()), lse(4 * 33);
    attention_cpu(make_params(sh.c, q, sh.k, sh.v, o, lse));
    MergeParams m;
    m.o_a = o_acc.data();
    m.lse_a = lse_acc.data();
    m.o_b = o.data();
    m.lse_b = lse.data();
    m.o_row_stride = 4 * 16;
    m.o_head_stride = 16;
    m.lse_head_stride = 33;
    m.rows = 33;
    m.heads = 4;
    m.head_dim = 16;
    merge_cpu(m);
  }
  for (size_t i = 0; i < o_ref.size(); ++i) {
    ASSERT_FALSE(std::isnan(o_acc[i]));
    EXPECT_NEAR(o_acc[i], o_ref[i], 2e-6) << i;
  }
  for (size_t i = 0; i < lse_ref.size(); ++i) EXPECT_NEAR(lse_acc[i], lse_ref[i], 2e-6) << i;
}

// merge_into_o: each shard merged by attention_cpu itself gives the bits of attention into a
// partial + merge_cpu (same arithmetic), from an accumulator that starts empty (a empty: the
// first shard is taken as is) through a shard that rows 0..19 do not reach (b empty).
TEST(MergeCpu, AttentionMergingIntoOEqualsPartialThenMerge) {
  const Case whole{33, 101, 4, 2, 16, 50, 0, MaskKind::kCausal};
  std::mt19937 rng(12);
  auto q = random_vec(33 * 4 * 16, rng), k = random_vec(101 * 2 * 16, rng),
       v = random_vec(101 * 2 * 16, rng);
  std::vector<float> o_fused(q.size(), 0.f), lse_fused(4 * 33, kNegInf);
  std::vector<float> o_acc(q.size(), 0.f), lse_acc(4 * 33, kNegInf);
  const int cuts[] = {0, 40, 70, 101};
  for (int s = 0; s < 3; ++s) {
    const Shard sh = shard(whole, k, v, cuts[s], cuts[s + 1]);
    AttnParams fused = make_params(sh.c, q, sh.k, sh.v, o_fused, lse_fused);
    fused.merge_into_o = true;
    attention_cpu(fused);
    std::vector<float> o(q.size()), lse(4 * 33);
    attention_cpu(make_params(sh.c, q, sh.k, sh.v, o, lse));
    MergeParams m{o_acc.data(), lse_acc.data(), o.data(), lse.data(), 4 * 16, 16, 33, 33, 4, 16};
    merge_cpu(m);
  }
  EXPECT_EQ(o_fused, o_acc);
  EXPECT_EQ(lse_fused, lse_acc);
  EXPECT_NE(lse_acc[0], kNegInf);  // every row saw keys
}

// With `out` set the merged o goes there (o_a untouched), the same values as in place, for every
// case: both seen, a empty, b empty; lse_a updated the same way.
TEST(MergeCpu, OutHoldsWhatInPlaceWouldAndLeavesOaAlone) {
  const int rows = 3, heads = 2, d = 8;
  std::vector<float> oa(rows * heads * d), ob(oa.size()), la(heads * rows), lb(la.size());
  for (size_t i = 0; i < oa.size(); ++i) {
    oa[i] = 0.5f + 0.01f * float(i);
    ob[i] = -0.25f + 0.02f * float(i);
  }
  for (size_t i = 0; i < la.size(); ++i) {
    la[i] = 0.3f * float(i) - 1.f;
    lb[i] = 1.f - 0.2f * float(i);
  }
  la[1] = kNegInf;  // a empty
  lb[2] = kNegInf;  // b empty
  std::vector<float> in_place = oa, la_in = la, out(oa.size(), 7.f), la_out = la;
  const std::vector<float> oa_before = oa;
  MergeParams m{in_place.data(), la_in.data(), ob.data(), lb.data(), heads * d, d, rows,
                rows, heads, d};
  merge_cpu(m);
  MergeParams o = m;
  o.o_a = oa.data();
  o.lse_a = la_out.data();
  o.out = out.data();
  o.out_row_stride = heads * d;
  merge_cpu(o);
  EXPECT_EQ(out, in_place);
  EXPECT_EQ(la_out, la_in);
  EXPECT_EQ(oa, oa_before);
  EXPECT_NE(in_place, oa_before);  // the merge did something
}

TEST(MergeCpu, BothEmptyStaysEmptyWithoutNaN) {
  std::vector<float> oa(4, 0.f), ob(4, 0.f), la(1, kNegInf), lb(1, kNegInf);
  MergeParams m{oa.data(), la.data(), ob.data(), lb.data(), 4, 4, 1, 1, 1, 4};
  merge_cpu(m);
  EXPECT_EQ(la[0], kNegInf);
  for (float x : oa) EXPECT_EQ(x, 0.f);
}

}  // namespace
}  // namespace burst::kernels
