// CpuBackend: the Backend ops in fp32 on host memory, through the kernels' CPU references.
// It is both the embedded default (tiny model, CI) and the twin every CUDA op is tested against.
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>

#include "engine/backend.h"
#include "engine/dtype_convert.h"
#include "engine/random.h"
#include "engine/sampler.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops.h"

namespace burst::engine {
namespace {

Status shape_error(const char* op, const std::string& what) {
  return Status::error(std::string("cpu ") + op + ": " + what);
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(bool merges, const Tuning& tuning) : Backend(tuning), merges_(merges) {}
  std::string name() const override { return "cpu"; }
  DeviceKind device() const override { return DeviceKind::kCpu; }
  DType compute_dtype() const override { return DType::kF32; }

  Result<Tensor> alloc(std::vector<int64_t> shape, DType dtype) override {
    Tensor t = Tensor::unallocated(std::move(shape), dtype, DeviceKind::kCpu);
    if (const std::string why = t.shape_problem(); !why.empty()) return shape_error("alloc", why);
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(t.bytes(), 64));
    // 64-byte aligned for the vector loops; zeroed so a bug reads zeros, not old data.
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) return shape_error("alloc", "out of host memory for " + t.describe());
    std::memset(p, 0, bytes);
    t.storage = std::shared_ptr<void>(p, std::free);
    t.data = p;
    return t;
  }

  Status upload(const void* host, DType host_dtype, Tensor& dst) override {
    if (dst.dtype == DType::kI32 || host_dtype == DType::kI32) {  // tables: bits unchanged
      if (dst.dtype != host_dtype) return shape_error("upload", "i32 uploads only into i32");
      std::memcpy(dst.data, host, static_cast<size_t>(dst.bytes()));
      return {};
    }
    if (dst.dtype != DType::kF32) return shape_error("upload", "cpu tensors are f32");
    const int64_t n = dst.numel();
    float* out = dst.as<float>();
    switch (host_dtype) {
      case DType::kF32: std::memcpy(out, host, static_cast<size_t>(n) * 4); break;
      case DType::kBF16: {
        const auto* h = static_cast<const uint16_t*>(host);
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(h[i]);
        break;
      }
      case DType::kF16: {
        const auto* h = static_cast<const uint16_t*>(host);
        for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(h[i]);
        break;
      }
      case DType::kFP8E4M3: return shape_error("upload", "fp8 is not a host format");
      case DType::kI32: break;  // above
    }
    return {};
  }

  Status download(const Tensor& src, std::vector<float>& host) override {
    if (src.dtype == DType::kI32) {
      host.assign(src.as<int32_t>(), src.as<int32_t>() + src.numel());
      return {};
    }
    if (src.dtype != DType::kF32) return shape_error("download", "cpu tensors are f32");
    host.assign(src.as<float>(), src.as<float>() + src.numel());
    return {};
  }

  Status copy(const Tensor& src, Tensor& dst) override {
    if (src.dtype != dst.dtype || src.numel() != dst.numel()) {
      return shape_error("copy", src.describe() + " -> " + dst.describe());
    }
    std::memmove(dst.data, src.data, static_cast<size_t>(src.bytes()));
    return {};
  }

