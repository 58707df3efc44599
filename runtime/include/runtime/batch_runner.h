// One step of continuous batching on one rank of a sequence-sharded group: a batch of
// sequences, each contributing a prefill chunk (its tokens sharded over the ranks,
// engine/sharding.h) or one decode token (replicated), runs as ONE forward: the GEMMs see every
// row of every sequence, attention runs per sequence through the ring (engine::RingAttention),
// and all decode tokens share one all-gather per layer. Every rank calls step() with the same
// plan, in the same order; rank 0 returns the tokens. A sampled row whose logits nothing on
// the host reads (no logprobs, no LogitAdjust) is drawn by the backend of the rank that
// computes it (Backend::sample: on a GPU no logits leave the device), with a uniform from rank
// 0's stream for its sequence; the others' logits go to rank 0, which samples them there.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "engine/sampler.h"
#include "models/model.h"
#include "runtime/step.h"

namespace burst::runtime {

using models::LayerHook;
using models::SampleRows;

class BatchRunner {
 public:
  BatchRunner(models::Model& model, engine::RingAttention& ring, engine::Communicator& comm)
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
  struct Sample;      // a sampled row of a step (batch_runner.cpp)
  struct StepInputs;  // this rank's rows of a step and what they feed (batch_runner.cpp)
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
  // A decode token of a plan that rank 0's backend drew in the step before and still holds:
  // plan.seqs[seq]'s token is that backend's draw `index` (Backend::DrawnId).
  struct DrawnPrevious {
    size_t seq;
    int64_t index;
  };
  // The step's rows on this rank: ids (`drawn`, in plan order: the rows the backend reads from
  // its draws), positions, ring rows, RoPE spans, the rows sampled on the device or brought to
  // the host, the prompt rows to score.
  void build_inputs(const StepPlan& plan, const std::vector<DrawnPrevious>& drawn,
                    StepInputs& in) const;
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
  // by rank 0's backend (the usual decode step): they stay kPreviousToken in the plan and go
  // into `drawn`, which the embedding reads where the backend drew them, the other ranks'
  // copies by ONE broadcast between the backends' memory (queued, no host wait on GPUs).
  // Otherwise rank 0 fills them in from what it knows and they reach the other ranks in ONE
  // host broadcast.
  Status resolve_previous(StepPlan& plan, std::vector<DrawnPrevious>& drawn);
  Status gather_ids(const std::vector<Sample>& samples, size_t remote,
                    const std::vector<int32_t>& sampled, std::vector<int32_t>& device_ids);
  // The samples that need their logits on rank 0 (logprobs, LogitAdjust): today's path, one
  // broadcast of a logits row per such sample that another rank computed; rank 0 adjusts,
  // samples and scores them, and appends every sample's token to result.tokens in plan order.
  Status sample_on_host(const StepPlan& plan, const std::vector<Sample>& samples,
                        const std::vector<float>& logits, const std::vector<int32_t>& device_ids,
                        StepResult& result);

  // What this rank keeps of one sequence between steps (release() drops it whole).
  struct SeqState {
    int64_t next_pos = 0;                        // the position its next step starts at
    std::optional<engine::Sampler> sampler;      // rank 0: made at its first sample
    std::optional<engine::TokenHistory> history;  // rank 0, with an adjust: prompt + drawn ids
    // The last step's draw (a kPreviousToken of the next plan is resolved from it): whether
    // it sampled (every rank: it follows from the plans), the id (rank 0, once known), and its
    // index among rank 0's backend's draws, which stay in its memory (every rank; -1: drawn
    // elsewhere).
    bool sampled_last = false;
    std::optional<int32_t> drawn_last;
    int64_t drawn_index = -1;
  };
  // The state of `id` (made on first use).
  SeqState& seq(uint64_t id) { return seqs_[id]; }
  // Forgets every sequence's last draw (a new step is launched).
  void clear_last_draws();

  models::Model& model_;
  engine::RingAttention& ring_;
  engine::Communicator& comm_;
  std::unordered_map<uint64_t, SeqState> seqs_;
  int64_t drawn_count_ = 0;  // draws of rank 0's backend in the last step
  std::deque<Launched> launched_;  // launched, not finished; oldest first
};

}  // namespace burst::runtime
