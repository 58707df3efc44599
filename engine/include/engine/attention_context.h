// Where a layer's attention finds its keys. The model computes q, k, v for the new tokens and
// hands them here; a context stores k/v for later tokens and writes the attention output.
// LocalKvCache serves one process; the ring context (BurstAttention) serves N ranks with the
// same interface, so the model code does not know how the sequence is sharded.
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
};

// Per-layer K and V buffers of `capacity` rows each, [capacity, kv_heads * head_dim] in the
// backend's compute dtype: the storage of every attention context.
Status alloc_kv_layers(Backend& backend, const AttentionShape& shape, int64_t capacity,
                       std::vector<Tensor>& k, std::vector<Tensor>& v);

// A single-process KV cache of `capacity` tokens per layer. New tokens must continue the
// sequence (positions length(), length() + 1, ...).
class LocalKvCache final : public AttentionContext {
 public:
  static Result<std::unique_ptr<LocalKvCache>> create(Backend& backend, AttentionShape shape,
                                                      int64_t capacity);
  Status attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const std::vector<int64_t>& positions, Tensor& out) override;
  int64_t length() const override { return lengths_.empty() ? 0 : lengths_[0]; }
  int64_t capacity() const override { return capacity_; }
  void clear() override;

 private:
  LocalKvCache(Backend& backend, AttentionShape shape, int64_t capacity)
      : backend_(backend), shape_(shape), capacity_(capacity) {}
  Backend& backend_;
  AttentionShape shape_;
  int64_t capacity_;
  std::vector<Tensor> k_, v_;      // per layer [capacity, kv_heads * head_dim]
  std::vector<int64_t> lengths_;   // per layer
  Tensor lse_;                     // scratch [heads, rows], grown on demand
};

}  // namespace burst::engine
