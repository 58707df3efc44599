// GPU tests of FP8 prefill attention (kernels/attention_cuda.h: attention_fp8_cuda) against an
// fp64 reference over the same bf16 inputs.
//
// Tolerance rule: the kernel's error (RMSE of O over all rows, max |LSE error|) is at most twice
// that of a naive FP8 attention in the same precision: q, k and v each rounded to e4m3 with
// one scale for the whole tensor (max |x| / 448), scores from those values in fp32, P = exp(s -
// max) rounded to e4m3 before P.V, the sum over unrounded P. On inputs with outlier channels (a
// few channels 20x the rest, as LLaMA activations have) the kernel's block scales and Hadamard
// rotation must do better than that naive one. The bf16 kernel's error is printed beside them.
// Every test skips with a message off Hopper (the FP8 kernel is sm_90a only).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../fp8_attention_reference.h"
#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/kv_fp8.h"
#include "kernels/ops_cuda.h"

namespace burst::kernels {
namespace {

namespace ref = testing::fp8_attention;
constexpr int kD = 128;    // LLaMA's head_dim
constexpr int kD64 = 64;   // the other head_dim the kernel runs
using testing::decode;
using testing::DevBuf;
using testing::encode;
using testing::have_gpu;
using testing::round_to;

class GpuAttentionFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!have_gpu(why)) GTEST_SKIP() << "skipping GPU FP8 attention test: " << why;
    AttnParams probe;
    probe.head_dim = kD;
    if (!attention_fp8_supported(probe)) {
      GTEST_SKIP() << "skipping GPU FP8 attention test: the device is not a Hopper GPU "
                      "(compute capability 9.0)";
    }
  }
};

struct Case {
  std::string name;
  ref::Shape shape;
  bool outliers = false;
  DType o_dtype = DType::kBF16;
  int rows = 0;  // Fp8AttnOptions::rows: the tile's query rows (0: chosen)
};

float to_bf16(float x) { return round_to(DType::kBF16, x); }

ref::Inputs inputs_of(const Case& c, uint32_t seed) {
  return ref::draw_inputs(c.shape, c.outliers, seed, to_bf16);
}

// The CPU emulation of the same roundings (attention_cpu with qkv_fp8).
ref::Result emulate(const ref::Shape& s, const ref::Inputs& in) {
  return ref::attention_cpu_of(s, in, true);
}

struct Device {
  DevBuf q, k, v, o, lse, ws;
};

AttnParams params_of(const ref::Shape& c, DType o_dtype, Device& dev) {
  AttnParams p = ref::params_of(c, dev.q.ptr, dev.k.ptr, dev.v.ptr, dev.o.ptr,
                                static_cast<float*>(dev.lse.ptr));
  p.dtype = DType::kBF16;
  p.o_dtype = o_dtype;
  return p;
}

