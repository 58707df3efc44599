// The scheduling policy without a process (server/frontend/planner.h): plans and fake outcomes.
// Decode rows come first and the token budget bounds a step; a short prompt runs before a long
// prompt's full chunk but never twice in a row; admission follows the page ledger (kv_pages_needed
// is checked against a hand count); a cancel in every phase gives every page back and releases
// the sequence exactly once; EOS, ignore_eos, stop_token_ids (after min_tokens) and max_tokens
// end sequences with the right reason; a prompt-only request (max_tokens 0) ends with its
// prefill, its token discarded; the lookahead feeds kPreviousToken and skips what ends.
#include <gtest/gtest.h>

#include <deque>
#include <vector>

#include "frontend/planner.h"
#include "frontend/scheduler.h"

namespace burst::server {
namespace {

using runtime::FinishReason;
using runtime::SampledToken;

constexpr int32_t kEos = 2;

// Requests live here while the planner runs them (it keeps pointers).
struct Requests {
  std::deque<ScheduledRequest> all;
  const ScheduledRequest& make(int64_t prompt, int max_tokens) {
    ScheduledRequest r;
    for (int64_t i = 0; i < prompt; ++i) r.prompt.push_back(static_cast<int32_t>(100 + i % 50));
    r.max_tokens = max_tokens;
    all.push_back(std::move(r));
    return all.back();
  }
};

PlannerOptions options(int world, int64_t chunk, int64_t budget) {
  PlannerOptions o;
  o.world = world;
  o.prefill_chunk = chunk;
  o.max_batched_tokens = budget;
  o.max_running = 8;
  o.prefix_caching = false;  // tests/unit/prefix_cache_test.cpp tests the planner with it
  return o;
}

uint64_t admit(Planner& p, const ScheduledRequest& r) {
  std::vector<int64_t> need;
  EXPECT_EQ(p.fits(r, &need), Planner::Fit::kNow);
  return p.admit(r, need);
}

// Runs plans with a fake outcome (token `t` for every sampled row) until `id` decodes.
void prefill_all(Planner& p, int32_t t = 7) {
  for (int i = 0; i < 100; ++i) {
    bool prefilling = false;
    for (uint64_t id = 1; id < 100; ++id) {
      const Planner::Seq* s = p.find(id);
      prefilling = prefilling || (s && !s->decoding());
    }
    if (!prefilling) return;
    const Planner::Plan plan = p.plan();
    std::vector<SampledToken> out;
    for (const auto& w : plan.step.seqs) {
      if (w.sample) out.push_back({w.id, t, false, 0.f, {}});
    }
    p.update(plan, out, kEos);
  }
  FAIL() << "prefill did not end";
}

TEST(Planner, DecodeRowsFirstThenPrefillChunksWithinTheBudget) {
  Requests rq;
  Planner p(options(2, 16, 20));
  p.reset(1000, 16);
  const uint64_t a = admit(p, rq.make(10, 8));
  prefill_all(p);  // a decodes now
  const uint64_t b = admit(p, rq.make(40, 8));
  const uint64_t c = admit(p, rq.make(30, 8));
  const Planner::Plan plan = p.plan();
  ASSERT_GE(plan.step.seqs.size(), 2u);
  EXPECT_TRUE(plan.step.seqs[0].decode);
  EXPECT_EQ(plan.step.seqs[0].id, a);
  EXPECT_EQ(plan.step.seqs[0].start, 10);  // the first decode row feeds the prefill's token
  EXPECT_EQ(plan.step.seqs[0].tokens[0], 7);
  // Budget 20: one decode row, then one 16-token chunk (c has fewer tokens left: it goes first);
  // b's chunk would pass the budget and waits.
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].id, c);
  EXPECT_EQ(plan.chunks[0].len, 16);
  int64_t tokens = 0;
  for (const auto& w : plan.step.seqs) tokens += static_cast<int64_t>(w.tokens.size());
  EXPECT_LE(tokens, 20);
  (void)b;
}

TEST(Planner, AStepAlwaysMakesProgressPastTheBudget) {
  Requests rq;
  Planner p(options(1, 0, 4));  // whole prompts, budget 4
  p.reset(1000, 16);
  admit(p, rq.make(50, 4));
  const Planner::Plan plan = p.plan();
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].len, 50);
}

