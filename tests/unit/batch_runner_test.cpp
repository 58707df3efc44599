// runtime::BatchRunner on 2 and 3 ranks (real processes, Gloo): a step that mixes decode tokens
// and prefill chunks in any row order (decodes NOT on consecutive rows, so the ring takes its
// one-launch-per-token decode path, and prefill chunks between them) gives every sequence the
// greedy tokens it gets when it runs alone, and so does a decode whose tokens are left to the
// runner (kPreviousToken); releasing every sequence frees every page.
// Sampling: a batch of seeded rows of every kind (greedy and sampled rows drawn on their owner
// rank's backend, rows with logprobs or penalties on rank 0's host) gives, on 1, 2 and 3 ranks,
// the tokens of the host sampler on a single-process forward of each sequence alone; and the
// step's own collectives do not grow with the number of sequences it samples.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <vector>

#include "engine/attention_context.h"
#include "engine/backend.h"
#include "models/llama.h"
#include "runtime/batch_runner.h"
#include "../one_sequence.h"
#include "multiprocess.h"

namespace burst::models {
namespace {

using namespace ::burst::runtime;

using burst::testing::make_temp_dir;
using burst::testing::run_ranks;

constexpr int kNew = 6;  // tokens generated per sequence

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p = {1};
  for (int i = 1; i < n; ++i) p.push_back(300 + (i * 7919 + salt * 104729) % 7000);
  return p;
}

// The plan's sampled tokens, from rank 0 to every rank (id -> token), in plan order.
Result<std::map<uint64_t, int32_t>> share(engine::Communicator& comm, const StepPlan& plan,
                                          const StepResult& r) {
  std::vector<int32_t> toks;
  for (const auto& t : r.tokens) toks.push_back(t.token);
  size_t n = 0;
  for (const auto& s : plan.seqs) n += s.sample ? 1 : 0;
  toks.resize(n);
  BURST_RETURN_IF_ERROR(comm.broadcast(toks.data(), toks.size() * 4, 0));
  std::map<uint64_t, int32_t> out;
  size_t i = 0;
  for (const auto& s : plan.seqs) {
    if (s.sample) out[s.id] = toks[i++];
  }
  return out;
}

// One rank of a CPU group over Gloo: the kjv-tiny model, a 2048-row ring and a batch runner.
struct Member {
  std::unique_ptr<engine::Communicator> gloo;
  std::unique_ptr<engine::Backend> backend;
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<engine::RingAttention> ring;
  std::unique_ptr<BatchRunner> runner;
  // 0, or the rank's exit code: 30 no communicator.
  int connect(int world, int rank, const std::string& store) {
    auto c = engine::make_gloo_communicator({rank, world, store, "127.0.0.1",
                                             std::chrono::milliseconds(30000), nullptr});
    if (!c.ok()) return 30;
    gloo = c.take();
    return 0;
  }
  // The model, ring and runner over comm (gloo, or a wrapper of it): 0, 31 no model, 32 no ring.
  int load(engine::Communicator& comm) {
    backend = engine::make_cpu_backend();
    auto m = LlamaModel::load(*backend, std::string(BURST_SOURCE_DIR) + "/models/kjv-tiny");
    if (!m.ok()) return 31;
    model = m.take();
    auto r = engine::RingAttention::create(*backend, comm, model->attention_shape(), 2048);
    if (!r.ok()) return 32;
    ring = r.take();
    runner = std::make_unique<BatchRunner>(*model, *ring, comm);
    return 0;
  }
};

int rank_main(int world, int rank, const std::string& store) {
  Member m;
  if (const int e = m.connect(world, rank, store)) return e;
  if (const int e = m.load(*m.gloo)) return e;
  BatchRunner& runner = *m.runner;
  const std::vector<std::vector<int32_t>> prompts = {prompt_of(23, 1), prompt_of(61, 2),
                                                     prompt_of(9, 3)};
  auto work = [&](uint64_t id, bool decode, std::vector<int32_t> toks, int64_t start,
                  bool sample) {
    SeqWork w;
    w.id = id;
    w.decode = decode;
    w.tokens = std::move(toks);
    w.start = start;
    w.prompt_len = static_cast<int64_t>(prompts[id % 10].size());
    w.sample = sample;
    return w;
  };
  // Alone: each sequence prefilled whole, then kNew - 1 decode steps.
  std::vector<std::vector<int32_t>> want(prompts.size());
  for (uint64_t i = 0; i < prompts.size(); ++i) {
    const int64_t n = static_cast<int64_t>(prompts[i].size());
    StepPlan p;
    p.seqs.push_back(work(i, false, prompts[i], 0, true));
    for (int t = 0; t < kNew; ++t) {
      auto r = runner.step(p);
      if (!r.ok()) return 33;
      auto got = share(*m.gloo, p, r.value());
      if (!got.ok()) return 34;
      want[i].push_back(got.value()[i]);
      p = StepPlan();
      p.seqs.push_back(work(i, true, {want[i].back()}, n + t, true));
    }
    runner.release(i);
  }
  // Mixed: ids 10, 11, 12 are the same prompts. Step 1 prefills 10 and 12; then 11 comes in
  // chunks of 25 BETWEEN the decode tokens of 10 and 12, then decodes with them.
  std::map<uint64_t, std::vector<int32_t>> got;
  std::map<uint64_t, int64_t> done;  // prompt tokens prefilled
  StepPlan p;
  p.seqs.push_back(work(10, false, prompts[0], 0, true));
  p.seqs.push_back(work(12, false, prompts[2], 0, true));
  done[10] = static_cast<int64_t>(prompts[0].size());
  done[12] = static_cast<int64_t>(prompts[2].size());
  done[11] = 0;
  for (int step = 0; step < 20; ++step) {
    auto r = runner.step(p);
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d step %d: %s\n", rank, step, r.message().c_str());
      return 35;
    }
    auto toks = share(*m.gloo, p, r.value());
    if (!toks.ok()) return 36;
    for (const auto& [id, t] : toks.value()) got[id].push_back(t);
    p = StepPlan();
    for (uint64_t id : {10, 11, 12}) {
      const auto& pr = prompts[id % 10];
      const int64_t n = static_cast<int64_t>(pr.size());
      if (done[id] < n) {
        const int64_t len = std::min<int64_t>(25, n - done[id]);
        p.seqs.push_back(work(id, false, {pr.begin() + done[id], pr.begin() + done[id] + len},
                              done[id], done[id] + len == n));
        done[id] += len;
      } else if (!got[id].empty() && static_cast<int>(got[id].size()) < kNew) {
        p.seqs.push_back(work(id, true, {got[id].back()},
                              n + static_cast<int64_t>(got[id].size()) - 1, true));
      }
    }
    if (p.seqs.empty()) break;
  }
  for (uint64_t id : {10, 11, 12}) {
    if (rank == 0 && got[id] != want[id % 10]) {
      std::fprintf(stderr, "rank 0: sequence %d mixed != alone\n", static_cast<int>(id));
      return 37;
    }
    runner.release(id);
  }
  // Lookahead rows: ids 20, 21, 22 (the same prompts) prefilled in one step, then decoded with
  // kPreviousToken only (what the scheduler sends before it has read the tokens; rank 0 fills
  // them in, the prefill's tokens drawn on whichever rank holds each prompt's last row): the
  // tokens of each sequence alone. A row asking for the token of a step that did not sample
  // that sequence is refused on every rank before any collective, and the runner goes on.
  std::map<uint64_t, std::vector<int32_t>> prev;
  StepPlan q;
  for (uint64_t id : {20, 21, 22}) q.seqs.push_back(work(id, false, prompts[id % 10], 0, true));
  for (int t = 0; t < kNew; ++t) {
    auto r = runner.step(q);
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d lookahead step %d: %s\n", rank, t, r.message().c_str());
      return 39;
    }
    auto toks = share(*m.gloo, q, r.value());
    if (!toks.ok()) return 40;
    for (const auto& [id, tok] : toks.value()) prev[id].push_back(tok);
    q = StepPlan();
    for (uint64_t id : {20, 21, 22}) {
      const auto n = static_cast<int64_t>(prompts[id % 10].size());
      q.seqs.push_back(work(id, true, {kPreviousToken}, n + t, true));
    }
  }
  for (uint64_t id : {20, 21, 22}) {
    if (rank == 0 && prev[id] != want[id % 10]) {
      std::fprintf(stderr, "rank 0: sequence %d by kPreviousToken != alone\n",
                   static_cast<int>(id));
      return 41;
    }
  }
  const auto n20 = static_cast<int64_t>(prompts[0].size());
  const auto n21 = static_cast<int64_t>(prompts[1].size());
  StepPlan only20;
  only20.seqs.push_back(work(20, true, {kPreviousToken}, n20 + kNew - 1, true));
  if (!runner.step(only20).ok()) return 42;
  StepPlan stale;  // 21 did not sample in the step before
  stale.seqs.push_back(work(21, true, {kPreviousToken}, n21 + kNew - 1, true));
  auto refused = runner.step(stale);
  if (refused.ok() || refused.code() != StatusCode::kInvalidArgument ||
      refused.message().find("did not sample") == std::string::npos) {
    return 43;
  }
  std::vector<int32_t> last21 = {rank == 0 ? prev[21].back() : 0};
  if (!m.gloo->broadcast(last21.data(), 4, 0).ok()) return 44;
  StepPlan given;  // the same row with its token spelled out runs
  given.seqs.push_back(work(21, true, last21, n21 + kNew - 1, true));
  if (!runner.step(given).ok()) return 45;
  for (uint64_t id : {20, 21, 22}) runner.release(id);
  // Overlapped steps (the worker's order while a step's ids are on their way): ids 30, 31, 32
  // (the same prompts) prefilled by step(), then decode steps by kPreviousToken, each launched
  // BEFORE the step before it is finished; one step also asks 31's logprobs (that step's ids
  // come to the host inside its launch), and 32 is released by the plan launched while the
  // step that ran it is unfinished. The tokens are each sequence's alone, in launch order.
  std::map<uint64_t, std::vector<int32_t>> over;
  auto take = [&](const StepPlan& plan, int code) -> int {
    auto r = runner.finish();
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d overlapped finish: %s\n", rank, r.message().c_str());
      return code;
    }
    for (const auto& t : r.value().tokens) {
      const bool asked = plan.seqs[0].id == 31 && plan.seqs[0].logprobs >= 0;
      if (rank == 0 && t.id == 31 && asked != t.has_logprob) return code + 1;
    }
    auto toks = share(*m.gloo, plan, r.value());
    if (!toks.ok()) return code + 2;
    for (const auto& [id, tok] : toks.value()) over[id].push_back(tok);
    return 0;
  };
  StepPlan o;
  for (uint64_t id : {30, 31, 32}) o.seqs.push_back(work(id, false, prompts[id % 10], 0, true));
  if (runner.launched() || runner.queues(o) || !runner.launch(o).ok()) return 46;
  if (runner.step(o).ok()) return 47;  // step() refuses while a launched step awaits finish()
  if (const int e = take(o, 48)) return e;
  StepPlan before;  // launched, not finished
  for (int t = 0; t + 1 < kNew; ++t) {
    StepPlan d;
    for (uint64_t id : {31, 30, 32}) {  // 31 first: the logprobs row
      if (id == 32 && t >= 3) continue;
      d.seqs.push_back(work(id, true, {kPreviousToken}, prompts[id % 10].size() + t, true));
      if (id == 31 && t == 2) d.seqs.back().logprobs = 1;
    }
    if (t == 3) d.release.push_back(32);
    if (rank == 0 && t > 0 && runner.queues(d) != (t != 2)) return 51;
    if (!runner.launch(d).ok()) {
      std::fprintf(stderr, "rank %d overlapped launch %d\n", rank, t);
      return 52;
    }
    if (t > 0) {
      if (const int e = take(before, 53)) return e;
    }
    before = d;
  }
  if (const int e = take(before, 56)) return e;
  if (runner.launched()) return 59;
  auto prefix = want[2];
  prefix.resize(4);
  if (rank == 0 && (over[30] != want[0] || over[31] != want[1] || over[32] != prefix)) {
    std::fprintf(stderr, "rank 0: overlapped steps != alone\n");
    return 60;
  }
  for (uint64_t id : {30, 31}) runner.release(id);
  return m.ring->cache().usage().used_pages == 0 ? 0 : 38;
}

