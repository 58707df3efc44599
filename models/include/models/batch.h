// One step of continuous batching on one rank of a sequence-sharded group: a batch of
// sequences, each contributing a prefill chunk (its tokens sharded over the ranks, zigzag
// within the chunk) or one decode token (replicated), runs as ONE forward: the GEMMs see every
// row of every sequence, attention runs per sequence through the ring (engine::RingAttention),
// and all decode tokens share one all-gather per layer. Every rank calls step() with the same
// plan, in the same order; rank 0 returns the tokens. A sampled row whose logits nothing on
// the host reads (no logprobs, no LogitAdjust) is drawn by the backend of the rank that
// computes it (Backend::sample: on a GPU no logits leave the device), with a uniform from rank
// 0's stream for its sequence; the others' logits go to rank 0, which samples them there.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "engine/sampler.h"
#include "models/llama.h"

namespace burst::models {

// A decode token that is not known yet where the plan is made: the token this sequence drew
// in the step right before this one (which must have sampled it). Rank 0 knows it and hands it
// to the other ranks at the step's start, so a planner can send the next decode step before
// the replies of the current one come back (the scheduler's lookahead).
constexpr int32_t kPreviousToken = -1;

struct SeqWork {
  uint64_t id = 0;
  bool decode = false;
  // Prefill: the chunk's tokens, at positions [start, start + tokens.size()); the sequence's
  // earlier chunks (positions [0, start)) must be cached already. Decode: one token at `start`,
  // which must be the sequence's next position (or kPreviousToken).
  std::vector<int32_t> tokens;
  int64_t start = 0;
  int64_t prompt_len = 0;  // the whole prompt: RoPE's sequence length for every chunk of it
  bool sample = false;     // sample from the last row (the prompt's last chunk; every decode)
  // Rank 0 makes the sequence's sampler from these at its first sample and keeps it (one
  // random stream per sequence, as a single-process run has).
  engine::SamplingParams sampling;
  // Rank 0 applies these to a copy of the logits before sampling (penalties need the
  // sequence's history, which rank 0 keeps: its prompt chunks and sampled tokens).
  engine::LogitAdjust adjust;
  // -1: none; n >= 0: rank 0 returns the sampled token's log-probability (log-softmax of the
  // model's raw logits, before adjust and temperature) and the n most likely ids'.
  int logprobs = -1;
  // Prefill chunks: -1: none; k >= 0: the log-probability of every prompt token this chunk's
  // rows predict (row p predicts token p + 1; the chunk's last row predicts next_token, the
  // first token of the next chunk) and the k most likely ids. Each rank computes its own rows'
  // (its shard of the chunk) and rank 0 gathers them in position order.
  int prompt_logprobs = -1;
  int32_t next_token = -1;
};

// The work of prefilling prompt tokens [start, start + len) of sequence id (sampling after
// the prompt's last chunk), and of feeding `token` at position pos after a prompt_len-token
// prompt: what every step planner (the scheduler, WorkerGroup::generate, generate_sharded)
// builds; adjust and logprobs stay at their defaults for the caller to set.
SeqWork prefill_work(uint64_t id, const std::vector<int32_t>& prompt, int64_t start, int64_t len,
                     const engine::SamplingParams& sampling);
SeqWork decode_work(uint64_t id, int32_t token, int64_t pos, int64_t prompt_len,
                    const engine::SamplingParams& sampling);

struct PromptTokenLogprob {
  int64_t pos = 0;  // of the token (>= 1: the first prompt token has none)
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};

struct PromptLogprobs {
  uint64_t id = 0;
  std::vector<PromptTokenLogprob> entries;  // in position order
};

struct StepPlan {
  std::vector<uint64_t> release;  // sequences to forget first (finished, cancelled)
  std::vector<SeqWork> seqs;
  engine::ShardLayout layout = engine::ShardLayout::kZigzag;  // of the prefill chunks
};

struct SampledToken {
  uint64_t id = 0;
  int32_t token = 0;
  bool has_logprob = false;  // SeqWork.logprobs >= 0
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // the SeqWork.logprobs most likely ids
};

struct StepResult {
  std::vector<SampledToken> tokens;  // rank 0: one per SeqWork with sample, in plan order
  engine::KvUsage kv;                // this rank's cache after the step
  int64_t rows = 0;                  // rows of this rank's forward
  std::vector<PromptLogprobs> prompt_logprobs;  // rank 0: SeqWorks with prompt_logprobs >= 0
};

class BatchRunner {
 public:
  BatchRunner(LlamaModel& model, engine::RingAttention& ring, engine::Communicator& comm)
      : model_(model), ring_(ring), comm_(comm) {}

