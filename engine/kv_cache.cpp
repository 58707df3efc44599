// LocalKvCache: the one-process attention context. Appends the new tokens' k/v, then runs the
// attention contract against everything cached, causal by absolute position.
#include <cmath>

#include "engine/attention_context.h"

namespace burst::engine {

Status alloc_kv_layers(Backend& backend, const AttentionShape& shape, int64_t capacity,
                       std::vector<Tensor>& k, std::vector<Tensor>& v) {
  if (capacity <= 0) return Status::error("kv cache: capacity must be > 0");
  const int64_t width = int64_t{shape.kv_heads} * shape.head_dim;
  BURST_RETURN_IF_ERROR(backend.check_fits(
      2 * shape.layers * capacity * width * dtype_size(backend.compute_dtype()),
      "KV cache of " + std::to_string(capacity) + " tokens"));
  for (int l = 0; l < shape.layers; ++l) {
    for (auto* list : {&k, &v}) {
      auto t = backend.alloc({capacity, width}, backend.compute_dtype());
      if (!t.ok()) {
        return Status::error("kv cache of " + std::to_string(capacity) + " tokens: " +
                             t.message());
      }
      list->push_back(t.take());
    }
  }
  return {};
}

Result<std::unique_ptr<LocalKvCache>> LocalKvCache::create(Backend& backend, AttentionShape shape,
                                                           int64_t capacity) {
  std::unique_ptr<LocalKvCache> c(new LocalKvCache(backend, shape, capacity));
  BURST_RETURN_IF_ERROR(alloc_kv_layers(backend, shape, capacity, c->k_, c->v_));
  c->lengths_.assign(static_cast<size_t>(shape.layers), 0);
  return c;
}

void LocalKvCache::clear() { lengths_.assign(lengths_.size(), 0); }

Status LocalKvCache::attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                            const std::vector<int64_t>& positions, Tensor& out) {
  if (layer < 0 || layer >= shape_.layers) return Status::error("kv cache: bad layer index");
  int64_t& len = lengths_[static_cast<size_t>(layer)];
  const int64_t rows = q.dim(0);
  if (rows == 0) return {};
  if (positions.empty() || positions[0] != len) {
    return Status::error("kv cache: new tokens must continue at position " + std::to_string(len));
  }
  if (len + rows > capacity_) {
    return Status::error("kv cache: " + std::to_string(len + rows) +
                         " tokens exceed its capacity of " + std::to_string(capacity_));
  }
  Tensor k_dst = k_[layer].rows(len, rows), v_dst = v_[layer].rows(len, rows);
  BURST_RETURN_IF_ERROR(backend_.copy(k, k_dst));
  BURST_RETURN_IF_ERROR(backend_.copy(v, v_dst));
  if (lse_.empty() || lse_.numel() < int64_t{shape_.heads} * rows) {
    auto t = backend_.alloc({int64_t{shape_.heads} * rows}, DType::kF32);
    if (!t.ok()) return t.status();
    lse_ = t.take();
  }
  kernels::AttnParams p;
  p.q = q.data;
  p.k = k_[layer].data;
  p.v = v_[layer].data;
  p.o = out.data;
  p.lse = lse_.as<float>();
  p.n_q = static_cast<int32_t>(rows);
  p.n_kv = static_cast<int32_t>(len + rows);
  p.heads = shape_.heads;
  p.kv_heads = shape_.kv_heads;
  p.head_dim = shape_.head_dim;
  kernels::set_packed_strides(p);
  p.q_start = positions[0];
  p.kv_start = 0;
  p.mask = kernels::MaskKind::kCausal;
  p.scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.dtype = backend_.compute_dtype();
  BURST_RETURN_IF_ERROR(backend_.attention(p));
  len += rows;
  return {};
}

}  // namespace burst::engine
