// Sampling: greedy ties, seeded replay, the empirical distribution against softmax(l / T), and
// that top-k / top-p never return an id outside their set; the CPU backend's sample op is the
// Sampler's draws, row by row, for rows of mixed settings.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "engine/backend.h"
#include "../queued_draws_check.h"

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

// min_p keeps the ids whose probability is at least min_p times the largest: at T=1 the logits
// below give p / p_max = 1, e^-0.5 = .61, e^-1 = .37, e^-4 = .018; min_p 0.5 keeps {1, 4}, 0.3
// keeps {1, 4, 2}, 1 only the argmax. Their draws match a reference over the kept set alone
// (the rest's logits -inf), for every u, with and without top_k (a prefix too) and top_p (which
// then normalises over the min_p set, as vLLM applies min_p first).
TEST(Sampler, MinPKeepsIdsAtLeastMinPTimesTheMostLikely) {
  const std::vector<float> l = {0.f, 5.f, 4.f, 1.f, 4.5f, -3.f};
  const float inf = std::numeric_limits<float>::infinity();
  auto only = [&](std::initializer_list<int> ids) {
    std::vector<float> m(l.size(), -inf);
    for (int id : ids) m[static_cast<size_t>(id)] = l[static_cast<size_t>(id)];
    return m;
  };
  struct Case {
    SamplingParams with_min_p;
    std::vector<float> reference_logits;
    SamplingParams reference;
    std::set<int> kept;
  };
  const std::vector<Case> cases = {
      {{1.f, 0, 1.f, 0, 0.5f}, only({1, 4}), {1.f, 0, 1.f, 0}, {1, 4}},
      {{1.f, 0, 1.f, 0, 0.3f}, only({1, 4, 2}), {1.f, 0, 1.f, 0}, {1, 4, 2}},
      {{1.f, 0, 1.f, 0, 1.f}, only({1}), {1.f, 0, 1.f, 0}, {1}},
      {{1.f, 2, 1.f, 0, 0.3f}, only({1, 4}), {1.f, 0, 1.f, 0}, {1, 4}},       // top_k 2 first
      {{1.f, 5, 1.f, 0, 0.5f}, only({1, 4}), {1.f, 0, 1.f, 0}, {1, 4}},       // min_p first
      {{1.f, 0, 0.7f, 0, 0.3f}, only({1, 4, 2}), {1.f, 0, 0.7f, 0}, {1, 4}},  // top_p of the rest
      {{2.f, 0, 1.f, 0, 0.5f}, only({1, 4, 2}), {2.f, 0, 1.f, 0}, {1, 4, 2}},  // after T: /2
      {{1.f, 0, 1.f, 0, 0.f}, l, {1.f, 0, 1.f, 0}, {0, 1, 2, 3, 4, 5}},        // 0: off
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    std::set<int> drawn;
    for (int t = 0; t <= 1000; ++t) {
      const double u = t / 1000.0 * 0.999999;
      const int32_t id = sample_with_uniform(l.data(), 6, c.with_min_p, u);
      EXPECT_EQ(id, sample_with_uniform(c.reference_logits.data(), 6, c.reference, u))
          << "case " << k << " u " << u;
      drawn.insert(id);
    }
    if (c.with_min_p.top_p == 1.f) {
      EXPECT_EQ(drawn, c.kept) << "case " << k;
    }
  }
  // Greedy ignores min_p; the bounds are [0, 1].
  EXPECT_EQ(sample_with_uniform(l.data(), 6, {0.f, 0, 1.f, 0, 0.9f}, 0.7), 1);
  EXPECT_TRUE(validate(SamplingParams{1.f, 0, 1.f, 0, 1.f}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, 0, 1.f, 0, -0.1f}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, 0, 1.f, 0, 1.5f}).empty());
  EXPECT_FALSE(validate(SamplingParams{1.f, 0, 1.f, 0, NAN}).empty());
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

// Backend::sample on the CPU backend: six rows of mixed settings (greedy, temperature, top-k,
// top-p, both; a greedy row with a top_k it must ignore), each with its own seeded stream, drawn
// in one call per step with Sampler::draw_uniform, pick what each row's own Sampler::sample
// picks on the same logits, and leave every stream where sample() leaves it.
TEST(BackendSample, CpuEqualsSamplerDrawsForMixedSettings) {
  auto backend = make_cpu_backend();
  const std::vector<SamplingParams> settings = {{0.f, 0, 1.f, 1},   {0.7f, 0, 1.f, 2},
                                                {1.3f, 40, 1.f, 3}, {0.8f, 0, 0.9f, 4},
                                                {1.f, 5, 0.5f, 5},  {0.f, 3, 0.5f, 6}};
  const auto rows = static_cast<int64_t>(settings.size());
  constexpr int64_t kVocab = 4099;
  std::vector<Sampler> drawers, reference;
  for (const auto& p : settings) {
    drawers.emplace_back(p);
    reference.emplace_back(p);
  }
  auto t = backend->alloc({rows, kVocab}, DType::kF32);
  ASSERT_TRUE(t.ok()) << t.message();
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> dist(-6.f, 6.f);
  std::vector<std::set<int32_t>> seen(settings.size());
  for (int step = 0; step < 60; ++step) {
    std::vector<float> host(static_cast<size_t>(rows * kVocab));
    for (float& x : host) x = dist(rng);
    ASSERT_TRUE(backend->upload(host.data(), DType::kF32, t.value()).ok());
    std::vector<double> u;
    for (Sampler& s : drawers) u.push_back(s.draw_uniform());
    std::vector<int32_t> ids;
    const Status st = backend->sample(t.value(), settings, u, ids);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_EQ(ids.size(), settings.size());
    for (size_t r = 0; r < settings.size(); ++r) {
      EXPECT_EQ(ids[r], reference[r].sample(&host[r * kVocab], kVocab))
          << "step " << step << " row " << r;
      seen[r].insert(ids[r]);
    }
  }
  for (size_t r = 0; r < settings.size(); ++r) {
    EXPECT_EQ(drawers[r].next_uniform(), reference[r].next_uniform()) << "row " << r;
    EXPECT_GT(seen[r].size(), 10u) << "row " << r << ": random logits give varied ids";
  }
}

