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

// Fills an fp32 host tensor (the CPU ring keeps its scratch in host memory).
void fill(Tensor& t, float value) {
  float* p = t.as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value;
}

}  // namespace

Result<std::unique_ptr<RingAttention>> RingAttention::create(Backend& backend, Communicator& comm,
                                                             AttentionShape shape,
                                                             int64_t capacity) {
  if (backend.device() != DeviceKind::kCpu) {
    return Status::error("ring attention: only the CPU ring exists so far (NCCL ring: CUDA issue)");
  }
  if (capacity <= 0) return Status::error("ring attention: capacity must be > 0");
  std::unique_ptr<RingAttention> r(new RingAttention(backend, comm, shape, capacity));
  const int64_t width = int64_t{shape.kv_heads} * shape.head_dim;
  for (int l = 0; l < shape.layers; ++l) {
    for (auto* list : {&r->k_, &r->v_}) {
      auto t = backend.alloc({capacity, width}, backend.compute_dtype());
      if (!t.ok()) return Status::error("ring kv cache: " + t.message());
      list->push_back(t.take());
    }
  }
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

Status RingAttention::ensure(Tensor& t, int64_t numel) {
  if (!t.empty() && t.numel() >= numel) return {};
  t = Tensor();
  auto a = backend_.alloc({numel}, DType::kF32);
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
  const int64_t block_elems = 2 * rows * kvw;  // K rows then V rows
  BURST_RETURN_IF_ERROR(ensure(block_[0], block_elems));
  BURST_RETURN_IF_ERROR(ensure(block_[1], block_elems));
  BURST_RETURN_IF_ERROR(ensure(o_part_, rows * qw));
  BURST_RETURN_IF_ERROR(ensure(lse_part_, shape_.heads * rows));
  BURST_RETURN_IF_ERROR(ensure(o_acc_, rows * qw));
  BURST_RETURN_IF_ERROR(ensure(lse_acc_, shape_.heads * rows));
  fill(o_acc_, 0.f);
  fill(lse_acc_, kNegInf);  // nothing seen yet: the first merge takes the partial as is

  // Step 0's block is our own k/v.
  std::memcpy(block_[0].data, k.data, static_cast<size_t>(rows * kvw) * 4);
  std::memcpy(block_[0].as<float>() + rows * kvw, v.data, static_cast<size_t>(rows * kvw) * 4);
  const std::vector<Segment> q_segs = plan_.segments(rank);
  const int next = (rank + 1) % world, prev = (rank - 1 + world) % world;
  const float scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));

  for (int s = 0; s < world; ++s) {
    Tensor& cur = block_[s % 2];
    Tensor& nxt = block_[(s + 1) % 2];
    // Double buffer: post the transfer of the block for step s + 1 before computing step s.
    // `cur` is only read while it is being sent; `nxt` is not touched until its recv completes.
    std::unique_ptr<CommHandle> send, recv;
    if (s + 1 < world) {
      const size_t bytes = static_cast<size_t>(block_elems) * 4;
      auto sh = comm_.isend(cur.data, bytes, next, kTagKv);
      if (!sh.ok()) return sh.status();
      auto rh = comm_.irecv(nxt.data, bytes, prev, kTagKv);
      if (!rh.ok()) return rh.status();
      send = sh.take();
      recv = rh.take();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int src = (rank - s + world) % world;
    const float* kb = cur.as<float>();
    const float* vb = kb + rows * kvw;
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
        p.q = q.as<float>() + qs.row * qw;
        p.k = kb + ks.row * kvw;
        p.v = vb + ks.row * kvw;
        p.o = o_part_.as<float>() + qs.row * qw;
        p.lse = lse_part_.as<float>() + qs.row;
        p.q_start = qs.pos;
        p.kv_start = ks.pos;
        p.mask = rel == kernels::BlockRelation::kFull ? kernels::MaskKind::kNone
                                                      : kernels::MaskKind::kCausal;
        p.scale = scale;
        p.dtype = DType::kF32;
        BURST_RETURN_IF_ERROR(backend_.attention(p));
        kernels::MergeParams m;
        m.o_a = o_acc_.as<float>() + qs.row * qw;
        m.lse_a = lse_acc_.as<float>() + qs.row;
        m.o_b = o_part_.as<float>() + qs.row * qw;
        m.lse_b = lse_part_.as<float>() + qs.row;
        m.o_row_stride = qw;
        m.o_head_stride = shape_.head_dim;
        m.lse_head_stride = rows;
        m.rows = static_cast<int32_t>(qs.len);
        m.heads = shape_.heads;
        m.head_dim = shape_.head_dim;
        BURST_RETURN_IF_ERROR(backend_.merge(m));
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    // The next step reads `nxt` (must have arrived) and the step after overwrites `cur` (our
    // send of it must be done): wait for both before moving on.
    if (send) BURST_RETURN_IF_ERROR(send->wait());
    if (recv) BURST_RETURN_IF_ERROR(recv->wait());
    const auto t2 = std::chrono::steady_clock::now();
    stats_.compute_ms += ms_between(t0, t1);
    stats_.wait_ms += ms_between(t1, t2);
    ++stats_.steps;
  }
  std::memcpy(out.data, o_acc_.data, static_cast<size_t>(rows * qw) * 4);

  // Cache the real tokens of our shard (padding is never attended to again).
  int64_t& len = lengths_[static_cast<size_t>(layer)];
  len = 0;
  for (const Segment& sg : q_segs) {
    const int64_t valid = std::clamp<int64_t>(plan_.prompt_len - sg.pos, 0, sg.len);
    if (len + valid > capacity_) return Status::error("ring kv cache: shard exceeds capacity");
    std::memcpy(k_[layer].as<float>() + len * kvw, k.as<float>() + sg.row * kvw,
                static_cast<size_t>(valid * kvw) * 4);
    std::memcpy(v_[layer].as<float>() + len * kvw, v.as<float>() + sg.row * kvw,
                static_cast<size_t>(valid * kvw) * 4);
    len += valid;
  }
  return {};
}

