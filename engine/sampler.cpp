// Sampler: greedy, or softmax(logits / T) restricted to the top-k ids and then to the smallest
// prefix whose probability reaches top_p, drawn with a seeded 64-bit Mersenne twister.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace burst::engine {

std::string validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature)) {
    return "temperature must be a finite number >= 0";
  }
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return "top_p must be in (0, 1]";
  return {};
}

namespace {

using Scratch = std::vector<std::pair<float, int32_t>>;

// Probability mass as an unsigned fixed-point number of 2^-96 units. A mass p = exp(s - max)
// is in [0, 1], so it needs 97 bits and 2^31 of them sum in 128 bits without overflow: prefix
// sums are exact, hence the same in any summation order (the GPU's tree, our running sum).
// Masses below 2^-96 of the top one truncate to nothing; no 53-bit uniform could reach them.
using Mass = unsigned __int128;

// Truncates p (finite, in [0, 1]) to whole units. kernels/cuda/sampling.cu has the twin.
Mass to_mass(double p) {
  uint64_t b;
  std::memcpy(&b, &p, sizeof b);
  const int e = static_cast<int>((b >> 52) & 0x7ff);
  if (e == 0) return 0;  // zero or subnormal: far below one unit
  const uint64_t m = (b & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52);
  const int shift = e - 979;  // p = m * 2^(e - 1075) = m * 2^(e - 979) units
  if (shift >= 0) return Mass{m} << shift;
  return -shift >= 64 ? Mass{0} : Mass{m >> -shift};
}

// Round-to-nearest of each 64-bit half, then one rounded add (the product is exact): the same
// double on the host and the GPU for the same mass.
double to_double(Mass q) {
  return static_cast<double>(static_cast<uint64_t>(q >> 64)) * 0x1p64 +
         static_cast<double>(static_cast<uint64_t>(q));
}

int32_t sample_impl(const float* logits, int64_t vocab, const SamplingParams& p, double u,
                    Scratch& scratch) {
  if (p.temperature == 0.f) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return static_cast<int32_t>(best);
  }
  scratch.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    scratch[i] = {logits[i] / p.temperature, static_cast<int32_t>(i)};
  }
  // Descending by logit, ties by id, so the kept set never depends on sort stability.
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = scratch.size();
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < keep) {
    keep = static_cast<size_t>(p.top_k);
    std::partial_sort(scratch.begin(), scratch.begin() + keep, scratch.end(), by_logit);
  } else {
    std::sort(scratch.begin(), scratch.end(), by_logit);
  }
  // Softmax in double over the kept ids, shifted by the max for stability; cumulative masses
  // are exact sums of fixed-point masses (see to_mass), so the GPU twin, which adds in another
  // order, gets the very same prefixes.
  const double mx = scratch[0].first;
  std::vector<Mass> cum(keep);
  Mass run = 0;
  for (size_t i = 0; i < keep; ++i) cum[i] = run += to_mass(std::exp(scratch[i].first - mx));
  size_t cut = keep - 1;
  if (p.top_p < 1.f) {
    const double total = to_double(cum[keep - 1]);
    for (size_t i = 0; i < keep; ++i) {
      if (to_double(cum[i]) / total >= p.top_p) {
        cut = i;
        break;
      }
    }
  }
  // The last kept id absorbs rounding (u * kept rounded up to kept).
  const double target = u * to_double(cum[cut]);
  for (size_t i = 0; i <= cut; ++i) {
    if (target < to_double(cum[i])) return scratch[i].second;
  }
  return scratch[cut].second;
}

}  // namespace

int32_t sample_with_uniform(const float* logits, int64_t vocab, const SamplingParams& p,
                            double u) {
  Scratch scratch;
  return sample_impl(logits, vocab, p, u, scratch);
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

double Sampler::next_uniform() {
  // 53 random bits -> uniform in [0, 1).
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  // Greedy consumes no randomness, so a greedy step leaves the stream where it was.
  const double u = params_.temperature == 0.f ? 0.0 : next_uniform();
  return sample_impl(logits, vocab, params_, u, scratch_);
}

}  // namespace burst::engine
