// BurstAttention on real processes over Gloo (loopback): the ring's prefill output equals one
// monolithic attention over the whole sequence for N = 1..4 ranks, zigzag and contiguous,
// lengths that are not multiples of 2N, GQA, rows that see nothing; one decode step gives the
// monolithic answer, bit-identical on every rank; chunk-by-chunk prefill by either ring (pass-KV,
// pass-Q) gives the same rows; and with a transport that is slower than
// compute, the double buffer hides it (total close to max(compute, comm), not their sum).
// Under an FP8 KV cache the same holds against monolithic attention over the keys and values
// the FP8 rows hold (kernels/kv_fp8.h): every key a query sees, cached or of its own chunk,
// went through the same rounding, however the prompt was cut. Under FP8 attention (the CPU
// emulation of the Hopper kernel's roundings, whose blocks follow each launch's keys) the
// chunk-by-chunk rows' error against exact attention is at most twice that of one monolithic
// FP8 attention over the whole prompt.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <ostream>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "engine/ring_attention.h"
#include "kernels/kv_fp8.h"
#include "multiprocess.h"

namespace burst::engine {
namespace {

using burst::testing::make_temp_dir;
using burst::testing::run_ranks;

struct Shape {
  int64_t n;
  int heads, kv_heads, head_dim;
};

std::vector<float> random_vec(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = u(rng); while (x == 0.f);
  }
  return v;
}

// x [rows, kv_heads * head_dim] through FP8 KV rows and back: the values an FP8 cache holds.
std::vector<float> through_fp8(const std::vector<float>& x, int kv_heads, int head_dim) {
  const int64_t kvw = int64_t{kv_heads} * head_dim, rows = static_cast<int64_t>(x.size()) / kvw;
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * kernels::kv_fp8_row_bytes(kv_heads, head_dim)));
  std::vector<float> out(x.size());
  kernels::quantize_kv_cpu(x.data(), rows, kv_heads, head_dim, nullptr, bytes.data());
  kernels::dequantize_kv_cpu(bytes.data(), rows, kv_heads, head_dim, out.data());
  return out;
}

// The whole sequence's q/k/v (padded length, so padding rows hold random values too) and the
// monolithic causal attention of the first n rows over the keys and values attention sees
// (seen_k, seen_v: k and v themselves, or what FP8 rows hold of them).
struct Problem {
  Shape s;
  int64_t padded;
  std::vector<float> q, k, v, seen_k, seen_v, o_ref, lse_ref;
  Problem(Shape shape, int64_t padded_len, bool fp8 = false, uint32_t seed = 1)
      : s(shape), padded(padded_len) {
    const int64_t qw = int64_t{s.heads} * s.head_dim, kvw = int64_t{s.kv_heads} * s.head_dim;
    q = random_vec(static_cast<size_t>(padded * qw), seed);
    k = random_vec(static_cast<size_t>(padded * kvw), seed + 1);
    v = random_vec(static_cast<size_t>(padded * kvw), seed + 2);
    seen_k = fp8 ? through_fp8(k, s.kv_heads, s.head_dim) : k;
    seen_v = fp8 ? through_fp8(v, s.kv_heads, s.head_dim) : v;
    o_ref.resize(static_cast<size_t>(s.n * qw));
    lse_ref.resize(static_cast<size_t>(s.n * s.heads));
    kernels::AttnParams p = params(q.data(), seen_k.data(), seen_v.data(), o_ref.data(),
                                   lse_ref.data(), s.n, s.n, 0, 0, kernels::MaskKind::kCausal);
    kernels::attention_cpu(p);
  }
  // The rows of o_ref by one monolithic FP8 attention (qkv_fp8, the CPU emulation).
  std::vector<float> o_fp8() const {
    std::vector<float> o(o_ref.size()), lse(lse_ref.size());
    kernels::AttnParams p = params(q.data(), seen_k.data(), seen_v.data(), o.data(), lse.data(),
                                   s.n, s.n, 0, 0, kernels::MaskKind::kCausal);
    p.qkv_fp8 = true;
    kernels::attention_cpu(p);
    return o;
  }
  kernels::AttnParams params(const float* qp, const float* kp, const float* vp, float* op,
                             float* lsep, int64_t n_q, int64_t n_kv, int64_t q_start,
                             int64_t kv_start, kernels::MaskKind mask) const {
    kernels::AttnParams p;
    p.q = qp;
    p.k = kp;
    p.v = vp;
    p.o = op;
    p.lse = lsep;
    p.n_q = static_cast<int32_t>(n_q);
    p.n_kv = static_cast<int32_t>(n_kv);
    p.heads = s.heads;
    p.kv_heads = s.kv_heads;
    p.head_dim = s.head_dim;
    kernels::set_packed_strides(p);
    p.q_start = q_start;
    p.kv_start = kv_start;
    p.mask = mask;
    p.scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
    return p;
  }
};

