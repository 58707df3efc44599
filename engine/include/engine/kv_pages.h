// The paged KV cache of one rank: the keys and values of many sequences at once. Per layer a K
// and a V pool of pages * page_size rows ([rows, kv_heads * head_dim], the compute dtype);
// a sequence owns pages through its page table, which every layer shares (each layer caches
// the same rows of a sequence). Memory is taken a page at a time as a sequence grows, never
// reserved for the worst case, and release() gives it back.
//
// Rows are logical per sequence: row j of sequence s lives in page table(s)[j / page_size], at
// row j % page_size of that page (AttnParams::kv_pages reads the same mapping). A forward adds
// rows in two phases: reserve() takes the pages for the rows this step will add and write()
// fills them layer by layer; commit() makes them part of the sequence once every layer wrote.
// A sequence's pages follow each other where they can (a growing prompt keeps the page after
// its last; new sequences start in the largest free run, halfway along it when another
// sequence ends right before it), so a long prompt's cached prefix is usually one run of the
// pool that attention reads in place.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "engine/attention_context.h"
#include "engine/backend.h"

namespace burst::engine {

// What the KV cache holds (--kv-cache-dtype): K and V in the compute dtype ("auto"), or FP8
// rows (kernels/kv_fp8.h: e4m3 with a scale per token and head, about half the bytes of bf16).
// Under fp8 every attention reads the rows' values: the decode kernel reads the rows
// themselves, a prefill's keys are dequantized from them (its own chunk's too, so a prompt
// sees the same keys however it is cut into chunks).
enum class KvCacheDtype { kAuto, kFp8 };
// "auto", "fp8" or "fp8_e4m3" (vLLM's names; fp8 is e4m3).
Result<KvCacheDtype> parse_kv_cache_dtype(const std::string& name);
const char* kv_cache_dtype_name(KvCacheDtype dtype);
// The dtype of the pool's tensors, and the bytes of one row (one token's K or V of one layer).
DType kv_pool_dtype(const Backend& backend, KvCacheDtype dtype);
int64_t kv_row_bytes(const Backend& backend, const AttentionShape& shape, KvCacheDtype dtype);

struct KvUsage {
  int64_t total_pages = 0;
  int64_t used_pages = 0;    // held by sequences or by prefix blocks
  int64_t sequences = 0;
  int page_size = 0;
  int64_t cached_pages = 0;  // held by prefix blocks alone (no sequence reads them)
  int64_t blocks = 0;        // prefix blocks
};

class PagedKvCache {
 public:
  static Result<std::unique_ptr<PagedKvCache>> create(Backend& backend, AttentionShape shape,
                                                      int64_t pages, int page_size,
                                                      KvCacheDtype dtype = KvCacheDtype::kAuto);

  int page_size() const { return page_size_; }
  KvCacheDtype dtype() const { return dtype_; }
  int64_t total_pages() const { return static_cast<int64_t>(k_.empty() ? 0 : pages_); }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  KvUsage usage() const;
  // Committed rows of `seq` (0 for an unknown sequence).
  int64_t length(uint64_t seq) const;
  // Rows reserved by the step in progress and not committed yet.
  int64_t pending(uint64_t seq) const;
  // Pages that reserve(seq, rows) would take now.
  int64_t pages_needed(uint64_t seq, int64_t rows) const;
  // Takes the pages for `rows` more rows of seq (creating it if new); kResourceExhausted, and
  // nothing taken, when the free pages do not suffice.
  Status reserve(uint64_t seq, int64_t rows);
  // Writes k and v ([n, kv_width], the compute dtype; quantized into FP8 rows under fp8) of
  // `layer` at logical rows [row, row + n) of seq; the rows must lie within its committed +
  // reserved rows.
  Status write(uint64_t seq, int layer, int64_t row, const Tensor& k, const Tensor& v);
  // The reserved rows become the sequence's.
  void commit(uint64_t seq);
  // Gives every page of seq back (a finished, cancelled or failed sequence); a page that a
  // prefix block or another sequence also holds stays.
  void release(uint64_t seq);
  // Every sequence and every prefix block: the pool is empty.
  void release_all();

