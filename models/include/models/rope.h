// RoPE frequencies as HF transformers computes them for LLaMA: inv_freq[i] = 1 / theta^(2i/d);
// "linear" scaling divides them by the factor; "dynamic" (NTK) grows theta once the sequence
// passes max_position_embeddings: theta * (factor * len / max_pos - (factor - 1))^(d / (d - 2)),
// with len = the largest position in the forward + 1 (as HF's dynamic update does).
#pragma once

#include <cstdint>
#include <vector>

#include "models/config.h"

namespace burst::models {

std::vector<float> rope_inv_freq(const LlamaConfig& c, int64_t seq_len);

}  // namespace burst::models
