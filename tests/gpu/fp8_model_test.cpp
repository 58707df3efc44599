// What FP8 costs a real model on a GPU (tests/kjv_fp8_cost.h says what is measured): kjv-tiny
// (head_dim 128, 2 query heads on 1 KV head) through the CUDA backend in bf16 against the same
// with the FP8 KV cache and with FP8 attention (the Hopper kernel itself, where the CPU test
// runs its emulation). The bounds are the CPU test's (tests/unit/fp8_model_test.cpp), whose
// measured costs the kernel must stay near. Skips without a GPU, without the KJV text (the
// `bible` command, or $BURST_KJV_DIR), and, for FP8 attention, off Hopper.
#include <gtest/gtest.h>

#include <string>

#include "engine/backend.h"
#include "../kjv_fp8_cost.h"
#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"

namespace burst::models {
namespace {

using testing::fp8_cost::check_costs;
using testing::fp8_cost::Numerics;

// The CUDA backend on GPU 0, or a skip.
std::unique_ptr<engine::Backend> cuda_or_skip(std::string& why) {
  if (!testing::have_gpu(why)) return nullptr;
  auto b = engine::make_cuda_backend(0);
  if (!b.ok()) {
    why = b.message();
    return nullptr;
  }
  return b.take();
}

TEST(GpuFp8Model, KvCacheKjvTinyPerplexityAndGreedyAgreement) {
  std::string why;
  auto gpu = cuda_or_skip(why);
  if (!gpu) GTEST_SKIP() << "skipping the GPU FP8 model test: " << why;
  check_costs(*gpu, testing::source_root(), "gpu, fp8 KV cache",
              Numerics{engine::KvCacheDtype::kFp8, engine::AttentionDtype::kAuto}, 0.12);
}

TEST(GpuFp8Model, AttentionKjvTinyPerplexityAndGreedyAgreement) {
  std::string why;
  auto gpu = cuda_or_skip(why);
  if (!gpu) GTEST_SKIP() << "skipping the GPU FP8 model test: " << why;
  kernels::AttnParams probe;
  probe.head_dim = 128;
  if (!kernels::attention_fp8_supported(probe)) {
    GTEST_SKIP() << "skipping: FP8 attention needs a Hopper GPU (compute capability 9.0)";
  }
  check_costs(*gpu, testing::source_root(), "gpu, fp8 attention",
              Numerics{engine::KvCacheDtype::kAuto, engine::AttentionDtype::kFp8}, 0.15);
}

}  // namespace
}  // namespace burst::models
