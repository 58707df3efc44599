// The step codec (server/group/step_codec.h), the one translation between the runtime's step
// types and the worker protocol: every field survives encode -> decode on both messages, the
// "none" values (-1) survive the +1 offsets, and every field of the wire messages is written by
// the encoder (found by protobuf reflection: a field added to worker.proto and not to the codec
// fails here, not in a process test).
#include <gtest/gtest.h>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <vector>

#include "group/step_codec.h"

namespace burst::server {
namespace {

namespace pb = burst::v1::internal;

runtime::SeqWork every_field_set(uint64_t id) {
  runtime::SeqWork w;
  w.id = id;
  w.decode = false;
  w.tokens = {5, 7, 11};
  w.start = 13;
  w.prompt_len = 40;
  w.sample = true;
  w.sampling = {0.7f, 17, 0.9f, 12345, 0.05f};
  w.adjust.presence_penalty = 0.25f;
  w.adjust.frequency_penalty = -0.5f;
  w.adjust.repetition_penalty = 1.3f;
  w.adjust.logit_bias = {{3, -2.5f}, {9, 1.5f}};
  w.adjust.min_tokens = 4;
  w.logprobs = 2;
  w.prompt_logprobs = 3;
  w.next_token = 99;
  w.reuse = {4, 2, 8};
  return w;
}

void expect_same(const runtime::SeqWork& a, const runtime::SeqWork& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.decode, b.decode);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.start, b.start);
  EXPECT_EQ(a.prompt_len, b.prompt_len);
  EXPECT_EQ(a.sample, b.sample);
  EXPECT_EQ(a.sampling.temperature, b.sampling.temperature);
  EXPECT_EQ(a.sampling.top_k, b.sampling.top_k);
  EXPECT_EQ(a.sampling.top_p, b.sampling.top_p);
  EXPECT_EQ(a.sampling.seed, b.sampling.seed);
  EXPECT_EQ(a.sampling.min_p, b.sampling.min_p);
  EXPECT_EQ(a.adjust.presence_penalty, b.adjust.presence_penalty);
  EXPECT_EQ(a.adjust.frequency_penalty, b.adjust.frequency_penalty);
  EXPECT_EQ(a.adjust.repetition_penalty, b.adjust.repetition_penalty);
  EXPECT_EQ(a.adjust.logit_bias, b.adjust.logit_bias);
  EXPECT_EQ(a.adjust.min_tokens, b.adjust.min_tokens);
  EXPECT_EQ(a.logprobs, b.logprobs);
  EXPECT_EQ(a.prompt_logprobs, b.prompt_logprobs);
  EXPECT_EQ(a.next_token, b.next_token);
  EXPECT_EQ(a.reuse, b.reuse);
}

// The first field (by full name) that is at its default in every message of ms (singular: not
// set; repeated: empty; inside messages, recursively over their first elements), else "".
std::string first_unset(const std::vector<const google::protobuf::Message*>& ms) {
  const auto* d = ms.front()->GetDescriptor();
  const auto* r = ms.front()->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const auto* f = d->field(i);
    std::vector<const google::protobuf::Message*> inner;
    bool set = false;
    for (const auto* m : ms) {
      if (f->is_repeated()) {
        if (r->FieldSize(*m, f) == 0) continue;
        set = true;
        if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
          inner.push_back(&r->GetRepeatedMessage(*m, f, 0));
        }
      } else {
        set = set || f->enum_type() != nullptr || r->HasField(*m, f);
      }
    }
    if (!set) return std::string(f->full_name());
    if (!inner.empty()) {
      if (std::string u = first_unset(inner); !u.empty()) return u;
    }
  }
  return "";
}

