// One sequence through a model and a RingAttention, for tests that want a forward's logits at
// chosen rows (HF logits, teacher forcing, reference paths): each forward is one step of the
// sequence, a prefill chunk sharded by `plan` or one decode token, begun and ended around it
// (RingAttention::begin_step / end_step), as BatchRunner does. OneRank is the ring of a group
// of one in this process (engine::make_local_communicator).
#pragma once

#include <memory>
#include <vector>

#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "engine/sharding.h"
#include "models/model.h"

namespace burst::testing {

// The prefill chunk `plan` of sequence `seq` (this rank's rows: ids at positions), logits of
// logit_rows into `logits`; seq_len: the whole prompt (dynamic RoPE), 0: max(positions) + 1.
inline Status forward_chunk(models::Model& m, engine::RingAttention& ring, uint64_t seq,
                            const engine::ShardPlan& plan, const std::vector<int32_t>& ids,
                            const std::vector<int64_t>& positions,
                            const std::vector<int64_t>& logit_rows, std::vector<float>& logits,
                            int64_t seq_len = 0, const models::LayerHook& hook = nullptr) {
  engine::SeqRows s;
  s.seq = seq;
  s.plan = plan;
  BURST_RETURN_IF_ERROR(ring.begin_step({s}));
  models::ForwardOutput out;
  BURST_RETURN_IF_ERROR(
      m.forward(models::ForwardBatch::of_sequence(ids, positions, logit_rows, seq_len), ring,
                out, hook));
  ring.end_step();
  logits = std::move(out.logits);
  return {};
}

// One decode token of sequence `seq` at position `pos` (every rank runs it).
inline Status forward_decode(models::Model& m, engine::RingAttention& ring, uint64_t seq,
                             int32_t token, int64_t pos, const std::vector<int64_t>& logit_rows,
                             models::ForwardOutput& out, int64_t seq_len = 0,
                             const models::LayerHook& hook = nullptr,
                             const models::SampleRows& sample = {}) {
  engine::SeqRows s;
  s.seq = seq;
  s.decode = true;
  s.pos = pos;
  BURST_RETURN_IF_ERROR(ring.begin_step({s}));
  auto batch = models::ForwardBatch::of_sequence({token}, {pos}, logit_rows, seq_len);
  batch.sample = sample;
  BURST_RETURN_IF_ERROR(m.forward(batch, ring, out, hook));
  ring.end_step();
  return {};
}

// A group of one: the sequence's forwards in order, each a prefill chunk of consecutive
// positions, or a decode token when it is one token after what is cached.
struct OneRank {
  static constexpr uint64_t kSeq = 1;
  std::unique_ptr<engine::Communicator> comm;
  std::unique_ptr<engine::RingAttention> ring;

  static Result<OneRank> create(models::Model& m, int64_t capacity,
                                engine::KvCacheDtype kv = engine::KvCacheDtype::kAuto,
                                engine::AttentionDtype attention = engine::AttentionDtype::kAuto) {
    OneRank r;
    r.comm = engine::make_local_communicator();
    auto ring = engine::RingAttention::create(m.backend(), *r.comm, m.attention_shape(), capacity,
                                              engine::kv_page_size(m.backend()), kv, attention);
    if (!ring.ok()) return ring.status();
    r.ring = ring.take();
    return r;
  }
  // Forgets the sequence (the next forward starts at position 0).
  void clear() { ring->clear(); }
  Status forward(models::Model& m, const std::vector<int32_t>& ids,
                 const std::vector<int64_t>& positions, const std::vector<int64_t>& logit_rows,
                 std::vector<float>& logits, int64_t seq_len = 0,
                 const models::LayerHook& hook = nullptr) {
    if (ids.size() == 1 && ring->rows_on(kSeq, 0) == positions[0] && positions[0] > 0) {
      models::ForwardOutput out;
      BURST_RETURN_IF_ERROR(
          forward_decode(m, *ring, kSeq, ids[0], positions[0], logit_rows, out, seq_len, hook));
      logits = std::move(out.logits);
      return {};
    }
    const auto plan = engine::ShardPlan::make(engine::ShardLayout::kContiguous,
                                              static_cast<int64_t>(ids.size()), 1, positions[0]);
    return forward_chunk(m, *ring, kSeq, plan, ids, positions, logit_rows, logits, seq_len,
                         hook);
  }
};

}  // namespace burst::testing
