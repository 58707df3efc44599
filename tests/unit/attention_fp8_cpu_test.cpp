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

// attention_cpu over in, fp32; fp8: with qkv_fp8. merge_split > 0: keys [0, split) then the
// rest merged into O (merge_into_o).
ref::Result run(const ref::Shape& s, const ref::Inputs& in, bool fp8, int merge_split = 0) {
  ref::Result r;
  r.o.assign(size_t(s.n_q) * s.heads * s.head_dim, 0.f);
  r.lse.assign(size_t(s.heads) * s.n_q, 0.f);
  AttnParams p;
  p.q = in.q.data();
  p.k = in.k.data();
  p.v = in.v.data();
  p.o = r.o.data();
  p.lse = r.lse.data();
  p.n_q = s.n_q;
  p.n_kv = s.n_kv;
  p.heads = s.heads;
  p.kv_heads = s.kv_heads;
  p.head_dim = s.head_dim;
  p.q_start = s.q_start;
  p.kv_start = s.kv_start;
  p.mask = s.mask;
  p.scale = 1.f / std::sqrt(float(s.head_dim));
  p.qkv_fp8 = fp8;
  set_packed_strides(p);
  if (merge_split == 0) {
    attention_cpu(p);
    return r;
  }
  AttnParams first = p, second = p;
  first.n_kv = merge_split;
  second.n_kv = s.n_kv - merge_split;
  second.kv_start = s.kv_start + merge_split;
  second.k = in.k.data() + int64_t{merge_split} * p.k_row_stride;
  second.v = in.v.data() + int64_t{merge_split} * p.v_row_stride;
  second.merge_into_o = true;
  attention_cpu(first);
  attention_cpu(second);
  return r;
}

void check(const std::string& name, const ref::Shape& s, bool outliers, uint32_t seed,
           int merge_split = 0) {
  SCOPED_TRACE(name);
  const ref::Inputs in = ref::draw_inputs(s, outliers, seed, as_is);
  const ref::Result truth = ref::attend(s, in, false);
  const ref::Errors e8 = ref::errors(s, run(s, in, true, merge_split), truth);
  const ref::Errors e32 = ref::errors(s, run(s, in, false), truth);
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