// The rows of `rank` under plan (q, k, v from the problem's arrays, fp32 on the CPU backend)
// and their positions.
struct Rows {
  Tensor q, k, v, o;
  std::vector<int64_t> positions;
  Rows(Backend& backend, const Problem& pr, const ShardPlan& plan, int rank) {
    const int64_t qw = int64_t{pr.s.heads} * pr.s.head_dim;
    const int64_t kvw = int64_t{pr.s.kv_heads} * pr.s.head_dim;
    const int64_t rows = plan.local_rows(rank);
    q = backend.alloc({rows, qw}, DType::kF32).take();
    k = backend.alloc({rows, kvw}, DType::kF32).take();
    v = backend.alloc({rows, kvw}, DType::kF32).take();
    o = backend.alloc({rows, qw}, DType::kF32).take();
    for (const auto& sg : plan.segments(rank)) {
      for (int64_t i = 0; i < sg.len; ++i) {
        const int64_t row = sg.row + i, pos = sg.position(i);
        std::memcpy(q.as<float>() + row * qw, pr.q.data() + pos * qw, qw * 4);
        std::memcpy(k.as<float>() + row * kvw, pr.k.data() + pos * kvw, kvw * 4);
        std::memcpy(v.as<float>() + row * kvw, pr.v.data() + pos * kvw, kvw * 4);
        positions.push_back(pos);
      }
    }
  }
  // Output elements at positions before `end` farther than 2e-5 from the monolithic rows (the
  // first three printed): merging shards reorders fp32 sums, a few ulps of O(1) outputs.
  int mismatches(const Problem& pr, const ShardPlan& plan, int rank, int64_t end) const {
    const int64_t qw = int64_t{pr.s.heads} * pr.s.head_dim;
    int bad = 0;
    for (const auto& sg : plan.segments(rank)) {
      for (int64_t i = 0; i < sg.len && sg.position(i) < end; ++i) {
        for (int64_t c = 0; c < qw; ++c) {
          const float got = o.as<float>()[(sg.row + i) * qw + c];
          const float want = pr.o_ref[sg.position(i) * qw + c];
          if (!(std::fabs(got - want) <= 2e-5f) && bad++ < 3) {
            std::fprintf(stderr, "rank %d pos %ld col %ld: %g vs %g\n", rank,
                         static_cast<long>(sg.position(i)), static_cast<long>(c), got, want);
          }
        }
      }
    }
    return bad;
  }
};

