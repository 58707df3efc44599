// What FP8 costs a real model, on any backend: kjv-tiny (trained on the KJV; head_dim 128, as
// LLaMA's), teacher-forced in prefill chunks over held-out text (Revelation 21-22: training held
// out the last 1 % of the chapters) and over training text (Genesis 1-2), in the backend's own
// precision (fp32 on the CPU, bf16 on a GPU) and with an FP8 option: the FP8 KV cache
// (--kv-cache-dtype fp8: FP8 rows) or FP8 attention (--attention-dtype fp8: the products of
// prefill attention in e4m3; on the CPU the emulation of the Hopper kernel). Reported:
// perplexity of each, the per-token log-probability difference (mean, p99, max), and greedy
// agreement over 64 decoded tokens, free-running and step by step given the same history
// (docs/benchmarks.md has the numbers). Bounds, for a regression to trip: perplexity within 3 %
// either way; mean |dlogp| on the training text below the caller's bound; 48 of 64 steps
// choosing the same token given the same history (free-running, one near-tie changes the rest).
// Used by tests/unit/fp8_model_test.cpp (CPU) and tests/gpu/fp8_model_test.cpp (CUDA).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/tokenizer.h"
#include "engine/backend.h"
#include "models/llama.h"
#include "one_sequence.h"

namespace burst::testing::fp8_cost {

// A passage of the KJV (`bible` from Debian bible-kjv), one verse per line without its number,
// as the model was trained; empty without the command. Where the command is absent (a GPU
// machine), $BURST_KJV_DIR/<passage>.txt holds the command's output, written where it is.
inline std::string bible_output(const std::string& passage) {
  const std::string cmd = "bible " + passage + " 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  if (p) {
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, p.get())) out.append(buf, n);
  }
  const char* dir = std::getenv("BURST_KJV_DIR");
  if (out.empty() && dir != nullptr && *dir != '\0') {
    std::ifstream f(std::string(dir) + "/" + passage + ".txt", std::ios::binary);
    std::ostringstream s;
    s << f.rdbuf();
    out = s.str();
  }
  return out;
}

inline std::string kjv_text(const std::string& passage) {
  const std::string out = bible_output(passage);
  std::string text;
  // One verse per line without its number, as the model was trained.
  size_t pos = 0;
  while (pos < out.size()) {
    size_t end = out.find('\n', pos);
    if (end == std::string::npos) end = out.size();
    std::string line = out.substr(pos, end - pos);
    pos = end + 1;
    // `bible` prints "Revelation 21" headings from column 0, verses as "  N text" and their
    // wrapped continuations from column 0.
    const size_t first = line.find_first_not_of(' ');
    if (first == std::string::npos) continue;
    const size_t last_space = line.rfind(' ');
    if (first == 0 && last_space != std::string::npos &&
        line.find_first_not_of("0123456789", last_space + 1) == std::string::npos) {
      continue;  // a heading
    }
    size_t body = line.find(' ', first);
    const bool numbered = first > 0 && std::isdigit(static_cast<unsigned char>(line[first])) != 0;
    const std::string verse = numbered && body != std::string::npos ? line.substr(body + 1)
                                                                      : line.substr(first);
    text += (numbered || text.empty() ? (text.empty() ? "" : "\n") : " ") + verse;
  }
  return text;
}

// Log-probabilities of ids[1..] given the prefix, by prefill chunks of `chunk` tokens.
// The FP8 options of a run (fp32 where both are kAuto).
struct Numerics {
  engine::KvCacheDtype kv = engine::KvCacheDtype::kAuto;
  engine::AttentionDtype attention = engine::AttentionDtype::kAuto;
};

