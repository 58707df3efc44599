#include "runtime/batch_runner.h"

#include <algorithm>
#include <unordered_set>

namespace burst::runtime {

namespace {

Status bad(std::string m) { return Status::error(StatusCode::kInvalidArgument, std::move(m)); }

// The prefix blocks there are once a plan's publish and evict are applied.
struct PlanBlocks {
  const engine::PagedKvCache& cache;
  std::unordered_set<int64_t> published, evicted;
  bool exists(int64_t id) const {
    return (cache.has_block(id) || published.count(id) != 0) && evicted.count(id) == 0;
  }
};

// A plan's publish list (new ids, pages full on every rank), then its evict list (blocks that
// exist), recorded into blocks.
Status check_block_changes(const StepPlan& plan, const engine::RingAttention& ring, int world,
                           PlanBlocks& blocks) {
  const int64_t page = ring.cache().page_size();
  for (const PublishBlock& b : plan.publish) {
    const std::string what = "prefix block " + std::to_string(b.id) + ": ";
    if (ring.cache().has_block(b.id) || !blocks.published.insert(b.id).second) {
      return bad(what + "exists already");
    }
    for (int r = 0; r < world; ++r) {
      if (b.index < 0 || ring.rows_on(b.seq, r) < (b.index + 1) * page) {
        return bad(what + "page " + std::to_string(b.index) + " of sequence " +
                   std::to_string(b.seq) + " is not full on rank " + std::to_string(r));
      }
    }
  }
  for (int64_t id : plan.evict) {
    if (!blocks.exists(id)) return bad("prefix block " + std::to_string(id) + ": none to evict");
    blocks.evicted.insert(id);
  }
  return {};
}

// What a sequence's work asks for beside its tokens: sampling, logit adjustments and logprobs
// when it samples, prompt logprobs, the forced next token. who: "sequence <id>: ".
Status check_seq_options(const SeqWork& s, int64_t vocab_size, const std::string& who) {
  if (s.sample) {
    const std::string why = engine::validate(s.sampling);
    if (!why.empty()) return bad(who + why);
    const std::string adj = engine::validate(s.adjust, vocab_size);
    if (!adj.empty()) return bad(who + adj);
    if (s.logprobs < -1 || s.logprobs > vocab_size) {
      return bad(who + "logprobs must be in [-1, vocab]");
    }
  }
  if (s.prompt_logprobs < -1 || s.prompt_logprobs > 20) {
    return bad(who + "prompt_logprobs must be in [-1, 20]");
  }
  if (s.next_token < -1 || s.next_token >= vocab_size) {
    return bad(who + "next_token outside the vocabulary");
  }
  return {};
}

}  // namespace

Status BatchRunner::validate(const StepPlan& plan) const {
  const models::ModelInfo c = model_.info();
  std::unordered_set<uint64_t> seen;
  if (plan.seqs.empty() && plan.release.empty() && plan.publish.empty() && plan.evict.empty()) {
    return bad("an empty step");
  }
  // Prefix blocks: those that exist once the plan's publish and evict are applied. A block is
  // one page a rank only under the striped layout (engine/sharding.h).
  const bool reuses = std::any_of(plan.seqs.begin(), plan.seqs.end(),
                                  [](const SeqWork& s) { return !s.reuse.empty(); });
  if ((reuses || !plan.publish.empty()) && plan.layout != engine::ShardLayout::kStriped) {
    return bad("prefix blocks need the striped layout");
  }
  const engine::RingAttention& ring = ring_;
  const int64_t page = ring.cache().page_size();
  PlanBlocks blocks{ring.cache(), {}, {}};
  BURST_RETURN_IF_ERROR(check_block_changes(plan, ring, comm_.world_size(), blocks));
  for (const SeqWork& s : plan.seqs) {
    const std::string who = "sequence " + std::to_string(s.id) + ": ";
    if (!seen.insert(s.id).second) return bad(who + "appears twice in one step");
    for (uint64_t r : plan.release) {
      if (r == s.id) return bad(who + "released and run in the same step");
    }
    if (s.tokens.empty()) return bad(who + "no tokens");
    if (s.decode && s.tokens.size() != 1) return bad(who + "a decode step has one token");
    const bool previous = s.decode && s.tokens[0] == kPreviousToken;
    const auto it = seqs_.find(s.id);
    const SeqState* state = it == seqs_.end() ? nullptr : &it->second;
    if (previous && !(state && state->sampled_last)) {
      return bad(who + "asks for the token of the step before, which did not sample it");
    }
    for (int32_t t : s.tokens) {
      if (previous) break;
      if (t < 0 || t >= c.vocab_size) {
        return bad(who + "token id " + std::to_string(t) + " outside the vocabulary");
      }
    }
    if (!s.reuse.empty()) {
      if (state != nullptr || s.decode) {
        return bad(who + "only a new sequence's first chunk starts from prefix blocks");
      }
      std::unordered_set<int64_t> once;
      for (int64_t id : s.reuse) {
        if (!blocks.exists(id)) return bad(who + "no prefix block " + std::to_string(id));
        if (!once.insert(id).second) return bad(who + "prefix block " + std::to_string(id) + " twice");
      }
    }
    const int64_t next =
        state ? state->next_pos
              : static_cast<int64_t>(s.reuse.size()) *
                    block_tokens(comm_.world_size(), static_cast<int>(page));
    if (s.start != next) {
      return bad(who + "starts at position " + std::to_string(s.start) + ", its next is " +
                 std::to_string(next));
    }
    if (!s.decode && (s.prompt_len < s.start + static_cast<int64_t>(s.tokens.size()))) {
      return bad(who + "prompt_len is shorter than its chunk's end");
    }
    if (s.decode && s.start < s.prompt_len) return bad(who + "decode inside the prompt");
    BURST_RETURN_IF_ERROR(check_seq_options(s, c.vocab_size, who));
  }
  return {};
}

void BatchRunner::release(uint64_t id) {
  ring_.release(id);
  seqs_.erase(id);
}

void BatchRunner::clear_last_draws() {
  for (auto& [id, st] : seqs_) {
    st.sampled_last = false;
    st.drawn_last.reset();
    st.drawn_index = -1;
  }
  drawn_count_ = 0;
}

void BatchRunner::release_all() {
  // Launched steps' ids are dropped (their queued draws taken off the backend first).
  for (Launched& l : launched_) {
    std::vector<int32_t> ids;
    if (!l.draws.empty()) (void)model_.backend().sampled(ids);
  }
  launched_.clear();
  ring_.clear();
  seqs_.clear();
  drawn_count_ = 0;
}

Status BatchRunner::resolve_previous(StepPlan& plan, std::vector<DrawnPrevious>& drawn) {
  std::vector<SeqWork*> asked;
  bool on_rank0_device = true;  // the same on every rank: it follows from the plans
  for (SeqWork& s : plan.seqs) {
    if (s.decode && s.tokens[0] == kPreviousToken) {
      asked.push_back(&s);
      on_rank0_device = on_rank0_device && seq(s.id).drawn_index >= 0;
    }
  }
  if (asked.empty()) return {};
  if (on_rank0_device) {
    // Every asked token was drawn by rank 0's backend in the step before and lies where it
    // was drawn: the embedding reads it there (Backend::DrawnId), and the other
    // ranks get the step's ids by one broadcast into their backend's memory, queued with the
    // step's work (on GPUs no host waits for it).
    if (comm_.world_size() > 1) {
      void* where = nullptr;
      BURST_RETURN_IF_ERROR(model_.backend().drawn_ids(drawn_count_, &where));
      BURST_RETURN_IF_ERROR(
          comm_.broadcast(where, static_cast<size_t>(drawn_count_) * sizeof(int32_t), 0));
    }
    for (SeqWork* s : asked) {
      drawn.push_back({static_cast<size_t>(s - plan.seqs.data()), seq(s->id).drawn_index});
    }
    return {};
  }
  // Some token was drawn on another rank or on rank 0's host: rank 0 knows them all once the
  // steps launched before have their ids.
  for (Launched& l : launched_) BURST_RETURN_IF_ERROR(settle(l, &l == &launched_.back()));
  std::vector<int32_t> ids(asked.size(), 0);
  if (comm_.rank() == 0) {
    for (size_t k = 0; k < asked.size(); ++k) {
      const std::optional<int32_t>& drawn = seq(asked[k]->id).drawn_last;
      if (!drawn) return Status::error("batch: the token of the step before is not known");
      ids[k] = *drawn;
    }
  }
  if (comm_.world_size() > 1) {
    BURST_RETURN_IF_ERROR(comm_.broadcast(ids.data(), ids.size() * sizeof(int32_t), 0));
  }
  for (size_t k = 0; k < asked.size(); ++k) asked[k]->tokens[0] = ids[k];
  return {};
}

namespace {

// Whether rank 0 must see a sampled row's logits: logprobs are computed from them, and a
// LogitAdjust changes them with the sequence's history, which rank 0 keeps. Any other row is
// drawn by the backend of the rank that computes it, and only its id travels.
bool needs_host_logits(const SeqWork& s) { return s.logprobs >= 0 || s.adjust.active(); }

}  // namespace

// A sampled row of a step, as every rank sees it (all know the plan, hence every owner).
struct BatchRunner::Sample {
  size_t seq;        // index into plan.seqs
  int owner;         // the rank that computes its logits
  bool on_device;    // drawn by the owner's backend (!needs_host_logits)
  int64_t index;     // on the owner: its index in the forward's logits, or in its SampleRows
  int64_t remote;    // device-drawn, owner > 0: its slot in the ids' all-gather; else -1
  int64_t remote_u;  // ... and not greedy: its slot in the uniforms' broadcast; else -1
};

Status BatchRunner::draw_uniforms(const StepPlan& plan, const std::vector<Sample>& samples,
                                  size_t remote_u, SampleRows& device) {
  const int rank = comm_.rank();
  std::vector<double> shared(remote_u, 0.0);
  if (rank == 0) {
    for (const Sample& sm : samples) {
      const SeqWork& s = plan.seqs[sm.seq];
      // Made at a sequence's first sample and kept: one stream per sequence, as one process.
      std::optional<engine::Sampler>& made = seq(s.id).sampler;
      if (!made) made.emplace(s.sampling);
      engine::Sampler& sampler = *made;
      if (!sm.on_device) continue;  // sample_on_host draws it
      const double u = sampler.draw_uniform();  // greedy draws nothing (0)
      if (sm.owner == 0) {
        device.uniforms[static_cast<size_t>(sm.index)] = u;
      } else if (sm.remote_u >= 0) {
        shared[static_cast<size_t>(sm.remote_u)] = u;
      }
    }
  }
  if (remote_u == 0) return {};
  BURST_RETURN_IF_ERROR(comm_.broadcast(shared.data(), shared.size() * sizeof(double), 0));
  for (const Sample& sm : samples) {
    if (sm.owner == rank && sm.remote_u >= 0) {
      device.uniforms[static_cast<size_t>(sm.index)] = shared[static_cast<size_t>(sm.remote_u)];
    }
  }
  return {};
}

Status BatchRunner::gather_ids(const std::vector<Sample>& samples, size_t remote,
                               const std::vector<int32_t>& sampled,
                               std::vector<int32_t>& device_ids) {
  const int rank = comm_.rank(), world = comm_.world_size();
  device_ids.assign(samples.size(), -1);
  std::vector<int32_t> mine(remote, -1);
  for (size_t k = 0; k < samples.size(); ++k) {
    const Sample& sm = samples[k];
    if (!sm.on_device || sm.owner != rank) continue;
    const int32_t id = sampled.at(static_cast<size_t>(sm.index));
    if (rank == 0) {
      device_ids[k] = id;
    } else {
      mine[static_cast<size_t>(sm.remote)] = id;
    }
  }
  if (remote == 0) return {};
  std::vector<int32_t> all(remote * static_cast<size_t>(world));
  BURST_RETURN_IF_ERROR(comm_.all_gather(mine.data(), all.data(), remote * sizeof(int32_t)));
  if (rank != 0) return {};
  for (size_t k = 0; k < samples.size(); ++k) {
    const Sample& sm = samples[k];
    if (sm.remote >= 0) {
      device_ids[k] = all[static_cast<size_t>(sm.owner) * remote + static_cast<size_t>(sm.remote)];
    }
  }
  return {};
}

Status BatchRunner::sample_on_host(const StepPlan& plan, const std::vector<Sample>& samples,
                                   const std::vector<float>& logits,
                                   const std::vector<int32_t>& device_ids, StepResult& result) {
  const int rank = comm_.rank();
  const int64_t vocab = model_.info().vocab_size;
  // Logits a rank other than 0 computed travel to rank 0, one broadcast each, in plan order.
  std::vector<const float*> sample_rows(samples.size(), nullptr);
  std::vector<std::vector<float>> moved(samples.size());
  for (size_t k = 0; k < samples.size(); ++k) {
    const Sample& sm = samples[k];
    if (sm.on_device) continue;
    if (sm.owner == 0) {
      if (rank == 0) sample_rows[k] = logits.data() + sm.index * vocab;
      continue;
    }
    moved[k].resize(static_cast<size_t>(vocab));
    if (rank == sm.owner) {
      std::copy(logits.begin() + sm.index * vocab, logits.begin() + (sm.index + 1) * vocab,
                moved[k].begin());
    }
    BURST_RETURN_IF_ERROR(comm_.broadcast(moved[k].data(), moved[k].size() * 4, sm.owner));
    sample_rows[k] = moved[k].data();
  }
  if (rank != 0) return {};
  // Each sequence draws from its own stream, so the draws run in parallel (a draw without
  // top-k is ~1 ms of CPU for a 32000-id vocabulary: sixteen in a row were a decode step's
  // time); the map entries are made first, one thread (draw_uniforms made the samplers).
  std::vector<engine::Sampler*> samplers(samples.size());
  std::vector<engine::TokenHistory*> histories(samples.size(), nullptr);
  for (size_t k = 0; k < samples.size(); ++k) {
    const SeqWork& s = plan.seqs[samples[k].seq];
    SeqState& st = seq(s.id);
    samplers[k] = &*st.sampler;
    if (s.adjust.active()) {
      if (!st.history) st.history.emplace();
      histories[k] = &*st.history;
    }
  }
  std::vector<SampledToken> drawn(samples.size());
  const int32_t eos = model_.info().eos_token_id;
#pragma omp parallel for schedule(dynamic) if (samples.size() > 1)
  for (size_t k = 0; k < samples.size(); ++k) {
    const SeqWork& s = plan.seqs[samples[k].seq];
    SampledToken& t = drawn[k];
    t.id = s.id;
    if (samples[k].on_device) {
      t.token = device_ids[k];
      continue;
    }
    const float* row = sample_rows[k];
    std::vector<float> adjusted;
    const float* use = row;
    if (histories[k]) {
      adjusted.assign(row, row + vocab);
      engine::adjust_logits(adjusted.data(), vocab, s.adjust, *histories[k], eos);
      use = adjusted.data();
    }
    t.token = samplers[k]->sample(use, vocab);
    if (histories[k]) histories[k]->add_generated(t.token);
    if (s.logprobs >= 0) {
      t.has_logprob = true;
      t.logprob = engine::log_softmax_at(row, vocab, t.token, s.logprobs, &t.top);
    }
  }
  for (SampledToken& t : drawn) result.tokens.push_back(std::move(t));
  return {};
}

// This rank's rows of a step: each sequence's share, in plan order, and what is drawn or scored.
struct BatchRunner::StepInputs {
  // This rank's forward: its rows of every sequence, the rows whose logits come back to the
  // host (logit_rows) and the rows its backend draws (sample).
  models::ForwardBatch batch;
  std::vector<engine::SeqRows> rows;
  std::vector<Sample> samples;
  size_t remote = 0, remote_u = 0;  // device-drawn samples owned by ranks > 0 (not greedy)
  // Prompt logprobs: per such sequence (plan order), this rank's (position, logit index).
  std::vector<std::pair<size_t, std::vector<std::pair<int64_t, int64_t>>>> prompt_rows;

