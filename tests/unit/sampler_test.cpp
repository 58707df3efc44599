// Sampling: greedy ties, seeded replay, the empirical distribution against softmax(l / T), and
// that top-k / top-p never return an id outside their set.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

namespace burst::engine {
namespace {

TEST(Sampler, GreedyTakesArgmaxAndLowestIdOnTies) {
  Sampler s({0.f, 0, 1.f, 0});
  const std::vector<float> l = {0.1f, 3.f, -2.f, 3.f, 1.f};
  EXPECT_EQ(s.sample(l.data(), 5), 1);
  const std::vector<float> m = {-1.f, -5.f, -0.5f};
  EXPECT_EQ(s.sample(m.data(), 3), 2);
}

TEST(Sampler, SameSeedReplaysDifferentSeedDiffers) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 0.7f);
  auto run = [&](uint64_t seed) {
    Sampler s({1.f, 0, 1.f, seed});
    std::vector<int> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l.data(), 50));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, FrequenciesFollowSoftmaxOfLogitsOverTemperature) {
  const std::vector<float> l = {1.f, 0.f, 2.f, -1.f};
  const float t = 0.7f;
  std::vector<double> p(4);
  double z = 0;
  for (int i = 0; i < 4; ++i) z += p[i] = std::exp(l[i] / t);
  Sampler s({t, 0, 1.f, 9});
  const int n = 40000;
  std::vector<int> count(4, 0);
  for (int i = 0; i < n; ++i) ++count[s.sample(l.data(), 4)];
  for (int i = 0; i < 4; ++i) {
    const double pi = p[i] / z, sigma = std::sqrt(pi * (1 - pi) / n);
    EXPECT_NEAR(count[i] / double(n), pi, 5 * sigma) << "id " << i;
  }
}

TEST(Sampler, TopKAndTopPStayInsideTheirSets) {
  const std::vector<float> l = {0.f, 5.f, 4.f, 1.f, 4.5f, -3.f};
  Sampler k2({2.f, 2, 1.f, 1});
  for (int i = 0; i < 2000; ++i) {
    const int id = k2.sample(l.data(), 6);
    EXPECT_TRUE(id == 1 || id == 4) << id;
  }
  // softmax at T=1: p(1)=.49, p(4)=.30, p(2)=.18, ...; top_p 0.75 keeps {1, 4} only.
  Sampler p75({1.f, 0, 0.75f, 2});
  std::map<int, int> seen;
  for (int i = 0; i < 4000; ++i) ++seen[p75.sample(l.data(), 6)];
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[1], seen[4]);
  Sampler k1({5.f, 1, 1.f, 3});  // top_k 1 is greedy whatever the temperature
  for (int i = 0; i < 100; ++i) EXPECT_EQ(k1.sample(l.data(), 6), 1);
}

// sample_with_uniform against a plain reference (the whole vocabulary sorted, masses in double):
// for vocab 32000, flat and peaked logits, with and without top-k / top-p, the id drawn for u
// must be the reference's, unless u * kept mass falls within rounding (1e-9 of the mass) of a
// boundary between two ids. The sampler sorts only the prefix a draw needs; this pins that it
// still walks the ids in the same order and stops at the same place.
TEST(Sampler, PartialSortDrawsWhatAFullSortDraws) {
  const int64_t vocab = 32000;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  int checked = 0;
  for (float spread : {0.1f, 1.f, 6.f}) {  // nearly flat .. peaked
    std::vector<float> l(static_cast<size_t>(vocab));
    for (auto& x : l) x = spread * nd(rng);
    l[123] = l[456];  // a tie: the lower id comes first
    for (const SamplingParams& sp :
         {SamplingParams{1.f, 0, 1.f, 0}, SamplingParams{0.7f, 0, 0.9f, 0},
          SamplingParams{1.3f, 0, 0.3f, 0}, SamplingParams{1.f, 50, 1.f, 0},
          SamplingParams{1.f, 2000, 0.8f, 0}}) {
      std::vector<std::pair<double, int32_t>> ref;
      for (int64_t i = 0; i < vocab; ++i)
        ref.push_back({double(l[i] / sp.temperature), int32_t(i)});
      std::sort(ref.begin(), ref.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      const size_t keep = sp.top_k > 0 ? static_cast<size_t>(sp.top_k) : ref.size();
      std::vector<double> cum(keep);
      double run = 0;
      for (size_t i = 0; i < keep; ++i) cum[i] = run += std::exp(ref[i].first - ref[0].first);
      size_t cut = keep - 1;
      for (size_t i = 0; sp.top_p < 1.f && i < keep; ++i) {
        if (cum[i] / cum[keep - 1] >= sp.top_p) {
          cut = i;
          break;
        }
      }
      for (int t = 0; t < 200; ++t) {
        const double u = t < 3 ? (t == 0 ? 0.0 : t == 1 ? 0.999999 : 0.5) : ud(rng);
        const double target = u * cum[cut];
        const size_t want =
            std::upper_bound(cum.begin(), cum.begin() + cut + 1, target) - cum.begin();
        const size_t w = std::min(want, cut);
        const double lo = w == 0 ? 0 : cum[w - 1];
        if (std::fabs(target - lo) < 1e-9 * cum[cut] ||
            std::fabs(cum[w] - target) < 1e-9 * cum[cut]) {
          continue;  // on a boundary: rounding may pick either neighbour
        }
        EXPECT_EQ(sample_with_uniform(l.data(), vocab, sp, u), ref[w].second)
            << "spread " << spread << " T " << sp.temperature << " top_k " << sp.top_k << " top_p "
            << sp.top_p << " u " << u;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 2900);  // of 3000: boundaries are rare
}

TEST(Sampler, ValidateRejectsBadParams) {
  EXPECT_TRUE(validate(SamplingParams{0.f, 0, 1.f, 0}).empty());
  EXPECT_FALSE(validate(SamplingParams{-0.1f, 0, 1.f, 0}).empty());
  EXPECT_FALSE(validate(SamplingParams{NAN, 0, 1.f, 0}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, -1, 1.f, 0}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, 0, 0.f, 0}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, 0, 1.5f, 0}).empty());
}

}  // namespace
}  // namespace burst::engine