TEST(Planner, ShortPromptRunsBeforeALongChunkButNeverTwiceInARow) {
  Requests rq;
  Planner p(options(2, 32, 1000));
  p.reset(1000, 16);
  const uint64_t long_id = admit(p, rq.make(200, 4));
  const uint64_t short1 = admit(p, rq.make(5, 4));
  Planner::Plan plan = p.plan();
  ASSERT_EQ(plan.chunks.size(), 1u) << "the long prompt's full chunk waits one step";
  EXPECT_EQ(plan.chunks[0].id, short1);
  p.update(plan, {{short1, 9, false, 0.f, {}}}, kEos);
  // Another short prompt arrives: this time the long chunk is not deferred again.
  const uint64_t short2 = admit(p, rq.make(6, 4));
  plan = p.plan();
  bool long_in = false, short2_in = false;
  for (const auto& c : plan.chunks) {
    long_in = long_in || c.id == long_id;
    short2_in = short2_in || c.id == short2;
  }
  EXPECT_TRUE(long_in);
  EXPECT_TRUE(short2_in);
  EXPECT_TRUE(plan.step.seqs[0].decode) << "short1 decodes first";
}

TEST(Planner, KvPagesNeededMatchesAHandCount) {
  // 10 prompt tokens zigzag over 2 ranks (parts of 10/4 -> 3,3,3,1: rank 0 parts 0 and 3,
  // rank 1 parts 1 and 2): 4 + 6 rows; decode positions 10..13: ranks 0,1,0,1 -> 2 each.
  const auto pages = kv_pages_needed(10, 4, 0, 2, engine::ShardLayout::kZigzag, 4);
  std::vector<int64_t> rows(2, 0);
  const auto plan = engine::ShardPlan::make(engine::ShardLayout::kZigzag, 10, 2, 0);
  for (int r = 0; r < 2; ++r) rows[static_cast<size_t>(r)] = plan.real_rows(r) + 2;
  ASSERT_EQ(pages.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(pages[static_cast<size_t>(r)], (rows[static_cast<size_t>(r)] + 3) / 4) << r;
  }
  EXPECT_EQ(rows[0] + rows[1], 14);
}

