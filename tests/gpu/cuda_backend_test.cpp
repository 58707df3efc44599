// GPU tests of the CUDA backend (engine/cuda/cuda_backend.cu) against its CPU twin: every
// Backend op at odd sizes, the models end to end, and (when asked through the environment) the
// dump for bench/gpu/hf_compare.py and the prefill benchmark of bench/gpu/bench_prefill.sh.
//
// Tolerance rule: the CPU backend runs in fp32 on the inputs rounded to bf16 (the reference);
// a "naive" bf16 implementation is that reference rounded once to bf16. Per element,
//   |ours - ref| <= 2 |naive - ref| + acc + 4e-6 |ref| + 1e-6,
// where acc is the fp32 accumulation-order allowance of reductions we do not control: for a
// GEMM of depth k, k * 2^-23 * sum_i |x_i w_i| (twice the worst-case fp32 summation error
// gamma_k); 0 for element-wise ops. So ours rounds the right value to bf16; near a rounding
// midpoint fp32 reassociation may pick the other neighbour, nothing more. Copies, conversions
// and fill_random are exact. Attention follows tests/gpu/attention_test.cu (2x a naive
// implementation that rounds P to bf16 before P.V), merge is fp32 on both sides.
//
// Every test skips with a message when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/attention_context.h"
#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/dtype_convert.h"
#include "engine/kv_pages.h"
#include "engine/random.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops.h"
#include "models/config.h"
#include "runtime/driver.h"
#include "models/llama.h"
#include "common/tokenizer.h"
#include "gpu_test_util.h"
#include "../one_sequence.h"
#include "../queued_draws_check.h"

namespace burst {
namespace {

using engine::Backend;
using engine::DType;
using engine::Tensor;
namespace fs = std::filesystem;

using burst::testing::OneRank;

// The sequence's next forward through its one-rank ring, the logits of logit_rows (seq_len 0:
// max(positions) + 1).
Status forward_logits(models::LlamaModel& m, const std::vector<int32_t>& ids,
                      const std::vector<int64_t>& pos, OneRank& seq,
                      const std::vector<int64_t>& logit_rows, std::vector<float>& logits,
                      int64_t seq_len = 0, const models::LayerHook& hook = nullptr) {
  return seq.forward(m, ids, pos, logit_rows, logits, seq_len, hook);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The source tree (models, fixtures).
const std::string kRoot = testing::source_root();

using testing::have_gpu;

float round_bf16(float x) { return engine::bf16_to_f32(engine::f32_to_bf16(x)); }
std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}

std::vector<float> random_vector(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The naive same-precision attention of the tolerance rule (defined below).
void attention_naive(const kernels::AttnParams& p, std::vector<float>& o, std::vector<float>& lse);

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!have_gpu(why)) GTEST_SKIP() << "skipping CUDA backend test: " << why;
    // The environment's switches, as burst-worker's main reads them (BURST_ATTN_KERNEL=sm80
    // runs these tests on the A100's prefill kernel).
    auto tuning = engine::Tuning::from_env();
    ASSERT_TRUE(tuning.ok()) << tuning.message();
    auto b = engine::make_cuda_backend(0, tuning.value());
    ASSERT_TRUE(b.ok()) << b.message();
    gpu_ = b.take();
    cpu_ = engine::make_cpu_backend();
  }

  // A tensor of `dtype` on `b` holding host (fp32) values, converted by upload().
  Tensor make(Backend& b, std::vector<int64_t> shape, const std::vector<float>& host,
              DType dtype) {
    auto t = b.alloc(std::move(shape), dtype);
    EXPECT_TRUE(t.ok()) << t.message();
    if (!t.ok()) return {};
    const Status st = b.upload(host.data(), DType::kF32, t.value());
    EXPECT_TRUE(st.ok()) << st.message();
    return t.take();
  }
  Tensor gpu(std::vector<int64_t> shape, const std::vector<float>& host,
             DType dtype = DType::kBF16) {
    return make(*gpu_, std::move(shape), host, dtype);
  }
  Tensor cpu(std::vector<int64_t> shape, const std::vector<float>& host) {
    return make(*cpu_, std::move(shape), host, DType::kF32);
  }
  std::vector<float> fetch(Backend& b, const Tensor& t) {
    std::vector<float> host;
    const Status st = b.download(t, host);
    EXPECT_TRUE(st.ok()) << st.message();
    return host;
  }

  // The fp32 reference of p's attention (the CPU backend) and the naive same-precision one
  // (attention_naive), from host q [n_q, heads x d], k and v [n_kv, kv_heads x d].
  struct AttnRefs {
    std::vector<float> o, lse, naive_o, naive_lse;
  };
  AttnRefs attention_refs(const kernels::AttnParams& p, const std::vector<float>& q,
                          const std::vector<float>& k, const std::vector<float>& v) {
    const int64_t qw = int64_t{p.heads} * p.head_dim, kw = int64_t{p.kv_heads} * p.head_dim;
    Tensor cq = cpu({p.n_q, qw}, q), ck = cpu({p.n_kv, kw}, k), cv = cpu({p.n_kv, kw}, v);
    auto co = cpu_->alloc({p.n_q, qw}, DType::kF32);
    auto cl = cpu_->alloc({int64_t{p.heads} * p.n_q}, DType::kF32);
    AttnRefs r;
    if (!co.ok() || !cl.ok()) {
      ADD_FAILURE() << "reference buffers: " << co.message() << cl.message();
      return r;
    }
    kernels::AttnParams pc = p;
    pc.q = cq.data;
    pc.k = ck.data;
    pc.v = cv.data;
    pc.o = co.value().data;
    pc.lse = cl.value().as<float>();
    pc.dtype = DType::kF32;
    pc.o_dtype = DType::kF32;
    const Status st = cpu_->attention(pc);
    EXPECT_TRUE(st.ok()) << st.message();
    attention_naive(pc, r.naive_o, r.naive_lse);
    r.o = fetch(*cpu_, co.value());
    r.lse = fetch(*cpu_, cl.value());
    return r;
  }

  std::unique_ptr<Backend> gpu_, cpu_;
};

