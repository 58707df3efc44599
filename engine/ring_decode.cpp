// RingAttention's decode (engine/include/engine/ring_attention.h): every decode token of the
// step at once, each token's K/V cached on one rank (round robin by position), each rank's
// partial (o, lse) over its shard all-gathered and merged in rank order on every rank.
#include <cmath>
#include <string>
#include <vector>

#include "engine/ring_attention.h"

namespace burst::engine {

kernels::AttnParams RingAttention::decode_params(int layer, int64_t n_q, int64_t n,
                                                 const Tensor& q, int64_t q_row) {
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  kernels::AttnParams p;
  p.heads = shape_.heads;
  p.kv_heads = shape_.kv_heads;
  p.head_dim = shape_.head_dim;
  p.n_q = static_cast<int32_t>(n_q);
  kernels::set_packed_strides(p);
  p.lse_head_stride = n;  // the batch's lse is [heads, n]
  p.q = q.at(q_row * qw);
  p.k = cache_->k_pool(layer).data;
  p.v = cache_->v_pool(layer).data;
  p.page_size = cache_->page_size();
  if (fp8()) {  // the pool's FP8 rows, read as they lie
    p.kv_fp8 = true;
    p.k_row_stride = p.v_row_stride = kv_row_bytes(backend_, shape_, cache_->dtype());
  }
  p.mask = kernels::MaskKind::kNone;  // every cached key precedes (or is) the new token
  p.kv_settled = true;  // the pool: this step writes only each row's new (last) key
  p.scale = shape_.logit_scale / std::sqrt(static_cast<float>(shape_.head_dim));
  p.dtype = backend_.compute_dtype();
  p.o_dtype = DType::kF32;
  return p;
}

Status RingAttention::decode_each(int layer, const std::vector<const SeqRows*>& batch,
                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                  const DecodeOut& o) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const auto n = static_cast<int64_t>(batch.size());
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  for (int64_t b = 0; b < n; ++b) {
    const SeqRows& s = *batch[static_cast<size_t>(b)];
    // Round robin by position, so no shard grows faster than another.
    const int64_t len = cache_->length(s.seq);
    const bool mine = s.pos % world == rank;
    if (mine) {
      BURST_RETURN_IF_ERROR(
          cache_->write(s.seq, layer, len, k.rows(s.row, 1), v.rows(s.row, 1)));
    }
    kernels::AttnParams p = decode_params(layer, 1, n, q, s.row);
    p.n_kv = static_cast<int32_t>(len + (mine ? 1 : 0));
    p.kv_pages = tables_.at<int32_t>(table_offset_[static_cast<size_t>(b)]);
    p.o = static_cast<char*>(o.data) + b * qw * dtype_size(o.dtype);
    p.o_dtype = o.dtype;
    p.lse = pairs_.at<float>(n * qw + b);
    BURST_RETURN_IF_ERROR(backend_.attention(p));  // an empty shard gives lse -inf, o 0
  }
  return {};
}

Status RingAttention::decode_batched(int layer, const std::vector<const SeqRows*>& batch,
                                     const Tensor& q, const Tensor& k, const Tensor& v,
                                     const DecodeOut& o) {
  const auto n = static_cast<int64_t>(batch.size());
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  // Every decode token's k/v into its page (or nowhere, on the other ranks): one launch each.
  const int32_t* dst = tables_.at<int32_t>(decode_dst_);
  Tensor kp = cache_->k_pool(layer), vp = cache_->v_pool(layer);
  if (fp8()) {
    BURST_RETURN_IF_ERROR(backend_.quantize_kv(k.rows(batch[0]->row, n), shape_.kv_heads, dst, kp));
    BURST_RETURN_IF_ERROR(backend_.quantize_kv(v.rows(batch[0]->row, n), shape_.kv_heads, dst, vp));
  } else {
    BURST_RETURN_IF_ERROR(backend_.scatter_rows_pair(k.rows(batch[0]->row, n),
                                                     v.rows(batch[0]->row, n), dst, kp, vp));
  }
  kernels::AttnParams p = decode_params(layer, n, n, q, batch[0]->row);
  p.n_kv = decode_max_kv_;  // the longest row_kv_len of the step (begin_step)
  p.kv_pages = tables_.at<int32_t>(0);
  p.row_kv_len = tables_.at<int32_t>(decode_meta_);
  p.row_page_offset = tables_.at<int32_t>(decode_meta_ + n);
  p.o = o.data;
  p.o_dtype = o.dtype;
  p.lse = pairs_.at<float>(n * qw);
  return backend_.attention(p);
}