void upload(DevBuf& d, const std::vector<uint8_t>& h) {
  ASSERT_EQ(cudaMalloc(&d.ptr, std::max<size_t>(h.size(), 16)), cudaSuccess);
  CUDA_ASSERT(cudaMemcpy(d.ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
}

// q, k, v (bf16) on the device, O (o_dtype, poisoned: every row must be written) and LSE.
void to_device(const ref::Shape& c, const ref::Inputs& in, DType o_dtype, Device& dev) {
  upload(dev.q, encode(DType::kBF16, in.q));
  upload(dev.k, encode(DType::kBF16, in.k));
  upload(dev.v, encode(DType::kBF16, in.v));
  const size_t o_bytes = size_t(c.n_q) * c.heads * c.head_dim * testing::dtype_bytes(o_dtype);
  ASSERT_EQ(cudaMalloc(&dev.o.ptr, o_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev.lse.ptr, sizeof(float) * c.heads * c.n_q + 16), cudaSuccess);
  CUDA_ASSERT(cudaMemset(dev.o.ptr, 0x7f, o_bytes));
}

void fetch(const ref::Shape& c, DType o_dtype, const Device& dev, ref::Result& out) {
  CUDA_ASSERT(cudaDeviceSynchronize());
  std::vector<uint8_t> o(size_t(c.n_q) * c.heads * c.head_dim * testing::dtype_bytes(o_dtype));
  out.lse.resize(size_t(c.heads) * c.n_q);
  CUDA_ASSERT(cudaMemcpy(o.data(), dev.o.ptr, o.size(), cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(out.lse.data(), dev.lse.ptr, sizeof(float) * out.lse.size(),
                         cudaMemcpyDeviceToHost));
  out.o = decode(o_dtype, o);
}

enum class Run { kFp8, kFp8NoHadamard, kBf16 };

// One launch of `run` over in; the outputs as fp32 values.
void launch(const Case& c, const ref::Inputs& in, Run run, ref::Result& out) {
  Device dev;
  to_device(c.shape, in, c.o_dtype, dev);
  if (::testing::Test::HasFatalFailure()) return;
  AttnParams p = params_of(c.shape, c.o_dtype, dev);
  if (run == Run::kBf16) {
    CUDA_ASSERT(attention_cuda(p, nullptr));
  } else {
    const size_t ws = attention_fp8_workspace_bytes(p);
    ASSERT_GT(ws, 0u);
    ASSERT_EQ(cudaMalloc(&dev.ws.ptr, ws), cudaSuccess);
    Fp8AttnOptions opt;
    opt.hadamard = run == Run::kFp8;
    opt.rows = c.rows;
    CUDA_ASSERT(attention_fp8_cuda(p, dev.ws.ptr, ws, nullptr, opt));
  }
  fetch(c.shape, c.o_dtype, dev, out);
}

// Every row that sees a key is finite, every row that sees none exactly empty.
void expect_sound(const ref::Errors& e, const std::string& what) {
  EXPECT_EQ(e.not_finite, 0) << what << ": NaN or infinite values";
  EXPECT_EQ(e.wrong_empty, 0) << what << ": rows that see no key must be O = 0, LSE = -inf";
}

// The errors of the kernel (with and without the rotation), its CPU emulation, bf16 and naive
// FP8, printed; the kernel's within twice the naive one's and twice its emulation's.
void check_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  const ref::Shape& s = c.shape;
  const ref::Inputs in = inputs_of(c, seed);
  const ref::Result truth = ref::attend(s, in, false);
  const ref::Result naive = ref::naive_fp8(s, in);
  const ref::Result emulated = emulate(s, in);
  ref::Result fp8, fp8_plain, bf16;
  launch(c, in, Run::kFp8, fp8);
  launch(c, in, Run::kFp8NoHadamard, fp8_plain);
  launch(c, in, Run::kBf16, bf16);
  if (::testing::Test::HasFatalFailure()) return;
  const ref::Errors e8 = ref::errors(s, fp8, truth), e8p = ref::errors(s, fp8_plain, truth);
  const ref::Errors e16 = ref::errors(s, bf16, truth), en = ref::errors(s, naive, truth);
  const ref::Errors em = ref::errors(s, emulated, truth);
  expect_sound(e8, "fp8");
  expect_sound(e8p, "fp8 without rotation");
  expect_sound(em, "cpu emulation");
  std::printf(
      "[fp8 attention] %s: O RMSE fp8 %.3e (no Hadamard %.3e, CPU emulation %.3e), naive "
      "per-tensor fp8 %.3e, bf16 %.3e; LSE RMSE fp8 %.3e (%.3e, %.3e), naive %.3e, bf16 "
      "%.3e; max |LSE err| fp8 %.3e, naive %.3e; %d empty rows\n",
      c.name.c_str(), e8.o_rmse, e8p.o_rmse, em.o_rmse, en.o_rmse, e16.o_rmse, e8.lse_rmse,
      e8p.lse_rmse, em.lse_rmse, en.lse_rmse, e16.lse_rmse, e8.lse_max, en.lse_max,
      e8.empty_rows);
  EXPECT_LE(e8.o_rmse, 2 * en.o_rmse + 1e-6) << "fp8 O error above twice the naive fp8's";
  EXPECT_LE(e8.lse_rmse, 2 * en.lse_rmse + 1e-6) << "fp8 LSE RMSE above twice the naive's";
  EXPECT_LE(e8p.o_rmse, 2 * en.o_rmse + 1e-6) << "fp8 (no rotation) O error above 2x naive";
  EXPECT_LE(e8.o_rmse, 2 * em.o_rmse + 1e-6) << "fp8 O error above twice its CPU emulation's";
  // FP8 is coarser than bf16, and it must still be attention (not, say, zeros).
  EXPECT_GT(e8.o_rmse, e16.o_rmse);
  if (c.outliers) {
    EXPECT_LT(e8.o_rmse, en.o_rmse) << "block scales + rotation must beat per-tensor FP8";
  }
}

TEST_F(GpuAttentionFp8, OddSizesCausalAndFullWithinTwiceNaive) {
  check_case({"causal gqa", {1000, 1000, 8, 2, kD, MaskKind::kCausal}}, 11);
  check_case({"full odd", {333, 1537, 4, 4, kD, MaskKind::kNone}}, 12);
  check_case({"full fp32 out", {257, 389, 4, 1, kD, MaskKind::kNone}, false, DType::kF32}, 13);
}

TEST_F(GpuAttentionFp8, ChunkAfterPrefixAndFullyMaskedRows) {
  // A chunk of 700 queries after 1200 cached keys (q_start past kv_start).
  check_case({"chunk after prefix", {700, 1900, 8, 8, kD, MaskKind::kCausal, 1200, 0}}, 21);
  // Keys that start after the first 150 queries: those rows see nothing.
  check_case({"masked rows", {517, 900, 4, 2, kD, MaskKind::kCausal, 0, 150}}, 22);
}

TEST_F(GpuAttentionFp8, OutlierChannelsBeatPerTensorFp8) {
  check_case({"outliers causal", {1024, 1024, 8, 2, kD, MaskKind::kCausal}, true}, 31);
  check_case({"outliers full", {640, 1111, 4, 4, kD, MaskKind::kNone}, true}, 32);
}

// merge_into_o: the keys in two launches, the second merging into the first's fp32 (O, LSE),
// equal one launch over all keys within the rule.
// Head_dim 64: rows of 64 bytes (the 64-byte swizzle), P.V with 72 columns (64 + the sums);
// tiles of 128 rows (two consumer warpgroups) and of 192 (three; a tile's first warpgroups
// idle where it starts before row 0).
TEST_F(GpuAttentionFp8, HeadDim64) {
  for (int rows : {128, 192}) {
    const std::string r = " rows " + std::to_string(rows);
    const DType bf16 = DType::kBF16, f32 = DType::kF32;
    check_case({"d64 causal gqa" + r, {1000, 1000, 8, 2, kD64, MaskKind::kCausal}, false, bf16,
                rows}, 61);
    check_case({"d64 full odd" + r, {333, 1537, 4, 4, kD64, MaskKind::kNone}, false, bf16, rows},
               62);
    check_case({"d64 full fp32 out" + r, {257, 389, 6, 3, kD64, MaskKind::kNone}, false, f32,
                rows}, 63);
    check_case({"d64 chunk after prefix" + r,
                {700, 1900, 8, 8, kD64, MaskKind::kCausal, 1200, 0}, false, bf16, rows}, 64);
    check_case({"d64 masked rows" + r, {517, 900, 4, 2, kD64, MaskKind::kCausal, 0, 150}, false,
                bf16, rows}, 65);
    check_case({"d64 outliers causal" + r, {1024, 1024, 8, 2, kD64, MaskKind::kCausal}, true,
                bf16, rows}, 66);
  }
}

TEST_F(GpuAttentionFp8, MergeIntoOEqualsOneLaunch) {
  for (int d : {kD, kD64}) {
    SCOPED_TRACE(d);
    const ref::Shape whole{600, 1400, 8, 2, d, MaskKind::kCausal, 800, 0};
    const ref::Inputs in = ref::draw_inputs(whole, false, 41, to_bf16);
    const ref::Result truth = ref::attend(whole, in, false);
    const ref::Result naive = ref::naive_fp8(whole, in);
    Device dev;
    to_device(whole, in, DType::kF32, dev);
    if (HasFatalFailure()) return;
    AttnParams first = params_of(whole, DType::kF32, dev);
    const int split = 650;  // keys [0, 650) then [650, 1400)
    first.n_kv = split;
    AttnParams second = first;
    second.n_kv = whole.n_kv - split;
    second.kv_start = split;
    second.k = static_cast<const uint16_t*>(dev.k.ptr) + int64_t{split} * second.k_row_stride;
    second.v = static_cast<const uint16_t*>(dev.v.ptr) + int64_t{split} * second.v_row_stride;
    second.merge_into_o = true;
    const size_t ws = std::max(attention_fp8_workspace_bytes(first),
                               attention_fp8_workspace_bytes(second));
    ASSERT_EQ(cudaMalloc(&dev.ws.ptr, ws), cudaSuccess);
    CUDA_ASSERT(attention_fp8_cuda(first, dev.ws.ptr, ws, nullptr));
    CUDA_ASSERT(attention_fp8_cuda(second, dev.ws.ptr, ws, nullptr));
    ref::Result got;
    fetch(whole, DType::kF32, dev, got);
    const ref::Errors e = ref::errors(whole, got, truth), en = ref::errors(whole, naive, truth);
    expect_sound(e, "merged");
    std::printf("[fp8 attention] merge into O, head_dim %d: O RMSE %.3e, naive %.3e; LSE RMSE "
                "%.3e, naive %.3e\n", d, e.o_rmse, en.o_rmse, e.lse_rmse, en.lse_rmse);
    EXPECT_LE(e.o_rmse, 2 * en.o_rmse + 1e-6);
    EXPECT_LE(e.lse_rmse, 2 * en.lse_rmse + 1e-6);
  }
}

// FP8 attention over the FP8 KV cache's rows where they lie (kv_fp8; paged, the pages out of
// order; and contiguous) equals, bit for bit, FP8 attention over those rows dequantized into one
// bf16 block (dequantize_kv_cuda), the path it replaces; its error against fp64 over the rows'
// values stays within twice the naive FP8 attention's.
TEST_F(GpuAttentionFp8, Fp8KvRowsInPlaceEqualTheirDequantizedBlock) {
  constexpr int kPage = 16;
  for (int d : {kD, kD64}) {
    for (const ref::Shape& c : {ref::Shape{300, 997, 8, 2, d, MaskKind::kNone, 997, 0},
                                ref::Shape{333, 833, 6, 3, d, MaskKind::kCausal, 500, 0}}) {
      SCOPED_TRACE("head_dim " + std::to_string(d) + ", " + std::to_string(c.n_q) + " x " +
                   std::to_string(c.n_kv));
      ref::Inputs in = ref::draw_inputs(c, false, 61 + d, to_bf16);
      Device dev;
      to_device(c, in, DType::kF32, dev);
      if (HasFatalFailure()) return;
      const int64_t row_bytes = kv_fp8_row_bytes(c.kv_heads, d);
      const int pages = (c.n_kv + kPage - 1) / kPage;
      // Logical page i at physical page perm[i] of a pool with two spare pages.
      std::vector<int32_t> perm(static_cast<size_t>(pages)), dst_rows(static_cast<size_t>(c.n_kv));
      for (int i = 0; i < pages; ++i) perm[static_cast<size_t>(i)] = i;
      std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
      for (int i = 0; i < pages; ++i) perm[static_cast<size_t>(i)] += 2;
      for (int j = 0; j < c.n_kv; ++j) {
        dst_rows[static_cast<size_t>(j)] = perm[static_cast<size_t>(j / kPage)] * kPage + j % kPage;
      }
      DevBuf table, rows_d, k8, v8, pk8, pv8, kb, vb, o_ref, lse_ref;
      const size_t pool = size_t(pages + 2) * kPage * row_bytes, flat = size_t(c.n_kv) * row_bytes;
      const size_t values = size_t(c.n_kv) * c.kv_heads * d * 2;
      for (DevBuf* b : {&k8, &v8}) ASSERT_EQ(cudaMalloc(&b->ptr, flat), cudaSuccess);
      for (DevBuf* b : {&pk8, &pv8}) ASSERT_EQ(cudaMalloc(&b->ptr, pool), cudaSuccess);
      for (DevBuf* b : {&kb, &vb}) ASSERT_EQ(cudaMalloc(&b->ptr, values), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&table.ptr, perm.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&rows_d.ptr, dst_rows.size() * 4), cudaSuccess);
      CUDA_ASSERT(cudaMemcpy(table.ptr, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
      CUDA_ASSERT(cudaMemcpy(rows_d.ptr, dst_rows.data(), dst_rows.size() * 4,
                             cudaMemcpyHostToDevice));
      const auto* dst = static_cast<const int32_t*>(rows_d.ptr);
      for (auto [src, flat_rows, paged] : {std::tuple{dev.k.ptr, k8.ptr, pk8.ptr},
                                           std::tuple{dev.v.ptr, v8.ptr, pv8.ptr}}) {
        CUDA_ASSERT(cudaMemset(paged, 0x7f, pool));  // unused rows: NaN bytes, never read
        CUDA_ASSERT(quantize_kv_cuda(src, DType::kBF16, c.n_kv, c.kv_heads, d, nullptr,
                                     flat_rows, nullptr));
        CUDA_ASSERT(quantize_kv_cuda(src, DType::kBF16, c.n_kv, c.kv_heads, d, dst, paged,
                                     nullptr));
      }
      CUDA_ASSERT(dequantize_kv_cuda(k8.ptr, c.n_kv, c.kv_heads, d, kb.ptr, DType::kBF16,
                                     nullptr));
      CUDA_ASSERT(dequantize_kv_cuda(v8.ptr, c.n_kv, c.kv_heads, d, vb.ptr, DType::kBF16,
                                     nullptr));
      AttnParams block = params_of(c, DType::kF32, dev);
      block.k = kb.ptr;
      block.v = vb.ptr;
      const size_t ws = attention_fp8_workspace_bytes(block);
      ASSERT_EQ(cudaMalloc(&dev.ws.ptr, ws), cudaSuccess);
      CUDA_ASSERT(attention_fp8_cuda(block, dev.ws.ptr, ws, nullptr));
      ref::Result want;
      fetch(c, DType::kF32, dev, want);
      // The reference: fp64 over the rows' values (what the block holds).
      auto host = [&](const DevBuf& b) {
        std::vector<uint8_t> h(values);
        EXPECT_EQ(cudaMemcpy(h.data(), b.ptr, values, cudaMemcpyDeviceToHost), cudaSuccess);
        return decode(DType::kBF16, h);
      };
      const std::vector<float> kv_k = host(kb), kv_v = host(vb);
      const ref::Inputs seen{in.q, kv_k, kv_v};
      const ref::Errors e = ref::errors(c, want, ref::attend(c, seen, false));
      const ref::Errors en = ref::errors(c, ref::naive_fp8(c, seen), ref::attend(c, seen, false));
      expect_sound(e, "over the dequantized block");
      EXPECT_LE(e.o_rmse, 2 * en.o_rmse + 1e-6);
      for (bool paged : {true, false}) {
        AttnParams rows = block;
        rows.kv_fp8 = true;
        rows.k = paged ? pk8.ptr : k8.ptr;
        rows.v = paged ? pv8.ptr : v8.ptr;
        rows.k_row_stride = rows.v_row_stride = row_bytes;
        rows.kv_pages = paged ? static_cast<const int32_t*>(table.ptr) : nullptr;
        rows.page_size = paged ? kPage : 0;
        CUDA_ASSERT(cudaMemset(dev.o.ptr, 0x7f, size_t(c.n_q) * c.heads * d * 4));
        CUDA_ASSERT(attention_fp8_cuda(rows, dev.ws.ptr, ws, nullptr));
        ref::Result got;
        fetch(c, DType::kF32, dev, got);
        EXPECT_EQ(std::memcmp(got.o.data(), want.o.data(), got.o.size() * 4), 0)
            << (paged ? "paged " : "") << "FP8 rows: O differs from the dequantized block's";
        EXPECT_EQ(std::memcmp(got.lse.data(), want.lse.data(), got.lse.size() * 4), 0)
            << (paged ? "paged " : "") << "FP8 rows: LSE differs from the dequantized block's";
      }
      std::printf("[fp8 attention] FP8 KV rows in place, head_dim %d, %d x %d: equal to the "
                  "dequantized block; O RMSE %.3e (naive %.3e)\n", d, c.n_q, c.n_kv, e.o_rmse,
                  en.o_rmse);
    }
  }
}

TEST_F(GpuAttentionFp8, RefusesWhatItCannotRun) {
  const ref::Shape c{64, 64, 2, 2, kD, MaskKind::kCausal};
  const ref::Inputs in = ref::draw_inputs(c, false, 51, to_bf16);
  Device dev;
  to_device(c, in, DType::kBF16, dev);
  if (HasFatalFailure()) return;
  AttnParams p = params_of(c, DType::kBF16, dev);
  const size_t ws = attention_fp8_workspace_bytes(p);
  ASSERT_EQ(cudaMalloc(&dev.ws.ptr, ws), cudaSuccess);
  EXPECT_EQ(attention_fp8_cuda(p, dev.ws.ptr, ws - 1, nullptr), cudaErrorInvalidValue)
      << "a workspace one byte short";
  AttnParams d96 = p;
  d96.head_dim = 96;
  d96.q_row_stride = d96.o_row_stride = 2 * 96;
  d96.k_row_stride = d96.v_row_stride = 2 * 96;
  d96.q_head_stride = d96.k_head_stride = d96.v_head_stride = d96.o_head_stride = 96;
  EXPECT_FALSE(attention_fp8_supported(d96));
  EXPECT_EQ(attention_fp8_cuda(d96, dev.ws.ptr, ws, nullptr), cudaErrorInvalidValue)
      << "head_dim 96";
  AttnParams pp64 = p;
  pp64.head_dim = 64;
  pp64.q_row_stride = pp64.o_row_stride = pp64.k_row_stride = pp64.v_row_stride = 2 * 64;
  pp64.q_head_stride = pp64.k_head_stride = pp64.v_head_stride = pp64.o_head_stride = 64;
  Fp8AttnOptions pingpong;
  pingpong.pingpong = true;
  EXPECT_EQ(attention_fp8_cuda(pp64, dev.ws.ptr, ws, nullptr, pingpong), cudaErrorInvalidValue)
      << "ping-pong at head_dim 64 (an option measured at 128 only)";
  Fp8AttnOptions rows192, rows100;
  rows192.rows = 192;
  rows100.rows = 100;
  EXPECT_EQ(attention_fp8_cuda(p, dev.ws.ptr, ws, nullptr, rows192), cudaErrorInvalidValue)
      << "192-row tiles at head_dim 128";
  EXPECT_EQ(attention_fp8_cuda(pp64, dev.ws.ptr, ws, nullptr, rows100), cudaErrorInvalidValue)
      << "100-row tiles";
  AttnParams short_rows = p;  // FP8 KV rows narrower than a row of this shape
  short_rows.kv_fp8 = true;
  short_rows.k_row_stride = short_rows.v_row_stride = kv_fp8_row_bytes(c.kv_heads, kD) - 16;
  EXPECT_EQ(attention_fp8_cuda(short_rows, dev.ws.ptr, ws, nullptr), cudaErrorInvalidValue)
      << "FP8 KV rows with a stride below a row's bytes";
  AttnParams merge_bf16 = p;
  merge_bf16.merge_into_o = true;
  EXPECT_EQ(attention_fp8_cuda(merge_bf16, dev.ws.ptr, ws, nullptr), cudaErrorInvalidValue)
      << "merge into a bf16 O";
}

}  // namespace
}  // namespace burst::kernels
