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
constexpr int kTagQ = 2;        // pass-Q: a query block around the ring
constexpr int kTagPartial = 3;  // pass-Q: a partial (o, lse) back to its queries' rank

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Posts a send of `bytes` from `send` to rank `to` and a receive into `recv` from rank `from`;
// *h holds the transfer until it is waited on.
Status start_exchange(Communicator& comm, const void* send, int to, void* recv, int from,
                      size_t bytes, int tag, std::unique_ptr<CommHandle>* h) {
  auto r = comm.isendrecv(send, to, recv, from, bytes, tag);
  if (!r.ok()) return r.status();
  *h = r.take();
  return {};
}

// A pass-Q partial buffer (fp32: o [rows, qw], then lse [heads, rows]) seen as its o and lse.
void partial_views(const Tensor& part, int64_t rows, int64_t qw, int heads, Tensor* o,
                   Tensor* lse) {
  *o = part;
  o->shape = {rows, qw};
  *lse = part;
  lse->data = part.at(rows * qw);
  lse->shape = {heads * rows};
}

}  // namespace

Result<AttentionDtype> parse_attention_dtype(const std::string& name) {
  if (name == "auto" || name == "bf16") return AttentionDtype::kAuto;
  if (name == "fp8") return AttentionDtype::kFp8;
  return Status::error("attention dtype must be auto, bf16 or fp8, got '" + name + "'");
}

const char* attention_dtype_name(AttentionDtype dtype) {
  return dtype == AttentionDtype::kFp8 ? "fp8" : "auto";
}

Result<std::unique_ptr<RingAttention>> RingAttention::create(Backend& backend, Communicator& comm,
                                                             AttentionShape shape,
                                                             int64_t capacity, int page_size,
                                                             KvCacheDtype kv_dtype,
                                                             AttentionDtype attention) {
  if (capacity <= 0) return Status::error("kv cache: capacity must be > 0");
  if (page_size <= 0) return Status::error("kv cache: page size must be > 0");
  if (attention == AttentionDtype::kFp8) {
    const std::string why = backend.attention_fp8_refusal(shape.head_dim);
    if (!why.empty()) return Status::error(why);
  }
  std::unique_ptr<RingAttention> r(new RingAttention(backend, comm, shape));
  r->attention_fp8_ = attention == AttentionDtype::kFp8;
  auto cache = PagedKvCache::create(backend, shape, (capacity + page_size - 1) / page_size,
                                    page_size, kv_dtype);
  if (!cache.ok()) return cache.status();
  r->cache_ = cache.take();
  return r;
}

int64_t RingAttention::rows_on(uint64_t seq, int r) const {
  const auto it = rows_.find(seq);
  return it == rows_.end() ? 0 : it->second[static_cast<size_t>(r)];
}

Status RingAttention::adopt(uint64_t seq, const std::vector<int64_t>& blocks) {
  if (rows_.count(seq) != 0) {
    return Status::error(StatusCode::kInvalidArgument,
                         "ring: sequence " + std::to_string(seq) +
                             " exists: only a new sequence starts from prefix blocks");
  }
  BURST_RETURN_IF_ERROR(cache_->adopt(seq, blocks));
  rows_[seq].assign(static_cast<size_t>(comm_.world_size()),
                    static_cast<int64_t>(blocks.size()) * cache_->page_size());
  return {};
}

Status RingAttention::publish(uint64_t seq, int64_t index, int64_t id) {
  for (int r = 0; r < comm_.world_size(); ++r) {
    if (rows_on(seq, r) < (index + 1) * cache_->page_size()) {
      return Status::error(StatusCode::kInvalidArgument,
                           "ring: page " + std::to_string(index) + " of sequence " +
                               std::to_string(seq) + " is not full on rank " + std::to_string(r));
    }
  }
  return cache_->publish(seq, index, id);
}

