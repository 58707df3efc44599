// GPU tests of the CUDA attention kernels (kernels/attention_cuda.h) against the CPU reference
// of the same contract (attention_cpu, fp32 on the inputs rounded to the kernel's dtype).
//
// Tolerance rule (FlashAttention's): our error against the fp32 reference is at most twice the
// error of a naive implementation in the same precision (scores fp32, P rounded to the input
// dtype before P.V, O rounded to the output dtype), plus a tiny epsilon for cases where both
// are exact. Every test skips with a message when no CUDA device is present.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
#include <vector>

#include "kernels/attention.h"
#include "kernels/attention_cuda.h"
#include "kernels/kv_fp8.h"
#include "../fp8_attention_reference.h"
#include "gpu_test_util.h"

namespace burst::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using testing::decode;
using testing::DevBuf;
using testing::encode;
using testing::have_gpu;
using testing::parallel_rows;
using testing::round_to;

class GpuAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!have_gpu(why)) GTEST_SKIP() << "skipping GPU attention test: " << why;
  }
};

// Random values never zero: magnitude in [lo, hi], random sign, already rounded to t.
std::vector<float> random_values(size_t n, float lo, float hi, DType t, std::mt19937& rng) {
  std::uniform_real_distribution<float> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> x(n);
  for (auto& v : x) v = round_to(t, neg(rng) ? -mag(rng) : mag(rng));
  return x;
}

// The current device's multiprocessor count (the launch planners' input).
void device_sms(int& sms) {
  int device = 0;
  CUDA_ASSERT(cudaGetDevice(&device));
  CUDA_ASSERT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
}