  using Backend::fill_random;
  Status fill_random(Tensor& t, uint64_t seed, float scale, const RandomWindow& w) override {
    float* p = t.as<float>();
    const int64_t n = t.numel();
    const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t counter = w.cols == 0 ? i : (w.row0 + i / cols) * w.cols + w.col0 + i % cols;
      p[i] = uniform_at(seed, counter, scale);
    }
    return {};
  }

  Status fill(Tensor& t, float value) override {
    if (t.dtype == DType::kFP8E4M3) {
      std::memset(t.data, kernels::fp8_e4m3_from_float(value), static_cast<size_t>(t.bytes()));
      return {};
    }
    if (t.dtype != DType::kF32) return shape_error("fill", t.describe() + ": cpu tensors are f32");
    std::fill(t.as<float>(), t.as<float>() + t.numel(), value);
    return {};
  }

  Status quantize_kv(const Tensor& src, int kv_heads, const int32_t* dst_rows,
                     Tensor& dst) override {
    int head_dim = 0;
    if (src.dtype != DType::kF32 || !kv_rows_match(src, kv_heads, dst, head_dim) ||
        (!dst_rows && dst.dim(0) < src.dim(0))) {
      return shape_error("quantize_kv", src.describe() + " -> " + dst.describe());
    }
    kernels::quantize_kv_cpu(src.as<float>(), src.dim(0), kv_heads, head_dim, dst_rows,
                             dst.data);
    return {};
  }

  Status dequantize_kv(const Tensor& src, int kv_heads, Tensor& dst) override {
    int head_dim = 0;
    if (dst.dtype != DType::kF32 || !kv_rows_match(dst, kv_heads, src, head_dim) ||
        src.dim(0) < dst.dim(0)) {
      return shape_error("dequantize_kv", src.describe() + " -> " + dst.describe());
    }
    kernels::dequantize_kv_cpu(src.data, dst.dim(0), kv_heads, head_dim, dst.as<float>());
    return {};
  }

  using Backend::embedding;
  Status embedding(const Tensor& table, const std::vector<int32_t>& ids,
                   const std::vector<DrawnId>& drawn, Tensor& out) override {
    const int64_t vocab = table.dim(0), dim = table.dim(1);
    if (out.dim(0) != static_cast<int64_t>(ids.size()) || out.dim(1) != dim) {
      return shape_error("embedding", "out " + out.describe() + " for table " + table.describe());
    }
    const std::string bad =
        check_embedding_ids(vocab, ids, drawn, static_cast<int64_t>(drawn_.size()));
    if (!bad.empty()) return shape_error("embedding", bad);
    std::vector<int32_t> resolved(ids);
    for (const DrawnId& d : drawn) {
      resolved[static_cast<size_t>(d.row)] = drawn_[static_cast<size_t>(d.index)];
    }
    kernels::embedding_cpu(table.as<float>(), resolved.data(), out.as<float>(),
                           static_cast<int64_t>(ids.size()), dim);
    return {};
  }

  Status drawn_ids(int64_t n, void** where) override {
    if (n < 0) return shape_error("drawn_ids", "count " + std::to_string(n));
    drawn_.resize(static_cast<size_t>(n));
    *where = drawn_.data();
    return {};
  }

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
    const int64_t dim = w.numel();
    if (x.numel() != out.numel() || x.numel() % dim != 0) {
      return shape_error("rms_norm", x.describe() + " w " + w.describe() + " out " +
                                         out.describe());
    }
    kernels::rms_norm_cpu(x.as<float>(), w.as<float>(), out.as<float>(), x.numel() / dim, dim,
                          eps);
    return {};
  }

  Status gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) override {
    const int64_t m = x.dim(0), k = x.dim(1), n = w.dim(0);
    if (w.dim(1) != k || out.dim(0) != m || out.dim(1) != n) {
      return shape_error("gemm", "x " + x.describe() + " w " + w.describe() + " out " +
                                     out.describe());
    }
    kernels::gemm_cpu(x.as<float>(), w.as<float>(), out.as<float>(), m, n, k, accumulate);
    return {};
  }

  Status rope(Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
              const std::vector<float>& inv_freq) override {
    const int64_t rows = x.dim(0);
    if (static_cast<int64_t>(positions.size()) != rows || x.dim(1) != int64_t{heads} * head_dim ||
        static_cast<int>(inv_freq.size()) != head_dim / 2) {
      return shape_error("rope", "x " + x.describe() + " for " + std::to_string(heads) + "x" +
                                     std::to_string(head_dim) + ", " +
                                     std::to_string(positions.size()) + " positions");
    }
    kernels::rope_cpu(x.as<float>(), rows, heads, head_dim, x.dim(1), positions.data(),
                      inv_freq.data());
    return {};
  }

  Status silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) override {
    if (gate.numel() != up.numel() || gate.numel() != out.numel()) {
      return shape_error("silu_mul", gate.describe() + " " + up.describe() + " " +
                                         out.describe());
    }
    kernels::silu_mul_cpu(gate.as<float>(), up.as<float>(), out.as<float>(), gate.numel());
    return {};
  }

  Status gather_rows(const Tensor& pool, const int32_t* pages, int64_t page_size, int64_t rows,
                     Tensor& dst) override {
    if (pool.dtype != dst.dtype || pool.shape.size() != 2 || dst.shape.size() != 2 ||
        pool.dim(1) != dst.dim(1) || dst.dim(0) < rows || page_size <= 0) {
      return shape_error("gather_rows", pool.describe() + " -> " + dst.describe());
    }
    kernels::gather_rows_cpu(pool.data, pages, page_size, rows, pool.dim(1) * dtype_size(pool.dtype),
                             dst.data);
    return {};
  }

  Status scatter_rows(const Tensor& src, const int32_t* dst_rows, Tensor& pool) override {
    if (pool.dtype != src.dtype || pool.shape.size() != 2 || src.shape.size() != 2 ||
        pool.dim(1) != src.dim(1)) {
      return shape_error("scatter_rows", src.describe() + " -> " + pool.describe());
    }
    kernels::scatter_rows_cpu(src.data, dst_rows, src.dim(0), src.dim(1) * dtype_size(src.dtype),
                              pool.data);
    return {};
  }

  Status add(Tensor& x, const Tensor& y) override {
    if (x.numel() != y.numel()) return shape_error("add", x.describe() + " + " + y.describe());
    kernels::add_cpu(x.as<float>(), y.as<float>(), x.numel());
    return {};
  }

  Status attention(const kernels::AttnParams& p) override {
    if (p.dtype != DType::kF32) return shape_error("attention", "cpu attention is f32");
    const std::string err = kernels::validate(p);
    if (!err.empty()) return shape_error("attention", err);
    kernels::attention_cpu(p);
    return {};
  }

  bool attention_merges(const kernels::AttnParams&) const override { return merges_; }

  Status merge(const kernels::MergeParams& p) override {
    if (p.out && p.out_dtype != DType::kF32) return shape_error("merge", "cpu tensors are f32");
    kernels::merge_cpu(p);
    return {};
  }

  Status sample(const Tensor& logits, const std::vector<SamplingParams>& params,
                const std::vector<double>& uniforms, std::vector<int32_t>& ids) override {
    const std::string bad = check_sample_args(logits, params, uniforms);
    if (!bad.empty()) return shape_error("sample", bad);
    if (logits.dtype != DType::kF32) return shape_error("sample", "cpu tensors are f32");
    const int64_t rows = logits.dim(0), vocab = logits.dim(1);
    ids.resize(static_cast<size_t>(rows));
    const float* l = logits.as<float>();
    // Rows are independent (each has its own uniform): in parallel, as a draw without top-k
    // costs ~1 ms of CPU for a 32000-id vocabulary.
#pragma omp parallel for schedule(dynamic) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
      const auto i = static_cast<size_t>(r);
      ids[i] = sample_with_uniform(l + r * vocab, vocab, params[i], uniforms[i]);
    }
    drawn_ = ids;
    return {};
  }

  Status synchronize() override { return {}; }

 private:
  std::vector<int32_t> drawn_;  // the last sample()'s ids (drawn_ids)
  bool merges_;                 // what attention_merges reports (make_cpu_backend)
};

}  // namespace