Status RingAttention::begin_step(std::vector<SeqRows> seqs) {
  const int world = comm_.world_size(), rank = comm_.rank();
  if (in_step_) return Status::error("ring: a step is already in progress");
  // Rows each sequence adds on this rank: its real rows of a chunk, or a decode token cached
  // here (position mod N). Every reservation is checked before any page is taken, so a
  // refusal changes nothing.
  std::vector<int64_t> adds;
  int64_t need = 0;
  for (const SeqRows& s : seqs) {
    adds.push_back(s.decode ? (s.pos % world == rank ? 1 : 0) : s.plan.real_rows(rank));
    need += cache_->pages_needed(s.seq, adds.back());
    if (!s.decode && cache_->length(s.seq) != rows_on(s.seq, rank)) {
      return Status::error("ring: sequence " + std::to_string(s.seq) + " holds " +
                           std::to_string(cache_->length(s.seq)) + " rows, expected " +
                           std::to_string(rows_on(s.seq, rank)));
    }
  }
  if (need > cache_->free_pages()) {
    return Status::error(StatusCode::kResourceExhausted,
                         "kv cache of rank " + std::to_string(rank) + ": the step needs " +
                             std::to_string(need) + " pages, " +
                             std::to_string(cache_->free_pages()) + " are free");
  }
  std::vector<int32_t> tables, kv_lens;
  table_offset_.clear();
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqRows& s = seqs[i];
    const int64_t add = adds[i];
    BURST_RETURN_IF_ERROR(cache_->reserve(s.seq, add));
    rows_.try_emplace(s.seq, static_cast<size_t>(world), 0);
    if (s.decode) {
      table_offset_.push_back(static_cast<int64_t>(tables.size()));
      kv_lens.push_back(static_cast<int32_t>(cache_->length(s.seq) + add));
      const auto& pages = cache_->pages(s.seq);
      tables.insert(tables.end(), pages.begin(), pages.end());
    }
  }
  decode_max_kv_ = kv_lens.empty() ? 0 : *std::max_element(kv_lens.begin(), kv_lens.end());
  if (!kv_lens.empty()) {
    // After the page tables: each decode token's key count and page-table offset, the
    // per-row arrays of one batched decode launch (AttnParams::row_kv_len).
    decode_meta_ = static_cast<int64_t>(tables.size());
    tables.insert(tables.end(), kv_lens.begin(), kv_lens.end());
    for (int64_t off : table_offset_) tables.push_back(static_cast<int32_t>(off));
  }
  // Then, per decode token, the pool row its k/v goes to on this rank (-1: another rank's):
  // one scatter per layer writes them all.
  decode_dst_ = static_cast<int64_t>(tables.size());
  for (const SeqRows& s : seqs) {
    if (!s.decode) continue;
    if (s.pos % world != rank) {
      tables.push_back(-1);
      continue;
    }
    const int64_t len = cache_->length(s.seq);
    const auto& pages = cache_->pages(s.seq);
    const int64_t ps = cache_->page_size();
    tables.push_back(static_cast<int32_t>(int64_t{pages[static_cast<size_t>(len / ps)]} * ps +
                                          len % ps));
  }
  // Then the page tables of the prefill chunks' sequences: their cached prefix is gathered
  // into the ring's block in one launch per layer (backend gather_rows).
  prefill_table_.clear();
  for (const SeqRows& s : seqs) {
    if (s.decode) continue;
    prefill_table_[s.seq] = static_cast<int64_t>(tables.size());
    const auto& pages = cache_->pages(s.seq);
    tables.insert(tables.end(), pages.begin(), pages.end());
  }
  if (!tables.empty()) {
    // The step's tables, one upload of int32 for the step.
    BURST_RETURN_IF_ERROR(ensure(tables_, {static_cast<int64_t>(tables.size())}, DType::kI32));
    BURST_RETURN_IF_ERROR(backend_.upload(tables.data(), DType::kI32, tables_));
  }
  step_ = std::move(seqs);
  in_step_ = true;
  return {};
}

void RingAttention::end_step() {
  const int world = comm_.world_size();
  for (const SeqRows& s : step_) {
    cache_->commit(s.seq);
    auto& rows = rows_[s.seq];
    rows.resize(static_cast<size_t>(world), 0);
    if (s.decode) {
      ++rows[static_cast<size_t>(s.pos % world)];
    } else {
      for (int r = 0; r < world; ++r) rows[static_cast<size_t>(r)] += s.plan.real_rows(r);
    }
  }
  step_.clear();
  in_step_ = false;
}