Status RingAttention::decode(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             const std::vector<int64_t>& positions, Tensor& out) {
  const int world = comm_.world_size();
  std::vector<const SeqRows*> batch;
  for (const SeqRows& s : step_) {
    if (s.decode) batch.push_back(&s);
  }
  if (batch.empty()) return {};
  const auto n = static_cast<int64_t>(batch.size());
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  for (const SeqRows* s : batch) {
    if (positions[static_cast<size_t>(s->row)] != s->pos) {
      return Status::error("ring decode: the token of sequence " + std::to_string(s->seq) +
                           " is at position " +
                           std::to_string(positions[static_cast<size_t>(s->row)]) +
                           ", the step says " + std::to_string(s->pos));
    }
  }
  // This rank's partials of the whole batch, o [n, qw] then lse [heads, n], fp32: one
  // all-gather per layer moves them all.
  const int64_t part = n * qw + int64_t{shape_.heads} * n;
  BURST_RETURN_IF_ERROR(ensure(pairs_, {part}, DType::kF32));
  if (world > 1) BURST_RETURN_IF_ERROR(ensure(gathered_, {world, part}, DType::kF32));
  // Decode tokens on consecutive rows (the scheduler puts them first) attend in ONE launch:
  // per-row K/V, each row with its own sequence's length and page table.
  bool in_order = true;
  for (int64_t b = 1; b < n && in_order; ++b) {
    in_order = batch[static_cast<size_t>(b)]->row == batch[0]->row + b;
  }
  // One rank with the batch's rows in order: the kernel writes the output itself (its
  // partials are the answer); else fp32 partials for the gather and the merge.
  const bool direct = world == 1 && in_order;
  Tensor dst_all;  // the batch's output rows, when they follow each other
  if (in_order) dst_all = out.rows(batch[0]->row, n);
  const DecodeOut o = direct ? DecodeOut{dst_all.data, dst_all.dtype}
                             : DecodeOut{pairs_.data, DType::kF32};
  BURST_RETURN_IF_ERROR(n > 1 && in_order ? decode_batched(layer, batch, q, k, v, o)
                                          : decode_each(layer, batch, q, k, v, o));
  if (direct) return {};
  // One rank, rows out of order: its partials are the answer, converted below.
  const Tensor& merged_all = world == 1 ? pairs_ : gathered_;
  if (world > 1) {
    BURST_RETURN_IF_ERROR(
        comm_.all_gather(pairs_.data, gathered_.data, static_cast<size_t>(part) * 4));
  }
  // Merge in rank order on every rank: the same operations in the same order give the same
  // bits everywhere, so the replicated decode never drifts between ranks. When the batch's rows
  // follow each other, the last merge writes the output (converted) itself.
  for (int r = 1; r < world; ++r) {
    const bool last = r == world - 1 && in_order;
    BURST_RETURN_IF_ERROR(merge(gathered_.at<float>(0), gathered_.at<float>(n * qw),
                                gathered_.at<float>(r * part),
                                gathered_.at<float>(r * part + n * qw), n, n,
                                last ? &dst_all : nullptr));
    if (last) return {};
  }
  for (int64_t b = 0; b < n;) {
    // Consecutive batch rows convert in one call.
    const int64_t first = batch[static_cast<size_t>(b)]->row;
    int64_t e = b + 1;
    while (e < n && batch[static_cast<size_t>(e)]->row == first + (e - b)) ++e;
    Tensor merged = merged_all;  // fp32 on this device; data and shape set here
    merged.data = merged_all.at(b * qw);
    merged.shape = {e - b, qw};
    Tensor dst = out.rows(first, e - b);
    BURST_RETURN_IF_ERROR(backend_.convert(merged, dst));
    b = e;
  }
  return {};
}

}  // namespace burst::engine
