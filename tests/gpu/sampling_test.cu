// GPU tests of kernels/sampling_cuda.h against the host sampler (engine::sample_with_uniform,
// the one implementation behind engine::Sampler): for the same logits and the same uniform u
// the GPU must pick exactly the host's id. Random never-zero logits, fp32 and bf16 (bf16 rows
// are full of exact ties), vocab 1, 7, 4099, 32000, 128256, rows 1 and 5 with a padded row
// stride, eight settings (three with min_p) and 50 uniforms (0, tiny, 0.5, just below 1, and Sampler draws). Both
// sum masses exactly (128-bit fixed point), so an id could legitimately differ only where
// glibc's and CUDA's fp64 exp differ by an ulp and u * mass falls within it. Exact
// ties (duplicate maxima, constant rows, ties across the top-k cut) are checked against
// hand-derived ids too; rows of different settings in one call (row_params) too. Every test
// skips with a message without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "gpu_test_util.h"
#include "kernels/sampling_cuda.h"

namespace burst::kernels {
namespace {

class GpuSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!testing::have_gpu(why)) GTEST_SKIP() << "skipping GPU sampling test: " << why;
  }
};

using testing::DevBuf;
using testing::encode;
using testing::round_to;

struct Setting {
  const char* name;
  float temperature;
  int top_k;
  float top_p;
  float min_p = 0.f;
};

constexpr Setting kSettings[] = {
    {"greedy", 0.f, 0, 1.f},
    {"T=0.7", 0.7f, 0, 1.f},
    {"T=1.3 top_k=40", 1.3f, 40, 1.f},
    {"T=0.8 top_p=0.9", 0.8f, 0, 0.9f},
    {"T=1 top_k=5 top_p=0.5", 1.f, 5, 0.5f},
    {"T=1 min_p=0.05", 1.f, 0, 1.f, 0.05f},
    {"T=1.5 top_k=40 min_p=0.2 top_p=0.9", 1.5f, 40, 0.9f, 0.2f},
    {"T=0.7 min_p=1", 0.7f, 0, 1.f, 1.f},
};

const char* name(DType t) { return t == DType::kBF16 ? "bf16" : "fp32"; }

// A host copy of logits [rows, stride] (the dtype's values widened to fp32, which is what the
// host sampler sees) and its device twin in the dtype.
struct Logits {
  DType dtype;
  int64_t rows, vocab, stride;
  std::vector<float> host;
  DevBuf dev;
};

void upload(Logits& l) {
  if (l.dev.ptr) {
    CUDA_ASSERT(cudaFree(l.dev.ptr));
    l.dev.ptr = nullptr;
  }
  const std::vector<uint8_t> b = encode(l.dtype, l.host);
  CUDA_ASSERT(cudaMalloc(&l.dev.ptr, b.size()));
  CUDA_ASSERT(cudaMemcpy(l.dev.ptr, b.data(), b.size(), cudaMemcpyHostToDevice));
}

// The stride is vocab + 3 and the padding holds 1e4, larger than any logit: reading past a
// row's end would win the argmax and the sample.
void fill_random(Logits& l, std::mt19937& rng) {
  l.stride = l.vocab + 3;
  l.host.assign(static_cast<size_t>(l.rows * l.stride), 1e4f);
  std::uniform_real_distribution<float> u(-8.f, 8.f);
  for (int64_t r = 0; r < l.rows; ++r) {
    for (int64_t c = 0; c < l.vocab; ++c) {
      float v;
      do {
        v = round_to(l.dtype, u(rng));
      } while (v == 0.f);
      l.host[r * l.stride + c] = v;
    }
  }
}

// 50 uniforms: the edges, then draws from a seeded Sampler (the stream a server would feed).
std::vector<double> test_uniforms() {
  std::vector<double> u = {0.0,
                           std::ldexp(1.0, -53),
                           1e-300,
                           0.5,
                           0.25,
                           0.75,
                           1.0 - std::ldexp(1.0, -53),
                           1.0 - 1e-9,
                           0.999};
  engine::Sampler s({1.f, 0, 1.f, 1234});
  while (u.size() < 50) u.push_back(s.next_uniform());
  return u;
}