void RingAttention::release(uint64_t seq) {
  cache_->release(seq);
  rows_.erase(seq);
}

void RingAttention::clear() {
  cache_->release_all();
  rows_.clear();
  step_.clear();
  in_step_ = false;
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

Status RingAttention::ensure_block(Tensor& t, int64_t rows) {
  const DType dtype = kv_pool_dtype(backend_, cache_->dtype());
  const int64_t width = kv_row_bytes(backend_, shape_, cache_->dtype()) / dtype_size(dtype);
  return ensure(t, {2 * rows, width}, dtype);
}

Status RingAttention::attend(int layer, const Tensor& q, const Tensor& k, const Tensor& v,
                             const std::vector<int64_t>& positions, Tensor& out) {
  if (layer < 0 || layer >= shape_.layers) return Status::error("ring: bad layer index");
  if (!in_step_) return Status::error("ring: attend outside a step (begin_step first)");
  const int rank = comm_.rank();
  int64_t rows = 0;
  for (const SeqRows& s : step_) rows = std::max(rows, s.row + s.rows(rank));
  if (q.dim(0) != rows) {
    return Status::error("ring: rank " + std::to_string(rank) + " got " +
                         std::to_string(q.dim(0)) + " rows, its step has " +
                         std::to_string(rows));
  }
  for (const SeqRows& s : step_) {
    if (s.decode) continue;
    const int64_t n = s.rows(rank);
    Tensor o = out.rows(s.row, n);
    BURST_RETURN_IF_ERROR(prefill(layer, s, q.rows(s.row, n), k.rows(s.row, n),
                                  v.rows(s.row, n), o));
  }
  return decode(layer, q, k, v, positions, out);
}

Status RingAttention::prefill_buffers(const SeqRows& sr, PrefillBlocks& b) {
  const int world = comm_.world_size();
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  b.rows = sr.plan.local_rows(comm_.rank());
  b.prefix.assign(static_cast<size_t>(world), 0);
  int64_t max_prefix = 0;
  for (int r = 0; r < world; ++r) {
    b.prefix[static_cast<size_t>(r)] = rows_on(sr.seq, r);
    max_prefix = std::max(max_prefix, b.prefix[static_cast<size_t>(r)]);
  }
  b.block_rows = max_prefix + b.rows;
  BURST_RETURN_IF_ERROR(ensure(o_acc_, {b.rows, qw}, DType::kF32));
  return ensure(lse_acc_, {shape_.heads * b.rows}, DType::kF32);
}

Status RingAttention::reset_acc(Tensor& o, Tensor& lse) {
  // Nothing seen yet: o 0 and lse -inf, so the first merge takes the partial as is.
  BURST_RETURN_IF_ERROR(backend_.fill(o, 0.f));
  return backend_.fill(lse, kNegInf);
}

bool RingAttention::pass_q(const PrefillBlocks& b) const {
  if (pass_ != RingPass::kAuto) return pass_ == RingPass::kQ;
  // One rank: pass-Q is its first step alone, the queries against this rank's keys where they
  // lie (the chunk's k/v as made, the prefix in the pool), where pass-KV first copies both
  // into a block: ~2 GB of copies per layer late in a 128K prompt on one GPU.
  if (comm_.world_size() == 1) return true;
  if (!transfers_) return false;
  // Bytes one hop moves: a KV block (K and V of the largest prefix plus the chunk) against a
  // query block out and its fp32 (o, lse) partial back.
  const int64_t elt = static_cast<int64_t>(dtype_size(backend_.compute_dtype()));
  const int64_t kv = b.block_rows * 2 * kv_row_bytes(backend_, shape_, cache_->dtype());
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  const int64_t q = b.rows * (qw * elt + (qw + shape_.heads) * 4);
  return q < kv;
}

Status RingAttention::load_own_block(int layer, const SeqRows& sr, const PrefillBlocks& b,
                                     const Tensor& k, const Tensor& v) {
  const int64_t own_prefix = b.prefix[static_cast<size_t>(comm_.rank())];
  Tensor pk = block_[0].rows(0, own_prefix), pv = block_[0].rows(b.block_rows, own_prefix);
  if (own_prefix > 0) BURST_RETURN_IF_ERROR(gather_prefix(layer, sr, own_prefix, pk, pv));
  return own_rows(k, v, block_[0], own_prefix, b.block_rows);
}

Status RingAttention::own_rows(const Tensor& k, const Tensor& v, Tensor& block, int64_t row,
                               int64_t block_rows) {
  const int64_t n = k.dim(0);
  Tensor ck = block.rows(row, n), cv = block.rows(block_rows + row, n);
  if (fp8()) {
    BURST_RETURN_IF_ERROR(backend_.quantize_kv(k, shape_.kv_heads, nullptr, ck));
    return backend_.quantize_kv(v, shape_.kv_heads, nullptr, cv);
  }
  BURST_RETURN_IF_ERROR(backend_.copy(k, ck));
  return backend_.copy(v, cv);
}

Status RingAttention::block_values(const Tensor& block, int64_t block_rows, KvView* kv) {
  // FP8 attention's quantizer reads FP8 rows as they are (7B, 128K in 8K chunks with both FP8
  // settings on one H200: the dequantized copies took 236 ms and the prefix's gathers 158 ms).
  if (!fp8() || attention_fp8_) {
    *kv = KvView{block.data, block.at(block_rows * block.dim(1)), fp8()};
    return {};
  }
  const int64_t kvw = int64_t{shape_.kv_heads} * shape_.head_dim;
  BURST_RETURN_IF_ERROR(ensure(kv_values_, {2 * block_rows, kvw}, backend_.compute_dtype()));
  Tensor rows = block.rows(0, 2 * block_rows);
  BURST_RETURN_IF_ERROR(backend_.dequantize_kv(rows, shape_.kv_heads, kv_values_));
  *kv = KvView{kv_values_.data, kv_values_.at(block_rows * kvw)};
  return {};
}

Status RingAttention::gather_prefix(int layer, const SeqRows& sr, int64_t n, Tensor& k,
                                    Tensor& v) {
  const int32_t* pages = tables_.at<int32_t>(prefill_table_.at(sr.seq));
  const int64_t ps = cache_->page_size();
  BURST_RETURN_IF_ERROR(backend_.gather_rows(cache_->k_pool(layer), pages, ps, n, k));
  return backend_.gather_rows(cache_->v_pool(layer), pages, ps, n, v);
}

Status RingAttention::attend_merge(int64_t rows, const void* q, const KvView& kv,
                                   const Segment& qs, const Segment& ks, kernels::MaskKind mask,
                                   float* o_acc, float* lse_acc, bool direct) {
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  const auto elt = static_cast<int64_t>(dtype_size(backend_.compute_dtype()));
  const int64_t kv_row = kv.fp8_rows ? kv_row_bytes(backend_, shape_, KvCacheDtype::kFp8)
                                     : int64_t{shape_.kv_heads} * shape_.head_dim * elt;
  if (kv.pages && ks.row != 0) {
    return Status::error("ring attention: a paged prefix is read from its first row");
  }
  kernels::AttnParams p;
  p.heads = shape_.heads;
  p.kv_heads = shape_.kv_heads;
  p.head_dim = shape_.head_dim;
  p.n_q = static_cast<int32_t>(qs.len);
  p.n_kv = static_cast<int32_t>(ks.len);
  kernels::set_packed_strides(p);
  p.lse_head_stride = rows;  // partial lse laid out [heads, rows] over all local rows
  p.q = static_cast<const char*>(q) + qs.row * qw * elt;
  p.k = static_cast<const char*>(kv.k) + ks.row * kv_row;
  p.v = static_cast<const char*>(kv.v) + ks.row * kv_row;
  if (kv.fp8_rows) {
    p.kv_fp8 = true;
    p.k_row_stride = p.v_row_stride = kv_row;
  }
  if (kv.pages) {
    p.kv_pages = kv.pages;
    p.page_size = static_cast<int32_t>(cache_->page_size());
  }
  const MaskStarts starts = mask_starts(qs, ks);
  p.q_start = starts.q_start;
  p.kv_start = starts.kv_start;
  p.mask = mask;
  p.scale = shape_.logit_scale / std::sqrt(static_cast<float>(shape_.head_dim));
  p.dtype = backend_.compute_dtype();
  p.o_dtype = DType::kF32;  // partials merge in fp32, never rounded between hops
  p.beside_transfer = beside_transfer_;
  p.qkv_fp8 = attention_fp8_;
  if (direct_out_ != nullptr) {  // the only contribution: straight into the output
    if (!direct || direct_written_) {
      return Status::error("ring attention: a second contribution to a one-call prefill");
    }
    direct_written_ = true;
    p.o_dtype = direct_out_->dtype;
    p.o = direct_out_->at(qs.row * qw);
    p.lse = lse_acc + qs.row;
    return backend_.attention(p);
  }
  // The first contribution to these rows goes straight into the accumulator (same layout);
  // later ones merge into it, in the kernel where the backend's does that (one pass over the
  // accumulator), else through a partial and a merge.
  p.merge_into_o = !direct && backend_.attention_merges(p);
  const bool in_place = direct || p.merge_into_o;
  if (!in_place) {  // scratch only where the kernel cannot merge (1 GiB at 128K on 2 GPUs)
    BURST_RETURN_IF_ERROR(ensure(o_part_, {rows, qw}, DType::kF32));
    BURST_RETURN_IF_ERROR(ensure(lse_part_, {shape_.heads * rows}, DType::kF32));
  }
  p.o = in_place ? static_cast<void*>(o_acc + qs.row * qw) : o_part_.at(qs.row * qw);
  p.lse = in_place ? lse_acc + qs.row : lse_part_.at<float>(qs.row);
  BURST_RETURN_IF_ERROR(backend_.attention(p));
  if (in_place) return {};
  return merge(o_acc + qs.row * qw, lse_acc + qs.row, o_part_.at<float>(qs.row * qw),
               lse_part_.at<float>(qs.row), qs.len, rows);
}

Status RingAttention::merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b,
                            int64_t rows, int64_t lse_stride, Tensor* out) {
  kernels::MergeParams m;
  m.o_a = o_a;
  m.lse_a = lse_a;
  m.o_b = o_b;
  m.lse_b = lse_b;
  m.o_row_stride = int64_t{shape_.heads} * shape_.head_dim;
  m.o_head_stride = shape_.head_dim;
  m.lse_head_stride = lse_stride;
  m.rows = static_cast<int32_t>(rows);
  m.heads = shape_.heads;
  m.head_dim = shape_.head_dim;
  if (out != nullptr) {
    m.out = out->data;
    m.out_dtype = out->dtype;
    m.out_row_stride = out->dim(1);
  }
  return backend_.merge(m);
}