class BatchRunnerMixed : public ::testing::TestWithParam<int> {};

TEST_P(BatchRunnerMixed, InterleavedStepsEqualEachSequenceAlone) {
  const int world = GetParam();
  const std::string store = make_temp_dir();
  const auto codes = run_ranks(world, [&](int rank) { return rank_main(world, rank, store); },
                               std::chrono::seconds(120));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, BatchRunnerMixed, ::testing::Values(2, 3));

// A sequence of the sampling tests: how it samples, and what reads its logits on the host.
struct SampledSeq {
  engine::SamplingParams sampling;
  int logprobs = -1;           // >= 0: rank 0 scores the token (host path)
  engine::LogitAdjust adjust;  // active: rank 0 adjusts the logits (host path)
  int prompt_len = 0;
};

std::vector<SampledSeq> sampled_seqs() {
  engine::LogitAdjust pen;
  pen.presence_penalty = 0.5f;
  pen.repetition_penalty = 1.3f;
  return {
      {{0.f, 0, 1.f, 0}, -1, {}, 23},     // greedy, on the owner's backend
      {{0.8f, 0, 0.9f, 7}, -1, {}, 40},   // top-p, backend
      {{1.f, 40, 1.f, 11}, 2, {}, 9},     // top-k with logprobs: host
      {{0.7f, 0, 1.f, 5}, -1, pen, 31},   // penalties: host
      {{0.f, 0, 1.f, 0}, 0, {}, 17},      // greedy with logprobs: host
      {{1.2f, 0, 1.f, 3}, -1, {}, 12},    // plain temperature, backend
      {{1.5f, 5, 0.95f, 9}, -1, {}, 28},  // top-k and top-p, backend
  };
}

