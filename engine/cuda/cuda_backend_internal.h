// CudaBackend, the class behind make_cuda_backend (engine/cuda/cuda_backend.h is the public
// face), shared by its sources: cuda_backend.cu (lifetime, memory, copies and fills, the scratch
// buffers, creation), cuda_backend_ops.cu (the layer ops and attention) and
// cuda_backend_sample.cu (token sampling and the ids kept on the device). The backend's contract
// is at the top of cuda_backend.cu.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "kernels/attention_cuda.h"

namespace burst::kernels {
struct SampleParams;  // kernels/sampling_cuda.h
}  // namespace burst::kernels

namespace burst::engine::cuda_impl {

// A failed CUDA / cuBLAS call as a Status naming the device, the op, the call (up to its '('),
// the error, file and line.
Status cuda_failure(int device, const char* op, const char* call, cudaError_t err,
                    const char* file, int line);
Status cublas_failure(int device, const char* op, const char* call, cublasStatus_t st,
                      const char* file, int line);

}  // namespace burst::engine::cuda_impl

// Return the Status of a failed CUDA / cuBLAS call from the enclosing function; dev names the
// GPU, op the backend op, and the call's text (up to its '(') the function that failed.
#define BURST_CUDA_TRY(dev, op, call)                                                        \
  do {                                                                                       \
    const cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      return ::burst::engine::cuda_impl::cuda_failure(dev, op, #call, err_, __FILE__,        \
                                                      __LINE__);                             \
    }                                                                                        \
  } while (0)
#define BURST_CUBLAS_TRY(dev, op, call)                                                      \
  do {                                                                                       \
    const cublasStatus_t st_ = (call);                                                       \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      return ::burst::engine::cuda_impl::cublas_failure(dev, op, #call, st_, __FILE__,       \
                                                        __LINE__);                           \
    }                                                                                        \
  } while (0)

namespace burst::engine::cuda_impl {

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

class CudaBackend final : public Backend {
 public:
  static Result<std::unique_ptr<Backend>> create(int device, const Tuning& tuning);
  ~CudaBackend() override;

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  DeviceKind device() const override { return DeviceKind::kCuda; }
  DType compute_dtype() const override { return DType::kBF16; }

  CudaStreams streams() const { return {device_, compute_}; }

  Result<CudaMemoryInfo> memory_info() const;
  Status check_fits(int64_t bytes, const std::string& what, int64_t reserve) const;
  Result<Tensor> alloc(std::vector<int64_t> shape, DType dtype) override;
  Status upload(const void* host, DType host_dtype, Tensor& dst) override;
  Status download(const Tensor& src, std::vector<float>& host) override;
  Status copy(const Tensor& src, Tensor& dst) override;
  Status convert(const Tensor& src, Tensor& dst) override;

  using Backend::fill_random;
  Status fill_random(Tensor& t, uint64_t seed, float scale, const RandomWindow& w) override;
  Status fill(Tensor& t, float value) override;
  Status quantize_kv(const Tensor& src, int kv_heads, const int32_t* dst_rows,
                     Tensor& dst) override;
  Status dequantize_kv(const Tensor& src, int kv_heads, Tensor& dst) override;

  using Backend::embedding;
  Status embedding(const Tensor& table, const std::vector<int32_t>& ids,
                   const std::vector<DrawnId>& drawn, Tensor& out) override;

  Status rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) override;

  // gemm's arguments: on this device, 2-D, out [m, n] = x [m, k] w [n, k]^T, one dtype.
  Status check_gemm(const char* op, const Tensor& x, const Tensor& w, const Tensor& out) const;

  // The norm, then a decode step's q, k and v in one weight-streaming launch.
  Status norm_project(const Tensor& x, const Norm& norm,
                      std::initializer_list<Projection> projections) override;

  // The same launch, q and k rotated at its store.
  Status norm_project_rope(const Tensor& x, const Norm& norm,
                           std::initializer_list<Projection> projections,
                           const RopeQk& rope) override;

  Status project_fused(const Tensor& x, const Norm& norm,
                       std::initializer_list<Projection> projections, const RopeQk* rope);

  // The norm, then a decode step's gate and up with SwiGLU at the store in one launch.
  Status norm_swiglu(const Tensor& x, const Norm& norm, const Tensor& w_gate, const Tensor& w_up,
                     Tensor& gate, Tensor& up) override;