Status RingAttention::cache_chunk(int layer, const SeqRows& sr, const PrefillBlocks& b,
                                  const Tensor& k, const Tensor& v) {
  // Padding rows are never attended to again: only the real ones follow the prefix.
  int64_t written = b.prefix[static_cast<size_t>(comm_.rank())];
  for (const Segment& sg : sr.plan.segments(comm_.rank())) {
    const int64_t valid = sr.plan.real_len(sg);
    if (valid == 0) continue;
    BURST_RETURN_IF_ERROR(
        cache_->write(sr.seq, layer, written, k.rows(sg.row, valid), v.rows(sg.row, valid)));
    written += valid;
  }
  return {};
}

Status RingAttention::prefill(int layer, const SeqRows& sr, const Tensor& q, const Tensor& k,
                              const Tensor& v, Tensor& out) {
  PrefillBlocks b;
  BURST_RETURN_IF_ERROR(prefill_buffers(sr, b));
  // One rank, nothing cached before the chunk and one segment of all its rows: the attention is
  // one kernel call, which writes `out` itself (7B, 128K on one H200: the conversion pass took
  // 24 ms of the prefill, and the fp32 rows written twice the bytes).
  const std::vector<Segment> segs = sr.plan.segments(comm_.rank());
  const bool by_q = pass_q(b);
  const bool one_call = by_q && comm_.world_size() == 1 && b.prefix[0] == 0 && segs.size() == 1 &&
                        segs[0].len == b.rows && segs[0].row == 0 && b.rows > 0;
  direct_out_ = one_call ? &out : nullptr;
  direct_written_ = false;
  const Status st = by_q ? prefill_pass_q(layer, sr, b, q, k, v)
                         : prefill_pass_kv(layer, sr, b, q, k, v);
  direct_out_ = nullptr;
  BURST_RETURN_IF_ERROR(st);
  if (!direct_written_) BURST_RETURN_IF_ERROR(backend_.convert(o_acc_, out));
  return cache_chunk(layer, sr, b, k, v);
}