// One rank: ring prefill of its shard, compared with the monolithic rows; then one decode
// step compared with monolithic attention and with every other rank's bits.
int ring_rank(int rank, int world, const std::string& store, Shape s, ShardLayout layout,
              bool kernel_merges, KvCacheDtype kv) {
  auto comm = make_gloo_communicator({rank, world, store, "127.0.0.1",
                                      std::chrono::milliseconds(20000), nullptr});
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.message().c_str());
    return 10;
  }
  const auto plan = ShardPlan::make(layout, s.n, world);
  // One extra row: the decode token.
  Problem pr(s, plan.padded_len + 1, kv == KvCacheDtype::kFp8);
  auto backend = make_cpu_backend(kernel_merges);
  auto ring = RingAttention::create(*backend, *comm.value(),
                                    {1, s.heads, s.kv_heads, s.head_dim}, plan.local_rows(rank) + 2,
                                    kDefaultKvPageSize, kv);
  if (!ring.ok()) return 11;
  const int64_t qw = int64_t{s.heads} * s.head_dim, kvw = int64_t{s.kv_heads} * s.head_dim;
  Rows in(*backend, pr, plan, rank);
  SeqRows whole;  // sequence 0: the prompt in one chunk
  whole.plan = plan;
  Status st = ring.value()->begin_step({whole});
  if (st.ok()) st = ring.value()->attend(0, in.q, in.k, in.v, in.positions, in.o);
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, st.message().c_str());
    return 12;
  }
  ring.value()->end_step();
  if (in.mismatches(pr, plan, rank, s.n)) return 13;

  // Decode: the token at position n attends to every real token and itself.
  const int64_t pos = s.n;
  auto q1 = backend->alloc({1, qw}, DType::kF32).take();
  auto k1 = backend->alloc({1, kvw}, DType::kF32).take();
  auto v1 = backend->alloc({1, kvw}, DType::kF32).take();
  auto o1 = backend->alloc({1, qw}, DType::kF32).take();
  std::memcpy(q1.data, pr.q.data() + plan.padded_len * qw, qw * 4);
  std::memcpy(k1.data, pr.k.data() + plan.padded_len * kvw, kvw * 4);
  std::memcpy(v1.data, pr.v.data() + plan.padded_len * kvw, kvw * 4);
  SeqRows token;
  token.decode = true;
  token.pos = pos;
  st = ring.value()->begin_step({token});
  if (st.ok()) st = ring.value()->attend(0, q1, k1, v1, {pos}, o1);
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d decode: %s\n", rank, st.message().c_str());
    return 14;
  }
  ring.value()->end_step();
  // Monolithic reference: keys 0..n-1 then the decode token's key.
  const auto& sk = pr.seen_k;
  const auto& sv = pr.seen_v;
  std::vector<float> kk(sk.begin(), sk.begin() + s.n * kvw), vv(sv.begin(), sv.begin() + s.n * kvw);
  kk.insert(kk.end(), sk.begin() + plan.padded_len * kvw, sk.begin() + (plan.padded_len + 1) * kvw);
  vv.insert(vv.end(), sv.begin() + plan.padded_len * kvw, sv.begin() + (plan.padded_len + 1) * kvw);
  std::vector<float> o_ref(qw), lse_ref(s.heads);
  kernels::attention_cpu(pr.params(pr.q.data() + plan.padded_len * qw, kk.data(), vv.data(),
                                   o_ref.data(), lse_ref.data(), 1, s.n + 1, pos, 0,
                                   kernels::MaskKind::kNone));
  for (int64_t c = 0; c < qw; ++c) {
    if (!(std::fabs(o1.as<float>()[c] - o_ref[c]) <= 2e-5f)) {
      std::fprintf(stderr, "rank %d decode col %ld: %g vs %g\n", rank, static_cast<long>(c),
                   o1.as<float>()[c], o_ref[c]);
      return 15;
    }
  }
  std::vector<float> all(static_cast<size_t>(qw * world));
  if (!comm.value()->all_gather(o1.data, all.data(), qw * 4).ok()) return 16;
  for (int r = 0; r < world; ++r) {
    if (std::memcmp(all.data() + r * qw, o1.data, qw * 4) != 0) {
      std::fprintf(stderr, "rank %d: decode output differs from rank %d's bits\n", rank, r);
      return 17;
    }
  }
  return 0;
}

struct RingCase {
  int world;
  Shape shape;
  ShardLayout layout;
  // Whether the attention merges later contributions into o itself (the CPU kernel, the Hopper
  // kernel) or the ring merges partials (the mma.sync kernel's path).
  bool kernel_merges = true;
  KvCacheDtype kv = KvCacheDtype::kAuto;
};

