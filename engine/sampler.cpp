// Sampler: greedy, or softmax(logits / T) restricted to the top-k ids, to the ids at least min_p
// times as likely as the most likely one, and then to the smallest prefix whose probability
// reaches top_p, drawn with a seeded 64-bit Mersenne twister.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/sampling_mass.h"

namespace burst::engine {

std::string validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature)) {
    return "temperature must be a finite number >= 0";
  }
  if (p.top_k < 0) return "top_k must be >= 0";
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return "top_p must be in (0, 1]";
  if (!(p.min_p >= 0.f && p.min_p <= 1.f)) return "min_p must be in [0, 1]";
  return {};
}

std::string validate(const LogitAdjust& a, int64_t vocab) {
  auto in = [](float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; };
  if (!in(a.presence_penalty, -2.f, 2.f)) return "presence_penalty must be in [-2, 2]";
  if (!in(a.frequency_penalty, -2.f, 2.f)) return "frequency_penalty must be in [-2, 2]";
  if (!(std::isfinite(a.repetition_penalty) && a.repetition_penalty > 0.f)) {
    return "repetition_penalty must be a finite number > 0";
  }
  if (a.min_tokens < 0) return "min_tokens must be >= 0";
  for (const auto& [id, bias] : a.logit_bias) {
    if (id < 0 || id >= vocab) {
      return "logit_bias: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
             std::to_string(vocab) + ")";
    }
    if (!in(bias, -100.f, 100.f)) return "logit_bias values must be in [-100, 100]";
  }
  return {};
}

void TokenHistory::add_prompt(const int32_t* ids, size_t n) {
  for (size_t i = 0; i < n; ++i) seen.insert(ids[i]);
}

void TokenHistory::add_generated(int32_t id) {
  ++generated[id];
  seen.insert(id);
  ++generated_total;
}

void adjust_logits(float* logits, int64_t vocab, const LogitAdjust& a, const TokenHistory& h,
                   int32_t eos_id) {
  for (const auto& [id, bias] : a.logit_bias) {
    if (id >= 0 && id < vocab) logits[id] += bias;
  }
  if (h.generated_total < a.min_tokens && eos_id >= 0 && eos_id < vocab) {
    logits[eos_id] = -std::numeric_limits<float>::infinity();
  }
  if (a.repetition_penalty != 1.f) {
    for (int32_t id : h.seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[id];
      l = l > 0 ? l / a.repetition_penalty : l * a.repetition_penalty;
    }
  }
  if (a.frequency_penalty != 0.f || a.presence_penalty != 0.f) {
    for (const auto& [id, count] : h.generated) {
      if (id < 0 || id >= vocab) continue;
      logits[id] -= a.frequency_penalty * static_cast<float>(count) +
                    (count > 0 ? a.presence_penalty : 0.f);
    }
  }
}

float log_softmax_at(const float* logits, int64_t vocab, int32_t token, int top_n,
                     std::vector<std::pair<int32_t, float>>* top) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  if (top) {
    top->clear();
    const auto n = static_cast<size_t>(std::min<int64_t>(std::max(top_n, 0), vocab));
    if (n > 0) {
      std::vector<int32_t> ids(static_cast<size_t>(vocab));
      for (int64_t i = 0; i < vocab; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(i);
      std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(),
                        [&](int32_t x, int32_t y) {
                          return logits[x] != logits[y] ? logits[x] > logits[y] : x < y;
                        });
      for (size_t i = 0; i < n; ++i) {
        top->push_back({ids[i], static_cast<float>(static_cast<double>(logits[ids[i]]) - lse)});
      }
    }
  }
  if (token < 0 || token >= vocab) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(static_cast<double>(logits[token]) - lse);
}