  void add_sample(const StepPlan& plan, int rank, size_t i, int owner, int64_t row) {
    const SeqWork& s = plan.seqs[i];
    Sample sm{i, owner, !needs_host_logits(s), 0, -1, -1};
    if (sm.on_device && owner != 0) {
      sm.remote = static_cast<int64_t>(remote++);
      if (s.sampling.temperature > 0.f) sm.remote_u = static_cast<int64_t>(remote_u++);
    }
    if (rank == owner && sm.on_device) {
      sm.index = static_cast<int64_t>(batch.sample.size());
      batch.sample.rows.push_back(row);
      batch.sample.params.push_back(s.sampling);
      batch.sample.uniforms.push_back(0.0);  // draw_uniforms fills it
    } else if (rank == owner) {
      sm.index = static_cast<int64_t>(batch.logit_rows.size());
      batch.logit_rows.push_back(row);
    }
    samples.push_back(sm);
  }
};

void BatchRunner::build_inputs(const StepPlan& plan, const std::vector<DrawnPrevious>& drawn,
                               StepInputs& in) const {
  const int rank = comm_.rank(), world = comm_.world_size();
  auto next_drawn = drawn.begin();  // in plan order
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const SeqWork& s = plan.seqs[i];
    engine::SeqRows sr;
    sr.seq = s.id;
    sr.row = static_cast<int64_t>(in.batch.ids.size());
    const auto n = static_cast<int64_t>(s.tokens.size());
    if (s.decode) {
      sr.decode = true;
      sr.pos = s.start;
      if (next_drawn != drawn.end() && next_drawn->seq == i) {
        in.batch.drawn.push_back({sr.row, next_drawn->index});
        in.batch.ids.push_back(0);  // not read: the backend reads its draw
        ++next_drawn;
      } else {
        in.batch.ids.push_back(s.tokens[0]);
      }
      in.batch.positions.push_back(s.start);
      in.batch.spans.push_back({sr.row, 1, s.start + 1});
      // Every rank runs the decode token; rank 0 samples it.
      if (s.sample) in.add_sample(plan, rank, i, 0, sr.row);
      in.rows.push_back(std::move(sr));
      continue;
    }
    sr.plan = engine::ShardPlan::make(plan.layout, n, world, s.start);
    // Padding (id 0, past the chunk's end) is never cached, attended to or sampled.
    for (const auto& sg : sr.plan.segments(rank)) {
      for (int64_t j = 0; j < sg.len; ++j) {
        const int64_t pos = sg.position(j);
        const bool real = pos < s.start + n;
        in.batch.ids.push_back(real ? s.tokens[static_cast<size_t>(pos - s.start)] : 0);
        in.batch.positions.push_back(pos);
      }
    }
    in.batch.spans.push_back({sr.row, sr.plan.local_rows(rank), s.prompt_len});
    if (s.sample) {
      int64_t local = 0;
      const int owner = sr.plan.owner(s.start + n - 1, &local);
      in.add_sample(plan, rank, i, owner, sr.row + local);
    }
    if (s.prompt_logprobs >= 0) {
      // Every real row of this rank's shard whose next token is a prompt token.
      std::vector<std::pair<int64_t, int64_t>> mine;
      int64_t row = sr.row;
      for (const auto& sg : sr.plan.segments(rank)) {
        for (int64_t j = 0; j < sg.len; ++j, ++row) {
          const int64_t pos = sg.position(j);
          if (pos < s.start + n && pos + 1 < s.prompt_len) {
            mine.emplace_back(pos, static_cast<int64_t>(in.batch.logit_rows.size()));
            in.batch.logit_rows.push_back(row);
          }
        }
      }
      in.prompt_rows.emplace_back(i, std::move(mine));
    }
    in.rows.push_back(std::move(sr));
  }
}