// Today's semantics, independently of BatchRunner: the sequence alone in one process, its
// logits on the host, adjusted (with rank 0's history rules), drawn by its Sampler.
std::vector<int32_t> host_reference(LlamaModel& m, const std::vector<int32_t>& prompt,
                                    const SampledSeq& q, int n_new, std::vector<float>& logprobs) {
  const int64_t vocab = m.config().vocab_size, n = static_cast<int64_t>(prompt.size());
  auto one = burst::testing::OneRank::create(m, 256);
  if (!one.ok()) return {};
  std::vector<int64_t> pos(prompt.size());
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> logits;
  if (!one.value().forward(m, prompt, pos, {n - 1}, logits, n).ok()) return {};
  engine::Sampler sampler(q.sampling);
  engine::TokenHistory h;
  if (q.adjust.repetition_penalty != 1.f) h.add_prompt(prompt.data(), prompt.size());
  std::vector<int32_t> out;
  for (int t = 0; t < n_new; ++t) {
    std::vector<float> use = logits;
    if (q.adjust.active()) {
      engine::adjust_logits(use.data(), vocab, q.adjust, h, m.config().eos_token_id);
    }
    const int32_t token = sampler.sample(use.data(), vocab);
    if (q.adjust.active()) h.add_generated(token);
    logprobs.push_back(engine::log_softmax_at(logits.data(), vocab, token, 0, nullptr));
    out.push_back(token);
    if (!one.value().forward(m, {token}, {n + t}, {0}, logits, n + t + 1).ok()) return {};
  }
  return out;
}

