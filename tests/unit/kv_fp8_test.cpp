// FP8 KV rows (kernels/kv_fp8.h): the e4m3 conversion against the format's definition (every
// code, rounding ties to even, saturation, NaN), quantization error within half an e4m3 step
// of each value, and attention_cpu over FP8 rows equal to attention over their values (paged,
// per-row K/V, GQA, odd sizes) within the CPU kernel's own fp32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/kv_pages.h"
#include "kernels/attention.h"
#include "kernels/kv_fp8.h"

namespace burst::kernels {
namespace {

// e4m3 by its definition: sign, exponent bits e (bias 7), mantissa m.
double e4m3_value(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

TEST(Fp8E4M3, EveryCodeDecodesAndEncodesBack) {
  for (int code = 0; code < 256; ++code) {
    const float x = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(x), e4m3_value(code)) << code;
    EXPECT_EQ(fp8_e4m3_from_float(x), code) << code;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.f, -9));
}

TEST(Fp8E4M3, RoundsToNearestEvenAndSaturates) {
  // Between neighbours a < b: a point just below the midpoint goes to a, just above to b, the
  // midpoint itself to the one with an even mantissa.
  for (int code = 0; code < 0x7e; ++code) {
    const double a = e4m3_value(code), b = e4m3_value(code + 1), mid = (a + b) / 2;
    const float below = std::nextafter(static_cast<float>(mid), -1.f);
    const float above = std::nextafter(static_cast<float>(mid), 1000.f);
    EXPECT_EQ(fp8_e4m3_from_float(below), code) << a;
    EXPECT_EQ(fp8_e4m3_from_float(above), code + 1) << a;
    EXPECT_EQ(fp8_e4m3_from_float(static_cast<float>(mid)), (code & 1) ? code + 1 : code) << a;
    EXPECT_EQ(fp8_e4m3_from_float(-static_cast<float>(mid)),
              0x80 | ((code & 1) ? code + 1 : code)) << a;
  }
  for (float big : {448.f, 463.9f, 464.f, 500.f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(fp8_e4m3_from_float(big), 0x7e) << big;
    EXPECT_EQ(fp8_e4m3_from_float(-big), 0xfe) << big;
  }
  EXPECT_EQ(fp8_e4m3_from_float(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.f, -11)), 0);  // below half the smallest step
}

std::vector<float> random_values(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng); while (x == 0.f);
  }
  return v;
}

