// BurstAttention: the attention context of one rank in a sequence-sharded worker group, over a
// paged KV cache that holds many sequences. A forward is one step of a batch: each sequence in
// it contributes either a prefill chunk (this rank's share of the chunk's
// tokens, engine/sharding.h) or one
// decode token (replicated on every rank). Every rank runs the same steps in the same order.
//
// Prefill chunk (per layer): the rank holds q, k, v of its share of the chunk, and its share of
// the sequence's earlier chunks in the cache (the prefix). One of two rings moves the data:
// - pass-KV: K and V travel around the ring packed in one buffer, prefix then chunk; at step s
//   the rank attends its queries to the block that started on rank (r - s) mod N while the
//   block for step s + 1 is already in flight (double buffer: the send/recv of the next block
//   is posted before the current step is computed, and the next step waits only on that
//   transfer).
// - pass-Q: the query blocks travel instead; at step s the rank attends the queries of rank
//   (r - s) mod N to its own prefix and chunk keys and sends that partial (o, lse) back to their
//   rank while step s + 1 computes; each rank merges the partials of its queries as they arrive.
//   A hop moves rows x (q + fp32 o and lse) instead of (prefix + rows) x (k + v): once the
//   cached prefix is larger than about half the chunk, far fewer bytes (the pass-Q of Meta's
//   context-parallel inference paper). Each chunk takes the ring that moves fewer bytes; one
//   rank always takes pass-Q, which attends its keys in place (pass-KV copies them first).
// Every prefix key precedes every chunk query (kNone); each (q segment, kv segment) pair of the
// chunk is skipped, full or causal by absolute positions (kernels::block_relation over the
// pair's mask_starts: with the striped layout every pair is one causal block). Partial
// results merge by the online-softmax merge (GAO) in fp32. An unchunked prefill is the case of
// an empty prefix.
//
// Decode (per layer, all decode tokens of the step at once): each token's k/v is appended on
// one rank, round robin by position; each rank attends every token to its own shard of that
// token's sequence (paged K/V), giving (o, lse) per token; one all-gather moves the pairs of
// the whole batch, and every rank merges them in rank order, so all ranks get bit-identical
// output.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/attention_context.h"
#include "engine/attention_dtype.h"
#include "engine/communicator.h"
#include "engine/kv_pages.h"
#include "engine/sharding.h"

namespace burst::engine {

struct RingStats {
  double compute_ms = 0;  // attention + merge, summed over steps and layers
  double wait_ms = 0;     // time blocked on transfers after compute (exposed communication)
  int64_t steps = 0;
};

// One sequence's rows in a step.
struct SeqRows {
  uint64_t seq = 0;
  int64_t row = 0;      // its first row in the forward's batch
  bool decode = false;  // one replicated token (1 row); else a prefill chunk of `plan`
  int64_t pos = 0;      // decode: the token's position (it is cached on rank pos mod N)
  ShardPlan plan;       // prefill: the chunk's sharding (plan.local_rows(rank) rows)
  int64_t rows(int rank) const { return decode ? 1 : plan.local_rows(rank); }
};

// CPU workers: small pages (tiny models, many short requests). GPU workers pass a larger one:
// a page is copied in one call when a prefix travels, so fewer, larger pages mean fewer copies.
constexpr int kDefaultKvPageSize = 16;
constexpr int kCudaKvPageSize = 256;
// The page size a rank's KV cache uses on `backend` (the CUDA decode kernel reads whole
// 256-row pages; CPU ranks serve small models and many short requests).
inline int kv_page_size(const Backend& backend) {
  return backend.device() == DeviceKind::kCuda ? kCudaKvPageSize : kDefaultKvPageSize;
}

// Which ring a prefill chunk uses (tests and benchmarks force one; kAuto picks per chunk).
enum class RingPass { kAuto, kKv, kQ };


class RingAttention final : public AttentionContext {
 public:
  // capacity: KV tokens this rank may hold over all sequences (rounded up to whole pages).
  // kv_dtype fp8: the pages hold FP8 rows, and so do the blocks pass-KV sends (half the bytes
  // a hop); each block is dequantized where it is attended.
  // attention fp8: every prefill launch rounds its products to e4m3 (AttentionDtype).
  static Result<std::unique_ptr<RingAttention>> create(
      Backend& backend, Communicator& comm, AttentionShape shape, int64_t capacity,
      int page_size = kDefaultKvPageSize, KvCacheDtype kv_dtype = KvCacheDtype::kAuto,
      AttentionDtype attention = AttentionDtype::kAuto);

