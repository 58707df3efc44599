// What the CUDA backend (engine/cuda/cuda_backend.cu) exposes beyond engine::Backend: its
// compute stream, for the NCCL communicator (which queues its transfers on a stream of its own,
// ordered against compute by CUDA events: engine/cuda/nccl_communicator.cpp), and its memory
// plan, for callers that want to know before allocating whether a model or KV cache fits.
// Only CUDA builds (BURST_HAVE_CUDA) have this header's functions.
//
// Streams: every Backend op of one CUDA backend is queued, in order, on its compute stream.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "engine/backend.h"

namespace burst::engine {

struct CudaStreams {
  int device = 0;
  cudaStream_t compute = nullptr;
};

// The streams of a backend made by make_cuda_backend; an error for any other backend.
Result<CudaStreams> cuda_streams(Backend& backend);

// Device memory as the backend sees it (bytes).
struct CudaMemoryInfo {
  int64_t free = 0;   // cudaMemGetInfo's free, now
  int64_t total = 0;  // the device's memory
  int64_t held = 0;   // held by tensors this backend allocated and has not freed yet
};
Result<CudaMemoryInfo> cuda_memory_info(Backend& backend);

// The memory plan: OK when `bytes` more fit in the device's free memory, keeping `reserve`
// bytes free for what comes later (cuBLAS, scratch); otherwise an error "<what> needs X GiB,
// Y GiB free on cuda:N (...)". Call it before allocating weights or a KV cache.
Status cuda_check_fits(Backend& backend, int64_t bytes, const std::string& what,
                       int64_t reserve = 0);

}  // namespace burst::engine
