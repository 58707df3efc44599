#include "engine/kv_pages.h"

#include <algorithm>

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

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::create(Backend& backend, AttentionShape shape,
                                                           int64_t pages, int page_size) {
  if (page_size <= 0) return Status::error(StatusCode::kInvalidArgument, "kv page size must be > 0");
  if (pages <= 0 || pages > (int64_t{1} << 31) - 1) {
    return Status::error(StatusCode::kInvalidArgument, "kv cache: bad page count " +
                                                           std::to_string(pages));
  }
  std::unique_ptr<PagedKvCache> c(new PagedKvCache(backend, shape, pages, page_size));
  BURST_RETURN_IF_ERROR(alloc_kv_layers(backend, shape, pages * page_size, c->k_, c->v_));
  for (int64_t p = 0; p < pages; ++p) c->free_.insert(c->free_.end(), static_cast<int32_t>(p));
  return c;
}

KvUsage PagedKvCache::usage() const {
  return {pages_, pages_ - free_pages(), static_cast<int64_t>(seqs_.size()), page_size_};
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
  free_.insert(it->second.pages.begin(), it->second.pages.end());
  seqs_.erase(it);
}

void PagedKvCache::release_all() {
  std::vector<uint64_t> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  for (uint64_t id : ids) release(id);
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
