// Generation on one process: prefill the prompt (positions 0..n-1), sample the first token
// from the last position's logits, then decode one token at a time until EOS, max_tokens, the
// KV capacity, or the callback asks to stop. Tokens are drawn on the model's backend
// (Backend::sample, with the request's seeded stream): on a GPU no logits reach the host.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "models/llama.h"

namespace burst::models {

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 64;
  engine::SamplingParams sampling;
  bool stop_at_eos = true;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_ms = 0;  // prompt forward + first sample: the time to first token
  double decode_ms = 0;   // every later token
  std::string finish_reason;  // "stop" (EOS), "length", "cancelled"
};

// Called with each sampled token; return false to stop (client gone).
using TokenCallback = std::function<bool(int32_t token)>;
// Called during the prefill after every layer with the fraction done (layers / all layers);
// return false to cancel the request before its first token (a long prompt takes minutes).
using ProgressCallback = std::function<bool(double fraction)>;

// Runs one request on `model`, using and then clearing `cache`.
Result<GenerateStats> generate(LlamaModel& model, engine::AttentionContext& cache,
                               const GenerateRequest& request, const TokenCallback& on_token,
                               const ProgressCallback& on_progress = nullptr);

}  // namespace burst::models

#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "models/batch.h"

namespace burst::models {

// Generation on one rank of a sequence-sharded group: every rank calls this with the same
// request. The prompt is sharded by `layout`, prefilled through the BurstAttention ring; the
// rank holding the last prompt position draws the first token on its backend with rank 0's
// uniform (BatchRunner), rank 0 broadcasts every token (so the sampler's random stream is the
// single-process one); decode runs the replicated token through the distributed flash-decode.
// on_token and on_progress are called on rank 0 only; after every prefill layer rank 0
// broadcasts whether to go on, so a cancel during a long prefill stops every rank at the next
// layer.
Result<GenerateStats> generate_sharded(LlamaModel& model, engine::RingAttention& ring,
                                       engine::Communicator& comm, engine::ShardLayout layout,
                                       const GenerateRequest& request,
                                       const TokenCallback& on_token,
                                       const ProgressCallback& on_progress = nullptr);

}  // namespace burst::models