  // The next forward is a step of these sequences (their rows in this order); reserves the KV
  // pages the step adds on this rank (kResourceExhausted, nothing changed, when they do not fit).
  Status begin_step(std::vector<SeqRows> seqs);
  // After the forward: the rows the step wrote become part of their sequences.
  void end_step();
  // Frees every page of seq on this rank.
  void release(uint64_t seq);
  // Rows of `seq` on rank r, as every rank computes them (each rank sees the same steps).
  int64_t rows_on(uint64_t seq, int r) const;
  // Prefix caching over the striped layout: the first k x N x page_size tokens of a sequence
  // are its first k pages on every rank, so a prefix block is one page per rank
  // (PagedKvCache::publish, adopt, evict). A new sequence that adopts k blocks holds
  // k x page_size rows on every rank; page `index` of seq becomes block `id` once every rank
  // holds it whole.
  Status adopt(uint64_t seq, const std::vector<int64_t>& blocks);
  Status publish(uint64_t seq, int64_t index, int64_t id);
  Status evict(int64_t id) { return cache_->evict(id); }
  PagedKvCache& cache_mut() { return *cache_; }
  const PagedKvCache& cache() const { return *cache_; }

  Status attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const std::vector<int64_t>& positions, Tensor& out) override;
  int64_t length() const override { return cache_->length(0); }
  int64_t capacity() const override { return cache_->total_pages() * cache_->page_size(); }
  void clear() override;
  const RingStats& stats() const { return stats_; }
  // Benchmarks only: when false, every step reuses the block in hand instead of receiving the
  // next one (same kernels, same shapes, no transfer), which measures compute alone.
  void set_transfers(bool on) { transfers_ = on; }
  void set_pass(RingPass pass) { pass_ = pass; }

