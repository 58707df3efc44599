// CudaBackend's layer ops (the class: engine/cuda/cuda_backend_internal.h; the contract: the top
// of cuda_backend.cu): the embedding, RMSNorm, GEMMs through cuBLAS or the decode GEMV (the
// norm and RoPE fused with it where a decode step allows), RoPE, SwiGLU, add, the KV rows'
// gathers, scatters and FP8 conversions, attention (a prefill kernel, or split-KV decode) and
// merge.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>
#include <vector>

#include "cuda_backend_internal.h"
#include "kernels/attention_cuda.h"
#include "kernels/ops_cuda.h"

namespace burst::engine::cuda_impl {
namespace {

cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kFP8E4M3: return CUDA_R_8F_E4M3;
    case DType::kI32: return CUDA_R_32I;
  }
  return CUDA_R_32F;
}

std::string describe(const kernels::AttnParams& p) {
  return "n_q=" + std::to_string(p.n_q) + " n_kv=" + std::to_string(p.n_kv) + " heads=" +
         std::to_string(p.heads) + "/" + std::to_string(p.kv_heads) + " head_dim=" +
         std::to_string(p.head_dim) + " dtype=" + dtype_name(p.dtype) + " o_dtype=" +
         dtype_name(kernels::output_dtype(p));
}

}  // namespace

