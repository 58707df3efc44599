// The unit of work of the runtime: a StepPlan (the sequences of one step, each a prefill chunk
// or a decode token) and what a step returns (StepResult). A planner makes plans (the frontend's
// scheduler, the single-request driver); every rank of a group runs the same plan through its
// BatchRunner (runtime/batch_runner.h); the worker protocol carries both (server's step codec).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/kv_pages.h"
#include "engine/sampler.h"
#include "engine/sharding.h"

namespace burst::runtime {

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
  // Prefix caching: a new sequence's first chunk may start after prefix blocks that hold its
  // first reuse.size() x block_tokens tokens (its first pages on every rank, computed by
  // another sequence); start is then that many tokens.
  std::vector<int64_t> reuse;
};

// A full page of a running sequence (its rows [index x page_size, (index + 1) x page_size) on
// every rank: tokens [index x block_tokens, (index + 1) x block_tokens)) becomes prefix block
// `id`, which outlives the sequence until a plan evicts it.
struct PublishBlock {
  uint64_t seq = 0;
  int64_t index = 0;
  int64_t id = 0;
};

// The work of prefilling prompt tokens [start, start + len) of sequence id (sampling after
// the prompt's last chunk), and of feeding `token` at position pos after a prompt_len-token
// prompt: what every step planner (the scheduler, the single-request driver) builds; adjust and
// logprobs stay at their defaults for the caller to set.
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

// Tokens of one prefix block: one page on each of the ring's ranks (striped layout).
inline int64_t block_tokens(int ring_ranks, int page_size) {
  return int64_t{ring_ranks} * page_size;
}

// A rank applies a plan in this order: publish, release, evict, then the sequences' work.
struct StepPlan {
  std::vector<PublishBlock> publish;  // pages that become prefix blocks
  std::vector<uint64_t> release;      // sequences to forget (finished, cancelled)
  std::vector<int64_t> evict;         // prefix blocks to drop
  std::vector<SeqWork> seqs;
  engine::ShardLayout layout = engine::ShardLayout::kStriped;  // of the prefill chunks
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
  double ring_compute_ms = 0, ring_wait_ms = 0;  // this rank's ring, cumulative (RingStats)
};

}  // namespace burst::runtime
