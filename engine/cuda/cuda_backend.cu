// CudaBackend: the Backend ops on one GPU in bf16 (activations, weights, KV cache) with fp32
// accumulation: GEMMs through cuBLAS (bf16 in and out, fp32 compute), RMSNorm / RoPE / SwiGLU /
// embedding / conversion / add / random fill through kernels/ops_cuda.h (this file holds no
// device code), attention through kernels/attention_cuda.h (the prefill kernel, or split-KV
// decode for one query row), merge through merge_cuda, token sampling through
// kernels/sampling_cuda.h (only the ids come back to the host).
//
// Contract beyond backend.h:
// - Tensors are device memory (never managed memory) from a stream-ordered pool of the
//   backend's own (cudaMallocFromPoolAsync / cudaFreeAsync on the compute stream), zeroed at
//   allocation, freed when the last view drops them. A tensor freed mid-forward is reused by
//   the next allocation without a device synchronisation (cudaFree waits for the whole device:
//   with it, a decode step of the 7B preset stalled the GPU hundreds of times). Out of memory
//   is an error naming the tensor, what it needs and what is free (the pool's cached bytes
//   count as free); engine/cuda/cuda_backend.h offers the same check up front.
// - Every op is queued on one compute stream in call order; only download(), sample() and
//   synchronize() wait. Host inputs of ops (token ids, positions, RoPE frequencies, sampling
//   uniforms) are copied to device scratch on that stream, so the caller may reuse its vectors
//   once an op returns.
// - Every CUDA and cuBLAS return code is checked; failures come back as Status naming the
//   device, the op, the failing call, the error, file and line. Nothing throws or exits.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/dtype_convert.h"
#include "kernels/attention_cuda.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops_cuda.h"
#include "kernels/sampling_cuda.h"

namespace burst::engine {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// cuBLAS's own workspace: 32 MiB is what cuBLAS itself picks on Hopper; giving it ours keeps
// its memory inside the plan and allocated once.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Uploads that convert (e.g. an fp32 checkpoint into bf16) go through a staging buffer of this
// size in chunks, so loading never needs a second copy of a whole tensor on the device.
constexpr size_t kStagingBytes = size_t{64} << 20;

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / kGiB);
  return buf;
}

// "engine/cuda/cuda_backend.cu" rather than the build machine's absolute path.
const char* short_file(const char* file) {
  const char* p = std::strstr(file, "engine/cuda/");
  return p ? p : file;
}

// "cudaMemcpyAsync" out of "cudaMemcpyAsync(dst, src, ...)".
std::string call_name(const char* call) {
  const std::string s(call);
  return s.substr(0, s.find('('));
}

Status device_error(int device, const char* op, const char* call, const std::string& what,
                    const char* file, int line) {
  return Status::error("cuda:" + std::to_string(device) + " " + op + ": " + call_name(call) +
                       " failed: " + what + " (" + short_file(file) + ":" +
                       std::to_string(line) + ")");
}

Status cuda_failure(int device, const char* op, const char* call, cudaError_t err,
                    const char* file, int line) {
  return device_error(device, op, call,
                      std::string(cudaGetErrorString(err)) + " [" + cudaGetErrorName(err) + "]",
                      file, line);
}

Status cublas_failure(int device, const char* op, const char* call, cublasStatus_t st,
                      const char* file, int line) {
  return device_error(device, op, call, cublasGetStatusString(st), file, line);
}

}  // namespace
}  // namespace burst::engine

// Return the Status of a failed CUDA / cuBLAS call from the enclosing function; dev names the
// GPU, op the backend op, and the call's text (up to its '(') the function that failed.
#define BURST_CUDA_TRY(dev, op, call)                                                        \
  do {                                                                                       \
    const cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      return ::burst::engine::cuda_failure(dev, op, #call, err_, __FILE__, __LINE__);        \
    }                                                                                        \
  } while (0)
#define BURST_CUBLAS_TRY(dev, op, call)                                                      \
  do {                                                                                       \
    const cublasStatus_t st_ = (call);                                                       \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      return ::burst::engine::cublas_failure(dev, op, #call, st_, __FILE__, __LINE__);       \
    }                                                                                        \
  } while (0)

namespace burst::engine {
namespace {

cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kFP8E4M3: return CUDA_R_8F_E4M3;
  }
  return CUDA_R_32F;
}

// A device buffer the backend owns and grows (scratch for host inputs, staging, workspaces).
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// What the tensors of a backend allocate from, shared with their deleters (tensors may outlive
// the backend): the compute stream that orders every allocation and free, and the pool. Both
// go when the backend and its last tensor have gone.
struct TensorMemory {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  std::atomic<int64_t> held{0};  // bytes of live tensors
  ~TensorMemory() {
    int current = 0;
    const bool restore = cudaGetDevice(&current) == cudaSuccess && current != device;
    cudaSetDevice(device);
    if (stream) cudaStreamSynchronize(stream);
    if (pool) cudaMemPoolDestroy(pool);
    if (stream) cudaStreamDestroy(stream);
    if (restore) cudaSetDevice(current);
  }
};