// The tolerance rule of the file comment; acc may be empty (element-wise ops).
void expect_rule(const std::vector<float>& ours, const std::vector<float>& ref,
                 const std::vector<float>& acc, const std::string& what) {
  ASSERT_EQ(ours.size(), ref.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_excess = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float naive = round_bf16(ref[i]);
    const double bound = 2.0 * std::fabs(double(naive) - ref[i]) + (acc.empty() ? 0 : acc[i]) +
                         4e-6 * std::fabs(ref[i]) + 1e-6;
    const double err = std::fabs(double(ours[i]) - ref[i]);
    if (!(err <= bound)) {
      if (bad == 0 || err - bound > worst_excess) {
        worst_excess = err - bound;
        worst = i;
      }
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << ref.size()
                     << " elements outside the rule; worst at " << worst << ": ours "
                     << ours[worst] << " ref " << ref[worst];
}

// ---- data movement ----------------------------------------------------------------------------

TEST_F(CudaBackendTest, UploadDownloadConvertExactly) {
  for (int64_t n : {1, 7, 37, 127, 769, 20 * 1000 * 1000 + 37}) {  // the last spans 2 chunks
    SCOPED_TRACE("n=" + std::to_string(n));
    const auto host = random_vector(static_cast<size_t>(n), -3.f, 3.f, static_cast<uint32_t>(n));
    // fp32 -> bf16 rounds to nearest even, exactly as the host conversion does.
    Tensor t = gpu({n}, host);
    EXPECT_EQ(fetch(*gpu_, t), round_bf16(host));
    // fp32 -> fp32 and bf16 -> bf16 are copies.
    Tensor f = gpu({n}, host, DType::kF32);
    EXPECT_EQ(fetch(*gpu_, f), host);
    std::vector<uint16_t> bf(host.size()), hf(host.size());
    for (size_t i = 0; i < host.size(); ++i) bf[i] = engine::f32_to_bf16(host[i]);
    ASSERT_TRUE(gpu_->upload(bf.data(), DType::kBF16, t).ok());
    EXPECT_EQ(fetch(*gpu_, t), round_bf16(host));
    // fp16 host data: values that fp16 holds exactly (multiples of 2^-8 below 8), encoded
    // through a table of every fp16 bit pattern.
    if (n < 1000) {
      std::map<float, uint16_t> f16_bits;
      for (uint32_t h = 0; h < 0x10000; ++h) {
        const float v = engine::f16_to_f32(static_cast<uint16_t>(h));
        if (std::isfinite(v)) f16_bits.emplace(v, static_cast<uint16_t>(h));
      }
      std::vector<float> want(host.size());
      for (size_t i = 0; i < host.size(); ++i) {
        const float v = std::round(host[i] * 256.f) / 256.f;
        hf[i] = f16_bits.at(v);
        want[i] = round_bf16(v);
      }
      ASSERT_TRUE(gpu_->upload(hf.data(), DType::kF16, t).ok());
      EXPECT_EQ(fetch(*gpu_, t), want);
    }
  }
}

TEST_F(CudaBackendTest, CopyConvertAndFillRandomMatchCpu) {
  for (int64_t n : {1, 7, 37, 127, 769, 1000003}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    auto g = gpu_->alloc({n}, DType::kBF16);
    auto c = cpu_->alloc({n}, DType::kF32);
    ASSERT_TRUE(g.ok() && c.ok());
    const uint64_t seed = 1000003ull * 7 + static_cast<uint64_t>(n);
    ASSERT_TRUE(gpu_->fill(g.value(), 0.0156f).ok());
    ASSERT_TRUE(cpu_->fill(c.value(), 0.0156f).ok());
    EXPECT_EQ(fetch(*gpu_, g.value()), round_bf16(fetch(*cpu_, c.value())));
    ASSERT_TRUE(gpu_->fill_random(g.value(), seed, 0.0156f).ok());
    ASSERT_TRUE(cpu_->fill_random(c.value(), seed, 0.0156f).ok());
    // The device draws the same uniform_at values and rounds each once to bf16.
    EXPECT_EQ(fetch(*gpu_, g.value()), round_bf16(fetch(*cpu_, c.value())));
    auto dst = gpu_->alloc({n}, DType::kBF16);
    ASSERT_TRUE(dst.ok());
    ASSERT_TRUE(gpu_->copy(g.value(), dst.value()).ok());
    EXPECT_EQ(fetch(*gpu_, dst.value()), fetch(*gpu_, g.value()));
  }
  // A tensor-parallel slice's window (rows and columns of a larger matrix): the CPU's values.
  for (const Backend::RandomWindow w : {Backend::RandomWindow{1037, 3, 0},
                                        Backend::RandomWindow{1037, 0, 500},
                                        Backend::RandomWindow{4099, 17, 1111}}) {
    auto g = gpu_->alloc({19, 37}, DType::kBF16);
    auto c = cpu_->alloc({19, 37}, DType::kF32);
    ASSERT_TRUE(g.ok() && c.ok());
    ASSERT_TRUE(gpu_->fill_random(g.value(), 77, 0.5f, w).ok());
    ASSERT_TRUE(cpu_->fill_random(c.value(), 77, 0.5f, w).ok());
    EXPECT_EQ(fetch(*gpu_, g.value()), round_bf16(fetch(*cpu_, c.value()))) << w.col0;
  }
  // convert: fp32 -> bf16 rounds once; bf16 -> fp32 is exact.
  const auto f = random_vector(769, -3.f, 3.f, 9);
  Tensor src = gpu({769}, f, DType::kF32), half = gpu({769}, f), back = gpu({769}, f, DType::kF32);
  ASSERT_TRUE(gpu_->convert(src, half).ok());
  EXPECT_EQ(fetch(*gpu_, half), round_bf16(f));
  ASSERT_TRUE(gpu_->convert(half, back).ok());
  EXPECT_EQ(fetch(*gpu_, back), round_bf16(f));
  // Views: copying one row into the middle of another tensor touches only that row.
  const auto host = random_vector(7 * 37, -1.f, 1.f, 5);
  Tensor a = gpu({7, 37}, host), b = gpu({7, 37}, std::vector<float>(7 * 37, 0.f));
  Tensor dst = b.rows(3, 1);
  ASSERT_TRUE(gpu_->copy(a.rows(5, 1), dst).ok());
  const auto got = fetch(*gpu_, b);
  for (int r = 0; r < 7; ++r) {
    for (int c = 0; c < 37; ++c) {
      EXPECT_EQ(got[r * 37 + c], r == 3 ? round_bf16(host[5 * 37 + c]) : 0.f);
    }
  }
}

// ---- the layer ops ----------------------------------------------------------------------------

constexpr int64_t kRows[] = {1, 7, 37, 127, 769};

// FP8 KV rows: the CUDA backend's quantize_kv writes the CPU reference's bytes (scattered,
// a skipped row untouched, padding zeroed) from bf16 and fp32 values with outlier channels and
// an all-zero head, and dequantize_kv gives the CPU values rounded once to bf16.
TEST_F(CudaBackendTest, QuantizeAndDequantizeKvMatchCpu) {
  struct Shape {
    int kv_heads, head_dim;
  };
  // head_dim 64 and 128 aligned: 16 values a lane (301 x 1 x 128 ends in a part warp);
  // otherwise one warp an item: 32-256 and 40 4 values a lane (a lane idle, or looping over a
  // head of 256), 6 one value a lane (4 a lane needs a multiple of 4). The GPU dequantizer
  // takes multiples of 8 only, so head_dim 6 checks the bytes alone.
  for (const Shape s : {Shape{8, 128}, Shape{4, 64}, Shape{1, 128}, Shape{3, 32}, Shape{2, 256},
                        Shape{3, 40}, Shape{2, 6}}) {
    SCOPED_TRACE(std::to_string(s.kv_heads) + " heads x " + std::to_string(s.head_dim));
    const int64_t rows = 301, width = int64_t{s.kv_heads} * s.head_dim;
    const int64_t row_bytes = kernels::kv_fp8_row_bytes(s.kv_heads, s.head_dim);
    std::vector<float> x = round_bf16(random_vector(size_t(rows * width), -4.f, 4.f, 5));
    for (int64_t r = 0; r < rows; ++r) x[size_t(r * width + 5)] = round_bf16(300.f + r);
    for (int64_t c = 0; c < s.head_dim; ++c) x[size_t(7 * width + c)] = 0.f;  // a zero head
    std::vector<int32_t> dst(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) dst[size_t(r)] = r == 11 ? -1 : int32_t(rows - 1 - r);
    std::vector<uint8_t> want(size_t(rows * row_bytes), 0x5a);
    kernels::quantize_kv_cpu(x.data(), rows, s.kv_heads, s.head_dim, dst.data(), want.data());

    auto pool = gpu_->alloc({rows, row_bytes}, DType::kFP8E4M3);
    ASSERT_TRUE(pool.ok()) << pool.message();
    auto table = gpu_->alloc({rows}, DType::kI32);
    ASSERT_TRUE(table.ok());
    ASSERT_TRUE(gpu_->upload(dst.data(), DType::kI32, table.value()).ok());
    std::vector<float> rows_back;
    ASSERT_TRUE(gpu_->download(table.value(), rows_back).ok());
    EXPECT_EQ(rows_back, std::vector<float>(dst.begin(), dst.end())) << "i32 round trip";
    // The same bytes from bf16 and fp32 values (16 values a lane at head_dim 64 and 128), and
    // from bf16 values one element past a 16-byte boundary (the one-warp-an-item kernel).
    std::vector<float> shifted(x.size() + 1, 0.f);
    std::copy(x.begin(), x.end(), shifted.begin() + 1);
    Tensor padded = gpu({int64_t(shifted.size())}, shifted);
    Tensor unaligned = padded;
    unaligned.data = static_cast<char*>(padded.data) + 2;  // one bf16 in
    unaligned.shape = {rows, width};
    const std::pair<const char*, Tensor> sources[] = {
        {"bf16", gpu({rows, width}, x)},
        {"fp32", gpu({rows, width}, x, DType::kF32)},
        {"bf16 one element past 16 bytes", unaligned}};
    for (const auto& [name, src] : sources) {
      SCOPED_TRACE(name);
      ASSERT_EQ(cudaMemset(pool.value().data, 0x5a, size_t(rows * row_bytes)), cudaSuccess);
      Status st = gpu_->quantize_kv(src, s.kv_heads, table.value().as<int32_t>(), pool.value());
      ASSERT_TRUE(st.ok()) << st.message();
      ASSERT_TRUE(gpu_->synchronize().ok());
      std::vector<uint8_t> got(want.size());
      ASSERT_EQ(cudaMemcpy(got.data(), pool.value().data, got.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
      EXPECT_EQ(differ, 0u) << "bytes differ from quantize_kv_cpu";
    }
    if (s.head_dim % 8 != 0) continue;

    std::vector<float> values(size_t(rows * width));
    kernels::dequantize_kv_cpu(want.data(), rows, s.kv_heads, s.head_dim, values.data());
    auto back = gpu_->alloc({rows, width}, DType::kBF16);
    ASSERT_TRUE(back.ok());
    Status st = gpu_->dequantize_kv(pool.value(), s.kv_heads, back.value());
    ASSERT_TRUE(st.ok()) << st.message();
    const std::vector<float> dq = fetch(*gpu_, back.value());
    size_t off = 0;
    for (int64_t r = 0; r < rows; ++r) {
      if (r == int64_t{rows - 1 - 11}) continue;  // the skipped row's pool row: 0x5a bytes
      for (int64_t c = 0; c < width; ++c) {
        const size_t i = size_t(r * width + c);
        off += !(dq[i] == round_bf16(values[i]));
      }
    }
    EXPECT_EQ(off, 0u) << "dequantized values differ from the CPU's rounded to bf16";
    // Mismatched widths are refused with the shapes named.
    auto narrow = gpu_->alloc({rows, width / 2}, DType::kBF16);
    st = gpu_->dequantize_kv(pool.value(), s.kv_heads, narrow.value());
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("dequantize_kv"), std::string::npos) << st.message();
  }
}

TEST_F(CudaBackendTest, EmbeddingIsExact) {
  const int64_t vocab = 1001, dim = 200;
  const auto table = round_bf16(random_vector(vocab * dim, -1.f, 1.f, 1));
  Tensor gt = gpu({vocab, dim}, table);
  Tensor ct = cpu({vocab, dim}, table);
  for (int64_t rows : kRows) {
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) ids[r] = static_cast<int32_t>((r * 7919 + 13) % vocab);
    ids[0] = static_cast<int32_t>(vocab - 1);
    auto go = gpu_->alloc({rows, dim}, DType::kBF16);
    auto co = cpu_->alloc({rows, dim}, DType::kF32);
    ASSERT_TRUE(gpu_->embedding(gt, ids, go.value()).ok());
    ASSERT_TRUE(cpu_->embedding(ct, ids, co.value()).ok());
    EXPECT_EQ(fetch(*gpu_, go.value()), fetch(*cpu_, co.value())) << "rows " << rows;
  }
  auto out = gpu_->alloc({1, dim}, DType::kBF16);
  const Status st = gpu_->embedding(gt, {static_cast<int32_t>(vocab)}, out.value());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("outside vocab"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.message();
}

TEST_F(CudaBackendTest, RmsNormSiluMulAdd) {
  for (int64_t dim : {100, 4096}) {
    for (int64_t rows : kRows) {
      const std::string what = std::to_string(rows) + "x" + std::to_string(dim);
      const size_t n = static_cast<size_t>(rows * dim);
      const auto x = round_bf16(random_vector(n, -2.f, 2.f, 11));
      const auto y = round_bf16(random_vector(n, -2.f, 2.f, 12));
      const auto w = round_bf16(random_vector(static_cast<size_t>(dim), 0.5f, 1.5f, 13));
      Tensor gx = gpu({rows, dim}, x), gy = gpu({rows, dim}, y), gw = gpu({dim}, w);
      Tensor cx = cpu({rows, dim}, x), cy = cpu({rows, dim}, y), cw = cpu({dim}, w);
      auto go = gpu_->alloc({rows, dim}, DType::kBF16);
      auto co = cpu_->alloc({rows, dim}, DType::kF32);

      ASSERT_TRUE(gpu_->rms_norm(gx, gw, 1e-5f, go.value()).ok());
      ASSERT_TRUE(cpu_->rms_norm(cx, cw, 1e-5f, co.value()).ok());
      expect_rule(fetch(*gpu_, go.value()), fetch(*cpu_, co.value()), {}, "rms_norm " + what);

      ASSERT_TRUE(gpu_->silu_mul(gx, gy, go.value()).ok());
      ASSERT_TRUE(cpu_->silu_mul(cx, cy, co.value()).ok());
      expect_rule(fetch(*gpu_, go.value()), fetch(*cpu_, co.value()), {}, "silu_mul " + what);

      ASSERT_TRUE(gpu_->add(gx, gy).ok());
      ASSERT_TRUE(cpu_->add(cx, cy).ok());
      expect_rule(fetch(*gpu_, gx), fetch(*cpu_, cx), {}, "add " + what);
    }
  }
}

TEST_F(CudaBackendTest, GemmMatchesCpuWithinAccumulationBound) {
  struct Shape { int64_t n, k; };
  for (Shape s : {Shape{37, 77}, Shape{1031, 4096}}) {
    for (int64_t m : kRows) {
      const std::string what = "m=" + std::to_string(m) + " n=" + std::to_string(s.n) +
                               " k=" + std::to_string(s.k);
      const auto x = round_bf16(random_vector(size_t(m * s.k), -1.f, 1.f, 21));
      const auto w = round_bf16(random_vector(size_t(s.n * s.k), -0.03f, 0.03f, 22));
      const auto old = round_bf16(random_vector(size_t(m * s.n), -1.f, 1.f, 23));
      std::vector<float> ax(x.size()), aw(w.size()), acc(size_t(m * s.n));
      for (size_t i = 0; i < x.size(); ++i) ax[i] = std::fabs(x[i]);
      for (size_t i = 0; i < w.size(); ++i) aw[i] = std::fabs(w[i]);
      kernels::gemm_cpu(ax.data(), aw.data(), acc.data(), m, s.n, s.k, false);
      for (float& a : acc) a *= static_cast<float>(s.k) * std::ldexp(1.f, -23);
      Tensor gx = gpu({m, s.k}, x), gw = gpu({s.n, s.k}, w);
      Tensor cx = cpu({m, s.k}, x), cw = cpu({s.n, s.k}, w);
      for (bool accumulate : {false, true}) {
        Tensor go = gpu({m, s.n}, old), co = cpu({m, s.n}, old);
        ASSERT_TRUE(gpu_->gemm(gx, gw, go, accumulate).ok());
        ASSERT_TRUE(cpu_->gemm(cx, cw, co, accumulate).ok());
        expect_rule(fetch(*gpu_, go), fetch(*cpu_, co), acc,
                    "gemm " + what + (accumulate ? " accumulate" : ""));
      }
    }
  }
  auto bad = gpu_->alloc({3, 5}, DType::kBF16);
  Tensor x = gpu({3, 4}, std::vector<float>(12, 1.f)), w = gpu({5, 3}, std::vector<float>(15));
  EXPECT_FALSE(gpu_->gemm(x, w, bad.value(), false).ok());
}

TEST_F(CudaBackendTest, RopeAbsolutePositionsAndReupload) {
  const int heads = 5, head_dim = 128;
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = std::pow(10000.f, -2.f * i / head_dim);
  }
  for (int64_t rows : kRows) {
    const int64_t width = int64_t{heads} * head_dim;
    std::vector<int64_t> pos_a(static_cast<size_t>(rows)), pos_b(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      pos_a[r] = 100000 + 3 * r;  // long-context positions: angles far beyond 2 pi
      pos_b[r] = (r * 7) % 41;    // not sorted
    }
    const auto x = round_bf16(random_vector(size_t(rows * width), -2.f, 2.f, 31));
    // The same positions twice (the backend reuses its device copy), then new ones of the
    // same length (it must notice and upload them).
    for (const auto* pos : {&pos_a, &pos_a, &pos_b}) {
      Tensor g = gpu({rows, width}, x), c = cpu({rows, width}, x);
      ASSERT_TRUE(gpu_->rope(g, heads, head_dim, *pos, inv_freq).ok());
      ASSERT_TRUE(cpu_->rope(c, heads, head_dim, *pos, inv_freq).ok());
      expect_rule(fetch(*gpu_, g), fetch(*cpu_, c), {}, "rope rows " + std::to_string(rows));
    }
  }
}

// A layer's q/k/v with RoPE at the projections' store (norm_project_rope: the decode step's one
// launch, rows <= 4; more rows take cuBLAS and the rope kernel) equals norm_project then rope_qk
// bit for bit, at long-context positions; v is not rotated.
TEST_F(CudaBackendTest, NormProjectRopeEqualsNormProjectThenRope) {
  const int heads = 6, kv_heads = 2, head_dim = 128;
  const int64_t k = 264;
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(10000.f, -2.f * i / head_dim);
  const auto w_norm = random_vector(size_t(k), 0.5f, 1.5f, 51);
  const auto wq = round_bf16(random_vector(size_t(heads * head_dim * k), -0.1f, 0.1f, 52));
  const auto wk = round_bf16(random_vector(size_t(kv_heads * head_dim * k), -0.1f, 0.1f, 53));
  const auto wv = round_bf16(random_vector(size_t(kv_heads * head_dim * k), -0.1f, 0.1f, 54));
  Tensor gn = gpu({k}, w_norm), gq_w = gpu({heads * head_dim, k}, wq);
  Tensor gk_w = gpu({kv_heads * head_dim, k}, wk), gv_w = gpu({kv_heads * head_dim, k}, wv);
  for (int64_t rows : {1, 3, 4, 7}) {
    const std::string what = "rows " + std::to_string(rows);
    const auto x = round_bf16(random_vector(size_t(rows * k), -1.f, 1.f, 55 + rows));
    std::vector<int64_t> pos(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pos[r] = 131072 + 977 * r;
    std::vector<float> apart_q, apart_k, apart_v, unrotated_q;  // norm_project, then rope_qk
    for (int fused = 0; fused < 2; ++fused) {
      Tensor gx = gpu({rows, k}, x), h = gpu({rows, k}, x);
      Tensor q = gpu({rows, heads * head_dim}, std::vector<float>(rows * heads * head_dim));
      Tensor kk = gpu({rows, kv_heads * head_dim}, std::vector<float>(rows * kv_heads * head_dim));
      Tensor v = gpu({rows, kv_heads * head_dim}, std::vector<float>(rows * kv_heads * head_dim));
      if (fused) {
        const Status st =
            gpu_->norm_project_rope(gx, {gn, 1e-5f, h}, {{gq_w, q}, {gk_w, kk}, {gv_w, v}},
                                    {heads, kv_heads, head_dim, pos, inv_freq});
        ASSERT_TRUE(st.ok()) << what << ": " << st.message();
      } else {
        Status st = gpu_->norm_project(gx, {gn, 1e-5f, h}, {{gq_w, q}, {gk_w, kk}, {gv_w, v}});
        ASSERT_TRUE(st.ok()) << what << ": " << st.message();
        unrotated_q = fetch(*gpu_, q);
        st = gpu_->rope_qk(q, heads, kk, kv_heads, head_dim, pos, inv_freq);
        ASSERT_TRUE(st.ok()) << what << ": " << st.message();
      }
      const std::vector<float> qv = fetch(*gpu_, q), kv = fetch(*gpu_, kk), vv = fetch(*gpu_, v);
      if (fused) {
        EXPECT_EQ(qv, apart_q) << what << " q";
        EXPECT_EQ(kv, apart_k) << what << " k";
        EXPECT_EQ(vv, apart_v) << what << " v";
        EXPECT_NE(qv, unrotated_q) << what << ": the rotation moved q";
      } else {
        apart_q = qv;
        apart_k = kv;
        apart_v = vv;
      }
    }
  }
  // Shapes that are not q and k of these heads: a clear error.
  Tensor gx = gpu({1, k}, std::vector<float>(k, 0.5f)), h = gpu({1, k}, std::vector<float>(k));
  Tensor q = gpu({1, heads * head_dim}, std::vector<float>(heads * head_dim));
  Tensor kk = gpu({1, kv_heads * head_dim}, std::vector<float>(kv_heads * head_dim));
  Tensor v = gpu({1, kv_heads * head_dim}, std::vector<float>(kv_heads * head_dim));
  const std::vector<int64_t> one{5};
  EXPECT_FALSE(gpu_->norm_project_rope(gx, {gn, 1e-5f, h}, {{gq_w, q}, {gk_w, kk}, {gv_w, v}},
                                       {heads + 1, kv_heads, head_dim, one, inv_freq})
                   .ok());
}

// The naive same-precision attention of the rule: fp32 scores, P rounded to bf16 before P.V,
// O rounded to bf16. q/k/v are packed and already bf16-rounded.
void attention_naive(const kernels::AttnParams& p, std::vector<float>& o, std::vector<float>& lse) {
  const auto* q = static_cast<const float*>(p.q);
  const auto* k = static_cast<const float*>(p.k);
  const auto* v = static_cast<const float*>(p.v);
  const int group = p.heads / p.kv_heads, d = p.head_dim;
  o.assign(size_t(p.n_q) * p.heads * d, 0.f);
  lse.assign(size_t(p.heads) * p.n_q, kNegInf);
  for (int h = 0; h < p.heads; ++h) {
    const int g = h / group;
    for (int i = 0; i < p.n_q; ++i) {
      const int64_t visible = std::clamp<int64_t>(p.q_start + i - p.kv_start + 1, 0, p.n_kv);
      if (visible == 0) continue;
      const float* qi = q + (int64_t{i} * p.heads + h) * d;
      std::vector<float> s(static_cast<size_t>(visible));
      float mx = kNegInf;
      for (int64_t j = 0; j < visible; ++j) {
        const float* kj = k + (j * p.kv_heads + g) * d;
        float dot = 0.f;
        for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
        s[j] = dot * p.scale;
        mx = std::max(mx, s[j]);
      }
      std::vector<float> acc(static_cast<size_t>(d), 0.f);
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) {
        const float pj = std::exp(s[j] - mx);
        sum += pj;
        const float pr = round_bf16(pj);
        const float* vj = v + (j * p.kv_heads + g) * d;
        for (int c = 0; c < d; ++c) acc[c] += pr * vj[c];
      }
      float* oi = o.data() + (int64_t{i} * p.heads + h) * d;
      for (int c = 0; c < d; ++c) oi[c] = round_bf16(acc[c] / sum);
      lse[size_t(h) * p.n_q + i] = mx + std::log(sum);
    }
  }
}

struct AttnErrors {
  double max_abs = 0, lse_max_abs = 0;
  int bad_empty = 0;
};

AttnErrors attn_errors(const std::vector<float>& o, const std::vector<float>& lse,
                       const std::vector<float>& ref_o, const std::vector<float>& ref_lse) {
  AttnErrors e;
  for (size_t r = 0; r < ref_lse.size(); ++r) {
    if (ref_lse[r] == kNegInf) {
      e.bad_empty += lse[r] != kNegInf;
    } else {
      e.lse_max_abs = std::max(e.lse_max_abs, std::fabs(double(lse[r]) - ref_lse[r]));
    }
  }
  for (size_t i = 0; i < ref_o.size(); ++i) {
    if (std::isnan(o[i])) {
      e.bad_empty++;
      continue;
    }
    e.max_abs = std::max(e.max_abs, std::fabs(double(o[i]) - ref_o[i]));
  }
  return e;
}

TEST_F(CudaBackendTest, AttentionPrefillDecodeGqaAndEmptyRows) {
  struct Case {
    int n_q, n_kv, heads, kv_heads, head_dim;
    int64_t q_start, kv_start;
  };
  std::vector<Case> cases;
  for (int n : {7, 37, 127, 769}) cases.push_back({n, 100 + n, 8, 2, 128, 100, 0});
  cases.push_back({37, 37, 4, 4, 64, 0, 0});
  cases.push_back({7, 9, 8, 2, 128, 0, 5});  // queries 0..4 see no key: empty rows
  for (int n_kv : {1, 37, 769, 4097}) cases.push_back({1, n_kv, 32, 8, 128, n_kv - 1, 0});
  for (const Case& c : cases) {
    const std::string what = "n_q=" + std::to_string(c.n_q) + " n_kv=" + std::to_string(c.n_kv) +
                             " heads=" + std::to_string(c.heads) + "/" +
                             std::to_string(c.kv_heads) + " d=" + std::to_string(c.head_dim);
    SCOPED_TRACE(what);
    const int64_t qw = int64_t{c.heads} * c.head_dim, kw = int64_t{c.kv_heads} * c.head_dim;
    const auto q = round_bf16(random_vector(size_t(c.n_q * qw), -2.f, 2.f, 41));
    const auto k = round_bf16(random_vector(size_t(c.n_kv * kw), -2.f, 2.f, 42));
    const auto v = round_bf16(random_vector(size_t(c.n_kv * kw), -1.f, 1.f, 43));
    kernels::AttnParams p;
    p.n_q = c.n_q;
    p.n_kv = c.n_kv;
    p.heads = c.heads;
    p.kv_heads = c.kv_heads;
    p.head_dim = c.head_dim;
    p.q_start = c.q_start;
    p.kv_start = c.kv_start;
    p.mask = kernels::MaskKind::kCausal;
    p.scale = 1.f / std::sqrt(float(c.head_dim));
    kernels::set_packed_strides(p);

    // Reference: the CPU backend in fp32, and the naive bf16 implementation.
    const AttnRefs ref = attention_refs(p, q, k, v);

    Tensor gq = gpu({c.n_q, qw}, q), gk = gpu({c.n_kv, kw}, k), gv = gpu({c.n_kv, kw}, v);
    auto go = gpu_->alloc({c.n_q, qw}, DType::kBF16);
    auto gl = gpu_->alloc({int64_t{c.heads} * c.n_q}, DType::kF32);
    kernels::AttnParams pg = p;
    pg.q = gq.data;
    pg.k = gk.data;
    pg.v = gv.data;
    pg.o = go.value().data;
    pg.lse = gl.value().as<float>();
    pg.dtype = DType::kBF16;
    const Status st = gpu_->attention(pg);
    ASSERT_TRUE(st.ok()) << st.message();

    const AttnErrors ours = attn_errors(fetch(*gpu_, go.value()), fetch(*gpu_, gl.value()),
                                        ref.o, ref.lse);
    const AttnErrors naive = attn_errors(ref.naive_o, ref.naive_lse, ref.o, ref.lse);
    EXPECT_EQ(ours.bad_empty, 0) << "empty rows must have lse -inf, no NaN";
    EXPECT_LE(ours.max_abs, 2 * naive.max_abs + 1e-6) << "naive " << naive.max_abs;
    // 1e-4 nats: a 1e-4 relative error in a merge weight, 40x below bf16 resolution.
    EXPECT_LE(ours.lse_max_abs, 2 * naive.lse_max_abs + 1e-4) << "naive " << naive.lse_max_abs;
    if (c.kv_start > c.q_start) {
      const auto o = fetch(*gpu_, go.value());
      for (int64_t i = 0; i < (c.kv_start - c.q_start) * qw; ++i) ASSERT_EQ(o[i], 0.f);
    }
  }
}

TEST_F(CudaBackendTest, AttentionRejectsUnsupportedHeadDimClearly) {
  const int heads = 6, kv_heads = 2, d = 16, n = 7;
  Tensor q = gpu({n, heads * d}, std::vector<float>(n * heads * d, 0.1f));
  Tensor k = gpu({n, kv_heads * d}, std::vector<float>(n * kv_heads * d, 0.1f));
  auto o = gpu_->alloc({n, heads * d}, DType::kBF16);
  auto lse = gpu_->alloc({heads * n}, DType::kF32);
  kernels::AttnParams p;
  p.q = q.data;
  p.k = p.v = k.data;
  p.o = o.value().data;
  p.lse = lse.value().as<float>();
  p.n_q = p.n_kv = n;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = d;
  p.scale = 0.25f;
  p.dtype = DType::kBF16;
  kernels::set_packed_strides(p);
  const Status st = gpu_->attention(p);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("head_dim 16 is not supported"), std::string::npos)
      << st.message();
  EXPECT_TRUE(gpu_->synchronize().ok()) << "a rejected call must not poison the device";
}

// Tuning::prefill_kernel (BURST_ATTN_KERNEL) picks the backend's prefill kernel: sm80 (what an
// A100 runs; forced on Hopper to rehearse an A100 deployment) or auto. The backend's launch
// must give the bits of the kernel it names, launched directly on the same buffers; any other
// value of the variable fails at Tuning::from_env.
TEST_F(CudaBackendTest, PrefillKernelFromTheTuning) {
  struct EnvGuard {
    std::string old;
    bool had;
    EnvGuard() {
      const char* v = std::getenv("BURST_ATTN_KERNEL");
      had = v != nullptr;
      if (had) old = v;
    }
    ~EnvGuard() {
      if (had) setenv("BURST_ATTN_KERNEL", old.c_str(), 1);
      else unsetenv("BURST_ATTN_KERNEL");
    }
  } guard;
  setenv("BURST_ATTN_KERNEL", "sm100", 1);
  auto bad = engine::Tuning::from_env();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("BURST_ATTN_KERNEL must be auto or sm80, got 'sm100'"),
            std::string::npos)
      << bad.message();

  const int n_q = 769, n_kv = 869, heads = 8, kv_heads = 2, d = 128;
  const auto q = round_bf16(random_vector(size_t(n_q) * heads * d, -2.f, 2.f, 51));
  const auto k = round_bf16(random_vector(size_t(n_kv) * kv_heads * d, -2.f, 2.f, 52));
  const auto v = round_bf16(random_vector(size_t(n_kv) * kv_heads * d, -1.f, 1.f, 53));
  const std::pair<const char*, kernels::AttnKernel> modes[] = {
      {"sm80", kernels::AttnKernel::kSm80}, {"auto", kernels::AttnKernel::kAuto}};
  for (const auto& [name, kernel] : modes) {
    SCOPED_TRACE(name);
    setenv("BURST_ATTN_KERNEL", name, 1);
    auto tuning = engine::Tuning::from_env();
    ASSERT_TRUE(tuning.ok()) << tuning.message();
    auto made = engine::make_cuda_backend(0, tuning.value());
    ASSERT_TRUE(made.ok()) << made.message();
    std::unique_ptr<Backend> b = made.take();
    auto upload = [&](std::vector<int64_t> shape, const std::vector<float>& host) {
      return make(*b, std::move(shape), host, DType::kBF16);
    };
    Tensor gq = upload({n_q, heads * d}, q), gk = upload({n_kv, kv_heads * d}, k),
           gv = upload({n_kv, kv_heads * d}, v);
    auto o_backend = b->alloc({n_q, heads * d}, DType::kF32);
    auto o_direct = b->alloc({n_q, heads * d}, DType::kF32);
    auto lse_backend = b->alloc({heads * n_q}, DType::kF32);
    auto lse_direct = b->alloc({heads * n_q}, DType::kF32);
    ASSERT_TRUE(o_backend.ok() && o_direct.ok() && lse_backend.ok() && lse_direct.ok());
    kernels::AttnParams p;
    p.q = gq.data;
    p.k = gk.data;
    p.v = gv.data;
    p.n_q = n_q;
    p.n_kv = n_kv;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.head_dim = d;
    p.q_start = n_kv - n_q;  // a chunk after a prefix, as chunked prefill launches it
    p.mask = kernels::MaskKind::kCausal;
    p.scale = 1.f / std::sqrt(float(d));
    p.dtype = DType::kBF16;
    p.o_dtype = DType::kF32;  // a ring step's fp32 O
    kernels::set_packed_strides(p);
    kernels::AttnParams pb = p, pd = p;
    pb.o = o_backend.value().data;
    pb.lse = lse_backend.value().as<float>();
    pd.o = o_direct.value().data;
    pd.lse = lse_direct.value().as<float>();
    const Status st = b->attention(pb);
    ASSERT_TRUE(st.ok()) << st.message();
    auto streams = engine::cuda_streams(*b);
    ASSERT_TRUE(streams.ok()) << streams.message();
    ASSERT_EQ(kernels::attention_cuda(pd, streams.value().compute, kernel), cudaSuccess);
    const auto ob = fetch(*b, o_backend.value()), od = fetch(*b, o_direct.value());
    const auto lb = fetch(*b, lse_backend.value()), ld = fetch(*b, lse_direct.value());
    ASSERT_EQ(ob.size(), od.size());
    EXPECT_EQ(std::memcmp(ob.data(), od.data(), ob.size() * sizeof(float)), 0)
        << "the backend's O differs from the " << name << " kernel's";
    EXPECT_EQ(std::memcmp(lb.data(), ld.data(), lb.size() * sizeof(float)), 0)
        << "the backend's LSE differs from the " << name << " kernel's";
    // And the answer is attention: within the 2x-naive rule of the fp32 reference.
    const AttnRefs ref = attention_refs(p, q, k, v);
    const AttnErrors ours = attn_errors(ob, lb, ref.o, ref.lse);
    const AttnErrors naive = attn_errors(ref.naive_o, ref.naive_lse, ref.o, ref.lse);
    EXPECT_LE(ours.max_abs, 2 * naive.max_abs + 1e-6) << "naive " << naive.max_abs;
    EXPECT_LE(ours.lse_max_abs, 2 * naive.lse_max_abs + 1e-4) << "naive " << naive.lse_max_abs;
  }
}