Status BatchRunner::score_prompt(const StepPlan& plan, const SeqWork& s,
                                 const std::vector<std::pair<int64_t, int64_t>>& mine,
                                 const std::vector<float>& logits, StepResult& result) {
  const int rank = comm_.rank(), world = comm_.world_size();
  const int64_t vocab = model_.info().vocab_size;
  const int k = std::min<int>(s.prompt_logprobs, static_cast<int>(vocab));
  const size_t rec = 3 + 2 * static_cast<size_t>(k);  // pos, token, logprob, k x (id, lp)
  const auto sp = engine::ShardPlan::make(plan.layout, static_cast<int64_t>(s.tokens.size()),
                                          world, s.start);
  int64_t most = 0;
  for (int r = 0; r < world; ++r) most = std::max(most, sp.real_rows(r));
  std::vector<double> send(static_cast<size_t>(most) * rec, -1.0);
  std::vector<std::pair<int32_t, float>> top;
  for (size_t m = 0; m < mine.size(); ++m) {
    const auto [pos, li] = mine[m];
    const int64_t next = pos + 1;
    const int32_t tok = next < s.start + static_cast<int64_t>(s.tokens.size())
                            ? s.tokens[static_cast<size_t>(next - s.start)]
                            : s.next_token;
    double* out = send.data() + m * rec;
    out[0] = static_cast<double>(next);
    out[1] = tok;
    out[2] = tok < 0 ? 0.0
                     : engine::log_softmax_at(logits.data() + li * vocab, vocab, tok, k, &top);
    if (tok < 0) top.clear();
    for (size_t t = 0; t < top.size(); ++t) {
      out[3 + 2 * t] = top[t].first;
      out[4 + 2 * t] = top[t].second;
    }
  }
  std::vector<double> all(send.size() * static_cast<size_t>(world));
  BURST_RETURN_IF_ERROR(comm_.all_gather(send.data(), all.data(), send.size() * 8));
  if (rank != 0) return {};
  PromptLogprobs pl;
  pl.id = s.id;
  for (size_t r = 0; r < all.size(); r += rec) {
    if (all[r] < 0 || all[r + 1] < 0) continue;
    PromptTokenLogprob e;
    e.pos = static_cast<int64_t>(all[r]);
    e.token = static_cast<int32_t>(all[r + 1]);
    e.logprob = static_cast<float>(all[r + 2]);
    for (int t = 0; t < k; ++t) {
      e.top.emplace_back(static_cast<int32_t>(all[r + 3 + 2 * t]),
                         static_cast<float>(all[r + 4 + 2 * t]));
    }
    pl.entries.push_back(std::move(e));
  }
  std::sort(pl.entries.begin(), pl.entries.end(),
            [](const PromptTokenLogprob& a, const PromptTokenLogprob& b) { return a.pos < b.pos; });
  result.prompt_logprobs.push_back(std::move(pl));
  return {};
}