Status RingAttention::prefill_pass_kv(int layer, const SeqRows& sr, const PrefillBlocks& b,
                                      const Tensor& q, const Tensor& k, const Tensor& v) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const ShardPlan& plan = sr.plan;
  // A block is K rows then V rows, one buffer, so one transfer moves both.
  for (Tensor& block : block_) BURST_RETURN_IF_ERROR(ensure_block(block, b.block_rows));
  BURST_RETURN_IF_ERROR(load_own_block(layer, sr, b, k, v));
  const std::vector<Segment> q_segs = plan.segments(rank);
  const int next = (rank + 1) % world, prev = (rank - 1 + world) % world;
  const size_t block_bytes = static_cast<size_t>(block_[0].bytes());

  for (int s = 0; s < world; ++s) {
    Tensor& cur = block_[transfers_ ? s % 2 : 0];
    Tensor& nxt = block_[(s + 1) % 2];
    // Double buffer: post the transfer of the block for step s + 1 before computing step s.
    // `cur` is only read while it is being sent; `nxt` is not touched until its recv completes.
    std::unique_ptr<CommHandle> xfer;
    if (s + 1 < world && transfers_) {
      BURST_RETURN_IF_ERROR(
          start_exchange(comm_, cur.data, next, nxt.data, prev, block_bytes, kTagKv, &xfer));
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int src = (rank - s + world) % world;
    const int64_t src_prefix = b.prefix[static_cast<size_t>(src)];
    // The block in hand: in place, or (FP8 rows under bf16 attention) its values.
    KvView kv;
    BURST_RETURN_IF_ERROR(block_values(cur, b.block_rows, &kv));
    beside_transfer_ = xfer != nullptr;
    BURST_RETURN_IF_ERROR(attend_keys(b.rows, q.data, q_segs, kv, src_prefix, kv,
                                      plan.segments(src), src_prefix, o_acc_, lse_acc_,
                                      /*fresh=*/s == 0));
    beside_transfer_ = false;
    // Host time of the compute: exact on CPU; on a GPU the ops are queued, so the benchmark
    // measures with events instead.
    const auto t1 = std::chrono::steady_clock::now();
    // The next step reads `nxt` (it must have arrived) and the step after overwrites `cur`
    // (our send of it must be done).
    if (xfer) BURST_RETURN_IF_ERROR(xfer->wait());
    count_step(t0, t1);
  }
  return {};
}