TEST(Planner, AdmissionFollowsTheLedger) {
  Requests rq;
  Planner p(options(2, 0, 1000));
  p.reset(4, 4);  // 16 rows per rank
  const ScheduledRequest& big = rq.make(20, 4);  // ~12 rows a rank: 3 pages each
  const ScheduledRequest& next = rq.make(12, 4);  // 8 rows a rank: 2 pages each
  const ScheduledRequest& never = rq.make(40, 2);  // 21 rows a rank: more than a rank holds
  std::vector<int64_t> need;
  EXPECT_EQ(p.fits(never, &need), Planner::Fit::kNever);
  const uint64_t a = admit(p, big);
  EXPECT_EQ(p.fits(next, &need), Planner::Fit::kLater);
  p.finish(a);
  EXPECT_EQ(p.free_pages(), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(p.fits(next, &need), Planner::Fit::kNow);
  const Planner::Plan plan = p.plan();
  EXPECT_EQ(plan.step.release, std::vector<uint64_t>{a});
}

TEST(Planner, MaxRunningBoundsTheBatch) {
  Requests rq;
  PlannerOptions o = options(1, 0, 1000);
  o.max_running = 2;
  Planner p(o);
  p.reset(1000, 16);
  admit(p, rq.make(3, 2));
  EXPECT_FALSE(p.full());
  admit(p, rq.make(3, 2));
  EXPECT_TRUE(p.full());
}

// Cancelled while prefilling (between two chunks), while decoding, and with a lookahead step in
// flight: every page comes back, the release goes out once, late tokens are dropped.
TEST(Planner, CancelInEveryPhaseGivesThePagesBackAndReleasesOnce) {
  Requests rq;
  PlannerOptions o = options(2, 8, 1000);
  Planner p(o);
  p.reset(100, 4);
  const std::vector<int64_t> empty = p.free_pages();
  const uint64_t a = admit(p, rq.make(20, 6));
  Planner::Plan plan = p.plan();
  p.update(plan, {}, kEos);  // first chunk done, no sample yet
  EXPECT_EQ(p.find(a)->prefilled, 8);
  p.finish(a);  // cancelled mid-prefill
  EXPECT_EQ(p.free_pages(), empty);
  plan = p.plan();
  EXPECT_EQ(plan.step.release, std::vector<uint64_t>{a});
  EXPECT_TRUE(plan.step.seqs.empty());
  EXPECT_TRUE(p.plan().step.release.empty()) << "released once";

  const uint64_t b = admit(p, rq.make(6, 10));
  prefill_all(p);
  plan = p.plan();  // b decodes
  ASSERT_TRUE(p.can_look_ahead(plan, true));
  EXPECT_FALSE(p.can_look_ahead(plan, false)) << "a waiting request joins the next plan";
  const Planner::Plan ahead = p.continue_decode(plan);
  ASSERT_EQ(ahead.step.seqs.size(), 1u);
  EXPECT_EQ(ahead.step.seqs[0].tokens[0], runtime::kPreviousToken);
  EXPECT_EQ(ahead.step.seqs[0].start, plan.step.seqs[0].start + 1);
  p.update(plan, {{b, 11, false, 0.f, {}}}, kEos);
  p.finish(b);  // cancelled while decoding, the lookahead step in flight
  const Planner::Update late = p.update(ahead, {{b, 12, false, 0.f, {}}}, kEos);
  EXPECT_EQ(late.dropped, 1u);
  EXPECT_TRUE(late.tokens.empty());
  EXPECT_EQ(p.free_pages(), empty);
  EXPECT_EQ(p.plan().step.release, std::vector<uint64_t>{b});
}

TEST(Planner, StopTokensAndLengthEndSequencesWithTheirReason) {
  Requests rq;
  Planner p(options(1, 0, 1000));
  p.reset(1000, 16);
  const uint64_t eos = admit(p, rq.make(4, 10));
  ScheduledRequest& ignore_r = const_cast<ScheduledRequest&>(rq.make(4, 3));
  ignore_r.ignore_eos = true;
  const uint64_t ignore = admit(p, ignore_r);
  ScheduledRequest& ids_r = const_cast<ScheduledRequest&>(rq.make(4, 10));
  ids_r.stop_token_ids = {42};
  ids_r.adjust.min_tokens = 2;
  const uint64_t ids = admit(p, ids_r);
  Planner::Plan plan = p.plan();
  Planner::Update u = p.update(plan, {{eos, kEos, false, 0.f, {}},
                                      {ignore, kEos, false, 0.f, {}},
                                      {ids, 42, false, 0.f, {}}},
                               kEos);
  ASSERT_EQ(u.tokens.size(), 3u);
  EXPECT_TRUE(u.tokens[0].ends);
  EXPECT_TRUE(u.tokens[0].is_stop);
  EXPECT_EQ(u.tokens[0].reason, FinishReason::kStop);
  EXPECT_FALSE(u.tokens[1].ends) << "ignore_eos";
  EXPECT_FALSE(u.tokens[2].ends) << "a stop id before min_tokens";
  EXPECT_EQ(p.find(eos), nullptr);
  plan = p.plan();
  EXPECT_EQ(plan.step.release, std::vector<uint64_t>{eos});
  u = p.update(plan, {{ignore, kEos, false, 0.f, {}}, {ids, 42, false, 0.f, {}}}, kEos);
  ASSERT_EQ(u.tokens.size(), 2u);
  EXPECT_FALSE(u.tokens[0].ends);
  EXPECT_FALSE(u.tokens[1].ends) << "min_tokens 2: the 2nd token cannot stop, the 3rd can";
  u = p.update(p.plan(), {{ignore, 5, false, 0.f, {}}, {ids, 42, false, 0.f, {}}}, kEos);
  ASSERT_EQ(u.tokens.size(), 2u);
  EXPECT_TRUE(u.tokens[0].ends);
  EXPECT_FALSE(u.tokens[0].is_stop);
  EXPECT_EQ(u.tokens[0].reason, FinishReason::kLength);
  EXPECT_TRUE(u.tokens[1].ends);
  EXPECT_TRUE(u.tokens[1].is_stop);
  EXPECT_EQ(u.tokens[1].reason, FinishReason::kStop);
  EXPECT_EQ(p.running(), 0u);
}

TEST(Planner, PromptOnlyRequestEndsWithItsPrefill) {
  // max_tokens 0 (echo with the prompt's logprobs): pages for the prompt alone; its chunks
  // carry the prompt logprobs; the token of the last chunk is discarded and it ends "length"
  // with nothing generated, released in the next plan.
  Requests rq;
  Planner p(options(1, 4, 1000));
  p.reset(1000, 4);
  ScheduledRequest& r = const_cast<ScheduledRequest&>(rq.make(6, 0));
  r.prompt_logprobs = 1;
  std::vector<int64_t> need;
  EXPECT_EQ(p.fits(r, &need), Planner::Fit::kNow);
  EXPECT_EQ(need, (std::vector<int64_t>{2}));  // 6 rows of 4 per page; no decode row
  const uint64_t id = p.admit(r, need);
  Planner::Plan plan = p.plan();
  ASSERT_EQ(plan.step.seqs.size(), 1u);
  EXPECT_EQ(plan.step.seqs[0].prompt_logprobs, 1);
  EXPECT_FALSE(plan.step.seqs[0].sample);
  Planner::Update u = p.update(plan, {}, kEos);
  EXPECT_TRUE(u.tokens.empty());
  plan = p.plan();
  ASSERT_EQ(plan.step.seqs.size(), 1u);
  EXPECT_TRUE(plan.step.seqs[0].sample);
  EXPECT_FALSE(p.can_look_ahead(plan, true));
  u = p.update(plan, {{id, 9, false, 0.f, {}}}, kEos);
  ASSERT_EQ(u.tokens.size(), 1u);
  EXPECT_TRUE(u.tokens[0].ends);
  EXPECT_TRUE(u.tokens[0].discard);
  EXPECT_EQ(u.tokens[0].reason, FinishReason::kLength);
  EXPECT_EQ(p.find(id), nullptr);
  EXPECT_EQ(p.free_pages(), (std::vector<int64_t>{1000}));
  plan = p.plan();
  EXPECT_EQ(plan.step.release, std::vector<uint64_t>{id});
  EXPECT_TRUE(plan.step.seqs.empty());
}

TEST(Planner, LookaheadSkipsASequenceThatEndsByMaxTokens) {
  Requests rq;
  Planner p(options(1, 0, 1000));
  p.reset(1000, 16);
  const uint64_t one = admit(p, rq.make(4, 2));   // its 2nd token is its last
  const uint64_t more = admit(p, rq.make(4, 9));
  prefill_all(p);
  const Planner::Plan plan = p.plan();  // draws token 2 of each
  const Planner::Plan ahead = p.continue_decode(plan);
  ASSERT_EQ(ahead.step.seqs.size(), 1u);
  EXPECT_EQ(ahead.step.seqs[0].id, more);
  (void)one;
}

}  // namespace
}  // namespace burst::server

