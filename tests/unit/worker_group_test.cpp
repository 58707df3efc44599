// The worker group as burst-generate and burst-server use it: real burst-worker processes
// joined over Gloo. Greedy tokens are identical for 1..4 workers (and equal to the in-process
// engine); a worker SIGKILLed mid-prefill fails the request with a clear error within seconds
// (no hang), the group reports unhealthy, restart() brings it back, and the next request works.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <cstdio>
#include <thread>

#include "engine/backend.h"
#include "runtime/driver.h"
#include "engine/sharding.h"
#include "frontend/scheduler.h"  // kv_pages_needed
#include "group/worker_group.h"

namespace burst::server {
namespace {

const std::string kModel =
    std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-linear/model";

WorkerGroupOptions options(int workers, int64_t capacity) {
  WorkerGroupOptions o;
  o.worker_binary = std::string(BURST_BINARY_DIR) + "/bin/burst-worker";
  o.model.dir = kModel;
  o.workers = workers;
  o.kv_capacity = capacity;
  o.threads_per_worker = 1;
  return o;
}

std::vector<int32_t> prompt_of(int n, int vocab) {
  std::vector<int32_t> p = {1};
  for (int i = 1; i < n; ++i) p.push_back(3 + (i * 7919) % (vocab - 3));
  return p;
}

// A GPU rank's KV pool sized from its memory: the free bytes less (1 - fraction) of the
// device and the activations' reserve, in whole pages; nothing when less than a page is left.
TEST(WorkerGroup, KvRowsFromMemory) {
  const int64_t gib = int64_t{1} << 30, row = 512 * 1024, page = 256;  // the 7B's 512 KiB/token
  // An H200 after the 7B's weights: 128 GiB free of 140, 90 %, 8 GiB reserve.
  const int64_t rows = engine::kv_rows_from_memory(128 * gib, 140 * gib, 0.9, 8 * gib, row, page);
  const int64_t budget = 128 * gib - static_cast<int64_t>(0.1 * 140 * gib) - 8 * gib;
  EXPECT_EQ(rows, budget / row / page * page);
  EXPECT_EQ(rows % page, 0);
  EXPECT_GT(rows, 200000);  // room for a 128K prompt and more beside it
  EXPECT_LE(rows * row, budget);
  // Fraction 1 leaves nothing to others; a reserve larger than what is left gives nothing.
  EXPECT_EQ(engine::kv_rows_from_memory(10 * gib, 80 * gib, 1.0, 0, row, page),
            10 * gib / row / page * page);
  EXPECT_EQ(engine::kv_rows_from_memory(10 * gib, 80 * gib, 0.9, 3 * gib, row, page), 0);
  EXPECT_EQ(engine::kv_rows_from_memory(row * (page - 1), row * page, 1.0, 0, row, page), 0);
  EXPECT_EQ(engine::kv_rows_from_memory(10 * gib, 80 * gib, 1.0, 0, 0, page), 0);
}

// Admission with a smaller chunk while others decode (Scheduler's prefill_chunk_decoding): a
// prompt is cut in any mix of the two sizes (both multiples of 2 x ranks), and the pages
// reserved (kv_pages_needed with mixed_chunks) must hold what every rank caches for any such
// mix. Random mixes against the exact rows of each chunk's ShardPlan.
TEST(WorkerGroup, KvPagesHoldAnyMixOfChunkSizes) {
  std::mt19937 rng(5);
  for (int world : {1, 2, 3, 4}) {
    for (auto layout : {engine::ShardLayout::kStriped, engine::ShardLayout::kZigzag,
                        engine::ShardLayout::kContiguous}) {
      const int64_t small = 4 * world, full = 12 * world;  // multiples of 2 x ranks
      for (int trial = 0; trial < 200; ++trial) {
        const int64_t prompt = 1 + static_cast<int64_t>(rng() % 400);
        std::vector<int64_t> rows(static_cast<size_t>(world), 0);
        for (int64_t start = 0; start < prompt;) {
          const int64_t len = std::min(rng() % 2 ? small : full, prompt - start);
          const auto plan = engine::ShardPlan::make(layout, len, world, start);
          for (int r = 0; r < world; ++r) rows[static_cast<size_t>(r)] += plan.real_rows(r);
          start += len;
        }
        const int page = 16;
        const auto pages = kv_pages_needed(prompt, 1, full, world, layout, page, true);
        for (int r = 0; r < world; ++r) {
          // The prompt rows cached, plus this rank's decode rows (at most one for 1 token).
          ASSERT_LE((rows[static_cast<size_t>(r)] + page - 1) / page, pages[static_cast<size_t>(r)])
              << "world " << world << " prompt " << prompt << " rank " << r;
        }
      }
    }
  }
}

TEST(WorkerGroup, GreedyTokensIdenticalForOneToFourWorkers) {
  runtime::GenerateRequest req;
  req.prompt = prompt_of(53, 4099);
  req.max_tokens = 16;
  req.stop_at_eos = false;
  // The in-process engine is the reference.
  auto backend = engine::make_cpu_backend();
  auto model = models::LlamaModel::load(*backend, kModel);
  ASSERT_TRUE(model.ok()) << model.message();
  auto local = runtime::LocalStepRunner::create(*model.value(), 128);
  ASSERT_TRUE(local.ok()) << local.message();
  std::vector<int32_t> want;
  ASSERT_TRUE(runtime::generate(*local.value(), req, [&](int32_t t) {
                want.push_back(t);
                return true;
              }).ok());
  ASSERT_EQ(want.size(), 16u);
  for (int n = 1; n <= 4; ++n) {
    for (auto layout : {engine::ShardLayout::kStriped, engine::ShardLayout::kZigzag,
                        engine::ShardLayout::kContiguous}) {
      if (layout != engine::ShardLayout::kStriped && n != 3) continue;
      auto opt = options(n, 128);
      opt.layout = layout;
      auto group = WorkerGroup::start(opt);
      ASSERT_TRUE(group.ok()) << group.message();
      std::vector<int32_t> got;
      auto r = runtime::generate(*group.value(), req, [&](int32_t t) {
        got.push_back(t);
        return true;
      });
      ASSERT_TRUE(r.ok()) << n << " workers: " << r.message();
      EXPECT_EQ(got, want) << n << " workers";
      EXPECT_EQ(r.value().finish_reason, runtime::FinishReason::kLength);
      EXPECT_EQ(r.value().prompt_tokens, 53);
    }
  }
}

TEST(WorkerGroup, CancelStopsEveryRankAndTheGroupStaysUsable) {
  auto group = WorkerGroup::start(options(2, 256));
  ASSERT_TRUE(group.ok()) << group.message();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(20, 4099);
  req.max_tokens = 200;
  req.stop_at_eos = false;
  int seen = 0;
  auto r = runtime::generate(*group.value(), req, [&](int32_t) { return ++seen < 5; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().finish_reason, runtime::FinishReason::kCancelled);
  EXPECT_LT(seen, 10);
  seen = 0;
  req.max_tokens = 7;
  r = runtime::generate(*group.value(), req, [&](int32_t) { return ++seen, true; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(seen, 7);
  EXPECT_TRUE(group.value()->healthy());
}

// Progress arrives after every prefill layer (odd-linear has 3), before any token; a cancel
// from the progress callback stops a long prefill at the next layer on every rank, and the
// group serves the next request.
TEST(WorkerGroup, PrefillProgressPerLayerAndCancelMidPrefill) {
  auto group = WorkerGroup::start(options(2, 9000));
  ASSERT_TRUE(group.ok()) << group.message();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(40, 4099);
  req.max_tokens = 3;
  req.stop_at_eos = false;
  std::vector<double> seen;
  int tokens = 0;
  auto r = runtime::generate(*group.value(), 
      req, [&](int32_t) { return ++tokens, true; },
      [&](double f) {
        EXPECT_EQ(tokens, 0) << "progress comes before the first token";
        seen.push_back(f);
        return true;
      });
  ASSERT_TRUE(r.ok()) << r.message();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_NEAR(seen[0], 1.0 / 3, 1e-9);
  EXPECT_NEAR(seen[1], 2.0 / 3, 1e-9);
  EXPECT_EQ(seen[2], 1.0);
  EXPECT_EQ(tokens, 3);

  req.prompt = prompt_of(8000, 4099);  // seconds of CPU prefill
  tokens = 0;
  int calls = 0;
  const auto t0 = std::chrono::steady_clock::now();
  r = runtime::generate(*group.value(), req, [&](int32_t) { return ++tokens, true; },
                              [&](double) { return ++calls < 1; });  // cancel at layer 1
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().finish_reason, runtime::FinishReason::kCancelled);
  EXPECT_EQ(tokens, 0);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(group.value()->healthy());
  std::printf("[ info     ] cancelled after layer 1 of 3 in %.2f s\n", s);
  req.prompt = prompt_of(30, 4099);
  r = runtime::generate(*group.value(), req, [&](int32_t) { return ++tokens, true; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(tokens, 3);
}

TEST(WorkerGroup, KilledWorkerFailsTheRequestFastAndRestartRecovers) {
  auto group = WorkerGroup::start(options(2, 9000));
  ASSERT_TRUE(group.ok()) << group.message();
  WorkerGroup& g = *group.value();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(8000, 4099);  // seconds of CPU prefill: the kill lands inside it
  req.max_tokens = 8;
  const int victim = g.pids()[1];
  std::thread killer([victim] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(victim, SIGKILL);
  });
  int tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = runtime::generate(g, req, [&](int32_t) { return ++tokens, true; });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  killer.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(tokens, 0) << "the kill was meant to land mid-prefill";
  EXPECT_LT(s, 5.0) << "the coordinator must not wait for the survivors' timeouts";
  EXPECT_NE(r.message().find("worker rank 1"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("signal 9"), std::string::npos) << r.message();
  EXPECT_FALSE(g.healthy());
  // Refused while unhealthy, with the reason.
  auto refused = runtime::generate(g, req, [](int32_t) { return true; });
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("unavailable"), std::string::npos) << refused.message();

  ASSERT_TRUE(g.restart().ok());
  EXPECT_TRUE(g.healthy());
  req.prompt = prompt_of(30, 4099);
  tokens = 0;
  r = runtime::generate(g, req, [&](int32_t) { return ++tokens, true; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(tokens, 8);
}

// A hung (SIGSTOP'ed, not dead) rank: waitpid sees nothing, the survivors would wait for their
// communicator timeout; the heartbeats find it and fail the step within a few seconds.
TEST(WorkerGroup, StoppedWorkerIsFoundByHeartbeatsAndRestartRecovers) {
  auto o = options(2, 9000);
  o.heartbeat_interval = std::chrono::milliseconds(200);
  o.heartbeat_timeout = std::chrono::milliseconds(1000);
  auto group = WorkerGroup::start(o);
  ASSERT_TRUE(group.ok()) << group.message();
  WorkerGroup& g = *group.value();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(8000, 4099);
  req.max_tokens = 8;
  const int victim = g.pids()[1];
  std::thread stopper([victim] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(victim, SIGSTOP);
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto r = runtime::generate(g, req, [](int32_t) { return true; });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stopper.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.code(), StatusCode::kUnavailable);
  EXPECT_LT(s, 4.0) << r.message();
  EXPECT_NE(r.message().find("worker rank 1"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("heartbeat"), std::string::npos) << r.message();
  EXPECT_FALSE(g.healthy());
  ASSERT_TRUE(g.restart().ok());  // kills the stopped rank (SIGCONT + SIGTERM, then SIGKILL)
  EXPECT_NE(kill(victim, 0), 0) << "the stopped rank is gone";
  req.prompt = prompt_of(30, 4099);
  int tokens = 0;
  r = runtime::generate(g, req, [&](int32_t) { return ++tokens, true; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(tokens, 8);
}

// The step deadline: a step running past step_timeout (+ per token) fails the group.
TEST(WorkerGroup, StepPastItsDeadlineFailsTheGroup) {
  auto o = options(2, 9000);
  o.heartbeat_interval = std::chrono::milliseconds(0);  // deadline only
  o.step_timeout = std::chrono::milliseconds(200);
  o.step_ms_per_token = 0;
  auto group = WorkerGroup::start(o);
  ASSERT_TRUE(group.ok()) << group.message();
  WorkerGroup& g = *group.value();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(8000, 4099);  // seconds of CPU prefill
  req.max_tokens = 2;
  auto r = runtime::generate(g, req, [](int32_t) { return true; });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.code(), StatusCode::kUnavailable);
  EXPECT_NE(r.message().find("deadline"), std::string::npos) << r.message();
  EXPECT_FALSE(g.healthy());
  ASSERT_TRUE(g.restart().ok());
  EXPECT_TRUE(g.healthy());
}

// Requests that cannot run are refused before any collective: the group stays healthy and
// serves the next request (a refused request must never look like a broken ring).
TEST(WorkerGroup, RefusedRequestsLeaveTheGroupHealthy) {
  auto group = WorkerGroup::start(options(2, 64));
  ASSERT_TRUE(group.ok()) << group.message();
  WorkerGroup& g = *group.value();
  runtime::GenerateRequest req;
  req.prompt = prompt_of(60, 4099);
  req.max_tokens = 10;  // 70 > 64
  auto r = runtime::generate(g, req, [](int32_t) { return true; });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("KV tokens"), std::string::npos) << r.message();
  req.prompt = prompt_of(10, 4099);
  req.max_tokens = 0;  // reaches the workers, which refuse it
  r = runtime::generate(g, req, [](int32_t) { return true; });
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("max_tokens"), std::string::npos) << r.message();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a dying worker would show
  EXPECT_TRUE(g.healthy());
  req.max_tokens = 4;
  int tokens = 0;
  r = runtime::generate(g, req, [&](int32_t) { return ++tokens, true; });
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(tokens, 4);
}

TEST(WorkerGroup, StartFailureNamesTheRank) {
  auto opt = options(2, 64);
  opt.model.dir = "/nonexistent/model";
  auto group = WorkerGroup::start(opt);
  ASSERT_FALSE(group.ok());
  EXPECT_NE(group.message().find("during start-up"), std::string::npos) << group.message();
}

}  // namespace
}  // namespace burst::server