class RingAttentionTest : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingAttentionTest, EqualsMonolithicAttention) {
  const RingCase c = GetParam();
  const std::string store = make_temp_dir();
  ASSERT_FALSE(store.empty());
  const auto codes = run_ranks(c.world, [&](int rank) {
    return ring_rank(rank, c.world, store, c.shape, c.layout, c.kernel_merges, c.kv);
  });
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, RingAttentionTest,
    ::testing::Values(RingCase{1, {37, 4, 2, 16}, ShardLayout::kStriped},
                      RingCase{2, {37, 4, 2, 16}, ShardLayout::kStriped},
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kStriped},
                      RingCase{4, {127, 8, 2, 16}, ShardLayout::kStriped},
                      RingCase{4, {3, 2, 1, 16}, ShardLayout::kStriped},  // a rank holds padding
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kStriped, false},
                      RingCase{1, {37, 4, 2, 16}, ShardLayout::kZigzag},
                      RingCase{2, {37, 4, 2, 16}, ShardLayout::kZigzag},
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kZigzag},
                      RingCase{4, {127, 8, 2, 16}, ShardLayout::kZigzag},
                      RingCase{4, {5, 2, 1, 16}, ShardLayout::kZigzag},  // ranks hold only padding
                      RingCase{3, {50, 4, 4, 16}, ShardLayout::kContiguous},
                      RingCase{4, {130, 2, 1, 64}, ShardLayout::kContiguous},
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kZigzag, false},
                      RingCase{4, {130, 2, 1, 64}, ShardLayout::kContiguous, false},
                      RingCase{1, {37, 4, 2, 16}, ShardLayout::kStriped, true, KvCacheDtype::kFp8},
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kStriped, true, KvCacheDtype::kFp8},
                      RingCase{4, {127, 8, 2, 16}, ShardLayout::kStriped, false, KvCacheDtype::kFp8},
                      RingCase{3, {101, 6, 2, 32}, ShardLayout::kZigzag, true, KvCacheDtype::kFp8}),
    [](const auto& info) {
      const RingCase& c = info.param;
      std::ostringstream os;  // not string +: see attention_cpu_test.cpp
      os << c.world << "ranks_" << c.shape.n << "tokens_" << c.shape.heads << "q"
         << c.shape.kv_heads << "kv_" << shard_layout_name(c.layout)
         << (c.kernel_merges ? "" : "_partials") << (c.kv == KvCacheDtype::kFp8 ? "_fp8" : "");
      return os.str();
    });

// Chunked prefill: a prompt prefilled chunk by chunk (sizes that divide neither the prompt nor
// 2N) gives the monolithic rows, by pass-KV, by pass-Q and by the ring each chunk picks. Sequence
// 1 runs alone (its pages follow each other: pass-Q reads the prefix in place); sequences 2 and 3
// alternate chunk by chunk on pages of 4 rows (their pages interleave: the prefix is gathered).
int chunked_rank(int rank, int world, const std::string& store, Shape s, ShardLayout layout,
                 RingPass pass, KvCacheDtype kv, AttentionDtype att) {
  auto comm = make_gloo_communicator({rank, world, store, "127.0.0.1",
                                      std::chrono::milliseconds(20000), nullptr});
  if (!comm.ok()) return 10;
  const std::vector<int64_t> chunks = {s.n / 3, 7, s.n / 4 + 1, 0};  // 0: the rest
  // Room for the last chunk's padding rows. Each sequence has its own values: a prefix read
  // from another sequence's pages (the same positions) would not pass for its own.
  std::vector<Problem> problems;
  for (uint32_t seed : {1u, 4u, 7u}) {
    problems.emplace_back(s, s.n + 2 * world * 8, kv == KvCacheDtype::kFp8, seed);
  }
  auto backend = make_cpu_backend();
  auto ring = RingAttention::create(*backend, *comm.value(), {1, s.heads, s.kv_heads, s.head_dim},
                                    3 * s.n + 64, /*page_size=*/4, kv, att);
  if (!ring.ok()) return 11;
  RingAttention& ra = *ring.value();
  ra.set_pass(pass);
  // FP8 attention: squared errors against exact attention of this rank's rows, chunked and
  // monolithic (Problem::o_fp8, once a sequence), summed over every chunk of every sequence.
  const bool fp8_att = att == AttentionDtype::kFp8;
  std::vector<std::vector<float>> whole_fp8;
  for (const Problem& pr : problems) {
    whole_fp8.push_back(fp8_att ? pr.o_fp8() : std::vector<float>{});
  }
  double err_chunked = 0, err_whole = 0;
  int64_t n_err = 0;
  auto add_errors = [&](const Problem& pr, const std::vector<float>& o_fp8, const Rows& in,
                        const ShardPlan& plan, int64_t end) {
    const int64_t qw = int64_t{s.heads} * s.head_dim;
    for (const auto& sg : plan.segments(rank)) {
      for (int64_t i = 0; i < sg.len && sg.position(i) < end; ++i) {
        for (int64_t c = 0; c < qw; ++c) {
          const size_t at = static_cast<size_t>(sg.position(i) * qw + c);
          const double want = pr.o_ref[at];
          err_chunked += std::pow(in.o.as<float>()[(sg.row + i) * qw + c] - want, 2);
          err_whole += std::pow(o_fp8[at] - want, 2);
          ++n_err;
        }
      }
    }
  };
  // One chunk [start, start + len) of sequence seq, checked against the monolithic rows.
  auto chunk = [&](uint64_t seq, int64_t start, int64_t len) -> int {
    SeqRows sr;
    sr.seq = seq;
    sr.plan = ShardPlan::make(layout, len, world, start);
    const Problem& pr = problems[seq - 1];
    Rows in(*backend, pr, sr.plan, rank);
    Status st = ra.begin_step({sr});
    if (st.ok()) st = ra.attend(0, in.q, in.k, in.v, in.positions, in.o);
    ra.end_step();
    if (!st.ok()) {
      std::fprintf(stderr, "rank %d seq %lu chunk at %ld: %s\n", rank,
                   static_cast<unsigned long>(seq), static_cast<long>(start),
                   st.message().c_str());
      return 12;
    }
    if (fp8_att) {
      add_errors(pr, whole_fp8[seq - 1], in, sr.plan, start + len);
      return 0;
    }
    return in.mismatches(pr, sr.plan, rank, start + len) ? 13 : 0;
  };
  int64_t start = 0;
  for (int64_t c : chunks) {
    const int64_t len = c == 0 ? s.n - start : c;
    if (const int e = chunk(1, start, len)) return e;
    start += len;
  }
  start = 0;
  for (int64_t c : chunks) {
    const int64_t len = c == 0 ? s.n - start : c;
    for (uint64_t seq : {2, 3}) {
      if (const int e = chunk(seq, start, len)) return e;
    }
    start += len;
  }
  for (uint64_t seq : {1, 2, 3}) {
    if (ra.rows_on(seq, rank) != ra.cache().length(seq)) return 14;
    ra.release(seq);
  }
  if (fp8_att) {
    const double chunked = std::sqrt(err_chunked / n_err), whole = std::sqrt(err_whole / n_err);
    std::fprintf(stderr, "rank %d: FP8 attention O RMSE chunk by chunk %.3e, monolithic %.3e\n",
                 rank, chunked, whole);
    if (!(whole > 0) || !(chunked <= 2 * whole)) return 16;
  }
  return ra.cache().usage().used_pages == 0 ? 0 : 15;
}