namespace burst::server {
namespace {

// A waiting queue as the scheduler keeps one: requests in arrival order, admitted through
// Planner::pick exactly as Scheduler::admit does.
struct Queue {
  Requests rq;
  std::vector<const ScheduledRequest*> waiting;
  void add(int64_t prompt, int max_tokens, uint64_t owner, int copies = 1) {
    for (int i = 0; i < copies; ++i) {
      rq.make(prompt, max_tokens);
      rq.all.back().owner = owner;
      waiting.push_back(&rq.all.back());
    }
  }
  // Admits what pick() allows; returns the owners admitted, in order.
  std::vector<uint64_t> admit_all(Planner& p) {
    std::vector<uint64_t> owners;
    while (true) {
      Planner::Pick pick = p.pick(waiting);
      if (pick.index < 0 || pick.fit != Planner::Fit::kNow) break;
      const ScheduledRequest* r = waiting[static_cast<size_t>(pick.index)];
      waiting.erase(waiting.begin() + pick.index);
      p.admit(*r, pick.need);
      owners.push_back(r->owner);
    }
    return owners;
  }
};

size_t running_of(const Planner& p, uint64_t owner) {
  size_t n = 0;
  for (uint64_t id = 1; id < 1000; ++id) {
    const Planner::Seq* s = p.find(id);
    n += s != nullptr && s->request->owner == owner ? 1 : 0;
  }
  return n;
}

TEST(PlannerFairness, OneRequestsChoicesLeaveSlotsForANewcomer) {
  Planner p(options(1, 0, 1000));  // max_running 8: a request's share is 6 slots
  p.reset(1000, 16);
  Queue q;
  q.add(20, 4, /*owner=*/1, /*copies=*/8);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>(6, 1));
  EXPECT_EQ(q.waiting.size(), 2u) << "two choices wait for the request's own to end";
  EXPECT_FALSE(p.full());
  // A newcomer behind the two waiting choices passes them.
  q.add(2, 2, /*owner=*/2);
  Planner::Pick pick = p.pick(q.waiting);
  EXPECT_EQ(pick.index, 2);
  EXPECT_EQ(pick.fit, Planner::Fit::kNow);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>{2});
  // A request of one sequence (owner 0) is never held to a share.
  q.add(2, 2, /*owner=*/0);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>{0});
  EXPECT_TRUE(p.full());
  EXPECT_EQ(p.pick(q.waiting).index, -1);
}