TEST(StepCodec, PlanRoundTripsEveryField) {
  runtime::StepPlan plan;
  plan.layout = engine::ShardLayout::kContiguous;
  plan.release = {3, 8};
  plan.publish = {{7, 2, 41}, {9, 0, 42}};
  plan.evict = {12, 5};
  plan.seqs.push_back(every_field_set(21));
  runtime::SeqWork none = runtime::decode_work(22, runtime::kPreviousToken, 50, 40, {});
  none.logprobs = -1;
  none.prompt_logprobs = -1;
  none.next_token = -1;
  plan.seqs.push_back(none);

  const pb::StepRequest req = encode_plan(plan, true);
  EXPECT_TRUE(reports_progress(req));
  EXPECT_FALSE(reports_progress(encode_plan(plan, false)));
  EXPECT_EQ(req.layout(), pb::CONTIGUOUS);
  // A prefill chunk with every option and a decode token: each field is written by one.
  EXPECT_EQ(first_unset({&req.seqs(0), &req.seqs(1)}), "")
      << "a SeqWork field the encoder does not write";
  for (int i = 0; i < req.GetDescriptor()->field_count(); ++i) {  // the request's own fields
    const auto* f = req.GetDescriptor()->field(i);
    const auto* r = req.GetReflection();
    EXPECT_TRUE(f->is_repeated() ? r->FieldSize(req, f) > 0 : r->HasField(req, f) || f->enum_type())
        << "a StepRequest field the encoder does not write: " << f->full_name();
  }

  const runtime::StepPlan back = decode_plan(req);
  EXPECT_EQ(back.layout, plan.layout);
  EXPECT_EQ(back.release, plan.release);
  EXPECT_EQ(back.evict, plan.evict);
  ASSERT_EQ(back.publish.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back.publish[i].seq, plan.publish[i].seq);
    EXPECT_EQ(back.publish[i].index, plan.publish[i].index);
    EXPECT_EQ(back.publish[i].id, plan.publish[i].id);
  }
  ASSERT_EQ(back.seqs.size(), 2u);
  expect_same(back.seqs[0], plan.seqs[0]);
  expect_same(back.seqs[1], plan.seqs[1]);
  EXPECT_EQ(back.seqs[1].tokens[0], runtime::kPreviousToken);
  EXPECT_EQ(back.seqs[1].adjust.repetition_penalty, 1.f) << "no penalty is 1, not 0";
}

TEST(StepCodec, ResultRoundTripsEveryField) {
  runtime::StepResult r;
  r.tokens.push_back({4, 17, true, -0.75f, {{17, -0.75f}, {2, -1.5f}}});
  r.tokens.push_back({5, 3, false, 0.f, {}});
  runtime::PromptLogprobs pl;
  pl.id = 4;
  pl.entries.push_back({1, 9, -2.25f, {{9, -2.25f}}});
  pl.entries.push_back({2, 10, -3.5f, {{1, -0.5f}}});
  r.prompt_logprobs.push_back(pl);
  r.kv.used_pages = 12;
  r.kv.total_pages = 64;
  r.kv.cached_pages = 5;
  r.kv.blocks = 9;
  r.rows = 37;
  r.ring_compute_ms = 1.25;
  r.ring_wait_ms = 0.5;

  const pb::StepReply reply = encode_result(r, 32);
  EXPECT_TRUE(reply.final());
  EXPECT_EQ(reply.layers(), 32);
  const runtime::StepResult back = decode_result(reply);
  ASSERT_EQ(back.tokens.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back.tokens[i].id, r.tokens[i].id);
    EXPECT_EQ(back.tokens[i].token, r.tokens[i].token);
    EXPECT_EQ(back.tokens[i].has_logprob, r.tokens[i].has_logprob);
    EXPECT_EQ(back.tokens[i].logprob, r.tokens[i].logprob);
    EXPECT_EQ(back.tokens[i].top, r.tokens[i].top);
  }
  ASSERT_EQ(back.prompt_logprobs.size(), 1u);
  EXPECT_EQ(back.prompt_logprobs[0].id, 4u);
  ASSERT_EQ(back.prompt_logprobs[0].entries.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& a = back.prompt_logprobs[0].entries[i];
    const auto& b = pl.entries[i];
    EXPECT_EQ(a.pos, b.pos);
    EXPECT_EQ(a.token, b.token);
    EXPECT_EQ(a.logprob, b.logprob);
    EXPECT_EQ(a.top, b.top);
  }
  EXPECT_EQ(back.kv.used_pages, 12);
  EXPECT_EQ(back.kv.total_pages, 64);
  EXPECT_EQ(back.kv.cached_pages, 5);
  EXPECT_EQ(back.kv.blocks, 9);
  EXPECT_EQ(back.rows, 37);
  EXPECT_EQ(back.ring_compute_ms, 1.25);
  EXPECT_EQ(back.ring_wait_ms, 0.5);
}

}  // namespace
}  // namespace burst::server
