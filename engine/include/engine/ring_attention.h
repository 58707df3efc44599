// BurstAttention: the attention context of one rank in a sequence-sharded worker group.
//
// Prefill (per layer): the rank holds q, k, v of its shard (ShardPlan). K and V travel around
// the ring packed in one buffer; at step s the rank attends its queries to the block that
// started on rank (r - s) mod N while the block for step s + 1 is already in flight (double
// buffer: the send/recv of the next block is posted before the current step is computed, and
// the next step waits only on that transfer). Each (q segment, kv segment) pair is skipped,
// full or causal by absolute positions (kernels::block_relation). Partial results merge by the
// online-softmax merge (GAO) in fp32.
//
// Decode (per layer): every rank runs the same new token; the token's k/v is appended on one
// rank, round robin by position; each rank attends the token to its own shard giving (o, lse),
// the pairs are all-gathered and merged in rank order, so every rank gets bit-identical output.
#pragma once

#include <memory>
#include <vector>

#include "engine/attention_context.h"
#include "engine/communicator.h"
#include "engine/sharding.h"

namespace burst::engine {

struct RingStats {
  double compute_ms = 0;  // attention + merge, summed over steps and layers
  double wait_ms = 0;     // time blocked on transfers after compute (exposed communication)
  int64_t steps = 0;
};

class RingAttention final : public AttentionContext {
 public:
  // capacity: KV tokens this rank may hold (its shard of the prompt plus its decode share).
  static Result<std::unique_ptr<RingAttention>> create(Backend& backend, Communicator& comm,
                                                       AttentionShape shape, int64_t capacity);

  // The next forward is the prefill of `plan` (this rank's rows in plan order); clears the cache.
  void begin_prefill(const ShardPlan& plan);
  // Later forwards are decode steps (one replicated token at a time).
  void begin_decode();

  Status attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const std::vector<int64_t>& positions, Tensor& out) override;
  int64_t length() const override { return lengths_.empty() ? 0 : lengths_[0]; }
  int64_t capacity() const override { return capacity_; }
  void clear() override;
  const RingStats& stats() const { return stats_; }
  // Benchmarks only: when false, every step reuses the block in hand instead of receiving the
  // next one (same kernels, same shapes, no transfer), which measures compute alone.
  void set_transfers(bool on) { transfers_ = on; }

 private:
  RingAttention(Backend& backend, Communicator& comm, AttentionShape shape, int64_t capacity)
      : backend_(backend), comm_(comm), shape_(shape), capacity_(capacity) {}
  Status prefill(int layer, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  Status decode(int layer, const Tensor& q, const Tensor& k, const Tensor& v, int64_t pos,
                Tensor& out);
  // t becomes a [shape] tensor of dtype, reusing its buffer when large enough.
  Status ensure(Tensor& t, std::vector<int64_t> shape, DType dtype);

  Backend& backend_;
  Communicator& comm_;
  AttentionShape shape_;
  int64_t capacity_;
  ShardPlan plan_;
  bool decoding_ = false;
  bool transfers_ = true;
  std::vector<Tensor> k_, v_;     // per layer [capacity, kv_heads * head_dim]
  std::vector<int64_t> lengths_;  // per layer, valid rows
  // Scratch: two packed KV blocks (double buffer), partial and accumulated (o, lse).
  Tensor block_[2], o_part_, lse_part_, o_acc_, lse_acc_, gathered_;
  RingStats stats_;
};

}  // namespace burst::engine
