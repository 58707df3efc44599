#include "engine/ring_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

namespace burst::engine {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTagKv = 1;

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Element `i` of a tensor's storage, whatever its dtype.
template <typename T = void>
T* at(const Tensor& t, int64_t i) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + i * dtype_size(t.dtype));
}

}  // namespace

Result<std::unique_ptr<RingAttention>> RingAttention::create(Backend& backend, Communicator& comm,
                                                             AttentionShape shape,
                                                             int64_t capacity) {
  std::unique_ptr<RingAttention> r(new RingAttention(backend, comm, shape, capacity));
  BURST_RETURN_IF_ERROR(alloc_kv_layers(backend, shape, capacity, r->k_, r->v_));
  r->lengths_.assign(static_cast<size_t>(shape.layers), 0);
  return r;
}

void RingAttention::begin_prefill(const ShardPlan& plan) {
  clear();
  plan_ = plan;
  decoding_ = false;
}

void RingAttention::begin_decode() { decoding_ = true; }

void RingAttention::clear() {
  lengths_.assign(lengths_.size(), 0);
  decoding_ = false;
}

Status RingAttention::ensure(Tensor& t, std::vector<int64_t> shape, DType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (!t.empty() && t.dtype == dtype && t.numel() >= numel) {
    t.shape = std::move(shape);  // a view of the first numel elements
    return {};
  }
  t = Tensor();
  auto a = backend_.alloc(std::move(shape), dtype);
  if (!a.ok()) return Status::error("ring scratch: " + a.message());
  t = a.take();
  return {};
}

Status RingAttention::attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             const std::vector<int64_t>& positions, Tensor& out) {
  if (layer < 0 || layer >= shape_.layers) return Status::error("ring: bad layer index");
  if (decoding_) {
    if (q.dim(0) != 1) return Status::error("ring decode: one token per step");
    return decode(layer, q, k, v, positions[0], out);
  }
  const int64_t rows = plan_.local_rows(comm_.rank());
  if (q.dim(0) != rows) {
    return Status::error("ring prefill: rank " + std::to_string(comm_.rank()) + " got " +
                         std::to_string(q.dim(0)) + " rows, its shard has " +
                         std::to_string(rows));
  }
  return prefill(layer, q, k, v, out);
}

Status RingAttention::prefill(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                              Tensor& out) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const int64_t rows = plan_.local_rows(rank);
  const int64_t kvw = int64_t{shape_.kv_heads} * shape_.head_dim;
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  const DType dt = backend_.compute_dtype();
  // A block is K rows then V rows, one buffer, so one transfer moves both.
  BURST_RETURN_IF_ERROR(ensure(block_[0], {2 * rows, kvw}, dt));
  BURST_RETURN_IF_ERROR(ensure(block_[1], {2 * rows, kvw}, dt));
  BURST_RETURN_IF_ERROR(ensure(o_part_, {rows, qw}, DType::kF32));
  BURST_RETURN_IF_ERROR(ensure(lse_part_, {shape_.heads * rows}, DType::kF32));
  BURST_RETURN_IF_ERROR(ensure(o_acc_, {rows, qw}, DType::kF32));
  BURST_RETURN_IF_ERROR(ensure(lse_acc_, {shape_.heads * rows}, DType::kF32));
  // Nothing seen yet: o 0 and lse -inf, so the first merge takes the partial as is.
  BURST_RETURN_IF_ERROR(backend_.fill_random(o_acc_, 0, 0.f, /*constant=*/true));
  BURST_RETURN_IF_ERROR(backend_.fill_random(lse_acc_, 0, kNegInf, /*constant=*/true));

  // Step 0's block is our own k/v.
  Tensor own_k = block_[0].rows(0, rows), own_v = block_[0].rows(rows, rows);
  BURST_RETURN_IF_ERROR(backend_.copy(k, own_k));
  BURST_RETURN_IF_ERROR(backend_.copy(v, own_v));
  const std::vector<Segment> q_segs = plan_.segments(rank);
  const int next = (rank + 1) % world, prev = (rank - 1 + world) % world;
  const float scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
  const size_t block_bytes = static_cast<size_t>(block_[0].bytes());

  for (int s = 0; s < world; ++s) {
    Tensor& cur = block_[transfers_ ? s % 2 : 0];
    Tensor& nxt = block_[(s + 1) % 2];
    // Double buffer: post the transfer of the block for step s + 1 before computing step s.
    // `cur` is only read while it is being sent; `nxt` is not touched until its recv completes.
    std::unique_ptr<CommHandle> xfer;
    if (s + 1 < world && transfers_) {
      auto h = comm_.isendrecv(cur.data, next, nxt.data, prev, block_bytes, kTagKv);
      if (!h.ok()) return h.status();
      xfer = h.take();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int src = (rank - s + world) % world;
    for (const Segment& qs : q_segs) {
      for (const Segment& ks : plan_.segments(src)) {
        const auto rel = kernels::block_relation(qs.pos, qs.len, ks.pos, ks.len);
        if (rel == kernels::BlockRelation::kSkip) continue;  // keys all after the queries
        kernels::AttnParams p;
        p.heads = shape_.heads;
        p.kv_heads = shape_.kv_heads;
        p.head_dim = shape_.head_dim;
        p.n_q = static_cast<int32_t>(qs.len);
        p.n_kv = static_cast<int32_t>(ks.len);
        kernels::set_packed_strides(p);
        p.lse_head_stride = rows;  // partial lse laid out [heads, rows] over all local rows
        p.q = at(q, qs.row * qw);
        p.k = at(cur, ks.row * kvw);
        p.v = at(cur, (rows + ks.row) * kvw);
        p.o = at(o_part_, qs.row * qw);
        p.lse = at<float>(lse_part_, qs.row);
        p.q_start = qs.pos;
        p.kv_start = ks.pos;
        p.mask = rel == kernels::BlockRelation::kFull ? kernels::MaskKind::kNone
                                                      : kernels::MaskKind::kCausal;
        p.scale = scale;
        p.dtype = dt;
        p.o_dtype = DType::kF32;  // partials merge in fp32, never rounded between hops
        BURST_RETURN_IF_ERROR(backend_.attention(p));
        kernels::MergeParams m;
        m.o_a = at<float>(o_acc_, qs.row * qw);
        m.lse_a = at<float>(lse_acc_, qs.row);
        m.o_b = at<float>(o_part_, qs.row * qw);
        m.lse_b = at<float>(lse_part_, qs.row);
        m.o_row_stride = qw;
        m.o_head_stride = shape_.head_dim;
        m.lse_head_stride = rows;
        m.rows = static_cast<int32_t>(qs.len);
        m.heads = shape_.heads;
        m.head_dim = shape_.head_dim;
        BURST_RETURN_IF_ERROR(backend_.merge(m));
      }
    }
    // Host time of the compute: exact on CPU; on a GPU the ops are queued, so the benchmark
    // measures with events instead.
    const auto t1 = std::chrono::steady_clock::now();
    // The next step reads `nxt` (it must have arrived) and the step after overwrites `cur`
    // (our send of it must be done).
    if (xfer) BURST_RETURN_IF_ERROR(xfer->wait());
    const auto t2 = std::chrono::steady_clock::now();
    stats_.compute_ms += ms_between(t0, t1);
    stats_.wait_ms += ms_between(t1, t2);
    ++stats_.steps;
  }
  BURST_RETURN_IF_ERROR(backend_.convert(o_acc_, out));

  // Cache the real tokens of our shard (padding is never attended to again).
  int64_t& len = lengths_[static_cast<size_t>(layer)];
  len = 0;
  for (const Segment& sg : q_segs) {
    const int64_t valid = std::clamp<int64_t>(plan_.prompt_len - sg.pos, 0, sg.len);
    if (valid == 0) continue;
    if (len + valid > capacity_) return Status::error("ring kv cache: shard exceeds capacity");
    Tensor kd = k_[layer].rows(len, valid), vd = v_[layer].rows(len, valid);
    BURST_RETURN_IF_ERROR(backend_.copy(k.rows(sg.row, valid), kd));
    BURST_RETURN_IF_ERROR(backend_.copy(v.rows(sg.row, valid), vd));
    len += valid;
  }
  return {};
}

