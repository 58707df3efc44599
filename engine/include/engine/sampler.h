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

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Picks a token id from logits [vocab]. Greedy ties go to the lowest id.
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace burst::engine
