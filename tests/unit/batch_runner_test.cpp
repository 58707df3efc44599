// models::BatchRunner on 2 and 3 ranks (real processes, Gloo): a step that mixes decode tokens
// and prefill chunks in any row order (decodes NOT on consecutive rows, so the ring takes its
// one-launch-per-token decode path, and prefill chunks between them) gives every sequence the
// greedy tokens it gets when it runs alone; releasing every sequence frees every page.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <vector>

#include "engine/backend.h"
#include "models/batch.h"
#include "multiprocess.h"

namespace burst::models {
namespace {

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

int rank_main(int world, int rank, const std::string& store) {
  const std::string root = BURST_SOURCE_DIR;
  auto comm = engine::make_gloo_communicator({rank, world, store, "127.0.0.1",
                                              std::chrono::milliseconds(30000), nullptr});
  if (!comm.ok()) return 30;
  auto backend = engine::make_cpu_backend();
  auto model = LlamaModel::load(*backend, root + "/models/kjv-tiny");
  if (!model.ok()) return 31;
  auto ring = engine::RingAttention::create(*backend, *comm.value(),
                                            model.value()->attention_shape(), 2048);
  if (!ring.ok()) return 32;
  BatchRunner runner(*model.value(), *ring.value(), *comm.value());
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
      auto got = share(*comm.value(), p, r.value());
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
    auto toks = share(*comm.value(), p, r.value());
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
  return ring.value()->cache().usage().used_pages == 0 ? 0 : 38;
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

}  // namespace
}  // namespace burst::models