Status RingAttention::decode(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             int64_t pos, Tensor& out) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  int64_t& len = lengths_[static_cast<size_t>(layer)];
  // Round robin by position, so no shard grows faster than another.
  if (pos % world == rank) {
    if (len + 1 > capacity_) return Status::error("ring kv cache: decode exceeds capacity");
    Tensor kd = k_[layer].rows(len, 1), vd = v_[layer].rows(len, 1);
    BURST_RETURN_IF_ERROR(backend_.copy(k, kd));
    BURST_RETURN_IF_ERROR(backend_.copy(v, vd));
    ++len;
  }
  const int64_t pair = qw + shape_.heads;  // o then lse, fp32
  BURST_RETURN_IF_ERROR(ensure(o_part_, {pair}, DType::kF32));
  BURST_RETURN_IF_ERROR(ensure(gathered_, {world, pair}, DType::kF32));
  kernels::AttnParams p;
  p.heads = shape_.heads;
  p.kv_heads = shape_.kv_heads;
  p.head_dim = shape_.head_dim;
  p.n_q = 1;
  p.n_kv = static_cast<int32_t>(len);
  kernels::set_packed_strides(p);
  p.q = q.data;
  p.k = k_[layer].data;
  p.v = v_[layer].data;
  p.o = o_part_.data;
  p.lse = at<float>(o_part_, qw);
  p.mask = kernels::MaskKind::kNone;  // every cached key precedes (or is) the new token
  p.scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.dtype = backend_.compute_dtype();
  p.o_dtype = DType::kF32;
  BURST_RETURN_IF_ERROR(backend_.attention(p));  // an empty shard gives lse -inf, o 0
  BURST_RETURN_IF_ERROR(comm_.all_gather(o_part_.data, gathered_.data,
                                         static_cast<size_t>(pair) * 4));
  // Merge in rank order on every rank: the same operations in the same order give the same
  // bits everywhere, so the replicated decode never drifts between ranks.
  for (int r = 1; r < world; ++r) {
    kernels::MergeParams m;
    m.o_a = at<float>(gathered_, 0);
    m.lse_a = at<float>(gathered_, qw);
    m.o_b = at<float>(gathered_, r * pair);
    m.lse_b = at<float>(gathered_, r * pair + qw);
    m.o_row_stride = qw;
    m.o_head_stride = shape_.head_dim;
    m.lse_head_stride = 1;
    m.rows = 1;
    m.heads = shape_.heads;
    m.head_dim = shape_.head_dim;
    BURST_RETURN_IF_ERROR(backend_.merge(m));
  }
  Tensor merged = gathered_.rows(0, 1);
  merged.shape = {1, qw};
  return backend_.convert(merged, out);
}

}  // namespace burst::engine
