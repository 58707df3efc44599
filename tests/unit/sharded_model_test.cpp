// The LLaMA model over tp x N ranks (real processes, Gloo over loopback, BurstAttention ring of
// N ranks, tensor-parallel groups of tp): the prefill logits at the last prompt position match
// Hugging Face's within the golden tolerance, and the 32-token greedy continuation (the prompt
// in one step, and in chunks) equals Hugging Face's on every ring, for N = 1, 2, 3, 4, both
// sharding layouts, and tp = 1, 2, 3, 4 where the model's heads split.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/backend.h"
#include "engine/communicator_factory.h"
#include "models/llama.h"
#include "runtime/batch_runner.h"
#include "runtime/driver.h"
#include "../one_sequence.h"
#include "multiprocess.h"

namespace burst::models {
namespace {

using namespace ::burst::runtime;

using burst::testing::make_temp_dir;
using burst::testing::run_ranks;

struct Case {
  const char* fixture;
  const char* model_dir;  // relative to the repo root
  int world;  // the ring's ranks
  engine::ShardLayout layout;
  int tp = 1;  // tensor parallelism: tp x world processes
};

int rank_main(const Case& c, int global_rank, const std::string& store) {
  const std::string root = BURST_SOURCE_DIR;
  const std::string dir = root + "/tests/fixtures/golden/" + c.fixture;
  std::ifstream in(dir + "/golden.json");
  if (!in) return 30;
  const auto g = nlohmann::json::parse(in);
  const auto prompt = g.at("prompt_ids").get<std::vector<int32_t>>();
  const auto ref_logits = g.at("prefill_logits").get<std::vector<float>>();
  const auto ref_tokens = g.at("greedy_tokens").get<std::vector<int32_t>>();

  auto backend = engine::make_cpu_backend();
  const engine::ParallelLayout layout{c.tp, c.world};
  engine::CommunicatorOptions co;
  co.rank = global_rank;
  co.world_size = layout.world();
  co.store_dir = store;
  auto comms = engine::make_rank_communicators(*backend, co, layout);
  if (!comms.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", global_rank, comms.message().c_str());
    return 31;
  }
  auto& comm = comms.value().ring;
  const int rank = layout.cp_index(global_rank);  // this rank's place in its ring
  auto model = LlamaModel::load(*backend, root + "/" + c.model_dir, nullptr,
                                {layout.tp_index(global_rank), c.tp});
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.message().c_str());
    return 32;
  }
  model.value()->set_tensor_parallel_comm(*comms.value().tp);
  const auto n = static_cast<int64_t>(prompt.size());
  const auto plan = engine::ShardPlan::make(c.layout, n, c.world);
  auto ring = engine::RingAttention::create(*backend, *comm,
                                            model.value()->attention_shape(),
                                            plan.local_rows(rank) + 64);
  if (!ring.ok()) return 33;

  // Prefill logits from the rank that holds the last position.
  std::vector<int32_t> ids;
  std::vector<int64_t> pos;
  for (const auto& sg : plan.segments(rank)) {
    for (int64_t i = 0; i < sg.len; ++i) {
      ids.push_back(sg.position(i) < n ? prompt[sg.position(i)] : 0);
      pos.push_back(sg.position(i));
    }
  }
  int64_t row = 0;
  const int owner = plan.owner(n - 1, &row);
  std::vector<float> logits;
  auto st = burst::testing::forward_chunk(
      *model.value(), *ring.value(), 0, plan, ids, pos,
      owner == rank ? std::vector<int64_t>{row} : std::vector<int64_t>{}, logits, n);
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, st.message().c_str());
    return 34;
  }
  if (owner == rank) {
    double mx = 0, worst = 0;
    for (float x : ref_logits) mx = std::max(mx, std::fabs(double(x)));
    for (size_t i = 0; i < ref_logits.size(); ++i) {
      worst = std::max(worst, std::fabs(double(logits[i]) - ref_logits[i]));
    }
    if (!(worst <= 1e-3 * mx)) {
      std::fprintf(stderr, "rank %d: prefill logits off by %g (tolerance %g)\n", rank, worst,
                   1e-3 * mx);
      return 35;
    }
  }

  // The prompt in one step, then in chunks of 7 (they divide neither the prompt nor 2N),
  // through the batch runner, then decode steps: transformers' greedy tokens both ways.
  BatchRunner runner(*model.value(), *ring.value(), *comm);
  runner.release_all();  // the logits' forward above left its sequence in the ring
  constexpr uint64_t kSeq = 42;
  for (const int64_t chunk : {n, int64_t{7}}) {
    std::vector<int32_t> chunked;
    int32_t token = 0;
    for (int64_t start = 0; start < n; start += chunk) {
      StepPlan plan;
      plan.layout = c.layout;
      SeqWork w = prefill_work(kSeq, prompt, start, std::min(chunk, n - start), {});
      plan.seqs.push_back(w);
      auto r = runner.step(plan);
      if (!r.ok()) {
        std::fprintf(stderr, "rank %d: chunk at %lld: %s\n", rank, (long long)start,
                     r.message().c_str());
        return 39;
      }
      if (w.sample && rank == 0) token = r.value().tokens.at(0).token;
    }
    for (size_t i = 0; i < ref_tokens.size(); ++i) {
      if (comm->broadcast(&token, sizeof token, 0).ok() == false) return 40;
      chunked.push_back(token);
      if (i + 1 == ref_tokens.size()) break;
      StepPlan plan;
      plan.seqs.push_back(decode_work(kSeq, token, n + static_cast<int64_t>(i), n, {}));
      auto r = runner.step(plan);
      if (!r.ok()) return 41;
      if (rank == 0) token = r.value().tokens.at(0).token;
    }
    if (rank == 0 && chunked != ref_tokens) {
      std::fprintf(stderr, "rank 0: greedy tokens (chunks of %lld) differ from transformers'\n",
                   (long long)chunk);
      return 42;
    }
    runner.release(kSeq);
    if (ring.value()->cache().usage().used_pages != 0) return 43;
  }
  return 0;
}

