// GPU tests of kernels/ops_cuda.h against the CPU twins of kernels/ops.h at odd sizes, in
// bf16, fp16 and fp32. The CPU twin runs in fp32 on the inputs rounded to the dtype; the best a
// same-precision implementation can do is that result rounded once to the dtype ("naive").
// Rule, per element: |ours - ref| <= 2 |naive - ref| + 4e-6 |ref| + 1e-6, i.e. ours rounds the
// right value (fp32 reassociation may flip a rounding that sits on a midpoint, nothing more).
// Embedding is a copy and must be exact. Every test skips with a message without a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "kernels/ops_cuda.h"
#include "gpu_test_util.h"

namespace burst::kernels {
namespace {

class GpuOps : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!testing::have_gpu(why)) GTEST_SKIP() << "skipping GPU ops test: " << why;
  }
};

using testing::decode;
using testing::DevBuf;
using testing::encode;
using testing::random_values;
using testing::round_to;

constexpr DType kDtypes[] = {DType::kBF16, DType::kF16, DType::kF32};

const char* name(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kF16 ? "fp16" : "fp32";
}

void upload(DevBuf& d, const void* data, size_t bytes) {
  CUDA_ASSERT(cudaMalloc(&d.ptr, bytes > 0 ? bytes : 16));
  CUDA_ASSERT(cudaMemcpy(d.ptr, data, bytes, cudaMemcpyHostToDevice));
}

void upload(DevBuf& d, DType t, const std::vector<float>& x) {
  const std::vector<uint8_t> b = encode(t, x);
  upload(d, b.data(), b.size());
}

void download(const DevBuf& d, DType t, size_t n, std::vector<float>& out) {
  std::vector<uint8_t> b(n * testing::dtype_bytes(t));
  CUDA_ASSERT(cudaMemcpy(b.data(), d.ptr, b.size(), cudaMemcpyDeviceToHost));
  out = decode(t, b);
}