TEST(KvFp8Rows, QuantizedValuesLieWithinHalfAStep) {
  const int kv_heads = 3, head_dim = 40, rows = 17;
  const int64_t width = kv_heads * head_dim, row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  ASSERT_EQ(row_bytes % 16, 0);
  std::vector<float> x = random_values(static_cast<size_t>(rows * width), 7, 3.f);
  // Outliers: one large channel in head 1 of every row, and a head of tiny values in row 2.
  for (int r = 0; r < rows; ++r) x[static_cast<size_t>(r * width + head_dim + 5)] = 900.f + r;
  for (int c = 0; c < head_dim; ++c) x[static_cast<size_t>(2 * width + 2 * head_dim + c)] *= 1e-6f;
  // Scattered into rows 4, 5, ... of a pool, row 3 skipped (negative).
  std::vector<int32_t> dst(rows);
  for (int r = 0; r < rows; ++r) dst[static_cast<size_t>(r)] = r == 3 ? -1 : r + 4;
  std::vector<uint8_t> pool(static_cast<size_t>((rows + 4) * row_bytes), 0xab);
  quantize_kv_cpu(x.data(), rows, kv_heads, head_dim, dst.data(), pool.data());
  for (int64_t b = 7 * row_bytes; b < 8 * row_bytes; ++b) {  // row 3 went nowhere: pool row 7
    EXPECT_EQ(pool[static_cast<size_t>(b)], 0xab);
  }
  std::vector<float> back(static_cast<size_t>((rows + 4) * width));
  dequantize_kv_cpu(pool.data(), rows + 4, kv_heads, head_dim, back.data());
  for (int r = 0; r < rows; ++r) {
    if (r == 3) continue;
    for (int g = 0; g < kv_heads; ++g) {
      float amax = 0.f;
      for (int c = 0; c < head_dim; ++c) amax = std::fmax(amax, std::fabs(x[static_cast<size_t>(r * width + g * head_dim + c)]));
      const float scale = amax / 448.f;
      for (int c = 0; c < head_dim; ++c) {
        const float want = x[static_cast<size_t>(r * width + g * head_dim + c)];
        const float got = back[static_cast<size_t>((r + 4) * width + g * head_dim + c)];
        // Half a step of e4m3 (3 mantissa bits: 2^-4 of the value; subnormals: 2^-10 of the
        // scale), plus the fp32 roundings of x / scale and e4m3 x scale.
        const float bound = std::fmax(std::fabs(want) * 0.0625f, scale * std::ldexp(1.f, -10)) +
                            std::fabs(want) * 1e-6f;
        EXPECT_LE(std::fabs(got - want), bound) << "row " << r << " head " << g << " col " << c;
      }
      // The head's largest value is 448 x scale exactly: nothing saturated.
      float back_max = 0.f;
      for (int c = 0; c < head_dim; ++c) back_max = std::fmax(back_max, std::fabs(back[static_cast<size_t>((r + 4) * width + g * head_dim + c)]));
      EXPECT_NEAR(back_max, amax, amax * 1e-6f);
    }
  }
}

// attention over FP8 rows (paged, scattered pool) against attention_cpu on their dequantized
// values laid out densely: the same keys, so within the kernel's fp32 rounding (1e-6 here).
TEST(KvFp8Rows, AttentionReadsRowsAsTheirValues) {
  const int heads = 6, kv_heads = 2, head_dim = 24, n_kv = 45, n_q = 3, page = 4;
  const int64_t qw = heads * head_dim, kvw = kv_heads * head_dim;
  const int64_t row_bytes = kv_fp8_row_bytes(kv_heads, head_dim);
  const std::vector<float> q = random_values(static_cast<size_t>(n_q * qw), 1, 2.f);
  const std::vector<float> k = random_values(static_cast<size_t>(n_kv * kvw), 2, 2.f);
  const std::vector<float> v = random_values(static_cast<size_t>(n_kv * kvw), 3, 2.f);
  // Pages in reverse order: key j at pool row pages[j / page] * page + j % page.
  const int n_pages = (n_kv + page - 1) / page;
  std::vector<int32_t> pages(static_cast<size_t>(n_pages)), dst(static_cast<size_t>(n_kv));
  for (int i = 0; i < n_pages; ++i) pages[static_cast<size_t>(i)] = n_pages - 1 - i;
  for (int j = 0; j < n_kv; ++j) dst[static_cast<size_t>(j)] = pages[static_cast<size_t>(j / page)] * page + j % page;
  std::vector<uint8_t> kp(static_cast<size_t>(n_pages * page * row_bytes)), vp(kp.size());
  quantize_kv_cpu(k.data(), n_kv, kv_heads, head_dim, dst.data(), kp.data());
  quantize_kv_cpu(v.data(), n_kv, kv_heads, head_dim, dst.data(), vp.data());
  std::vector<float> kd(k.size()), vd(v.size()), tmp(static_cast<size_t>(n_pages * page * kvw));
  dequantize_kv_cpu(kp.data(), n_pages * page, kv_heads, head_dim, tmp.data());
  for (int j = 0; j < n_kv; ++j) std::memcpy(&kd[static_cast<size_t>(j * kvw)], &tmp[static_cast<size_t>(dst[static_cast<size_t>(j)] * kvw)], kvw * 4);
  dequantize_kv_cpu(vp.data(), n_pages * page, kv_heads, head_dim, tmp.data());
  for (int j = 0; j < n_kv; ++j) std::memcpy(&vd[static_cast<size_t>(j * kvw)], &tmp[static_cast<size_t>(dst[static_cast<size_t>(j)] * kvw)], kvw * 4);

  auto params = [&](float* o, float* lse) {
    AttnParams p;
    p.q = q.data();
    p.o = o;
    p.lse = lse;
    p.n_q = n_q;
    p.n_kv = n_kv;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.head_dim = head_dim;
    set_packed_strides(p);
    p.q_start = n_kv - 2;  // causal: the last query rows see all but the last keys
    p.mask = MaskKind::kCausal;
    p.scale = 1.f / std::sqrt(static_cast<float>(head_dim));
    return p;
  };
  std::vector<float> o_ref(static_cast<size_t>(n_q * qw)), lse_ref(static_cast<size_t>(n_q * heads));
  AttnParams ref = params(o_ref.data(), lse_ref.data());
  ref.k = kd.data();
  ref.v = vd.data();
  attention_cpu(ref);
  std::vector<float> o(o_ref.size()), lse(lse_ref.size());
  AttnParams p = params(o.data(), lse.data());
  p.k = kp.data();
  p.v = vp.data();
  p.kv_fp8 = true;
  p.k_row_stride = p.v_row_stride = row_bytes;
  p.kv_pages = pages.data();
  p.page_size = page;
  attention_cpu(p);
  for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(o[i], o_ref[i], 1e-6f) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse[i], lse_ref[i], 1e-6f) << i;
  // And the values differ from the unrounded keys' attention by the FP8 error, not by nothing
  // (the test would pass with a reader that ignored the format otherwise).
  std::vector<float> o_exact(o.size()), lse_exact(lse.size());
  AttnParams exact = params(o_exact.data(), lse_exact.data());
  exact.k = k.data();
  exact.v = v.data();
  attention_cpu(exact);
  double diff = 0;
  for (size_t i = 0; i < o.size(); ++i) diff = std::fmax(diff, std::fabs(o[i] - o_exact[i]));
  EXPECT_GT(diff, 1e-4);
  EXPECT_LT(diff, 0.1);
}

