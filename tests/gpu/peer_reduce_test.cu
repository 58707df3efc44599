// The decode all-reduce's kernels (kernels::peer_all_reduce_cuda, peer_all_reduce_norm_cuda)
// with 2 and 4 ranks on one GPU: each rank a stream of its own and a region of this GPU's
// memory, so the exchange, the flags and the sums run as between GPUs (only the stores stay
// local). The one-launch sum and norm is held to the two launches it replaces (the sum into the
// residual, then rms_norm_cuda) bit for bit, every rank to the same bits, and h to the norm of
// x computed in fp64; bf16 and fp32 rows, one row to kPeerGatherMaxBlocks, a thread holding 1-4
// chunks, h in place of the partial. PeerGather.* (peer_gather_test.cpp) runs them between GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/ops_cuda.h"

namespace burst::kernels {
namespace {

using testing::decode;
using testing::DevBuf;
using testing::encode;
using testing::random_values;

class PeerReduceOneGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!testing::have_gpu(why)) GTEST_SKIP() << "skipping the peer all-reduce test: " << why;
  }
};

void upload(DevBuf& d, const std::vector<uint8_t>& bytes) {
  CUDA_ASSERT(cudaMalloc(&d.ptr, bytes.size()));
  CUDA_ASSERT(cudaMemcpy(d.ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
}

std::vector<uint8_t> download(const DevBuf& d, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), d.ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

struct Case {
  int world;
  DType t;
  int64_t rows, dim;
  bool in_place;
};

TEST_F(PeerReduceOneGpu, SumAndNormInOneLaunchEqualTheTwoLaunches) {
  constexpr int64_t kSlot = int64_t{2} << 20;
  constexpr float kEps = 1e-5f;
  std::mt19937 rng(71);
  uint32_t epoch = 0;
  const Case cases[] = {{2, DType::kBF16, 1, 8192, true},    {2, DType::kBF16, 3, 4104, false},
                        {4, DType::kBF16, 32, 8192, true},   {4, DType::kF32, 5, 4096, false},
                        {2, DType::kF32, 2, 1000, true},     {4, DType::kBF16, 7, 5120, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::to_string(c.world) + " ranks, " + std::to_string(c.rows) + " x " +
                 std::to_string(c.dim) + (c.t == DType::kBF16 ? " bf16" : " fp32") +
                 (c.in_place ? ", h in place of the partial" : ""));
    const int64_t n = c.rows * c.dim;
    const size_t bytes = size_t(n) * testing::dtype_bytes(c.t);
    DevBuf regions[kPeerGatherMaxRanks], w;
    cudaStream_t streams[kPeerGatherMaxRanks] = {};
    for (int r = 0; r < c.world; ++r) {
      const int64_t rb = peer_gather_region_bytes(c.world, kSlot);
      CUDA_ASSERT(cudaMalloc(&regions[r].ptr, size_t(rb)));
      CUDA_ASSERT(cudaMemset(regions[r].ptr, 0, size_t(rb)));
      CUDA_ASSERT(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    upload(w, encode(c.t, random_values(size_t(c.dim), 0.5f, 1.5f, c.t, rng)));
    const std::vector<float> x0 = random_values(size_t(n), -1.f, 1.f, c.t, rng);
    std::vector<std::vector<float>> parts;
    for (int r = 0; r < c.world; ++r) {
      parts.push_back(random_values(size_t(n), -2.f, 2.f, c.t, rng));
    }
    auto rank_view = [&](int r) {
      PeerGather g{r, c.world, {}, kSlot, uint64_t{10} * 1000 * 1000 * 1000};
      for (int q = 0; q < c.world; ++q) g.region[q] = regions[q].ptr;
      return g;
    };
    ASSERT_TRUE(peer_all_reduce_norm_applies(rank_view(0), w.ptr, w.ptr, w.ptr, w.ptr, c.rows,
                                             c.dim, c.t));
    // The norm kernel runs once alone first. CUDA loads a kernel at its first launch (lazy
    // loading, the default), and the load waits for the work on the device. Launched first
    // behind rank 0's exchange below, it would wait for that exchange, which spins until rank
    // 1's is launched: after this launch returns (the exchange's timeout ends it).
    {
      DevBuf x1, h1;
      upload(x1, encode(c.t, x0));
      CUDA_ASSERT(cudaMalloc(&h1.ptr, bytes));
      CUDA_ASSERT(rms_norm_cuda(x1.ptr, w.ptr, h1.ptr, c.rows, c.dim, kEps, c.t, streams[0]));
      CUDA_ASSERT(cudaStreamSynchronize(streams[0]));
    }
    // [0]: the one launch; [1]: the sum into x, then the norm.
    std::vector<uint8_t> got_x[2][kPeerGatherMaxRanks], got_h[2][kPeerGatherMaxRanks];
    for (int way = 0; way < 2; ++way) {
      ++epoch;
      DevBuf p[kPeerGatherMaxRanks], x[kPeerGatherMaxRanks], h[kPeerGatherMaxRanks];
      for (int r = 0; r < c.world; ++r) {
        upload(p[r], encode(c.t, parts[size_t(r)]));
        upload(x[r], encode(c.t, x0));
        CUDA_ASSERT(cudaMalloc(&h[r].ptr, bytes));
        CUDA_ASSERT(cudaMemset(h[r].ptr, 0x7f, bytes));
      }
      CUDA_ASSERT(cudaDeviceSynchronize());
      for (int r = 0; r < c.world; ++r) {
        const PeerGather g = rank_view(r);
        void* hr = c.in_place ? p[r].ptr : h[r].ptr;
        if (way == 0) {
          CUDA_ASSERT(peer_all_reduce_norm_cuda(g, p[r].ptr, x[r].ptr, w.ptr, hr, c.rows, c.dim,
                                                kEps, c.t, epoch, streams[r]));
        } else {
          CUDA_ASSERT(peer_all_reduce_cuda(g, p[r].ptr, x[r].ptr, int64_t(bytes), c.t, true,
                                           epoch, streams[r]));
          CUDA_ASSERT(rms_norm_cuda(x[r].ptr, w.ptr, hr, c.rows, c.dim, kEps, c.t, streams[r]));
        }
      }
      CUDA_ASSERT(cudaDeviceSynchronize());
      for (int r = 0; r < c.world; ++r) {
        got_x[way][r] = download(x[r], bytes);
        got_h[way][r] = download(c.in_place ? p[r] : h[r], bytes);
      }
    }
    for (int r = 0; r < c.world; ++r) {
      EXPECT_EQ(got_x[0][r], got_x[1][r]) << "x of rank " << r;
      EXPECT_EQ(got_h[0][r], got_h[1][r]) << "h of rank " << r;
      EXPECT_EQ(got_x[0][r], got_x[0][0]) << "rank " << r << " against rank 0";
      EXPECT_EQ(got_h[0][r], got_h[0][0]) << "rank " << r << " against rank 0";
    }
    // h against the fp64 norm of the x the launch made; x against the exact sum.
    const std::vector<float> gx = decode(c.t, got_x[0][0]), gh = decode(c.t, got_h[0][0]);
    const std::vector<float> wv =
        decode(c.t, download(w, size_t(c.dim) * testing::dtype_bytes(c.t)));
    // Half an ulp of t, relative; and fp32's own error in the norm (the sum of squares' ~30
    // roundings on a path, rsqrtf's 2 ulp, three products), relative.
    const double ulp = c.t == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    const double f32 = 3e-6;
    int bad = 0;
    for (int64_t r = 0; r < c.rows && bad < 5; ++r) {
      double ss = 0.0;
      for (int64_t i = 0; i < c.dim; ++i) {
        const double v = gx[size_t(r * c.dim + i)];
        ss += v * v;
      }
      const double inv = 1.0 / std::sqrt(ss / double(c.dim) + kEps);
      for (int64_t i = 0; i < c.dim && bad < 5; ++i) {
        const size_t k = size_t(r * c.dim + i);
        double sum = x0[k], magnitude = std::fabs(x0[k]);
        for (int q = 0; q < c.world; ++q) {
          sum += parts[size_t(q)][k];
          magnitude += std::fabs(parts[size_t(q)][k]);
        }
        // The sum: fp32 adds (world of them, each within 2^-24 of the running magnitude), one
        // rounding to t. The norm: one rounding to t, fp32 arithmetic far below it.
        const bool x_ok =
            std::fabs(gx[k] - sum) <= (ulp + c.world * std::ldexp(1.0, -24)) * magnitude;
        const double exact = double(wv[size_t(i)]) * gx[k] * inv;
        const bool h_ok = std::fabs(gh[k] - exact) <= (ulp + f32) * std::fabs(exact);
        if (!x_ok || !h_ok) {
          ++bad;
          ADD_FAILURE() << "row " << r << " col " << i << ": x " << gx[k] << " (exact " << sum
                        << "), h " << gh[k] << " (exact " << exact << ")";
        }
      }
    }
    for (int r = 0; r < c.world; ++r) CUDA_ASSERT(cudaStreamDestroy(streams[r]));
  }
}

// Rows the one launch does not take are refused before anything runs.
TEST_F(PeerReduceOneGpu, RefusesWhatItDoesNotTake) {
  alignas(16) static uint8_t buf[64] = {};
  PeerGather g{0, 2, {buf, buf}, int64_t{2} << 20};
  EXPECT_TRUE(peer_all_reduce_norm_applies(g, buf, buf, buf, buf, 1, 8, DType::kBF16));
  EXPECT_FALSE(peer_all_reduce_norm_applies(g, buf, buf, buf, buf, kPeerGatherMaxBlocks + 1, 8,
                                            DType::kBF16));  // more rows than blocks
  EXPECT_FALSE(peer_all_reduce_norm_applies(g, buf, buf, buf, buf, 1, 8200, DType::kBF16));
  EXPECT_FALSE(peer_all_reduce_norm_applies(g, buf, buf, buf, buf, 1, 12, DType::kBF16));
  EXPECT_FALSE(peer_all_reduce_norm_applies(g, buf, buf, buf + 8, buf, 1, 8, DType::kBF16));
  EXPECT_FALSE(peer_all_reduce_norm_applies(g, buf, buf, buf, buf, 1, 8, DType::kI32));
  EXPECT_EQ(peer_all_reduce_norm_cuda(g, buf, buf, buf, buf, 1, 8200, 1e-5f, DType::kBF16, 1,
                                      nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace burst::kernels
