// Tuning: the switches that time one path against another (A/B runs: scripts in bench/gpu/).
// A program reads them once in its main (Tuning::from_env, from the variables named below) and
// hands them to make_backend; below main nothing reads the environment for them: the backend
// keeps them (Backend::tuning) for the kernels it launches and for what runs on it (the NCCL
// communicator, the worker's step loop). The defaults are the production paths.
#pragma once

#include "engine/status.h"

namespace burst::engine {

// The prefill attention kernel of a CUDA backend.
enum class PrefillKernel {
  kAuto,  // the best one the GPU runs (the TMA/wgmma kernel on Hopper)
  kSm80,  // the mma.sync kernel an A100 runs, on any GPU (an A100 deployment's path on an H100)
};

struct Tuning {
  // BURST_OVERLAP=0: a worker answers every step before it reads the next (no lookahead).
  bool overlap_steps = true;
  // BURST_PDL=0: CUDA kernels are launched without programmatic dependent launch.
  bool pdl = true;
  // BURST_PEER_GATHER=0: a GPU rank's decode all-gathers and all-reduces go through NCCL, not
  // by stores into its peers' memory.
  bool peer_gather = true;
  // BURST_ATTN_KERNEL=auto|sm80.
  PrefillKernel prefill_kernel = PrefillKernel::kAuto;

  // The switches the environment sets (the defaults where a variable is unset); an error for a
  // value it cannot mean (BURST_ATTN_KERNEL other than auto or sm80).
  static Result<Tuning> from_env();
};

}  // namespace burst::engine
