// Prefix caching, below the process level: the planner's index (PrefixCache: hash chain, exact
// comparison, references, LRU order with children before parents), the ranks' page sharing
// (PagedKvCache: publish, adopt, evict, reference-counted pages, poisoned free pages), and the
// planner's use of both (hits, publishing prompt and generated blocks, the page ledger through
// eviction). The same requests served from the cache and cold give the same tokens: process
// tests in tests/server/test_prefix_cache.py.
#include <gtest/gtest.h>

#include <cmath>
#include <deque>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/kv_pages.h"
#include "engine/sharding.h"
#include "frontend/planner.h"
#include "frontend/prefix_cache.h"
#include "frontend/scheduler.h"
#include "models/llama.h"
#include "runtime/driver.h"

namespace burst::server {
namespace {

std::vector<int32_t> ids(std::initializer_list<int32_t> v) { return v; }

TEST(PrefixCache, MatchesTheLongestCachedChainExactly) {
  PrefixCache c(2);
  const auto a = c.insert(-1, ids({5, 6}).data());
  ASSERT_TRUE(a.second);
  const auto b = c.insert(a.first, ids({7, 8}).data());
  ASSERT_TRUE(b.second);
  EXPECT_EQ(c.match({5, 6, 7, 8, 9}, 10), (std::vector<int64_t>{a.first, b.first}));
  EXPECT_EQ(c.match({5, 6, 7, 8, 9}, 1), (std::vector<int64_t>{a.first}));
  EXPECT_EQ(c.match({5, 6, 7}, 10), (std::vector<int64_t>{a.first}));  // a partial block: no
  EXPECT_TRUE(c.match({5, 7, 7, 8}, 10).empty());
  // The same ids after another prefix are another block.
  EXPECT_EQ(c.match({1, 2, 7, 8}, 10), std::vector<int64_t>{});
  // Inserting an equal block gives its id back (held once more).
  const auto again = c.insert(-1, ids({5, 6}).data());
  EXPECT_FALSE(again.second);
  EXPECT_EQ(again.first, a.first);
  EXPECT_EQ(c.refs(a.first), 2);
  EXPECT_EQ(c.references(), 3);
}

TEST(PrefixCache, EvictsUnreferencedLeastRecentlyUsedChildrenFirst) {
  PrefixCache c(1);
  const int32_t t[] = {1, 2, 3, 4};
  const int64_t x = c.insert(-1, &t[0]).first, y = c.insert(x, &t[1]).first;
  const int64_t z = c.insert(-1, &t[2]).first;
  EXPECT_EQ(c.evictable(), 0);
  EXPECT_TRUE(c.evict(3).empty()) << "every block is held";
  c.release({x, y});  // one sequence's chain ends
  c.release({z});     // later
  EXPECT_EQ(c.evictable(), 3);
  // x and y were released together: y (x's child) first, then x, then z (more recent).
  EXPECT_EQ(c.evict(2), (std::vector<int64_t>{y, x}));
  EXPECT_FALSE(c.contains(x));
  EXPECT_TRUE(c.match({1, 2}, 5).empty());
  // A block held again is not evicted.
  c.acquire({z});
  EXPECT_TRUE(c.evict(1).empty());
  c.release({z});
  EXPECT_EQ(c.evict(5), std::vector<int64_t>{z});
  EXPECT_EQ(c.size(), 0);
}

TEST(PrefixCache, HashCollisionsNeverGiveAWrongBlock) {
  // Many random blocks: every match is exact, whatever the buckets.
  PrefixCache c(3);
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> blocks;
  for (int i = 0; i < 2000; ++i) {
    std::vector<int32_t> b = {static_cast<int32_t>(rng() % 7), static_cast<int32_t>(rng() % 7),
                              static_cast<int32_t>(rng() % 7)};
    c.insert(-1, b.data());
    blocks.push_back(b);
  }
  for (const auto& b : blocks) {
    const auto m = c.match(b, 1);
    ASSERT_EQ(m.size(), 1u);
    const auto again = c.insert(-1, b.data());
    EXPECT_EQ(again.first, m[0]);
    EXPECT_FALSE(again.second);
  }
  EXPECT_LE(c.size(), 343);
}

// The ranks' side: pages shared by sequences and blocks.
TEST(PrefixPages, PublishAdoptEvictCountReferences) {
  auto backend = engine::make_cpu_backend();
  auto made = engine::PagedKvCache::create(*backend, {1, 2, 1, 8}, /*pages=*/8, /*page_size=*/4);
  ASSERT_TRUE(made.ok()) << made.message();
  engine::PagedKvCache& c = *made.value();
  ASSERT_TRUE(c.reserve(1, 10).ok());
  c.commit(1);
  EXPECT_FALSE(c.publish(1, 2, 100).ok()) << "page 2 holds 2 of 4 rows";
  ASSERT_TRUE(c.publish(1, 0, 100).ok());
  ASSERT_TRUE(c.publish(1, 1, 101).ok());
  EXPECT_FALSE(c.publish(1, 1, 101).ok()) << "a block id is unique";
  const std::vector<int32_t> first(c.pages(1).begin(), c.pages(1).begin() + 2);
  // A new sequence starts from both blocks: their pages, 8 committed rows, no page taken.
  const int64_t free_before = c.free_pages();
  ASSERT_TRUE(c.adopt(2, {100, 101}).ok());
  EXPECT_EQ(c.free_pages(), free_before);
  EXPECT_EQ(c.length(2), 8);
  EXPECT_EQ(c.pages(2), first);
  EXPECT_FALSE(c.adopt(2, {100}).ok()) << "only a new sequence adopts";
  EXPECT_FALSE(c.adopt(3, {100, 999}).ok()) << "an unknown block";
  EXPECT_EQ(c.length(3), 0);
  // It grows on a page of its own.
  ASSERT_TRUE(c.reserve(2, 1).ok());
  c.commit(2);
  EXPECT_EQ(c.pages(2).size(), 3u);
  EXPECT_EQ(c.free_pages(), free_before - 1);
  // The first sequence ends: its third page goes, the blocks' pages stay (sequence 2 and the
  // blocks hold them).
  c.release(1);
  EXPECT_EQ(c.free_pages(), free_before);
  EXPECT_EQ(c.usage().cached_pages, 0) << "sequence 2 reads both blocks";
  c.release(2);
  EXPECT_EQ(c.usage().cached_pages, 2);
  EXPECT_EQ(c.usage().blocks, 2);
  EXPECT_EQ(c.free_pages(), 8 - 2);
  ASSERT_TRUE(c.evict(100).ok());
  EXPECT_FALSE(c.evict(100).ok());
  ASSERT_TRUE(c.evict(101).ok());
  EXPECT_EQ(c.free_pages(), 8);
  EXPECT_EQ(c.usage().used_pages, 0);
}

TEST(PrefixPages, FreedPagesArePoisonedWhenAsked) {
  auto backend = engine::make_cpu_backend();
  auto made = engine::PagedKvCache::create(*backend, {1, 1, 1, 4}, /*pages=*/2, /*page_size=*/2);
  ASSERT_TRUE(made.ok()) << made.message();
  engine::PagedKvCache& c = *made.value();
  c.set_poison_freed(true);
  ASSERT_TRUE(c.reserve(1, 2).ok());
  auto k = backend->alloc({2, 4}, engine::DType::kF32).take();
  auto v = backend->alloc({2, 4}, engine::DType::kF32).take();
  ASSERT_TRUE(backend->fill_random(k, 1, 1.f).ok());
  ASSERT_TRUE(backend->fill_random(v, 2, 1.f).ok());
  ASSERT_TRUE(c.write(1, 0, 0, k, v).ok());
  c.commit(1);
  ASSERT_TRUE(c.publish(1, 0, 7).ok());
  const int32_t page = c.pages(1)[0];
  c.release(1);
  const float* pool = c.k_pool(0).as<float>() + page * 2 * 4;
  EXPECT_FALSE(std::isnan(pool[0])) << "the block still holds the page";
  ASSERT_TRUE(c.evict(7).ok());
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isnan(pool[i])) << i;
}

// The striped layout: a position's rank and row do not depend on the chunking.
TEST(PrefixPages, StripedLayoutIsTheSameForAnyChunking) {
  std::mt19937 rng(9);
  for (int world : {1, 2, 3, 4}) {
    for (int trial = 0; trial < 50; ++trial) {
      const int64_t total = 1 + static_cast<int64_t>(rng() % 300);
      std::vector<int64_t> rows(static_cast<size_t>(world), 0);
      for (int64_t start = 0; start < total;) {
        const int64_t len = std::min<int64_t>(1 + static_cast<int64_t>(rng() % 40), total - start);
        const auto plan = engine::ShardPlan::make(engine::ShardLayout::kStriped, len, world, start);
        for (int r = 0; r < world; ++r) {
          for (const auto& sg : plan.segments(r)) {
            for (int64_t i = 0; i < plan.real_len(sg); ++i) {
              const int64_t p = sg.position(i);
              ASSERT_EQ(p % world, r);
              ASSERT_EQ(p / world, rows[static_cast<size_t>(r)]) << "local row of " << p;
              ++rows[static_cast<size_t>(r)];
              int64_t row = -1;
              ASSERT_EQ(plan.owner(p, &row), r);
              ASSERT_EQ(row, sg.row + i);
            }
          }
        }
        start += len;
      }
    }
  }
}

// One rank in this process: a sequence published as blocks, released, and a new sequence that
// starts from them draws the token a cold run draws; plans that misuse blocks are refused
// before anything runs.
TEST(PrefixPages, ReusedBlocksGiveTheColdTokenAndBadPlansAreRefused) {
  auto backend = engine::make_cpu_backend();
  auto model = models::LlamaModel::load(
      *backend, std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-linear/model");
  ASSERT_TRUE(model.ok()) << model.message();
  auto made = runtime::LocalStepRunner::create(*model.value(), 512, /*page_size=*/16);
  ASSERT_TRUE(made.ok()) << made.message();
  runtime::LocalStepRunner& run = *made.value();
  std::vector<int32_t> prompt;
  for (int i = 0; i < 45; ++i) prompt.push_back(static_cast<int32_t>(5 + (i * 37) % 4000));
  auto greedy = [&](uint64_t id, int64_t start, std::vector<int64_t> reuse,
                    std::vector<runtime::PublishBlock> publish) -> Result<int32_t> {
    runtime::StepPlan p;
    p.publish = std::move(publish);
    runtime::SeqWork w = runtime::prefill_work(id, prompt, start,
                                               static_cast<int64_t>(prompt.size()) - start, {});
    w.reuse = std::move(reuse);
    p.seqs.push_back(w);
    auto r = run.run_step(p, nullptr);
    if (!r.ok()) return r.status();
    return r.value().tokens.at(0).token;
  };
  auto cold = greedy(1, 0, {}, {});
  ASSERT_TRUE(cold.ok()) << cold.message();
  // Sequence 1's pages 0 and 1 (tokens 0-31) become blocks 7 and 8; it is released.
  runtime::StepPlan keep;
  keep.publish = {{1, 0, 7}, {1, 1, 8}};
  keep.release = {1};
  ASSERT_TRUE(run.run_step(keep, nullptr).ok());
  runtime::BatchRunner& b = run.batch();
  auto refused = [&](runtime::StepPlan p, const std::string& why) {
    const Status st = b.validate(p);
    EXPECT_FALSE(st.ok()) << why;
    EXPECT_NE(st.message().find(why), std::string::npos) << st.message();
  };
  runtime::StepPlan bad;
  bad.seqs.push_back(runtime::prefill_work(2, prompt, 32, 13, {}));
  bad.seqs[0].reuse = {7, 8};
  bad.layout = engine::ShardLayout::kZigzag;
  refused(bad, "striped");
  bad.layout = engine::ShardLayout::kStriped;
  bad.seqs[0].reuse = {7, 7};
  refused(bad, "twice");
  bad.seqs[0].reuse = {7, 9};
  refused(bad, "no prefix block 9");
  bad.seqs[0].reuse = {7};
  refused(bad, "starts at position 32, its next is 16");
  bad.seqs[0].reuse = {7, 8};
  bad.evict = {8};
  refused(bad, "no prefix block 8");
  bad.evict = {99};
  refused(bad, "none to evict");
  runtime::StepPlan early;
  early.publish = {{2, 0, 10}};
  refused(early, "not full");
  // Sequence 2 starts after both blocks: only tokens 32-44 are computed, the same token drawn.
  auto warm = greedy(2, 32, {7, 8}, {});
  ASSERT_TRUE(warm.ok()) << warm.message();
  EXPECT_EQ(warm.value(), cold.value());
  EXPECT_EQ(b.ring().cache().usage().blocks, 2);
}

// The planner with prefix caching.
constexpr int32_t kEos = 2;

struct Requests {
  std::deque<ScheduledRequest> all;
  const ScheduledRequest& make(std::vector<int32_t> prompt, int max_tokens) {
    ScheduledRequest r;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    all.push_back(std::move(r));
    return all.back();
  }
};

std::vector<int32_t> doc(int64_t n, int32_t seed) {
  std::vector<int32_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(static_cast<int32_t>(3 + (i * 7 + seed) % 300));
  return v;
}

PlannerOptions caching_options(int world, int64_t chunk) {
  PlannerOptions o;
  o.world = world;
  o.prefill_chunk = chunk;
  o.max_batched_tokens = chunk + 8;
  o.max_running = 8;
  return o;
}

// Runs plans with token `t` drawn for every sampled row until nothing runs, checking the
// ledger after each: free + reserved + cache pages = all pages, on every rank.
void run_all(Planner& p, int64_t pages, int32_t t = 9) {
  for (int i = 0; i < 1000 && (p.running() > 0); ++i) {
    const Planner::Plan plan = p.plan();
    std::vector<runtime::SampledToken> out;
    for (const auto& w : plan.step.seqs) {
      if (w.sample) out.push_back({w.id, t, false, 0.f, {}});
    }
    p.update(plan, out, kEos);
    for (size_t r = 0; r < p.free_pages().size(); ++r) {
      int64_t reserved = 0;
      for (uint64_t id = 1; id < 100; ++id) {
        if (const auto* s = p.find(id)) reserved += s->pages[r];
      }
      ASSERT_EQ(p.free_pages()[r] + reserved + p.cached_pages(), pages) << "rank " << r;
    }
  }
  ASSERT_EQ(p.running(), 0u);
}

TEST(PlannerPrefix, SecondRequestStartsAfterTheCachedBlocks) {
  Requests rq;
  Planner p(caching_options(2, 64));
  p.reset(/*pages=*/100, /*page_size=*/4);  // blocks of 8 tokens
  ASSERT_TRUE(p.caching());
  std::vector<int32_t> a = doc(45, 1);
  std::vector<int> drawn;
  std::vector<int64_t> need;
  ASSERT_EQ(p.fits(rq.make(a, 3), &need), Planner::Fit::kNow);
  const uint64_t first = p.admit(rq.all.back(), need);
  EXPECT_EQ(p.find(first)->cached, 0);
  // Its prefill (45 tokens: 5 full blocks) publishes 5 blocks with the next plan.
  Planner::Plan plan = p.plan();
  ASSERT_EQ(plan.step.seqs.size(), 1u);
  EXPECT_TRUE(plan.step.seqs[0].reuse.empty());
  p.update(plan, {{first, 9, false, 0.f, {}}}, kEos);
  plan = p.plan();
  ASSERT_EQ(plan.step.publish.size(), 5u);
  for (int64_t k = 0; k < 5; ++k) {
    EXPECT_EQ(plan.step.publish[static_cast<size_t>(k)].seq, first);
    EXPECT_EQ(plan.step.publish[static_cast<size_t>(k)].index, k);
  }
  // The decode steps feed tokens 45, 46, ...: block 5 (tokens 40-47) is full after 46 and 47
  // are fed (its last draw is not fed): max_tokens 3 feeds positions 45 and 46 only.
  p.update(plan, {{first, 10, false, 0.f, {}}}, kEos);
  plan = p.plan();
  p.update(plan, {{first, 11, false, 0.f, {}}}, kEos);
  EXPECT_EQ(p.find(first), nullptr) << "ended by max_tokens";
  plan = p.plan();
  EXPECT_TRUE(plan.step.publish.empty()) << "block 5 holds 47 of 48 computed tokens";
  ASSERT_EQ(plan.step.release, std::vector<uint64_t>{first});
  EXPECT_EQ(p.cached_pages(), 5);

  // A question after the same 45 tokens: 40 of them (5 blocks) from the cache.
  std::vector<int32_t> q = a;
  for (int32_t t : {77, 78, 79}) q.push_back(t);
  ASSERT_EQ(p.fits(rq.make(q, 2), &need), Planner::Fit::kNow);
  const uint64_t second = p.admit(rq.all.back(), need);
  EXPECT_EQ(p.find(second)->cached, 40);
  plan = p.plan();
  ASSERT_EQ(plan.step.seqs.size(), 1u);
  EXPECT_EQ(plan.step.seqs[0].start, 40);
  EXPECT_EQ(plan.step.seqs[0].tokens.size(), 8u);
  EXPECT_EQ(plan.step.seqs[0].reuse.size(), 5u);
  EXPECT_EQ(p.cached_pages(), 5) << "held by a sequence, still cache pages";
  EXPECT_EQ(p.prefix_cache().evictable(), 0);
  // A prompt that IS a cached prefix still computes its last block (its logits).
  std::vector<int32_t> exact(a.begin(), a.begin() + 40);
  ASSERT_EQ(p.fits(rq.make(exact, 1), &need), Planner::Fit::kNow);
  const uint64_t third = p.admit(rq.all.back(), need);
  EXPECT_EQ(p.find(third)->cached, 32);
  run_all(p, 100);
  EXPECT_EQ(p.prefix_cache().references(), 0);
}

TEST(PlannerPrefix, MultiTurnHitsTheGeneratedTokens) {
  Requests rq;
  Planner p(caching_options(1, 16));
  p.reset(100, 4);  // blocks of 4 tokens
  std::vector<int32_t> turn1 = doc(10, 2);
  std::vector<int64_t> need;
  ASSERT_EQ(p.fits(rq.make(turn1, 8), &need), Planner::Fit::kNow);
  p.admit(rq.all.back(), need);
  run_all(p, 100, /*t=*/42);  // 8 tokens of 42: positions 10..17, 10..16 fed
  // The next turn: the history, the answer, a new message.
  std::vector<int32_t> turn2 = turn1;
  for (int i = 0; i < 8; ++i) turn2.push_back(42);
  for (int32_t t : {50, 51, 52, 53, 54}) turn2.push_back(t);
  ASSERT_EQ(p.fits(rq.make(turn2, 1), &need), Planner::Fit::kNow);
  const uint64_t id = p.admit(rq.all.back(), need);
  EXPECT_EQ(p.find(id)->cached, 16) << "17 tokens computed: 4 full blocks";
  run_all(p, 100);
}

TEST(PlannerPrefix, EvictsOnlyUnheldBlocksWhenPagesRunOut) {
  Requests rq;
  Planner p(caching_options(1, 64));
  p.reset(/*pages=*/12, /*page_size=*/4);
  std::vector<int64_t> need;
  // Two documents of 5 blocks each fill 10 of 12 pages with cache blocks.
  for (int32_t seed : {1, 2}) {
    ASSERT_EQ(p.fits(rq.make(doc(21, seed), 1), &need), Planner::Fit::kNow);
    p.admit(rq.all.back(), need);
    run_all(p, 12);
  }
  EXPECT_EQ(p.cached_pages(), 10);
  EXPECT_EQ(p.free_pages()[0], 2);
  // A request on document 2 holds its 5 blocks (and takes 1 page); a new 16-token request
  // needs 5 pages, 1 free: only document 1's blocks may go (4 of them, least recently used
  // first).
  std::vector<int32_t> q = doc(21, 2);
  q.push_back(5);
  ASSERT_EQ(p.fits(rq.make(q, 2), &need), Planner::Fit::kNow);
  const uint64_t held = p.admit(rq.all.back(), need);
  EXPECT_EQ(p.find(held)->cached, 20);
  ASSERT_EQ(p.fits(rq.make(doc(16, 3), 1), &need), Planner::Fit::kNow);
  p.admit(rq.all.back(), need);
  const Planner::Plan plan = p.plan();
  EXPECT_EQ(plan.step.evict.size(), 4u);
  for (int64_t id : plan.step.evict) EXPECT_GT(id, 0);
  EXPECT_EQ(p.prefix_cache().match(doc(21, 2), 10).size(), 5u) << "held blocks stay";
  EXPECT_EQ(p.prefix_cache().match(doc(21, 1), 10).size(), 1u) << "document 1's first block";
  // Nothing more can be evicted while document 2's blocks are held: a 40-token request waits.
  ASSERT_EQ(p.fits(rq.make(doc(40, 4), 1), &need), Planner::Fit::kLater);
}

TEST(PlannerPrefix, PromptLogprobsAndRepetitionPenaltyComputeEveryRow) {
  Requests rq;
  Planner p(caching_options(2, 64));
  p.reset(100, 4);
  std::vector<int64_t> need;
  ASSERT_EQ(p.fits(rq.make(doc(33, 1), 1), &need), Planner::Fit::kNow);
  p.admit(rq.all.back(), need);
  run_all(p, 100);
  ScheduledRequest lp;
  lp.prompt = doc(33, 1);
  lp.max_tokens = 1;
  lp.prompt_logprobs = 0;
  rq.all.push_back(lp);
  ASSERT_EQ(p.fits(rq.all.back(), &need), Planner::Fit::kNow);
  EXPECT_EQ(p.find(p.admit(rq.all.back(), need))->cached, 0);
  ScheduledRequest rep = lp;
  rep.prompt_logprobs = -1;
  rep.adjust.repetition_penalty = 1.2f;
  rq.all.push_back(rep);
  ASSERT_EQ(p.fits(rq.all.back(), &need), Planner::Fit::kNow);
  EXPECT_EQ(p.find(p.admit(rq.all.back(), need))->cached, 0);
  rep.adjust.repetition_penalty = 1.f;
  rq.all.push_back(rep);
  ASSERT_EQ(p.fits(rq.all.back(), &need), Planner::Fit::kNow);
  EXPECT_EQ(p.find(p.admit(rq.all.back(), need))->cached, 32);
  run_all(p, 100);
}

TEST(PlannerPrefix, OffWithoutTheStripedLayoutOrWhenAsked) {
  for (bool zigzag : {true, false}) {
    PlannerOptions o = caching_options(2, 64);
    if (zigzag) o.layout = engine::ShardLayout::kZigzag;
    else o.prefix_caching = false;
    Planner p(o);
    p.reset(100, 4);
    EXPECT_FALSE(p.caching());
    Requests rq;
    std::vector<int64_t> need;
    for (int i = 0; i < 2; ++i) {
      ASSERT_EQ(p.fits(rq.make(doc(40, 1), 1), &need), Planner::Fit::kNow);
      const uint64_t id = p.admit(rq.all.back(), need);
      EXPECT_EQ(p.find(id)->cached, 0);
      run_all(p, 100);
    }
    EXPECT_EQ(p.cached_pages(), 0);
  }
}

}  // namespace
}  // namespace burst::server