TEST_F(CudaBackendTest, MergeMatchesCpu) {
  const int heads = 8, d = 128;
  for (int rows : {1, 7, 37, 127, 769}) {
    const size_t on = size_t(rows) * heads * d, ln = size_t(heads) * rows;
    const auto oa = random_vector(on, -1.f, 1.f, 51), ob = random_vector(on, -1.f, 1.f, 52);
    auto la = random_vector(ln, -5.f, 5.f, 53), lb = random_vector(ln, -5.f, 5.f, 54);
    // Empty sides: a -inf b finite, a finite b -inf, and both -inf.
    la[0] = kNegInf;
    if (ln > 1) lb[1] = kNegInf;
    if (ln > 2) la[2] = lb[2] = kNegInf;
    Tensor goa = gpu({int64_t(on)}, oa, DType::kF32), gob = gpu({int64_t(on)}, ob, DType::kF32);
    Tensor gla = gpu({int64_t(ln)}, la, DType::kF32), glb = gpu({int64_t(ln)}, lb, DType::kF32);
    Tensor coa = cpu({int64_t(on)}, oa), cob = cpu({int64_t(on)}, ob);
    Tensor cla = cpu({int64_t(ln)}, la), clb = cpu({int64_t(ln)}, lb);
    kernels::MergeParams p;
    p.rows = rows;
    p.heads = heads;
    p.head_dim = d;
    p.o_row_stride = int64_t{heads} * d;
    p.o_head_stride = d;
    p.lse_head_stride = rows;
    kernels::MergeParams pg = p, pc = p;
    pg.o_a = goa.as<float>();
    pg.lse_a = gla.as<float>();
    pg.o_b = gob.as<float>();
    pg.lse_b = glb.as<float>();
    pc.o_a = coa.as<float>();
    pc.lse_a = cla.as<float>();
    pc.o_b = cob.as<float>();
    pc.lse_b = clb.as<float>();
    ASSERT_TRUE(gpu_->merge(pg).ok());
    ASSERT_TRUE(cpu_->merge(pc).ok());
    // Both fp32: only exp/log1p implementations differ (a few ulps).
    const auto go = fetch(*gpu_, goa), co = fetch(*cpu_, coa);
    const auto gl = fetch(*gpu_, gla), cl = fetch(*cpu_, cla);
    for (size_t i = 0; i < on; ++i) {
      ASSERT_NEAR(go[i], co[i], 1e-5 * std::fabs(co[i]) + 1e-6) << "o " << i << " rows " << rows;
    }
    for (size_t i = 0; i < ln; ++i) {
      if (cl[i] == kNegInf) {
        ASSERT_EQ(gl[i], kNegInf) << i;
      } else {
        ASSERT_NEAR(gl[i], cl[i], 1e-5 * std::fabs(cl[i]) + 1e-6) << "lse " << i;
      }
    }
    // The out form (the decode's last rank merge): merged o written as bf16 straight into out
    // gives the bits of the in-place merge followed by a conversion, and the same LSE.
    Tensor goa2 = gpu({int64_t(on)}, oa, DType::kF32), gla2 = gpu({int64_t(ln)}, la, DType::kF32);
    auto out = gpu_->alloc({rows, int64_t{heads} * d}, DType::kBF16);
    ASSERT_TRUE(out.ok());
    Tensor got = out.take();
    kernels::MergeParams po = pg;
    po.o_a = goa2.as<float>();
    po.lse_a = gla2.as<float>();
    po.out = got.data;
    po.out_dtype = DType::kBF16;
    po.out_row_stride = int64_t{heads} * d;
    ASSERT_TRUE(gpu_->merge(po).ok());
    auto conv = gpu_->alloc({rows, int64_t{heads} * d}, DType::kBF16);
    ASSERT_TRUE(conv.ok());
    Tensor want = conv.take();
    Tensor merged = goa;
    merged.shape = {rows, int64_t{heads} * d};
    ASSERT_TRUE(gpu_->convert(merged, want).ok());
    ASSERT_EQ(fetch(*gpu_, got), fetch(*gpu_, want)) << "out form, rows " << rows;
    ASSERT_EQ(fetch(*gpu_, gla2), gl) << "out form lse, rows " << rows;
    ASSERT_EQ(fetch(*gpu_, goa2), oa) << "out form left o_a alone, rows " << rows;
  }
}