void upload(DevBuf& d, const std::vector<uint8_t>& h) {
  ASSERT_EQ(cudaMalloc(&d.ptr, std::max<size_t>(h.size(), 16)), cudaSuccess);
  CUDA_ASSERT(cudaMemcpy(d.ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
}

// The naive same-precision implementation: full fp32 score row, P = exp(s - max) rounded to the
// input dtype before P.V, sum over unrounded P, O rounded to the output dtype.
void attention_naive(const AttnParams& p, DType in_t, DType out_t) {
  const auto* q = static_cast<const float*>(p.q);
  const auto* k = static_cast<const float*>(p.k);
  const auto* v = static_cast<const float*>(p.v);
  auto* o = static_cast<float*>(p.o);
  const int group = p.heads / p.kv_heads, d = p.head_dim;
  parallel_rows(p.heads, p.n_q, [&](int h, int i) {
    const int g = h / group;
    int64_t visible = p.n_kv;
    if (p.mask == MaskKind::kCausal) {
      visible = std::clamp<int64_t>(p.q_start + i - p.kv_start + 1, 0, p.n_kv);
    }
    float* oi = o + i * p.o_row_stride + h * p.o_head_stride;
    float* lse = p.lse + h * p.lse_head_stride + i;
    if (visible == 0) {
      for (int c = 0; c < d; ++c) oi[c] = 0.f;
      *lse = kNegInf;
      return;
    }
    const float* qi = q + i * p.q_row_stride + h * p.q_head_stride;
    std::vector<float> s(visible);
    float mx = kNegInf;
    for (int64_t j = 0; j < visible; ++j) {
      const float* kj = k + j * p.k_row_stride + g * p.k_head_stride;
      float dot = 0.f;
      for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
      s[j] = dot * p.scale;
      mx = std::max(mx, s[j]);
    }
    std::vector<float> acc(d, 0.f);
    float sum = 0.f;
    for (int64_t j = 0; j < visible; ++j) {
      const float pj = std::exp(s[j] - mx);
      sum += pj;
      const float pr = round_to(in_t, pj);
      const float* vj = v + j * p.v_row_stride + g * p.v_head_stride;
      for (int c = 0; c < d; ++c) acc[c] += pr * vj[c];
    }
    for (int c = 0; c < d; ++c) oi[c] = round_to(out_t, acc[c] / sum);
    *lse = mx + std::log(sum);
  });
}

struct Case {
  std::string name;
  int n_q, n_kv, heads, kv_heads, head_dim;
  MaskKind mask;
  int64_t q_start = 0, kv_start = 0;
  DType dtype = DType::kBF16;
  DType o_dtype = DType::kBF16;
  bool padded = false;  // non-packed strides (head and row padding) for q, k, v and lse
};

std::string describe(const Case& c) {
  return c.name + " n_q=" + std::to_string(c.n_q) + " n_kv=" + std::to_string(c.n_kv) +
         " heads=" + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) +
         " d=" + std::to_string(c.head_dim) +
         (c.mask == MaskKind::kCausal ? " causal" : " full") +
         " q_start=" + std::to_string(c.q_start) + " kv_start=" + std::to_string(c.kv_start);
}

// Host inputs of one case, already rounded to the input dtype, with their strides.
struct Inputs {
  AttnParams p;  // strides, shapes; pointers unset
  std::vector<float> q, k, v;
};

// The shapes and strides of a case (pointers unset).
AttnParams case_params(const Case& c) {
  AttnParams p;
  p.n_q = c.n_q;
  p.n_kv = c.n_kv;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.mask = c.mask;
  p.q_start = c.q_start;
  p.kv_start = c.kv_start;
  p.scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  set_packed_strides(p);
  if (c.padded) {
    p.q_head_stride = c.head_dim + 8;
    p.q_row_stride = c.heads * p.q_head_stride + 16;
    p.k_head_stride = p.v_head_stride = c.head_dim + 16;
    p.k_row_stride = p.v_row_stride = c.kv_heads * p.k_head_stride + 8;
    p.lse_head_stride = c.n_q + 5;
  }
  return p;
}

// A case's parameters for the launch planners (attention_sm90_split_parts,
// attention_sm90_schedule): they read shapes and dtypes only, so any non-null pointers do.
AttnParams plan_params(const Case& c) {
  AttnParams p = case_params(c);
  static float dummy[4];
  p.q = p.k = p.v = p.o = p.lse = dummy;
  p.dtype = c.dtype;
  p.o_dtype = c.o_dtype;
  return p;
}

Inputs make_inputs(const Case& c, uint32_t seed) {
  Inputs in;
  in.p = case_params(c);
  const AttnParams& p = in.p;
  std::mt19937 rng(seed);
  // |q|, |k| up to 2: scores of a few units, so softmax rows are peaked, not flat.
  in.q = random_values(size_t(std::max(c.n_q, 1)) * p.q_row_stride, 0.05f, 2.f, c.dtype, rng);
  in.k = random_values(size_t(std::max(c.n_kv, 1)) * p.k_row_stride, 0.05f, 2.f, c.dtype, rng);
  in.v = random_values(size_t(std::max(c.n_kv, 1)) * p.v_row_stride, 0.05f, 1.f, c.dtype, rng);
  return in;
}

struct Outputs {
  std::vector<float> o, lse;  // o packed [n_q, heads, d]; lse with p.lse_head_stride
};

// fp32 reference (attention_cpu) and the naive same-precision result for the same inputs.
void references(const Inputs& in, DType in_t, DType out_t, Outputs& ref, Outputs& naive) {
  AttnParams p = in.p;
  p.dtype = DType::kF32;
  p.o_dtype.reset();
  p.o_row_stride = int64_t{p.heads} * p.head_dim;
  p.o_head_stride = p.head_dim;
  p.q = in.q.data();
  p.k = in.k.data();
  p.v = in.v.data();
  const size_t o_elems = size_t(p.n_q) * p.heads * p.head_dim;
  const size_t lse_elems = size_t(p.heads) * p.lse_head_stride;
  ref.o.assign(o_elems, 0.f);
  ref.lse.assign(lse_elems, 0.f);
  naive.o.assign(o_elems, 0.f);
  naive.lse.assign(lse_elems, 0.f);
  p.o = ref.o.data();
  p.lse = ref.lse.data();
  attention_cpu(p);
  p.o = naive.o.data();
  p.lse = naive.lse.data();
  attention_naive(p, in_t, out_t);
}

struct Errors {
  double rel_l2 = 0, max_abs = 0, lse_max_abs = 0;
};

// Compares out against ref over the valid elements; empty rows (ref LSE -inf) must be exactly
// O = 0 and LSE = -inf, and no value may be NaN (outputs were poisoned with NaN before).
Errors compare(const AttnParams& p, const Outputs& out, const Outputs& ref, const char* who) {
  Errors e;
  double num = 0, den = 0;
  int reported = 0;
  for (int h = 0; h < p.heads; ++h) {
    for (int i = 0; i < p.n_q; ++i) {
      const float rl = ref.lse[size_t(h) * p.lse_head_stride + i];
      const float ol = out.lse[size_t(h) * p.lse_head_stride + i];
      const bool empty = rl == kNegInf;
      if (empty) {
        if (ol != kNegInf && reported++ < 5) {
          ADD_FAILURE() << who << ": empty row h=" << h << " i=" << i << " has lse " << ol;
        }
      } else if (!std::isfinite(ol)) {
        if (reported++ < 5) ADD_FAILURE() << who << ": lse h=" << h << " i=" << i << " = " << ol;
      } else {
        e.lse_max_abs = std::max(e.lse_max_abs, double(std::fabs(ol - rl)));
      }
      for (int c = 0; c < p.head_dim; ++c) {
        const size_t idx = (size_t(i) * p.heads + h) * p.head_dim + c;
        const float ov = out.o[idx], rv = ref.o[idx];
        if (std::isnan(ov) || (empty && ov != 0.f)) {
          if (reported++ < 5) {
            ADD_FAILURE() << who << ": o h=" << h << " i=" << i << " c=" << c << " = " << ov
                          << (empty ? " (empty row, want 0)" : "");
          }
          continue;
        }
        const double d = double(ov) - rv;
        num += d * d;
        den += double(rv) * rv;
        e.max_abs = std::max(e.max_abs, std::fabs(d));
      }
    }
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

// Applies the 2x-naive rule. 1e-6 covers cases where both are exact (one key: O = V);
// LSE adds 1e-4 nats: a relative error of 1e-4 in a merge weight, 40x below bf16 resolution.
void expect_within_rule(const Errors& ours, const Errors& naive, const std::string& what) {
  EXPECT_LE(ours.rel_l2, 2 * naive.rel_l2 + 1e-6) << what << " (naive " << naive.rel_l2 << ")";
  EXPECT_LE(ours.max_abs, 2 * naive.max_abs + 1e-6) << what << " (naive " << naive.max_abs
                                                     << ")";
  EXPECT_LE(ours.lse_max_abs, 2 * naive.lse_max_abs + 1e-4)
      << what << " (naive " << naive.lse_max_abs << ")";
}

// Device copies of the inputs and output buffers of one case.
struct Device {
  DevBuf q, k, v, o, lse;
  AttnParams p;
};

void to_device(const Inputs& in, const Case& c, Device& dev) {
  dev.p = in.p;
  dev.p.dtype = c.dtype;
  dev.p.o_dtype = c.o_dtype;
  upload(dev.q, encode(c.dtype, in.q));
  if (::testing::Test::HasFatalFailure()) return;
  if (c.n_kv > 0) {
    upload(dev.k, encode(c.dtype, in.k));
    if (::testing::Test::HasFatalFailure()) return;
    upload(dev.v, encode(c.dtype, in.v));
    if (::testing::Test::HasFatalFailure()) return;
  }
  const size_t o_bytes = size_t(c.n_q) * c.heads * c.head_dim * testing::dtype_bytes(c.o_dtype);
  const size_t lse_bytes = size_t(c.heads) * dev.p.lse_head_stride * sizeof(float);
  ASSERT_EQ(cudaMalloc(&dev.o.ptr, std::max<size_t>(o_bytes, 16)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev.lse.ptr, std::max<size_t>(lse_bytes, 16)), cudaSuccess);
  dev.p.q = dev.q.ptr;
  dev.p.k = dev.k.ptr;  // null when n_kv = 0: the contract allows it
  dev.p.v = dev.v.ptr;
  dev.p.o = dev.o.ptr;
  dev.p.lse = static_cast<float*>(dev.lse.ptr);
  dev.p.o_row_stride = int64_t{c.heads} * c.head_dim;
  dev.p.o_head_stride = c.head_dim;
}

// All-ones bytes are NaN in fp32, bf16 and fp16: any element the kernel fails to write shows.
void poison(Device& dev, const Case& c) {
  const size_t o_bytes = size_t(c.n_q) * c.heads * c.head_dim * testing::dtype_bytes(c.o_dtype);
  const size_t lse_bytes = size_t(c.heads) * dev.p.lse_head_stride * sizeof(float);
  CUDA_ASSERT(cudaMemset(dev.o.ptr, 0xff, o_bytes));
  CUDA_ASSERT(cudaMemset(dev.lse.ptr, 0xff, lse_bytes));
}

void fetch(const Device& dev, const Case& c, Outputs& out) {
  const size_t o_elems = size_t(c.n_q) * c.heads * c.head_dim;
  std::vector<uint8_t> ob(o_elems * testing::dtype_bytes(c.o_dtype));
  CUDA_ASSERT(cudaMemcpy(ob.data(), dev.o.ptr, ob.size(), cudaMemcpyDeviceToHost));
  out.o = decode(c.o_dtype, ob);
  out.lse.assign(size_t(c.heads) * dev.p.lse_head_stride, 0.f);
  // Padding between heads of lse is never written; keep it out of the comparison's reach.
  CUDA_ASSERT(cudaMemcpy(out.lse.data(), dev.lse.ptr, out.lse.size() * sizeof(float),
                         cudaMemcpyDeviceToHost));
}

enum class Kernel { kPrefill, kDecode };

// Runs one case on one kernel: the prefill kernel `prefill` (kSm80 or kSm90) or decode.
void run_one(const Case& c, const Inputs& in, const Outputs& ref, const Outputs& naive,
             Kernel kernel, AttnKernel prefill) {
  SCOPED_TRACE(describe(c) + (kernel == Kernel::kDecode                ? " [decode]"
                              : prefill == AttnKernel::kSm90         ? " [prefill sm90]"
                              : prefill == AttnKernel::kSm90Rows128  ? " [prefill sm90 128 rows]"
                              : prefill == AttnKernel::kSm90Rows192  ? " [prefill sm90 192 rows]"
                                                                     : " [prefill sm80]"));
  Outputs ours;
  Device dev;
  to_device(in, c, dev);
  if (::testing::Test::HasFatalFailure()) return;
  poison(dev, c);
  if (::testing::Test::HasFatalFailure()) return;
  if (kernel == Kernel::kPrefill) {
    CUDA_ASSERT(attention_cuda(dev.p, nullptr, prefill));
  } else {
    const size_t ws_bytes = attention_decode_workspace_bytes(dev.p);
    ASSERT_GT(ws_bytes, 0u);
    DevBuf ws;
    CUDA_ASSERT(cudaMalloc(&ws.ptr, ws_bytes));
    CUDA_ASSERT(attention_decode_cuda(dev.p, ws.ptr, ws_bytes, nullptr));
    CUDA_ASSERT(cudaDeviceSynchronize());
  }
  CUDA_ASSERT(cudaGetLastError());
  CUDA_ASSERT(cudaDeviceSynchronize());
  fetch(dev, c, ours);
  if (::testing::Test::HasFatalFailure()) return;
  const Errors en = compare(in.p, naive, ref, "naive");
  if (kernel == Kernel::kPrefill) {
    auto same_bits = [](const Outputs& a, const Outputs& b) {
      return a.o.size() == b.o.size() && a.lse.size() == b.lse.size() &&
             std::memcmp(a.o.data(), b.o.data(), a.o.size() * 4) == 0 &&
             std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4) == 0;
    };
    auto again = [&](bool beside, Outputs& out) {
      poison(dev, c);
      if (::testing::Test::HasFatalFailure()) return;
      dev.p.beside_transfer = beside;
      CUDA_ASSERT(attention_cuda(dev.p, nullptr, prefill));
      CUDA_ASSERT(cudaDeviceSynchronize());
      dev.p.beside_transfer = false;
      fetch(dev, c, out);
    };
    // Beside a ring transfer the tiles are scheduled otherwise (AttnParams::beside_transfer):
    // the same bits, unless the launch without it cut its last round's tiles over keys (the
    // Hopper kernel's split tail), whose merge rounds otherwise; that launch repeated gives
    // the same bits (its parts merge in a fixed order, whichever finishes last).
    Outputs beside;
    again(true, beside);
    if (::testing::Test::HasFatalFailure()) return;
    if (attention_sm90_split_parts(dev.p, prefill) > 1) {
      expect_within_rule(compare(in.p, beside, ref, "beside"), en, describe(c) + " beside");
      Outputs repeat;
      again(false, repeat);
      if (::testing::Test::HasFatalFailure()) return;
      EXPECT_TRUE(same_bits(repeat, ours)) << "a split launch repeated changed the result";
    } else {
      EXPECT_TRUE(same_bits(beside, ours)) << "beside_transfer changed the result";
    }
  }
  const Errors eo = compare(in.p, ours, ref, "ours");
  expect_within_rule(eo, en, describe(c));
}

// Every prefill case runs on every prefill kernel the device has (the mma.sync kernel
// everywhere, the wgmma kernel on compute capability 9.0, at head_dim 64 also with each of its
// query tiles forced: the launch picks one by the shape, so a test shape alone may miss one).
void run_case(const Case& c, Kernel kernel, uint32_t seed) {
  const Inputs in = make_inputs(c, seed);
  Outputs ref, naive;
  references(in, c.dtype, c.o_dtype, ref, naive);
  if (kernel == Kernel::kDecode) {
    run_one(c, in, ref, naive, kernel, AttnKernel::kAuto);
    return;
  }
  run_one(c, in, ref, naive, kernel, AttnKernel::kSm80);
  if (::testing::Test::HasFatalFailure()) return;
  if (!attention_sm90_supported(in.p)) return;
  run_one(c, in, ref, naive, kernel, AttnKernel::kSm90);
  if (c.head_dim != 64) return;
  for (AttnKernel forced : {AttnKernel::kSm90Rows128, AttnKernel::kSm90Rows192}) {
    if (::testing::Test::HasFatalFailure()) return;
    run_one(c, in, ref, naive, kernel, forced);
  }
}

constexpr int kOddSizes[] = {1, 7, 37, 127, 769, 4095};

TEST_F(GpuAttention, OddSizesFullAndCausal) {
  uint32_t seed = 1;
  for (int n_q : kOddSizes) {
    for (int n_kv : kOddSizes) {
      for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
        // Causal with the last query aligned to the last key (chunked prefill) when there are
        // more keys than queries, else both from 0 (some queries see every key).
        const int64_t q_start = std::max(0, n_kv - n_q);
        run_case({"odd", n_q, n_kv, 3, 1, 128, mask, q_start, 0}, Kernel::kPrefill, seed++);
        if (HasFailure()) return;
      }
    }
  }
}

// head_dim 64 (both kernels on Hopper): odd sizes, GQA, rows that see nothing, and queries in
// the middle of the keys (chunked prefill).
TEST_F(GpuAttention, HeadDim64OddSizesGqaAndEmptyRows) {
  uint32_t seed = 101;
  for (int n_q : {1, 127, 769}) {
    for (int n_kv : {37, 769, 4095}) {
      for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
        const int64_t q_start = std::max(0, n_kv - n_q);
        run_case({"d64-odd", n_q, n_kv, 3, 1, 64, mask, q_start, 0}, Kernel::kPrefill, seed++);
        if (HasFailure()) return;
      }
    }
  }
  run_case({"d64-gqa8/2", 769, 1500, 8, 2, 64, MaskKind::kCausal, 731, 0}, Kernel::kPrefill,
           seed++);
  run_case({"d64-empty-rows", 769, 769, 3, 1, 64, MaskKind::kCausal, 0, 300}, Kernel::kPrefill,
           seed++);
  run_case({"d64-no-keys", 37, 0, 3, 1, 64, MaskKind::kNone}, Kernel::kPrefill, seed++);
}