Status RingAttention::attend_keys(int64_t rows, const void* q, const std::vector<Segment>& q_segs,
                                  const KvView& prefix, int64_t n_prefix, const KvView& own,
                                  const std::vector<Segment>& k_segs, int64_t k_row0, Tensor& o,
                                  Tensor& lse, bool fresh) {
  auto relation = [](const Segment& qs, const Segment& ks) {
    const MaskStarts m = mask_starts(qs, ks);
    return kernels::block_relation(m.q_start, qs.len, m.kv_start, ks.len);
  };
  if (fresh && n_prefix == 0) {
    // A query segment no key reaches would keep what the buffer held: start from nothing seen.
    for (const Segment& qs : q_segs) {
      bool reached = false;
      for (const Segment& ks : k_segs) reached |= relation(qs, ks) != kernels::BlockRelation::kSkip;
      if (reached) continue;
      BURST_RETURN_IF_ERROR(reset_acc(o, lse));
      fresh = false;
      break;
    }
  }
  float* o_acc = o.as<float>();
  float* lse_acc = lse.as<float>();
  if (n_prefix > 0) {
    // Every prefix key precedes every query of the chunk: no mask, and positions do not matter.
    BURST_RETURN_IF_ERROR(attend_merge(rows, q, prefix, Segment{0, 0, rows},
                                       Segment{0, 0, n_prefix}, kernels::MaskKind::kNone, o_acc,
                                       lse_acc, fresh));
    fresh = false;
  }
  for (const Segment& qs : q_segs) {
    bool first = fresh;
    for (const Segment& ks : k_segs) {
      const auto rel = relation(qs, ks);
      if (rel == kernels::BlockRelation::kSkip) continue;  // keys all after the queries
      BURST_RETURN_IF_ERROR(attend_merge(
          rows, q, own, qs, Segment{ks.pos, k_row0 + ks.row, ks.len, ks.stride},
          rel == kernels::BlockRelation::kFull ? kernels::MaskKind::kNone
                                               : kernels::MaskKind::kCausal,
          o_acc, lse_acc, first));
      first = false;
    }
  }
  return {};
}

