#include "models/rope.h"

#include <algorithm>
#include <cmath>

namespace burst::models {

std::vector<float> rope_inv_freq(const LlamaConfig& c, int64_t seq_len) {
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

}  // namespace burst::models
