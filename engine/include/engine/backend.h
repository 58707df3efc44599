// Backend: the ops a LLaMA layer needs, on one device. The model code (models/llama.cpp) is
// written once against this interface; CpuBackend runs them in fp32 with the kernels' CPU
// references, the CUDA backend (engine/cuda) in bf16 with fp32 accumulation.
//
// Every op checks shapes and dtypes and returns a Status naming the op and the shapes; device
// errors (CUDA/cuBLAS) come back as Status with file, line and rank, never as a crash.
// 2-D tensors are [rows, features] row-major; weights follow HF's nn.Linear layout [out, in].
#pragma once

#include <deque>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "engine/status.h"
#include "engine/tensor.h"
#include "engine/tuning.h"
#include "kernels/attention.h"

namespace burst::engine {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual DeviceKind device() const = 0;
  // The dtype of activations, weights and the KV cache on this backend.
  virtual DType compute_dtype() const = 0;
  // The A/B switches this backend was made with (make_backend): its own launches follow them,
  // and so does what runs on it (the NCCL communicator, the worker's step loop).
  const Tuning& tuning() const { return tuning_; }

  virtual Result<Tensor> alloc(std::vector<int64_t> shape, DType dtype) = 0;
  // Converts host data of host_dtype (fp32/bf16/fp16, dst.numel() elements) into dst.
  virtual Status upload(const void* host, DType host_dtype, Tensor& dst) = 0;
  // Copies src to the host as fp32.
  virtual Status download(const Tensor& src, std::vector<float>& host) = 0;
  // dst = src, same dtype and element count (device to device).
  virtual Status copy(const Tensor& src, Tensor& dst) = 0;
  // dst = src converted to dst's dtype (same element count); the ring's fp32 accumulators
  // become activations through it. Backends with one dtype only need the same-dtype copy.
  virtual Status convert(const Tensor& src, Tensor& dst) {
    if (src.dtype == dst.dtype) return copy(src, dst);
    return Status::error(name() + " convert: " + src.describe() + " -> " + dst.describe() +
                         " is not supported");
  }
  // Fills t with uniform values in [-scale, scale] from a counter-based generator keyed by
  // seed (deterministic on every backend). `window` says which part of a larger matrix t is:
  // element (r, c) of t (as [rows, its last dimension]) draws counter (row0 + r) * cols + col0 +
  // c, so a tensor-parallel rank's slice holds exactly the values of the whole matrix there.
  // cols 0: t is the whole (counter = index). A constant fill is fill().
  struct RandomWindow {
    int64_t cols = 0, row0 = 0, col0 = 0;
  };
  virtual Status fill_random(Tensor& t, uint64_t seed, float scale,
                             const RandomWindow& window) = 0;
  Status fill_random(Tensor& t, uint64_t seed, float scale) {
    return fill_random(t, seed, scale, RandomWindow{});
  }
  // Every element of t = value, rounded once to t's dtype. An FP8 tensor gets value's e4m3
  // byte in every byte, its rows' scales included: NaN poisons whole FP8 KV rows, 0 zeroes them.
  virtual Status fill(Tensor& t, float value) = 0;

  // The FP8 KV cache's rows (kernels/kv_fp8.h), kFP8E4M3 tensors [rows, kv_fp8_row_bytes].
  // quantize_kv: src [n, kv_heads * head_dim] of the compute dtype into FP8 rows of dst, row i
  // into dst row dst_rows[i] (this backend's memory; negative: skipped), or into row i when
  // dst_rows is null. dequantize_kv: dst [n, kv_heads * head_dim] (the compute dtype) = the
  // values of src's rows [0, n), rounded once. The CPU backend is kernels/kv_fp8.h's reference;
  // the CUDA one writes the same bytes and values.
  virtual Status quantize_kv(const Tensor& src, int kv_heads, const int32_t* dst_rows,
                             Tensor& dst) = 0;
  virtual Status dequantize_kv(const Tensor& src, int kv_heads, Tensor& dst) = 0;