namespace {

using Scratch = std::vector<std::pair<float, int32_t>>;

using kernels::Mass;
using kernels::to_double;
using kernels::to_mass;

// Descending by logit, ties by id, so the kept set never depends on sort stability.
bool by_logit(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

// The candidates in descending order, sorted only as far as the draw needs: without top-k
// (the OpenAI default) the whole vocabulary is kept, and a full sort of 32000 ids per token per
// sequence cost milliseconds on the step loop's thread. The masses' total needs no order (the
// fixed-point sums are exact), and the draw stops at the first prefix whose mass passes the
// target, which a peaked distribution reaches within the first few dozen ids. The candidates
// are the first `kept` of c, of which the first `sorted` are in order already; extend(n) sorts
// the first n (in chunks that double) and appends their running masses to `cum`.
class SortedPrefix {
 public:
  SortedPrefix(Scratch& c, size_t kept, size_t sorted, double mx)
      : c_(c), kept_(kept), sorted_(sorted), mx_(mx) {}
  size_t size() const { return cum_.size(); }
  Mass cum(size_t i) const { return cum_[i]; }
  int32_t id(size_t i) const { return c_[i].second; }
  void extend(size_t n) {
    n = std::min(n, kept_);
    if (n <= sorted_) return append_masses(n);
    const size_t want = std::max(n, std::min(kept_, std::max<size_t>(64, 2 * sorted_)));
    auto first = c_.begin() + static_cast<std::ptrdiff_t>(sorted_);
    auto mid = c_.begin() + static_cast<std::ptrdiff_t>(want);
    auto last = c_.begin() + static_cast<std::ptrdiff_t>(kept_);
    if (mid != last) std::nth_element(first, mid, last, by_logit);
    std::sort(first, mid, by_logit);
    sorted_ = want;
    append_masses(n);
  }

 private:
  void append_masses(size_t n) {
    Mass run = cum_.empty() ? Mass{0} : cum_.back();
    while (cum_.size() < n) {
      run += to_mass(std::exp(c_[cum_.size()].first - mx_));
      cum_.push_back(run);
    }
  }
  Scratch& c_;
  size_t kept_, sorted_;
  double mx_;
  std::vector<Mass> cum_;
};

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
  size_t keep = scratch.size();
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < keep) {
    keep = static_cast<size_t>(p.top_k);
    std::partial_sort(scratch.begin(), scratch.begin() + keep, scratch.end(), by_logit);
  }
  // Softmax in double over the kept ids, shifted by the max for stability; cumulative masses
  // are exact sums of fixed-point masses (see to_mass), so the GPU twin, which adds in another
  // order, gets the very same prefixes.
  double mx = scratch[0].first;
  for (size_t i = 1; i < keep; ++i) mx = std::max(mx, static_cast<double>(scratch[i].first));
  size_t sorted_prefix = keep < scratch.size() ? keep : 0;
  if (p.min_p > 0.f) {
    // min_p: the ids with exp(s - mx) >= min_p, a prefix of the descending order, moved to the
    // front so the kept ids are again the first `keep` candidates. A range top_k sorted is
    // partitioned already (the kept ids lead it), and partition then swaps nothing.
    const double floor = static_cast<double>(p.min_p);
    const auto first = scratch.begin();
    const auto last = first + static_cast<std::ptrdiff_t>(keep);
    const auto kept_end = std::partition(first, last, [&](const std::pair<float, int32_t>& c) {
      return std::exp(c.first - mx) >= floor;
    });
    keep = static_cast<size_t>(kept_end - first);
    sorted_prefix = std::min(sorted_prefix, keep);
  }
  Mass total = 0;
  for (size_t i = 0; i < keep; ++i) total += to_mass(std::exp(scratch[i].first - mx));
  SortedPrefix sorted(scratch, keep, sorted_prefix, mx);
  // cut: the last kept id in descending order (top-p keeps the shortest prefix whose
  // normalised mass reaches top_p); mass: the running mass through it.
  size_t cut = keep - 1;
  Mass mass = total;
  if (p.top_p < 1.f) {
    const double whole = to_double(total);
    for (size_t i = 0; i < keep; ++i) {
      if (i == sorted.size()) sorted.extend(i + 1);
      if (to_double(sorted.cum(i)) / whole >= p.top_p) {
        cut = i;
        mass = sorted.cum(i);
        break;
      }
    }
  }
  // The last kept id absorbs rounding (u * kept rounded up to kept).
  const double target = u * to_double(mass);
  for (size_t i = 0; i <= cut; ++i) {
    if (i == sorted.size()) sorted.extend(i + 1);
    if (target < to_double(sorted.cum(i))) return sorted.id(i);
  }
  sorted.extend(cut + 1);
  return sorted.id(cut);
}

}  // namespace

int32_t sample_with_uniform(const float* logits, int64_t vocab, const SamplingParams& p,
                            double u) {
  // Kept per thread: Backend::sample calls this once per row and token, and a fresh buffer of
  // vocab pairs (256 KB for 32000 ids) per call would be an allocation on every decode step.
  thread_local Scratch scratch;
  return sample_impl(logits, vocab, p, u, scratch);
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

double Sampler::next_uniform() {
  // 53 random bits -> uniform in [0, 1).
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);
}

double Sampler::draw_uniform() {
  // Greedy consumes no randomness, so a greedy step leaves the stream where it was.
  return params_.temperature == 0.f ? 0.0 : next_uniform();
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  return sample_impl(logits, vocab, params_, draw_uniform(), scratch_);
}

}  // namespace burst::engine