struct SamplingCase {
  int world;
  engine::ShardLayout layout;
};

int sampling_rank_main(const SamplingCase& c, int rank, const std::string& store) {
  Member m;
  if (const int e = m.connect(c.world, rank, store)) return e;
  if (const int e = m.load(*m.gloo)) return e;
  BatchRunner& runner = *m.runner;
  const std::vector<SampledSeq> seqs = sampled_seqs();
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < seqs.size(); ++i) {
    prompts.push_back(prompt_of(seqs[i].prompt_len, static_cast<int>(i) + 4));
  }
  // Prompts in chunks of 16 (so they complete in different steps, their last rows on
  // different ranks), each sequence decoding as soon as it has its first token.
  constexpr int kChunk = 16;
  std::vector<int64_t> done(seqs.size(), 0);
  std::vector<std::vector<int32_t>> got(seqs.size());
  std::vector<std::vector<SampledToken>> tokens(seqs.size());
  for (int step = 0; step < 40; ++step) {
    StepPlan p;
    p.layout = c.layout;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int64_t n = static_cast<int64_t>(prompts[i].size());
      SeqWork w;
      if (done[i] < n) {
        const int64_t len = std::min<int64_t>(kChunk, n - done[i]);
        w = prefill_work(i, prompts[i], done[i], len, seqs[i].sampling);
        done[i] += len;
      } else if (static_cast<int>(got[i].size()) < kNew) {
        w = decode_work(i, got[i].back(), n + static_cast<int64_t>(got[i].size()) - 1, n,
                        seqs[i].sampling);
      } else {
        continue;
      }
      w.adjust = seqs[i].adjust;  // every chunk: rank 0 keeps the prompt's ids for repetition
      w.logprobs = seqs[i].logprobs;
      p.seqs.push_back(std::move(w));
    }
    if (p.seqs.empty()) break;
    auto r = runner.step(p);
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d step %d: %s\n", rank, step, r.message().c_str());
      return 33;
    }
    auto toks = share(*m.gloo, p, r.value());
    if (!toks.ok()) return 34;
    for (const auto& [id, t] : toks.value()) got[id].push_back(t);
    for (const SampledToken& t : r.value().tokens) tokens[t.id].push_back(t);
  }
  if (rank != 0) return 0;
  int bad = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<float> lps;
    const auto want = host_reference(*m.model, prompts[i], seqs[i], kNew, lps);
    if (got[i] != want) {
      std::fprintf(stderr, "world %d: sequence %zu: tokens differ from the host sampler's\n",
                   c.world, i);
      ++bad;
      continue;
    }
    for (size_t t = 0; t < tokens[i].size(); ++t) {
      const SampledToken& st = tokens[i][t];
      if (st.has_logprob != (seqs[i].logprobs >= 0) ||
          (st.has_logprob && !(std::fabs(st.logprob - lps[t]) < 1e-3f))) {
        std::fprintf(stderr, "world %d: sequence %zu token %zu: logprob %g, want %g\n",
                     c.world, i, t, st.logprob, lps[t]);
        ++bad;
      }
    }
  }
  // The sampled sequences really sample: their tokens are not all their greedy twins'.
  SampledSeq greedy = seqs[1];
  greedy.sampling = {};
  std::vector<float> unused;
  if (host_reference(*m.model, prompts[1], greedy, kNew, unused) == got[1]) {
    std::fprintf(stderr, "sequence 1 drew its greedy tokens\n");
    ++bad;
  }
  return bad == 0 ? 0 : 35;
}