  // A row of an embedding whose id this backend drew itself: row `row` takes the `index`-th id
  // of the last sample() (or of drawn_ids()'s room), read where it lies (the decode lookahead's
  // "the token this sequence drew last", with no round trip through the host).
  struct DrawnId {
    int64_t row = 0;
    int64_t index = 0;
  };
  // out[r] = table[ids[r]]; table [vocab, dim], out [ids.size(), dim]; ids are validated. The
  // rows that `drawn` names take a drawn id instead (their ids[r] is not read); each index is
  // below the count of drawn_ids().
  virtual Status embedding(const Tensor& table, const std::vector<int32_t>& ids,
                           const std::vector<DrawnId>& drawn, Tensor& out) = 0;
  Status embedding(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out) {
    return embedding(table, ids, {}, out);
  }
  // Where the ids the last sample() drew lie (this backend's memory, int32), readied for n of
  // them; the count embedding() accepts becomes n. The ids stay when n is at most what
  // sample() drew; otherwise the room is for another rank's ids to be broadcast into.
  virtual Status drawn_ids(int64_t n, void** where) = 0;
  // out = rmsnorm(x) * w over the last dimension; x, out [rows, dim]; w [dim].
  virtual Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) = 0;
  // out [m, n] (+)= x [m, k] * w [n, k]^T.
  virtual Status gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) = 0;
  // A layer's normalised input and what reads it. norm_project: h = rms_norm(x) * norm.w
  // (norm.eps), then out_i = h w_i^T for each (w_i, out_i) (no accumulation): a layer's q, k
  // and v. norm_swiglu: the same h, then gate = silu(h w_gate^T) * (h w_up^T). The defaults run
  // rms_norm into norm.h, one gemm per product and silu_mul into gate; a backend may run the
  // products in fewer launches (the CUDA one does for a decode step's few rows), bit for bit
  // the defaults' results, leaving the scratch up untouched. With norm.ready, h already holds
  // rms_norm(x) * w (a tensor-parallel sum normed it: Communicator::all_reduce_add_norm) and
  // only the products run.
  struct Norm {
    const Tensor& w;
    float eps;
    Tensor& h;  // [rows, k], scratch
    bool ready = false;
  };
  struct Projection {
    const Tensor& w;
    Tensor& out;
  };
  // norm.h = rms_norm(x) * norm.w, unless norm.ready.
  Status apply_norm(const Tensor& x, const Norm& norm) {
    return norm.ready ? Status{} : rms_norm(x, norm.w, norm.eps, norm.h);
  }
  virtual Status norm_project(const Tensor& x, const Norm& norm,
                              std::initializer_list<Projection> projections) {
    Status s = apply_norm(x, norm);
    return s.ok() ? project_each(norm.h, projections) : s;
  }
  virtual Status norm_swiglu(const Tensor& x, const Norm& norm, const Tensor& w_gate,
                             const Tensor& w_up, Tensor& gate, Tensor& up) {
    Status s = apply_norm(x, norm);
    return s.ok() ? swiglu_apart(norm.h, w_gate, w_up, gate, up) : s;
  }
  // Rotate-half RoPE in place on x [rows, heads * head_dim], positions absolute (one per row),
  // inv_freq [head_dim / 2] already scaled (models/rope.h).
  virtual Status rope(Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
                      const std::vector<float>& inv_freq) = 0;
  // rope on a layer's q (heads) and k (kv_heads) at the same positions: one launch where the
  // backend can; the default is one rope each.
  virtual Status rope_qk(Tensor& q, int heads, Tensor& k, int kv_heads, int head_dim,
                         const std::vector<int64_t>& positions,
                         const std::vector<float>& inv_freq) {
    Status s = rope(q, heads, head_dim, positions, inv_freq);
    if (s.ok()) s = rope(k, kv_heads, head_dim, positions, inv_freq);
    return s;
  }
  // norm_project, then rope_qk on the first two outputs (a layer's q with rope.heads heads and
  // k with rope.kv_heads): the default runs the two; a backend may rotate at the projections'
  // store (the CUDA one does for a decode step's few rows, one launch fewer a layer), bit for
  // bit the default's results.
  struct RopeQk {
    int heads, kv_heads, head_dim;
    const std::vector<int64_t>& positions;
    const std::vector<float>& inv_freq;
  };
  virtual Status norm_project_rope(const Tensor& x, const Norm& norm,
                                   std::initializer_list<Projection> projections,
                                   const RopeQk& rope) {
    Status s = norm_project(x, norm, projections);
    return s.ok() ? rope_projections(projections, rope) : s;
  }
  // out = silu(gate) * up, all [rows, n].
  virtual Status silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // x += y, same shape.
  virtual Status add(Tensor& x, const Tensor& y) = 0;
  // dst [rows, width] = rows [0, rows) of a paged pool [pool rows, width], same dtype: row i is
  // pool row pages[i / page_size] * page_size + i % page_size; pages is this backend's memory.
  virtual Status gather_rows(const Tensor& pool, const int32_t* pages, int64_t page_size,
                             int64_t rows, Tensor& dst) = 0;
  // pool row dst_rows[i] = src row i ([n, width], same dtype and width); negative entries skip;
  // dst_rows is this backend's memory.
  virtual Status scatter_rows(const Tensor& src, const int32_t* dst_rows, Tensor& pool) = 0;
  // Both of a step's scatters to the same rows (k into k_pool, v into v_pool): one launch where
  // the backend can; the default is one scatter_rows each.
  virtual Status scatter_rows_pair(const Tensor& k, const Tensor& v, const int32_t* dst_rows,
                                   Tensor& k_pool, Tensor& v_pool) {
    Status s = scatter_rows(k, dst_rows, k_pool);
    if (s.ok()) s = scatter_rows(v, dst_rows, v_pool);
    return s;
  }
  // One attention call of the kernels/attention.h contract on this backend's memory.
  virtual Status attention(const kernels::AttnParams& p) = 0;
  // Whether attention(p) takes p with merge_into_o set (the CPU kernel always; on CUDA the
  // prefill kernels with an fp32 o, not the decode kernel: one row, or per-row K/V).
  virtual bool attention_merges(const kernels::AttnParams& p) const = 0;
  // Why FP8 attention (AttnParams::qkv_fp8, --attention-dtype fp8) cannot run here at this
  // head_dim; empty where it can (the CPU emulation always can).
  virtual std::string attention_fp8_refusal(int /*head_dim*/) const { return {}; }
  // One (O, LSE) merge of the kernels/attention.h contract (fp32) on this backend's memory.
  virtual Status merge(const kernels::MergeParams& p) = 0;
  // One token per row of logits [rows, vocab] (this backend's memory, fp32 or its compute
  // dtype): row r drawn by engine::sample_with_uniform's contract (engine/sampler.h) with
  // params[r] (temperature, top_k, top_p; the seed is not used) and uniforms[r] (read only
  // when params[r].temperature > 0: Sampler::draw_uniform gives it), rows of different settings
  // in one call; ids [rows] on the host. The CPU backend is that function itself; the CUDA one
  // its GPU twin (kernels/sampling_cuda.h: the same id but for the documented 1-ulp exp edge).
  // Waits for the ids. check_sample_args says what is refused.
  virtual Status sample(const Tensor& logits, const std::vector<SamplingParams>& params,
                        const std::vector<double>& uniforms, std::vector<int32_t>& ids) = 0;
  // sample() in two halves, so that a caller may queue the next step's work before this step's
  // ids reach the host: sample_queued() queues the draw (its ids are what drawn_ids() and
  // embedding() see from then on, as after sample()); sampled() waits for the oldest queued
  // draw and hands its ids over (in the order the draws were queued); sampled_ready() says
  // whether sampled() would return without waiting. At most kMaxQueuedDraws are outstanding.
  // The defaults draw at once through sample() and keep the ids until sampled().
  static constexpr size_t kMaxQueuedDraws = 2;
  virtual Status sample_queued(const Tensor& logits, const std::vector<SamplingParams>& params,
                               const std::vector<double>& uniforms) {
    if (queued_draws_.size() >= kMaxQueuedDraws) return too_many_draws();
    std::vector<int32_t> ids;
    Status s = sample(logits, params, uniforms, ids);
    if (s.ok()) queued_draws_.push_back(std::move(ids));
    return s;
  }
  virtual Status sampled(std::vector<int32_t>& ids) {
    if (queued_draws_.empty()) return Status::error(name() + " sampled: no draw is queued");
    ids = std::move(queued_draws_.front());
    queued_draws_.pop_front();
    return {};
  }
  virtual bool sampled_ready() const { return true; }
  // The memory plan: OK when `bytes` more fit on the device now, else an error naming `what`,
  // the bytes needed and the bytes free. Called before allocating weights or a KV cache so a
  // model that cannot fit fails with one clear message. Host memory is not planned (default).
  virtual Status check_fits(int64_t bytes, const std::string& what) {
    (void)bytes;
    (void)what;
    return {};
  }
  // Waits for queued work; a no-op on CPU.
  virtual Status synchronize() = 0;

 protected:
  Backend() = default;
  explicit Backend(const Tuning& tuning) : tuning_(tuning) {}
  Status too_many_draws() const {
    return Status::error(name() + " sample_queued: " + std::to_string(kMaxQueuedDraws) +
                         " draws are queued already (sampled() takes them)");
  }
  // The compound ops' products one op at a time (the defaults' second half, and what a
  // backend's override falls back to where it cannot fuse): out_i = h w_i^T each; gate =
  // silu(h w_gate^T) * (h w_up^T) through gemm, gemm, silu_mul.
  Status project_each(const Tensor& h, std::initializer_list<Projection> projections) {
    for (const Projection& p : projections) {
      Status s = gemm(h, p.w, p.out, false);
      if (!s.ok()) return s;
    }
    return {};
  }
  // rope_qk on the first two projections' outputs (norm_project_rope's second half).
  Status rope_projections(std::initializer_list<Projection> projections, const RopeQk& rope) {
    if (projections.size() < 2) return Status::error("norm_project_rope: needs q and k");
    return rope_qk(projections.begin()[0].out, rope.heads, projections.begin()[1].out,
                   rope.kv_heads, rope.head_dim, rope.positions, rope.inv_freq);
  }
  Status swiglu_apart(const Tensor& h, const Tensor& w_gate, const Tensor& w_up, Tensor& gate,
                      Tensor& up) {
    Status s = gemm(h, w_gate, gate, false);
    if (s.ok()) s = gemm(h, w_up, up, false);
    if (s.ok()) s = silu_mul(gate, up, gate);
    return s;
  }

 private:
  Tuning tuning_;
  std::deque<std::vector<int32_t>> queued_draws_;  // the defaults' queued draws
};