inline std::vector<double> teacher_forced(models::LlamaModel& m, const std::vector<int32_t>& ids,
                                          int64_t chunk, Numerics num) {
  auto one = OneRank::create(m, static_cast<int64_t>(ids.size()) + 64, num.kv,
                                             num.attention);
  EXPECT_TRUE(one.ok()) << one.message();
  std::vector<double> lp;
  const int64_t vocab = m.config().vocab_size;
  for (int64_t start = 0; start + 1 < static_cast<int64_t>(ids.size()); start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(ids.size()) - 1 - start);
    std::vector<int32_t> part(ids.begin() + start, ids.begin() + start + n);
    std::vector<int64_t> pos(static_cast<size_t>(n)), rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = start + i, rows[size_t(i)] = i;
    std::vector<float> logits;
    const Status st = one.value().forward(m, part, pos, rows, logits);
    EXPECT_TRUE(st.ok()) << st.message();
    if (!st.ok()) return {};
    for (int64_t i = 0; i < n; ++i) {
      const float* l = logits.data() + i * vocab;
      const double mx = *std::max_element(l, l + vocab);
      double sum = 0;
      for (int64_t t = 0; t < vocab; ++t) sum += std::exp(double(l[t]) - mx);
      lp.push_back(double(l[ids[size_t(start + i + 1)]]) - mx - std::log(sum));
    }
  }
  return lp;
}

// Greedy tokens after `prompt` (prefill, then decode steps that read the cache). With `forced`,
// each step is fed forced[s] instead of its own choice (its choices are still returned): the
// agreement of every step given the same history, which one early near-tie cannot end.
inline std::vector<int32_t> greedy(models::LlamaModel& m, const std::vector<int32_t>& prompt,
                                   int steps, Numerics num,
                                   const std::vector<int32_t>& forced = {}) {
  auto one = OneRank::create(m, static_cast<int64_t>(prompt.size()) + steps + 8,
                                             num.kv, num.attention);
  EXPECT_TRUE(one.ok()) << one.message();
  const int64_t vocab = m.config().vocab_size;
  std::vector<int32_t> ids = prompt, out;
  std::vector<int32_t> feed = prompt;
  for (int s = 0; s < steps; ++s) {
    const int64_t start = static_cast<int64_t>(ids.size() - feed.size());
    std::vector<int64_t> pos(feed.size());
    for (size_t i = 0; i < feed.size(); ++i) pos[i] = start + static_cast<int64_t>(i);
    std::vector<float> logits;
    const Status st = one.value().forward(m, feed, pos, {static_cast<int64_t>(feed.size()) - 1},
                                          logits);
    EXPECT_TRUE(st.ok()) << st.message();
    if (!st.ok()) return out;
    const auto best =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + vocab) -
                             logits.begin());
    out.push_back(best);
    const int32_t next = forced.empty() ? best : forced[static_cast<size_t>(s)];
    ids.push_back(next);
    feed = {next};
  }
  return out;
}

struct Cost {
  double ppl_ref = 0, ppl_fp8 = 0, mean = 0, p99 = 0, max = 0;
  size_t tokens = 0;
};

// Teacher-forced log-probabilities of ids in the backend's precision and with `fp8`, compared.
inline Cost cost(models::LlamaModel& m, const std::vector<int32_t>& ids, Numerics fp8_numerics) {
  const auto ref = teacher_forced(m, ids, 257, Numerics{});
  const auto fp8 = teacher_forced(m, ids, 257, fp8_numerics);
  Cost c;
  EXPECT_EQ(ref.size(), ids.size() - 1);
  EXPECT_EQ(fp8.size(), ref.size());
  if (ref.empty() || fp8.size() != ref.size()) return c;
  double nll_ref = 0, nll_fp8 = 0;
  std::vector<double> diffs;
  for (size_t i = 0; i < ref.size(); ++i) {
    nll_ref -= ref[i];
    nll_fp8 -= fp8[i];
    diffs.push_back(std::fabs(fp8[i] - ref[i]));
    c.mean += diffs.back();
  }
  const double n = static_cast<double>(ref.size());
  c.tokens = ref.size();
  c.mean /= n;
  std::sort(diffs.begin(), diffs.end());
  c.p99 = diffs[static_cast<size_t>(0.99 * (n - 1))];
  c.max = diffs.back();
  c.ppl_ref = std::exp(nll_ref / n);
  c.ppl_fp8 = std::exp(nll_fp8 / n);
  return c;
}