class ShardedModel : public ::testing::TestWithParam<Case> {};

constexpr const char* kOddLinear = "tests/fixtures/golden/odd-linear/model";
constexpr const char* kOddDynamic = "tests/fixtures/golden/odd-dynamic/model";
constexpr const char* kOddYarn = "tests/fixtures/golden/odd-yarn/model";

TEST_P(ShardedModel, MatchesTransformersOnEveryWorldSize) {
  const Case c = GetParam();
  const std::string store = make_temp_dir();
  const int processes = c.world * c.tp;
  const auto codes = run_ranks(processes, [&](int rank) { return rank_main(c, rank, store); },
                               std::chrono::seconds(120));
  for (int r = 0; r < processes; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, ShardedModel,
    ::testing::Values(Case{"kjv-tiny", "models/kjv-tiny", 1, engine::ShardLayout::kStriped},
                      Case{"kjv-tiny", "models/kjv-tiny", 2, engine::ShardLayout::kStriped},
                      Case{"kjv-tiny", "models/kjv-tiny", 3, engine::ShardLayout::kStriped},
                      Case{"kjv-tiny", "models/kjv-tiny", 4, engine::ShardLayout::kStriped},
                      Case{"kjv-tiny", "models/kjv-tiny", 3, engine::ShardLayout::kContiguous},
                      Case{"kjv-tiny", "models/kjv-tiny", 3, engine::ShardLayout::kZigzag},
                      Case{"odd-linear", kOddLinear, 1, engine::ShardLayout::kStriped},
                      Case{"odd-linear", kOddLinear, 2, engine::ShardLayout::kStriped},
                      Case{"odd-linear", kOddLinear, 3, engine::ShardLayout::kStriped},
                      Case{"odd-linear", kOddLinear, 4, engine::ShardLayout::kStriped},
                      Case{"odd-linear", kOddLinear, 3, engine::ShardLayout::kContiguous},
                      Case{"odd-linear", kOddLinear, 4, engine::ShardLayout::kZigzag},
                      Case{"odd-dynamic", kOddDynamic, 4, engine::ShardLayout::kStriped},
                      // Tensor parallelism: odd-linear has 6 heads and 2 KV heads (tp 2: one
                      // KV head each), odd-dynamic 4 and 4 (tp 4: one head each), kjv-tiny 2
                      // heads and 1 KV head (tp 2: the KV head replicated).
                      Case{"odd-linear", kOddLinear, 1, engine::ShardLayout::kStriped, 2},
                      Case{"odd-linear", kOddLinear, 2, engine::ShardLayout::kStriped, 2},
                      Case{"odd-linear", kOddLinear, 3, engine::ShardLayout::kContiguous, 2},
                      Case{"odd-dynamic", kOddDynamic, 1, engine::ShardLayout::kStriped, 4},
                      Case{"odd-dynamic", kOddDynamic, 2, engine::ShardLayout::kStriped, 2},
                      Case{"kjv-tiny", "models/kjv-tiny", 2, engine::ShardLayout::kStriped, 2},
                      // yarn (4 heads, 2 KV heads): uneven shards of the 40-token prompt, and
                      // tp 2 x a ring of 2.
                      Case{"odd-yarn", kOddYarn, 3, engine::ShardLayout::kStriped},
                      Case{"odd-yarn", kOddYarn, 2, engine::ShardLayout::kStriped, 2}),
    [](const auto& info) {
      std::string s = std::string(info.param.fixture) + "_" + std::to_string(info.param.world) +
                      "_" + engine::shard_layout_name(info.param.layout) +
                      (info.param.tp > 1 ? "_tp" + std::to_string(info.param.tp) : "");
      for (char& ch : s) ch = ch == '-' ? '_' : ch;
      return s;
    });

}  // namespace
}  // namespace burst::models