void RingAttention::count_step(std::chrono::steady_clock::time_point t0,
                               std::chrono::steady_clock::time_point t1) {
  const auto t2 = std::chrono::steady_clock::now();
  stats_.compute_ms += ms_between(t0, t1);
  stats_.wait_ms += ms_between(t1, t2);
  ++stats_.steps;
}

RingAttention::KvView RingAttention::pool_prefix(int layer, const SeqRows& sr, int64_t n) const {
  const Tensor& kp = cache_->k_pool(layer);
  const Tensor& vp = cache_->v_pool(layer);
  const std::vector<int32_t>& pages = cache_->pages(sr.seq);
  const int64_t ps = cache_->page_size();
  bool runs = true;
  for (int64_t i = 1; i < (n + ps - 1) / ps && runs; ++i) {
    runs = pages[static_cast<size_t>(i)] == pages[0] + i;
  }
  if (runs) {  // from their first row: no page table for the launch to read
    const int64_t first = int64_t{pages[0]} * ps * kp.dim(1);
    return KvView{kp.at(first), vp.at(first), fp8()};
  }
  return KvView{kp.data, vp.data, fp8(), tables_.at<int32_t>(prefill_table_.at(sr.seq))};
}

Status RingAttention::local_prefix(int layer, const SeqRows& sr, int64_t n, KvView* kv) {
  *kv = pool_prefix(layer, sr, n);
  if (!kv->pages) return {};  // the pool rows in place: no copy
  const int64_t kvw = int64_t{shape_.kv_heads} * shape_.head_dim;
  BURST_RETURN_IF_ERROR(ensure(block_[0], {2 * n, kvw}, backend_.compute_dtype()));
  Tensor pk = block_[0].rows(0, n), pv = block_[0].rows(n, n);
  BURST_RETURN_IF_ERROR(gather_prefix(layer, sr, n, pk, pv));
  *kv = KvView{pk.data, pv.data};
  return {};
}

Status RingAttention::pass_q_keys(int layer, const SeqRows& sr, const PrefillBlocks& b,
                                  const Tensor& k, const Tensor& v, KvView* prefix, KvView* own,
                                  int64_t* own_row0) {
  const int64_t own_prefix = b.prefix[static_cast<size_t>(comm_.rank())];
  *prefix = KvView{};
  *own = KvView{k.data, v.data};
  *own_row0 = 0;
  if (attention_fp8_) {
    // FP8 attention's quantizer reads the cached prefix in its pages, as the pool holds it;
    // under fp8 the chunk's rows are rounded as the cache rounds them.
    if (own_prefix > 0) *prefix = pool_prefix(layer, sr, own_prefix);
    if (!fp8()) return {};
    BURST_RETURN_IF_ERROR(ensure_block(block_[0], b.rows));
    BURST_RETURN_IF_ERROR(own_rows(k, v, block_[0], 0, b.rows));
    return block_values(block_[0], b.rows, own);
  }
  if (fp8()) {  // one block of FP8 rows, prefix then chunk, read as its values
    BURST_RETURN_IF_ERROR(ensure_block(block_[0], b.block_rows));
    BURST_RETURN_IF_ERROR(load_own_block(layer, sr, b, k, v));
    BURST_RETURN_IF_ERROR(block_values(block_[0], b.block_rows, prefix));
    *own = *prefix;
    *own_row0 = own_prefix;
    return {};
  }
  return own_prefix > 0 ? local_prefix(layer, sr, own_prefix, prefix) : Status{};
}