// ---- errors, memory plan, streams -------------------------------------------------------------

// Backend::sample: on the same logits (bf16 values, so both backends see the same numbers)
// and the same uniforms (seeded Samplers' draw_uniform), the CUDA backend draws the CPU
// backend's ids: rows of mixed settings in one call (greedy rows among them, one with a top_k
// it must ignore), one setting for every row (the scalar call) and all-greedy rows (the argmax
// kernel), from bf16 and fp32 logits, at vocab 1, 7, 4099 and 32000.
TEST_F(CudaBackendTest, SampleEqualsCpuForMixedRows) {
  using engine::SamplingParams;
  const std::vector<SamplingParams> mixed = {
      {0.f, 0, 1.f, 1},   {0.7f, 0, 1.f, 2}, {1.3f, 40, 1.f, 3}, {0.8f, 0, 0.9f, 4},
      {1.f, 5, 0.5f, 5},  {0.f, 3, 0.5f, 6}, {0.7f, 0, 1.f, 7}};
  const std::vector<SamplingParams> same(5, SamplingParams{0.9f, 0, 0.95f, 8});
  const std::vector<SamplingParams> greedy = {{0.f, 0, 1.f, 0}, {0.f, 7, 0.3f, 0}};
  const std::pair<const char*, const std::vector<SamplingParams>*> sets[] = {
      {"mixed", &mixed}, {"same", &same}, {"greedy", &greedy}};
  uint32_t seed = 1;
  for (const auto& [set_name, settings] : sets) {
    const auto rows = static_cast<int64_t>(settings->size());
    for (int64_t vocab : {1, 7, 4099, 32000}) {
      for (DType dt : {DType::kBF16, DType::kF32}) {
        std::vector<engine::Sampler> streams;
        for (const SamplingParams& p : *settings) streams.emplace_back(p);
        int differ = 0;
        std::vector<int32_t> first;
        for (int step = 0; step < 12; ++step) {
          const auto host = round_bf16(
              random_vector(static_cast<size_t>(rows * vocab), -8.f, 8.f, seed++));
          const Tensor c = cpu({rows, vocab}, host);
          const Tensor g = gpu({rows, vocab}, host, dt);
          std::vector<double> u;
          for (engine::Sampler& s : streams) u.push_back(s.draw_uniform());
          std::vector<int32_t> want, got;
          Status st = cpu_->sample(c, *settings, u, want);
          ASSERT_TRUE(st.ok()) << st.message();
          st = gpu_->sample(g, *settings, u, got);
          ASSERT_TRUE(st.ok()) << st.message();
          EXPECT_EQ(got, want) << set_name << " vocab " << vocab << " "
                               << engine::dtype_name(dt) << " step " << step;
          if (step == 0) first = got;
          differ += got != first;
        }
        if (vocab > 1) {
          EXPECT_GT(differ, 0) << set_name << ": random logits give varied ids";
        }
      }
    }
  }
  // Refused: a row count that is not the logits', invalid settings, fp16 logits.
  const Tensor g = gpu({2, 8}, std::vector<float>(16, 1.f));
  std::vector<int32_t> ids;
  EXPECT_FALSE(gpu_->sample(g, {mixed[0]}, {0.5}, ids).ok());
  EXPECT_FALSE(gpu_->sample(g, {mixed[0], {1.f, -1, 1.f, 0}}, {0.5, 0.5}, ids).ok());
  const Tensor h = gpu({2, 8}, std::vector<float>(16, 1.f), DType::kF16);
  EXPECT_FALSE(gpu_->sample(h, {mixed[1], mixed[1]}, {0.5, 0.5}, ids).ok());
}

