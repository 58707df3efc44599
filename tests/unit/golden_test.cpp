// The CPU engine against Hugging Face transformers (fixtures from scripts/make_golden.py, run
// on the GPU machine with transformers 5.17 / torch 2.11, eager attention, fp32): the logits at
// the last prompt position and at the last decode step within 1e-3 x max |ref|, and the 32-token
// greedy continuation identical.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "engine/backend.h"
#include "../one_sequence.h"
#include "runtime/driver.h"
#include "models/llama.h"

namespace burst::models {
namespace {

using namespace ::burst::runtime;

struct Fixture {
  const char* name;
  const char* model_dir;  // relative to the repo root
};

class Golden : public ::testing::TestWithParam<Fixture> {};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& ref, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double tol = 1e-3 * max_abs(ref);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (!(e <= worst)) {  // also catches NaN
      worst = e;
      at = i;
    }
  }
  EXPECT_LE(worst, tol) << what << ": worst |logit - ref| at id " << at << " (" << got[at]
                        << " vs " << ref[at] << ")";
}

TEST_P(Golden, MatchesTransformers) {
  const Fixture f = GetParam();
  const std::string root = BURST_SOURCE_DIR;
  std::ifstream in(root + "/tests/fixtures/golden/" + f.name + "/golden.json");
  ASSERT_TRUE(in) << "missing fixture for " << f.name << " (scripts/make_golden.py writes it)";
  const auto g = nlohmann::json::parse(in);
  const auto prompt = g.at("prompt_ids").get<std::vector<int32_t>>();
  const auto ref_prefill = g.at("prefill_logits").get<std::vector<float>>();
  const auto ref_decode = g.at("decode_logits").get<std::vector<float>>();
  const auto ref_tokens = g.at("greedy_tokens").get<std::vector<int32_t>>();

  auto backend = engine::make_cpu_backend();
  auto model = LlamaModel::load(*backend, root + "/" + f.model_dir);
  ASSERT_TRUE(model.ok()) << model.message();
  LlamaModel& m = *model.value();
  const auto n = static_cast<int64_t>(prompt.size());
  auto one = burst::testing::OneRank::create(m, n + static_cast<int64_t>(ref_tokens.size()));
  ASSERT_TRUE(one.ok()) << one.message();

  // Prefill logits, then decode the reference's own greedy tokens one at a time (so a single
  // flipped argmax cannot hide a numeric error later on) and keep the last step's logits.
  std::vector<int64_t> pos(static_cast<size_t>(n));
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> logits;
  ASSERT_TRUE(one.value().forward(m, prompt, pos, {n - 1}, logits).ok());
  expect_close(logits, ref_prefill, "prefill logits");
  for (size_t i = 0; i + 1 < ref_tokens.size(); ++i) {
    auto st = one.value().forward(m, {ref_tokens[i]}, {n + static_cast<int64_t>(i)}, {0}, logits);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  expect_close(logits, ref_decode, "last decode-step logits");

  // The generator's own greedy run must give exactly the reference tokens.
  runtime::GenerateRequest req;
  req.prompt = prompt;
  req.max_tokens = static_cast<int>(ref_tokens.size());
  req.stop_at_eos = false;
  std::vector<int32_t> got;
  auto local = runtime::LocalStepRunner::create(m, n + static_cast<int64_t>(ref_tokens.size()));
  ASSERT_TRUE(local.ok()) << local.message();
  auto stats = runtime::generate(*local.value(), req, [&](int32_t t) {
    got.push_back(t);
    return true;
  });
  ASSERT_TRUE(stats.ok()) << stats.message();
  EXPECT_EQ(got, ref_tokens);
  EXPECT_EQ(stats.value().finish_reason, runtime::FinishReason::kLength);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, Golden,
    ::testing::Values(Fixture{"kjv-tiny", "models/kjv-tiny"},
                      Fixture{"odd-linear", "tests/fixtures/golden/odd-linear/model"},
                      Fixture{"odd-dynamic", "tests/fixtures/golden/odd-dynamic/model"},
                      Fixture{"odd-yarn", "tests/fixtures/golden/odd-yarn/model"}),
    [](const auto& info) {
      std::string s = info.param.name;
      for (char& c : s) c = (c == '-') ? '_' : c;
      return s;
    });

}  // namespace
}  // namespace burst::models
