// RoPE frequencies as HF transformers computes them for LLaMA: inv_freq[i] = 1 / theta^(2i/d);
// "linear" scaling divides them by the factor; "dynamic" (NTK) grows theta once the sequence
// passes max_position_embeddings: theta * (factor * len / max_pos - (factor - 1))^(d / (d - 2)),
// with len = the largest position in the forward + 1 (as HF's dynamic update does).
//
// "yarn" (YaRN, arXiv 2309.00071; HF's _compute_yarn_parameters) keeps the fast pairs' frequency
// and divides the slow pairs' by the factor. Over the original context L, pair i turns
// L / (2 pi theta^(2i/d)) times; the pair index that turns r times is
//   cdim(r) = d ln(L / (2 pi r)) / (2 ln theta),
// and the ramp runs from low = cdim(beta_fast) to high = cdim(beta_slow) (floored and ceiled
// when truncate, then clamped to [0, d - 1]):
//   ramp_i = clamp((i - low) / (high - low), 0, 1)        (high += 0.001 when they are equal)
//   inv_freq_i = ramp_i / (factor theta^(2i/d)) + (1 - ramp_i) / theta^(2i/d)
// It does not depend on the sequence length. YaRN also multiplies cos and sin by m (HF's
// attention_scaling), which scales every attention logit by m^2: rope_logit_scale.
#pragma once

#include <cstdint>
#include <vector>

#include "models/config.h"

namespace burst::models {

// [head_dim / 2] inverse frequencies for a forward whose largest position is seq_len - 1.
std::vector<float> rope_inv_freq(const LlamaConfig& c, int64_t seq_len);

// HF's attention_scaling m: yarn's attention_factor when given, else with f = factor,
// g(s) = 0.1 s ln f + 1 (1 when f <= 1): g(mscale) / g(mscale_all_dim) when both are non-zero,
// else g(1). 1 for every other rope type.
double rope_attention_scaling(const LlamaConfig& c);

// m^2: what the attention's softmax scale is multiplied by (engine::AttentionShape::logit_scale),
// since the rotated q and k are each m times HF's unscaled ones.
float rope_logit_scale(const LlamaConfig& c);

}  // namespace burst::models
