// CudaBackend's token sampling (the class: engine/cuda/cuda_backend_internal.h; the kernel:
// kernels/sampling_cuda.h): draws queued on the compute stream, each with a pinned slot its ids
// come back to, and the last draw's ids kept on the device for the next embedding (drawn_ids).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_backend_internal.h"
#include "kernels/sampling_cuda.h"

namespace burst::engine::cuda_impl {

Status CudaBackend::sample(const Tensor& logits, const std::vector<SamplingParams>& params,
                           const std::vector<double>& uniforms, std::vector<int32_t>& ids) {
  BURST_RETURN_IF_ERROR(sample_queued(logits, params, uniforms));
  const int slot = queued_.back();
  queued_.pop_back();
  return take_draw(slot, ids);
}

Status CudaBackend::sampled(std::vector<int32_t>& ids) {
  if (queued_.empty()) return op_error("sampled", "no draw is queued");
  const int slot = queued_.front();
  queued_.pop_front();
  return take_draw(slot, ids);
}

Status CudaBackend::sample_queued(const Tensor& logits, const std::vector<SamplingParams>& params,
                                  const std::vector<double>& uniforms) {
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
  const int64_t rows = logits.dim(0);
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
  BURST_RETURN_IF_ERROR(stage_draw(logits, params, uniforms, d, p));
  BURST_RETURN_IF_ERROR(launched("sample", kernels::sample_cuda(p, compute_),
                                 logits.describe()));
  // Kept for the next embedding (drawn_ids): where the ids already are, in the stream.
  const size_t id_bytes = static_cast<size_t>(rows) * 4;
  BURST_RETURN_IF_ERROR(ensure(drawn_, id_bytes, "sample"));
  BURST_CUDA_TRY(device_, "sample",
                 cudaMemcpyAsync(drawn_.ptr, p.out_ids, id_bytes, cudaMemcpyDeviceToDevice,
                                 compute_));
  drawn_count_ = rows;
  BURST_CUDA_TRY(device_, "sample",
                 cudaMemcpyAsync(static_cast<unsigned char*>(d.pinned.ptr) + d.ids_offset,
                                 p.out_ids, id_bytes, cudaMemcpyDeviceToHost, compute_));
  BURST_CUDA_TRY(device_, "sample", cudaEventRecord(d.done, compute_));
  queued_.push_back(slot);
  return {};
}

// The kernel's parameters for a draw of rows >= 1 into slot d: its inputs copied to the device
// (one copy from d's pinned buffer), the ids' place (d.ids_offset in both buffers), the
// workspace.
Status CudaBackend::stage_draw(const Tensor& logits, const std::vector<SamplingParams>& params,
                               const std::vector<double>& uniforms, DrawSlot& d,
                               kernels::SampleParams& p) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
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
  return {};
}

Status CudaBackend::take_draw(int slot, std::vector<int32_t>& ids) {
  const DrawSlot& d = draws_[slot];
  ids.resize(static_cast<size_t>(d.rows));
  if (d.rows == 0) return {};
  BURST_RETURN_IF_ERROR(use_device("sampled"));
  BURST_CUDA_TRY(device_, "sampled", cudaEventSynchronize(d.done));
  std::memcpy(ids.data(), static_cast<const unsigned char*>(d.pinned.ptr) + d.ids_offset,
              ids.size() * 4);
  return {};
}

Status CudaBackend::drawn_ids(int64_t n, void** where) {
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

}  // namespace burst::engine::cuda_impl