  // What is wrong with the plan for this rank's state (empty: nothing). Every rank holds the
  // same state, so all refuse the same plan before any collective and the ring stays usable.
  Status validate(const StepPlan& plan) const;
  // Runs the plan (validate() first). after_layer runs on every rank after each layer.
  // launch() then finish().
  Result<StepResult> step(const StepPlan& plan, const LayerHook& after_layer = nullptr);
  // step() in two halves, for a caller that queues step n + 1 before step n's tokens reach the
  // host (the worker: the device never waits for the host's turnaround between two steps).
  // launch() runs the plan up to its queued device work; finish() returns the oldest launched
  // step's result (launch order). A step whose only draws are rank 0's backend's (no logits
  // for the host, no prompt logprobs, no other rank's draw: the usual decode step) returns
  // from launch() with its ids still on their way (Backend::sample_queued), and the next plan
  // may be launched at once; any other step completes inside launch(). Nothing of the host's
  // collectives runs in finish(), so ranks may finish at different moments. At most two
  // steps may be launched and not finished. A failed launch() leaves the group broken, as a
  // failed step() does.
  Status launch(const StepPlan& plan, const LayerHook& after_layer = nullptr);
  Result<StepResult> finish();
  // Whether the worker may launch `plan` behind a step whose reply is not written yet: a valid
  // plan of decode rows only (a few hundred launches, no prefill: the host is back at once)
  // whose draws are all rank 0's backend's, so launch() returns with its ids on their way
  // and runs no host collective. On rank 0 (false on the others, which draw nothing).
  bool queues(const StepPlan& plan) const;
  // Whether a step awaits finish(), and whether finish() would return without waiting.
  bool launched() const { return !launched_.empty(); }
  bool finish_ready() const;
  void release(uint64_t id);
  void release_all();
  engine::RingAttention& ring() { return ring_; }

 private:
  struct Sample;      // a sampled row of a step (batch.cpp)
  struct StepInputs;  // this rank's rows of a step and what they feed (batch.cpp)
  // A launched step: its result, and the sequences (draw order) of its draws whose ids
  // Backend::sampled() has still to hand over (rank 0's queued draws; empty once settled).
  struct Launched {
    StepResult result;
    std::vector<uint64_t> draws;
  };
  // Waits for l's ids and puts its tokens into its result; `latest`: l is the last launched
  // step, whose tokens a kPreviousToken of the next plan may name (drawn_last_).
  Status settle(Launched& l, bool latest);
  // Whether nothing but rank 0's device draws comes back from a step with these inputs (the
  // same on every rank: it follows from the plan), so nothing after its forward is a collective.
  static bool device_only(const StepInputs& in);
  // The step's rows on this rank: ids, positions, ring rows, RoPE spans, the rows sampled on
  // the device or brought to the host, the prompt rows to score.
  void build_inputs(const StepPlan& plan, StepInputs& in) const;
  // Prompt logprobs of sequence s: this rank scores its rows `mine` (position, logits row);
  // one all-gather of fixed-size records; rank 0 appends the merged entries to result.
  Status score_prompt(const StepPlan& plan, const SeqWork& s,
                      const std::vector<std::pair<int64_t, int64_t>>& mine,
                      const std::vector<float>& logits, StepResult& result);
  // Rank 0 draws the uniform of every device-drawn sample from its sequence's stream (greedy
  // draws none) into `device` (its own rows); those of rows that other ranks own reach them
  // in ONE broadcast (none when there are none), whatever the number of sequences.
  Status draw_uniforms(const StepPlan& plan, const std::vector<Sample>& samples, size_t remote_u,
                       SampleRows& device);
  // device_ids[k] on rank 0: the id drawn for device sample k (-1 for host samples). Those
  // that other ranks drew (`sampled`: this rank's ids, in SampleRows order) come in ONE
  // all-gather of `remote` slots per rank (none when there are none).
  // Decode tokens given as kPreviousToken become the tokens drawn in the step before. Drawn
  // by rank 0's backend (the usual decode step): ids -1 - k that the embedding reads where the
  // backend drew them, the other ranks' copies by ONE broadcast between the backends' memory
  // (queued, no host wait on GPUs). Otherwise rank 0 fills them in from what it knows and they
  // reach the other ranks in ONE host broadcast.
  Status resolve_previous(StepPlan& plan);
  Status gather_ids(const std::vector<Sample>& samples, size_t remote,
                    const std::vector<int32_t>& sampled, std::vector<int32_t>& device_ids);
  // The samples that need their logits on rank 0 (logprobs, LogitAdjust): today's path, one
  // broadcast of a logits row per such sample that another rank computed; rank 0 adjusts,
  // samples and scores them, and appends every sample's token to result.tokens in plan order.
  Status sample_on_host(const StepPlan& plan, const std::vector<Sample>& samples,
                        const std::vector<float>& logits, const std::vector<int32_t>& device_ids,
                        StepResult& result);

  LlamaModel& model_;
  engine::RingAttention& ring_;
  engine::Communicator& comm_;
  std::unordered_map<uint64_t, engine::Sampler> samplers_;  // rank 0
  std::unordered_map<uint64_t, int64_t> next_pos_;          // next position of each sequence
  std::unordered_map<uint64_t, engine::TokenHistory> histories_;  // rank 0, with an adjust
  // The sequences that sampled in the last step (every rank: it follows from the plans), and
  // what they drew (rank 0): a kPreviousToken of the next step is resolved from these.
  std::unordered_set<uint64_t> sampled_last_;
  std::unordered_map<uint64_t, int32_t> drawn_last_;
  // Of those, the ones rank 0's backend drew (every rank): their index among its draws, which
  // stay in its memory (Backend::drawn_ids), and how many it drew.
  std::unordered_map<uint64_t, int64_t> drawn_index_;
  int64_t drawn_count_ = 0;
  std::deque<Launched> launched_;  // launched, not finished; oldest first
};

}  // namespace burst::models