// The CUDA backend's queued draws (two pinned slots, an event each): taken in order behind the
// next queued draw, equal to the CPU backend's sample(), the next draw's uniforms written while
// the one before is still queued; embedding() reads a queued draw's ids on the device at once.
TEST_F(CudaBackendTest, QueuedDrawsComeBackInOrderAndEqualTheCpu) {
  testing::check_queued_draws(*gpu_, *cpu_, DType::kBF16);
}

// Backend::embedding's DrawnId {row, k} on the GPU: the k-th id the last sample() drew, read on
// the device (the same rows as the ids themselves give), or ids another rank's broadcast put
// into drawn_ids()'s room; a k beyond the count is refused.
TEST_F(CudaBackendTest, EmbeddingReadsTheIdsTheLastSampleDrew) {
  constexpr int64_t kVocab = 97, kDim = 64;
  const std::vector<float> table_host = random_vector(size_t(kVocab * kDim), -1.f, 1.f, 91);
  const Tensor table = gpu({kVocab, kDim}, table_host);
  std::vector<float> l(size_t(2 * kVocab), 0.f);
  l[41] = 3.f;
  l[kVocab + 88] = 3.f;
  const Tensor logits = gpu({2, kVocab}, l, DType::kF32);
  const engine::SamplingParams greedy{0.f, 0, 1.f, 0};
  std::vector<int32_t> ids;
  ASSERT_TRUE(gpu_->sample(logits, {greedy, greedy}, {0.0, 0.0}, ids).ok());
  ASSERT_EQ(ids, (std::vector<int32_t>{41, 88}));
  auto rows_of = [&](const std::vector<int32_t>& in,
                     const std::vector<Backend::DrawnId>& drawn = {}) {
    Tensor out = gpu({static_cast<int64_t>(in.size()), kDim},
                     std::vector<float>(in.size() * kDim, 0.f));
    const Status st = gpu_->embedding(table, in, drawn, out);
    EXPECT_TRUE(st.ok()) << st.message();
    return fetch(*gpu_, out);
  };
  EXPECT_EQ(rows_of({0, 5, 0}, {{0, 1}, {2, 0}}), rows_of({88, 5, 41}));
  void* where = nullptr;
  ASSERT_TRUE(gpu_->drawn_ids(3, &where).ok());
  const int32_t theirs[3] = {7, 0, 96};
  ASSERT_EQ(cudaMemcpy(where, theirs, sizeof theirs, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(rows_of({-1, 0, 9}, {{0, 2}, {1, 0}}), rows_of({96, 7, 9}));
  Tensor one = gpu({1, kDim}, std::vector<float>(kDim, 0.f));
  const Status beyond = gpu_->embedding(table, {0}, {{0, 3}}, one);
  ASSERT_FALSE(beyond.ok());
  EXPECT_NE(beyond.message().find("drawn ids: 3"), std::string::npos) << beyond.message();
}

TEST_F(CudaBackendTest, OutOfMemoryIsAClearError) {
  // 2^40 bf16 elements (2 TiB): no GPU holds it.
  auto t = gpu_->alloc({int64_t{1} << 20, int64_t{1} << 20}, DType::kBF16);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.message().find("out of GPU memory"), std::string::npos) << t.message();
  EXPECT_NE(t.message().find("needs 2048.00 GiB"), std::string::npos) << t.message();
  EXPECT_NE(t.message().find("GiB free on cuda:0"), std::string::npos) << t.message();
  // The failure is not sticky: the backend keeps working.
  auto small = gpu_->alloc({7}, DType::kBF16);
  EXPECT_TRUE(small.ok()) << small.message();
  EXPECT_TRUE(gpu_->synchronize().ok());

  auto info = engine::cuda_memory_info(*gpu_);
  ASSERT_TRUE(info.ok()) << info.message();
  EXPECT_GT(info.value().total, 0);
  EXPECT_GT(info.value().free, 0);
  EXPECT_GE(info.value().held, 256);
  EXPECT_TRUE(engine::cuda_check_fits(*gpu_, 1 << 20, "1 MiB").ok());
  const Status big = engine::cuda_check_fits(*gpu_, info.value().total, "the whole GPU");
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.message().find("the whole GPU needs"), std::string::npos) << big.message();
  EXPECT_FALSE(engine::cuda_check_fits(*cpu_, 1, "x").ok());

  // A KV cache that cannot fit fails with the cache named and the sizes in the message.
  auto cache = engine::PagedKvCache::create(*gpu_, {2, 32, 32, 128}, 625000, 16);
  ASSERT_FALSE(cache.ok());
  EXPECT_NE(cache.message().find("KV cache of 10000000 tokens needs"), std::string::npos)
      << cache.message();
  EXPECT_NE(cache.message().find("GiB free on cuda:0"), std::string::npos) << cache.message();
  std::printf("[ info     ] %s\n", cache.message().c_str());
}