// The Hopper kernel's split tail (attention_sm90.cu, TileOrder): a persistent full launch
// whose last round is short of whole deals that round's key blocks out to its CTAs and merges
// each tile's pieces. Head counts are searched so that each shape splits on this device (the
// plan depends on its multiprocessor count): whole rounds before the split (4095 x 64 heads'
// 192-row tiles, the 4K benchmark's shape at fewer heads), none before it, a short first block
// beside the pieces, CTAs whose share spans two tiles, GQA, fp16 with fp32 O, padded strides.
// Each case also runs every other kernel (run_case).
TEST_F(GpuAttention, SplitTailOverKeysMatchesReference) {
  if (!attention_sm90_supported(case_params({"probe", 1, 1, 1, 1, 128, MaskKind::kNone}))) {
    GTEST_SKIP() << "the split tail is the Hopper kernel's (compute capability 9.0)";
  }
  struct Shape {
    Case c;
    bool whole_rounds;  // at least one whole round of full tiles before the split
    // More full tiles left over than half the multiprocessors free beside the short blocks:
    // no tile can go to two CTAs whole, so CTAs' shares end in one tile and go on in the next.
    bool across_tiles;
  };
  std::vector<Shape> shapes = {
      {{"split-d64", 4095, 4095, 0, 0, 64, MaskKind::kNone}, true, false},
      {{"split-d128-f16-of32", 2000, 3000, 0, 0, 128, MaskKind::kNone}, true, false},
      {{"split-d128-padded", 769, 1500, 0, 0, 128, MaskKind::kNone}, false, false},
      {{"split-d64-small", 1000, 2047, 0, 0, 64, MaskKind::kNone}, false, false},
      {{"split-d128-of32", 2000, 3000, 0, 0, 128, MaskKind::kNone}, true, false},
      {{"across-d128", 1024, 3001, 0, 0, 128, MaskKind::kNone}, true, true},
      {{"across-d64-short", 1000, 2047, 0, 0, 64, MaskKind::kNone}, false, true},
      {{"across-d128-of32", 1024, 1700, 0, 0, 128, MaskKind::kNone}, false, true},
  };
  shapes[4].c.o_dtype = DType::kF32;
  shapes[7].c.o_dtype = DType::kF32;
  shapes[1].c.dtype = DType::kF16;
  shapes[1].c.o_dtype = DType::kF32;
  shapes[2].c.padded = true;
  int sms = 0;
  device_sms(sms);
  if (HasFatalFailure()) return;
  uint32_t seed = 401;
  for (Shape& s : shapes) {
    Case& c = s.c;
    // The fewest heads (GQA 2:1 where 2 divides them) whose launch splits, with whole rounds
    // before it where the shape asks for them.
    int parts = 1;
    for (int heads = 2; heads <= 64 && parts < 2; ++heads) {
      c.heads = heads;
      c.kv_heads = heads % 2 == 0 ? heads / 2 : heads;
      const AttnParams p = plan_params(c);
      const int rows = attention_sm90_schedule(p, AttnKernel::kSm90, sms).rows;
      ASSERT_GT(rows, 0) << c.name << ": no Hopper launch planned";
      const int full = c.n_q / rows * heads, short_tiles = c.n_q % rows != 0 ? heads : 0;
      if (s.whole_rounds && full < sms) continue;
      if (s.across_tiles && (full % sms) * 2 <= sms - short_tiles) continue;
      parts = attention_sm90_split_parts(p, AttnKernel::kSm90);
    }
    ASSERT_GE(parts, 2) << c.name << ": no head count up to 64 splits on " << sms
                        << " multiprocessors";
    run_case(c, Kernel::kPrefill, seed++);
    if (HasFailure()) return;
  }
}

