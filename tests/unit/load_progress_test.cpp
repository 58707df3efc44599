// Loading progress (models::LoadProgress): kjv-tiny loaded from its directory and a preset
// generated from its seed both report after every weight, in bytes that only grow, starting at
// 0 and ending at model_weight_bytes (what the coordinator shows on /health); and the default
// start timeout scales with those bytes.
#include <gtest/gtest.h>

#include <vector>

#include "engine/backend.h"
#include "models/config.h"
#include "models/llama.h"
#include "group/worker_group.h"

namespace burst::models {
namespace {

void expect_progress(const std::vector<std::pair<int64_t, int64_t>>& seen, int64_t total,
                     size_t weights) {
  ASSERT_EQ(seen.size(), weights + 1);  // the start, then one report per weight
  EXPECT_EQ(seen.front().first, 0);
  EXPECT_EQ(seen.back().first, total);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].second, total);
    if (i > 0) {
      EXPECT_GT(seen[i].first, seen[i - 1].first) << i;
    }
  }
}

TEST(LoadProgress, DirectoryLoadReportsEveryWeight) {
  auto backend = engine::make_cpu_backend();
  const std::string dir = std::string(BURST_SOURCE_DIR) + "/models/kjv-tiny";
  auto cfg = load_config(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.message();
  std::vector<std::pair<int64_t, int64_t>> seen;
  auto m = LlamaModel::load(*backend, dir, [&](int64_t d, int64_t t) { seen.emplace_back(d, t); });
  ASSERT_TRUE(m.ok()) << m.message();
  const LlamaConfig& c = cfg.value();
  // embed, 9 per layer, final norm, and lm_head unless tied.
  const size_t weights =
      2 + 9 * static_cast<size_t>(c.num_layers) + (c.tie_word_embeddings ? 0 : 1);
  const int64_t total = model_weight_bytes(c, engine::DType::kF32);
  int64_t params = c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2) + c.hidden_size;
  const int64_t qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  params += c.num_layers * (2 * c.hidden_size + 2 * qd * c.hidden_size + 2 * kvd * c.hidden_size +
                            3 * c.hidden_size * c.intermediate_size);
  EXPECT_EQ(total, params * 4);
  expect_progress(seen, total, weights);
}

TEST(LoadProgress, PresetGenerationReportsEveryWeight) {
  auto backend = engine::make_cpu_backend();
  auto cfg = preset_config("7b");
  ASSERT_TRUE(cfg.ok());
  LlamaConfig small = cfg.value();  // the 7b shape, cut to something a unit test can fill
  small.num_layers = 2;
  small.hidden_size = 256;
  small.num_heads = small.num_kv_heads = 2;
  small.intermediate_size = 512;
  small.vocab_size = 1000;
  std::vector<std::pair<int64_t, int64_t>> seen;
  auto m = LlamaModel::random(*backend, small, 7,
                              [&](int64_t d, int64_t t) { seen.emplace_back(d, t); });
  ASSERT_TRUE(m.ok()) << m.message();
  expect_progress(seen, model_weight_bytes(small, engine::DType::kF32), 2 + 9 * 2 + 1);
}

TEST(LoadProgress, DefaultStartTimeoutScalesWithTheWeights) {
  using std::chrono::milliseconds;
  EXPECT_EQ(server::default_start_timeout(0), milliseconds(120000));
  auto c7 = preset_config("7b");
  ASSERT_TRUE(c7.ok());
  const int64_t b = model_weight_bytes(c7.value(), engine::DType::kBF16);
  EXPECT_EQ(b, 6738415616LL * 2);  // LLaMA-2-7B's parameter count, bf16
  EXPECT_EQ(server::default_start_timeout(b), milliseconds(120000 + b * 30 / 1000000));
  EXPECT_GT(server::default_start_timeout(b), milliseconds(500000));
}

}  // namespace
}  // namespace burst::models
