// The CPU emulation of FP8 attention (attention_cpu with AttnParams::qkv_fp8: what CPU workers
// run under --attention-dtype fp8, and the reference of the Hopper kernel's roundings) against
// an fp64 attention over the same inputs, by the rule of tests/gpu/attention_fp8_test.cu: its
// error at most twice that of a naive per-tensor FP8 attention, better than it where channels
// carry outliers, rows that see no key empty. Odd sizes, GQA, masks, chunks after a prefix,
// merges, and the golden models' head_dim 16 beside LLaMA's 128.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../fp8_attention_reference.h"
#include "kernels/attention.h"

namespace burst::kernels {
namespace {

namespace ref = testing::fp8_attention;

float as_is(float x) { return x; }

void check(const std::string& name, const ref::Shape& s, bool outliers, uint32_t seed,
           int merge_split = 0) {
  SCOPED_TRACE(name);
  const ref::Inputs in = ref::draw_inputs(s, outliers, seed, as_is);
  const ref::Result truth = ref::attend(s, in, false);
  const ref::Errors e8 = ref::errors(s, ref::attention_cpu_of(s, in, true, merge_split), truth);
  const ref::Errors e32 = ref::errors(s, ref::attention_cpu_of(s, in, false), truth);
  const ref::Errors en = ref::errors(s, ref::naive_fp8(s, in), truth);
  std::printf("[fp8 attention, CPU] %s: O RMSE %.3e, naive per-tensor fp8 %.3e, fp32 %.3e; "
              "LSE RMSE %.3e (max %.3e), naive %.3e (max %.3e); %d empty rows\n",
              name.c_str(), e8.o_rmse, en.o_rmse, e32.o_rmse, e8.lse_rmse, e8.lse_max,
              en.lse_rmse, en.lse_max, e8.empty_rows);
  EXPECT_EQ(e8.not_finite, 0);
  EXPECT_EQ(e8.wrong_empty, 0) << "rows that see no key must be O = 0, LSE = -inf";
  EXPECT_LE(e8.o_rmse, 2 * en.o_rmse);
  EXPECT_LE(e8.lse_rmse, 2 * en.lse_rmse + 1e-6);
  // It rounds: coarser than fp32 by far (an emulation that rounds nothing fails here).
  EXPECT_GT(e8.o_rmse, 10 * e32.o_rmse);
  if (outliers) {
    EXPECT_LT(e8.o_rmse, en.o_rmse) << "block scales + rotation beat per-tensor";
  }
}

TEST(AttentionFp8Cpu, LlamaHeadDimOddSizesGqaAndMasks) {
  check("causal gqa", {301, 301, 4, 2, 128, MaskKind::kCausal}, false, 1);
  check("full odd", {97, 389, 2, 2, 128, MaskKind::kNone}, false, 2);
  check("chunk after prefix", {133, 420, 4, 1, 128, MaskKind::kCausal, 287, 0}, false, 3);
  check("masked rows", {150, 200, 2, 2, 128, MaskKind::kCausal, 0, 40}, false, 4);
}

TEST(AttentionFp8Cpu, OutlierChannelsBeatPerTensor) {
  check("outliers causal", {256, 256, 4, 2, 128, MaskKind::kCausal}, true, 5);
}

TEST(AttentionFp8Cpu, GoldenHeadDimAndMerge) {
  check("head_dim 16", {77, 77, 6, 2, 16, MaskKind::kCausal}, false, 6);
  check("merged halves", {120, 300, 4, 2, 128, MaskKind::kCausal, 180, 0}, false, 7, 130);
}

}  // namespace
}  // namespace burst::kernels
