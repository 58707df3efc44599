// Sampling: greedy ties, seeded replay, the empirical distribution against softmax(l / T), and
// that top-k / top-p never return an id outside their set.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "engine/sampler.h"

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