  // Prefix blocks (prefix caching): a block is one full page of a sequence, named by the
  // planner, that outlives the sequence until evicted. Pages are reference-counted: by each
  // sequence whose page table holds them and by the block. No sequence ever writes a shared
  // page: a block is whole when it is published, and a sequence that adopts blocks writes only
  // after them.
  // Page `index` of seq (committed and full) becomes block `id`.
  Status publish(uint64_t seq, int64_t index, int64_t id);
  // A new sequence starts with these blocks as its first pages (blocks.size() x page_size
  // committed rows).
  Status adopt(uint64_t seq, const std::vector<int64_t>& blocks);
  // The block goes; its page is freed unless a sequence still holds it.
  Status evict(int64_t id);
  bool has_block(int64_t id) const { return blocks_.count(id) != 0; }
  // Freed pages are filled with NaN first (a test of the prefix cache: a request that read a
  // page after it was freed gives NaN logits, not plausible tokens).
  void set_poison_freed(bool on) { poison_freed_ = on; }
  // The page table of seq (page indices in row order).
  const std::vector<int32_t>& pages(uint64_t seq) const;
  // The pools' rows (kv_row_bytes each).
  const Tensor& k_pool(int layer) const { return k_[static_cast<size_t>(layer)]; }
  const Tensor& v_pool(int layer) const { return v_[static_cast<size_t>(layer)]; }

 private:
  struct Seq {
    int64_t length = 0;
    int64_t pending = 0;
    std::vector<int32_t> pages;
  };
  PagedKvCache(Backend& backend, AttentionShape shape, int64_t pages, int page_size,
               KvCacheDtype dtype)
      : backend_(backend), shape_(shape), pages_(pages), page_size_(page_size), dtype_(dtype) {}
  // Per layer a K and a V pool of pages_ * page_size_ rows.
  Status alloc_pools();
  // Calls f(pool_row, logical_row, n) for each run of rows [row, row + count) whose pool rows
  // follow each other (within a page, or across pages that are consecutive in the pool).
  template <typename F>
  Status for_each_run(const Seq& s, int64_t row, int64_t count, F&& f) const;

  Backend& backend_;
  AttentionShape shape_;
  int64_t pages_;
  int page_size_;
  KvCacheDtype dtype_;
  // Per layer [pages * page_size, kv_width] (compute dtype) or [.., kv_fp8_row_bytes] (fp8).
  std::vector<Tensor> k_, v_;
  // Where a run of pages for a sequence starts (a new one, or one whose next page is taken):
  // the start of the largest free run, or its middle when a sequence ends right before it.
  int32_t run_start() const;

  // One reference less on page p; at none it is free (and poisoned when asked).
  void unref(int32_t p);

  std::set<int32_t> free_;  // free page indices, ordered (runs of consecutive pages)
  std::unordered_map<uint64_t, Seq> seqs_;
  std::vector<int32_t> refs_;                    // per page: holders (sequences and a block)
  std::unordered_map<int64_t, int32_t> blocks_;  // prefix block id -> page
  bool poison_freed_ = false;
};

// KV rows each rank caches for a group holding `total` tokens: its share plus slack for prompts
// cut in chunks of `chunk` tokens (0: whole prompts): under zigzag each chunk gives a rank at
// most 2 rows over its exact share (striped: at most 1 over, whatever the chunks).
int64_t kv_capacity_per_rank(int64_t total, int ranks, int64_t chunk = 0);

// KV rows a rank holds when its pool is sized from its GPU's memory (--kv-capacity 0): what is
// free once the weights are in, less what the process leaves to others ((1 - fraction) of the
// device) and the activations' reserve, in whole pages of bytes_per_row each; 0 when that is
// not one page.
int64_t kv_rows_from_memory(int64_t free_bytes, int64_t total_bytes, double fraction,
                            int64_t reserve_bytes, int64_t bytes_per_row, int page_size);

}  // namespace burst::engine
