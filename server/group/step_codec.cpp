#include "group/step_codec.h"

namespace burst::server {

namespace pb = burst::v1::internal;

namespace {

// The most likely ids with their logprobs, onto a sampled token or a prompt position.
template <typename Msg>
void add_top(Msg* m, const std::vector<std::pair<int32_t, float>>& top) {
  for (const auto& [id, lp] : top) {
    auto* t = m->add_top();
    t->set_token(id);
    t->set_logprob(lp);
  }
}

template <typename Msg>
std::vector<std::pair<int32_t, float>> top_of(const Msg& m) {
  std::vector<std::pair<int32_t, float>> top;
  for (const auto& t : m.top()) top.emplace_back(t.token(), t.logprob());
  return top;
}

}  // namespace

pb::StepRequest encode_plan(const runtime::StepPlan& plan, bool report_progress) {
  pb::StepRequest req;
  switch (plan.layout) {
    case engine::ShardLayout::kStriped: req.set_layout(pb::STRIPED); break;
    case engine::ShardLayout::kZigzag: req.set_layout(pb::ZIGZAG); break;
    case engine::ShardLayout::kContiguous: req.set_layout(pb::CONTIGUOUS); break;
  }
  req.mutable_release()->Add(plan.release.begin(), plan.release.end());
  req.mutable_evict()->Add(plan.evict.begin(), plan.evict.end());
  for (const runtime::PublishBlock& b : plan.publish) {
    pb::PublishBlock* m = req.add_publish();
    m->set_seq(b.seq);
    m->set_index(b.index);
    m->set_id(b.id);
  }
  for (const runtime::SeqWork& s : plan.seqs) {
    pb::SeqWork* w = req.add_seqs();
    w->set_id(s.id);
    w->set_decode(s.decode);
    w->mutable_tokens()->Add(s.tokens.begin(), s.tokens.end());
    w->set_start(s.start);
    w->set_prompt_len(s.prompt_len);
    w->set_sample(s.sample);
    w->set_temperature(s.sampling.temperature);
    w->set_top_k(s.sampling.top_k);
    w->set_top_p(s.sampling.top_p);
    w->set_seed(s.sampling.seed);
    w->set_min_p(s.sampling.min_p);
    w->set_report_progress(report_progress);
    w->set_presence_penalty(s.adjust.presence_penalty);
    w->set_frequency_penalty(s.adjust.frequency_penalty);
    w->set_repetition_penalty(s.adjust.repetition_penalty);
    for (const auto& [token, bias] : s.adjust.logit_bias) {
      auto* b = w->add_logit_bias();
      b->set_token(token);
      b->set_bias(bias);
    }
    w->set_min_tokens(s.adjust.min_tokens);
    w->set_logprobs(s.logprobs + 1);
    w->set_prompt_logprobs(s.prompt_logprobs + 1);
    w->set_next_token(s.next_token + 1);
    w->mutable_reuse()->Add(s.reuse.begin(), s.reuse.end());
  }
  return req;
}

runtime::StepPlan decode_plan(const pb::StepRequest& req) {
  runtime::StepPlan plan;
  plan.layout = req.layout() == pb::STRIPED      ? engine::ShardLayout::kStriped
                : req.layout() == pb::CONTIGUOUS ? engine::ShardLayout::kContiguous
                                                 : engine::ShardLayout::kZigzag;
  plan.release.assign(req.release().begin(), req.release().end());
  plan.evict.assign(req.evict().begin(), req.evict().end());
  for (const pb::PublishBlock& b : req.publish()) plan.publish.push_back({b.seq(), b.index(), b.id()});
  for (const pb::SeqWork& w : req.seqs()) {
    runtime::SeqWork s;
    s.id = w.id();
    s.decode = w.decode();
    s.tokens.assign(w.tokens().begin(), w.tokens().end());
    s.start = w.start();
    s.prompt_len = w.prompt_len();
    s.sample = w.sample();
    s.sampling = {w.temperature(), w.top_k(), w.top_p(), w.seed(), w.min_p()};
    s.adjust.presence_penalty = w.presence_penalty();
    s.adjust.frequency_penalty = w.frequency_penalty();
    s.adjust.repetition_penalty = w.repetition_penalty() == 0.f ? 1.f : w.repetition_penalty();
    for (const auto& b : w.logit_bias()) s.adjust.logit_bias.emplace_back(b.token(), b.bias());
    s.adjust.min_tokens = w.min_tokens();
    s.logprobs = w.logprobs() - 1;
    s.prompt_logprobs = w.prompt_logprobs() - 1;
    s.next_token = w.next_token() - 1;
    s.reuse.assign(w.reuse().begin(), w.reuse().end());
    plan.seqs.push_back(std::move(s));
  }
  return plan;
}

bool reports_progress(const pb::StepRequest& req) {
  for (const auto& w : req.seqs()) {
    if (w.report_progress()) return true;
  }
  return false;
}

pb::StepReply encode_result(const runtime::StepResult& r, int layers) {
  pb::StepReply reply;
  reply.set_final(true);
  reply.set_layers(layers);
  for (const auto& t : r.tokens) {
    auto* o = reply.add_tokens();
    o->set_id(t.id);
    o->set_token(t.token);
    o->set_has_logprob(t.has_logprob);
    o->set_logprob(t.logprob);
    add_top(o, t.top);
  }
  for (const auto& pl : r.prompt_logprobs) {
    auto* o = reply.add_prompt_logprobs();
    o->set_id(pl.id);
    for (const auto& e : pl.entries) {
      auto* oe = o->add_entries();
      oe->set_pos(e.pos);
      oe->set_token(e.token);
      oe->set_logprob(e.logprob);
      add_top(oe, e.top);
    }
  }
  reply.set_kv_used_pages(r.kv.used_pages);
  reply.set_kv_total_pages(r.kv.total_pages);
  reply.set_kv_cached_pages(r.kv.cached_pages);
  reply.set_kv_blocks(r.kv.blocks);
  reply.set_rows(r.rows);
  reply.set_ring_compute_ms(r.ring_compute_ms);
  reply.set_ring_wait_ms(r.ring_wait_ms);
  return reply;
}

runtime::StepResult decode_result(const pb::StepReply& reply) {
  runtime::StepResult out;
  for (const auto& t : reply.tokens()) {
    runtime::SampledToken st;
    st.id = t.id();
    st.token = t.token();
    st.has_logprob = t.has_logprob();
    st.logprob = t.logprob();
    st.top = top_of(t);
    out.tokens.push_back(std::move(st));
  }
  for (const auto& pl : reply.prompt_logprobs()) {
    runtime::PromptLogprobs m;
    m.id = pl.id();
    for (const auto& e : pl.entries()) {
      runtime::PromptTokenLogprob me;
      me.pos = e.pos();
      me.token = e.token();
      me.logprob = e.logprob();
      me.top = top_of(e);
      m.entries.push_back(std::move(me));
    }
    out.prompt_logprobs.push_back(std::move(m));
  }
  out.kv.used_pages = reply.kv_used_pages();
  out.kv.total_pages = reply.kv_total_pages();
  out.kv.cached_pages = reply.kv_cached_pages();
  out.kv.blocks = reply.kv_blocks();
  out.rows = reply.rows();
  out.ring_compute_ms = reply.ring_compute_ms();
  out.ring_wait_ms = reply.ring_wait_ms();
  return out;
}

}  // namespace burst::server
