// The decode's all-gather by stores into the peers' memory (kernels::peer_all_gather_cuda,
// taken by NcclCommunicator::all_gather for device buffers up to its slot) on up to 8 GPUs of
// this machine: every rank's block arrives bit for bit, for sizes from one 16-byte vector to
// the slot, each size three calls in a row (both halves of the region, a peer one call ahead),
// and a size past the slot through NCCL between them; and when one rank declines
// (BURST_PEER_GATHER=0) all take NCCL. Each rank is this binary run again (a process that
// initialised CUDA cannot fork one that uses it); fewer than 2 GPUs, or GPUs without peer
// access: skipped, saying why. Each rank also checks NCCL's all_reduce_sum (all_reduce_check)
// and the sum with the RMSNorm after it (all_reduce_norm_check).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/cuda/nccl_communicator.h"
#include "engine/dtype_convert.h"
#include "engine/tuning.h"
#include "gpu_test_util.h"
#include "kernels/ops_cuda.h"

namespace burst {
namespace {

constexpr int kNoPeerPath = 77;

uint32_t word_of(int rank, int call, size_t i) {
  uint64_t x = (uint64_t{static_cast<uint32_t>(rank)} << 40) ^ (uint64_t{static_cast<uint32_t>(call)} << 24) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 29;
  return static_cast<uint32_t>(x);
}

// all_reduce_sum and all_reduce_add on device bf16 (tensor parallelism's row-parallel sums):
// every rank gets the same bits (compared through an all_gather), within bf16 rounding of the
// exact result from the ranks' (random, never zero) values: at most one half-ulp of the sum of
// magnitudes per addition. all_reduce_add sums into x = 0.5 everywhere (the residual add fused
// on the one-shot path).
int all_reduce_check(engine::Communicator& comm, int rank, int world, cudaStream_t stream,
                     int64_t count) {
  auto value = [](int r, int64_t i) {
    return engine::bf16_to_f32(engine::f32_to_bf16(
        static_cast<float>(static_cast<int32_t>(word_of(r, 999, static_cast<size_t>(i)) % 2001) -
                           1000) / 250.f + 0.003f));
  };
  std::vector<uint16_t> mine(count), all(static_cast<size_t>(count * world));
  for (int64_t i = 0; i < count; ++i) {
    mine[static_cast<size_t>(i)] = engine::f32_to_bf16(value(rank, i));
  }
  const std::vector<uint16_t> halves(count, engine::f32_to_bf16(0.5f));
  void *d = nullptr, *x = nullptr, *gathered = nullptr;
  if (cudaMalloc(&d, count * 2) != cudaSuccess || cudaMalloc(&x, count * 2) != cudaSuccess ||
      cudaMalloc(&gathered, count * 2 * world) != cudaSuccess) {
    return 20;
  }
  for (const bool add : {false, true}) {
    const char* what = add ? "all_reduce_add" : "all_reduce_sum";
    const double base = add ? 0.5 : 0.0;
    cudaMemcpy(d, mine.data(), count * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(x, halves.data(), count * 2, cudaMemcpyHostToDevice);
    void* result = add ? x : d;
    Status st = add ? comm.all_reduce_add(d, x, count, engine::DType::kBF16)
                    : comm.all_reduce_sum(d, count, engine::DType::kBF16);
    if (st.ok()) st = comm.all_gather(result, gathered, static_cast<size_t>(count) * 2);
    if (!st.ok() || cudaStreamSynchronize(stream) != cudaSuccess ||
        cudaMemcpy(all.data(), gathered, count * 2 * world, cudaMemcpyDeviceToHost) !=
            cudaSuccess) {
      std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, st.message().c_str());
      return 21;
    }
    for (int src = 1; src < world; ++src) {
      if (!std::equal(all.begin(), all.begin() + count, all.begin() + src * count)) {
        std::fprintf(stderr, "rank %d: %s: rank %d differs from rank 0\n", rank, what, src);
        return 22;
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      double exact = base, magnitude = base;
      for (int r = 0; r < world; ++r) {
        exact += value(r, i);
        magnitude += std::fabs(value(r, i));
      }
      const double got = engine::bf16_to_f32(all[static_cast<size_t>(i)]);
      if (std::fabs(got - exact) > (world + (add ? 1 : 0)) * std::ldexp(magnitude, -8)) {
        std::fprintf(stderr, "rank %d: %s element %lld: %g, exact %g\n", rank, what,
                     (long long)i, got, exact);
        return 23;
      }
    }
  }
  cudaFree(x);
  cudaFree(d);
  cudaFree(gathered);
  return 0;
}

// all_reduce_add_norm (a decode step's row-parallel sum and the RMSNorm after it, one launch
// on the peer path): x and h bit for bit all_reduce_add then rms_norm_cuda, in place (h the
// partial) and apart, for row counts 1-32 and dims of 4104 (a thread holding 3 chunks) to 8192;
// h within bf16 rounding of the norm of x computed in fp64. 33 rows (more than the path takes),
// or the path declined (`peer` false): refused with nothing written.
int all_reduce_norm_check(engine::Communicator& comm, int rank, cudaStream_t stream, bool peer) {
  struct Case {
    int64_t rows, dim;
    bool in_place;
  };
  const float eps = 1e-5f;
  int call = 500;
  for (const Case c : {Case{1, 8192, true}, Case{3, 4104, false}, Case{32, 8192, true},
                       Case{5, 4096, false}, Case{33, 4096, true}}) {
    const int64_t n = c.rows * c.dim;
    auto bf16_of = [](uint32_t w, float scale, float shift) {
      return engine::f32_to_bf16(static_cast<float>(static_cast<int32_t>(w % 2001) - 1000) /
                                     1000.f * scale + shift);
    };
    std::vector<uint16_t> part(n), x(n), w(c.dim);
    for (int64_t i = 0; i < n; ++i) {
      part[size_t(i)] = bf16_of(word_of(rank, call, size_t(i)), 2.f, 0.01f);
      x[size_t(i)] = bf16_of(word_of(99, call, size_t(i)), 1.f, 0.003f);  // the same on every rank
    }
    for (int64_t i = 0; i < c.dim; ++i) {
      w[size_t(i)] = bf16_of(word_of(98, call, size_t(i)), 0.5f, 1.f);
    }
    ++call;
    void *dp = nullptr, *dx = nullptr, *dh = nullptr, *dw = nullptr, *rp = nullptr, *rx = nullptr,
         *rh = nullptr;
    for (void** b : {&dp, &dx, &dh, &rp, &rx, &rh}) {
      if (cudaMalloc(b, n * 2) != cudaSuccess) return 30;
    }
    if (cudaMalloc(&dw, c.dim * 2) != cudaSuccess) return 30;
    for (void* b : {dp, rp}) cudaMemcpy(b, part.data(), n * 2, cudaMemcpyHostToDevice);
    for (void* b : {dx, rx}) cudaMemcpy(b, x.data(), n * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w.data(), c.dim * 2, cudaMemcpyHostToDevice);
    cudaMemset(dh, 0x7f, n * 2);
    cudaDeviceSynchronize();
    void* h = c.in_place ? dp : dh;
    const engine::Communicator::NormAfter norm{dw, eps, h, c.rows, c.dim};
    auto fused = comm.all_reduce_add_norm(dp, dx, engine::DType::kBF16, norm);
    if (!fused.ok()) {
      std::fprintf(stderr, "rank %d: all_reduce_add_norm: %s\n", rank, fused.message().c_str());
      return 31;
    }
    const bool want = peer && c.rows <= kernels::kPeerGatherMaxBlocks;
    if (fused.value() != want) {
      std::fprintf(stderr, "rank %d: all_reduce_add_norm %lld x %lld: %s, expected %s\n", rank,
                   (long long)c.rows, (long long)c.dim, fused.value() ? "fused" : "declined",
                   want ? "fused" : "declined");
      return 32;
    }
    std::vector<uint16_t> gx(n), gh(n), ex(n), eh(n);
    if (!want) {  // nothing written: x as it was
      cudaMemcpy(gx.data(), dx, n * 2, cudaMemcpyDeviceToHost);
      if (gx != x) return 33;
    } else {
      Status st = comm.all_reduce_add(rp, rx, n, engine::DType::kBF16);
      if (!st.ok() || kernels::rms_norm_cuda(rx, dw, rh, c.rows, c.dim, eps, engine::DType::kBF16,
                                             stream) != cudaSuccess ||
          cudaStreamSynchronize(stream) != cudaSuccess) {
        return 34;
      }
      cudaMemcpy(gx.data(), dx, n * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(gh.data(), h, n * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(ex.data(), rx, n * 2, cudaMemcpyDeviceToHost);
      cudaMemcpy(eh.data(), rh, n * 2, cudaMemcpyDeviceToHost);
      if (gx != ex || gh != eh) {
        std::fprintf(stderr, "rank %d: all_reduce_add_norm %lld x %lld: x %s, h %s the two "
                     "launches'\n", rank, (long long)c.rows, (long long)c.dim,
                     gx == ex ? "equals" : "differs from", gh == eh ? "equals" : "differs from");
        return 35;
      }
      for (int64_t r = 0; r < c.rows; ++r) {  // h against the fp64 norm of the x it got
        double ss = 0.0;
        for (int64_t i = 0; i < c.dim; ++i) {
          const double v = engine::bf16_to_f32(gx[size_t(r * c.dim + i)]);
          ss += v * v;
        }
        const double inv = 1.0 / std::sqrt(ss / double(c.dim) + eps);
        for (int64_t i = 0; i < c.dim; ++i) {
          const size_t k = size_t(r * c.dim + i);
          const double exact = engine::bf16_to_f32(w[size_t(i)]) * engine::bf16_to_f32(gx[k]) * inv;
          const double got = engine::bf16_to_f32(gh[k]);
          if (std::fabs(got - exact) > std::ldexp(std::fabs(exact), -8) + 1e-6) {
            std::fprintf(stderr, "rank %d: h[%lld][%lld] %g, exact %g\n", rank, (long long)r,
                         (long long)i, got, exact);
            return 36;
          }
        }
      }
    }
    for (void* b : {dp, dx, dh, dw, rp, rx, rh}) cudaFree(b);
  }
  return 0;
}

// One rank: 0 when every gather was right, kNoPeerPath when the communicator chose NCCL for
// them, else a code naming the failure (stderr says more).
int rank_main(int rank, int world, const std::string& store, int declined_by) {
  if (cudaSetDevice(rank) != cudaSuccess) return 10;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return 11;
  engine::NcclOptions o;
  o.rank = rank;
  o.world_size = world;
  o.device = rank;
  o.store_dir = store;
  o.compute_stream = stream;
  o.timeout = std::chrono::milliseconds(60000);
  // The rank's switches as burst-worker's main reads them (BURST_PEER_GATHER=0 declines).
  auto tuning = engine::Tuning::from_env();
  if (!tuning.ok()) return 18;
  o.peer_gather = tuning.value().peer_gather;
  auto comm = engine::make_nccl_communicator(o);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.message().c_str());
    return 12;
  }
  const std::string how = comm.value()->transport();
  if (declined_by >= 0) {
    // One rank declined: every rank must have fallen back to NCCL, naming it.
    const std::string want = "BURST_PEER_GATHER=0 on rank " + std::to_string(declined_by);
    if (how.find(want) == std::string::npos) {
      std::fprintf(stderr, "rank %d: transport '%s', expected '%s'\n", rank, how.c_str(),
                   want.c_str());
      return 17;
    }
  } else if (how.find("peer") == std::string::npos) {
    std::fprintf(stderr, "rank %d: %s\n", rank, how.c_str());
    return kNoPeerPath;
  }
  const size_t slot = size_t{2} << 20;
  const std::vector<size_t> sizes = {16, 592, 16512, 16 * 4099, (size_t{1} << 20) + 16 * 7,
                                     slot, slot + 16, 48};
  int call = 0;
  for (size_t bytes : sizes) {
    for (int rep = 0; rep < 3; ++rep, ++call) {
      const size_t words = bytes / 4;
      std::vector<uint32_t> in(words), got(words * static_cast<size_t>(world));
      for (size_t i = 0; i < words; ++i) in[i] = word_of(rank, call, i);
      void *din = nullptr, *dout = nullptr;
      if (cudaMalloc(&din, bytes) != cudaSuccess ||
          cudaMalloc(&dout, bytes * static_cast<size_t>(world)) != cudaSuccess) {
        return 13;
      }
      cudaMemset(dout, 0xAB, bytes * static_cast<size_t>(world));
      cudaMemcpy(din, in.data(), bytes, cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
      const Status st = comm.value()->all_gather(din, dout, bytes);
      if (!st.ok()) {
        std::fprintf(stderr, "rank %d, %zu bytes: %s\n", rank, bytes, st.message().c_str());
        return 14;
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess ||
          cudaMemcpy(got.data(), dout, bytes * static_cast<size_t>(world),
                     cudaMemcpyDeviceToHost) != cudaSuccess) {
        std::fprintf(stderr, "rank %d, %zu bytes: %s\n", rank, bytes,
                     cudaGetErrorString(cudaGetLastError()));
        return 15;
      }
      for (int src = 0; src < world; ++src) {
        for (size_t i = 0; i < words; ++i) {
          if (got[static_cast<size_t>(src) * words + i] != word_of(src, call, i)) {
            std::fprintf(stderr, "rank %d, %zu bytes, call %d: word %zu of rank %d wrong\n", rank,
                         bytes, call, i, src);
            return 16;
          }
        }
      }
      cudaFree(din);
      cudaFree(dout);
    }
  }
  // A decode step's rows (by peer stores when the path is on), an odd size (NCCL), and more
  // than a peer slot (NCCL).
  for (const int64_t count : {int64_t{3} * 8192, int64_t{3} * 4099, int64_t{1100007}}) {
    if (const int code = all_reduce_check(*comm.value(), rank, world, stream, count); code != 0) {
      return code;
    }
  }
  return all_reduce_norm_check(*comm.value(), rank, stream, declined_by < 0);
}

TEST(PeerGather, Rank) {
  const char* r = std::getenv("BURST_PG_RANK");
  if (!r) GTEST_SKIP() << "a rank of PeerGather.EveryRanksBlockArrivesOnEveryGpu (run by it)";
  std::exit(rank_main(std::atoi(r), std::atoi(std::getenv("BURST_PG_WORLD")),
                      std::getenv("BURST_PG_STORE"), std::atoi(std::getenv("BURST_PG_DECLINED"))));
}

// Runs PeerGather.Rank on every GPU (up to 8); rank `declined_by` (-1: none) runs with
// BURST_PEER_GATHER=0. The ranks' exit codes, or empty with *skip set.
std::vector<int> run_ranks(int declined_by, std::string* skip) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    cudaGetLastError();
    *skip = "skipping the peer all-gather test: it needs 2 GPUs, this machine has " +
            std::to_string(n);
    return {};
  }
  const int world = n < kernels::kPeerGatherMaxRanks ? n : kernels::kPeerGatherMaxRanks;
  char tmpl[] = "/tmp/burst-peer-gather-XXXXXX";
  if (!mkdtemp(tmpl)) {
    *skip = "no temporary directory";
    return {};
  }
  const std::string store = tmpl;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("BURST_PG_RANK", std::to_string(r).c_str(), 1);
      setenv("BURST_PG_WORLD", std::to_string(world).c_str(), 1);
      setenv("BURST_PG_STORE", store.c_str(), 1);
      setenv("BURST_PG_DECLINED", std::to_string(declined_by).c_str(), 1);
      if (r == declined_by) setenv("BURST_PEER_GATHER", "0", 1);
      execl("/proc/self/exe", "burst_gpu_tests", "--gtest_filter=PeerGather.Rank", nullptr);
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) {
      codes.push_back(126);
      continue;
    }
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

TEST(PeerGather, EveryRanksBlockArrivesOnEveryGpu) {
  if (std::getenv("BURST_PG_RANK")) GTEST_SKIP() << "inside a rank";
  std::string skip;
  const std::vector<int> codes = run_ranks(-1, &skip);
  if (codes.empty()) GTEST_SKIP() << skip;
  bool no_peer = false;
  for (int c : codes) no_peer = no_peer || c == kNoPeerPath;
  if (no_peer) GTEST_SKIP() << "these GPUs take NCCL for the gather (the ranks' stderr says why)";
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// BURST_PEER_GATHER=0 on one rank only (a --join worker's environment is its own): every rank
// takes NCCL, says why, and the gathers are still right.
TEST(PeerGather, OneRankDecliningSendsEveryRankThroughNccl) {
  if (std::getenv("BURST_PG_RANK")) GTEST_SKIP() << "inside a rank";
  std::string skip;
  const std::vector<int> codes = run_ranks(1, &skip);
  if (codes.empty()) GTEST_SKIP() << skip;
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace burst