std::string describe(const kernels::AttnParams& p) {
  return "n_q=" + std::to_string(p.n_q) + " n_kv=" + std::to_string(p.n_kv) + " heads=" +
         std::to_string(p.heads) + "/" + std::to_string(p.kv_heads) + " head_dim=" +
         std::to_string(p.head_dim) + " dtype=" + dtype_name(p.dtype) + " o_dtype=" +
         dtype_name(kernels::output_dtype(p));
}

class CudaBackend final : public Backend {
 public:
  static Result<std::unique_ptr<Backend>> create(int device, const Tuning& tuning);

  ~CudaBackend() override {
    // Nothing here can report an error; tensors still alive keep their memory (their deleters
    // free it), so only the backend's own objects go.
    cudaSetDevice(device_);
    if (compute_) cudaStreamSynchronize(compute_);
    for (Scratch* s : {&staging_, &ids_, &positions_, &inv_freq_, &decode_ws_, &sample_in_,
                       &sample_ws_, &drawn_}) {
      if (s->ptr) cudaFree(s->ptr);
    }
    for (DrawSlot& d : draws_) {
      if (d.pinned.ptr) cudaFreeHost(d.pinned.ptr);
      if (d.done) cudaEventDestroy(d.done);
    }
    if (cublas_workspace_) cudaFree(cublas_workspace_);
    if (cublas_) cublasDestroy(cublas_);
    // compute_ and the pool belong to mem_, which the last tensor releases.
  }

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  DeviceKind device() const override { return DeviceKind::kCuda; }
  DType compute_dtype() const override { return DType::kBF16; }

  CudaStreams streams() const { return {device_, compute_}; }

  Result<CudaMemoryInfo> memory_info() const {
    BURST_RETURN_IF_ERROR(use_device("memory info"));
    size_t free = 0, total = 0;
    BURST_CUDA_TRY(device_, "memory info", cudaMemGetInfo(&free, &total));
    // Bytes the pool keeps for reuse are free for our allocations (they are trimmed on demand).
    uint64_t reserved = 0, used = 0;
    BURST_CUDA_TRY(device_, "memory info",
                   cudaMemPoolGetAttribute(mem_->pool, cudaMemPoolAttrReservedMemCurrent,
                                           &reserved));
    BURST_CUDA_TRY(device_, "memory info",
                   cudaMemPoolGetAttribute(mem_->pool, cudaMemPoolAttrUsedMemCurrent, &used));
    const int64_t cached = reserved > used ? static_cast<int64_t>(reserved - used) : 0;
    return CudaMemoryInfo{static_cast<int64_t>(free) + cached, static_cast<int64_t>(total),
                          mem_->held.load()};
  }

  Status check_fits(int64_t bytes, const std::string& what, int64_t reserve) const {
    auto info = memory_info();
    if (!info.ok()) return info.status();
    const CudaMemoryInfo& m = info.value();
    if (bytes + reserve <= m.free) return {};
    return Status::error(what + " needs " + gib(double(bytes)) + " GiB" +
                         (reserve > 0 ? " (+" + gib(double(reserve)) + " GiB kept free)" : "") +
                         ", " + gib(double(m.free)) + " GiB free on " + name() + " (" +
                         gpu_name_ + ", " + gib(double(m.total)) +
                         " GiB total; this backend holds " + gib(double(m.held)) + " GiB)");
  }

