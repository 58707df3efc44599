// Backend::sample_queued / sampled / sampled_ready, checked on any backend against a reference
// backend's sample() (the CPU one): the worker's order (queue draw k, then take draw k - 1),
// a synchronous sample() while a draw is queued, a third queued draw refused, an empty queue
// refused; and a queued draw's ids are what embedding() reads as a DrawnId at once, before the
// host has them. Used by tests/unit/sampler_test.cpp (CPU defaults) and tests/gpu (CUDA).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/dtype_convert.h"
#include "engine/sampler.h"

namespace burst::testing {

inline void check_queued_draws(engine::Backend& b, engine::Backend& ref, engine::DType dtype) {
  using engine::DType;
  using engine::SamplingParams;
  using engine::Tensor;
  const std::vector<SamplingParams> settings = {
      {0.f, 0, 1.f, 1}, {0.7f, 0, 1.f, 2}, {1.3f, 40, 1.f, 3}, {0.8f, 0, 0.9f, 4}, {1.f, 5, 0.5f, 5}};
  const auto rows = static_cast<int64_t>(settings.size());
  constexpr int64_t kVocab = 4099, kDim = 8;
  constexpr int kSteps = 6;
  std::mt19937 rng(29);
  std::uniform_real_distribution<float> dist(-6.f, 6.f);
  // Values the dtype holds exactly, so both backends see the same logits.
  auto random_values = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = engine::bf16_to_f32(engine::f32_to_bf16(dist(rng)));
    return v;
  };
  auto make = [](engine::Backend& on, std::vector<int64_t> shape, const std::vector<float>& host,
                 DType dt) {
    auto t = on.alloc(std::move(shape), dt);
    EXPECT_TRUE(t.ok()) << t.message();
    if (!t.ok()) return Tensor();
    const auto st = on.upload(host.data(), DType::kF32, t.value());
    EXPECT_TRUE(st.ok()) << st.message();
    return t.take();
  };
  const Tensor table = make(b, {kVocab, kDim}, random_values(size_t(kVocab * kDim)), dtype);
  auto embed = [&](const std::vector<int32_t>& ids,
                   const std::vector<engine::Backend::DrawnId>& drawn = {}) {
    Tensor out = make(b, {static_cast<int64_t>(ids.size()), kDim},
                      std::vector<float>(ids.size() * kDim, 0.f), dtype);
    const auto st = b.embedding(table, ids, drawn, out);
    EXPECT_TRUE(st.ok()) << st.message();
    std::vector<float> h;
    EXPECT_TRUE(b.download(out, h).ok());
    return h;
  };
  std::vector<engine::Sampler> streams(settings.begin(), settings.end());
  std::vector<Tensor> logits;  // alive until drawn: a queued draw reads them when the device does
  std::vector<std::vector<int32_t>> want;
  auto draw_inputs = [&](Tensor& mine, std::vector<int32_t>& ids, std::vector<double>& u) {
    const std::vector<float> host = random_values(size_t(rows * kVocab));
    mine = make(b, {rows, kVocab}, host, dtype);
    const Tensor on_ref = make(ref, {rows, kVocab}, host, DType::kF32);
    u.clear();
    for (engine::Sampler& s : streams) u.push_back(s.draw_uniform());
    const auto st = ref.sample(on_ref, settings, u, ids);
    EXPECT_TRUE(st.ok()) << st.message();
  };
  for (int k = 0; k < kSteps; ++k) {
    logits.emplace_back();
    want.emplace_back();
    std::vector<double> u;
    draw_inputs(logits.back(), want.back(), u);
    const auto queued = b.sample_queued(logits.back(), settings, u);
    ASSERT_TRUE(queued.ok()) << queued.message();
    EXPECT_EQ(embed({0, 0}, {{0, 0}, {1, rows - 1}}), embed({want[k][0], want[k][rows - 1]}))
        << "draw " << k << ": embedding reads the queued draw's ids";
    if (k == 0) continue;
    if (k == 2) {
      const auto third = b.sample_queued(logits.back(), settings, u);
      ASSERT_FALSE(third.ok()) << "a third queued draw";
      EXPECT_NE(third.message().find("queued already"), std::string::npos) << third.message();
    }
    std::vector<int32_t> got;
    const auto taken = b.sampled(got);
    ASSERT_TRUE(taken.ok()) << taken.message();
    EXPECT_EQ(got, want[k - 1]) << "draw " << k - 1 << " taken behind draw " << k;
    if (k == 3) {  // a synchronous draw while draw 3 stays queued: its own ids
      Tensor extra;
      std::vector<int32_t> extra_want, extra_got;
      draw_inputs(extra, extra_want, u);
      const auto st = b.sample(extra, settings, u, extra_got);
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(extra_got, extra_want);
    }
  }
  while (!b.sampled_ready()) {
  }
  std::vector<int32_t> last;
  ASSERT_TRUE(b.sampled(last).ok());
  EXPECT_EQ(last, want.back());
  EXPECT_TRUE(b.sampled_ready());
  const auto none = b.sampled(last);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("no draw is queued"), std::string::npos) << none.message();
  int varied = 0;
  for (const auto& w : want) varied += w != want[0];
  EXPECT_GT(varied, 0) << "random logits give varied ids";
}

}  // namespace burst::testing