Status RingAttention::decode(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             int64_t pos, Tensor& out) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const int64_t kvw = int64_t{shape_.kv_heads} * shape_.head_dim;
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  int64_t& len = lengths_[static_cast<size_t>(layer)];
  // Round robin by position, so no shard grows faster than another.
  if (pos % world == rank) {
    if (len + 1 > capacity_) return Status::error("ring kv cache: decode exceeds capacity");
    std::memcpy(k_[layer].as<float>() + len * kvw, k.data, static_cast<size_t>(kvw) * 4);
    std::memcpy(v_[layer].as<float>() + len * kvw, v.data, static_cast<size_t>(kvw) * 4);
    ++len;
  }
  const int64_t pair = qw + shape_.heads;  // o then lse, fp32
  BURST_RETURN_IF_ERROR(ensure(o_part_, pair));
  BURST_RETURN_IF_ERROR(ensure(gathered_, pair * world));
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
  p.lse = o_part_.as<float>() + qw;
  p.mask = kernels::MaskKind::kNone;  // every cached key precedes (or is) the new token
  p.scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.dtype = DType::kF32;
  BURST_RETURN_IF_ERROR(backend_.attention(p));  // an empty shard gives lse -inf, o 0
  BURST_RETURN_IF_ERROR(comm_.all_gather(o_part_.data, gathered_.data,
                                         static_cast<size_t>(pair) * 4));
  // Merge in rank order on every rank: the same operations in the same order give the same
  // bits everywhere, so the replicated decode never drifts between ranks.
  float* acc = gathered_.as<float>();
  for (int r = 1; r < world; ++r) {
    float* other = gathered_.as<float>() + r * pair;
    kernels::MergeParams m;
    m.o_a = acc;
    m.lse_a = acc + qw;
    m.o_b = other;
    m.lse_b = other + qw;
    m.o_row_stride = qw;
    m.o_head_stride = shape_.head_dim;
    m.lse_head_stride = 1;
    m.rows = 1;
    m.heads = shape_.heads;
    m.head_dim = shape_.head_dim;
    BURST_RETURN_IF_ERROR(backend_.merge(m));
  }
  std::memcpy(out.data, acc, static_cast<size_t>(qw) * 4);
  return {};
}

}  // namespace burst::engine
