#include "engine/kv_pages.h"

#include <algorithm>
#include <limits>

#include "kernels/kv_fp8.h"

namespace burst::engine {

Result<KvCacheDtype> parse_kv_cache_dtype(const std::string& name) {
  if (name == "auto") return KvCacheDtype::kAuto;
  if (name == "fp8" || name == "fp8_e4m3") return KvCacheDtype::kFp8;
  return Status::error(StatusCode::kInvalidArgument,
                       "kv cache dtype must be auto, fp8 or fp8_e4m3, got '" + name + "'");
}

const char* kv_cache_dtype_name(KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kFp8 ? "fp8" : "auto";
}

DType kv_pool_dtype(const Backend& backend, KvCacheDtype dtype) {
  return dtype == KvCacheDtype::kFp8 ? DType::kFP8E4M3 : backend.compute_dtype();
}

int64_t kv_row_bytes(const Backend& backend, const AttentionShape& shape, KvCacheDtype dtype) {
  if (dtype == KvCacheDtype::kFp8) return kernels::kv_fp8_row_bytes(shape.kv_heads, shape.head_dim);
  return int64_t{shape.kv_heads} * shape.head_dim * dtype_size(backend.compute_dtype());
}

Status PagedKvCache::alloc_pools() {
  const int64_t rows = pages_ * page_size_;
  const DType dtype = kv_pool_dtype(backend_, dtype_);
  const int64_t width = kv_row_bytes(backend_, shape_, dtype_) / dtype_size(dtype);
  const std::string what = "KV cache of " + std::to_string(rows) + " tokens";
  BURST_RETURN_IF_ERROR(backend_.check_fits(
      2 * shape_.layers * rows * kv_row_bytes(backend_, shape_, dtype_), what));
  for (int l = 0; l < shape_.layers; ++l) {
    for (auto* list : {&k_, &v_}) {
      auto t = backend_.alloc({rows, width}, dtype);
      if (!t.ok()) return Status::error(what + ": " + t.message());
      list->push_back(t.take());
    }
  }
  return {};
}

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::create(Backend& backend, AttentionShape shape,
                                                           int64_t pages, int page_size,
                                                           KvCacheDtype dtype) {
  if (page_size <= 0) return Status::error(StatusCode::kInvalidArgument, "kv page size must be > 0");
  if (pages <= 0 || pages > (int64_t{1} << 31) - 1) {
    return Status::error(StatusCode::kInvalidArgument, "kv cache: bad page count " +
                                                           std::to_string(pages));
  }
  std::unique_ptr<PagedKvCache> c(new PagedKvCache(backend, shape, pages, page_size, dtype));
  BURST_RETURN_IF_ERROR(c->alloc_pools());
  for (int64_t p = 0; p < pages; ++p) c->free_.insert(c->free_.end(), static_cast<int32_t>(p));
  c->refs_.assign(static_cast<size_t>(pages), 0);
  return c;
}

KvUsage PagedKvCache::usage() const {
  KvUsage u{pages_, pages_ - free_pages(), static_cast<int64_t>(seqs_.size()), page_size_};
  u.blocks = static_cast<int64_t>(blocks_.size());
  for (const auto& [id, page] : blocks_) u.cached_pages += refs_[static_cast<size_t>(page)] == 1;
  return u;
}

void PagedKvCache::unref(int32_t p) {
  if (--refs_[static_cast<size_t>(p)] > 0) return;
  if (poison_freed_) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (std::vector<Tensor>* pools : {&k_, &v_}) {
      for (Tensor& pool : *pools) {
        Tensor rows = pool.rows(int64_t{p} * page_size_, page_size_);
        (void)backend_.fill(rows, nan);
      }
    }
  }
  free_.insert(p);
}