 private:
  RingAttention(Backend& backend, Communicator& comm, AttentionShape shape)
      : backend_(backend), comm_(comm), shape_(shape) {}
  Status prefill(int layer, const SeqRows& s, const Tensor& q, const Tensor& k, const Tensor& v,
                 Tensor& out);
  // One sequence's prefill on this rank: its chunk rows (the queries), every rank's cached rows
  // of the sequence, and the pass-KV block size (room for the largest prefix: one transfer
  // size).
  struct PrefillBlocks {
    int64_t rows = 0;                // this rank's chunk rows (padding included; equal on all)
    std::vector<int64_t> prefix;     // each rank's cached rows of the sequence
    int64_t block_rows = 0;          // max prefix + rows: K rows, then as many V rows
  };
  // Sizes the (o, lse) scratch (the first ring step writes the accumulator without reading it).
  Status prefill_buffers(const SeqRows& s, PrefillBlocks& b);
  // o 0 and lse -inf: the first merge into them takes the partial as is.
  Status reset_acc(Tensor& o, Tensor& lse);
  // Whether this chunk goes by pass-Q: the forced ring, else on one rank always (nothing
  // travels, nothing is copied), else the ring that moves fewer bytes per hop.
  bool pass_q(const PrefillBlocks& b) const;
  // The two rings; both leave this rank's queries' output in (o_acc_, lse_acc_).
  Status prefill_pass_kv(int layer, const SeqRows& s, const PrefillBlocks& b, const Tensor& q,
                         const Tensor& k, const Tensor& v);
  Status prefill_pass_q(int layer, const SeqRows& s, const PrefillBlocks& b, const Tensor& q,
                        const Tensor& k, const Tensor& v);
  // Keys and values as an attention launch reads them: row 0 of k and v, rows of the compute
  // dtype or (fp8_rows) FP8 KV rows, contiguous or (pages) paged by a device page table of the
  // cache's page size. Only FP8 attention reads FP8 rows and pages in prefill (its quantizer
  // does): for it a prefix is read in the pool and a block as it travels, never dequantized.
  struct KvView {
    const void* k = nullptr;
    const void* v = nullptr;
    bool fp8_rows = false;
    const int32_t* pages = nullptr;
  };
  // This rank's keys for pass-Q: its cached prefix (`prefix`) and its chunk's rows (`own`, from
  // row *own_row0), k and v as the forward made them. Under fp8 both are FP8 rows, as pass-KV
  // would send them: FP8 attention reads the prefix in the pool and the chunk's rows as
  // quantized, bf16 attention one block's values.
  Status pass_q_keys(int layer, const SeqRows& s, const PrefillBlocks& b, const Tensor& k,
                     const Tensor& v, KvView* prefix, KvView* own, int64_t* own_row0);
  // Block 0 (the first hop's): this rank's prefix from the pages, then its chunk's k and v
  // (quantized under fp8).
  Status load_own_block(int layer, const SeqRows& s, const PrefillBlocks& b, const Tensor& k,
                        const Tensor& v);
  // This rank's chunk k and v ([n, kvw]) into block rows row.. (K) and block_rows + row.. (V),
  // quantized under fp8.
  Status own_rows(const Tensor& k, const Tensor& v, Tensor& block, int64_t row,
                  int64_t block_rows);
  bool fp8() const { return cache_->dtype() == KvCacheDtype::kFp8; }
  // t becomes a block of rows K rows then rows V rows, of the pool's dtype and row bytes.
  Status ensure_block(Tensor& t, int64_t rows);
  // The keys and values of `block` ([2 * block_rows, row bytes]: K rows, then V rows) as a
  // launch reads them: the block itself, or under fp8 with bf16 attention its values
  // dequantized into kv_values_.
  Status block_values(const Tensor& block, int64_t block_rows, KvView* kv);
  // The first n cached rows of s in this layer, copied from the pages into k and v ([n, kvw]).
  Status gather_prefix(int layer, const SeqRows& s, int64_t n, Tensor& k, Tensor& v);
  // This rank's first n cached rows of s in this layer where the pool holds them: from their
  // first row when their pages follow each other, else through the step's page table.
  KvView pool_prefix(int layer, const SeqRows& s, int64_t n) const;
  // The same for a launch that reads no pages: the pool rows themselves, or a copy gathered
  // into block_[0].
  Status local_prefix(int layer, const SeqRows& s, int64_t n, KvView* kv);
  // Attention of the query rows qs of q ([rows, qw], positions from qs.pos) against the key
  // rows ks of kv (positions from ks.pos; a paged view from row 0 only) under mask, merged into
  // the accumulator o_acc [rows, qw] and lse_acc [heads, rows] (fp32), or written there in
  // place when `direct`.
  Status attend_merge(int64_t rows, const void* q, const KvView& kv, const Segment& qs,
                      const Segment& ks, kernels::MaskKind mask, float* o_acc, float* lse_acc,
                      bool direct);
  // (o_b, lse_b) merged into (o_a, lse_a) in fp32: `rows` rows of o [rows, qw], lse [heads,
  // lse_stride]; with `out` ([rows, qw], any dtype) the merged o goes there instead of o_a.
  Status merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows,
               int64_t lse_stride, Tensor* out = nullptr);
  // One ring step: the query segments q_segs of q against n_prefix prefix rows of `prefix`
  // (all before every query: kNone) and the chunk segments k_segs of `own`, found at rows
  // k_row0 + ks.row (each pair skipped, full or causal by positions), into (o, lse). `fresh`:
  // what (o, lse) hold is ignored: a row's first contribution is written in place (no merge),
  // rows no key reaches become o 0, lse -inf; otherwise every contribution is merged.
  Status attend_keys(int64_t rows, const void* q, const std::vector<Segment>& q_segs,
                     const KvView& prefix, int64_t n_prefix, const KvView& own,
                     const std::vector<Segment>& k_segs, int64_t k_row0, Tensor& o, Tensor& lse,
                     bool fresh);
  // Adds a ring step's host times (compute t0..t1, then the wait up to now) to the stats.
  void count_step(std::chrono::steady_clock::time_point t0,
                  std::chrono::steady_clock::time_point t1);
  // Caches the real (not padding) tokens of this rank's chunk after its prefix.
  Status cache_chunk(int layer, const SeqRows& s, const PrefillBlocks& b, const Tensor& k,
                     const Tensor& v);
  Status decode(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                const std::vector<int64_t>& positions, Tensor& out);
  // The AttnParams both decode launches share: n_q rows of q from q_row against this layer's
  // paged pool, o and lse fp32 into the batch's [n] partials (o, lse set by the caller).
  kernels::AttnParams decode_params(int layer, int64_t n_q, int64_t n, const Tensor& q,
                                    int64_t q_row);
  // Where a decode launch writes o, row b at data + b * heads * head_dim elements: the fp32
  // partials for the rank merge, or (one rank) the layer's output in its dtype.
  struct DecodeOut {
    void* data;
    DType dtype;
  };
  // Decode rows not consecutive: each token's k/v to its page, one launch per token.
  Status decode_each(int layer, const std::vector<const SeqRows*>& batch, const Tensor& q,
                     const Tensor& k, const Tensor& v, const DecodeOut& o);
  // Consecutive decode rows: one scatter of k/v and one launch with per-row K/V for all.
  Status decode_batched(int layer, const std::vector<const SeqRows*>& batch, const Tensor& q,
                        const Tensor& k, const Tensor& v, const DecodeOut& o);
  // t becomes a [shape] tensor of dtype, reusing its buffer when large enough.
  Status ensure(Tensor& t, std::vector<int64_t> shape, DType dtype);

  Backend& backend_;
  Communicator& comm_;
  AttentionShape shape_;
  std::unique_ptr<PagedKvCache> cache_;
  std::vector<SeqRows> step_;
  bool in_step_ = false;
  bool transfers_ = true;
  RingPass pass_ = RingPass::kAuto;
  // Rows of each sequence on every rank (the prefix sizes of the ring's blocks).
  std::unordered_map<uint64_t, std::vector<int64_t>> rows_;
  // Scratch: two packed KV blocks (double buffer), partial and accumulated (o, lse), the decode
  // batch's (o, lse) pairs and their all-gather, the decode page tables.
  Tensor block_[2], o_part_, lse_part_, o_acc_, lse_acc_, pairs_, gathered_, tables_;
  // Under fp8: the values of the block being attended ([2 * block_rows, kv_width], compute).
  Tensor kv_values_;
  // pass-Q: the query blocks (double buffer), the partials sent back and received.
  Tensor q_block_[2], part_out_[2], part_in_[2];
  std::vector<int64_t> table_offset_;  // per decode entry of the step, into tables_
  int64_t decode_meta_ = 0;            // tables_: row_kv_len then row_page_offset start here
  int32_t decode_max_kv_ = 0;          // the step's longest decode key count on this rank
  int64_t decode_dst_ = 0;             // tables_: each decode token's pool row here (-1: none)
  std::unordered_map<uint64_t, int64_t> prefill_table_;  // a prefill sequence's table in tables_
  // Set while a ring step's transfer is in flight: its attention launches say so
  // (AttnParams::beside_transfer).
  bool beside_transfer_ = false;
  // Set while the prefill's attention is one kernel call over all its rows (one rank, no
  // prefix, one segment): that call writes the layer's output, in its dtype, instead of the fp32
  // accumulator (no conversion pass after it).
  Tensor* direct_out_ = nullptr;
  bool direct_written_ = false;  // that call has run (any other contribution is an error)
  bool attention_fp8_ = false;  // AttentionDtype::kFp8: prefill launches set qkv_fp8
  RingStats stats_;
};

}  // namespace burst::engine