std::vector<uint8_t> download_bytes(const DevBuf& d, size_t bytes) {
  std::vector<uint8_t> b(bytes);
  if (cudaMemcpy(b.data(), d.ptr, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    ADD_FAILURE() << "cudaMemcpy of " << bytes << " bytes failed";
    b.clear();
  }
  return b;
}

// The per-element rule of the file comment; reports the first few offenders.
void expect_rounded_right(const std::vector<float>& ours, const std::vector<float>& ref,
                          DType t, const std::string& what) {
  ASSERT_EQ(ours.size(), ref.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double naive_err = std::fabs(double(round_to(t, ref[i])) - ref[i]);
    const double err = std::fabs(double(ours[i]) - ref[i]);
    const double tol = 2 * naive_err + 4e-6 * std::fabs(ref[i]) + 1e-6;
    if (!(err <= tol) && bad++ < 5) {
      ADD_FAILURE() << what << " [" << i << "]: ours " << ours[i] << " ref " << ref[i]
                    << " err " << err << " > " << tol;
    }
  }
}

// Rows of whole 16-byte chunks up to 8192 (16-bit) or 4096 (fp32) elements take the
// vectorised kernel, every other row (and a row not 16-byte aligned, below) the scalar one: dims
// on both sides of each limit, and 4104 = 513 chunks of 16-bit values (one thread holds 3).
TEST_F(GpuOps, RmsNorm) {
  std::mt19937 rng(1);
  for (DType t : kDtypes) {
    for (int64_t rows : {1, 7, 37, 769}) {
      for (int64_t dim : {1, 7, 8, 37, 4095, 4096, 4100, 4104, 8192, 8200}) {
        const std::string what = std::string("rms_norm ") + name(t) + " rows=" +
                                  std::to_string(rows) + " dim=" + std::to_string(dim);
        const auto x = random_values(size_t(rows * dim), -3.f, 3.f, t, rng);
        const auto w = random_values(size_t(dim), 0.5f, 1.5f, t, rng);
        std::vector<float> ref(x.size());
        rms_norm_cpu(x.data(), w.data(), ref.data(), rows, dim, 1e-5f);
        DevBuf dx, dw, dout;
        upload(dx, t, x);
        upload(dw, t, w);
        CUDA_ASSERT(cudaMalloc(&dout.ptr, x.size() * testing::dtype_bytes(t)));
        CUDA_ASSERT(cudaMemset(dout.ptr, 0xff, x.size() * testing::dtype_bytes(t)));  // NaN poison
        CUDA_ASSERT(rms_norm_cuda(dx.ptr, dw.ptr, dout.ptr, rows, dim, 1e-5f, t, nullptr));
        CUDA_ASSERT(cudaDeviceSynchronize());
        std::vector<float> ours;
        download(dout, t, x.size(), ours);
        expect_rounded_right(ours, ref, t, what);
        if (HasFailure()) return;
      }
    }
  }
}

// x, w and out one element past a 16-byte boundary: the scalar kernel, the same rule.
TEST_F(GpuOps, RmsNormUnalignedRows) {
  std::mt19937 rng(11);
  for (DType t : kDtypes) {
    const int64_t rows = 5, dim = 4096;
    const size_t es = testing::dtype_bytes(t);
    const auto x = random_values(size_t(rows * dim + 1), -3.f, 3.f, t, rng);
    const auto w = random_values(size_t(dim + 1), 0.5f, 1.5f, t, rng);
    std::vector<float> ref(size_t(rows * dim));
    rms_norm_cpu(x.data() + 1, w.data() + 1, ref.data(), rows, dim, 1e-5f);
    DevBuf dx, dw, dout;
    upload(dx, t, x);
    upload(dw, t, w);
    CUDA_ASSERT(cudaMalloc(&dout.ptr, (ref.size() + 1) * es));
    CUDA_ASSERT(cudaMemset(dout.ptr, 0xff, (ref.size() + 1) * es));  // NaN poison
    auto* out = static_cast<char*>(dout.ptr) + es;
    CUDA_ASSERT(rms_norm_cuda(static_cast<char*>(dx.ptr) + es, static_cast<char*>(dw.ptr) + es,
                              out, rows, dim, 1e-5f, t, nullptr));
    CUDA_ASSERT(cudaDeviceSynchronize());
    std::vector<uint8_t> b(ref.size() * es);
    CUDA_ASSERT(cudaMemcpy(b.data(), out, b.size(), cudaMemcpyDeviceToHost));
    expect_rounded_right(decode(t, b), ref, t, std::string("rms_norm unaligned ") + name(t));
  }
}

TEST_F(GpuOps, RopeRotateHalf) {
  std::mt19937 rng(2);
  for (DType t : kDtypes) {
    for (int64_t rows : {1, 37, 769}) {
      for (int64_t heads : {1, 3, 32}) {
        // head_dim 8: halves of 4 values, the scalar kernel for 16-bit types (the row-wise
        // vectorised one needs whole 16-byte chunks of a half); 64 and 128: the vectorised one.
        for (int64_t head_dim : {8, 64, 128}) {
          // Rows of a fused [q | k | v] projection: q's heads use the first third of each row.
          const int64_t row_stride = 3 * heads * head_dim;
          const std::string what = std::string("rope ") + name(t) + " rows=" +
                                   std::to_string(rows) + " heads=" + std::to_string(heads) +
                                   " d=" + std::to_string(head_dim);
          auto x = random_values(size_t(rows * row_stride), -2.f, 2.f, t, rng);
          std::vector<int64_t> pos(rows);
          std::uniform_int_distribution<int64_t> pd(0, 200000);  // long-context positions
          for (auto& p : pos) p = pd(rng);
          std::vector<float> inv_freq(head_dim / 2);
          for (int64_t d = 0; d < head_dim / 2; ++d) {
            inv_freq[d] = 1.f / std::pow(10000.f, 2.f * d / head_dim);
          }
          DevBuf dx, dpos, dfreq;
          upload(dx, t, x);
          upload(dpos, pos.data(), pos.size() * sizeof(int64_t));
          upload(dfreq, inv_freq.data(), inv_freq.size() * sizeof(float));
          CUDA_ASSERT(rope_cuda(dx.ptr, rows, heads, head_dim, row_stride,
                                static_cast<const int64_t*>(dpos.ptr),
                                static_cast<const float*>(dfreq.ptr), t, nullptr));
          CUDA_ASSERT(cudaDeviceSynchronize());
          std::vector<float> ours;
          download(dx, t, x.size(), ours);
          rope_cpu(x.data(), rows, heads, head_dim, row_stride, pos.data(), inv_freq.data());
          // The untouched k and v parts of each row must come back bit-identical: the rule's
          // naive error is 0 there, so any change fails it.
          expect_rounded_right(ours, x, t, what);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// q and k rotated in one launch (rope_qk_cuda, the decode step's) give the bits of one rope_cuda
// each: rows of a fused [q | k | v] projection, GQA (k has a quarter of q's heads, at least 1).
TEST_F(GpuOps, RopeQkInOneLaunchEqualsOneEach) {
  std::mt19937 rng(7);
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t rows : {1, 37}) {
      for (int64_t heads : {1, 8, 32}) {
        const int64_t kv_heads = std::max<int64_t>(1, heads / 4), head_dim = 128;
        const int64_t stride = (heads + 2 * kv_heads) * head_dim;
        const auto x = random_values(size_t(rows * stride), -2.f, 2.f, t, rng);
        std::vector<int64_t> pos(rows);
        std::uniform_int_distribution<int64_t> pd(0, 200000);
        for (auto& p : pos) p = pd(rng);
        std::vector<float> inv_freq(head_dim / 2);
        for (int64_t d = 0; d < head_dim / 2; ++d) {
          inv_freq[d] = 1.f / std::pow(10000.f, 2.f * d / head_dim);
        }
        DevBuf one, two, dpos, dfreq;
        upload(one, t, x);
        upload(two, t, x);
        upload(dpos, pos.data(), pos.size() * sizeof(int64_t));
        upload(dfreq, inv_freq.data(), inv_freq.size() * sizeof(float));
        const auto* p = static_cast<const int64_t*>(dpos.ptr);
        const auto* f = static_cast<const float*>(dfreq.ptr);
        const size_t k_off = size_t(heads * head_dim) * testing::dtype_bytes(t);
        char* o = static_cast<char*>(one.ptr);
        char* w = static_cast<char*>(two.ptr);
        CUDA_ASSERT(rope_qk_cuda(o, heads, stride, o + k_off, kv_heads, stride, rows, head_dim,
                                 p, f, t, nullptr));
        CUDA_ASSERT(rope_cuda(w, rows, heads, head_dim, stride, p, f, t, nullptr));
        CUDA_ASSERT(rope_cuda(w + k_off, rows, kv_heads, head_dim, stride, p, f, t, nullptr));
        CUDA_ASSERT(cudaDeviceSynchronize());
        std::vector<float> a, b;
        download(one, t, x.size(), a);
        download(two, t, x.size(), b);
        ASSERT_EQ(a, b) << name(t) << " rows=" << rows << " heads=" << heads;
        ASSERT_NE(a, x);  // something rotated
      }
    }
  }
}

// Paged row gather: the CUDA twin equals the CPU reference byte for byte (shuffled pages, row
// counts that end mid-page, bf16 rows of the 7B KV width and odd narrow rows).
TEST_F(GpuOps, GatherRowsMatchesCpu) {
  std::mt19937 rng(5);
  for (const int64_t row_bytes : {int64_t{8192}, int64_t{48}}) {
    for (const int64_t page : {int64_t{256}, int64_t{16}}) {
      for (const int64_t rows : {int64_t{1}, int64_t{37}, int64_t{4095}}) {
        const int64_t pages_used = (rows + page - 1) / page, pool_pages = pages_used + 3;
        std::vector<int32_t> perm(static_cast<size_t>(pool_pages));
        for (int64_t i = 0; i < pool_pages; ++i) perm[size_t(i)] = static_cast<int32_t>(i);
        std::shuffle(perm.begin(), perm.end(), rng);
        perm.resize(static_cast<size_t>(pages_used));
        std::vector<uint8_t> pool(size_t(pool_pages * page * row_bytes));
        for (auto& b : pool) b = static_cast<uint8_t>(rng());
        std::vector<uint8_t> want(size_t(rows * row_bytes)), got(want.size());
        gather_rows_cpu(pool.data(), perm.data(), page, rows, row_bytes, want.data());
        DevBuf dpool, dpages, ddst;
        CUDA_ASSERT(cudaMalloc(&dpool.ptr, pool.size()));
        CUDA_ASSERT(cudaMalloc(&dpages.ptr, perm.size() * 4));
        CUDA_ASSERT(cudaMalloc(&ddst.ptr, got.size()));
        CUDA_ASSERT(cudaMemcpy(dpool.ptr, pool.data(), pool.size(), cudaMemcpyHostToDevice));
        CUDA_ASSERT(cudaMemcpy(dpages.ptr, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
        CUDA_ASSERT(gather_rows_cuda(dpool.ptr, static_cast<const int32_t*>(dpages.ptr), page,
                                     rows, row_bytes, ddst.ptr, nullptr));
        CUDA_ASSERT(cudaMemcpy(got.data(), ddst.ptr, got.size(), cudaMemcpyDeviceToHost));
        EXPECT_EQ(got, want) << row_bytes << " bytes, page " << page << ", " << rows << " rows";
      }
    }
  }
  EXPECT_EQ(gather_rows_cuda(nullptr, nullptr, 16, 1, 24, nullptr, nullptr),
            cudaErrorInvalidValue);  // rows of 24 bytes: not 16-byte vectors
}

// Row scatter (decode tokens' k/v into their pages): equals the CPU reference, skipped rows
// (-1) leave the pool untouched.
TEST_F(GpuOps, ScatterRowsMatchesCpu) {
  std::mt19937 rng(6);
  const int64_t row_bytes = 8192, pool_rows = 4096;
  for (const int64_t rows : {int64_t{1}, int64_t{16}, int64_t{37}}) {
    std::vector<int32_t> dst(static_cast<size_t>(rows));
    std::vector<int32_t> all(static_cast<size_t>(pool_rows));
    for (int64_t i = 0; i < pool_rows; ++i) all[size_t(i)] = static_cast<int32_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t i = 0; i < rows; ++i) dst[size_t(i)] = i % 3 == 1 ? -1 : all[size_t(i)];
    std::vector<uint8_t> src(size_t(rows * row_bytes)), pool(size_t(pool_rows * row_bytes));
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    for (auto& b : pool) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> want = pool, got(pool.size());
    scatter_rows_cpu(src.data(), dst.data(), rows, row_bytes, want.data());
    DevBuf dsrc, ddst, dpool;
    CUDA_ASSERT(cudaMalloc(&dsrc.ptr, src.size()));
    CUDA_ASSERT(cudaMalloc(&ddst.ptr, dst.size() * 4));
    CUDA_ASSERT(cudaMalloc(&dpool.ptr, pool.size()));
    CUDA_ASSERT(cudaMemcpy(dsrc.ptr, src.data(), src.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(ddst.ptr, dst.data(), dst.size() * 4, cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dpool.ptr, pool.data(), pool.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(scatter_rows_cuda(dsrc.ptr, static_cast<const int32_t*>(ddst.ptr), rows,
                                  row_bytes, dpool.ptr, nullptr));
    CUDA_ASSERT(cudaMemcpy(got.data(), dpool.ptr, got.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, want) << rows << " rows";
    // The pair form (a step's k and v): src into the pool again (same bytes as above) and a
    // second source, reversed, into a second pool; one launch.
    std::vector<uint8_t> src2(src.rbegin(), src.rend()), want2 = pool, got2(pool.size());
    scatter_rows_cpu(src2.data(), dst.data(), rows, row_bytes, want2.data());
    DevBuf dsrc2, dpool2;
    CUDA_ASSERT(cudaMalloc(&dsrc2.ptr, src2.size()));
    CUDA_ASSERT(cudaMalloc(&dpool2.ptr, pool.size()));
    CUDA_ASSERT(cudaMemcpy(dsrc2.ptr, src2.data(), src2.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dpool.ptr, pool.data(), pool.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemcpy(dpool2.ptr, pool.data(), pool.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(scatter_rows_pair_cuda(dsrc.ptr, dpool.ptr, dsrc2.ptr, dpool2.ptr,
                                       static_cast<const int32_t*>(ddst.ptr), rows, row_bytes,
                                       nullptr));
    CUDA_ASSERT(cudaMemcpy(got.data(), dpool.ptr, got.size(), cudaMemcpyDeviceToHost));
    CUDA_ASSERT(cudaMemcpy(got2.data(), dpool2.ptr, got2.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, want) << rows << " rows, pair";
    EXPECT_EQ(got2, want2) << rows << " rows, pair (second)";
  }
}

TEST_F(GpuOps, SiluMul) {
  std::mt19937 rng(3);
  for (DType t : kDtypes) {
    for (int64_t n : {1, 7, 37, 127, 769, 4095, (1 << 20) + 3}) {
      auto gate = random_values(size_t(n), -12.f, 12.f, t, rng);
      const auto up = random_values(size_t(n), -2.f, 2.f, t, rng);
      if (n > 2) {  // saturated ends: exp(-g) overflows to inf for g < -88 (silu -> -0)
        gate[0] = round_to(t, -100.f);
        gate[1] = round_to(t, 100.f);
      }
      std::vector<float> ref(n);
      silu_mul_cpu(gate.data(), up.data(), ref.data(), n);
      DevBuf dg, du, dout;
      upload(dg, t, gate);
      upload(du, t, up);
      CUDA_ASSERT(cudaMalloc(&dout.ptr, n * testing::dtype_bytes(t)));
      CUDA_ASSERT(silu_mul_cuda(dg.ptr, du.ptr, dout.ptr, n, t, nullptr));
      CUDA_ASSERT(cudaDeviceSynchronize());
      std::vector<float> ours;
      download(dout, t, size_t(n), ours);
      expect_rounded_right(ours, ref, t, std::string("silu_mul ") + name(t) + " n=" +
                                             std::to_string(n));
      if (HasFailure()) return;
    }
  }
}

// silu_mul, add and convert take 16-byte chunks where every pointer is 16-byte aligned and one
// value a thread otherwise: the same operands one element off alignment (the scalar path) must
// give the same bits as aligned (the chunks, plus the scalar tail of an odd n).
TEST_F(GpuOps, ElementwiseChunksEqualOneValueAtATime) {
  std::mt19937 rng(5);
  for (DType t : kDtypes) {
    const size_t es = testing::dtype_bytes(t);
    for (int64_t n : {1, 13, 4099, (1 << 18) + 5}) {
      const auto a = random_values(size_t(n), -12.f, 12.f, t, rng);
      const auto b = random_values(size_t(n), -2.f, 2.f, t, rng);
      // Each buffer holds the operand at offset 0 (aligned) and at one element (not aligned).
      auto twice = [&](DevBuf& d, const std::vector<float>& x) {
        std::vector<uint8_t> bytes = encode(t, x);
        CUDA_ASSERT(cudaMalloc(&d.ptr, (2 * n + 1) * es));
        CUDA_ASSERT(cudaMemcpy(d.ptr, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
        CUDA_ASSERT(cudaMemcpy(static_cast<char*>(d.ptr) + (n + 1) * es, bytes.data(),
                               bytes.size(), cudaMemcpyHostToDevice));
      };
      DevBuf da, db, dout, dx, dconv;
      twice(da, a);
      twice(db, b);
      twice(dx, a);
      CUDA_ASSERT(cudaMalloc(&dout.ptr, (2 * n + 1) * es));
      const DType to = t == DType::kF32 ? DType::kBF16 : DType::kF32;  // narrower and wider
      const size_t ts = testing::dtype_bytes(to);
      CUDA_ASSERT(cudaMalloc(&dconv.ptr, (2 * n + 1) * ts));
      for (size_t off : {size_t{0}, size_t(n + 1)}) {
        auto at = [&](DevBuf& d, size_t bytes) { return static_cast<char*>(d.ptr) + off * bytes; };
        CUDA_ASSERT(silu_mul_cuda(at(da, es), at(db, es), at(dout, es), n, t, nullptr));
        CUDA_ASSERT(add_cuda(at(dx, es), at(db, es), n, t, nullptr));
        CUDA_ASSERT(convert_cuda(at(da, es), t, at(dconv, ts), to, n, nullptr));
      }
      CUDA_ASSERT(cudaDeviceSynchronize());
      auto halves_equal = [&](const DevBuf& d, DType dt, const char* what) {
        const size_t bytes = n * testing::dtype_bytes(dt);
        std::vector<uint8_t> all = download_bytes(d, (2 * n + 1) * testing::dtype_bytes(dt));
        const std::vector<uint8_t> aligned(all.begin(), all.begin() + bytes);
        const std::vector<uint8_t> odd(all.begin() + (n + 1) * testing::dtype_bytes(dt),
                                       all.begin() + (n + 1) * testing::dtype_bytes(dt) + bytes);
        EXPECT_EQ(aligned, odd) << what << " " << name(t) << " n=" << n;
        return decode(dt, aligned);
      };
      const auto silu = halves_equal(dout, t, "silu_mul");
      const auto sum = halves_equal(dx, t, "add");
      const auto conv = halves_equal(dconv, to, "convert");
      // Not vacuous: the outputs are the operation's, element by element.
      std::vector<float> ref(n);
      silu_mul_cpu(a.data(), b.data(), ref.data(), n);
      expect_rounded_right(silu, ref, t, std::string("silu_mul ") + name(t));
      for (int64_t i = 0; i < n; ++i) ref[i] = a[i] + b[i];
      expect_rounded_right(sum, ref, t, std::string("add ") + name(t));
      expect_rounded_right(conv, a, to, std::string("convert ") + name(t));
      if (HasFailure()) return;
    }
  }
}

TEST_F(GpuOps, EmbeddingIsExact) {
  std::mt19937 rng(4);
  const int64_t vocab = 1000;
  for (DType t : kDtypes) {
    for (int64_t rows : {1, 7, 769}) {
      for (int64_t dim : {7, 64, 4095}) {
        const auto table = random_values(size_t(vocab * dim), -1.f, 1.f, t, rng);
        std::vector<int32_t> ids(rows);
        std::uniform_int_distribution<int32_t> id(0, vocab - 1);
        for (auto& i : ids) i = id(rng);
        ids[0] = vocab - 1;  // the last row of the table
        // Every third row from 1 on names an id drawn on the device: -1 - k reads drawn[k].
        std::vector<int32_t> drawn(5), resolved = ids;
        for (auto& i : drawn) i = id(rng);
        for (int64_t r = 1; r < rows; r += 3) {
          const auto k = static_cast<int32_t>(r % 5);
          ids[size_t(r)] = -1 - k;
          resolved[size_t(r)] = drawn[size_t(k)];
        }
        std::vector<float> ref(size_t(rows * dim));
        embedding_cpu(table.data(), resolved.data(), ref.data(), rows, dim);
        DevBuf dt, di, dd, dout;
        upload(dt, t, table);
        upload(di, ids.data(), ids.size() * sizeof(int32_t));
        upload(dd, drawn.data(), drawn.size() * sizeof(int32_t));
        CUDA_ASSERT(cudaMalloc(&dout.ptr, ref.size() * testing::dtype_bytes(t)));
        CUDA_ASSERT(embedding_cuda(dt.ptr, static_cast<const int32_t*>(di.ptr),
                                   static_cast<const int32_t*>(dd.ptr), dout.ptr, rows, dim, t,
                                   nullptr));
        CUDA_ASSERT(cudaDeviceSynchronize());
        std::vector<float> ours;
        download(dout, t, ref.size(), ours);
        ASSERT_EQ(ours, ref) << "embedding " << name(t) << " rows=" << rows << " dim=" << dim;
      }
    }
  }
}

// The decode GEMV against a double-precision product of the same (rounded) inputs: per element
// |ours - ref| <= 2 |naive - ref| (the rounding to the dtype) + k 2^-23 sum |x w| (fp32
// accumulation in any order) + the file's slack. Rows m = 1..kGemvMaxRows, n odd (a warp's tail),
// k from under one warp's pass to several with a partial last pass; out accumulated or not.
TEST_F(GpuOps, GemvMatchesDoubleProductWithinAccumulationBound) {
  std::mt19937 rng(41);
  struct Shape { int64_t n, k; };
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (Shape sh : {Shape{37, 264}, Shape{1031, 4096}, Shape{77, 11008}}) {
      for (int64_t m = 1; m <= kGemvMaxRows; ++m) {
        const auto x = random_values(size_t(m * sh.k), -1.f, 1.f, t, rng);
        const auto w = random_values(size_t(sh.n * sh.k), -0.05f, 0.05f, t, rng);
        const auto old = random_values(size_t(m * sh.n), -1.f, 1.f, t, rng);
        for (bool accumulate : {false, true}) {
          const std::string what = std::string(name(t)) + " m=" + std::to_string(m) +
                                   " n=" + std::to_string(sh.n) + " k=" + std::to_string(sh.k) +
                                   (accumulate ? " accumulate" : "");
          DevBuf dx, dw, dout;
          upload(dx, t, x);
          upload(dw, t, w);
          upload(dout, t, old);
          ASSERT_TRUE(gemv_cuda_applies(m, sh.n, sh.k, t, dx.ptr, dw.ptr, dout.ptr)) << what;
          CUDA_ASSERT(gemv_cuda(dx.ptr, dw.ptr, dout.ptr, m, sh.n, sh.k, t, accumulate, nullptr));
          CUDA_ASSERT(cudaDeviceSynchronize());
          std::vector<float> ours;
          download(dout, t, size_t(m * sh.n), ours);
          int bad = 0;
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < sh.n; ++j) {
              double ref = accumulate ? old[size_t(i * sh.n + j)] : 0.0, mag = 0.0;
              for (int64_t c = 0; c < sh.k; ++c) {
                const double p = double(x[size_t(i * sh.k + c)]) * w[size_t(j * sh.k + c)];
                ref += p;
                mag += std::fabs(p);
              }
              const double got = ours[size_t(i * sh.n + j)];
              const double naive_err = std::fabs(double(round_to(t, float(ref))) - ref);
              const double tol = 2 * naive_err + double(sh.k) * std::ldexp(1.0, -23) * mag +
                                 4e-6 * std::fabs(ref) + 1e-6;
              if (!(std::fabs(got - ref) <= tol) && bad++ < 5) {
                ADD_FAILURE() << what << " [" << i << ", " << j << "]: ours " << got << " ref "
                              << ref << " > tol " << tol;
              }
            }
          }
        }
      }
    }
  }
}

// Three products of one x (a layer's q, k, v shaped: n[s] x k random weights) with two output
// buffers each, m rows: `a` for the launch under test, `b` for the reference.
struct ThreeProducts {
  int64_t n[3] = {}, m = 0;
  size_t es = 0;
  DevBuf w[3], a[3], b[3];
  GemvOut outs_a[3] = {}, outs_b[3] = {};
  // Draws the weights and allocates the outputs (fatal failures return early: check
  // HasFailure()).
  void make(const int64_t (&ns)[3], int64_t rows, int64_t k, DType t, std::mt19937& rng) {
    m = rows;
    es = testing::dtype_bytes(t);
    for (int s = 0; s < 3; ++s) {
      n[s] = ns[s];
      upload(w[s], t, random_values(size_t(n[s] * k), -0.05f, 0.05f, t, rng));
      CUDA_ASSERT(cudaMalloc(&a[s].ptr, bytes(s)));
      CUDA_ASSERT(cudaMalloc(&b[s].ptr, bytes(s)));
      outs_a[s] = {w[s].ptr, a[s].ptr, n[s]};
      outs_b[s] = {w[s].ptr, b[s].ptr, n[s]};
    }
  }
  size_t bytes(int s) const { return size_t(m * n[s]) * es; }
  // a and b hold the same bits, segment by segment.
  void expect_same(const std::string& what) const {
    for (int s = 0; s < 3; ++s) {
      EXPECT_EQ(download_bytes(a[s], bytes(s)), download_bytes(b[s], bytes(s)))
          << what << " segment " << s;
    }
  }
};

// One launch for several products of the same x (a layer's q, k, v), and gate/up with SwiGLU at
// the store, give what separate launches give, bit for bit (the same per-lane accumulation
// order, the same roundings), on a stream of their own (launches there are chained: PDL).
TEST_F(GpuOps, GemvMultiAndSwigluEqualSeparateLaunchesBitForBit) {
  std::mt19937 rng(43);
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (DType t : {DType::kBF16, DType::kF16}) {
    const size_t es = testing::dtype_bytes(t);
    for (int64_t k : {264, 4096}) {
      for (int64_t m = 1; m <= kGemvMaxRows; ++m) {
        const std::string what = std::string(name(t)) + " m=" + std::to_string(m) + " k=" +
                                 std::to_string(k);
        const auto x = random_values(size_t(m * k), -1.f, 1.f, t, rng);
        DevBuf dx;
        upload(dx, t, x);
        // q, k, v shaped: three n, one odd (a warp's tail), one under a CTA. a: one launch,
        // b: one launch each.
        ThreeProducts pr;
        pr.make({1031, 264, 5}, m, k, t, rng);
        if (HasFailure()) return;
        for (int s = 0; s < 3; ++s) {
          CUDA_ASSERT(gemv_cuda(dx.ptr, pr.w[s].ptr, pr.b[s].ptr, m, pr.n[s], k, t, false, stream));
        }
        CUDA_ASSERT(gemv_multi_cuda(dx.ptr, pr.outs_a, 3, m, k, t, stream));
        CUDA_ASSERT(cudaStreamSynchronize(stream));
        pr.expect_same(what);
        if (HasFailure()) return;
        // SwiGLU: gate and up of n = 1031 rows, against gemv + gemv + silu_mul.
        const int64_t n = 1031;
        DevBuf dg, du, gate, up, out;
        upload(dg, t, random_values(size_t(n * k), -0.2f, 0.2f, t, rng));
        upload(du, t, random_values(size_t(n * k), -0.2f, 0.2f, t, rng));
        for (DevBuf* b : {&gate, &up, &out}) CUDA_ASSERT(cudaMalloc(&b->ptr, size_t(m * n) * es));
        CUDA_ASSERT(gemv_cuda(dx.ptr, dg.ptr, gate.ptr, m, n, k, t, false, stream));
        CUDA_ASSERT(gemv_cuda(dx.ptr, du.ptr, up.ptr, m, n, k, t, false, stream));
        CUDA_ASSERT(silu_mul_cuda(gate.ptr, up.ptr, gate.ptr, m * n, t, stream));
        CUDA_ASSERT(gemv_swiglu_cuda(dx.ptr, dg.ptr, du.ptr, out.ptr, m, n, k, t, stream));
        CUDA_ASSERT(cudaStreamSynchronize(stream));
        const auto fused_bytes = download_bytes(out, size_t(m * n) * es);
        ASSERT_EQ(fused_bytes, download_bytes(gate, size_t(m * n) * es)) << what << " swiglu";
        // Not vacuous: silu of random sums is neither zero nor constant.
        std::vector<float> vals;
        download(out, t, size_t(m * n), vals);
        ASSERT_GT(std::count_if(vals.begin(), vals.end(), [](float v) { return v != 0.f; }),
                  int64_t(vals.size() / 2)) << what;
      }
    }
  }
  CUDA_ASSERT(cudaStreamDestroy(stream));
}

// q and k rotated at the GEMV's store (GemvRope: a decode step's q/k/v launch with RoPE in it)
// give the bits of gemv_multi_cuda's stores then rope_qk_cuda, for GQA shapes at head_dim 128
// and 64, every row count, positions up to ~1e6 (large angles), q and k rotated and v not.
TEST_F(GpuOps, GemvWithRopeEqualsGemvThenRopeBitForBit) {
  std::mt19937 rng(45);
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (DType t : {DType::kBF16, DType::kF16}) {
    const size_t es = testing::dtype_bytes(t);
    for (int head_dim : {128, 64}) {
      const int heads = 6, kv_heads = 2, k = 520;
      const int64_t ns[3] = {int64_t{heads} * head_dim, int64_t{kv_heads} * head_dim,
                             int64_t{kv_heads} * head_dim};
      std::vector<float> inv_freq(size_t(head_dim / 2));
      for (int i = 0; i < head_dim / 2; ++i) {
        inv_freq[size_t(i)] = std::pow(10000.f, -2.f * i / head_dim);
      }
      DevBuf df;
      CUDA_ASSERT(cudaMalloc(&df.ptr, inv_freq.size() * sizeof(float)));
      CUDA_ASSERT(cudaMemcpy(df.ptr, inv_freq.data(), inv_freq.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
      for (int64_t m = 1; m <= kGemvMaxRows; ++m) {
        const std::string what = std::string(name(t)) + " head_dim=" +
                                 std::to_string(head_dim) + " m=" + std::to_string(m);
        std::vector<int64_t> pos(static_cast<size_t>(m));
        for (auto& p : pos) p = std::uniform_int_distribution<int64_t>(0, 1 << 20)(rng);
        DevBuf dp, dx;
        CUDA_ASSERT(cudaMalloc(&dp.ptr, pos.size() * sizeof(int64_t)));
        CUDA_ASSERT(cudaMemcpy(dp.ptr, pos.data(), pos.size() * sizeof(int64_t),
                               cudaMemcpyHostToDevice));
        upload(dx, t, random_values(size_t(m * k), -1.f, 1.f, t, rng));
        // a: q/k/v with RoPE at the store; b: the plain launch, then the rope kernel.
        ThreeProducts pr;
        pr.make(ns, m, k, t, rng);
        if (HasFailure()) return;
        const auto* p = static_cast<const int64_t*>(dp.ptr);
        const auto* f = static_cast<const float*>(df.ptr);
        CUDA_ASSERT(gemv_multi_cuda(dx.ptr, pr.outs_b, 3, m, k, t, stream));
        CUDA_ASSERT(cudaStreamSynchronize(stream));
        const std::vector<uint8_t> unrotated = download_bytes(pr.b[0], pr.bytes(0));
        CUDA_ASSERT(rope_qk_cuda(pr.b[0].ptr, heads, ns[0], pr.b[1].ptr, kv_heads, ns[1], m,
                                 head_dim, p, f, t, stream));
        const GemvRope rope{p, f, head_dim, 2};
        CUDA_ASSERT(gemv_multi_cuda(dx.ptr, pr.outs_a, 3, m, k, t, stream, &rope));
        CUDA_ASSERT(cudaStreamSynchronize(stream));
        pr.expect_same(what);
        if (HasFailure()) return;
        // Not vacuous: the rotation moved q.
        ASSERT_NE(download_bytes(pr.a[0], pr.bytes(0)), unrotated) << what;
      }
      // Refused: head_dim odd, an output not a whole number of heads, more rotating segments
      // than outputs.
      DevBuf dx, dw, dout;
      upload(dx, t, random_values(size_t(k), -1.f, 1.f, t, rng));
      upload(dw, t, random_values(size_t(3 * head_dim * k), -0.05f, 0.05f, t, rng));
      CUDA_ASSERT(cudaMalloc(&dout.ptr, size_t(3 * head_dim) * es));
      DevBuf dp;
      CUDA_ASSERT(cudaMalloc(&dp.ptr, sizeof(int64_t)));
      const auto* p = static_cast<const int64_t*>(dp.ptr);
      const auto* f = static_cast<const float*>(df.ptr);
      const GemvOut whole{dw.ptr, dout.ptr, 3 * int64_t{head_dim}};
      const GemvOut partial{dw.ptr, dout.ptr, 3 * int64_t{head_dim} - 2};
      const GemvRope odd{p, f, head_dim - 1, 1}, too_many{p, f, head_dim, 2}, ok{p, f, head_dim, 1};
      EXPECT_EQ(gemv_multi_cuda(dx.ptr, &whole, 1, 1, k, t, stream, &odd), cudaErrorInvalidValue);
      EXPECT_EQ(gemv_multi_cuda(dx.ptr, &partial, 1, 1, k, t, stream, &ok),
                cudaErrorInvalidValue);
      EXPECT_EQ(gemv_multi_cuda(dx.ptr, &whole, 1, 1, k, t, stream, &too_many),
                cudaErrorInvalidValue);
    }
  }
  CUDA_ASSERT(cudaStreamDestroy(stream));
}

// Chained launches (cuda_dispatch.cuh: each kernel a programmatic dependent of the one before,
// on sm_90+) read what the kernel before wrote: a decode-like chain (norm -> GEMV -> residual
// add -> ...) queued back to back gives the bits of the same chain with the stream synchronised
// after every launch (where no overlap is possible). A kernel that read its input before its
// predecessor finished would see the previous iteration's values.
// The chained copy (CudaBackend::copy's small copies) moves every byte, from one 16-byte vector
// to a MiB; a size or address off 16 bytes is refused.
TEST_F(GpuOps, CopyChainedMovesEveryByte) {
  std::mt19937 rng(45);
  for (const int64_t bytes : {int64_t{16}, int64_t{1040}, int64_t{1} << 20}) {
    std::vector<uint8_t> src(static_cast<size_t>(bytes)), got(src.size());
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    DevBuf dsrc, ddst;
    CUDA_ASSERT(cudaMalloc(&dsrc.ptr, src.size()));
    CUDA_ASSERT(cudaMalloc(&ddst.ptr, src.size()));
    CUDA_ASSERT(cudaMemcpy(dsrc.ptr, src.data(), src.size(), cudaMemcpyHostToDevice));
    CUDA_ASSERT(cudaMemset(ddst.ptr, 0x5a, src.size()));
    CUDA_ASSERT(copy_chained_cuda(ddst.ptr, dsrc.ptr, bytes, nullptr));
    CUDA_ASSERT(cudaMemcpy(got.data(), ddst.ptr, got.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, src) << bytes << " bytes";
  }
  alignas(16) static uint8_t buf[64] = {};
  EXPECT_EQ(copy_chained_cuda(buf, buf + 16, 24, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(copy_chained_cuda(buf + 8, buf + 32, 16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(copy_chained_cuda(buf, buf, 0, nullptr), cudaSuccess);
  CUDA_ASSERT(cudaGetLastError());
}

TEST_F(GpuOps, ChainedLaunchesSeeTheirPredecessorsWrites) {
  std::mt19937 rng(44);
  const DType t = DType::kBF16;
  const int64_t d = 4096, f = 2752;  // 11008 / 4: a gate/up/down shape
  cudaStream_t stream = nullptr;
  CUDA_ASSERT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DevBuf norm_w, wq, wg, wu, wd;
  upload(norm_w, t, random_values(size_t(d), 0.5f, 1.5f, t, rng));
  upload(wq, t, random_values(size_t(d * d), -0.02f, 0.02f, t, rng));
  upload(wg, t, random_values(size_t(f * d), -0.02f, 0.02f, t, rng));
  upload(wu, t, random_values(size_t(f * d), -0.02f, 0.02f, t, rng));
  upload(wd, t, random_values(size_t(d * f), -0.02f, 0.02f, t, rng));
  const auto x0 = random_values(size_t(d), -1.f, 1.f, t, rng);
  std::vector<uint8_t> result[2];
  for (int synced = 0; synced < 2; ++synced) {
    DevBuf x, h, q, q2, g;
    upload(x, t, x0);
    for (DevBuf* b : {&h, &q, &q2}) CUDA_ASSERT(cudaMalloc(&b->ptr, size_t(d) * 2));
    CUDA_ASSERT(cudaMalloc(&g.ptr, size_t(f) * 2));
    auto step = [&](cudaError_t err) {
      CUDA_ASSERT(err);
      if (synced) CUDA_ASSERT(cudaStreamSynchronize(stream));
    };
    for (int layer = 0; layer < 24; ++layer) {
      step(rms_norm_cuda(x.ptr, norm_w.ptr, h.ptr, 1, d, 1e-5f, t, stream));
      step(gemv_cuda(h.ptr, wq.ptr, q.ptr, 1, d, d, t, false, stream));
      step(copy_chained_cuda(q2.ptr, q.ptr, d * 2, stream));  // as a decode token's k and v
      step(add_cuda(x.ptr, q2.ptr, d, t, stream));
      step(rms_norm_cuda(x.ptr, norm_w.ptr, h.ptr, 1, d, 1e-5f, t, stream));
      step(gemv_swiglu_cuda(h.ptr, wg.ptr, wu.ptr, g.ptr, 1, f, d, t, stream));
      step(gemv_cuda(g.ptr, wd.ptr, x.ptr, 1, d, f, t, true, stream));
    }
    CUDA_ASSERT(cudaStreamSynchronize(stream));
    result[synced] = download_bytes(x, size_t(d) * 2);
  }
  ASSERT_EQ(result[0], result[1]);
  std::vector<float> first = decode(t, result[0]);
  ASSERT_NE(first, x0);  // the chain changed x
  CUDA_ASSERT(cudaStreamDestroy(stream));
}

TEST_F(GpuOps, RejectsBadArguments) {
  EXPECT_EQ(rope_cuda(nullptr, 1, 1, 63, 63, nullptr, nullptr, DType::kBF16, nullptr),
            cudaErrorInvalidValue);  // odd head_dim
  EXPECT_EQ(rms_norm_cuda(nullptr, nullptr, nullptr, 1, 8, 1e-5f, DType::kBF16, nullptr),
            cudaErrorInvalidValue);  // null pointers
  EXPECT_EQ(silu_mul_cuda(nullptr, nullptr, nullptr, 0, DType::kBF16, nullptr), cudaSuccess);
  alignas(16) static const uint16_t buf[64] = {};
  EXPECT_FALSE(gemv_cuda_applies(kGemvMaxRows + 1, 8, 8, DType::kBF16, buf, buf, buf));  // m
  EXPECT_FALSE(gemv_cuda_applies(1, 8, 12, DType::kBF16, buf, buf, buf));  // k % 8
  EXPECT_FALSE(gemv_cuda_applies(1, 8, 8, DType::kF32, buf, buf, buf));    // dtype
  EXPECT_FALSE(gemv_cuda_applies(1, 8, 8, DType::kBF16, buf + 1, buf, buf));  // misaligned x
  EXPECT_EQ(gemv_cuda(buf, buf, nullptr, 1, 8, 8, DType::kBF16, false, nullptr),
            cudaErrorInvalidValue);  // null out
  const GemvOut one{buf, const_cast<uint16_t*>(buf), 8};
  EXPECT_EQ(gemv_multi_cuda(buf, &one, 0, 1, 8, DType::kBF16, nullptr), cudaErrorInvalidValue);
  const GemvOut four[4] = {one, one, one, one};
  EXPECT_EQ(gemv_multi_cuda(buf, four, 4, 1, 8, DType::kBF16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gemv_swiglu_cuda(buf, buf, buf + 1, const_cast<uint16_t*>(buf), 1, 8, 8,
                             DType::kBF16, nullptr),
            cudaErrorInvalidValue);  // misaligned up weights
  CUDA_ASSERT(cudaGetLastError());
}

}  // namespace
}  // namespace burst::kernels
