// Token sampling on the host from fp32 logits: greedy (temperature 0), or temperature with
// optional top-k, min-p and top-p (nucleus), from a seeded generator so a seed replays a run
// exactly.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace burst::engine {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy; must be >= 0
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // in (0, 1]; 1: off
  uint64_t seed = 0;
  float min_p = 0.f;        // in [0, 1]; 0: off (vLLM's min_p: kept ids have p >= min_p p_max)
};

// Empty when valid, else what is wrong.
std::string validate(const SamplingParams& p);

// The one sampling implementation (the GPU twin, kernels/sampling_cuda.h, follows it): picks an
// id from logits [vocab] with the uniform u in [0, 1). Temperature 0: the argmax, ties to the
// lowest id, u unused. Else s = logits / T; keep the top_k largest s (0: all) in the order
// (s descending, id ascending); p = exp(s - s_max) in double (p / p_max, as s_max's p is 1);
// if min_p > 0 keep, of those, the ids with p >= min_p (a prefix of the order, s_max's id always
// among them: counted, so the count does not depend on the order either); running masses summed
// exactly in 2^-96 fixed point (so any summation order gives the same prefixes); if top_p < 1
// keep the shortest prefix whose normalised mass (of the ids kept so far) reaches top_p; return
// the first kept id whose running mass exceeds u * kept mass, else (rounding) the last kept id.
// top_k and min_p both keep a prefix, so their order does not matter (vLLM applies min_p
// first). p.seed is not used.
int32_t sample_with_uniform(const float* logits, int64_t vocab, const SamplingParams& p,
                            double u);

// What is applied to a copy of a sequence's logits before sample_with_uniform (on the host,
// rank 0), in this order (vLLM's meanings):
//   logit_bias: logits[id] += bias (OpenAI: bias in [-100, 100]);
//   min_tokens: eos_id's logit is -inf while fewer than min_tokens tokens were generated;
//   repetition_penalty r (> 0; 1: off): for every id seen in the prompt or the output, a
//     positive logit is divided by r, a negative one multiplied by r;
//   frequency_penalty f, presence_penalty p (in [-2, 2]): logits[id] -= f * c + p * (c > 0),
//     c = the times id was generated (the output only, not the prompt).
// Sampling itself stays sample_with_uniform's contract (the GPU twin's too).
struct LogitAdjust {
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  float repetition_penalty = 1.f;
  std::vector<std::pair<int32_t, float>> logit_bias;
  int min_tokens = 0;
  bool active() const {
    return presence_penalty != 0.f || frequency_penalty != 0.f || repetition_penalty != 1.f ||
           !logit_bias.empty() || min_tokens > 0;
  }
};

// Empty when valid for a vocabulary of `vocab` ids, else what is wrong.
std::string validate(const LogitAdjust& a, int64_t vocab);

// A sequence's token history for LogitAdjust: the ids of its prompt (fed chunk by chunk) and
// how often each id was generated.
struct TokenHistory {
  std::unordered_map<int32_t, int> generated;  // id -> count
  std::unordered_set<int32_t> seen;            // ids of the prompt and the output
  int64_t generated_total = 0;
  void add_prompt(const int32_t* ids, size_t n);
  void add_generated(int32_t id);
};

// Applies `a` to logits [vocab] in place (see LogitAdjust for the order). eos_id < 0: no EOS.
void adjust_logits(float* logits, int64_t vocab, const LogitAdjust& a, const TokenHistory& h,
                   int32_t eos_id);

// log_softmax(logits)[token], computed in double, and (top_n > 0) the top_n largest
// log-probabilities (descending, ties to the lower id) in *top.
float log_softmax_at(const float* logits, int64_t vocab, int32_t token, int top_n,
                     std::vector<std::pair<int32_t, float>>* top);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks a token id from logits [vocab]: sample_with_uniform with u = next_uniform() when
  // temperature > 0; greedy draws nothing. Greedy ties go to the lowest id.
  int32_t sample(const float* logits, int64_t vocab);
  // The next uniform of this sampler's stream: 53 random bits, in [0, 1). A GPU sampler fed
  // these (one per sampled token, none for greedy) replays the host's choices.
  double next_uniform();
  // The uniform the next sample() would use, consumed: next_uniform() when temperature > 0,
  // else 0 (greedy draws nothing). sample_with_uniform(logits, vocab, params(), draw_uniform())
  // on any backend (Backend::sample) is sample(logits, vocab).
  double draw_uniform();
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace burst::engine
