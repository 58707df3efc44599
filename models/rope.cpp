#include "models/rope.h"

#include <algorithm>
#include <cmath>

namespace burst::models {
namespace {

constexpr double kPi = 3.14159265358979323846;

// theta^(2i/d) as HF evaluates it: the exponent in fp32, the power rounded to fp32 (within one
// ulp of torch's fp32 pow).
float pair_wavelength_factor(double theta, int64_t i, int64_t d) {
  const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
  return static_cast<float>(std::pow(theta, static_cast<double>(expo)));
}

// The (fractional) pair index whose rotation turns `rotations` times over `orig` positions.
double yarn_correction_dim(double rotations, int64_t d, double theta, int64_t orig) {
  return static_cast<double>(d) * std::log(static_cast<double>(orig) / (rotations * 2 * kPi)) /
         (2 * std::log(theta));
}

std::vector<float> yarn_inv_freq(const LlamaConfig& c) {
  const RopeScaling& y = c.rope_scaling;
  const int64_t d = c.head_dim;
  const double theta = c.rope_theta;
  double low = yarn_correction_dim(y.beta_fast, d, theta, y.original_max_position_embeddings);
  double high = yarn_correction_dim(y.beta_slow, d, theta, y.original_max_position_embeddings);
  if (y.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  // Clamped to [0, d - 1] (d, not d / 2: HF's bound, kept so the ramp is the same).
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  if (low == high) high += 0.001;  // a step instead of a division by zero
  // The ramp and the blend in fp32, step by step as HF's tensors compute them.
  const auto low_f = static_cast<float>(low);
  const auto span_f = static_cast<float>(high - low);
  std::vector<float> inv(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    const float w = pair_wavelength_factor(theta, i, d);
    const float extrapolated = 1.f / w;
    const float interpolated = 1.f / (y.factor * w);
    const float ramp = std::clamp((static_cast<float>(i) - low_f) / span_f, 0.f, 1.f);
    const float keep = 1.f - ramp;  // the share of the unscaled frequency
    inv[static_cast<size_t>(i)] = interpolated * (1.f - keep) + extrapolated * keep;
  }
  return inv;
}

}  // namespace

std::vector<float> rope_inv_freq(const LlamaConfig& c, int64_t seq_len) {
  if (c.rope_scaling.kind == RopeScaling::Kind::kYarn) return yarn_inv_freq(c);
  const int64_t d = c.head_dim;
  double base = c.rope_theta;
  const float factor = c.rope_scaling.factor;
  if (c.rope_scaling.kind == RopeScaling::Kind::kDynamic && seq_len > c.max_position_embeddings) {
    const double len = static_cast<double>(std::max(seq_len, c.max_position_embeddings));
    base *= std::pow(factor * len / static_cast<double>(c.max_position_embeddings) - (factor - 1.0),
                     static_cast<double>(d) / static_cast<double>(d - 2));
  }
  std::vector<float> inv(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    // HF evaluates base ** (2i / d) in fp32; rounding the double result to fp32 matches it to
    // within one ulp.
    const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
    inv[i] = static_cast<float>(1.0 / std::pow(base, static_cast<double>(expo)));
    if (c.rope_scaling.kind == RopeScaling::Kind::kLinear) inv[i] /= factor;
  }
  return inv;
}

double rope_attention_scaling(const LlamaConfig& c) {
  const RopeScaling& y = c.rope_scaling;
  if (y.kind != RopeScaling::Kind::kYarn) return 1.0;
  if (y.attention_factor > 0) return y.attention_factor;
  const double f = y.factor;
  auto g = [f](double s) { return f <= 1 ? 1.0 : 0.1 * s * std::log(f) + 1.0; };
  if (y.mscale != 0 && y.mscale_all_dim != 0) return g(y.mscale) / g(y.mscale_all_dim);
  return g(1.0);
}

float rope_logit_scale(const LlamaConfig& c) {
  const double m = rope_attention_scaling(c);
  return static_cast<float>(m * m);
}

}  // namespace burst::models