// Pages have no share (a share would halve a batch of long prompts), but a newcomer comes
// before a request's further choices when pages free up.
TEST(PlannerFairness, ANewcomerGetsTheNextPagesThatFreeUp) {
  Planner p(options(1, 0, 1000));
  p.reset(20, 16);  // 320 rows
  Queue q;
  q.add(60, 4, 1, 6);  // 64 rows: 4 pages each
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>(5, 1)) << "every page, whatever the share";
  EXPECT_EQ(p.free_pages(), std::vector<int64_t>{0});
  q.add(40, 8, 2);  // 48 rows: 3 pages; arrives after request 1's sixth choice
  const Planner::Pick waits = p.pick(q.waiting);
  EXPECT_EQ(waits.index, 1) << "the newcomer is picked, and waits for pages";
  EXPECT_EQ(waits.fit, Planner::Fit::kLater);
  p.finish(1);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>{2});
  EXPECT_EQ(p.free_pages(), std::vector<int64_t>{1});
}

TEST(PlannerFairness, AdmissionIsRoundRobinAndAPagesWaitStillBlocks) {
  Planner p(options(1, 0, 1000));
  p.reset(1000, 16);
  Queue q;
  q.add(10, 2, 1, 1);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>{1});
  p.finish(1);  // makes room; owner 1 keeps nothing running
  q.add(10, 2, 1, 1);
  EXPECT_EQ(q.admit_all(p), std::vector<uint64_t>{1});
  // Owner 1 runs one; its next choice arrived before owner 4's request, which goes first.
  q.waiting.clear();
  q.add(10, 2, 1, 2);
  q.add(10, 2, 4, 1);
  q.add(10, 2, 5, 1);
  EXPECT_EQ(q.admit_all(p), (std::vector<uint64_t>{4, 5, 1, 1}));
  // The picked request that waits for pages holds the line: nothing smaller passes it.
  Planner tight(options(1, 0, 1000));
  tight.reset(10, 16);
  Queue t;
  t.add(100, 10, 6);  // 7 pages
  EXPECT_EQ(t.admit_all(tight), std::vector<uint64_t>{6});
  t.add(100, 10, 7);  // 7 pages: later
  t.add(2, 2, 8);     // 1 page: would fit, but arrived after
  const Planner::Pick pick = tight.pick(t.waiting);
  EXPECT_EQ(pick.index, 0);
  EXPECT_EQ(pick.fit, Planner::Fit::kLater);
}

TEST(PlannerFairness, PrefillBudgetGoesRoundRobinOverRequests) {
  Planner p(options(1, 0, 45));  // whole prompts, 45 tokens a step
  p.reset(1000, 16);
  Queue q;
  q.add(10, 2, 1, 4);
  q.add(30, 2, 2, 1);
  EXPECT_EQ(q.admit_all(p).size(), 5u);
  const Planner::Plan plan = p.plan();
  // Each request's shortest chunk first: one of request 1 (10) and request 2's (30); a second
  // chunk of request 1 no longer fits. Without the rounds, four of request 1's came first.
  ASSERT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(p.find(plan.chunks[0].id)->request->owner, 1u);
  EXPECT_EQ(plan.chunks[0].len, 10);
  EXPECT_EQ(p.find(plan.chunks[1].id)->request->owner, 2u);
  EXPECT_EQ(plan.chunks[1].len, 30);
}

// The case in small: an n = 16 request on a long prompt fills the batch; a 2-token
// request arriving while it runs gets its first token within 2 steps of arriving.
TEST(PlannerFairness, ANewcomerBesideAnNChoicesRequestGetsItsTokenWithinTwoSteps) {
  PlannerOptions o = options(1, 64, 160);
  o.max_running = 16;
  Planner p(o);
  p.reset(4096, 16);
  Queue q;
  q.add(500, 40, 1, 16);
  int arrived = -1, first_token = -1;
  for (int step = 0; step < 400 && first_token < 0; ++step) {
    if (step == 5) {
      q.add(2, 2, 2);
      arrived = step;
    }
    q.admit_all(p);
    const Planner::Plan plan = p.plan();
    ASSERT_FALSE(plan.step.seqs.empty());
    std::vector<SampledToken> out;
    for (const auto& w : plan.step.seqs) {
      if (w.sample) out.push_back({w.id, 7, false, 0.f, {}});
    }
    const Planner::Update u = p.update(plan, out, kEos);
    for (const auto& t : u.tokens) {
      const Planner::Seq* s = p.find(t.id);
      if (s != nullptr && s->request->owner == 2) first_token = step;
    }
    if (arrived >= 0 && first_token < 0) {
      EXPECT_LE(step - arrived, 2) << "the newcomer still waits";
    }
  }
  EXPECT_EQ(first_token, arrived);
  EXPECT_EQ(running_of(p, 1), 12u) << "the n request holds its share of 16 slots";
}

}  // namespace
}  // namespace burst::server