TEST_F(CudaBackendTest, StreamsAndForeignTensors) {
  auto s = engine::cuda_streams(*gpu_);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(s.value().device, 0);
  EXPECT_NE(s.value().compute, nullptr);
  EXPECT_FALSE(engine::cuda_streams(*cpu_).ok());
  // A host tensor handed to a CUDA op is refused, not dereferenced on the device.
  Tensor host = cpu({4, 4}, std::vector<float>(16, 1.f));
  Tensor dev = gpu({4, 4}, std::vector<float>(16, 1.f));
  const Status st = gpu_->add(dev, host);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("not CUDA memory"), std::string::npos) << st.message();
  EXPECT_EQ(gpu_->name(), "cuda:0");
  EXPECT_EQ(gpu_->compute_dtype(), DType::kBF16);
  EXPECT_FALSE(engine::make_cuda_backend(4096).ok());
}

// ---- models -----------------------------------------------------------------------------------

TEST_F(CudaBackendTest, FixtureWithHeadDim16FailsClearly) {
  for (const char* name : {"odd-linear", "odd-dynamic"}) {
    const std::string dir = kRoot + "/tests/fixtures/golden/" + name + "/model";
    auto model = models::LlamaModel::load(*gpu_, dir);
    ASSERT_TRUE(model.ok()) << model.message();  // loading is fine; attention is what cannot run
    auto cache = OneRank::create(*model.value(), 16);
    ASSERT_TRUE(cache.ok()) << cache.message();
    std::vector<float> logits;
    const Status st = forward_logits(*model.value(), {1, 5, 9}, {0, 1, 2}, cache.value(), {2},
                                     logits);
    ASSERT_FALSE(st.ok()) << name;
    EXPECT_NE(st.message().find("head_dim 16 is not supported"), std::string::npos)
        << st.message();
  }
}

// Greedy continuation from a prompt: the prompt's forward, then one token at a time. Returns
// the tokens and, per step, the logits that chose them.
Status greedy(models::LlamaModel& m, const std::vector<int32_t>& prompt, int steps,
              std::vector<int32_t>& tokens, std::vector<std::vector<float>>& step_logits) {
  auto cache = OneRank::create(m, static_cast<int64_t>(prompt.size()) + steps);
  if (!cache.ok()) return cache.status();
  std::vector<int64_t> pos(prompt.size());
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<int32_t> ids = prompt;
  for (int s = 0; s < steps; ++s) {
    std::vector<float> logits;
    BURST_RETURN_IF_ERROR(forward_logits(m, ids, pos, cache.value(),
                                         {static_cast<int64_t>(ids.size()) - 1}, logits));
    const auto best = std::max_element(logits.begin(), logits.end()) - logits.begin();
    tokens.push_back(static_cast<int32_t>(best));
    step_logits.push_back(std::move(logits));
    const int64_t next = pos.back() + 1;
    ids = {static_cast<int32_t>(best)};
    pos = {next};
  }
  return {};
}

// Logits of every step when `tokens` are fed one at a time after the prompt (teacher forcing).
Status forced(models::LlamaModel& m, const std::vector<int32_t>& prompt,
              const std::vector<int32_t>& tokens, std::vector<std::vector<float>>& step_logits) {
  auto cache = OneRank::create(m, static_cast<int64_t>(prompt.size() + tokens.size()));
  if (!cache.ok()) return cache.status();
  std::vector<int64_t> pos(prompt.size());
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<int32_t> ids = prompt;
  for (size_t s = 0; s < tokens.size(); ++s) {
    std::vector<float> logits;
    BURST_RETURN_IF_ERROR(forward_logits(m, ids, pos, cache.value(),
                                         {static_cast<int64_t>(ids.size()) - 1}, logits));
    step_logits.push_back(std::move(logits));
    const int64_t next = pos.back() + 1;
    ids = {tokens[s]};
    pos = {next};
  }
  return {};
}

// The tiny model on CUDA (bf16 activations) against the CPU engine (fp32), teacher-forced on
// the CPU's greedy continuation so that one flip cannot hide later errors. At every step the
// logits must agree within the bf16 bound (2 % of max |logit|; the 7B-shape test measures
// 0.8 %), and CUDA's argmax must be the CPU's unless the CPU's own margin between the two
// tokens is within twice the difference observed at that step: a near-tie that bf16 rounding
// legitimately flips (seen once at step 6 of this prompt on an H200), not an engine error.
TEST_F(CudaBackendTest, KjvTinyGreedyMatchesCpu) {
  const std::string dir = kRoot + "/models/kjv-tiny";
  if (!fs::exists(dir + "/config.json")) {
    GTEST_SKIP() << "skipping: " << dir << "/config.json is absent (the model is not trained "
                 << "yet)";
  }
  auto tok = server::Tokenizer::load(dir + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.message();
  auto ids = tok.value()->encode("In the beginning God created", true, false);
  ASSERT_TRUE(ids.ok()) << ids.message();
  const std::vector<int32_t> prompt(ids.value().begin(), ids.value().end());
  auto on_cpu = models::LlamaModel::load(*cpu_, dir);
  auto on_gpu = models::LlamaModel::load(*gpu_, dir);
  ASSERT_TRUE(on_cpu.ok() && on_gpu.ok()) << on_cpu.message() << on_gpu.message();
  constexpr int kSteps = 24;
  std::vector<int32_t> want;
  std::vector<std::vector<float>> cpu_logits, gpu_logits;
  ASSERT_TRUE(greedy(*on_cpu.value(), prompt, kSteps, want, cpu_logits).ok());
  const Status st = forced(*on_gpu.value(), prompt, want, gpu_logits);
  ASSERT_TRUE(st.ok()) << st.message();
  int flips = 0;
  for (int s = 0; s < kSteps; ++s) {
    const auto& c = cpu_logits[s];
    const auto& g = gpu_logits[s];
    double diff = 0, mx = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      diff = std::max(diff, std::fabs(double(g[i]) - c[i]));
      mx = std::max(mx, std::fabs(double(c[i])));
    }
    EXPECT_LE(diff, 0.02 * mx) << "step " << s << ": logits beyond the bf16 bound";
    const auto g_best = std::max_element(g.begin(), g.end()) - g.begin();
    if (g_best == want[s]) continue;
    ++flips;
    const double margin = double(c[want[s]]) - c[g_best];
    std::printf("[ info     ] step %d: cuda picks %ld, cpu %d; cpu margin %.4f, |diff| %.4f\n", s,
                static_cast<long>(g_best), want[s], margin, diff);
    EXPECT_LE(margin, 2 * diff) << "step " << s << ": a flip the numerics do not explain";
  }
  EXPECT_LE(flips, 2) << "more near-ties than a 24-token continuation should have";
  std::vector<int32_t> got;
  std::vector<std::vector<float>> unused;
  ASSERT_TRUE(greedy(*on_gpu.value(), prompt, kSteps, got, unused).ok());
  std::printf("[ info     ] cpu  \"%s\"\n[ info     ] cuda \"%s\"\n",
              tok.value()->decode(std::vector<int>(want.begin(), want.end())).c_str(),
              tok.value()->decode(std::vector<int>(got.begin(), got.end())).c_str());
}

// runtime::generate (one-rank LocalStepRunner) draws every token on the device (no logits to
// the host): on the tiny model on CUDA, seeded, it gives the tokens of the path it replaced on the same GPU model (each
// step's logits downloaded, engine::Sampler on the host), greedy and sampled.
TEST_F(CudaBackendTest, KjvTinyGenerateOnDeviceEqualsHostSampler) {
  const std::string dir = kRoot + "/models/kjv-tiny";
  if (!fs::exists(dir + "/config.json")) GTEST_SKIP() << "skipping: no " << dir;
  auto model = models::LlamaModel::load(*gpu_, dir);
  ASSERT_TRUE(model.ok()) << model.message();
  models::LlamaModel& m = *model.value();
  const std::vector<int32_t> prompt = {1, 512, 4177, 1497, 29892, 2803, 727, 367, 6};
  const auto n = static_cast<int64_t>(prompt.size());
  constexpr int kTokens = 40;
  auto local = runtime::LocalStepRunner::create(m, n + kTokens + 1);
  ASSERT_TRUE(local.ok()) << local.message();
  for (const engine::SamplingParams& sp :
       {engine::SamplingParams{0.f, 0, 1.f, 0}, engine::SamplingParams{0.9f, 0, 0.95f, 42},
        engine::SamplingParams{1.2f, 50, 1.f, 7}}) {
    runtime::GenerateRequest req;
    req.prompt = prompt;
    req.max_tokens = kTokens;
    req.sampling = sp;
    req.stop_at_eos = false;
    std::vector<int32_t> got;
    auto stats = runtime::generate(*local.value(), req, [&](int32_t t) {
      got.push_back(t);
      return true;
    });
    ASSERT_TRUE(stats.ok()) << stats.message();
    // The host path, step by step, through the same runner and attention (the logits must be
    // the same bits: a sampled draw turns on them): asking for logprobs brings every sampled
    // row's logits to the host, where the sequence's engine::Sampler draws from them.
    std::vector<int32_t> want;
    constexpr uint64_t kSeq = 7;
    for (int64_t at = 0; static_cast<int>(want.size()) < kTokens; ++at) {
      runtime::StepPlan plan;
      plan.seqs.push_back(at == 0 ? runtime::prefill_work(kSeq, prompt, 0, n, sp)
                                  : runtime::decode_work(kSeq, want.back(), n + at - 1, n, sp));
      plan.seqs[0].logprobs = 0;
      auto r = local.value()->batch().step(plan);
      ASSERT_TRUE(r.ok()) << r.message();
      ASSERT_TRUE(r.value().tokens.at(0).has_logprob);
      want.push_back(r.value().tokens.at(0).token);
    }
    local.value()->batch().release(kSeq);
    EXPECT_EQ(got, want) << "temperature " << sp.temperature << " top_k " << sp.top_k
                         << " top_p " << sp.top_p;
  }
}

// ---- the 2-layer 7B-shape model: CUDA vs CPU (and the dump for hf_compare.py) ---------------

// The weights of LlamaModel::random, in its order and with its seed rule (models/llama.cpp):
// weight i is uniform_at(seed * 1000003 + i, element, 1 / sqrt(fan_in)), norms are 1. Written
// here as bf16 so that the CPU (fp32) and HF load exactly the values the CUDA backend holds.
struct NamedWeight {
  std::string name;
  std::vector<int64_t> shape;
  bool is_norm;
};

std::vector<NamedWeight> weight_list(const models::LlamaConfig& c) {
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  const int64_t qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  std::vector<NamedWeight> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, d}, false});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s.push_back({p + "input_layernorm.weight", {d}, true});
    s.push_back({p + "self_attn.q_proj.weight", {qd, d}, false});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, d}, false});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, d}, false});
    s.push_back({p + "self_attn.o_proj.weight", {d, qd}, false});
    s.push_back({p + "post_attention_layernorm.weight", {d}, true});
    s.push_back({p + "mlp.gate_proj.weight", {f, d}, false});
    s.push_back({p + "mlp.up_proj.weight", {f, d}, false});
    s.push_back({p + "mlp.down_proj.weight", {d, f}, false});
  }
  s.push_back({"model.norm.weight", {d}, true});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, d}, false});
  return s;
}