// Empty when Backend::embedding may read these ids, else what is wrong: each id of a row that
// `drawn` does not name in [0, vocab); each drawn row one of ids' rows, its index below
// drawn_count (the backend's drawn_ids() count).
std::string check_embedding_ids(int64_t vocab, const std::vector<int32_t>& ids,
                                const std::vector<Backend::DrawnId>& drawn, int64_t drawn_count);

// Empty when Backend::sample may run on these arguments, else what is wrong: logits 2-D with at
// least one id per row, one params (valid: engine::validate) and one uniform per row.
std::string check_sample_args(const Tensor& logits, const std::vector<SamplingParams>& params,
                              const std::vector<double>& uniforms);

// Whether `values` ([n, kv_heads * head_dim], 2-D) and `rows` (kFP8E4M3, [*, kv_fp8_row_bytes])
// are a tensor and its FP8 KV rows (Backend::quantize_kv, dequantize_kv); sets head_dim.
bool kv_rows_match(const Tensor& values, int kv_heads, const Tensor& rows, int& head_dim);

// The CPU backend (fp32). Always available. attention_merges = false makes it report that its
// attention cannot merge into o, so callers take the partial + merge path (the one a CUDA
// decode-shaped launch gets): for tests of that path.
std::unique_ptr<Backend> make_cpu_backend(bool attention_merges = true,
                                          const Tuning& tuning = {});
// The CUDA backend (bf16) on the given device, or an error when CUDA is absent or fails.
// tuning.pdl applies to the whole process (kernels::set_launch_switches), from this call on.
Result<std::unique_ptr<Backend>> make_cuda_backend(int device, const Tuning& tuning = {});
// "cpu" or "cuda[:N]"; `tuning`: Tuning::from_env() in a program's main.
Result<std::unique_ptr<Backend>> make_backend(const std::string& spec,
                                              const Tuning& tuning = {});

}  // namespace burst::engine