Status PagedKvCache::publish(uint64_t seq, int64_t index, int64_t id) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    return Status::error(StatusCode::kInvalidArgument,
                         "kv cache: publish of unknown sequence " + std::to_string(seq));
  }
  if (index < 0 || (index + 1) * page_size_ > it->second.length) {
    return Status::error(StatusCode::kInvalidArgument,
                         "kv cache: page " + std::to_string(index) + " of sequence " +
                             std::to_string(seq) + " is not full (" +
                             std::to_string(it->second.length) + " rows)");
  }
  if (!blocks_.emplace(id, it->second.pages[static_cast<size_t>(index)]).second) {
    return Status::error(StatusCode::kInvalidArgument,
                         "kv cache: prefix block " + std::to_string(id) + " exists");
  }
  ++refs_[static_cast<size_t>(it->second.pages[static_cast<size_t>(index)])];
  return {};
}

Status PagedKvCache::adopt(uint64_t seq, const std::vector<int64_t>& blocks) {
  if (seqs_.count(seq) != 0) {
    return Status::error(StatusCode::kInvalidArgument,
                         "kv cache: sequence " + std::to_string(seq) +
                             " exists: only a new sequence starts from prefix blocks");
  }
  for (int64_t id : blocks) {
    if (!has_block(id)) {
      return Status::error(StatusCode::kInvalidArgument,
                           "kv cache: no prefix block " + std::to_string(id));
    }
  }
  Seq& s = seqs_[seq];
  for (int64_t id : blocks) {
    const int32_t page = blocks_.at(id);
    ++refs_[static_cast<size_t>(page)];
    s.pages.push_back(page);
  }
  s.length = static_cast<int64_t>(blocks.size()) * page_size_;
  return {};
}

Status PagedKvCache::evict(int64_t id) {
  const auto it = blocks_.find(id);
  if (it == blocks_.end()) {
    return Status::error(StatusCode::kInvalidArgument,
                         "kv cache: no prefix block " + std::to_string(id) + " to evict");
  }
  const int32_t page = it->second;
  blocks_.erase(it);
  unref(page);
  return {};
}

int64_t PagedKvCache::length(uint64_t seq) const {
  const auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.length;
}

int64_t PagedKvCache::pending(uint64_t seq) const {
  const auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.pending;
}

const std::vector<int32_t>& PagedKvCache::pages(uint64_t seq) const {
  static const std::vector<int32_t> kNone;
  const auto it = seqs_.find(seq);
  return it == seqs_.end() ? kNone : it->second.pages;
}

int64_t PagedKvCache::pages_needed(uint64_t seq, int64_t rows) const {
  const auto it = seqs_.find(seq);
  const int64_t have_rows = it == seqs_.end() ? 0 : it->second.length + it->second.pending;
  const int64_t have_pages = it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.pages.size());
  return (have_rows + rows + page_size_ - 1) / page_size_ - have_pages;
}

Status PagedKvCache::reserve(uint64_t seq, int64_t rows) {
  if (rows < 0) return Status::error("kv cache: negative reservation");
  Seq& s = seqs_[seq];
  const int64_t want_rows = s.length + s.pending + rows;
  const int64_t want_pages = (want_rows + page_size_ - 1) / page_size_;
  const int64_t more = want_pages - static_cast<int64_t>(s.pages.size());
  if (more > free_pages()) {
    if (s.length == 0 && s.pending == 0 && s.pages.empty()) seqs_.erase(seq);
    return Status::error(StatusCode::kResourceExhausted,
                         "kv cache: " + std::to_string(rows) + " more rows need " +
                             std::to_string(more) + " pages, " + std::to_string(free_pages()) +
                             " free of " + std::to_string(pages_));
  }
  for (int64_t i = 0; i < more; ++i) {
    // Keep the sequence's pages consecutive where the page after its last is free: a prefix
    // on consecutive pages is attended in place (RingAttention::local_prefix), else gathered.
    auto it = s.pages.empty() ? free_.end() : free_.find(s.pages.back() + 1);
    if (it == free_.end()) it = free_.find(run_start());
    s.pages.push_back(*it);
    refs_[static_cast<size_t>(*it)] = 1;
    free_.erase(it);
  }
  s.pending += rows;
  return {};
}

