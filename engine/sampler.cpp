// Sampler: greedy, or softmax(logits / T) restricted to the top-k ids and then to the smallest
// prefix whose probability reaches top_p, drawn with a seeded 64-bit Mersenne twister.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

namespace burst::engine {

std::string validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature)) {
    return "temperature must be a finite number >= 0";
  }
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return "top_p must be in (0, 1]";
  return {};
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.f) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return static_cast<int32_t>(best);
  }
  scratch_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    scratch_[i] = {logits[i] / params_.temperature, static_cast<int32_t>(i)};
  }
  // Descending by logit, ties by id, so the kept set never depends on sort stability.
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = scratch_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = static_cast<size_t>(params_.top_k);
    std::partial_sort(scratch_.begin(), scratch_.begin() + keep, scratch_.end(), by_logit);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_logit);
  }
  // Softmax in double over the kept ids, shifted by the max for stability.
  const double mx = scratch_[0].first;
  std::vector<double> prob(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += prob[i] = std::exp(scratch_[i].first - mx);
  if (params_.top_p < 1.f) {
    double cum = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += prob[i] / sum;
      if (cum >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += prob[i];
  }
  // 53 random bits -> uniform in [0, 1); the last kept id absorbs rounding.
  const double u = static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0) * sum;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += prob[i];
    if (u < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

}  // namespace burst::engine