Status RingAttention::prefill_pass_q(int layer, const SeqRows& sr, const PrefillBlocks& b,
                                     const Tensor& q, const Tensor& k, const Tensor& v) {
  const int world = comm_.world_size(), rank = comm_.rank();
  const ShardPlan& plan = sr.plan;
  const int64_t qw = int64_t{shape_.heads} * shape_.head_dim;
  const DType dt = backend_.compute_dtype();
  const int64_t own_prefix = b.prefix[static_cast<size_t>(rank)];
  KvView prefix, own;
  int64_t own_row0 = 0;
  BURST_RETURN_IF_ERROR(pass_q_keys(layer, sr, b, k, v, &prefix, &own, &own_row0));
  const std::vector<Segment> own_segs = plan.segments(rank);
  // Every rank holds as many chunk rows (padding included), so blocks have one size. A
  // partial is o [rows, qw] then lse [heads, rows], fp32, one buffer for one transfer.
  const int64_t o_len = b.rows * qw, part = o_len + shape_.heads * b.rows;
  // One rank has no step 1: no query block arrives and no partial travels (at 128K rows these
  // buffers would be ~10 GB of a 7B's GPU memory).
  for (int i = 0; i < 2 && world > 1; ++i) {
    BURST_RETURN_IF_ERROR(ensure(q_block_[i], {b.rows, qw}, dt));
    BURST_RETURN_IF_ERROR(ensure(part_out_[i], {part}, DType::kF32));
    BURST_RETURN_IF_ERROR(ensure(part_in_[i], {part}, DType::kF32));
  }
  const size_t q_bytes = static_cast<size_t>(b.rows * qw) * dtype_size(dt);
  const size_t part_bytes = static_cast<size_t>(part) * 4;
  const int next = (rank + 1) % world, prev = (rank - 1 + world) % world;
  // The partial of our queries computed by rank (rank + s), merged into the accumulator.
  std::unique_ptr<CommHandle> back[2];
  auto merge_back = [&](int slot) -> Status {
    if (!back[slot]) return {};
    BURST_RETURN_IF_ERROR(back[slot]->wait());
    back[slot].reset();
    return merge(o_acc_.as<float>(), lse_acc_.as<float>(), part_in_[slot].as<float>(),
                 part_in_[slot].as<float>() + o_len, b.rows, b.rows);
  };

  for (int s = 0; s < world; ++s) {
    // Step s: the queries of rank src against this rank's keys. The next step's query block is
    // in flight meanwhile; the partial goes back to src while step s + 1 computes.
    const int src = (rank - s + world) % world;
    const void* qcur = s == 0 ? q.data : q_block_[s % 2].data;
    std::unique_ptr<CommHandle> xfer;
    if (s + 1 < world) {
      BURST_RETURN_IF_ERROR(start_exchange(comm_, qcur, next, q_block_[(s + 1) % 2].data, prev,
                                           q_bytes, kTagQ, &xfer));
    }
    const auto t0 = std::chrono::steady_clock::now();
    Tensor o_to = o_acc_, lse_to = lse_acc_;
    if (s > 0) {
      // This slot's previous partial (step s - 2) must have left, and its answer merged.
      BURST_RETURN_IF_ERROR(merge_back(s % 2));
      partial_views(part_out_[s % 2], b.rows, qw, shape_.heads, &o_to, &lse_to);
    }
    beside_transfer_ = xfer != nullptr || back[0] != nullptr || back[1] != nullptr;
    BURST_RETURN_IF_ERROR(attend_keys(b.rows, qcur, plan.segments(src), prefix, own_prefix,
                                      own, own_segs, own_row0, o_to, lse_to, /*fresh=*/true));
    beside_transfer_ = false;
    const auto t1 = std::chrono::steady_clock::now();
    if (xfer) BURST_RETURN_IF_ERROR(xfer->wait());
    if (s > 0) {
      BURST_RETURN_IF_ERROR(start_exchange(comm_, part_out_[s % 2].data, src,
                                           part_in_[s % 2].data, (rank + s) % world, part_bytes,
                                           kTagPartial, &back[s % 2]));
    }
    count_step(t0, t1);
  }
  // The last partials, in the order they were sent.
  for (int s = std::max(1, world - 2); s < world; ++s) BURST_RETURN_IF_ERROR(merge_back(s % 2));
  return {};
}

}  // namespace burst::engine