int32_t PagedKvCache::run_start() const {
  // The largest run of free pages (the first of equals).
  int32_t best = *free_.begin(), best_len = 0, begin = best, len = 0, prev = -2;
  for (int32_t p : free_) {
    if (p != prev + 1) {
      begin = p;
      len = 0;
    }
    ++len;
    prev = p;
    if (len > best_len) {
      best = begin;
      best_len = len;
    }
  }
  // A run right behind a sequence's last page is where that sequence grows (a prompt being
  // prefilled chunk by chunk): start halfway along it instead, leaving it room.
  if (best > 0) {
    for (const auto& [id, q] : seqs_) {
      if (!q.pages.empty() && q.pages.back() == best - 1) return best + best_len / 2;
    }
  }
  return best;
}

template <typename F>
Status PagedKvCache::for_each_run(const Seq& s, int64_t row, int64_t count, F&& f) const {
  if (row < 0 || row + count > s.length + s.pending) {
    return Status::error("kv cache: rows [" + std::to_string(row) + ", " +
                         std::to_string(row + count) + ") outside the sequence's " +
                         std::to_string(s.length + s.pending) + " rows");
  }
  int64_t done = 0;
  while (done < count) {
    const int64_t j = row + done;
    const int64_t in_page = j % page_size_;
    auto page = static_cast<size_t>(j / page_size_);
    const int64_t pool_row = int64_t{s.pages[page]} * page_size_ + in_page;
    int64_t n = std::min<int64_t>(count - done, page_size_ - in_page);
    // The run goes on through every following page that is the next one in the pool (a long
    // prompt's pages mostly are): one copy for the run instead of one a page (at 128K on 4
    // GPUs 16-row pages made ~4100 copies a layer, fed at the host's pace: docs/benchmarks.md).
    for (++page; done + n < count && page < s.pages.size() &&
                 s.pages[page] == s.pages[page - 1] + 1;
         ++page) {
      n += std::min<int64_t>(count - done - n, page_size_);
    }
    BURST_RETURN_IF_ERROR(f(pool_row, done, n));
    done += n;
  }
  return {};
}

Status PagedKvCache::write(uint64_t seq, int layer, int64_t row, const Tensor& k,
                           const Tensor& v) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Status::error("kv cache: write to an unknown sequence");
  const auto l = static_cast<size_t>(layer);
  return for_each_run(it->second, row, k.dim(0), [&](int64_t pool_row, int64_t off, int64_t n) {
    Tensor kd = k_[l].rows(pool_row, n), vd = v_[l].rows(pool_row, n);
    if (dtype_ == KvCacheDtype::kFp8) {
      BURST_RETURN_IF_ERROR(backend_.quantize_kv(k.rows(off, n), shape_.kv_heads, nullptr, kd));
      return backend_.quantize_kv(v.rows(off, n), shape_.kv_heads, nullptr, vd);
    }
    BURST_RETURN_IF_ERROR(backend_.copy(k.rows(off, n), kd));
    return backend_.copy(v.rows(off, n), vd);
  });
}

void PagedKvCache::commit(uint64_t seq) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  it->second.length += it->second.pending;
  it->second.pending = 0;
}

void PagedKvCache::release(uint64_t seq) {
  const auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t p : it->second.pages) unref(p);
  seqs_.erase(it);
}

void PagedKvCache::release_all() {
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  for (uint64_t id : ids) release(id);
  std::vector<int64_t> blocks;
  for (const auto& [id, page] : blocks_) blocks.push_back(id);
  for (int64_t id : blocks) (void)evict(id);
}

int64_t kv_capacity_per_rank(int64_t total, int ranks, int64_t chunk) {
  const int64_t chunks = chunk > 0 ? (total + chunk - 1) / chunk : 1;
  return (total + ranks - 1) / ranks + 2 * chunks + 4;
}

int64_t kv_rows_from_memory(int64_t free_bytes, int64_t total_bytes, double fraction,
                            int64_t reserve_bytes, int64_t bytes_per_row, int page_size) {
  if (bytes_per_row <= 0 || page_size <= 0) return 0;
  const auto others = static_cast<int64_t>((1.0 - fraction) * static_cast<double>(total_bytes));
  const int64_t budget = free_bytes - others - reserve_bytes;
  if (budget <= 0) return 0;
  return budget / bytes_per_row / page_size * page_size;
}

}  // namespace burst::engine