Result<StepResult> BatchRunner::step(const StepPlan& plan, const LayerHook& after_layer) {
  if (launched()) return Status::error("batch: step() while a launched step awaits finish()");
  BURST_RETURN_IF_ERROR(launch(plan, after_layer));
  return finish();
}

Status BatchRunner::launch(const StepPlan& given, const LayerHook& after_layer) {
  BURST_RETURN_IF_ERROR(validate(given));
  if (launched_.size() >= engine::Backend::kMaxQueuedDraws) {
    return Status::error("batch: " + std::to_string(launched_.size()) +
                         " steps are launched and not finished (finish() first)");
  }
  // Publish before release: a finishing sequence's last pages stay as blocks.
  for (const PublishBlock& b : given.publish) {
    BURST_RETURN_IF_ERROR(ring_.publish(b.seq, b.index, b.id));
  }
  for (uint64_t id : given.release) release(id);
  for (int64_t id : given.evict) BURST_RETURN_IF_ERROR(ring_.evict(id));
  for (const SeqWork& s : given.seqs) {
    if (!s.reuse.empty()) BURST_RETURN_IF_ERROR(ring_.adopt(s.id, s.reuse));
  }
  const bool previous = std::any_of(given.seqs.begin(), given.seqs.end(), [](const SeqWork& s) {
    return s.decode && s.tokens[0] == kPreviousToken;
  });
  StepPlan resolved;
  std::vector<DrawnPrevious> drawn;
  if (previous) {
    resolved = given;
    BURST_RETURN_IF_ERROR(resolve_previous(resolved, drawn));
  }
  const StepPlan& plan = previous ? resolved : given;
  Launched l;
  StepResult& result = l.result;
  clear_last_draws();
  if (plan.seqs.empty()) {
    result.kv = ring_.cache().usage();
    launched_.push_back(std::move(l));
    return {};
  }
  StepInputs in;
  build_inputs(plan, drawn, in);
  in.batch.sample.queued = device_only(in) && !in.batch.sample.rows.empty();
  BURST_RETURN_IF_ERROR(draw_uniforms(plan, in.samples, in.remote_u, in.batch.sample));
  BURST_RETURN_IF_ERROR(ring_.begin_step(std::move(in.rows)));
  models::ForwardOutput out;
  // On an error the caller treats the group as broken: the ring may be mid-step.
  BURST_RETURN_IF_ERROR(model_.forward(in.batch, ring_, out, after_layer));
  ring_.end_step();
  for (const SeqWork& s : plan.seqs) {
    SeqState& state = seq(s.id);
    state.next_pos = s.start + static_cast<int64_t>(s.tokens.size());
    // Repetition penalty counts the prompt's ids too: rank 0 sees every chunk's tokens.
    if (comm_.rank() == 0 && !s.decode && s.adjust.repetition_penalty != 1.f) {
      if (!state.history) state.history.emplace();
      state.history->add_prompt(s.tokens.data(), s.tokens.size());
    }
  }
  if (in.batch.sample.queued) {
    // Rank 0, every draw its backend's, in sample order: settle() reads the ids.
    for (const Sample& sm : in.samples) l.draws.push_back(plan.seqs[sm.seq].id);
  } else {
    std::vector<int32_t> device_ids;
    BURST_RETURN_IF_ERROR(gather_ids(in.samples, in.remote, out.sampled, device_ids));
    BURST_RETURN_IF_ERROR(sample_on_host(plan, in.samples, out.logits, device_ids, result));
    // Prompt logprobs: each rank scores its rows; one all-gather of fixed-size records per
    // sequence (every rank knows every rank's row count from the plan), merged on rank 0.
    for (const auto& [i, mine] : in.prompt_rows) {
      BURST_RETURN_IF_ERROR(score_prompt(plan, plan.seqs[i], mine, out.logits, result));
    }
    for (const SampledToken& t : result.tokens) seq(t.id).drawn_last = t.token;
  }
  for (const SeqWork& s : plan.seqs) {
    if (s.sample) seq(s.id).sampled_last = true;
  }
  // Rank 0's backend drew its device samples in this order (its SampleRows): every rank
  // knows the order from the plan.
  for (const Sample& sm : in.samples) {
    if (sm.owner == 0 && sm.on_device) seq(plan.seqs[sm.seq].id).drawn_index = drawn_count_++;
  }
  result.kv = ring_.cache().usage();
  result.rows = static_cast<int64_t>(in.batch.ids.size());
  result.ring_compute_ms = ring_.stats().compute_ms;
  result.ring_wait_ms = ring_.stats().wait_ms;
  launched_.push_back(std::move(l));
  return {};
}