  Result<Tensor> alloc(std::vector<int64_t> shape, DType dtype) override {
    Tensor t;
    t.dtype = dtype;
    t.device = DeviceKind::kCuda;
    t.shape = std::move(shape);
    for (int64_t d : t.shape) {
      if (d < 0) return op_error("alloc", "negative dimension in " + t.describe());
    }
    BURST_RETURN_IF_ERROR(use_device("alloc"));
    // At least 256 bytes: an empty tensor still gets a distinct, aligned, non-null pointer.
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(t.bytes(), 256));
    void* p = nullptr;
    cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, mem_->pool, compute_);
    if (err == cudaErrorMemoryAllocation) {
      // The pool may cache blocks that it cannot hand out for this size: give them back to
      // the device once queued work is done with them, and try again.
      cudaGetLastError();  // an allocation failure is not sticky; clear it for later calls
      BURST_CUDA_TRY(device_, "alloc", cudaStreamSynchronize(compute_));
      BURST_CUDA_TRY(device_, "alloc", cudaMemPoolTrimTo(mem_->pool, 0));
      err = cudaMallocFromPoolAsync(&p, bytes, mem_->pool, compute_);
    }
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      const std::string what = name() + " alloc " + t.describe();
      const Status fits = check_fits(static_cast<int64_t>(bytes), what, 0);
      if (!fits.ok()) return Status::error("out of GPU memory: " + fits.message());
      return Status::error(what + ": allocation of " + gib(double(bytes)) +
                           " GiB failed although that much is free (fragmentation)");
    }
    if (err != cudaSuccess) {
      return cuda_failure(device_, "alloc", "cudaMallocFromPoolAsync", err, __FILE__, __LINE__);
    }
    // Zeroed so that a bug reads zeros rather than an earlier request's data (as on CPU).
    const cudaError_t zero = cudaMemsetAsync(p, 0, bytes, compute_);
    if (zero != cudaSuccess) {
      cudaFreeAsync(p, compute_);
      return cuda_failure(device_, "alloc", "cudaMemsetAsync", zero, __FILE__, __LINE__);
    }
    mem_->held.fetch_add(static_cast<int64_t>(bytes));
    // Freed in stream order: work queued on the compute stream before the free (and transfers
    // it waits for, see NcclHandle) completes before the memory is handed out again.
    t.storage = std::shared_ptr<void>(p, [mem = mem_, bytes](void* q) {
      cudaFreeAsync(q, mem->stream);
      mem->held.fetch_sub(static_cast<int64_t>(bytes));
    });
    t.data = p;
    return t;
  }

  Status upload(const void* host, DType host_dtype, Tensor& dst) override {
    BURST_RETURN_IF_ERROR(on_device("upload", dst));
    BURST_RETURN_IF_ERROR(use_device("upload"));
    const int64_t n = dst.numel();
    if (n == 0) return {};
    if (host_dtype == dst.dtype) {
      BURST_CUDA_TRY(device_, "upload",
                     cudaMemcpyAsync(dst.data, host, static_cast<size_t>(dst.bytes()),
                                     cudaMemcpyHostToDevice, compute_));
      return {};
    }
    // Raw copy into staging, then convert on the device, chunk by chunk. The chunks reuse one
    // buffer: stream order makes each copy wait for the previous chunk's conversion.
    BURST_RETURN_IF_ERROR(ensure(staging_, kStagingBytes, "upload"));
    const int64_t hsize = dtype_size(host_dtype), dsize = dtype_size(dst.dtype);
    const int64_t chunk = static_cast<int64_t>(kStagingBytes) / hsize;
    for (int64_t off = 0; off < n; off += chunk) {
      const int64_t cnt = std::min(chunk, n - off);
      BURST_CUDA_TRY(device_, "upload",
                     cudaMemcpyAsync(staging_.ptr, static_cast<const char*>(host) + off * hsize,
                                     static_cast<size_t>(cnt * hsize), cudaMemcpyHostToDevice,
                                     compute_));
      BURST_RETURN_IF_ERROR(launched(
          "upload",
          kernels::convert_cuda(staging_.ptr, host_dtype,
                                static_cast<char*>(dst.data) + off * dsize, dst.dtype, cnt,
                                compute_),
          dst.describe()));
    }
    return {};
  }

  Status download(const Tensor& src, std::vector<float>& host) override {
    BURST_RETURN_IF_ERROR(on_device("download", src));
    BURST_RETURN_IF_ERROR(use_device("download"));
    const int64_t n = src.numel();
    host.resize(static_cast<size_t>(n));
    if (n == 0) return {};
    if (src.dtype == DType::kF32) {
      BURST_CUDA_TRY(device_, "download",
                     cudaMemcpyAsync(host.data(), src.data, static_cast<size_t>(src.bytes()),
                                     cudaMemcpyDeviceToHost, compute_));
      BURST_CUDA_TRY(device_, "download", cudaStreamSynchronize(compute_));
      return {};
    }
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    BURST_CUDA_TRY(device_, "download",
                   cudaMemcpyAsync(raw.data(), src.data, static_cast<size_t>(src.bytes()),
                                   cudaMemcpyDeviceToHost, compute_));
    BURST_CUDA_TRY(device_, "download", cudaStreamSynchronize(compute_));
    const bool bf16 = src.dtype == DType::kBF16;
    for (int64_t i = 0; i < n; ++i) {
      host[i] = bf16 ? bf16_to_f32(raw[i]) : f16_to_f32(raw[i]);
    }
    return {};
  }

  Status copy(const Tensor& src, Tensor& dst) override {
    BURST_RETURN_IF_ERROR(on_device("copy", src, dst));
    if (src.dtype != dst.dtype || src.numel() != dst.numel()) {
      return op_error("copy", src.describe() + " -> " + dst.describe());
    }
    BURST_RETURN_IF_ERROR(use_device("copy"));
    if (src.numel() == 0) return {};
    BURST_CUDA_TRY(device_, "copy",
                   cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(src.bytes()),
                                   cudaMemcpyDeviceToDevice, compute_));
    return {};
  }

  Status convert(const Tensor& src, Tensor& dst) override {
    BURST_RETURN_IF_ERROR(on_device("convert", src, dst));
    if (src.numel() != dst.numel()) {
      return op_error("convert", src.describe() + " -> " + dst.describe());
    }
    if (src.dtype == dst.dtype) return copy(src, dst);
    BURST_RETURN_IF_ERROR(use_device("convert"));
    if (src.numel() == 0) return {};
    return launched("convert",
                    kernels::convert_cuda(src.data, src.dtype, dst.data, dst.dtype,
                                          src.numel(), compute_),
                    src.describe() + " -> " + dst.describe());
  }

  using Backend::fill_random;
  Status fill_random(Tensor& t, uint64_t seed, float scale, const RandomWindow& w) override {
    BURST_RETURN_IF_ERROR(on_device("fill_random", t));
    BURST_RETURN_IF_ERROR(use_device("fill_random"));
    const int64_t n = t.numel();
    if (n == 0) return {};
    const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
    const kernels::FillWindow fw{cols, w.cols == 0 ? cols : w.cols, w.row0, w.col0};
    return launched("fill_random",
                    kernels::fill_uniform_cuda(t.data, n, t.dtype, seed, scale, fw, compute_),
                    t.describe());
  }

  Status fill(Tensor& t, float value) override {
    BURST_RETURN_IF_ERROR(on_device("fill", t));
    BURST_RETURN_IF_ERROR(use_device("fill"));
    if (t.numel() == 0) return {};
    if (t.dtype == DType::kFP8E4M3) {
      BURST_CUDA_TRY(device_, "fill",
                     cudaMemsetAsync(t.data, kernels::fp8_e4m3_from_float(value),
                                     static_cast<size_t>(t.bytes()), compute_));
      return {};
    }
    return launched("fill", kernels::fill_cuda(t.data, t.numel(), t.dtype, value, compute_),
                    t.describe());
  }

  Status quantize_kv(const Tensor& src, int kv_heads, const int32_t* dst_rows,
                     Tensor& dst) override {
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

  Status dequantize_kv(const Tensor& src, int kv_heads, Tensor& dst) override {
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

  using Backend::embedding;
  Status embedding(const Tensor& table, const std::vector<int32_t>& ids,
                   const std::vector<DrawnId>& drawn, Tensor& out) override {
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

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override {
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

  // gemm's arguments: on this device, 2-D, out [m, n] = x [m, k] w [n, k]^T, one dtype.
  Status check_gemm(const char* op, const Tensor& x, const Tensor& w, const Tensor& out) const {
    BURST_RETURN_IF_ERROR(on_device(op, x, w, out));
    if (x.shape.size() != 2 || w.shape.size() != 2 || out.shape.size() != 2 ||
        w.dim(1) != x.dim(1) || out.dim(0) != x.dim(0) || out.dim(1) != w.dim(0) ||
        x.dtype != w.dtype || x.dtype != out.dtype) {
      return op_error(op, "x " + x.describe() + " w " + w.describe() + " out " + out.describe());
    }
    return {};
  }

  // The norm, then a decode step's q, k and v in one weight-streaming launch.
  Status norm_project(const Tensor& x, const Norm& norm,
                      std::initializer_list<Projection> projections) override {
    return project_fused(x, norm, projections, nullptr);
  }

  // The same launch, q and k rotated at its store.
  Status norm_project_rope(const Tensor& x, const Norm& norm,
                           std::initializer_list<Projection> projections,
                           const RopeQk& rope) override {
    if (projections.size() < 2) return rope_projections(projections, rope);  // its error
    BURST_RETURN_IF_ERROR(check_rope(projections.begin()[0].out, rope.heads, rope.head_dim,
                                     rope.positions, rope.inv_freq));
    BURST_RETURN_IF_ERROR(check_rope(projections.begin()[1].out, rope.kv_heads, rope.head_dim,
                                     rope.positions, rope.inv_freq));
    return project_fused(x, norm, projections, &rope);
  }

  Status project_fused(const Tensor& x, const Norm& norm,
                       std::initializer_list<Projection> projections, const RopeQk* rope) {
    BURST_RETURN_IF_ERROR(rms_norm(x, norm.w, norm.eps, norm.h));
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

  // The norm, then a decode step's gate and up with SwiGLU at the store in one launch.
  Status norm_swiglu(const Tensor& x, const Norm& norm, const Tensor& w_gate, const Tensor& w_up,
                     Tensor& gate, Tensor& up) override {
    BURST_RETURN_IF_ERROR(rms_norm(x, norm.w, norm.eps, norm.h));
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

  Status gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) override {
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

  // rope's arguments for one tensor.
  Status check_rope(const Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
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

  Status rope(Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
              const std::vector<float>& inv_freq) override {
    return rope_pair(x, heads, nullptr, 0, head_dim, positions, inv_freq);
  }

  Status rope_qk(Tensor& q, int heads, Tensor& k, int kv_heads, int head_dim,
                 const std::vector<int64_t>& positions,
                 const std::vector<float>& inv_freq) override {
    BURST_RETURN_IF_ERROR(check_rope(k, kv_heads, head_dim, positions, inv_freq));
    return rope_pair(q, heads, &k, kv_heads, head_dim, positions, inv_freq);
  }

  // RoPE's positions and frequencies into positions_ and inv_freq_: q and k of every layer
  // rotate by the same ones, so they are uploaded once a forward (upload_cached).
  Status upload_rope(const std::vector<int64_t>& positions, const std::vector<float>& inv_freq) {
    BURST_RETURN_IF_ERROR(upload_cached(positions_, positions_host_, positions, "rope"));
    return upload_cached(inv_freq_, inv_freq_host_, inv_freq, "rope");
  }

  // x (and k, when given) rotated in one launch.
  Status rope_pair(Tensor& x, int heads, Tensor* k, int kv_heads, int head_dim,
                   const std::vector<int64_t>& positions, const std::vector<float>& inv_freq) {
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

  Status gather_rows(const Tensor& pool, const int32_t* pages, int64_t page_size, int64_t rows,
                     Tensor& dst) override {
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

  Status scatter_rows(const Tensor& src, const int32_t* dst_rows, Tensor& pool) override {
    return scatter_pair(src, nullptr, dst_rows, pool, nullptr);
  }

  Status scatter_rows_pair(const Tensor& k, const Tensor& v, const int32_t* dst_rows,
                           Tensor& k_pool, Tensor& v_pool) override {
    if (k.shape != v.shape || k.dtype != v.dtype || k_pool.shape != v_pool.shape ||
        k_pool.dtype != v_pool.dtype) {
      return op_error("scatter_rows", k.describe() + ", " + v.describe() + " -> " +
                                          k_pool.describe() + ", " + v_pool.describe());
    }
    return scatter_pair(k, &v, dst_rows, k_pool, &v_pool);
  }

  // src into pool (and src1 into pool1, when given: same shapes) in one launch.
  Status scatter_pair(const Tensor& src, const Tensor* src1, const int32_t* dst_rows,
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

  Status silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) override {
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

  Status add(Tensor& x, const Tensor& y) override {
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

  Status attention(const kernels::AttnParams& p) override {
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
    if ((p.kv_pages || p.kv_fp8) && p.n_q != 1 && !p.row_kv_len) {
      return op_error("attention", "paged K/V and FP8 KV rows are read by the decode kernel only "
                                   "(n_q 1, or per-row K/V), got " + describe(p));
    }
    if (p.merge_into_o && !attention_merges(p)) {
      return op_error("attention", "merging into o needs a prefill launch with an fp32 o, got " +
                                       describe(p));
    }
    if (p.n_q == 1 || p.row_kv_len) {
      // Decode: one query row against a long KV; split-KV keeps every multiprocessor busy.
      const size_t ws = kernels::attention_decode_workspace_bytes(p);
      if (ws == 0) return op_error("attention", "no decode plan for " + describe(p));
      BURST_RETURN_IF_ERROR(ensure(decode_ws_, ws, "attention"));
      return launched("attention",
                      kernels::attention_decode_cuda(p, decode_ws_.ptr, decode_ws_.bytes,
                                                     compute_),
                      describe(p));
    }
    return launched("attention", kernels::attention_cuda(p, compute_, prefill_kernel_),
                    describe(p));
  }

  // The prefill kernels (not the decode kernel: one row, or per-row K/V), fp32 o.
  bool attention_merges(const kernels::AttnParams& p) const override {
    return p.n_q != 1 && !p.row_kv_len && !p.kv_pages && kernels::attention_merges_into_o(p);
  }

  Status merge(const kernels::MergeParams& p) override {
    if (p.rows < 0 || p.heads < 0 || p.head_dim < 0) return op_error("merge", "negative shape");
    BURST_RETURN_IF_ERROR(use_device("merge"));
    return launched("merge", kernels::merge_cuda(p, compute_),
                    "rows=" + std::to_string(p.rows) + " heads=" + std::to_string(p.heads) +
                        " head_dim=" + std::to_string(p.head_dim));
  }

  // The draw queued, then its own ids waited for (other draws may stay queued around it).
  Status sample(const Tensor& logits, const std::vector<SamplingParams>& params,
                const std::vector<double>& uniforms, std::vector<int32_t>& ids) override {
    BURST_RETURN_IF_ERROR(sample_queued(logits, params, uniforms));
    const int slot = queued_.back();
    queued_.pop_back();
    return take_draw(slot, ids);
  }

  Status sampled(std::vector<int32_t>& ids) override {
    if (queued_.empty()) return op_error("sampled", "no draw is queued");
    const int slot = queued_.front();
    queued_.pop_front();
    return take_draw(slot, ids);
  }

  bool sampled_ready() const override {
    return queued_.empty() || cudaEventQuery(draws_[queued_.front()].done) != cudaErrorNotReady;
  }

  Status sample_queued(const Tensor& logits, const std::vector<SamplingParams>& params,
                       const std::vector<double>& uniforms) override {
    BURST_RETURN_IF_ERROR(on_device("sample", logits));
    const std::string bad = check_sample_args(logits, params, uniforms);
    if (!bad.empty()) return op_error("sample", bad);
    if (logits.dtype != DType::kF32 && logits.dtype != DType::kBF16) {
      return op_error("sample", "logits " + logits.describe() + " are not fp32 or bf16");
    }
    if (queued_.size() >= kMaxQueuedDraws) return too_many_draws();
    // A slot no queued draw holds: its pinned buffer and event are free to reuse.
    int slot = 0;
    while (std::find(queued_.begin(), queued_.end(), slot) != queued_.end()) ++slot;
    DrawSlot& d = draws_[slot];
    const int64_t rows = logits.dim(0), vocab = logits.dim(1);
    d.rows = rows;
    BURST_RETURN_IF_ERROR(use_device("sample"));
    if (d.done == nullptr) {
      BURST_CUDA_TRY(device_, "sample", cudaEventCreateWithFlags(&d.done, cudaEventDisableTiming));
    }
    if (rows == 0) {
      BURST_CUDA_TRY(device_, "sample", cudaEventRecord(d.done, compute_));
      queued_.push_back(slot);
      return {};
    }
    kernels::SampleParams p;
    p.logits = logits.data;
    p.dtype = logits.dtype;
    p.rows = rows;
    p.vocab = vocab;
    p.row_stride = vocab;
    // One setting for every row (the common batch): the scalars, and for all-greedy rows the
    // argmax kernel alone. Otherwise per-row settings, one call for the whole batch. A greedy
    // row's top_k, top_p and min_p do not matter.
    std::vector<kernels::SampleRowParams> settings(params.size());
    for (size_t r = 0; r < params.size(); ++r) {
      const SamplingParams& q = params[r];
      if (q.temperature > 0.f) settings[r] = {q.temperature, q.top_k, q.top_p, q.min_p};
    }
    const kernels::SampleRowParams& first = settings.front();
    const bool same = std::all_of(settings.begin(), settings.end(), [&](const auto& q) {
      return q.temperature == first.temperature && q.top_k == first.top_k &&
             q.top_p == first.top_p && q.min_p == first.min_p;
    });
    const bool greedy = same && first.temperature == 0.f;
    // The inputs travel in one copy: [uniforms (rows fp64) | row settings | out ids (rows)].
    const size_t u_bytes = static_cast<size_t>(rows) * sizeof(double);
    const size_t rp_bytes = same ? 0 : settings.size() * sizeof(kernels::SampleRowParams);
    const size_t in_bytes = u_bytes + rp_bytes;
    const size_t all_bytes = in_bytes + settings.size() * 4;
    BURST_RETURN_IF_ERROR(ensure(sample_in_, all_bytes, "sample"));
    BURST_RETURN_IF_ERROR(ensure_pinned(d.pinned, all_bytes, "sample"));
    auto* dev = static_cast<unsigned char*>(sample_in_.ptr);
    auto* host = static_cast<unsigned char*>(d.pinned.ptr);
    d.ids_offset = in_bytes;
    p.out_ids = reinterpret_cast<int32_t*>(dev + in_bytes);
    if (same) {
      p.temperature = first.temperature;
      p.top_k = first.top_k;
      p.top_p = first.top_p;
      p.min_p = first.min_p;
    } else {
      p.row_params = reinterpret_cast<const kernels::SampleRowParams*>(dev + u_bytes);
    }
    if (!greedy) {
      // Pinned, so both copies are truly asynchronous; the slot's buffer is rewritten only
      // once its ids were taken (take_draw waited for this draw's event).
      std::memcpy(host, uniforms.data(), u_bytes);
      if (!same) std::memcpy(host + u_bytes, settings.data(), rp_bytes);
      p.uniforms = reinterpret_cast<const double*>(dev);
      BURST_CUDA_TRY(device_, "sample",
                     cudaMemcpyAsync(dev, host, in_bytes, cudaMemcpyHostToDevice, compute_));
      const size_t ws = kernels::sample_cuda_workspace_bytes(vocab, rows);
      if (ws == 0) {
        return op_error("sample", "no workspace size for " + logits.describe() +
                                      " (rows * vocab beyond INT32_MAX?)");
      }
      // Kept and grown between calls: no allocation on the decode path once it has its size.
      BURST_RETURN_IF_ERROR(ensure(sample_ws_, ws, "sample"));
      p.workspace = sample_ws_.ptr;
      p.workspace_bytes = sample_ws_.bytes;
    }
    BURST_RETURN_IF_ERROR(launched("sample", kernels::sample_cuda(p, compute_),
                                   logits.describe()));
    // Kept for the next embedding (drawn_ids): where the ids already are, in the stream.
    BURST_RETURN_IF_ERROR(ensure(drawn_, settings.size() * 4, "sample"));
    BURST_CUDA_TRY(device_, "sample",
                   cudaMemcpyAsync(drawn_.ptr, p.out_ids, settings.size() * 4,
                                   cudaMemcpyDeviceToDevice, compute_));
    drawn_count_ = rows;
    BURST_CUDA_TRY(device_, "sample",
                   cudaMemcpyAsync(host + in_bytes, p.out_ids, settings.size() * 4,
                                   cudaMemcpyDeviceToHost, compute_));
    BURST_CUDA_TRY(device_, "sample", cudaEventRecord(d.done, compute_));
    queued_.push_back(slot);
    return {};
  }

  // Waits for the draw in `slot` (taken off queued_ by the caller) and copies its ids out.
  Status take_draw(int slot, std::vector<int32_t>& ids) {
    const DrawSlot& d = draws_[slot];
    ids.resize(static_cast<size_t>(d.rows));
    if (d.rows == 0) return {};
    BURST_RETURN_IF_ERROR(use_device("sampled"));
    BURST_CUDA_TRY(device_, "sampled", cudaEventSynchronize(d.done));
    std::memcpy(ids.data(), static_cast<const unsigned char*>(d.pinned.ptr) + d.ids_offset,
                ids.size() * 4);
    return {};
  }

  Status drawn_ids(int64_t n, void** where) override {
    if (n < 0) return op_error("drawn_ids", "count " + std::to_string(n));
    BURST_RETURN_IF_ERROR(use_device("drawn_ids"));
    // Growing loses the contents: only when n is beyond what sample() drew (the room is for
    // another rank's ids then).
    BURST_RETURN_IF_ERROR(ensure(drawn_, static_cast<size_t>(std::max<int64_t>(n, 1)) * 4,
                                 "drawn_ids"));
    drawn_count_ = n;
    *where = drawn_.ptr;
    return {};
  }

  Status check_fits(int64_t bytes, const std::string& what) override {
    // 1 GiB stays free for cuBLAS workspaces and the per-forward scratch.
    return cuda_check_fits(*this, bytes, what, int64_t{1} << 30);
  }

  Status synchronize() override {
    BURST_RETURN_IF_ERROR(use_device("synchronize"));
    BURST_CUDA_TRY(device_, "synchronize", cudaStreamSynchronize(compute_));
    return {};
  }

 private:
  CudaBackend(int device, const Tuning& tuning) : Backend(tuning), device_(device) {
    if (tuning.prefill_kernel == PrefillKernel::kSm80) {
      prefill_kernel_ = kernels::AttnKernel::kSm80;
    }
  }

  Status op_error(const char* op, const std::string& what) const {
    return Status::error(name() + " " + op + ": " + what);
  }

  // The calling thread may have another device current (a server thread, a second backend).
  Status use_device(const char* op) const {
    BURST_CUDA_TRY(device_, op, cudaSetDevice(device_));
    return {};
  }

  template <typename... Ts>
  Status on_device(const char* op, const Ts&... ts) const {
    for (const Tensor* t : {&ts...}) {
      if (t->device != DeviceKind::kCuda || (t->data == nullptr && t->numel() > 0)) {
        return op_error(op, "tensor " + t->describe() + " is not CUDA memory");
      }
    }
    return {};
  }

  // A kernel launcher's result: cudaErrorInvalidValue means it rejected the arguments.
  Status launched(const char* op, cudaError_t err, const std::string& what) const {
    if (err == cudaSuccess) return {};
    if (err == cudaErrorInvalidValue) {
      return op_error(op, "the kernel rejected its arguments (" + what +
                              "; see kernels/include/kernels/*_cuda.h for what it supports)");
    }
    return cuda_failure(device_, op, "kernel launch", err, __FILE__, __LINE__);
  }

  Status ensure(Scratch& s, size_t bytes, const char* op) {
    if (s.bytes >= bytes) return {};
    // Work already queued may still read the old buffer: let it finish before freeing.
    BURST_CUDA_TRY(device_, op, cudaStreamSynchronize(compute_));
    if (s.ptr) BURST_CUDA_TRY(device_, op, cudaFree(s.ptr));
    s.ptr = nullptr;
    s.bytes = 0;
    // Grow geometrically so a prefill that lengthens step by step reallocates rarely.
    const size_t want = std::max<size_t>(bytes + bytes / 2, 4096);
    const cudaError_t err = cudaMalloc(&s.ptr, want);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      s.ptr = nullptr;
      return Status::error("out of GPU memory: " +
                           check_fits(static_cast<int64_t>(want),
                                      name() + " " + op + " scratch", 0)
                               .message());
    }
    if (err != cudaSuccess) return cuda_failure(device_, op, "cudaMalloc", err, __FILE__, __LINE__);
    s.bytes = want;
    return {};
  }

  // Grows a pinned host buffer of sample() (cudaMallocHost: rarely, not per token).
  Status ensure_pinned(Scratch& pinned, size_t bytes, const char* op) {
    if (pinned.bytes >= bytes) return {};
    // A copy queued by a call that failed half-way may still read the old buffer.
    BURST_CUDA_TRY(device_, op, cudaStreamSynchronize(compute_));
    if (pinned.ptr) BURST_CUDA_TRY(device_, op, cudaFreeHost(pinned.ptr));
    pinned = Scratch{};
    const size_t want = std::max<size_t>(bytes + bytes / 2, 4096);
    BURST_CUDA_TRY(device_, op, cudaMallocHost(&pinned.ptr, want));
    pinned.bytes = want;
    return {};
  }

  // Copies host to s unless s already holds exactly these values (mirror is what it holds).
  template <typename T>
  Status upload_cached(Scratch& s, std::vector<T>& mirror, const std::vector<T>& host,
                       const char* op) {
    const size_t bytes = host.size() * sizeof(T);
    if (s.ptr != nullptr && s.bytes >= bytes && mirror == host) return {};
    BURST_RETURN_IF_ERROR(ensure(s, bytes, op));
    mirror.clear();  // stale until the copy below is queued
    BURST_CUDA_TRY(device_, op,
                   cudaMemcpyAsync(s.ptr, host.data(), bytes, cudaMemcpyHostToDevice, compute_));
    mirror = host;
    return {};
  }

  int device_;
  std::string gpu_name_;
  // The prefill kernel (Tuning::prefill_kernel): auto, or the mma.sync one that an A100 runs,
  // forced on a Hopper GPU to rehearse an A100 deployment's attention path.
  kernels::AttnKernel prefill_kernel_ = kernels::AttnKernel::kAuto;
  cudaStream_t compute_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;
  Scratch staging_, ids_, positions_, inv_freq_, decode_ws_;
  // sample(): its inputs and ids ([uniforms | row settings | ids]) on the device, and the
  // kernel's workspace (stream order lets each draw reuse them).
  Scratch sample_in_, sample_ws_;
  // A queued draw's pinned host mirror of those bytes (its ids at ids_offset, rows of them)
  // and the event after their copy to it: one slot per draw that may be outstanding, so the
  // next step's uniforms never overwrite bytes a queued copy has still to read.
  struct DrawSlot {
    Scratch pinned;
    size_t ids_offset = 0;
    int64_t rows = 0;
    cudaEvent_t done = nullptr;
  };
  DrawSlot draws_[kMaxQueuedDraws];
  std::deque<int> queued_;  // slots of the queued draws, oldest first
  // The ids the last sample() drew (or another rank's, broadcast in), and how many: what an
  // embedding's DrawnId reads (drawn_ids).
  Scratch drawn_;
  int64_t drawn_count_ = 0;
  std::vector<int64_t> positions_host_;
  std::vector<float> inv_freq_host_;
  // Shared with the deleters of the tensors this backend allocated, which may outlive it;
  // owns compute_.
  std::shared_ptr<TensorMemory> mem_ = std::make_shared<TensorMemory>();
};

Result<std::unique_ptr<Backend>> CudaBackend::create(int device, const Tuning& tuning) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return Status::error(std::string("cuda: no usable CUDA device (cudaGetDeviceCount: ") +
                         cudaGetErrorString(err) + ")");
  }
  if (device < 0 || device >= count) {
    return Status::error("cuda:" + std::to_string(device) + ": no such device (" +
                         std::to_string(count) + " CUDA device(s) visible)");
  }
  const char* op = "create";
  std::unique_ptr<CudaBackend> b(new CudaBackend(device, tuning));
  BURST_CUDA_TRY(device, op, cudaSetDevice(device));
  cudaDeviceProp prop{};
  BURST_CUDA_TRY(device, op, cudaGetDeviceProperties(&prop, device));
  b->gpu_name_ = prop.name;
  if (prop.major < 8) {
    return Status::error("cuda:" + std::to_string(device) + " (" + b->gpu_name_ + ", sm_" +
                         std::to_string(prop.major * 10 + prop.minor) +
                         "): the CUDA backend needs sm_80 or newer (bf16 tensor cores)");
  }
  kernels::set_launch_switches({tuning.pdl});
  // Non-blocking: the legacy default stream (used by libraries we do not control) must not
  // serialise against our work.
  BURST_CUDA_TRY(device, op, cudaStreamCreateWithFlags(&b->compute_, cudaStreamNonBlocking));
  b->mem_->device = device;
  b->mem_->stream = b->compute_;
  int pools = 0;
  BURST_CUDA_TRY(device, op,
                 cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
  if (!pools) {
    return Status::error("cuda:" + std::to_string(device) + " (" + b->gpu_name_ +
                         "): stream-ordered memory pools are not supported (driver too old?)");
  }
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  BURST_CUDA_TRY(device, op, cudaMemPoolCreate(&b->mem_->pool, &props));
  // Keep freed memory for reuse (the default gives it back at every synchronisation).
  uint64_t keep = UINT64_MAX;
  BURST_CUDA_TRY(device, op,
                 cudaMemPoolSetAttribute(b->mem_->pool, cudaMemPoolAttrReleaseThreshold, &keep));
  BURST_CUBLAS_TRY(device, op, cublasCreate(&b->cublas_));
  BURST_CUBLAS_TRY(device, op, cublasSetStream(b->cublas_, b->compute_));
  BURST_CUDA_TRY(device, op, cudaMalloc(&b->cublas_workspace_, kCublasWorkspaceBytes));
  BURST_CUBLAS_TRY(device, op,
                   cublasSetWorkspace(b->cublas_, b->cublas_workspace_, kCublasWorkspaceBytes));
  BURST_CUBLAS_TRY(device, op, cublasSetPointerMode(b->cublas_, CUBLAS_POINTER_MODE_HOST));
  return std::unique_ptr<Backend>(std::move(b));
}

CudaBackend* as_cuda(Backend& backend) { return dynamic_cast<CudaBackend*>(&backend); }

Status not_cuda(const Backend& backend) {
  return Status::error("backend " + backend.name() + " is not a CUDA backend");
}

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(int device, const Tuning& tuning) {
  return CudaBackend::create(device, tuning);
}

Result<CudaStreams> cuda_streams(Backend& backend) {
  CudaBackend* b = as_cuda(backend);
  if (!b) return not_cuda(backend);
  return b->streams();
}

Result<CudaMemoryInfo> cuda_memory_info(Backend& backend) {
  CudaBackend* b = as_cuda(backend);
  if (!b) return not_cuda(backend);
  return b->memory_info();
}

Status cuda_check_fits(Backend& backend, int64_t bytes, const std::string& what,
                       int64_t reserve) {
  CudaBackend* b = as_cuda(backend);
  if (!b) return not_cuda(backend);
  return b->check_fits(bytes, what, reserve);
}

}  // namespace burst::engine