inline void report(const char* option, const char* what, const Cost& c) {
  std::printf("[ info     ] kjv-tiny, %s, %s, %zu tokens in chunks of 257: perplexity without "
              "it %.4f, fp8 %.4f (%+.2f %%); |dlogp| mean %.5f, p99 %.5f, max %.5f nats\n",
              option, what, c.tokens, c.ppl_ref, c.ppl_fp8, 100 * (c.ppl_fp8 / c.ppl_ref - 1),
              c.mean, c.p99, c.max);
}

inline std::vector<int32_t> kjv_ids(const server::Tokenizer& tok, const std::string& passage,
                             size_t most) {
  auto encoded = tok.encode(kjv_text(passage), true, false);
  EXPECT_TRUE(encoded.ok()) << encoded.message();
  if (!encoded.ok()) return {};
  std::vector<int32_t> ids(encoded.value().begin(), encoded.value().end());
  ids.resize(std::min(ids.size(), most));
  return ids;
}

// kjv-tiny memorised its training text (loss 0.07) and knows little else (held-out loss 8.4,
// models/kjv-tiny/training_log.txt): on the held-out chapters every setting is near chance, on
// training text its attention is sharp. Both are measured. max_train_mean: the bound on the
// training text's mean |dlogp|. root: the source tree (models/kjv-tiny).
inline void check_costs(engine::Backend& backend, const std::string& root, const char* option,
                        Numerics fp8, double max_train_mean) {
  if (kjv_text("Gen1:1-Gen2:25").size() < 100) {
    GTEST_SKIP() << "needs the `bible` command (Debian bible-kjv; scripts/setup.sh installs it) "
                    "or $BURST_KJV_DIR with its output";
  }
  const std::string dir = root + "/models/kjv-tiny";
  auto tok = server::Tokenizer::load(dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.message();
  auto model = models::LlamaModel::load(backend, dir);
  ASSERT_TRUE(model.ok()) << model.message();

  const auto held_out = kjv_ids(*tok.value(), "Rev21:1-Rev22:21", 1000);
  const auto trained = kjv_ids(*tok.value(), "Gen1:1-Gen2:25", 1000);
  ASSERT_GT(held_out.size(), 900u);
  ASSERT_GT(trained.size(), 900u);
  const Cost h = cost(*model.value(), held_out, fp8);
  const Cost t = cost(*model.value(), trained, fp8);
  report(option, "held-out Revelation 21-22", h);
  report(option, "training text Genesis 1-2", t);
  for (const Cost* c : {&h, &t}) {
    EXPECT_GT(c->mean, 0.0) << "an FP8 option that changes nothing is not one";
    EXPECT_LT(std::fabs(c->ppl_fp8 / c->ppl_ref - 1), 0.03);
  }
  EXPECT_LT(t.mean, max_train_mean);

  // Greedy: 64 tokens after the first 600 tokens of Genesis, through decode steps.
  const std::vector<int32_t> prompt(trained.begin(), trained.begin() + 600);
  const auto g_ref = greedy(*model.value(), prompt, 64, Numerics{});
  const auto g_fp8 = greedy(*model.value(), prompt, 64, fp8);
  const auto g_forced = greedy(*model.value(), prompt, 64, fp8, g_ref);
  ASSERT_EQ(g_ref.size(), 64u);
  ASSERT_EQ(g_fp8.size(), 64u);
  ASSERT_EQ(g_forced.size(), 64u);
  size_t same_prefix = 0;
  while (same_prefix < 64 && g_ref[same_prefix] == g_fp8[same_prefix]) ++same_prefix;
  size_t same = 0, same_forced = 0;
  for (size_t i = 0; i < 64; ++i) {
    same += g_ref[i] == g_fp8[i];
    same_forced += g_ref[i] == g_forced[i];
  }
  std::printf("[ info     ] %s, greedy over 64 tokens after 600 of Genesis: identical for the "
              "first %zu, %zu of 64 equal; fed the same tokens, %zu of 64 steps choose alike\n",
              option, same_prefix, same, same_forced);
  EXPECT_GE(same_forced, 48u) << "greedy choices differ given the same history";
}

}  // namespace burst::testing::fp8_cost