// Runs fn(i) for i in [0, n) on a few threads (the host reference re-sorts the row per call).
template <typename Fn>
void parallel_for(int n, Fn fn) {
  const int workers = std::max(1, std::min<int>(16, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int i = w; i < n; i += workers) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

struct Gpu {
  DevBuf uniforms, out, workspace;
  size_t workspace_bytes = 0;
};

void alloc_gpu(Gpu& g, int64_t vocab, int64_t rows) {
  g.workspace_bytes = sample_cuda_workspace_bytes(vocab, rows);
  ASSERT_GT(g.workspace_bytes, 0u);
  CUDA_ASSERT(cudaMalloc(&g.workspace.ptr, g.workspace_bytes));
  CUDA_ASSERT(cudaMalloc(&g.uniforms.ptr, rows * sizeof(double)));
  CUDA_ASSERT(cudaMalloc(&g.out.ptr, rows * sizeof(int32_t)));
}

SampleParams params_for(const Logits& l, const Setting& s, Gpu& g) {
  SampleParams p;
  p.logits = l.dev.ptr;
  p.dtype = l.dtype;
  p.rows = l.rows;
  p.vocab = l.vocab;
  p.row_stride = l.stride;
  p.temperature = s.temperature;
  p.top_k = s.top_k;
  p.top_p = s.top_p;
  p.min_p = s.min_p;
  p.uniforms = static_cast<const double*>(g.uniforms.ptr);
  p.out_ids = static_cast<int32_t*>(g.out.ptr);
  p.workspace = g.workspace.ptr;
  p.workspace_bytes = g.workspace_bytes;
  return p;
}

// Samples every row with u[r] on the GPU; ids come back in `ids`.
void gpu_sample(const SampleParams& p, Gpu& g, const std::vector<double>& u,
                std::vector<int32_t>& ids) {
  if (p.temperature > 0.f || p.row_params) {
    CUDA_ASSERT(cudaMemcpy(g.uniforms.ptr, u.data(), u.size() * sizeof(double),
                           cudaMemcpyHostToDevice));
  }
  CUDA_ASSERT(sample_cuda(p, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  ids.resize(static_cast<size_t>(p.rows));
  CUDA_ASSERT(cudaMemcpy(ids.data(), g.out.ptr, ids.size() * sizeof(int32_t),
                         cudaMemcpyDeviceToHost));
}

engine::SamplingParams host_params(const Setting& s) {
  return engine::SamplingParams{s.temperature, s.top_k, s.top_p, 0, s.min_p};
}

// For each setting and each of the 50 uniforms (row r of call j takes u[(j + 11 r) % 50], so
// every row sees every u), the GPU ids must equal the host's.
void expect_matches_host(Logits& l, Gpu& g) {
  const std::vector<double> us = test_uniforms();
  const int nu = static_cast<int>(us.size());
  for (const Setting& s : kSettings) {
    // Greedy reads no uniform and no workspace: one call with both null checks that too.
    const bool greedy = s.temperature == 0.f;
    const int calls = greedy ? 1 : nu;
    SampleParams p = params_for(l, s, g);
    if (greedy) {
      p.uniforms = nullptr;
      p.workspace = nullptr;
      p.workspace_bytes = 0;
    }
    std::vector<int32_t> host(static_cast<size_t>(calls * l.rows));
    parallel_for(calls * static_cast<int>(l.rows), [&](int i) {
      const int j = i / static_cast<int>(l.rows), r = i % static_cast<int>(l.rows);
      host[i] = engine::sample_with_uniform(&l.host[r * l.stride], l.vocab, host_params(s),
                                            us[(j + 11 * r) % nu]);
    });
    int bad = 0;
    for (int j = 0; j < calls; ++j) {
      std::vector<double> u(static_cast<size_t>(l.rows));
      for (int64_t r = 0; r < l.rows; ++r) u[r] = us[(j + 11 * r) % nu];
      std::vector<int32_t> ids;
      gpu_sample(p, g, u, ids);
      if (::testing::Test::HasFatalFailure()) return;
      for (int64_t r = 0; r < l.rows; ++r) {
        const int32_t want = host[j * l.rows + r];
        if (ids[r] != want && bad++ < 5) {
          ADD_FAILURE() << name(l.dtype) << " vocab=" << l.vocab << " rows=" << l.rows << " "
                        << s.name << " row " << r << " u=" << u[r] << ": gpu " << ids[r]
                        << " host " << want;
        }
      }
    }
  }
}

TEST_F(GpuSampling, MatchesHostSamplerForEveryUniform) {
  std::mt19937 rng(7);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (int64_t vocab : {1, 7, 4099, 32000, 128256}) {
      for (int64_t rows : {1, 5}) {
        Logits l{t, rows, vocab, 0, {}, {}};
        fill_random(l, rng);
        upload(l);
        Gpu g;
        alloc_gpu(g, vocab, rows);
        if (HasFatalFailure()) return;
        expect_matches_host(l, g);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Per-row settings (SampleParams::row_params): 11 rows cycling through every setting above
// (greedy rows among sampled ones) in one call, with scalars that would be refused (they are
// not read), fp32 and bf16, vocab 7, 4099 and 32000: each row picks the host's id for its own
// setting and uniform, over 10 calls of rotated uniforms.
TEST_F(GpuSampling, PerRowSettingsMatchHost) {
  const std::vector<double> us = test_uniforms();
  const int nu = static_cast<int>(us.size());
  constexpr int kNumSettings = sizeof(kSettings) / sizeof(kSettings[0]);
  std::mt19937 rng(13);
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (int64_t vocab : {7, 4099, 32000}) {
      Logits l{t, 2 * kNumSettings + 1, vocab, 0, {}, {}};
      fill_random(l, rng);
      upload(l);
      Gpu g;
      alloc_gpu(g, vocab, l.rows);
      if (HasFatalFailure()) return;
      std::vector<SampleRowParams> rp(static_cast<size_t>(l.rows));
      for (int64_t r = 0; r < l.rows; ++r) {
        const Setting& s = kSettings[r % kNumSettings];
        rp[r] = {s.temperature, s.top_k, s.top_p, s.min_p};
      }
      DevBuf dev_rp;
      CUDA_ASSERT(cudaMalloc(&dev_rp.ptr, rp.size() * sizeof(SampleRowParams)));
      CUDA_ASSERT(cudaMemcpy(dev_rp.ptr, rp.data(), rp.size() * sizeof(SampleRowParams),
                             cudaMemcpyHostToDevice));
      SampleParams p = params_for(l, kSettings[1], g);
      p.temperature = -1.f;
      p.top_p = 0.f;
      p.row_params = static_cast<const SampleRowParams*>(dev_rp.ptr);
      int bad = 0;
      for (int j = 0; j < 10; ++j) {
        std::vector<double> u(static_cast<size_t>(l.rows));
        for (int64_t r = 0; r < l.rows; ++r) u[r] = us[(5 * j + 7 * r) % nu];
        std::vector<int32_t> ids;
        gpu_sample(p, g, u, ids);
        if (HasFatalFailure()) return;
        for (int64_t r = 0; r < l.rows; ++r) {
          const Setting& s = kSettings[r % kNumSettings];
          const int32_t want = engine::sample_with_uniform(&l.host[r * l.stride], l.vocab,
                                                           host_params(s), u[r]);
          if (ids[r] != want && bad++ < 5) {
            ADD_FAILURE() << name(t) << " vocab=" << vocab << " row " << r << " (" << s.name
                          << ") u=" << u[r] << ": gpu " << ids[r] << " host " << want;
          }
        }
      }
    }
  }
}

// Duplicate maxima: greedy takes the lowest id, in both dtypes, wherever the duplicates sit
// (row r has its duplicates at different ids, one of them in another thread's slice).
TEST_F(GpuSampling, GreedyTiesGoToLowestId) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    Logits l{t, 4, 4099, 0, {}, {}};
    std::mt19937 rng(3);
    fill_random(l, rng);
    const int64_t dup[4][3] = {{3, 100, 4000}, {0, 1, 4098}, {4098, 2048, 257}, {300, 44, 45}};
    for (int64_t r = 0; r < l.rows; ++r) {
      for (int64_t c : dup[r]) l.host[r * l.stride + c] = round_to(t, 9.5f);
    }
    upload(l);
    Gpu g;
    alloc_gpu(g, l.vocab, l.rows);
    if (HasFatalFailure()) return;
    std::vector<int32_t> ids;
    gpu_sample(params_for(l, kSettings[0], g), g, std::vector<double>(4, 0.0), ids);
    if (HasFatalFailure()) return;
    const int32_t want[4] = {3, 0, 257, 44};
    for (int64_t r = 0; r < l.rows; ++r) {
      EXPECT_EQ(ids[r], want[r]) << name(t) << " row " << r;
      EXPECT_EQ(engine::sample_with_uniform(&l.host[r * l.stride], l.vocab,
                                            host_params(kSettings[0]), 0.0),
                want[r])
          << name(t) << " row " << r << " (host)";
    }
    // All-equal row: id 0.
    std::fill(l.host.begin(), l.host.end(), round_to(t, -1.25f));
    upload(l);
    gpu_sample(params_for(l, kSettings[0], g), g, std::vector<double>(4, 0.0), ids);
    if (HasFatalFailure()) return;
    for (int64_t r = 0; r < l.rows; ++r) EXPECT_EQ(ids[r], 0) << name(t) << " row " << r;
  }
}

// Exact ties when sampling: a constant row orders by id with equal mass, so u picks
// floor(u * vocab) exactly (all sums are small integers, exact in either order); and when ten
// ids share the top logit, top_k = 4 keeps the four lowest of them, whatever u.
TEST_F(GpuSampling, SamplingTiesFollowIds) {
  const std::vector<double> us = test_uniforms();
  for (DType t : {DType::kF32, DType::kBF16}) {
    Logits l{t, 1, 4099, 0, {}, {}};
    std::mt19937 rng(5);
    fill_random(l, rng);
    std::fill(l.host.begin(), l.host.begin() + l.vocab, round_to(t, 2.5f));
    upload(l);
    Gpu g;
    alloc_gpu(g, l.vocab, l.rows);
    if (HasFatalFailure()) return;
    const Setting flat{"T=1", 1.f, 0, 1.f};
    for (double u : us) {
      std::vector<int32_t> ids;
      gpu_sample(params_for(l, flat, g), g, {u}, ids);
      if (HasFatalFailure()) return;
      // u * vocab may round up to vocab for u just below 1: then the last id.
      const auto want = static_cast<int32_t>(std::min(std::floor(u * l.vocab), l.vocab - 1.0));
      EXPECT_EQ(ids[0], want) << name(t) << " constant row, u=" << u;
      EXPECT_EQ(engine::sample_with_uniform(l.host.data(), l.vocab, host_params(flat), u), want)
          << name(t) << " constant row, u=" << u << " (host)";
    }

    fill_random(l, rng);
    const int64_t top[10] = {4000, 17, 2222, 9, 3000, 18, 1, 4098, 512, 513};
    for (int64_t c : top) l.host[c] = round_to(t, 8.5f);
    upload(l);
    const Setting k4{"T=1.1 top_k=4", 1.1f, 4, 1.f};
    for (double u : us) {
      std::vector<int32_t> ids;
      gpu_sample(params_for(l, k4, g), g, {u}, ids);
      if (HasFatalFailure()) return;
      // Equal mass: the four lowest tied ids {1, 9, 17, 18}, picked by floor(4 u).
      const int32_t kept[4] = {1, 9, 17, 18};
      const int32_t want = kept[static_cast<int>(std::min(std::floor(u * 4), 3.0))];
      EXPECT_EQ(ids[0], want) << name(t) << " top-k tie, u=" << u;
      EXPECT_EQ(engine::sample_with_uniform(l.host.data(), l.vocab, host_params(k4), u), want)
          << name(t) << " top-k tie, u=" << u << " (host)";
    }
  }
}

TEST_F(GpuSampling, RejectsBadParams) {
  Logits l{DType::kF32, 2, 64, 0, {}, {}};
  std::mt19937 rng(1);
  fill_random(l, rng);
  upload(l);
  Gpu g;
  alloc_gpu(g, l.vocab, l.rows);
  if (HasFatalFailure()) return;
  const SampleParams good = params_for(l, kSettings[3], g);
  CUDA_ASSERT(sample_cuda(good, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  auto expect_invalid = [&](const char* what, auto change) {
    SampleParams p = good;
    change(p);
    EXPECT_EQ(sample_cuda(p, nullptr), cudaErrorInvalidValue) << what;
  };
  expect_invalid("rows 0", [](SampleParams& p) { p.rows = 0; });
  expect_invalid("vocab 0", [](SampleParams& p) { p.vocab = 0; });
  expect_invalid("stride < vocab", [](SampleParams& p) { p.row_stride = p.vocab - 1; });
  expect_invalid("rows * vocab > INT32_MAX", [](SampleParams& p) { p.rows = int64_t{1} << 26; });
  expect_invalid("null logits", [](SampleParams& p) { p.logits = nullptr; });
  expect_invalid("null out", [](SampleParams& p) { p.out_ids = nullptr; });
  expect_invalid("T < 0", [](SampleParams& p) { p.temperature = -0.5f; });
  expect_invalid("T NaN", [](SampleParams& p) { p.temperature = NAN; });
  expect_invalid("T inf", [](SampleParams& p) { p.temperature = INFINITY; });
  expect_invalid("top_k < 0", [](SampleParams& p) { p.top_k = -1; });
  expect_invalid("top_p 0", [](SampleParams& p) { p.top_p = 0.f; });
  expect_invalid("top_p > 1", [](SampleParams& p) { p.top_p = 1.5f; });
  expect_invalid("min_p < 0", [](SampleParams& p) { p.min_p = -0.1f; });
  expect_invalid("min_p > 1", [](SampleParams& p) { p.min_p = 1.5f; });
  expect_invalid("fp16", [](SampleParams& p) { p.dtype = DType::kF16; });
  expect_invalid("null uniforms", [](SampleParams& p) { p.uniforms = nullptr; });
  expect_invalid("null workspace", [](SampleParams& p) { p.workspace = nullptr; });
  expect_invalid("small workspace", [](SampleParams& p) { --p.workspace_bytes; });
  EXPECT_EQ(sample_cuda_workspace_bytes(0, 1), 0u);
  EXPECT_EQ(sample_cuda_workspace_bytes(1, 0), 0u);
  CUDA_ASSERT(cudaGetLastError());
}

// Timing, one row of vocab 32000: microseconds per call over 100 calls (cudaEvent), after a
// warm-up. Printed, not asserted; the ids of the last call are still checked against the host.
TEST_F(GpuSampling, TimingVocab32000) {
  Logits l{DType::kF32, 1, 32000, 0, {}, {}};
  std::mt19937 rng(11);
  fill_random(l, rng);
  upload(l);
  Gpu g;
  alloc_gpu(g, l.vocab, l.rows);
  if (HasFatalFailure()) return;
  const double u = 0.37;
  CUDA_ASSERT(cudaMemcpy(g.uniforms.ptr, &u, sizeof u, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  CUDA_ASSERT(cudaEventCreate(&start));
  CUDA_ASSERT(cudaEventCreate(&stop));
  for (const Setting* s : {&kSettings[0], &kSettings[3], &kSettings[1], &kSettings[2]}) {
    const SampleParams p = params_for(l, *s, g);
    for (int i = 0; i < 10; ++i) CUDA_ASSERT(sample_cuda(p, nullptr));
    CUDA_ASSERT(cudaEventRecord(start, nullptr));
    for (int i = 0; i < 100; ++i) CUDA_ASSERT(sample_cuda(p, nullptr));
    CUDA_ASSERT(cudaEventRecord(stop, nullptr));
    CUDA_ASSERT(cudaEventSynchronize(stop));
    float ms = 0.f;
    CUDA_ASSERT(cudaEventElapsedTime(&ms, start, stop));
    std::printf("[ info     ] sample_cuda vocab 32000, 1 row, fp32, %s: %.1f us/call\n", s->name,
                ms * 1000.0 / 100);
    int32_t id = -1;
    CUDA_ASSERT(cudaMemcpy(&id, g.out.ptr, sizeof id, cudaMemcpyDeviceToHost));
    EXPECT_EQ(id, engine::sample_with_uniform(l.host.data(), l.vocab, host_params(*s), u))
        << s->name;
  }
  CUDA_ASSERT(cudaEventDestroy(start));
  CUDA_ASSERT(cudaEventDestroy(stop));
}

}  // namespace
}  // namespace burst::kernels