bool kv_rows_match(const Tensor& values, int kv_heads, const Tensor& rows, int& head_dim) {
  if (kv_heads <= 0 || values.shape.size() != 2 || rows.shape.size() != 2 ||
      rows.dtype != DType::kFP8E4M3 || values.dim(1) % kv_heads != 0) {
    return false;
  }
  head_dim = static_cast<int>(values.dim(1) / kv_heads);
  return rows.dim(1) == kernels::kv_fp8_row_bytes(kv_heads, head_dim);
}

std::string check_embedding_ids(int64_t vocab, const std::vector<int32_t>& ids,
                                const std::vector<Backend::DrawnId>& drawn, int64_t drawn_count) {
  std::vector<bool> is_drawn(ids.size(), false);
  for (const Backend::DrawnId& d : drawn) {
    if (d.row < 0 || d.row >= static_cast<int64_t>(ids.size())) {
      return "drawn row " + std::to_string(d.row) + " outside the " +
             std::to_string(ids.size()) + " rows";
    }
    if (d.index < 0 || d.index >= drawn_count) {
      return "drawn id " + std::to_string(d.index) + " of row " + std::to_string(d.row) +
             " beyond the count (drawn ids: " + std::to_string(drawn_count) + ")";
    }
    is_drawn[static_cast<size_t>(d.row)] = true;
  }
  for (size_t r = 0; r < ids.size(); ++r) {
    if (!is_drawn[r] && (ids[r] < 0 || ids[r] >= vocab)) {
      return "token id " + std::to_string(ids[r]) + " outside vocab " + std::to_string(vocab);
    }
  }
  return {};
}

std::string check_sample_args(const Tensor& logits, const std::vector<SamplingParams>& params,
                              const std::vector<double>& uniforms) {
  if (logits.shape.size() != 2 || logits.dim(1) < 1) {
    return "logits " + logits.describe() + " are not [rows, vocab]";
  }
  const auto rows = static_cast<size_t>(logits.dim(0));
  if (params.size() != rows || uniforms.size() != rows) {
    return std::to_string(params.size()) + " params and " + std::to_string(uniforms.size()) +
           " uniforms for " + std::to_string(rows) + " rows of logits";
  }
  for (size_t r = 0; r < rows; ++r) {
    const std::string why = validate(params[r]);
    if (!why.empty()) return "row " + std::to_string(r) + ": " + why;
  }
  return {};
}

std::unique_ptr<Backend> make_cpu_backend(bool attention_merges, const Tuning& tuning) {
  return std::make_unique<CpuBackend>(attention_merges, tuning);
}

}  // namespace burst::engine