class BatchRunnerSampling : public ::testing::TestWithParam<SamplingCase> {};

TEST_P(BatchRunnerSampling, MixedRowsDrawTheHostSamplersTokens) {
  const SamplingCase c = GetParam();
  const std::string store = make_temp_dir();
  const auto codes = run_ranks(
      c.world, [&](int rank) { return sampling_rank_main(c, rank, store); },
      std::chrono::seconds(120));
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, BatchRunnerSampling,
    ::testing::Values(SamplingCase{1, engine::ShardLayout::kStriped},
                      SamplingCase{2, engine::ShardLayout::kStriped},
                      SamplingCase{3, engine::ShardLayout::kStriped},
                      SamplingCase{2, engine::ShardLayout::kZigzag},
                      SamplingCase{2, engine::ShardLayout::kContiguous},
                      SamplingCase{3, engine::ShardLayout::kContiguous}),
    [](const ::testing::TestParamInfo<SamplingCase>& i) {
      return std::to_string(i.param.world) +
             "_" + engine::shard_layout_name(i.param.layout);
    });

// Counts broadcasts and all-gathers (the collectives whose number must not grow with the
// sequences a step samples); forwards everything to the real communicator.
class CountingComm final : public engine::Communicator {
 public:
  explicit CountingComm(engine::Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Result<std::unique_ptr<engine::CommHandle>> isend(const void* data, size_t bytes, int peer,
                                                    int tag) override {
    return inner_.isend(data, bytes, peer, tag);
  }
  Result<std::unique_ptr<engine::CommHandle>> irecv(void* data, size_t bytes, int peer,
                                                    int tag) override {
    return inner_.irecv(data, bytes, peer, tag);
  }
  Result<std::unique_ptr<engine::CommHandle>> isendrecv(const void* send, int send_peer,
                                                        void* recv, int recv_peer, size_t bytes,
                                                        int tag) override {
    return inner_.isendrecv(send, send_peer, recv, recv_peer, bytes, tag);
  }
  Status all_gather(const void* in, void* out, size_t bytes) override {
    ++collectives;
    return inner_.all_gather(in, out, bytes);
  }
  Status broadcast(void* data, size_t bytes, int root) override {
    ++collectives;
    return inner_.broadcast(data, bytes, root);
  }
  Status barrier() override { return inner_.barrier(); }
  int collectives = 0;

 private:
  engine::Communicator& inner_;
};

// Prompts whose last row lies on rank 1 (contiguous layout, 2 ranks), drawn on rank 1's
// backend: the step's collectives (the ring's prefill uses neither broadcast nor all-gather)
// are one uniforms broadcast and one ids all-gather, for 1 sequence as for 5; a greedy-only
// step needs no broadcast. The old path was one 4 * vocab-byte broadcast per sequence.
int count_rank_main(int rank, const std::string& store) {
  Member m;
  if (const int e = m.connect(2, rank, store)) return e;
  CountingComm comm(*m.gloo);
  if (const int e = m.load(comm)) return e;
  BatchRunner& runner = *m.runner;
  const int vocab = static_cast<int>(m.model->config().vocab_size);
  uint64_t next_id = 0;
  auto run = [&](const std::vector<engine::SamplingParams>& settings) -> int {
    StepPlan p;
    p.layout = engine::ShardLayout::kContiguous;
    for (size_t i = 0; i < settings.size(); ++i) {
      const auto prompt = prompt_of(20 + 3 * static_cast<int>(i), static_cast<int>(i));
      p.seqs.push_back(prefill_work(next_id++, prompt, 0, static_cast<int64_t>(prompt.size()),
                                    settings[i]));
    }
    comm.collectives = 0;
    auto r = runner.step(p);
    if (!r.ok()) return -1;
    if (rank == 0) {
      if (r.value().tokens.size() != settings.size()) return -1;
      for (const auto& t : r.value().tokens) {
        if (t.token < 0 || t.token >= vocab) return -1;
      }
    }
    return comm.collectives;
  };
  const engine::SamplingParams greedy{0.f, 0, 1.f, 0}, hot{0.9f, 0, 1.f, 1};
  const engine::SamplingParams top{1.1f, 20, 0.9f, 2};
  const int one = run({hot});
  const int five = run({hot, greedy, top, hot, greedy});
  const int greedy_only = run({greedy, greedy, greedy});
  if (one != 2 || five != 2 || greedy_only != 1) {
    std::fprintf(stderr, "rank %d: collectives 1 seq %d, 5 seqs %d, 3 greedy %d\n", rank, one,
                 five, greedy_only);
    return 33;
  }
  return 0;
}

TEST(BatchRunnerSamplingCollectives, DoNotGrowWithTheSequences) {
  const std::string store = make_temp_dir();
  const auto codes = run_ranks(2, [&](int rank) { return count_rank_main(rank, store); },
                               std::chrono::seconds(120));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace burst::models