// config.json (HF LlamaConfig keys) and model.safetensors (bf16) of the random model.
void write_random_model(const std::string& dir, const models::LlamaConfig& c, uint64_t seed) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json")
      << "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
      << "  \"hidden_size\": " << c.hidden_size << ",\n  \"intermediate_size\": "
      << c.intermediate_size << ",\n  \"num_hidden_layers\": " << c.num_layers
      << ",\n  \"num_attention_heads\": " << c.num_heads << ",\n  \"num_key_value_heads\": "
      << c.num_kv_heads << ",\n  \"head_dim\": " << c.head_dim << ",\n  \"rms_norm_eps\": "
      << c.rms_norm_eps << ",\n  \"rope_theta\": " << c.rope_theta
      << ",\n  \"max_position_embeddings\": " << c.max_position_embeddings
      << ",\n  \"vocab_size\": " << c.vocab_size << ",\n  \"tie_word_embeddings\": "
      << (c.tie_word_embeddings ? "true" : "false")
      << ",\n  \"hidden_act\": \"silu\",\n  \"attention_bias\": false,\n  \"mlp_bias\": false,"
      << "\n  \"bos_token_id\": 1,\n  \"eos_token_id\": 2,\n  \"torch_dtype\": \"bfloat16\"\n}\n";
  const auto list = weight_list(c);
  std::ostringstream header;
  header << "{\"__metadata__\":{\"format\":\"pt\"}";
  int64_t offset = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : list[i].shape) n *= d;
    header << ",\"" << list[i].name << "\":{\"dtype\":\"BF16\",\"shape\":[";
    for (size_t j = 0; j < list[i].shape.size(); ++j) header << (j ? "," : "") << list[i].shape[j];
    header << "],\"data_offsets\":[" << offset << "," << offset + 2 * n << "]}";
    offset += 2 * n;
  }
  header << "}";
  std::string h = header.str();
  h.append((8 - h.size() % 8) % 8, ' ');  // 8-byte aligned data
  std::ofstream f(dir + "/model.safetensors", std::ios::binary);
  const uint64_t hlen = h.size();
  f.write(reinterpret_cast<const char*>(&hlen), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  std::vector<uint16_t> buf;
  uint64_t index = 0;
  for (const auto& w : list) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    const uint64_t wseed = seed * 1000003ull + index++;
    const float a = w.is_norm ? 1.f : 1.f / std::sqrt(static_cast<float>(w.shape.back()));
    buf.resize(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = engine::f32_to_bf16(w.is_norm ? a : engine::uniform_at(wseed, i, a));
    }
    f.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(n * 2));
  }
}

