// CudaBackend: the Backend ops on one GPU in bf16 (activations, weights, KV cache) with fp32
// accumulation: GEMMs through cuBLAS (bf16 in and out, fp32 compute), RMSNorm / RoPE / SwiGLU /
// embedding / conversion / add / fills through kernels/ops_cuda.h, attention through
// kernels/attention_cuda.h (the prefill kernel, or split-KV decode for one query row), merge
// through merge_cuda, token sampling through kernels/sampling_cuda.h (only the ids come back to
// the host).
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
//
// The class is in cuda_backend_internal.h; this file holds its lifetime, memory, copies and
// fills, and creation; cuda_backend_ops.cu the layer ops and attention; cuda_backend_sample.cu
// sampling. No device code: the kernels are in kernels/cuda.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_backend_internal.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/dtype_convert.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops_cuda.h"

namespace burst::engine::cuda_impl {
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

}  // namespace

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

CudaBackend::~CudaBackend() {
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

Result<CudaMemoryInfo> CudaBackend::memory_info() const {
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

Status CudaBackend::check_fits(int64_t bytes, const std::string& what, int64_t reserve) const {
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

Result<Tensor> CudaBackend::alloc(std::vector<int64_t> shape, DType dtype) {
  Tensor t = Tensor::unallocated(std::move(shape), dtype, DeviceKind::kCuda);
  if (const std::string why = t.shape_problem(); !why.empty()) return op_error("alloc", why);
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

Status CudaBackend::upload(const void* host, DType host_dtype, Tensor& dst) {
  BURST_RETURN_IF_ERROR(on_device("upload", dst));
  BURST_RETURN_IF_ERROR(use_device("upload"));
  const int64_t n = dst.numel();
  if (n == 0) return {};
  if ((host_dtype == DType::kI32 || dst.dtype == DType::kI32) && host_dtype != dst.dtype) {
    return op_error("upload", "i32 uploads only into i32");
  }
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

Status CudaBackend::download(const Tensor& src, std::vector<float>& host) {
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
  if (src.dtype == DType::kI32) {
    std::vector<int32_t> ints(static_cast<size_t>(n));
    BURST_CUDA_TRY(device_, "download",
                   cudaMemcpyAsync(ints.data(), src.data, static_cast<size_t>(src.bytes()),
                                   cudaMemcpyDeviceToHost, compute_));
    BURST_CUDA_TRY(device_, "download", cudaStreamSynchronize(compute_));
    host.assign(ints.begin(), ints.end());
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

Status CudaBackend::copy(const Tensor& src, Tensor& dst) {
  BURST_RETURN_IF_ERROR(on_device("copy", src, dst));
  if (src.dtype != dst.dtype || src.numel() != dst.numel()) {
    return op_error("copy", src.describe() + " -> " + dst.describe());
  }
  BURST_RETURN_IF_ERROR(use_device("copy"));
  if (src.numel() == 0) return {};
  const int64_t bytes = src.bytes();
  // Small aligned copies (a decode token's k and v into its page) as a chained kernel, which
  // keeps the step's chain of launches unbroken; large ones by the copy engines.
  constexpr int64_t kChainedCopyBytes = int64_t{1} << 20;
  const auto addresses =
      reinterpret_cast<uintptr_t>(src.data) | reinterpret_cast<uintptr_t>(dst.data);
  if (bytes <= kChainedCopyBytes && bytes % 16 == 0 && (addresses & 15u) == 0) {
    return launched("copy", kernels::copy_chained_cuda(dst.data, src.data, bytes, compute_),
                    src.describe());
  }
  BURST_CUDA_TRY(device_, "copy",
                 cudaMemcpyAsync(dst.data, src.data, static_cast<size_t>(bytes),
                                 cudaMemcpyDeviceToDevice, compute_));
  return {};
}

Status CudaBackend::convert(const Tensor& src, Tensor& dst) {
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

Status CudaBackend::fill_random(Tensor& t, uint64_t seed, float scale, const RandomWindow& w) {
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

Status CudaBackend::fill(Tensor& t, float value) {
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

Status CudaBackend::synchronize() {
  BURST_RETURN_IF_ERROR(use_device("synchronize"));
  BURST_CUDA_TRY(device_, "synchronize", cudaStreamSynchronize(compute_));
  return {};
}

Status CudaBackend::ensure(Scratch& s, size_t bytes, const char* op) {
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

Status CudaBackend::ensure_pinned(Scratch& pinned, size_t bytes, const char* op) {
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

}  // namespace burst::engine::cuda_impl

namespace burst::engine {
namespace {

using cuda_impl::CudaBackend;

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