// The defaults of the queued draw (a CPU draw is complete when queued): order, limits, and the
// ids embedding() reads (tests/queued_draws_check.h).
TEST(BackendSample, QueuedDrawsComeBackInOrder) {
  auto backend = make_cpu_backend();
  auto reference = make_cpu_backend();
  burst::testing::check_queued_draws(*backend, *reference, DType::kF32);
}

TEST(BackendSample, RejectsBadArguments) {
  auto backend = make_cpu_backend();
  auto t = backend->alloc({2, 8}, DType::kF32);
  auto flat = backend->alloc({16}, DType::kF32);
  ASSERT_TRUE(t.ok() && flat.ok());
  const SamplingParams ok{1.f, 0, 1.f, 0};
  std::vector<int32_t> ids;
  EXPECT_TRUE(backend->sample(t.value(), {ok, ok}, {0.5, 0.5}, ids).ok());
  EXPECT_FALSE(backend->sample(t.value(), {ok}, {0.5, 0.5}, ids).ok());
  EXPECT_FALSE(backend->sample(t.value(), {ok, ok}, {0.5}, ids).ok());
  EXPECT_FALSE(backend->sample(flat.value(), {ok, ok}, {0.5, 0.5}, ids).ok());
  const Status bad = backend->sample(t.value(), {ok, {1.f, 0, 0.f, 0}}, {0.5, 0.5}, ids);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("row 1: top_p"), std::string::npos) << bad.message();
}

// Backend::embedding reads a DrawnId {row, k} as the k-th id the last sample() drew, where it
// was drawn (the decode lookahead's "the token you drew last"); drawn_ids(n) gives room for n
// ids that another rank's broadcast fills; a k beyond the count is refused with a message.
TEST(BackendSample, EmbeddingReadsTheIdsTheLastSampleDrew) {
  auto backend = make_cpu_backend();
  constexpr int64_t kVocab = 97, kDim = 5;
  std::vector<float> table_host(static_cast<size_t>(kVocab * kDim));
  for (size_t i = 0; i < table_host.size(); ++i) table_host[i] = 0.25f * static_cast<float>(i);
  auto table = backend->alloc({kVocab, kDim}, DType::kF32);
  auto logits = backend->alloc({2, kVocab}, DType::kF32);
  auto out = backend->alloc({3, kDim}, DType::kF32);
  auto want = backend->alloc({3, kDim}, DType::kF32);
  ASSERT_TRUE(table.ok() && logits.ok() && out.ok() && want.ok());
  ASSERT_TRUE(backend->upload(table_host.data(), DType::kF32, table.value()).ok());
  std::vector<float> l(static_cast<size_t>(2 * kVocab), 0.f);
  l[41] = 3.f;           // row 0 draws 41 (greedy)
  l[kVocab + 88] = 3.f;  // row 1 draws 88
  ASSERT_TRUE(backend->upload(l.data(), DType::kF32, logits.value()).ok());
  const SamplingParams greedy{0.f, 0, 1.f, 0};
  std::vector<int32_t> ids;
  ASSERT_TRUE(backend->sample(logits.value(), {greedy, greedy}, {0.0, 0.0}, ids).ok());
  ASSERT_EQ(ids, (std::vector<int32_t>{41, 88}));
  auto rows_of = [&](const std::vector<int32_t>& in, Tensor& dst,
                     const std::vector<Backend::DrawnId>& drawn = {}) {
    const Status st = backend->embedding(table.value(), in, drawn, dst);
    EXPECT_TRUE(st.ok()) << st.message();
    std::vector<float> h;
    EXPECT_TRUE(backend->download(dst, h).ok());
    return h;
  };
  EXPECT_EQ(rows_of({0, 5, 0}, out.value(), {{0, 1}, {2, 0}}),
            rows_of({88, 5, 41}, want.value()));
  // Room for another rank's ids, filled as a broadcast would.
  void* where = nullptr;
  ASSERT_TRUE(backend->drawn_ids(3, &where).ok());
  const int32_t theirs[3] = {7, 0, 96};
  std::memcpy(where, theirs, sizeof theirs);
  EXPECT_EQ(rows_of({-1, 0, 9}, out.value(), {{0, 2}, {1, 0}}),
            rows_of({96, 7, 9}, want.value()));
  auto one = backend->alloc({1, kDim}, DType::kF32);
  ASSERT_TRUE(one.ok());
  const Status beyond = backend->embedding(table.value(), {0}, {{0, 3}}, one.value());
  ASSERT_FALSE(beyond.ok());
  EXPECT_NE(beyond.message().find("drawn ids: 3"), std::string::npos) << beyond.message();
  const Status outside = backend->embedding(table.value(), {0}, {{1, 0}}, one.value());
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.message().find("drawn row 1"), std::string::npos) << outside.message();
  const Status negative = backend->embedding(table.value(), {-1}, one.value());
  ASSERT_FALSE(negative.ok()) << "a negative id is no drawn id";
  EXPECT_NE(negative.message().find("token id -1"), std::string::npos) << negative.message();
}

}  // namespace
}  // namespace burst::engine
