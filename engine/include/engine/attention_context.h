// Where a layer's attention finds its keys. The model computes q, k, v for the new tokens and
// hands them here; a context stores k/v for later tokens and writes the attention output.
// The ring context (BurstAttention, engine/ring_attention.h) serves N ranks, one included, so
// the model code does not know how the sequence is sharded.
#pragma once

#include <vector>

#include "engine/backend.h"

namespace burst::engine {

class AttentionContext {
 public:
  virtual ~AttentionContext() = default;
  // q [rows, heads * head_dim], k and v [rows, kv_heads * head_dim], already rotated, for new
  // tokens at absolute `positions`; out [rows, heads * head_dim]. Causal by position.
  virtual Status attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& positions, Tensor& out) = 0;
  // Tokens held for layer 0 (every layer holds the same count between forwards).
  virtual int64_t length() const = 0;
  virtual int64_t capacity() const = 0;
  // Forgets every token (the next request starts at position 0).
  virtual void clear() = 0;
};

struct AttentionShape {
  int layers = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  // Multiplies the softmax scale 1 / sqrt(head_dim). RoPE variants that scale the rotated q and
  // k by m each (HF's attention_scaling, e.g. YaRN's) scale every logit by m^2: folding that into
  // the softmax scale is the same product, and the kernels never see m.
  float logit_scale = 1.f;
};

}  // namespace burst::engine