struct ChunkedCase {
  int world;
  Shape shape;
  ShardLayout layout;
  RingPass pass;
  KvCacheDtype kv = KvCacheDtype::kAuto;
  AttentionDtype att = AttentionDtype::kAuto;
};

// gtest prints a failing case's parameters with this (not as raw bytes).
void PrintTo(const ChunkedCase& c, std::ostream* os) {
  *os << c.world << " ranks, " << c.shape.n << " tokens, " << c.shape.heads << "/"
      << c.shape.kv_heads << " heads x " << c.shape.head_dim << ", "
      << shard_layout_name(c.layout) << ", "
      << (c.pass == RingPass::kQ ? "pass-Q" : c.pass == RingPass::kKv ? "pass-KV" : "auto")
      << (c.kv == KvCacheDtype::kFp8 ? ", fp8 KV" : "")
      << (c.att == AttentionDtype::kFp8 ? ", fp8 attention" : "");
}

class RingChunkedTest : public ::testing::TestWithParam<ChunkedCase> {};

TEST_P(RingChunkedTest, ChunkByChunkEqualsMonolithicAttention) {
  const ChunkedCase c = GetParam();
  const std::string store = make_temp_dir();
  ASSERT_FALSE(store.empty());
  const auto codes = run_ranks(c.world, [&](int rank) {
    return chunked_rank(rank, c.world, store, c.shape, c.layout, c.pass, c.kv, c.att);
  });
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Passes, RingChunkedTest,
    ::testing::Values(ChunkedCase{1, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kQ},
                      ChunkedCase{2, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kKv},
                      ChunkedCase{3, {97, 6, 3, 16}, ShardLayout::kStriped, RingPass::kQ},
                      ChunkedCase{3, {97, 6, 3, 16}, ShardLayout::kStriped, RingPass::kKv},
                      ChunkedCase{4, {83, 4, 1, 32}, ShardLayout::kStriped, RingPass::kAuto},
                      ChunkedCase{1, {61, 4, 2, 16}, ShardLayout::kZigzag, RingPass::kQ},
                      ChunkedCase{2, {61, 4, 2, 16}, ShardLayout::kZigzag, RingPass::kKv},
                      ChunkedCase{2, {61, 4, 2, 16}, ShardLayout::kZigzag, RingPass::kQ},
                      ChunkedCase{3, {97, 6, 3, 16}, ShardLayout::kZigzag, RingPass::kQ},
                      ChunkedCase{3, {97, 6, 3, 16}, ShardLayout::kZigzag, RingPass::kAuto},
                      ChunkedCase{4, {83, 4, 1, 32}, ShardLayout::kZigzag, RingPass::kQ},
                      ChunkedCase{4, {83, 4, 1, 32}, ShardLayout::kContiguous, RingPass::kKv},
                      ChunkedCase{3, {70, 2, 2, 16}, ShardLayout::kContiguous, RingPass::kQ},
                      ChunkedCase{1, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kQ,
                                  KvCacheDtype::kFp8},
                      ChunkedCase{2, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kKv,
                                  KvCacheDtype::kFp8},
                      ChunkedCase{3, {97, 6, 3, 16}, ShardLayout::kStriped, RingPass::kQ,
                                  KvCacheDtype::kFp8},
                      ChunkedCase{4, {83, 4, 1, 32}, ShardLayout::kStriped, RingPass::kAuto,
                                  KvCacheDtype::kFp8},
                      // FP8 attention reads the cached prefix in its pages (FP8 rows under an
                      // FP8 cache) and a travelling FP8 block as it is.
                      ChunkedCase{1, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kQ,
                                  KvCacheDtype::kAuto, AttentionDtype::kFp8},
                      ChunkedCase{1, {61, 4, 2, 16}, ShardLayout::kStriped, RingPass::kQ,
                                  KvCacheDtype::kFp8, AttentionDtype::kFp8},
                      ChunkedCase{2, {61, 4, 2, 16}, ShardLayout::kZigzag, RingPass::kKv,
                                  KvCacheDtype::kFp8, AttentionDtype::kFp8},
                      ChunkedCase{3, {97, 6, 3, 32}, ShardLayout::kStriped, RingPass::kQ,
                                  KvCacheDtype::kFp8, AttentionDtype::kFp8},
                      ChunkedCase{3, {97, 6, 3, 32}, ShardLayout::kZigzag, RingPass::kQ,
                                  KvCacheDtype::kAuto, AttentionDtype::kFp8}),
    [](const auto& info) {
      const ChunkedCase& c = info.param;
      std::ostringstream os;
      os << c.world << "ranks_" << c.shape.n << "tokens_" << c.shape.heads << "q"
         << c.shape.kv_heads << "kv_"
         << shard_layout_name(c.layout) << "_"
         << (c.pass == RingPass::kQ ? "passQ" : c.pass == RingPass::kKv ? "passKV" : "auto")
         << (c.kv == KvCacheDtype::kFp8 ? "_fp8" : "")
         << (c.att == AttentionDtype::kFp8 ? "_fp8attention" : "");
      return os.str();
    });

