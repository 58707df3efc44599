// RoPE frequencies against Hugging Face transformers. YaRN: every case of
// tests/fixtures/rope/yarn_hf.json (scripts/make_rope_reference.py: HF 5.17's own inv_freq and
// attention_scaling for whole config.json files) goes through the engine's config reader and
// rope_inv_freq; the published 128K LLaMA-2 config is also checked against the formula written
// out here in double precision with the ramp's ends worked out by hand.
#include "models/rope.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/config.h"

namespace burst::models {
namespace {

using nlohmann::json;

// Against HF's own fp32 values: 2 ulp (the power is a double pow rounded once where torch
// rounds an fp32 pow; every case measured here is bit-equal but for 1 ulp in two pairs).
constexpr double kHfTol = 2.5e-7;
// Against the formula in double: the fp32 pipeline's few roundings.
constexpr double kFormulaTol = 1e-6;

void expect_freqs(const std::vector<float>& got, const std::vector<double>& ref, double rel_tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(got[i], ref[i], rel_tol * std::fabs(ref[i])) << what << ": inv_freq[" << i << "]";
  }
}

LlamaConfig parsed(const json& config, const std::string& name) {
  auto r = parse_config_json(config.dump(), name);
  EXPECT_TRUE(r.ok()) << r.message();
  return r.ok() ? r.value() : LlamaConfig{};
}

TEST(RopeYarn, MatchesTransformersOnEveryReferenceCase) {
  std::ifstream in(std::string(BURST_SOURCE_DIR) + "/tests/fixtures/rope/yarn_hf.json");
  ASSERT_TRUE(in) << "missing tests/fixtures/rope/yarn_hf.json (scripts/make_rope_reference.py)";
  const json fixture = json::parse(in);
  int cases = 0;
  for (const auto& [name, c] : fixture.at("cases").items()) {
    SCOPED_TRACE(name);
    ASSERT_FALSE(c.contains("error")) << c.at("error");
    const LlamaConfig cfg = parsed(c.at("config"), name);
    ASSERT_EQ(cfg.rope_scaling.kind, RopeScaling::Kind::kYarn);
    // The context HF resolved (top-level, rope object, or max_position_embeddings).
    const json& hf = c.at("rope_parameters");
    EXPECT_EQ(cfg.rope_scaling.original_max_position_embeddings,
              hf.at("original_max_position_embeddings").get<int64_t>());
    const auto ref = c.at("inv_freq").get<std::vector<double>>();
    // Yarn is static: the same frequencies at any length, within max_position_embeddings or past.
    for (int64_t len : {int64_t{1}, cfg.max_position_embeddings, 4 * cfg.max_position_embeddings}) {
      expect_freqs(rope_inv_freq(cfg, len), ref, kHfTol,
                   name + " at length " + std::to_string(len));
    }
    const double m = c.at("attention_scaling").get<double>();
    EXPECT_NEAR(rope_attention_scaling(cfg), m, 1e-6 * m);
    EXPECT_NEAR(rope_logit_scale(cfg), m * m, 1e-6 * m * m);
    ++cases;
  }
  EXPECT_EQ(cases, 10);
}

// NousResearch/Yarn-Llama-2-{7b,13b}-128k: head_dim 128, theta 10000, factor 32 over 4096.
TEST(RopeYarn, Llama2At128kByTheFormula) {
  LlamaConfig c;
  c.head_dim = 128;
  c.rope_theta = 10000.f;
  c.max_position_embeddings = 131072;
  c.rope_scaling.kind = RopeScaling::Kind::kYarn;
  c.rope_scaling.factor = 32.f;
  c.rope_scaling.original_max_position_embeddings = 4096;
  // cdim(r) = 128 ln(4096 / (2 pi r)) / (2 ln 10000): cdim(32) = 20.94 -> 20, cdim(1) = 45.03
  // -> 46. Pairs 0..20 keep theta^(-2i/d), pairs from 46 on are divided by 32, a linear ramp
  // between.
  const double low = 20, high = 46;
  std::vector<double> ref(64);
  for (int i = 0; i < 64; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / 128.0);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    ref[static_cast<size_t>(i)] = base * (1 - ramp) + base / 32 * ramp;
  }
  expect_freqs(rope_inv_freq(c, 1), ref, kFormulaTol, "128k");
  EXPECT_DOUBLE_EQ(rope_attention_scaling(c), 0.1 * std::log(32.0) + 1);
  EXPECT_FLOAT_EQ(rope_logit_scale(c), static_cast<float>(std::pow(0.1 * std::log(32.0) + 1, 2)));

  // The published config.json's rope fields parse to exactly this.
  const json j = {{"hidden_size", 4096},
                  {"intermediate_size", 11008},
                  {"num_hidden_layers", 32},
                  {"num_attention_heads", 32},
                  {"vocab_size", 32000},
                  {"max_position_embeddings", 131072},
                  {"rope_theta", 10000.0},
                  {"rope_scaling",
                   {{"factor", 32.0},
                    {"original_max_position_embeddings", 4096},
                    {"type", "yarn"},
                    {"finetuned", true}}}};
  expect_freqs(rope_inv_freq(parsed(j, "yarn-128k"), 131072), ref, kFormulaTol, "128k parsed");
}

// truncate false keeps the ramp's ends fractional; equal ends make a step, not a NaN.
TEST(RopeYarn, RampEnds) {
  LlamaConfig c;
  c.head_dim = 16;
  c.rope_theta = 10000.f;
  c.rope_scaling.kind = RopeScaling::Kind::kYarn;
  c.rope_scaling.factor = 4.f;
  c.rope_scaling.original_max_position_embeddings = 4096;
  c.rope_scaling.truncate = false;
  auto cdim = [](double r) {
    return 16 * std::log(4096 / (2 * 3.14159265358979323846 * r)) / (2 * std::log(10000.0));
  };
  const double low = std::max(cdim(32), 0.0), high = std::min(cdim(1), 15.0);
  std::vector<float> got = rope_inv_freq(c, 1);
  for (int i = 0; i < 8; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / 16.0);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    EXPECT_NEAR(got[static_cast<size_t>(i)], base * (1 - ramp) + base / 4 * ramp,
                kFormulaTol * base)
        << i;
  }
  // An original context shorter than one turn of pair 0 (4 < 2 pi): both ends clamp to 0, and
  // the ramp becomes a step at pair 0 (high = low + 0.001) instead of 0 / 0.
  c.rope_scaling.truncate = true;
  c.rope_scaling.original_max_position_embeddings = 4;
  got = rope_inv_freq(c, 1);
  for (int i = 0; i < 8; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / 16.0);
    EXPECT_NEAR(got[static_cast<size_t>(i)], i == 0 ? base : base / 4, kFormulaTol * base) << i;
  }
}

TEST(RopeYarn, OtherRopeTypesLeaveLogitsAlone) {
  LlamaConfig c;
  c.head_dim = 64;
  for (auto kind :
       {RopeScaling::Kind::kNone, RopeScaling::Kind::kLinear, RopeScaling::Kind::kDynamic}) {
    c.rope_scaling.kind = kind;
    c.rope_scaling.factor = 4.f;
    EXPECT_EQ(rope_attention_scaling(c), 1.0);
    EXPECT_EQ(rope_logit_scale(c), 1.f);
  }
}

}  // namespace
}  // namespace burst::models