  Status gemm(const Tensor& x, const Tensor& w, Tensor& out, bool accumulate) override;

  // rope's arguments for one tensor.
  Status check_rope(const Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
                    const std::vector<float>& inv_freq) const;

  Status rope(Tensor& x, int heads, int head_dim, const std::vector<int64_t>& positions,
              const std::vector<float>& inv_freq) override {
    return rope_pair(x, heads, nullptr, 0, head_dim, positions, inv_freq);
  }

  Status rope_qk(Tensor& q, int heads, Tensor& k, int kv_heads, int head_dim,
                 const std::vector<int64_t>& positions,
                 const std::vector<float>& inv_freq) override;

  // RoPE's positions and frequencies into positions_ and inv_freq_: q and k of every layer
  // rotate by the same ones, so they are uploaded once a forward (upload_cached).
  Status upload_rope(const std::vector<int64_t>& positions, const std::vector<float>& inv_freq);

  // x (and k, when given) rotated in one launch.
  Status rope_pair(Tensor& x, int heads, Tensor* k, int kv_heads, int head_dim,
                   const std::vector<int64_t>& positions, const std::vector<float>& inv_freq);

  Status gather_rows(const Tensor& pool, const int32_t* pages, int64_t page_size, int64_t rows,
                     Tensor& dst) override;

  Status scatter_rows(const Tensor& src, const int32_t* dst_rows, Tensor& pool) override {
    return scatter_pair(src, nullptr, dst_rows, pool, nullptr);
  }

  Status scatter_rows_pair(const Tensor& k, const Tensor& v, const int32_t* dst_rows,
                           Tensor& k_pool, Tensor& v_pool) override;

  // src into pool (and src1 into pool1, when given: same shapes) in one launch.
  Status scatter_pair(const Tensor& src, const Tensor* src1, const int32_t* dst_rows, Tensor& pool,
                      Tensor* pool1);

  Status silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) override;
  Status add(Tensor& x, const Tensor& y) override;
  Status attention(const kernels::AttnParams& p) override;

  // The prefill kernels (not the decode kernel), fp32 o.
  bool attention_merges(const kernels::AttnParams& p) const override {
    return !kernels::attention_is_decode(p) && kernels::attention_merges_into_o(p);
  }
  std::string attention_fp8_refusal(int head_dim) const override;

  Status merge(const kernels::MergeParams& p) override;

  // The draw queued, then its own ids waited for (other draws may stay queued around it).
  Status sample(const Tensor& logits, const std::vector<SamplingParams>& params,
                const std::vector<double>& uniforms, std::vector<int32_t>& ids) override;
  Status sampled(std::vector<int32_t>& ids) override;

  bool sampled_ready() const override {
    return queued_.empty() || cudaEventQuery(draws_[queued_.front()].done) != cudaErrorNotReady;
  }

  Status sample_queued(const Tensor& logits, const std::vector<SamplingParams>& params,
                       const std::vector<double>& uniforms) override;

  // Waits for the draw in `slot` (taken off queued_ by the caller) and copies its ids out.
  Status take_draw(int slot, std::vector<int32_t>& ids);
  Status drawn_ids(int64_t n, void** where) override;

  Status check_fits(int64_t bytes, const std::string& what) override {
    // 1 GiB stays free for cuBLAS workspaces and the per-forward scratch.
    return cuda_check_fits(*this, bytes, what, int64_t{1} << 30);
  }

  Status synchronize() override;

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

  Status ensure(Scratch& s, size_t bytes, const char* op);

  // Grows a pinned host buffer of sample() (cudaMallocHost: rarely, not per token).
  Status ensure_pinned(Scratch& pinned, size_t bytes, const char* op);

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
  Scratch staging_, ids_, positions_, inv_freq_, decode_ws_, fp8_attention_ws_;
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
  // sample_queued's draw of rows >= 1 into slot d, staged: its kernel's parameters p.
  Status stage_draw(const Tensor& logits, const std::vector<SamplingParams>& params,
                    const std::vector<double>& uniforms, DrawSlot& d, kernels::SampleParams& p);
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

}  // namespace burst::engine::cuda_impl