TEST(KvFp8Rows, BackendOpsAndPoolSizes) {
  auto backend = engine::make_cpu_backend();
  const engine::AttentionShape shape{2, 4, 2, 8};
  EXPECT_EQ(engine::kv_row_bytes(*backend, shape, engine::KvCacheDtype::kAuto), 2 * 8 * 4);
  EXPECT_EQ(engine::kv_row_bytes(*backend, shape, engine::KvCacheDtype::kFp8), 32);  // 16 + 8 -> 32
  auto parsed = engine::parse_kv_cache_dtype("fp8_e4m3");
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed.value(), engine::KvCacheDtype::kFp8);
  auto bad = engine::parse_kv_cache_dtype("fp8_e5m2");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("auto, fp8 or fp8_e4m3"), std::string::npos) << bad.message();
  // fill on FP8 rows: NaN in every byte (values and scales); quantize_kv refuses mismatched
  // widths.
  auto rows = backend->alloc({3, 32}, engine::DType::kFP8E4M3);
  ASSERT_TRUE(rows.ok());
  ASSERT_TRUE(backend->fill(rows.value(), std::numeric_limits<float>::quiet_NaN()).ok());
  auto values = backend->alloc({3, 16}, engine::DType::kF32);
  ASSERT_TRUE(backend->dequantize_kv(rows.value(), 2, values.value()).ok());
  for (int i = 0; i < 48; ++i) EXPECT_TRUE(std::isnan(values.value().as<float>()[i])) << i;
  auto wide = backend->alloc({3, 40}, engine::DType::kF32);  // head_dim 20: 48-byte rows
  EXPECT_FALSE(backend->quantize_kv(wide.value(), 2, nullptr, rows.value()).ok());
}

}  // namespace
}  // namespace burst::kernels
