// Token sampling on the host from fp32 logits: greedy (temperature 0), or temperature with
// optional top-k and top-p (nucleus), from a seeded generator so a seed replays a run exactly.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace burst::engine {

struct SamplingParams {
  float temperature = 0.f;  // 0: greedy; must be >= 0
  int top_k = 0;            // 0: off
  float top_p = 1.f;        // in (0, 1]; 1: off
  uint64_t seed = 0;
};

// Empty when valid, else what is wrong.
std::string validate(const SamplingParams& p);

// The one sampling implementation (the GPU twin, kernels/sampling_cuda.h, follows it): picks an
// id from logits [vocab] with the uniform u in [0, 1). Temperature 0: the argmax, ties to the
// lowest id, u unused. Else s = logits / T; keep the top_k largest s (0: all) in the order
// (s descending, id ascending); p = exp(s - s_max) in double, running masses summed exactly in
// 2^-96 fixed point (so any summation order gives the same prefixes); if top_p < 1 keep the
// shortest prefix whose normalised mass reaches top_p; return the first kept id whose running
// mass exceeds u * kept mass, else (rounding) the last kept id. p.seed is not used.
int32_t sample_with_uniform(const float* logits, int64_t vocab, const SamplingParams& p,
                            double u);

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks a token id from logits [vocab]: sample_with_uniform with u = next_uniform() when
  // temperature > 0; greedy draws nothing. Greedy ties go to the lowest id.
  int32_t sample(const float* logits, int64_t vocab);
  // The next uniform of this sampler's stream: 53 random bits, in [0, 1). A GPU sampler fed
  // these (one per sampled token, none for greedy) replays the host's choices.
  double next_uniform();

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace burst::engine
