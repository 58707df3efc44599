// Logprobs and logits processing on rank 0 (runtime::BatchRunner, engine::adjust_logits):
// - the logprobs BatchRunner returns (prefill's last row and decode steps) equal a naive
//   log-softmax, in double, of the logits of an independent full forward of kjv-tiny;
// - logit_bias, presence/frequency/repetition penalties and min_tokens change the logits as
//   their definitions say (hand-computed values), and greedy tokens under additive penalties
//   are the argmax of the raw log-probabilities plus the penalties of the tokens so far.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "engine/backend.h"
#include "engine/sampler.h"
#include "models/llama.h"
#include "runtime/batch_runner.h"
#include "../one_sequence.h"
#include "multiprocess.h"

namespace burst::models {
namespace {

using namespace ::burst::runtime;

const std::vector<int32_t> kPrompt = {1, 1126, 4177, 1497, 29892, 2803, 727, 367};

struct Fixture {
  std::unique_ptr<engine::Backend> backend = engine::make_cpu_backend();
  std::unique_ptr<engine::Communicator> comm;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<engine::RingAttention> ring;
  bool ok = false;
  Fixture() {
    auto c = engine::make_gloo_communicator({0, 1, burst::testing::make_temp_dir(), "127.0.0.1",
                                             std::chrono::milliseconds(30000), nullptr});
    if (!c.ok()) return;
    comm = c.take();
    auto m = LlamaModel::load(*backend, std::string(BURST_SOURCE_DIR) + "/models/kjv-tiny");
    if (!m.ok()) return;
    model = m.take();
    auto r = engine::RingAttention::create(*backend, *comm, model->attention_shape(), 1024);
    if (!r.ok()) return;
    ring = r.take();
    ok = true;
  }
  // The logits of every position of a fresh, whole forward of `ids` (its own cache).
  std::vector<std::vector<float>> all_logits(const std::vector<int32_t>& ids) {
    std::vector<std::vector<float>> out;
    for (size_t n = 1; n <= ids.size(); ++n) {
      out.push_back(reference_logits(std::vector<int32_t>(ids.begin(), ids.begin() + n)));
    }
    return out;
  }
  // The last row's logits of a fresh, whole forward of `ids` (its own cache).
  std::vector<float> reference_logits(const std::vector<int32_t>& ids) {
    auto r = engine::RingAttention::create(*backend, *comm, model->attention_shape(), 1024);
    EXPECT_TRUE(r.ok());
    const auto n = static_cast<int64_t>(ids.size());
    const auto plan = engine::ShardPlan::make(engine::ShardLayout::kZigzag, n, 1);
    std::vector<int32_t> rows;  // the plan's rows: the ids, then padding (never attended to)
    std::vector<int64_t> pos;
    for (const auto& sg : plan.segments(0)) {
      for (int64_t i = 0; i < sg.len; ++i) {
        rows.push_back(sg.position(i) < n ? ids[static_cast<size_t>(sg.position(i))] : 0);
        pos.push_back(sg.position(i));
      }
    }
    int64_t last = 0;
    plan.owner(n - 1, &last);
    std::vector<float> logits;
    const Status st =
        burst::testing::forward_chunk(*model, *r.value(), 0, plan, rows, pos, {last}, logits, n);
    EXPECT_TRUE(st.ok()) << st.message();
    logits.resize(static_cast<size_t>(model->config().vocab_size));
    return logits;
  }
};

std::vector<double> naive_log_softmax(const std::vector<float>& x) {
  double mx = -INFINITY, sum = 0;
  for (float v : x) mx = std::max(mx, double(v));
  for (float v : x) sum += std::exp(double(v) - mx);
  std::vector<double> out;
  for (float v : x) out.push_back(double(v) - mx - std::log(sum));
  return out;
}

SeqWork work(uint64_t id, bool decode, std::vector<int32_t> tokens, int64_t start) {
  SeqWork w;
  w.id = id;
  w.decode = decode;
  w.tokens = std::move(tokens);
  w.start = start;
  w.prompt_len = static_cast<int64_t>(kPrompt.size());
  w.sample = true;
  return w;
}

TEST(Logprobs, EqualLogSoftmaxOfTheEnginesLogits) {
  Fixture f;
  ASSERT_TRUE(f.ok);
  BatchRunner runner(*f.model, *f.ring, *f.comm);
  std::vector<int32_t> seq = kPrompt;
  StepPlan p;
  p.seqs.push_back(work(7, false, kPrompt, 0));
  p.seqs.back().logprobs = 5;
  for (int step = 0; step < 4; ++step) {
    auto r = runner.step(p);
    ASSERT_TRUE(r.ok()) << r.message();
    const SampledToken& t = r.value().tokens.at(0);
    const auto want = naive_log_softmax(f.reference_logits(seq));
    ASSERT_TRUE(t.has_logprob);
    // Decode runs other kernels than the whole forward: fp32 differences, far below 1e-3.
    EXPECT_NEAR(t.logprob, want[static_cast<size_t>(t.token)], 1e-3) << "step " << step;
    ASSERT_EQ(t.top.size(), 5u);
    // Greedy: the sampled token is the most likely one.
    EXPECT_EQ(t.top[0].first, t.token);
    for (const auto& [id, lp] : t.top) EXPECT_NEAR(lp, want[static_cast<size_t>(id)], 1e-3);
    std::vector<int32_t> order(want.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    std::partial_sort(order.begin(), order.begin() + 5, order.end(),
                      [&](int32_t a, int32_t b) { return want[a] > want[b]; });
    for (int k = 0; k < 5; ++k) EXPECT_EQ(t.top[k].first, order[k]) << "rank " << k;
    seq.push_back(t.token);
    p = StepPlan();
    p.seqs.push_back(work(7, true, {t.token}, static_cast<int64_t>(seq.size()) - 1));
    p.seqs.back().logprobs = 5;
  }
}

// Prompt logprobs of a prompt prefilled in chunks of 7: every token from position 1 on, its
// log-probability given the tokens before it, equal to the naive log-softmax of an independent
// forward's logits at the previous position.
TEST(Logprobs, PromptLogprobsOverChunks) {
  Fixture f;
  ASSERT_TRUE(f.ok);
  BatchRunner runner(*f.model, *f.ring, *f.comm);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back(i == 0 ? 1 : kPrompt[i % kPrompt.size()] + i);
  const auto n = static_cast<int64_t>(prompt.size());
  std::vector<PromptTokenLogprob> got;
  for (int64_t start = 0; start < n; start += 7) {
    StepPlan p;
    SeqWork w;
    w.id = 9;
    w.start = start;
    w.tokens.assign(prompt.begin() + start, prompt.begin() + std::min(n, start + 7));
    w.prompt_len = n;
    w.sample = start + 7 >= n;
    w.prompt_logprobs = 3;
    w.next_token = start + 7 < n ? prompt[static_cast<size_t>(start + 7)] : -1;
    p.seqs.push_back(w);
    auto r = runner.step(p);
    ASSERT_TRUE(r.ok()) << r.message();
    ASSERT_EQ(r.value().prompt_logprobs.size(), 1u);
    for (const auto& e : r.value().prompt_logprobs[0].entries) got.push_back(e);
  }
  ASSERT_EQ(static_cast<int64_t>(got.size()), n - 1);
  const auto ref = f.all_logits(prompt);
  for (int64_t pos = 1; pos < n; ++pos) {
    const auto& e = got[static_cast<size_t>(pos - 1)];
    ASSERT_EQ(e.pos, pos);
    ASSERT_EQ(e.token, prompt[static_cast<size_t>(pos)]);
    const auto want = naive_log_softmax(ref[static_cast<size_t>(pos - 1)]);
    EXPECT_NEAR(e.logprob, want[static_cast<size_t>(e.token)], 1e-4) << "position " << pos;
    ASSERT_EQ(e.top.size(), 3u);
    for (const auto& [id, lp] : e.top) EXPECT_NEAR(lp, want[static_cast<size_t>(id)], 1e-4);
  }
}

TEST(LogitAdjust, DefinitionsByHand) {
  std::vector<float> l = {2.f, -1.f, 0.5f, 3.f, -2.f};
  engine::TokenHistory h;
  const int32_t prompt[] = {1};
  h.add_prompt(prompt, 1);
  h.add_generated(0);
  h.add_generated(0);
  h.add_generated(3);
  engine::LogitAdjust a;
  a.repetition_penalty = 2.f;
  a.frequency_penalty = 0.5f;
  a.presence_penalty = 0.25f;
  a.logit_bias = {{4, 10.f}};
  a.min_tokens = 4;  // 3 generated: EOS (id 2 here) is masked
  engine::adjust_logits(l.data(), 5, a, h, 2);
  EXPECT_FLOAT_EQ(l[0], 2.f / 2 - 0.5f * 2 - 0.25f);  // generated twice
  EXPECT_FLOAT_EQ(l[1], -1.f * 2);                    // prompt only: repetition penalty only
  EXPECT_TRUE(std::isinf(l[2]) && l[2] < 0);          // EOS before min_tokens
  EXPECT_FLOAT_EQ(l[3], 3.f / 2 - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[4], -2.f + 10.f);                 // bias only (seen nowhere)
  h.add_generated(1);  // 4 generated: EOS allowed again
  std::vector<float> m = {0.f, 0.f, 1.f};
  engine::LogitAdjust only_min;
  only_min.min_tokens = 4;
  engine::adjust_logits(m.data(), 3, only_min, h, 2);
  EXPECT_FLOAT_EQ(m[2], 1.f);
  EXPECT_FALSE(engine::validate(engine::LogitAdjust{}, 5).size());
  engine::LogitAdjust bad;
  bad.presence_penalty = 2.5f;
  EXPECT_TRUE(engine::validate(bad, 5).size());
  bad = {};
  bad.logit_bias = {{5, 1.f}};
  EXPECT_TRUE(engine::validate(bad, 5).size());
}

// Greedy with additive adjustments (logit_bias, frequency and presence penalties): each token
// is the argmax of raw log-probabilities (all of them, logprobs = vocab) plus the adjustments
// computed here from the tokens generated before it; and the output differs from plain greedy.
TEST(LogitAdjust, GreedyUnderPenaltiesThroughTheBatchRunner) {
  Fixture f;
  ASSERT_TRUE(f.ok);
  BatchRunner runner(*f.model, *f.ring, *f.comm);
  const int vocab = static_cast<int>(f.model->config().vocab_size);
  auto run = [&](uint64_t id, const engine::LogitAdjust& a, int n, bool check) {
    std::vector<int32_t> out;
    std::map<int32_t, int> counts;
    StepPlan p;
    p.seqs.push_back(work(id, false, kPrompt, 0));
    for (int step = 0; step < n; ++step) {
      p.seqs.back().adjust = a;
      p.seqs.back().logprobs = check ? vocab : -1;
      auto r = runner.step(p);
      EXPECT_TRUE(r.ok()) << r.message();
      if (!r.ok()) return out;
      const SampledToken& t = r.value().tokens.at(0);
      if (check) {
        std::vector<double> s(static_cast<size_t>(vocab));
        for (const auto& [tok, lp] : t.top) s[static_cast<size_t>(tok)] = lp;
        for (const auto& [tok, bias] : a.logit_bias) s[static_cast<size_t>(tok)] += bias;
        for (const auto& [tok, c] : counts) {
          s[static_cast<size_t>(tok)] -= a.frequency_penalty * c + a.presence_penalty;
        }
        const auto best = std::max_element(s.begin(), s.end()) - s.begin();
        EXPECT_EQ(t.token, best) << "step " << step;
      }
      ++counts[t.token];
      out.push_back(t.token);
      p = StepPlan();
      p.seqs.push_back(work(id, true, {t.token},
                            static_cast<int64_t>(kPrompt.size() + out.size()) - 1));
    }
    runner.release(id);
    return out;
  };
  const auto plain = run(1, {}, 40, false);
  engine::LogitAdjust pen;
  pen.frequency_penalty = 2.f;
  pen.presence_penalty = 2.f;
  const auto penalised = run(2, pen, 40, true);
  EXPECT_NE(plain, penalised);
  // A repeated token costs at least 4 (frequency 2 per use + presence 2): fewer repeats than plain greedy.
  auto repeats = [](const std::vector<int32_t>& v) {
    std::map<int32_t, int> c;
    int r = 0;
    for (int32_t t : v) r += c[t]++ > 0;
    return r;
  };
  EXPECT_LT(repeats(penalised), repeats(plain));
  engine::LogitAdjust bias;
  bias.logit_bias = {{plain[0], -100.f}, {4177, 5.f}};
  const auto biased = run(3, bias, 3, true);
  EXPECT_NE(biased[0], plain[0]);
  engine::LogitAdjust force;
  force.logit_bias = {{4177, 100.f}};
  EXPECT_EQ(run(4, force, 3, false), std::vector<int32_t>(3, 4177));
}

}  // namespace
}  // namespace burst::models