// The Hopper kernel's schedule (attention_sm90_schedule: TileOrder and plan_launch, on the host,
// no device needed) over many shapes and multiprocessor counts: every tile computed exactly
// once, whole or as pieces that cover its key blocks once, in key order, with consistent merge
// slots; no launch slower than whole tiles dealt round-robin. The GPU test above checks the
// kernel's numbers on the shapes this device splits.
TEST(Sm90Schedule, EveryKeyBlockOnceAndPiecesMerge) {
  int schedules = 0, split = 0, across = 0;
  for (int sms : {132, 114, 78}) {
    for (int head_dim : {64, 128}) {
      for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
        for (AttnKernel kernel : {AttnKernel::kSm90, AttnKernel::kSm90Rows128}) {
          for (int n_q : {37, 1000, 1024, 4095, 4096}) {
            for (int n_kv : {127, 3001, 4096}) {
              for (int heads : {1, 9, 26, 64}) {
                const AttnParams p =
                    plan_params({"schedule", n_q, n_kv, heads, heads, head_dim, mask});
                const Sm90Schedule s = attention_sm90_schedule(p, kernel, sms);
                const std::string what = "sms " + std::to_string(sms) + " d " +
                                         std::to_string(head_dim) + " n_q " + std::to_string(n_q) +
                                         " n_kv " + std::to_string(n_kv) + " heads " +
                                         std::to_string(heads) +
                                         (mask == MaskKind::kCausal ? " causal" : " full");
                ASSERT_TRUE(s.rows == 128 || (s.rows == 192 && head_dim == 64)) << what;
                ASSERT_EQ(s.m_blocks, (n_q + s.rows - 1) / s.rows) << what;
                ASSERT_GT(s.ctas, 0) << what;
                ++schedules;
                const int tiles = s.m_blocks * heads, nb = (n_kv + 127) / 128;
                std::vector<int> whole(tiles, 0);
                std::vector<std::vector<Sm90Work>> pieces(tiles);
                std::vector<int64_t> cta_blocks(s.ctas, 0);
                int last_cta = -1, next_round = 0, last_piece_tile = -1;
                for (const Sm90Work& w : s.work) {
                  ASSERT_TRUE(w.cta >= 0 && w.cta < s.ctas && w.tile >= 0 && w.tile < tiles)
                      << what;
                  if (w.cta != last_cta) {
                    ASSERT_GT(w.cta, last_cta) << what;
                    last_cta = w.cta;
                    next_round = 0;
                    last_piece_tile = -1;
                  }
                  ASSERT_EQ(w.round, next_round++) << what << ": rounds of CTA " << w.cta;
                  if (w.part < 0) {
                    ++whole[w.tile];
                    cta_blocks[w.cta] += nb;
                    continue;
                  }
                  ASSERT_EQ(mask, MaskKind::kNone) << what << ": a causal launch split";
                  ASSERT_TRUE(w.parts >= 2 && w.parts <= 4 && w.part < w.parts) << what;
                  ASSERT_TRUE(w.lo >= 0 && w.lo < w.hi && w.hi <= nb) << what;
                  ASSERT_LE(w.slot + w.parts, 2 * sms) << what;
                  pieces[w.tile].push_back(w);
                  cta_blocks[w.cta] += w.hi - w.lo;
                  if (last_piece_tile >= 0 && last_piece_tile != w.tile) ++across;
                  last_piece_tile = w.tile;
                }
                std::vector<int> slot_owner(2 * sms, -1);
                for (int t = 0; t < tiles; ++t) {
                  std::vector<Sm90Work>& ps = pieces[t];
                  if (ps.empty()) {
                    ASSERT_EQ(whole[t], 1) << what << ": tile " << t;
                    continue;
                  }
                  ++split;
                  ASSERT_EQ(whole[t], 0) << what << ": tile " << t << " whole and cut";
                  ASSERT_EQ(static_cast<int>(ps.size()), ps[0].parts) << what << ": tile " << t;
                  std::sort(ps.begin(), ps.end(),
                            [](const Sm90Work& a, const Sm90Work& b) { return a.part < b.part; });
                  for (int q = 0; q < ps[0].parts; ++q) {
                    const Sm90Work& w = ps[q];
                    ASSERT_TRUE(w.part == q && w.parts == ps[0].parts && w.slot == ps[0].slot)
                        << what << ": tile " << t;
                    ASSERT_EQ(w.lo, q == 0 ? 0 : ps[q - 1].hi) << what << ": tile " << t;
                    ASSERT_EQ(slot_owner[w.slot + q], -1) << what << ": slot shared";
                    slot_owner[w.slot + q] = t;
                  }
                  ASSERT_EQ(ps.back().hi, nb) << what << ": tile " << t;
                }
                if (mask == MaskKind::kNone) {
                  const int64_t round_robin = int64_t{(tiles + s.ctas - 1) / s.ctas} * nb;
                  EXPECT_LE(*std::max_element(cta_blocks.begin(), cta_blocks.end()), round_robin)
                      << what;
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("[ info     ] %d schedules, %d tiles cut, %d shares spanning two tiles\n", schedules,
              split, across);
  // The shapes above include tails cut in equal parts and shares that span two tiles.
  EXPECT_GT(split, 0) << "no schedule cut a tile (" << schedules << " schedules)";
  EXPECT_GT(across, 0) << "no CTA's share went on from one tile into the next";
}

// The mma.sync kernel starts causal CTAs heads first where each CTA slot's share of the work
// is short, head after head otherwise (attention_sm80_heads_first). A causal GQA launch of
// enough heads to go head after head on this device: sampled heads carry the bits of the same
// head launched alone (heads first), and meet the fp32 reference by the 2x-naive rule.
TEST_F(GpuAttention, Sm80CausalOrderKeepsTheBits) {
  int sms = 0;
  device_sms(sms);
  if (HasFatalFailure()) return;
  // Three query blocks (the last of 44 rows) from position 0: the first sees 128 keys, the
  // last 300 (heads first needs the last to see at least 1.5x the first's).
  const Case one{"sm80-order-one", 300, 300, 1, 1, 64, MaskKind::kCausal, 0, 0};
  ASSERT_TRUE(attention_sm80_heads_first(plan_params(one), sms));
  // A chunk after a longer prefix (blocks of nearly equal work) goes head after head.
  const Case chunk{"sm80-order-chunk", 300, 700, 1, 1, 64, MaskKind::kCausal, 400, 0};
  EXPECT_FALSE(attention_sm80_heads_first(plan_params(chunk), sms));
  Case c = one;
  c.name = "sm80-order";
  c.heads = 256;
  while (attention_sm80_heads_first(plan_params(c), sms)) c.heads += 256;
  c.kv_heads = c.heads / 2;
  ASSERT_FALSE(attention_sm80_heads_first(plan_params(c), sms)) << describe(c);
  SCOPED_TRACE(describe(c));

  const Inputs in = make_inputs(c, 41);
  Device dev;
  to_device(in, c, dev);
  if (HasFatalFailure()) return;
  poison(dev, c);
  if (HasFatalFailure()) return;
  CUDA_ASSERT(attention_cuda(dev.p, nullptr, AttnKernel::kSm80));
  CUDA_ASSERT(cudaDeviceSynchronize());
  Outputs all;
  fetch(dev, c, all);
  if (HasFatalFailure()) return;

  const int d = c.head_dim, group = c.heads / c.kv_heads;
  const size_t elem = testing::dtype_bytes(c.dtype);
  for (int h : {0, 1, c.heads / 2 + 1, c.heads - 1}) {
    SCOPED_TRACE("head " + std::to_string(h));
    // Head h alone: its rows of q, its group's k and v, through the big launch's strides.
    Device alone;
    alone.p = dev.p;
    alone.p.heads = alone.p.kv_heads = 1;
    alone.p.q = static_cast<const char*>(dev.p.q) + h * dev.p.q_head_stride * elem;
    alone.p.k = static_cast<const char*>(dev.p.k) + (h / group) * dev.p.k_head_stride * elem;
    alone.p.v = static_cast<const char*>(dev.p.v) + (h / group) * dev.p.v_head_stride * elem;
    alone.p.o_row_stride = alone.p.o_head_stride = d;
    alone.p.lse_head_stride = c.n_q;
    ASSERT_TRUE(attention_sm80_heads_first(alone.p, sms));
    ASSERT_EQ(cudaMalloc(&alone.o.ptr, size_t(c.n_q) * d * elem), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&alone.lse.ptr, size_t(c.n_q) * sizeof(float)), cudaSuccess);
    alone.p.o = alone.o.ptr;
    alone.p.lse = static_cast<float*>(alone.lse.ptr);
    CUDA_ASSERT(attention_cuda(alone.p, nullptr, AttnKernel::kSm80));
    CUDA_ASSERT(cudaDeviceSynchronize());
    Case c1 = one;
    Outputs got, by_itself;
    fetch(alone, c1, by_itself);
    if (HasFatalFailure()) return;

    // Head h of the big launch, and its inputs as a one-head case for the references.
    Inputs in1;
    in1.p = case_params(c1);
    for (int i = 0; i < c.n_q; ++i) {
      const float* row = in.q.data() + i * in.p.q_row_stride + h * in.p.q_head_stride;
      in1.q.insert(in1.q.end(), row, row + d);
      for (int j = 0; j < d; ++j) {
        got.o.push_back(all.o[(size_t(i) * c.heads + h) * d + j]);
      }
      got.lse.push_back(all.lse[size_t(h) * dev.p.lse_head_stride + i]);
    }
    for (int i = 0; i < c.n_kv; ++i) {
      const float* k = in.k.data() + i * in.p.k_row_stride + (h / group) * in.p.k_head_stride;
      const float* v = in.v.data() + i * in.p.v_row_stride + (h / group) * in.p.v_head_stride;
      in1.k.insert(in1.k.end(), k, k + d);
      in1.v.insert(in1.v.end(), v, v + d);
    }
    EXPECT_TRUE(got.o == by_itself.o) << "O differs from the head launched alone";
    EXPECT_TRUE(got.lse == by_itself.lse) << "LSE differs from the head launched alone";
    Outputs ref, naive;
    references(in1, c.dtype, c.o_dtype, ref, naive);
    expect_within_rule(compare(in1.p, got, ref, "ours"), compare(in1.p, naive, ref, "naive"),
                       describe(c1));
  }
}

TEST_F(GpuAttention, GqaLlamaShapes) {
  run_case({"gqa32/8", 769, 769, 32, 8, 128, MaskKind::kCausal}, Kernel::kPrefill, 11);
  run_case({"gqa32/8", 127, 4095, 32, 8, 128, MaskKind::kNone}, Kernel::kPrefill, 12);
  run_case({"mha32", 37, 769, 32, 32, 128, MaskKind::kCausal, 732, 0}, Kernel::kPrefill, 13);
}

TEST_F(GpuAttention, EmptyRowsAndSkippedBlocks) {
  // Keys start at 300: rows 0..299 see nothing (the first two 128-row blocks never load a
  // key), later blocks skip the key blocks after their last row.
  run_case({"empty-rows", 769, 769, 3, 1, 128, MaskKind::kCausal, 0, 300}, Kernel::kPrefill, 21);
  // Every key after every query: all rows empty.
  run_case({"all-empty", 37, 127, 3, 1, 128, MaskKind::kCausal, 0, 100}, Kernel::kPrefill, 22);
  // No keys at all (k, v null).
  run_case({"no-keys", 37, 0, 3, 1, 128, MaskKind::kNone}, Kernel::kPrefill, 23);
  // Every key before every query: causal acts as full.
  run_case({"kv-before", 127, 769, 3, 1, 128, MaskKind::kCausal, 10000, 0}, Kernel::kPrefill,
           24);
  // Positions past 2^32 (int64 arithmetic), diagonal mid-block.
  const int64_t big = 5'000'000'000;
  run_case({"big-positions", 769, 1500, 3, 1, 128, MaskKind::kCausal, big, big - 1000},
           Kernel::kPrefill, 25);
}

TEST_F(GpuAttention, DtypesHeadDimsAndStrides) {
  Case c{"fp16-d64", 769, 4095, 3, 1, 64, MaskKind::kCausal, 3326, 0};
  c.dtype = c.o_dtype = DType::kF16;
  run_case(c, Kernel::kPrefill, 31);
  Case c2{"bf16-d64-full", 4095, 37, 1, 1, 64, MaskKind::kNone};
  run_case(c2, Kernel::kPrefill, 32);
  Case c3{"bf16-o-f32", 769, 769, 32, 8, 128, MaskKind::kCausal, 0, 0};
  c3.o_dtype = DType::kF32;
  run_case(c3, Kernel::kPrefill, 33);
  Case c4{"fp16-d64-o-f32", 127, 769, 3, 1, 64, MaskKind::kNone};
  c4.dtype = DType::kF16;
  c4.o_dtype = DType::kF32;
  run_case(c4, Kernel::kPrefill, 34);
  Case c5{"padded-strides", 769, 769, 6, 2, 128, MaskKind::kCausal, 100, 0};
  c5.padded = true;
  run_case(c5, Kernel::kPrefill, 35);
}

TEST_F(GpuAttention, RejectsUnsupportedParams) {
  AttnParams p;
  p.n_q = 1;
  p.n_kv = 1;
  p.heads = p.kv_heads = 1;
  p.head_dim = 96;  // not instantiated
  p.scale = 0.1f;
  p.dtype = DType::kBF16;
  set_packed_strides(p);
  DevBuf buf;
  CUDA_ASSERT(cudaMalloc(&buf.ptr, 4096));
  p.q = p.k = p.v = p.o = buf.ptr;
  p.lse = static_cast<float*>(buf.ptr);
  EXPECT_EQ(attention_cuda(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 128;
  p.dtype = DType::kF32;  // fp32 inputs have no tensor-core path
  EXPECT_EQ(attention_cuda(p, nullptr), cudaErrorInvalidValue);
  p.dtype = DType::kBF16;
  set_packed_strides(p);
  p.q = static_cast<char*>(buf.ptr) + 2;  // misaligned for 16-byte loads
  EXPECT_EQ(attention_cuda(p, nullptr), cudaErrorInvalidValue);
  // The wgmma kernel runs on compute capability 9.0 only (head_dim 64 and 128).
  p.q = buf.ptr;
  p.head_dim = 64;
  set_packed_strides(p);
  int dev = 0, major = 0, minor = 0;
  CUDA_ASSERT(cudaGetDevice(&dev));
  CUDA_ASSERT(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_ASSERT(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm90),
            major == 9 && minor == 0 ? cudaSuccess : cudaErrorInvalidDeviceFunction);
  EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm80), cudaSuccess);
  // 192-row query tiles exist at head_dim 64 only.
  if (major == 9 && minor == 0) {
    EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm90Rows192), cudaSuccess);
    p.head_dim = 128;
    set_packed_strides(p);
    EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm90Rows192), cudaErrorInvalidValue);
    EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm90Rows128), cudaSuccess);
  } else {
    EXPECT_EQ(attention_cuda(p, nullptr, AttnKernel::kSm90Rows192),
              cudaErrorInvalidDeviceFunction);
  }
  CUDA_ASSERT(cudaDeviceSynchronize());
  CUDA_ASSERT(cudaGetLastError());
}