// A communicator whose transfers take at least `delay` each (a slow link), delegating to Gloo.
class SlowComm final : public Communicator {
 public:
  SlowComm(Communicator& inner, std::chrono::milliseconds delay) : inner_(inner), delay_(delay) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  Result<std::unique_ptr<CommHandle>> isend(const void* d, size_t b, int p, int t) override {
    return wrap(inner_.isend(d, b, p, t));
  }
  Result<std::unique_ptr<CommHandle>> irecv(void* d, size_t b, int p, int t) override {
    return wrap(inner_.irecv(d, b, p, t));
  }
  Status all_gather(const void* in, void* out, size_t b) override {
    return inner_.all_gather(in, out, b);
  }
  Status broadcast(void* d, size_t b, int root) override { return inner_.broadcast(d, b, root); }
  Status barrier() override { return inner_.barrier(); }

 private:
  class Delayed final : public CommHandle {
   public:
    Delayed(std::unique_ptr<CommHandle> h, std::chrono::steady_clock::time_point ready)
        : h_(std::move(h)), ready_(ready) {}
    Status wait() override {
      std::this_thread::sleep_until(ready_);  // the link is busy until then
      return h_->wait();
    }

   private:
    std::unique_ptr<CommHandle> h_;
    std::chrono::steady_clock::time_point ready_;
  };
  Result<std::unique_ptr<CommHandle>> wrap(Result<std::unique_ptr<CommHandle>> h) {
    if (!h.ok()) return h;
    return std::unique_ptr<CommHandle>(
        new Delayed(h.take(), std::chrono::steady_clock::now() + delay_));
  }
  Communicator& inner_;
  std::chrono::milliseconds delay_;
};