bool BatchRunner::device_only(const StepInputs& in) {
  return in.remote == 0 && in.prompt_rows.empty() &&
         std::all_of(in.samples.begin(), in.samples.end(),
                     [](const Sample& sm) { return sm.on_device; });
}

bool BatchRunner::queues(const StepPlan& plan) const {
  if (!std::all_of(plan.seqs.begin(), plan.seqs.end(), [](const SeqWork& s) { return s.decode; })) {
    return false;
  }
  StepInputs in;
  build_inputs(plan, {}, in);
  return device_only(in) && !in.batch.sample.rows.empty();
}

Status BatchRunner::settle(Launched& l, bool latest) {
  if (l.draws.empty()) return {};
  const std::vector<uint64_t> draws = std::move(l.draws);
  l.draws.clear();
  std::vector<int32_t> ids;
  BURST_RETURN_IF_ERROR(model_.backend().sampled(ids));
  if (ids.size() != draws.size()) {
    return Status::error("batch: a queued draw gave " + std::to_string(ids.size()) + " ids for " +
                         std::to_string(draws.size()) + " sequences");
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    SampledToken t;
    t.id = draws[k];
    t.token = ids[k];
    l.result.tokens.push_back(std::move(t));
    const auto it = seqs_.find(draws[k]);  // a sequence released meanwhile keeps nothing
    if (latest && it != seqs_.end()) it->second.drawn_last = ids[k];
  }
  return {};
}

Result<StepResult> BatchRunner::finish() {
  if (launched_.empty()) return Status::error("batch: finish() with no step launched");
  BURST_RETURN_IF_ERROR(settle(launched_.front(), launched_.size() == 1));
  StepResult r = std::move(launched_.front().result);
  launched_.pop_front();
  return r;
}

bool BatchRunner::finish_ready() const {
  return launched_.empty() || launched_.front().draws.empty() || model_.backend().sampled_ready();
}

}  // namespace burst::runtime