TEST_F(GpuAttention, DecodeSplitKv) {
  uint32_t seed = 41;
  for (int n_q : {1, 3}) {
    for (int n_kv : {1, 37, 4095, 70001}) {
      run_case({"decode", n_q, n_kv, 32, 8, 128, MaskKind::kNone}, Kernel::kDecode, seed++);
      Case c{"decode-fp16-d64", n_q, n_kv, 3, 1, 64, MaskKind::kNone};
      c.dtype = c.o_dtype = DType::kF16;
      run_case(c, Kernel::kDecode, seed++);
    }
  }
  Case f{"decode-o-f32", 1, 4095, 32, 8, 128, MaskKind::kNone};
  f.o_dtype = DType::kF32;
  run_case(f, Kernel::kDecode, 51);
  // Causal decode: query 0 sees keys up to position 1999 of 3000, query 1 none.
  Case causal{"decode-causal", 2, 3000, 8, 2, 128, MaskKind::kCausal, 1999, 0};
  run_case(causal, Kernel::kDecode, 52);
  Case empty{"decode-causal-empty", 2, 3000, 8, 2, 128, MaskKind::kCausal, 0, 5000};
  run_case(empty, Kernel::kDecode, 53);
  run_case({"decode-no-keys", 1, 0, 8, 2, 128, MaskKind::kNone}, Kernel::kDecode, 54);
  Case padded{"decode-padded", 2, 777, 6, 2, 128, MaskKind::kNone};
  padded.padded = true;
  run_case(padded, Kernel::kDecode, 55);
}

