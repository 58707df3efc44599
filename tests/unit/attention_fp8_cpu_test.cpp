// The CPU emulation of FP8 attention (attention_cpu with AttnParams::qkv_fp8: what CPU workers
// run under --attention-dtype fp8, and the reference of the Hopper kernel's roundings) against
// an fp64 attention over the same inputs, by the rule of tests/gpu/attention_fp8_test.cu: its
// error at most twice that of a naive per-tensor FP8 attention, better than it where channels
// carry outliers, rows that see no key empty. Odd sizes, GQA, masks, chunks after a prefix,
// merges, and the golden models' head_dim 16 beside LLaMA's 128.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "../fp8_attention_reference.h"
#include "kernels/attention.h"
#include "kernels/kv_fp8.h"

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

// K and V as FP8 KV rows (kernels/kv_fp8.h), paged with the pages out of order: the same bits
// as FP8 attention over their values in one contiguous fp32 block (what the engine dequantized
// them into before), with the rows that no page holds poisoned.
TEST(AttentionFp8Cpu, Fp8KvRowsPagedEqualTheirValues) {
  const ref::Shape s{70, 203, 4, 2, 32, MaskKind::kCausal, 150, 0};
  const ref::Inputs in = ref::draw_inputs(s, false, 8, [](float x) { return x; });
  constexpr int kPage = 8;
  const int pages = (s.n_kv + kPage - 1) / kPage;
  std::vector<int32_t> table(static_cast<size_t>(pages)), dst(static_cast<size_t>(s.n_kv));
  for (int i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = (7 * i + 3) % (pages + 1);
  for (int j = 0; j < s.n_kv; ++j) {
    dst[static_cast<size_t>(j)] = table[static_cast<size_t>(j / kPage)] * kPage + j % kPage;
  }
  const int64_t row_bytes = kv_fp8_row_bytes(s.kv_heads, s.head_dim);
  const size_t pool = static_cast<size_t>((pages + 1) * kPage * row_bytes);
  std::vector<uint8_t> k8(pool, 0x7f), v8(pool, 0x7f);  // 0x7f: e4m3 NaN where no key lies
  quantize_kv_cpu(in.k.data(), s.n_kv, s.kv_heads, s.head_dim, dst.data(), k8.data());
  quantize_kv_cpu(in.v.data(), s.n_kv, s.kv_heads, s.head_dim, dst.data(), v8.data());
  // The values the rows hold, in key order.
  ref::Inputs seen = in;
  for (auto [rows, out] : {std::pair{&k8, &seen.k}, std::pair{&v8, &seen.v}}) {
    std::vector<uint8_t> ordered(static_cast<size_t>(s.n_kv * row_bytes));
    for (int j = 0; j < s.n_kv; ++j) {
      std::copy_n(rows->data() + dst[static_cast<size_t>(j)] * row_bytes, row_bytes,
                  ordered.data() + j * row_bytes);
    }
    dequantize_kv_cpu(ordered.data(), s.n_kv, s.kv_heads, s.head_dim, out->data());
  }
  const ref::Result want = ref::attention_cpu_of(s, seen, true);
  ref::Result got;
  got.o.assign(want.o.size(), 0.f);
  got.lse.assign(want.lse.size(), 0.f);
  AttnParams p = ref::params_of(s, in.q.data(), k8.data(), v8.data(), got.o.data(),
                                got.lse.data());
  p.qkv_fp8 = true;
  p.kv_fp8 = true;
  p.k_row_stride = p.v_row_stride = row_bytes;
  p.kv_pages = table.data();
  p.page_size = kPage;
  attention_cpu(p);
  EXPECT_EQ(got.o, want.o);
  EXPECT_EQ(got.lse, want.lse);
  // And it is FP8 attention: not the exact attention over those values.
  const ref::Result exact = ref::attention_cpu_of(s, seen, false);
  EXPECT_NE(got.o, exact.o);
}

}  // namespace
}  // namespace burst::kernels