// Each step's transfer is posted before its compute, so a link delay about equal to one step's
// compute must be hidden: total ~ N x max(compute, delay), far from N x (compute + delay).
TEST(RingAttentionOverlap, DoubleBufferHidesTheTransfer) {
  const int world = 2;
  const std::string store = make_temp_dir();
  const auto codes = run_ranks(world, [&](int rank) {
    auto gloo = make_gloo_communicator({rank, world, store, "127.0.0.1",
                                        std::chrono::milliseconds(20000), nullptr});
    if (!gloo.ok()) return 10;
    const Shape s{1024, 4, 2, 64};
    const auto plan = ShardPlan::make(ShardLayout::kZigzag, s.n, world);
    auto backend = make_cpu_backend();
    const int64_t rows = plan.local_rows(rank);
    const int64_t qw = int64_t{s.heads} * s.head_dim, kvw = int64_t{s.kv_heads} * s.head_dim;
    auto q = backend->alloc({rows, qw}, DType::kF32).take();
    auto k = backend->alloc({rows, kvw}, DType::kF32).take();
    auto v = backend->alloc({rows, kvw}, DType::kF32).take();
    auto o = backend->alloc({rows, qw}, DType::kF32).take();
    for (auto* t : {&q, &k, &v}) {
      auto r = random_vec(static_cast<size_t>(t->numel()), 5 + rank);
      std::memcpy(t->data, r.data(), r.size() * 4);
    }
    std::vector<int64_t> positions;
    for (const auto& sg : plan.segments(rank)) {
      for (int64_t i = 0; i < sg.len; ++i) positions.push_back(sg.position(i));
    }
    auto run = [&](Communicator& comm) {
      auto ring = RingAttention::create(*backend, comm, {1, s.heads, s.kv_heads, s.head_dim},
                                        rows).take();
      SeqRows whole;
      whole.plan = plan;
      if (!ring->begin_step({whole}).ok()) return std::make_pair(-1.0, RingStats{});
      // Start together: a rank that starts late looks like a slow link to its neighbour.
      if (!comm.barrier().ok()) return std::make_pair(-1.0, RingStats{});
      const auto t0 = std::chrono::steady_clock::now();
      if (!ring->attend(0, q, k, v, positions, o).ok()) return std::make_pair(-1.0, RingStats{});
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      return std::make_pair(ms, ring->stats());
    };
    // Measure compute alone (fast loopback), then give the link a delay of 0.6 step. Timing
    // on a loaded machine (CI runs two tests at once on 2 cores) can stall one rank for a while;
    // overlap is shown if one of three attempts shows it, while a ring that serialises the
    // transfer fails every attempt (its wait is the whole delay each time).
    run(*gloo.value());
    for (int attempt = 0; attempt < 3; ++attempt) {
      const auto [fast_ms, fast] = run(*gloo.value());
      const double step_ms = fast.compute_ms / fast.steps;
      const auto delay = std::chrono::milliseconds(static_cast<int>(0.6 * step_ms) + 1);
      SlowComm slow(*gloo.value(), delay);
      const auto [slow_ms, stats] = run(slow);
      // Posted before the compute, the transfer is exposed only by what the compute did not
      // cover: max(0, delay - step). Serialised, it would be exposed in full: the delay itself.
      const double slow_step = stats.compute_ms / stats.steps;
      const double allowed = std::max(0.0, delay.count() - slow_step) + 0.3 * delay.count();
      std::fprintf(stderr,
                   "rank %d attempt %d: compute %.1f ms/step (%.1f in the slow run), link delay "
                   "%ld ms, ring %.1f ms (fast link %.1f); exposed wait %.1f ms, allowed %.1f\n",
                   rank, attempt, step_ms, slow_step, static_cast<long>(delay.count()), slow_ms,
                   fast_ms, stats.wait_ms, allowed);
      // Every rank must agree on the verdict, or one would exit while the other runs again.
      int32_t ok = stats.wait_ms <= allowed ? 1 : 0, all[2] = {0, 0};
      if (!gloo.value()->all_gather(&ok, all, sizeof ok).ok()) return 21;
      if (all[0] && all[1]) return 0;
    }
    return 20;
  }, std::chrono::seconds(120));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace burst::engine