// Paged K/V (the server's KV cache): rows scattered over shuffled pages give exactly the bits
// of the contiguous layout (the kernel visits the same keys in the same order); unused pool
// rows hold NaN, so reading a wrong row cannot go unnoticed. A page size that a warp tile
// would cross is refused.
TEST_F(GpuAttention, DecodePagedEqualsContiguous) {
  const int heads = 32, kv_heads = 8, d = 128, page = 256;
  for (int n_kv : {1, 255, 4097, 70001}) {
    std::mt19937 rng(71 + n_kv);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t row = int64_t{kv_heads} * d;
    std::vector<float> q(size_t(heads) * d), kv(size_t(n_kv) * row * 2);
    for (auto& x : q) x = nd(rng);
    for (auto& x : kv) x = nd(rng);
    const int used = (n_kv + page - 1) / page, pool_pages = used + 5;
    std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
    for (int i = 0; i < pool_pages; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const std::vector<int32_t> table(perm.begin(), perm.begin() + used);
    const auto qb = encode(DType::kBF16, q);
    const auto kvb = encode(DType::kBF16, kv);  // K rows then V rows
    const size_t row_bytes = size_t(row) * 2, pool_rows = size_t(pool_pages) * page;
    std::vector<uint8_t> pool(pool_rows * row_bytes * 2, 0xFF);  // bf16 0xFFFF is a NaN
    for (int j = 0; j < n_kv; ++j) {
      const size_t dst = size_t(table[size_t(j) / page]) * page + size_t(j) % page;
      for (int kvi = 0; kvi < 2; ++kvi) {
        std::memcpy(&pool[(kvi * pool_rows + dst) * row_bytes],
                    &kvb[(size_t(kvi) * n_kv + j) * row_bytes], row_bytes);
      }
    }
    DevBuf dq, dkv, dpool, dtable, dout, dws;
    CUDA_ASSERT(cudaMalloc(&dq.ptr, qb.size()));
    CUDA_ASSERT(cudaMalloc(&dkv.ptr, kvb.size()));
    CUDA_ASSERT(cudaMalloc(&dpool.ptr, pool.size()));
    CUDA_ASSERT(cudaMalloc(&dtable.ptr, table.size() * 4));
    CUDA_ASSERT(cudaMalloc(&dout.ptr, 2 * (size_t(heads) * d * 2 + heads * 4)));
    CUDA_ASSERT(cudaMemcpy(dq.ptr, qb.data(), qb.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dkv.ptr, kvb.data(), kvb.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dpool.ptr, pool.data(), pool.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dtable.ptr, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    std::vector<std::vector<uint8_t>> got(2);
    for (int paged = 0; paged < 2; ++paged) {
      AttnParams p;
      p.n_q = 1;
      p.n_kv = n_kv;
      p.heads = heads;
      p.kv_heads = kv_heads;
      p.head_dim = d;
      set_packed_strides(p);
      p.scale = 1.f / std::sqrt(float(d));
      p.mask = MaskKind::kNone;
      p.dtype = DType::kBF16;
      p.q = dq.ptr;
      char* base = static_cast<char*>(paged ? dpool.ptr : dkv.ptr);
      p.k = base;
      p.v = base + (paged ? pool_rows : size_t(n_kv)) * row_bytes;
      if (paged) {
        p.kv_pages = static_cast<const int32_t*>(dtable.ptr);
        p.page_size = page;
      }
      char* o = static_cast<char*>(dout.ptr) + paged * (size_t(heads) * d * 2 + heads * 4);
      p.o = o;
      p.lse = reinterpret_cast<float*>(o + size_t(heads) * d * 2);
      const size_t ws = attention_decode_workspace_bytes(p);
      ASSERT_GT(ws, 0u);
      if (!dws.ptr) CUDA_ASSERT(cudaMalloc(&dws.ptr, size_t(64) << 20));
      ASSERT_LE(ws, size_t(64) << 20);
      CUDA_ASSERT(attention_decode_cuda(p, dws.ptr, ws, nullptr));
      CUDA_ASSERT(cudaDeviceSynchronize());
      got[size_t(paged)].resize(size_t(heads) * d * 2 + heads * 4);
      CUDA_ASSERT(cudaMemcpy(got[size_t(paged)].data(), o, got[size_t(paged)].size(),
                             cudaMemcpyDeviceToHost));
      if (paged) {
        p.page_size = 16;  // a 32-key warp tile would cross pages
        EXPECT_EQ(attention_decode_cuda(p, dws.ptr, ws, nullptr), cudaErrorInvalidValue);
      }
    }
    EXPECT_EQ(got[0], got[1]) << "n_kv " << n_kv << ": paged output differs from contiguous";
    const auto o = decode(DType::kBF16, std::vector<uint8_t>(got[1].begin(),
                                                             got[1].begin() + heads * d * 2));
    for (float x : o) ASSERT_TRUE(std::isfinite(x)) << "n_kv " << n_kv;
  }
}

// Batched decode: five sequences of different lengths, each with its own shuffled pages in one
// pool, in ONE launch (per-row K/V) give each sequence's single-launch result (fp32 O and LSE;
// the split count differs between the two, so the fp32 merge order does: 1e-5 relative).
TEST_F(GpuAttention, DecodeBatchedPerRowEqualsOneLaunchEach) {
  const int heads = 32, kv_heads = 8, d = 128, page = 256;
  const std::vector<int> lens = {1, 37, 300, 4097, 70001};
  const int n = static_cast<int>(lens.size());
  std::mt19937 rng(91);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t row = int64_t{kv_heads} * d;
  const size_t row_bytes = size_t(row) * 2;
  int total_pages = 0;
  for (int l : lens) total_pages += (l + page - 1) / page;
  const int pool_pages = total_pages + 3;
  std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
  for (int i = 0; i < pool_pages; ++i) perm[size_t(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  // Host layout of the metadata: page tables, then row_kv_len[n], then row_page_offset[n].
  std::vector<int32_t> meta;
  std::vector<int32_t> offsets;
  size_t next = 0;
  for (int l : lens) {
    offsets.push_back(static_cast<int32_t>(meta.size()));
    for (int pg = 0; pg < (l + page - 1) / page; ++pg) meta.push_back(perm[next++]);
  }
  const int32_t lens_at = static_cast<int32_t>(meta.size());
  meta.insert(meta.end(), lens.begin(), lens.end());
  meta.insert(meta.end(), offsets.begin(), offsets.end());
  const size_t pool_rows = size_t(pool_pages) * page;
  std::vector<float> q(size_t(n) * heads * d);
  for (auto& x : q) x = nd(rng);
  std::vector<float> pool_f(pool_rows * row * 2);
  for (auto& x : pool_f) x = nd(rng);
  const auto qb = encode(DType::kBF16, q);
  const auto poolb = encode(DType::kBF16, pool_f);
  DevBuf dq, dpool, dmeta, dout, dws;
  const size_t o_bytes = size_t(n) * heads * d * 4, lse_bytes = size_t(n) * heads * 4;
  CUDA_ASSERT(cudaMalloc(&dq.ptr, qb.size()));
  CUDA_ASSERT(cudaMalloc(&dpool.ptr, poolb.size()));
  CUDA_ASSERT(cudaMalloc(&dmeta.ptr, meta.size() * 4));
  CUDA_ASSERT(cudaMalloc(&dout.ptr, 2 * (o_bytes + lse_bytes)));
  CUDA_ASSERT(cudaMalloc(&dws.ptr, size_t(256) << 20));
  CUDA_ASSERT(cudaMemcpy(dq.ptr, qb.data(), qb.size(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(dpool.ptr, poolb.data(), poolb.size(), cudaMemcpyHostToDevice));
  CUDA_ASSERT(cudaMemcpy(dmeta.ptr, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
  const auto* dm = static_cast<const int32_t*>(dmeta.ptr);
  auto base_params = [&](int n_q) {
    AttnParams p;
    p.n_q = n_q;
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.head_dim = d;
    set_packed_strides(p);
    p.scale = 1.f / std::sqrt(float(d));
    p.mask = MaskKind::kNone;
    p.dtype = DType::kBF16;
    p.o_dtype = DType::kF32;
    p.k = dpool.ptr;
    p.v = static_cast<char*>(dpool.ptr) + pool_rows * row_bytes;
    p.page_size = page;
    return p;
  };
  char* out0 = static_cast<char*>(dout.ptr);
  char* out1 = out0 + o_bytes + lse_bytes;
  // One launch for all: q rows 0..n-1, lse [heads, n].
  AttnParams all = base_params(n);
  all.n_kv = *std::max_element(lens.begin(), lens.end());
  all.q = dq.ptr;
  all.kv_pages = dm;
  all.row_kv_len = dm + lens_at;
  all.row_page_offset = dm + lens_at + n;
  all.o = out0;
  all.lse = reinterpret_cast<float*>(out0 + o_bytes);
  size_t ws = attention_decode_workspace_bytes(all);
  ASSERT_GT(ws, 0u);
  ASSERT_LE(ws, size_t(256) << 20);
  CUDA_ASSERT(attention_decode_cuda(all, dws.ptr, ws, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  // One launch each, written into the same layout.
  for (int b = 0; b < n; ++b) {
    AttnParams one = base_params(1);
    one.n_kv = lens[size_t(b)];
    one.q = static_cast<const char*>(dq.ptr) + size_t(b) * heads * d * 2;
    one.kv_pages = dm + offsets[size_t(b)];
    one.o = out1 + size_t(b) * heads * d * 4;
    one.lse = reinterpret_cast<float*>(out1 + o_bytes) + b;
    one.lse_head_stride = n;
    ws = attention_decode_workspace_bytes(one);
    CUDA_ASSERT(attention_decode_cuda(one, dws.ptr, ws, nullptr));
    CUDA_ASSERT(cudaDeviceSynchronize());
  }
  std::vector<float> a((o_bytes + lse_bytes) / 4), e(a.size());
  CUDA_ASSERT(cudaMemcpy(a.data(), out0, o_bytes + lse_bytes, cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(e.data(), out1, o_bytes + lse_bytes, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a[i])) << i;
    worst = std::max(worst, std::fabs(double(a[i]) - e[i]) / (1.0 + std::fabs(double(e[i]))));
  }
  EXPECT_LE(worst, 1e-5) << "batched per-row decode differs from one launch per sequence";
  // Per-row K/V needs a page table and kNone.
  AttnParams bad = all;
  bad.mask = MaskKind::kCausal;
  EXPECT_EQ(attention_decode_cuda(bad, dws.ptr, ws, nullptr), cudaErrorInvalidValue);
}

// The decode kernel over FP8 KV rows (AttnParams::kv_fp8): paged, per-row K/V for several
// sequences in one launch and one launch each, GQA, head_dim 128 and 64, keys with outlier
// channels (a few channels 20x the rest, as LLaMA's K has). Against attention_cpu over the
// same rows (fp32 on their values): within 2x the error a naive bf16 attention over those
// values makes (P rounded to bf16 before P.V) plus 1e-5. And the FP8 cache's own error,
// against attention over the unrounded K/V, is reported beside that of a bf16 cache. One shape
// has V rows whose magnitude grows 2^20-fold along the pool (the kernel's fp16 P.V rescales
// its accumulator as the largest V scale grows), and fp16 q runs beside bf16.
TEST_F(GpuAttention, DecodeReadsFp8RowsAsTheirValues) {
  struct Shape {
    int heads, kv_heads, d;
    DType dtype;          // of q (the mma's inputs)
    bool growing_v = false;  // V row r times 2^(20 r / rows)
  };
  for (const Shape s : {Shape{32, 8, 128, DType::kBF16}, Shape{8, 2, 64, DType::kBF16},
                        Shape{4, 4, 128, DType::kBF16}, Shape{12, 4, 128, DType::kF16},
                        Shape{6, 2, 64, DType::kF16}, Shape{8, 2, 128, DType::kBF16, true}}) {
    SCOPED_TRACE("heads " + std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) +
                 " head_dim " + std::to_string(s.d) + (s.dtype == DType::kF16 ? " fp16" : "") +
                 (s.growing_v ? " growing V" : ""));
    const int page = 256;
    const std::vector<int> lens = {1, 37, 300, 4097, 20001};
    const int n = static_cast<int>(lens.size());
    std::mt19937 rng(7 + s.d);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int64_t kvw = int64_t{s.kv_heads} * s.d, qw = int64_t{s.heads} * s.d;
    const int64_t row_bytes = kv_fp8_row_bytes(s.kv_heads, s.d);
    int total_pages = 0;
    for (int l : lens) total_pages += (l + page - 1) / page;
    const int pool_pages = total_pages + 2;
    std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
    for (int i = 0; i < pool_pages; ++i) perm[size_t(i)] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int32_t> meta, offsets;
    size_t next = 0;
    for (int l : lens) {
      offsets.push_back(static_cast<int32_t>(meta.size()));
      for (int pg = 0; pg < (l + page - 1) / page; ++pg) meta.push_back(perm[next++]);
    }
    const int32_t lens_at = static_cast<int32_t>(meta.size());
    meta.insert(meta.end(), lens.begin(), lens.end());
    meta.insert(meta.end(), offsets.begin(), offsets.end());
    const int64_t pool_rows = int64_t{pool_pages} * page;
    std::vector<float> q(size_t(n) * qw), k(size_t(pool_rows) * kvw), v(k.size());
    for (auto& x : q) x = round_to(s.dtype, nd(rng));
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (int64_t r = 0; r < pool_rows; ++r) {  // outlier channels 3 and 77 of every head
      for (int g = 0; g < s.kv_heads; ++g) {
        for (int c : {3, 77 % s.d}) k[size_t(r * kvw + g * s.d + c)] *= 20.f;
      }
      if (s.growing_v) {
        const float f = std::exp2(20.f * float(r) / float(pool_rows));
        for (int64_t c = 0; c < kvw; ++c) v[size_t(r * kvw + c)] *= f;
      }
    }
    std::vector<uint8_t> kp(size_t(pool_rows * row_bytes)), vp(kp.size());
    quantize_kv_cpu(k.data(), pool_rows, s.kv_heads, s.d, nullptr, kp.data());
    quantize_kv_cpu(v.data(), pool_rows, s.kv_heads, s.d, nullptr, vp.data());
    DevBuf dq, dk, dv, dmeta, dout, dws;
    const size_t o_bytes = size_t(n) * qw * 4, lse_bytes = size_t(n) * s.heads * 4;
    upload(dq, encode(s.dtype, q));
    upload(dk, kp);
    upload(dv, vp);
    CUDA_ASSERT(cudaMalloc(&dmeta.ptr, meta.size() * 4));
    CUDA_ASSERT(cudaMemcpy(dmeta.ptr, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMalloc(&dout.ptr, 2 * (o_bytes + lse_bytes)));
    CUDA_ASSERT(cudaMalloc(&dws.ptr, size_t(256) << 20));
    const auto* dm = static_cast<const int32_t*>(dmeta.ptr);
    auto params = [&](int n_q) {
      AttnParams p;
      p.n_q = n_q;
      p.heads = s.heads;
      p.kv_heads = s.kv_heads;
      p.head_dim = s.d;
      set_packed_strides(p);
      p.k_row_stride = p.v_row_stride = row_bytes;
      p.kv_fp8 = true;
      p.scale = 1.f / std::sqrt(float(s.d));
      p.mask = MaskKind::kNone;
      p.dtype = s.dtype;
      p.o_dtype = DType::kF32;
      p.k = dk.ptr;
      p.v = dv.ptr;
      p.page_size = page;
      return p;
    };
    char* out0 = static_cast<char*>(dout.ptr);
    char* out1 = out0 + o_bytes + lse_bytes;
    AttnParams all = params(n);
    all.n_kv = *std::max_element(lens.begin(), lens.end());
    all.q = dq.ptr;
    all.kv_pages = dm;
    all.row_kv_len = dm + lens_at;
    all.row_page_offset = dm + lens_at + n;
    all.o = out0;
    all.lse = reinterpret_cast<float*>(out0 + o_bytes);
    size_t ws = attention_decode_workspace_bytes(all);
    ASSERT_GT(ws, 0u);
    CUDA_ASSERT(attention_decode_cuda(all, dws.ptr, ws, nullptr));
    for (int b = 0; b < n; ++b) {
      AttnParams one = params(1);
      one.n_kv = lens[size_t(b)];
      one.q = static_cast<const char*>(dq.ptr) + size_t(b) * qw * 2;
      one.kv_pages = dm + offsets[size_t(b)];
      one.o = out1 + size_t(b) * qw * 4;
      one.lse = reinterpret_cast<float*>(out1 + o_bytes) + b;
      one.lse_head_stride = n;
      ws = attention_decode_workspace_bytes(one);
      CUDA_ASSERT(attention_decode_cuda(one, dws.ptr, ws, nullptr));
    }
    CUDA_ASSERT(cudaDeviceSynchronize());
    std::vector<float> got(2 * (o_bytes + lse_bytes) / 4);
    CUDA_ASSERT(cudaMemcpy(got.data(), out0, got.size() * 4, cudaMemcpyDeviceToHost));
    // References per sequence: the CPU kernel over the same FP8 rows (its values in fp32), a
    // naive bf16 attention over those values, and attention over the unrounded K/V (fp32) and
    // over bf16 K/V (what a bf16 cache holds).
    double err_ours = 0, err_naive = 0, rmse_fp8 = 0, rmse_bf16 = 0, count = 0;
    double lse_ours = 0, lse_naive = 0;
    for (int b = 0; b < n; ++b) {
      const int len = lens[size_t(b)];
      std::vector<float> kd(size_t(len) * kvw), vd(kd.size()), ke(kd.size()), ve(kd.size());
      for (int j = 0; j < len; ++j) {
        const int64_t pr = int64_t{meta[size_t(offsets[size_t(b)] + j / page)]} * page + j % page;
        dequantize_kv_cpu(kp.data() + pr * row_bytes, 1, s.kv_heads, s.d, &kd[size_t(j) * kvw]);
        dequantize_kv_cpu(vp.data() + pr * row_bytes, 1, s.kv_heads, s.d, &vd[size_t(j) * kvw]);
        std::copy_n(&k[size_t(pr * kvw)], kvw, &ke[size_t(j) * kvw]);
        std::copy_n(&v[size_t(pr * kvw)], kvw, &ve[size_t(j) * kvw]);
      }
      const std::vector<float> qb(q.begin() + b * qw, q.begin() + (b + 1) * qw);
      Inputs in;
      in.q = qb;
      in.k = kd;
      in.v = vd;
      in.p.n_q = 1;
      in.p.n_kv = len;
      in.p.heads = s.heads;
      in.p.kv_heads = s.kv_heads;
      in.p.head_dim = s.d;
      set_packed_strides(in.p);
      in.p.scale = 1.f / std::sqrt(float(s.d));
      in.p.mask = MaskKind::kNone;
      Outputs ref, naive;
      references(in, s.dtype, DType::kF32, ref, naive);
      Inputs exact = in, bf16 = in;
      exact.k = ke;
      exact.v = ve;
      bf16.k = bf16.v = {};
      for (float x : ke) bf16.k.push_back(round_to(DType::kBF16, x));
      for (float x : ve) bf16.v.push_back(round_to(DType::kBF16, x));
      Outputs ref_exact, ref_bf16, unused;
      references(exact, s.dtype, DType::kF32, ref_exact, unused);
      references(bf16, s.dtype, DType::kF32, ref_bf16, unused);
      for (int h = 0; h < s.heads; ++h) {
        for (int launch = 0; launch < 2; ++launch) {
          const double g = got[size_t(launch * (o_bytes + lse_bytes) / 4 + o_bytes / 4 + h * n + b)];
          lse_ours = std::max(lse_ours, std::fabs(g - ref.lse[size_t(h)]));
        }
        lse_naive = std::max(lse_naive, std::fabs(double(naive.lse[size_t(h)]) - ref.lse[size_t(h)]));
      }
      for (int64_t c = 0; c < qw; ++c) {
        const double r = ref.o[size_t(c)];
        for (int launch = 0; launch < 2; ++launch) {
          const double g = got[size_t(launch * (o_bytes + lse_bytes) / 4 + b * qw + c)];
          ASSERT_TRUE(std::isfinite(g)) << "sequence " << b << " col " << c;
          err_ours = std::max(err_ours, std::fabs(g - r));
        }
        err_naive = std::max(err_naive, std::fabs(double(naive.o[size_t(c)]) - r));
        const double e = ref_exact.o[size_t(c)];
        rmse_fp8 += (r - e) * (r - e);
        rmse_bf16 += (double(ref_bf16.o[size_t(c)]) - e) * (double(ref_bf16.o[size_t(c)]) - e);
        count += 1;
      }
    }
    EXPECT_LE(err_ours, 2 * err_naive + 1e-5)
        << "fp8 decode max error " << err_ours << ", naive bf16 " << err_naive;
    EXPECT_LE(lse_ours, 2 * lse_naive + 1e-4) << "lse " << lse_ours << ", naive " << lse_naive;
    std::printf("fp8 KV decode, heads %d/%d head_dim %d%s: max error vs the CPU kernel %.3g "
                "(naive %s %.3g); output RMSE vs unrounded K/V: fp8 cache %.3g, bf16 cache "
                "%.3g\n",
                s.heads, s.kv_heads, s.d, s.growing_v ? " growing V" : "", err_ours,
                s.dtype == DType::kF16 ? "fp16" : "bf16", err_naive, std::sqrt(rmse_fp8 / count),
                std::sqrt(rmse_bf16 / count));
  }
}

// merge_into_o: attention over one part of the keys, then the other part merged into it by
// the kernel, equals one launch over all keys (the 2x-naive rule against the fp32 reference)
// and the unfused path (the second part into a partial, then merge_cuda) to fp32 rounding, on
// both prefill kernels. Causal, keys split at 900 with the diagonal at 731 + i: rows 0..168 see
// nothing of the second part, so one order merges empty partials into them (b empty) and the
// other merges into rows that saw nothing (a empty). The decode kernel and a 16-bit o refuse it.
TEST_F(GpuAttention, MergeIntoOEqualsOneLaunchOverAllKeys) {
  uint32_t seed = 61;
  for (int d : {128, 64}) {
    Case c{"merge-into-o", 769, 1500, 8, 2, d, MaskKind::kCausal, 731, 0};
    c.o_dtype = DType::kF32;
    const Inputs in = make_inputs(c, seed++);
    Outputs ref, naive;
    references(in, c.dtype, c.o_dtype, ref, naive);
    Device dev;
    to_device(in, c, dev);
    if (HasFatalFailure()) return;
    ASSERT_TRUE(attention_merges_into_o(dev.p));
    constexpr int kSplit = 900;
    AttnParams lo = dev.p, hi = dev.p;
    lo.n_kv = kSplit;
    hi.n_kv = c.n_kv - kSplit;
    hi.kv_start = c.kv_start + kSplit;
    hi.k = static_cast<const char*>(dev.p.k) + size_t{kSplit} * dev.p.k_row_stride * 2;
    hi.v = static_cast<const char*>(dev.p.v) + size_t{kSplit} * dev.p.v_row_stride * 2;
    const Errors en = compare(in.p, naive, ref, "naive");
    std::vector<AttnKernel> kernels = {AttnKernel::kSm80};
    if (attention_sm90_supported(dev.p)) kernels.push_back(AttnKernel::kSm90);
    for (AttnKernel kernel : kernels) {
      for (int order = 0; order < 2; ++order) {
        SCOPED_TRACE(describe(c) + (kernel == AttnKernel::kSm90 ? " [sm90]" : " [sm80]") +
                     (order == 0 ? " keys [0, 900) then [900, 1500) merged"
                                 : " keys [900, 1500) then [0, 900) merged"));
        const AttnParams& first = order == 0 ? lo : hi;
        AttnParams second = order == 0 ? hi : lo;
        poison(dev, c);
        CUDA_ASSERT(attention_cuda(first, nullptr, kernel));
        second.merge_into_o = true;
        CUDA_ASSERT(attention_cuda(second, nullptr, kernel));
        CUDA_ASSERT(cudaDeviceSynchronize());
        Outputs fused;
        fetch(dev, c, fused);
        if (HasFatalFailure()) return;
        expect_within_rule(compare(in.p, fused, ref, "fused"), en, "fused merge");
        // The unfused path on the same inputs.
        poison(dev, c);
        CUDA_ASSERT(attention_cuda(first, nullptr, kernel));
        DevBuf po, pl;
        CUDA_ASSERT(cudaMalloc(&po.ptr, size_t(c.n_q) * c.heads * d * sizeof(float)));
        CUDA_ASSERT(cudaMalloc(&pl.ptr, size_t(c.heads) * dev.p.lse_head_stride * sizeof(float)));
        AttnParams part = order == 0 ? hi : lo;
        part.o = po.ptr;
        part.lse = static_cast<float*>(pl.ptr);
        CUDA_ASSERT(attention_cuda(part, nullptr, kernel));
        MergeParams m;
        m.o_a = static_cast<float*>(dev.o.ptr);
        m.lse_a = static_cast<float*>(dev.lse.ptr);
        m.o_b = static_cast<const float*>(po.ptr);
        m.lse_b = static_cast<const float*>(pl.ptr);
        m.o_row_stride = int64_t{c.heads} * d;
        m.o_head_stride = d;
        m.lse_head_stride = dev.p.lse_head_stride;
        m.rows = c.n_q;
        m.heads = c.heads;
        m.head_dim = d;
        CUDA_ASSERT(merge_cuda(m, nullptr));
        CUDA_ASSERT(cudaDeviceSynchronize());
        Outputs unfused;
        fetch(dev, c, unfused);
        if (HasFatalFailure()) return;
        // Same arithmetic in another kernel: equal up to the compiler's fused multiply-adds.
        double o_diff = 0, lse_diff = 0;
        for (size_t i = 0; i < fused.o.size(); ++i) {
          o_diff = std::max(o_diff, std::fabs(double(fused.o[i]) - unfused.o[i]) /
                                        (std::fabs(double(unfused.o[i])) + 1e-3));
        }
        for (int h = 0; h < c.heads; ++h) {
          for (int i = 0; i < c.n_q; ++i) {
            const size_t at = size_t(h) * dev.p.lse_head_stride + i;
            const float a = fused.lse[at], b = unfused.lse[at];
            if (a == b) continue;  // also both -inf
            lse_diff = std::max(lse_diff, std::fabs(double(a) - b));
          }
        }
        EXPECT_LE(o_diff, 1e-5) << "fused against merge_cuda, relative";
        EXPECT_LE(lse_diff, 1e-5) << "fused against merge_cuda, lse";
      }
    }
    // Refused: a 16-bit o, and the decode kernel.
    AttnParams bf16_o = hi;
    bf16_o.merge_into_o = true;
    bf16_o.o_dtype = DType::kBF16;
    EXPECT_FALSE(attention_merges_into_o(bf16_o));
    EXPECT_EQ(attention_cuda(bf16_o, nullptr), cudaErrorInvalidValue);
    AttnParams one_row = hi;
    one_row.merge_into_o = true;
    one_row.n_q = 1;
    EXPECT_EQ(attention_decode_cuda(one_row, nullptr, 0, nullptr), cudaErrorInvalidValue);
    CUDA_ASSERT(cudaGetLastError());
  }
}

// head_dim 128 and 64 take the kernel's vector path (4 and 2 elements a lane), 96 the strided
// one; each in place (fp32 into o_a) and into a bf16 `out` (the decode's last rank merge).
TEST_F(GpuAttention, MergeMatchesCpu) {
  const int rows = 37, heads = 3;
  for (int d : {128, 64, 96}) {
    for (bool to_bf16 : {false, true}) {
      SCOPED_TRACE("head_dim " + std::to_string(d) + (to_bf16 ? ", out bf16" : ", in place"));
      std::mt19937 rng(61 + d);
      std::normal_distribution<float> nd(0.f, 1.f);
      const size_t n = size_t(rows) * heads * d;
      std::vector<float> oa(n), ob(n), la(size_t(heads) * rows), lb(la.size());
      for (auto& x : oa) x = nd(rng);
      for (auto& x : ob) x = nd(rng);
      for (size_t i = 0; i < la.size(); ++i) {
        la[i] = 3.f * nd(rng);
        lb[i] = 3.f * nd(rng);
        // Empty partials on either side, and on both, in every pattern.
        if (i % 5 == 1) la[i] = kNegInf;
        if (i % 7 == 2) lb[i] = kNegInf;
        if (i % 11 == 3) la[i] = lb[i] = kNegInf;
      }
      for (int h = 0; h < heads; ++h) {  // empty rows hold O = 0 by contract
        for (int r = 0; r < rows; ++r) {
          for (int c = 0; c < d; ++c) {
            const size_t idx = (size_t(r) * heads + h) * d + c;
            if (la[size_t(h) * rows + r] == kNegInf) oa[idx] = 0.f;
            if (lb[size_t(h) * rows + r] == kNegInf) ob[idx] = 0.f;
          }
        }
      }
      DevBuf d_oa, d_ob, d_la, d_lb, d_out;
      const std::pair<DevBuf*, std::vector<float>*> uploads[] = {
          {&d_oa, &oa}, {&d_ob, &ob}, {&d_la, &la}, {&d_lb, &lb}};
      for (const auto& [buf, host] : uploads) {
        CUDA_ASSERT(cudaMalloc(&buf->ptr, host->size() * sizeof(float)));
        CUDA_ASSERT(cudaMemcpy(buf->ptr, host->data(), host->size() * sizeof(float),
                               cudaMemcpyHostToDevice));
      }
      MergeParams mp;
      mp.o_row_stride = int64_t{heads} * d;
      mp.o_head_stride = d;
      mp.lse_head_stride = rows;
      mp.rows = rows;
      mp.heads = heads;
      mp.head_dim = d;
      MergeParams gp = mp;
      gp.o_a = static_cast<float*>(d_oa.ptr);
      gp.lse_a = static_cast<float*>(d_la.ptr);
      gp.o_b = static_cast<const float*>(d_ob.ptr);
      gp.lse_b = static_cast<const float*>(d_lb.ptr);
      if (to_bf16) {
        CUDA_ASSERT(cudaMalloc(&d_out.ptr, n * 2));
        CUDA_ASSERT(cudaMemset(d_out.ptr, 0xff, n * 2));  // NaN poison
        gp.out = d_out.ptr;
        gp.out_dtype = DType::kBF16;
        gp.out_row_stride = int64_t{heads} * d;
      }
      CUDA_ASSERT(merge_cuda(gp, nullptr));
      CUDA_ASSERT(cudaDeviceSynchronize());
      mp.o_a = oa.data();
      mp.lse_a = la.data();
      mp.o_b = ob.data();
      mp.lse_b = lb.data();
      merge_cpu(mp);
      std::vector<float> go(n), gl(la.size());
      if (to_bf16) {
        std::vector<uint8_t> b(n * 2);
        CUDA_ASSERT(cudaMemcpy(b.data(), d_out.ptr, b.size(), cudaMemcpyDeviceToHost));
        go = decode(DType::kBF16, b);
      } else {
        CUDA_ASSERT(cudaMemcpy(go.data(), d_oa.ptr, n * sizeof(float), cudaMemcpyDeviceToHost));
      }
      CUDA_ASSERT(cudaMemcpy(gl.data(), d_la.ptr, gl.size() * sizeof(float),
                             cudaMemcpyDeviceToHost));
      // Same formula in fp32 on both sides; device expf/log1pf are within 2 ulp of the host's.
      for (size_t i = 0; i < gl.size(); ++i) {
        if (la[i] == kNegInf) {
          EXPECT_EQ(gl[i], kNegInf) << "lse " << i;
        } else {
          EXPECT_NEAR(gl[i], la[i], 1e-5f * (1.f + std::fabs(la[i]))) << "lse " << i;
        }
      }
      // bf16 keeps 8 significant bits: its rounding (at most 2^-8 relative) on top.
      const float rel = to_bf16 ? 1e-5f + std::ldexp(1.f, -8) : 1e-5f;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_FALSE(std::isnan(go[i])) << i;
        EXPECT_NEAR(go[i], oa[i], rel * (1.f + std::fabs(oa[i]))) << "o " << i;
      }
      if (HasFailure()) return;
    }
  }
}

// Three KV shards attended separately (o in fp32, as the ring does) and merged in order equal
// one monolithic call, within the same 2x-naive rule against the fp32 reference.
TEST_F(GpuAttention, ThreeShardsMergedEqualMonolithic) {
  Case c{"shards", 769, 1500, 6, 2, 128, MaskKind::kCausal, 1000, 0};
  c.o_dtype = DType::kF32;
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c, 71);
  Outputs ref, naive;
  references(in, c.dtype, c.o_dtype, ref, naive);
  Device mono;
  to_device(in, c, mono);
  if (HasFatalFailure()) return;
  poison(mono, c);
  CUDA_ASSERT(attention_cuda(mono.p, nullptr));

  // Shard boundaries: the third shard starts after the first 100 queries (their partial is
  // empty there) and the first covers keys every query sees.
  const int bounds[] = {0, 500, 1100, 1500};
  const size_t o_elems = size_t(c.n_q) * c.heads * c.head_dim;
  const size_t lse_elems = size_t(c.heads) * c.n_q;
  DevBuf acc_o, acc_l, part_o, part_l;
  for (DevBuf* b : {&acc_o, &part_o}) CUDA_ASSERT(cudaMalloc(&b->ptr, o_elems * 4));
  for (DevBuf* b : {&acc_l, &part_l}) CUDA_ASSERT(cudaMalloc(&b->ptr, lse_elems * 4));
  for (int s = 0; s < 3; ++s) {
    AttnParams p = mono.p;
    const int k0 = bounds[s];
    p.n_kv = bounds[s + 1] - k0;
    p.kv_start = c.kv_start + k0;
    p.k = static_cast<const __nv_bfloat16*>(mono.p.k) + int64_t{k0} * p.k_row_stride;
    p.v = static_cast<const __nv_bfloat16*>(mono.p.v) + int64_t{k0} * p.v_row_stride;
    p.o = s == 0 ? acc_o.ptr : part_o.ptr;
    p.lse = static_cast<float*>(s == 0 ? acc_l.ptr : part_l.ptr);
    CUDA_ASSERT(attention_cuda(p, nullptr));
    if (s > 0) {
      MergeParams mp;
      mp.o_a = static_cast<float*>(acc_o.ptr);
      mp.lse_a = static_cast<float*>(acc_l.ptr);
      mp.o_b = static_cast<const float*>(part_o.ptr);
      mp.lse_b = static_cast<const float*>(part_l.ptr);
      mp.o_row_stride = int64_t{c.heads} * c.head_dim;
      mp.o_head_stride = c.head_dim;
      mp.lse_head_stride = c.n_q;
      mp.rows = c.n_q;
      mp.heads = c.heads;
      mp.head_dim = c.head_dim;
      CUDA_ASSERT(merge_cuda(mp, nullptr));
    }
  }
  CUDA_ASSERT(cudaDeviceSynchronize());
  Outputs merged, whole;
  fetch(mono, c, whole);
  merged.o.resize(o_elems);
  merged.lse.resize(lse_elems);
  CUDA_ASSERT(cudaMemcpy(merged.o.data(), acc_o.ptr, o_elems * 4, cudaMemcpyDeviceToHost));
  CUDA_ASSERT(cudaMemcpy(merged.lse.data(), acc_l.ptr, lse_elems * 4, cudaMemcpyDeviceToHost));
  const Errors en = compare(in.p, naive, ref, "naive");
  expect_within_rule(compare(in.p, whole, ref, "monolithic"), en, "monolithic");
  expect_within_rule(compare(in.p, merged, ref, "merged"), en, "merged");
  // The merged LSE is the monolithic one (the log-sum-exp of the three shard sums).
  EXPECT_LE(compare(in.p, merged, whole, "merged vs monolithic").lse_max_abs, 1e-4);
}

}  // namespace
}  // namespace burst::kernels