struct LogitErrors {
  double max_abs = 0, rel_l2 = 0, ref_max = 0;
};
LogitErrors logit_errors(const std::vector<float>& ours, const std::vector<float>& ref) {
  LogitErrors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(ours[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
    e.max_abs = std::max(e.max_abs, std::fabs(d));
    e.ref_max = std::max(e.ref_max, std::fabs(double(ref[i])));
  }
  e.rel_l2 = std::sqrt(num / den);
  return e;
}

TEST_F(CudaBackendTest, TwoLayer7bShapeMatchesCpu) {
  auto config = models::preset_config("7b");
  ASSERT_TRUE(config.ok());
  models::LlamaConfig c = config.value();
  c.num_layers = 2;
  constexpr uint64_t kSeed = 7;
  constexpr int kPromptTokens = 300;
  // BURST_HF_DIR keeps the model, prompt and logits for bench/gpu/hf_compare.py.
  const char* keep = std::getenv("BURST_HF_DIR");
  const std::string dir =
      keep ? std::string(keep) : (fs::temp_directory_path() / "burst-cuda-2layer-7b").string();
  write_random_model(dir, c, kSeed);

  std::vector<int32_t> ids = {1};
  for (int i = 1; i < kPromptTokens; ++i) {
    ids.push_back(259 + static_cast<int32_t>(engine::splitmix64(1000 + i) % (c.vocab_size - 259)));
  }
  std::vector<int64_t> pos(ids.size());
  std::iota(pos.begin(), pos.end(), 0);
  const std::vector<int64_t> last = {kPromptTokens - 1};
  auto run = [&](Backend& b, bool random, std::vector<float>& logits) {
    auto m = random ? models::LlamaModel::random(b, c, kSeed) : models::LlamaModel::load(b, dir);
    ASSERT_TRUE(m.ok()) << m.message();
    auto cache = OneRank::create(*m.value(), kPromptTokens);
    ASSERT_TRUE(cache.ok()) << cache.message();
    // Two forwards (250 + 50 tokens): the second is a prefill against cached keys.
    std::vector<int32_t> a(ids.begin(), ids.begin() + 250), z(ids.begin() + 250, ids.end());
    std::vector<int64_t> pa(pos.begin(), pos.begin() + 250), pz(pos.begin() + 250, pos.end());
    std::vector<float> unused;
    Status st = forward_logits(*m.value(), a, pa, cache.value(), {}, unused);
    ASSERT_TRUE(st.ok()) << st.message();
    st = forward_logits(*m.value(), z, pz, cache.value(), {49}, logits);
    ASSERT_TRUE(st.ok()) << st.message();
  };
  std::vector<float> ref, loaded, random;
  run(*cpu_, false, ref);
  run(*gpu_, false, loaded);
  run(*gpu_, true, random);
  ASSERT_EQ(ref.size(), size_t(c.vocab_size));
  ASSERT_EQ(loaded.size(), ref.size());
  ASSERT_EQ(random.size(), ref.size());
  // fill_random on the device gives exactly the bf16 weights written above: same logits.
  EXPECT_EQ(random, loaded) << "LlamaModel::random on CUDA differs from the bf16 weights";
  const LogitErrors e = logit_errors(loaded, ref);
  std::printf("[ info     ] 2-layer 7B shape, %d tokens: cuda vs cpu max abs %.4g, rel l2 %.4g, "
              "max |ref| %.4g\n", kPromptTokens, e.max_abs, e.rel_l2, e.ref_max);
  // bf16 activations carry 2^-9 relative rounding per stored value; about a dozen roundings
  // (norms, q/k/v, rope, attention, o, gate/up/silu, down, final norm, logits) lie on every
  // path to a logit, each a random 0-2^-9 error: ~sqrt(12) * 2^-9 ~ 0.7% in l2. 2% allows the
  // 2x of the rule with margin; bench/gpu/hf_compare.py holds us to 2x HF's own bf16 error.
  EXPECT_LT(e.rel_l2, 0.02);
  EXPECT_LT(e.max_abs, 0.05 * e.ref_max);
  if (keep) {
    std::ofstream(dir + "/prompt_ids.txt") << [&] {
      std::ostringstream os;
      for (int32_t id : ids) os << id << "\n";
      return os.str();
    }();
    std::ofstream(dir + "/logits_cuda.f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(loaded.data()), std::streamsize(loaded.size() * 4));
    std::ofstream(dir + "/logits_cpu.f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(ref.data()), std::streamsize(ref.size() * 4));
  } else {
    fs::remove_all(dir);
  }
}

// ---- prefill benchmark (bench/gpu/bench_prefill.sh) ----------------------------------------

std::vector<int64_t> parse_lengths(const char* text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// The lengths an opt-in benchmark was asked for ($var, comma separated, e.g. `example`), or
// nothing, with `skip` saying why it does not run (not asked, or no GPU).
std::optional<std::vector<int64_t>> bench_lengths(const char* var, const char* example,
                                                  std::string& skip) {
  const char* env = std::getenv(var);
  if (!env) {
    skip = std::string("benchmark: set ") + var + "=" + example + " to run";
    return std::nullopt;
  }
  std::string why;
  if (!have_gpu(why)) {
    skip = std::string("skipping ") + var + " benchmark: " + why;
    return std::nullopt;
  }
  return parse_lengths(env);
}

// What both opt-in benchmarks run on: the CUDA backend of device 0 and the 7B preset's shape.
struct Bench7b {
  std::unique_ptr<Backend> backend;
  models::LlamaConfig config;
};
void make_bench_7b(Bench7b& out) {
  auto tuning = engine::Tuning::from_env();  // BURST_PDL=0 etc., as in burst-worker
  ASSERT_TRUE(tuning.ok()) << tuning.message();
  auto backend = engine::make_cuda_backend(0, tuning.value());
  ASSERT_TRUE(backend.ok()) << backend.message();
  out.backend = backend.take();
  auto config = models::preset_config("7b");
  ASSERT_TRUE(config.ok()) << config.message();
  out.config = config.value();
}

// TTFT of the 7B preset (random weights, seed 0) on one GPU at the lengths in
// BURST_BENCH_PREFILL (comma separated): runtime::generate (one-rank LocalStepRunner) with
// max_tokens 1 and the prompt burst-generate --prompt-tokens N builds, one warm-up then BURST_BENCH_REPS (3) timed runs in
// one process; JSON lines to BURST_BENCH_OUT (or stdout). Skipped unless asked for.
TEST(CudaPrefillBench, Preset7b) {
  std::string skip;
  const auto asked = bench_lengths("BURST_BENCH_PREFILL", "4096,16384,...", skip);
  if (!asked) GTEST_SKIP() << skip;
  const std::vector<int64_t>& lengths = *asked;
  const int reps = std::getenv("BURST_BENCH_REPS") ? std::atoi(std::getenv("BURST_BENCH_REPS"))
                                                   : 3;
  const char* out_path = std::getenv("BURST_BENCH_OUT");
  FILE* out = out_path ? std::fopen(out_path, "w") : stdout;
  ASSERT_NE(out, nullptr);
  Bench7b bench;
  ASSERT_NO_FATAL_FAILURE(make_bench_7b(bench));
  Backend& b = *bench.backend;
  const models::LlamaConfig& c = bench.config;
  const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());

  // The memory plan, stated before allocating: weights, KV cache at the longest length.
  const int64_t weight_bytes =
      2 * (2 * c.vocab_size * c.hidden_size + c.hidden_size +
           c.num_layers * (2 * c.hidden_size + 4 * c.hidden_size * c.hidden_size +
                           3 * c.hidden_size * c.intermediate_size));
  const int64_t kv_bytes = 2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * (max_len + 1);
  Status plan = engine::cuda_check_fits(b, weight_bytes, "7B weights (bf16)");
  ASSERT_TRUE(plan.ok()) << plan.message();
  plan = engine::cuda_check_fits(b, weight_bytes + kv_bytes,
                                 "7B weights + KV cache of " + std::to_string(max_len + 1) +
                                     " tokens");
  ASSERT_TRUE(plan.ok()) << plan.message();
  const Status too_big = engine::cuda_check_fits(
      b, weight_bytes + 2 * 2 * c.num_layers * c.hidden_size * (int64_t{1} << 18),
      "7B weights + KV cache of 262144 tokens");
  std::printf("[ info     ] memory plan at 256K: %s\n", too_big.message().c_str());

  auto model = models::LlamaModel::random(b, c, 0);
  ASSERT_TRUE(model.ok()) << model.message();
  auto local = runtime::LocalStepRunner::create(*model.value(), max_len + 1);
  ASSERT_TRUE(local.ok()) << local.message();
  for (int64_t n : lengths) {
    runtime::GenerateRequest req;
    req.max_tokens = 1;
    req.sampling = engine::SamplingParams{0.f, 0, 1.f, 0};
    req.prompt.push_back(1);
    for (int64_t i = 1; i < n; ++i) {
      const uint64_t r = engine::splitmix64(static_cast<uint64_t>(i));
      req.prompt.push_back(259 + static_cast<int32_t>(r % (c.vocab_size - 259)));
    }
    std::vector<double> ms;
    int32_t first = -1;
    for (int rep = 0; rep <= reps; ++rep) {  // rep 0 is the warm-up
      auto stats = runtime::generate(*local.value(), req, [&](int32_t t) {
        first = t;
        return true;
      });
      ASSERT_TRUE(stats.ok()) << "prefill " << n << ": " << stats.message();
      if (rep > 0) ms.push_back(stats.value().prefill_ms);
    }
    std::sort(ms.begin(), ms.end());
    auto info = engine::cuda_memory_info(b);
    ASSERT_TRUE(info.ok());
    std::fprintf(out,
                 "{\"tokens\": %lld, \"median_ms\": %.2f, \"min_ms\": %.2f, \"max_ms\": %.2f, "
                 "\"reps\": %d, \"first_token\": %d, \"held_gib\": %.2f, \"free_gib\": %.2f}\n",
                 static_cast<long long>(n), ms[ms.size() / 2], ms.front(), ms.back(), reps,
                 first, info.value().held / 1073741824.0, info.value().free / 1073741824.0);
    std::fflush(out);
    std::printf("[ info     ] 7B prefill %lld tokens: median %.1f ms\n",
                static_cast<long long>(n), ms[ms.size() / 2]);
  }
  if (out != stdout) std::fclose(out);
}

// Where a decode step of the 7B preset (random weights, one GPU) spends its time at the
// contexts in BURST_BENCH_DECODE (comma separated): the host's time to enqueue the 32 layers
// (until the last layer's hook) against the whole step (LM head and the token drawn: greedy
// and T=0.8 top_p=0.95, each from logits downloaded to the host and on the device), over 32
// steps after a warm-up; and the host cost of single backend calls at the decode shapes (1000
// enqueued calls, then one synchronize). If enqueueing takes as long as the step, the GPU waits
// for the host; and the time to draw the tokens of 1, 16 and 64 rows on the host and on the
// device. Skipped unless asked for.
TEST(CudaDecodeBench, HostOverhead7b) {
  std::string skip;
  const auto asked = bench_lengths("BURST_BENCH_DECODE", "512,32768", skip);
  if (!asked) GTEST_SKIP() << skip;
  const std::vector<int64_t>& contexts = *asked;
  Bench7b bench;
  ASSERT_NO_FATAL_FAILURE(make_bench_7b(bench));
  Backend& b = *bench.backend;
  const models::LlamaConfig& c = bench.config;
  using Clock = std::chrono::steady_clock;
  auto us = [](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  {  // single calls
    const engine::DType dt = b.compute_dtype();
    auto x = b.alloc({1, c.hidden_size}, dt), w = b.alloc({c.hidden_size, c.hidden_size}, dt);
    auto y = b.alloc({1, c.hidden_size}, dt), nw = b.alloc({c.hidden_size}, dt);
    auto w2 = b.alloc({c.intermediate_size, c.hidden_size}, dt);
    auto y2 = b.alloc({1, c.intermediate_size}, dt);
    ASSERT_TRUE(x.ok() && w.ok() && y.ok() && nw.ok() && w2.ok() && y2.ok());
    ASSERT_TRUE(b.fill_random(w2.value(), 4, 0.01f).ok());
    ASSERT_TRUE(b.fill_random(x.value(), 1, 0.5f).ok());
    ASSERT_TRUE(b.fill_random(w.value(), 2, 0.01f).ok());
    ASSERT_TRUE(b.fill(nw.value(), 1.f).ok());
    auto time_calls = [&](const char* what, const std::function<Status()>& call) {
      ASSERT_TRUE(call().ok());
      ASSERT_TRUE(b.synchronize().ok());
      const auto t0 = Clock::now();
      for (int i = 0; i < 1000; ++i) ASSERT_TRUE(call().ok());
      const auto t1 = Clock::now();
      ASSERT_TRUE(b.synchronize().ok());
      const auto t2 = Clock::now();
      std::printf("[ info     ] %s: host %.2f us/call, with the GPU %.2f us/call\n", what,
                  us(t1 - t0) / 1000, us(t2 - t0) / 1000);
    };
    time_calls("gemm 1 x 4096 x 4096",
               [&] { return b.gemm(x.value(), w.value(), y.value(), false); });
    time_calls("gemm 1 x 4096 x 11008 (the GPU's bound: 90 MB of weights)",
               [&] { return b.gemm(x.value(), w2.value(), y2.value(), false); });
    time_calls("rms_norm 1 x 4096",
               [&] { return b.rms_norm(x.value(), nw.value(), 1e-5f, y.value()); });
  }
  {  // drawing the tokens of R rows of logits (the 7B's vocab, bf16 as the LM head leaves them)
    // The host way: the logits downloaded, engine::Sampler per row, OpenMP over rows (what
    // BatchRunner did for every row); the device way: Backend::sample, only the ids back.
    // Logits uniform in [-4, 4]: flatter than a trained model's, so top-p keeps many ids.
    const engine::SamplingParams settings[] = {{0.f, 0, 1.f, 0}, {0.8f, 0, 0.95f, 1}};
    for (int64_t rows : {1, 16, 64}) {
      auto logits = b.alloc({rows, c.vocab_size}, b.compute_dtype());
      ASSERT_TRUE(logits.ok()) << logits.message();
      ASSERT_TRUE(b.fill_random(logits.value(), 5, 4.f).ok());
      for (const engine::SamplingParams& sp : settings) {
        std::vector<engine::Sampler> on_host(static_cast<size_t>(rows), engine::Sampler(sp));
        std::vector<engine::Sampler> on_dev = on_host;
        const std::vector<engine::SamplingParams> params(static_cast<size_t>(rows), sp);
        std::vector<double> host_us, dev_us;
        std::vector<float> host;
        std::vector<int32_t> want(static_cast<size_t>(rows)), got;
        for (int rep = 0; rep <= 20; ++rep) {  // rep 0 is the warm-up
          ASSERT_TRUE(b.synchronize().ok());
          auto t0 = Clock::now();
          ASSERT_TRUE(b.download(logits.value(), host).ok());
#pragma omp parallel for schedule(dynamic) if (rows > 1)
          for (int64_t r = 0; r < rows; ++r) {
            want[static_cast<size_t>(r)] = on_host[static_cast<size_t>(r)].sample(
                host.data() + r * c.vocab_size, c.vocab_size);
          }
          auto t1 = Clock::now();
          std::vector<double> u;
          for (engine::Sampler& smp : on_dev) u.push_back(smp.draw_uniform());
          const Status st = b.sample(logits.value(), params, u, got);
          auto t2 = Clock::now();
          ASSERT_TRUE(st.ok()) << st.message();
          EXPECT_EQ(got, want) << rows << " rows, T=" << sp.temperature;
          if (rep == 0) continue;
          host_us.push_back(us(t1 - t0));
          dev_us.push_back(us(t2 - t1));
        }
        std::printf("[ info     ] draw %lld row(s), %s: logits to host + host sampler %.0f us, "
                    "on device %.0f us (medians of 20)\n",
                    static_cast<long long>(rows),
                    sp.temperature == 0.f ? "greedy" : "T=0.8 top_p=0.95", median(host_us),
                    median(dev_us));
      }
    }
  }
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  auto model = models::LlamaModel::random(b, c, 0);
  ASSERT_TRUE(model.ok()) << model.message();
  models::LlamaModel& m = *model.value();
  constexpr int kSteps = 32;
  // How the step's token is drawn: its logits to the host and engine::Sampler there (every
  // decode step before Backend::sample; what logprobs and penalties still take), or on the GPU
  // (Backend::sample: only the id comes back). Each way decodes kSteps + 1 tokens in turn.
  struct Way {
    const char* name;
    engine::SamplingParams sampling;
    bool on_device;
  };
  const Way ways[] = {{"greedy, logits to host", {0.f, 0, 1.f, 0}, false},
                      {"greedy, on device", {0.f, 0, 1.f, 0}, true},
                      {"T=0.8 top_p=0.95, logits to host", {0.8f, 0, 0.95f, 1}, false},
                      {"T=0.8 top_p=0.95, on device", {0.8f, 0, 0.95f, 1}, true}};
  constexpr int kWays = sizeof(ways) / sizeof(ways[0]);
  auto cache = OneRank::create(m, max_ctx + kWays * (kSteps + 1) + 2);
  ASSERT_TRUE(cache.ok()) << cache.message();
  for (int64_t n : contexts) {
    cache.value().clear();
    std::vector<int32_t> ids(static_cast<size_t>(n));
    std::vector<int64_t> pos(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ids[static_cast<size_t>(i)] =
          259 + static_cast<int32_t>(engine::splitmix64(static_cast<uint64_t>(i)) % 31000);
      pos[static_cast<size_t>(i)] = i;
    }
    std::vector<float> logits;
    ASSERT_TRUE(forward_logits(m, ids, pos, cache.value(), {n - 1}, logits).ok());
    int64_t at = n;
    for (const Way& w : ways) {
      engine::Sampler sampler(w.sampling);
      int32_t token = ids.back();
      std::vector<double> enq, total;
      for (int s = 0; s <= kSteps; ++s, ++at) {  // step 0 is the warm-up
        logits.clear();
        Clock::time_point t_enq{};
        const models::LayerHook hook = [&](int64_t layer) {
          if (layer == c.num_layers) t_enq = Clock::now();
          return Status{};
        };
        const auto t0 = Clock::now();
        Status st;
        if (w.on_device) {
          const models::SampleRows rows{{0}, {w.sampling}, {sampler.draw_uniform()}};
          models::ForwardOutput out;
          st = burst::testing::forward_decode(m, *cache.value().ring, OneRank::kSeq, token, at, {},
                                              out, at + 1, hook, rows);
          if (st.ok()) token = out.sampled.at(0);
        } else {
          st = forward_logits(m, {token}, {at}, cache.value(), {0}, logits, at + 1, hook);
          if (st.ok()) token = sampler.sample(logits.data(), c.vocab_size);
        }
        const auto t1 = Clock::now();
        ASSERT_TRUE(st.ok()) << st.message();
        if (s == 0) continue;
        enq.push_back(us(t_enq - t0));
        total.push_back(us(t1 - t0));
      }
      std::printf("[ info     ] 7B decode at %lld context, %s: step %.0f us (median of %d, "
                  "token drawn), host enqueue of the layers %.0f us\n",
                  static_cast<long long>(n), w.name, median(total), kSteps, median(enq));
    }
  }
}

}  // namespace
}  // namespace burst