Status CudaBackend::quantize_kv(const Tensor& src, int kv_heads, const int32_t* dst_rows,
                                Tensor& dst) {
  BURST_RETURN_IF_ERROR(on_device("quantize_kv", src, dst));
  int head_dim = 0;
  if (!kv_rows_match(src, kv_heads, dst, head_dim) || (!dst_rows && dst.dim(0) < src.dim(0))) {
    return op_error("quantize_kv", src.describe() + " -> " + dst.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("quantize_kv"));
  return launched("quantize_kv",
                  kernels::quantize_kv_cuda(src.data, src.dtype, src.dim(0), kv_heads,
                                            head_dim, dst_rows, dst.data, compute_),
                  src.describe() + " -> " + dst.describe());
}

Status CudaBackend::dequantize_kv(const Tensor& src, int kv_heads, Tensor& dst) {
  BURST_RETURN_IF_ERROR(on_device("dequantize_kv", src, dst));
  int head_dim = 0;
  if (!kv_rows_match(dst, kv_heads, src, head_dim) || src.dim(0) < dst.dim(0)) {
    return op_error("dequantize_kv", src.describe() + " -> " + dst.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("dequantize_kv"));
  return launched("dequantize_kv",
                  kernels::dequantize_kv_cuda(src.data, dst.dim(0), kv_heads, head_dim,
                                              dst.data, dst.dtype, compute_),
                  src.describe() + " -> " + dst.describe());
}

Status CudaBackend::embedding(const Tensor& table, const std::vector<int32_t>& ids,
                              const std::vector<DrawnId>& drawn, Tensor& out) {
  BURST_RETURN_IF_ERROR(on_device("embedding", table, out));
  if (table.shape.size() != 2 || out.shape.size() != 2 || table.dtype != out.dtype ||
      out.dim(0) != static_cast<int64_t>(ids.size()) || out.dim(1) != table.dim(1)) {
    return op_error("embedding", "out " + out.describe() + " for table " + table.describe() +
                                     " and " + std::to_string(ids.size()) + " ids");
  }
  const std::string bad = check_embedding_ids(table.dim(0), ids, drawn, drawn_count_);
  if (!bad.empty()) return op_error("embedding", bad);
  if (ids.empty()) return {};
  BURST_RETURN_IF_ERROR(use_device("embedding"));
  // A drawn row goes to the kernel as -1 - its index (embedding_cuda's encoding).
  std::vector<int32_t> encoded(ids);
  for (const DrawnId& d : drawn) {
    encoded[static_cast<size_t>(d.row)] = static_cast<int32_t>(-1 - d.index);
  }
  const size_t bytes = encoded.size() * sizeof(int32_t);
  BURST_RETURN_IF_ERROR(ensure(ids_, bytes, "embedding"));
  BURST_CUDA_TRY(device_, "embedding",
                 cudaMemcpyAsync(ids_.ptr, encoded.data(), bytes, cudaMemcpyHostToDevice,
                                 compute_));
  return launched("embedding",
                  kernels::embedding_cuda(table.data, static_cast<const int32_t*>(ids_.ptr),
                                          drawn.empty() ? nullptr
                                                        : static_cast<const int32_t*>(drawn_.ptr),
                                          out.data, out.dim(0), out.dim(1), out.dtype,
                                          compute_),
                  table.describe() + " -> " + out.describe());
}

Status CudaBackend::rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  BURST_RETURN_IF_ERROR(on_device("rms_norm", x, w, out));
  const int64_t dim = w.numel();
  if (dim == 0 || x.numel() != out.numel() || x.numel() % dim != 0 || x.dtype != w.dtype ||
      x.dtype != out.dtype) {
    return op_error("rms_norm", x.describe() + " w " + w.describe() + " out " +
                                    out.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("rms_norm"));
  return launched("rms_norm",
                  kernels::rms_norm_cuda(x.data, w.data, out.data, x.numel() / dim, dim, eps,
                                         x.dtype, compute_),
                  x.describe());
}

Status CudaBackend::check_gemm(const char* op, const Tensor& x, const Tensor& w,
                               const Tensor& out) const {
  BURST_RETURN_IF_ERROR(on_device(op, x, w, out));
  if (x.shape.size() != 2 || w.shape.size() != 2 || out.shape.size() != 2 ||
      w.dim(1) != x.dim(1) || out.dim(0) != x.dim(0) || out.dim(1) != w.dim(0) ||
      x.dtype != w.dtype || x.dtype != out.dtype) {
    return op_error(op, "x " + x.describe() + " w " + w.describe() + " out " + out.describe());
  }
  return {};
}

Status CudaBackend::norm_project(const Tensor& x, const Norm& norm,
                                 std::initializer_list<Projection> projections) {
  return project_fused(x, norm, projections, nullptr);
}

Status CudaBackend::norm_project_rope(const Tensor& x, const Norm& norm,
                                      std::initializer_list<Projection> projections,
                                      const RopeQk& rope) {
  if (projections.size() < 2) return rope_projections(projections, rope);  // its error
  BURST_RETURN_IF_ERROR(check_rope(projections.begin()[0].out, rope.heads, rope.head_dim,
                                   rope.positions, rope.inv_freq));
  BURST_RETURN_IF_ERROR(check_rope(projections.begin()[1].out, rope.kv_heads, rope.head_dim,
                                   rope.positions, rope.inv_freq));
  return project_fused(x, norm, projections, &rope);
}

Status CudaBackend::project_fused(const Tensor& x, const Norm& norm,
                                  std::initializer_list<Projection> projections,
                                  const RopeQk* rope) {
  BURST_RETURN_IF_ERROR(apply_norm(x, norm));
  const Tensor& h = norm.h;
  kernels::GemvOut outs[kernels::kGemvMaxOuts];
  int count = 0;
  bool fused = projections.size() <= static_cast<size_t>(kernels::kGemvMaxOuts);
  for (const Projection& p : projections) {
    BURST_RETURN_IF_ERROR(check_gemm("gemm", h, p.w, p.out));
    fused = fused && kernels::gemv_cuda_applies(h.dim(0), p.w.dim(0), h.dim(1), h.dtype,
                                                h.data, p.w.data, p.out.data);
    if (fused) outs[count++] = {p.w.data, p.out.data, p.w.dim(0)};
  }
  if (!fused || count == 0) {
    BURST_RETURN_IF_ERROR(project_each(h, projections));
    return rope ? rope_projections(projections, *rope) : Status{};
  }
  BURST_RETURN_IF_ERROR(use_device("gemm"));
  kernels::GemvRope gr{};
  if (rope) {
    BURST_RETURN_IF_ERROR(upload_rope(rope->positions, rope->inv_freq));
    gr = {static_cast<const int64_t*>(positions_.ptr), static_cast<const float*>(inv_freq_.ptr),
          rope->head_dim, 2};
  }
  return launched("gemm",
                  kernels::gemv_multi_cuda(h.data, outs, count, h.dim(0), h.dim(1), h.dtype,
                                           compute_, rope ? &gr : nullptr),
                  h.describe());
}

Status CudaBackend::norm_swiglu(const Tensor& x, const Norm& norm, const Tensor& w_gate,
                                const Tensor& w_up, Tensor& gate, Tensor& up) {
  BURST_RETURN_IF_ERROR(apply_norm(x, norm));
  const Tensor& h = norm.h;
  BURST_RETURN_IF_ERROR(check_gemm("gemm", h, w_gate, gate));
  BURST_RETURN_IF_ERROR(check_gemm("gemm", h, w_up, up));
  const int64_t m = h.dim(0), n = w_gate.dim(0), k = h.dim(1);
  if (w_up.dim(0) != n ||
      !kernels::gemv_cuda_applies(m, n, k, h.dtype, h.data, w_gate.data, gate.data) ||
      !kernels::gemv_cuda_applies(m, n, k, h.dtype, h.data, w_up.data, gate.data)) {
    return swiglu_apart(h, w_gate, w_up, gate, up);
  }
  BURST_RETURN_IF_ERROR(use_device("gemm"));
  return launched("gemm",
                  kernels::gemv_swiglu_cuda(h.data, w_gate.data, w_up.data, gate.data, m, n, k,
                                            h.dtype, compute_),
                  h.describe());
}

Status CudaBackend::gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) {
  BURST_RETURN_IF_ERROR(check_gemm("gemm", x, w, out));
  const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return op_error("gemm", "dimensions beyond cuBLAS's int range: x " + x.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("gemm"));
  if (m == 0 || n == 0) return {};
  if (k == 0) {  // an empty sum: out = 0, or unchanged when accumulating
    if (!accumulate) {
      BURST_CUDA_TRY(device_, "gemm",
                     cudaMemsetAsync(out.data, 0, static_cast<size_t>(out.bytes()), compute_));
    }
    return {};
  }
  // A decode step's few rows: a kernel that streams w at the bandwidth cuBLAS misses there.
  if (kernels::gemv_cuda_applies(m, n, k, x.dtype, x.data, w.data, out.data)) {
    return launched("gemm",
                    kernels::gemv_cuda(x.data, w.data, out.data, m, n, k, x.dtype, accumulate,
                                       compute_),
                    x.describe());
  }
  // Row-major out[m, n] = x w^T read column-major is out^T[n, m] = w x^T: cuBLAS sees w's
  // buffer as a column-major [k, n] matrix (op T makes it [n, k]) and x's as [k, m] (op N).
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  const cudaDataType_t dt = cuda_data_type(x.dtype);
  // fp32 compute (no TF32 for fp32 tensors): the accumulation precision the contract names.
  BURST_CUBLAS_TRY(device_, "gemm",
                   cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                static_cast<int>(m), static_cast<int>(k), &alpha, w.data, dt,
                                static_cast<int>(k), x.data, dt, static_cast<int>(k), &beta,
                                out.data, dt, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
  return {};
}

Status CudaBackend::check_rope(const Tensor& x, int heads, int head_dim,
                               const std::vector<int64_t>& positions,
                               const std::vector<float>& inv_freq) const {
  BURST_RETURN_IF_ERROR(on_device("rope", x));
  if (x.shape.size() != 2 || static_cast<int64_t>(positions.size()) != x.dim(0) ||
      x.dim(1) != int64_t{heads} * head_dim || head_dim % 2 != 0 ||
      static_cast<int>(inv_freq.size()) != head_dim / 2) {
    return op_error("rope", "x " + x.describe() + " for " + std::to_string(heads) + "x" +
                                std::to_string(head_dim) + ", " +
                                std::to_string(positions.size()) + " positions, " +
                                std::to_string(inv_freq.size()) + " frequencies");
  }
  return {};
}

Status CudaBackend::rope_qk(Tensor& q, int heads, Tensor& k, int kv_heads, int head_dim,
                            const std::vector<int64_t>& positions,
                            const std::vector<float>& inv_freq) {
  BURST_RETURN_IF_ERROR(check_rope(k, kv_heads, head_dim, positions, inv_freq));
  return rope_pair(q, heads, &k, kv_heads, head_dim, positions, inv_freq);
}

Status CudaBackend::upload_rope(const std::vector<int64_t>& positions,
                                const std::vector<float>& inv_freq) {
  BURST_RETURN_IF_ERROR(upload_cached(positions_, positions_host_, positions, "rope"));
  return upload_cached(inv_freq_, inv_freq_host_, inv_freq, "rope");
}

Status CudaBackend::rope_pair(Tensor& x, int heads, Tensor* k, int kv_heads, int head_dim,
                              const std::vector<int64_t>& positions,
                              const std::vector<float>& inv_freq) {
  BURST_RETURN_IF_ERROR(check_rope(x, heads, head_dim, positions, inv_freq));
  if (positions.empty()) return {};
  BURST_RETURN_IF_ERROR(use_device("rope"));
  BURST_RETURN_IF_ERROR(upload_rope(positions, inv_freq));
  return launched("rope",
                  kernels::rope_qk_cuda(x.data, heads, x.dim(1), k ? k->data : nullptr,
                                        k ? kv_heads : 0, k ? k->dim(1) : 0, x.dim(0),
                                        head_dim, static_cast<const int64_t*>(positions_.ptr),
                                        static_cast<const float*>(inv_freq_.ptr), x.dtype,
                                        compute_),
                  x.describe());
}

Status CudaBackend::gather_rows(const Tensor& pool, const int32_t* pages, int64_t page_size,
                                int64_t rows, Tensor& dst) {
  BURST_RETURN_IF_ERROR(on_device("gather_rows", pool, dst));
  if (pool.dtype != dst.dtype || pool.shape.size() != 2 || dst.shape.size() != 2 ||
      pool.dim(1) != dst.dim(1) || dst.dim(0) < rows || page_size <= 0) {
    return op_error("gather_rows", pool.describe() + " -> " + dst.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("gather_rows"));
  return launched("gather_rows",
                  kernels::gather_rows_cuda(pool.data, pages, page_size, rows,
                                            pool.dim(1) * dtype_size(pool.dtype), dst.data,
                                            compute_),
                  pool.describe());
}

Status CudaBackend::scatter_rows_pair(const Tensor& k, const Tensor& v, const int32_t* dst_rows,
                                      Tensor& k_pool, Tensor& v_pool) {
  if (k.shape != v.shape || k.dtype != v.dtype || k_pool.shape != v_pool.shape ||
      k_pool.dtype != v_pool.dtype) {
    return op_error("scatter_rows", k.describe() + ", " + v.describe() + " -> " +
                                        k_pool.describe() + ", " + v_pool.describe());
  }
  return scatter_pair(k, &v, dst_rows, k_pool, &v_pool);
}

Status CudaBackend::scatter_pair(const Tensor& src, const Tensor* src1, const int32_t* dst_rows,
                                 Tensor& pool, Tensor* pool1) {
  BURST_RETURN_IF_ERROR(on_device("scatter_rows", src, pool));
  if (src1) BURST_RETURN_IF_ERROR(on_device("scatter_rows", *src1, *pool1));
  if (pool.dtype != src.dtype || pool.shape.size() != 2 || src.shape.size() != 2 ||
      pool.dim(1) != src.dim(1)) {
    return op_error("scatter_rows", src.describe() + " -> " + pool.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("scatter_rows"));
  return launched("scatter_rows",
                  kernels::scatter_rows_pair_cuda(src.data, pool.data,
                                                  src1 ? src1->data : nullptr,
                                                  pool1 ? pool1->data : nullptr, dst_rows,
                                                  src.dim(0),
                                                  src.dim(1) * dtype_size(src.dtype),
                                                  compute_),
                  src.describe());
}

Status CudaBackend::silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  BURST_RETURN_IF_ERROR(on_device("silu_mul", gate, up, out));
  if (gate.numel() != up.numel() || gate.numel() != out.numel() || gate.dtype != up.dtype ||
      gate.dtype != out.dtype) {
    return op_error("silu_mul", gate.describe() + " " + up.describe() + " " +
                                    out.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("silu_mul"));
  return launched("silu_mul",
                  kernels::silu_mul_cuda(gate.data, up.data, out.data, gate.numel(),
                                         gate.dtype, compute_),
                  gate.describe());
}

Status CudaBackend::add(Tensor& x, const Tensor& y) {
  BURST_RETURN_IF_ERROR(on_device("add", x, y));
  if (x.numel() != y.numel() || x.dtype != y.dtype) {
    return op_error("add", x.describe() + " + " + y.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("add"));
  const int64_t n = x.numel();
  if (n == 0) return {};
  return launched("add", kernels::add_cuda(x.data, y.data, n, x.dtype, compute_),
                  x.describe());
}

Status CudaBackend::attention(const kernels::AttnParams& p) {
  if (p.dtype == DType::kF32) {
    return op_error("attention", "fp32 q/k/v are not supported on CUDA (bf16 or f16)");
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return op_error("attention", "head_dim " + std::to_string(p.head_dim) +
                                     " is not supported by the CUDA attention kernels "
                                     "(64 or 128); run this model on the cpu backend");
  }
  const std::string bad = kernels::validate(p);
  if (!bad.empty()) return op_error("attention", bad);
  BURST_RETURN_IF_ERROR(use_device("attention"));
  if (!kernels::attention_is_decode(p) && !kernels::prefill_reads_kv(p)) {
    return op_error("attention", "paged K/V and FP8 KV rows are read by the decode kernel and "
                                 "by FP8 attention only (n_q 1, per-row K/V, or qkv_fp8), got " +
                                     describe(p));
  }
  if (p.merge_into_o && !attention_merges(p)) {
    return op_error("attention", "merging into o needs a prefill launch with an fp32 o, got " +
                                     describe(p));
  }
  if (kernels::attention_is_decode(p)) {
    // Decode: one query row against a long KV; split-KV keeps every multiprocessor busy.
    const size_t ws = kernels::attention_decode_workspace_bytes(p);
    if (ws == 0) return op_error("attention", "no decode plan for " + describe(p));
    BURST_RETURN_IF_ERROR(ensure(decode_ws_, ws, "attention"));
    return launched("attention",
                    kernels::attention_decode_cuda(p, decode_ws_.ptr, decode_ws_.bytes,
                                                   compute_),
                    describe(p));
  }
  if (p.qkv_fp8) {
    // FP8 attention: the Hopper kernel over e4m3 copies of q, k and v in a workspace.
    const std::string why = attention_fp8_refusal(p.head_dim);
    if (!why.empty()) return op_error("attention", why);
    BURST_RETURN_IF_ERROR(
        ensure(fp8_attention_ws_, kernels::attention_fp8_workspace_bytes(p), "attention"));
    return launched("attention",
                    kernels::attention_fp8_cuda(p, fp8_attention_ws_.ptr,
                                                fp8_attention_ws_.bytes, compute_),
                    describe(p));
  }
  return launched("attention", kernels::attention_cuda(p, compute_, prefill_kernel_),
                  describe(p));
}

std::string CudaBackend::attention_fp8_refusal(int head_dim) const {
  const Status on = use_device("attention");
  if (!on.ok()) return on.message();
  kernels::AttnParams p;
  p.head_dim = head_dim;
  if (kernels::attention_fp8_supported(p)) return {};
  return "fp8 attention runs on Hopper GPUs (compute capability 9.0) at head_dim 128 or 64; "
         "this is " +
         std::string(kernels::attention_fp8_head_dim(head_dim)
                         ? "another GPU"
                         : "head_dim " + std::to_string(head_dim)) +
         " (use --attention-dtype auto)";
}

Status CudaBackend::merge(const kernels::MergeParams& p) {
  if (p.rows < 0 || p.heads < 0 || p.head_dim < 0) return op_error("merge", "negative shape");
  BURST_RETURN_IF_ERROR(use_device("merge"));
  return launched("merge", kernels::merge_cuda(p, compute_),
                  "rows=" + std::to_string(p.rows) + " heads=" + std::to_string(p.heads) +
                      " head_dim=" + std::to_string(p.head_dim));
}

}  // namespace burst::engine::cuda_impl
