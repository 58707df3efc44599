// burst-bench-ring: the BurstAttention ring on N GPUs (one process per GPU, NCCL), one attention
// layer at a given shape, for several total sequence lengths. For each length it reports the
// ring's time per layer, the same kernels with transfers switched off (compute alone), one
// hop's transfer alone, and the exposed communication (ring - compute alone).
// With --chunk C it then prefills each length in C-token chunks (the continuous-batching
// server's chunked prefill), once with every chunk by pass-KV and once by pass-Q, reports the
// time per layer of each, and checks that both rings give the same outputs (exit 1 if any
// element differs by more than 2 bf16 ulps of its magnitude: the two merge the same fp32
// partials in another order, then round once).
//
// usage: burst-bench-ring --world N [--seq 32768,131072] [--heads 32] [--kv-heads 32]
//                         [--head-dim 128] [--reps 5] [--chunk C] [--out FILE.json]
//                         [--layout striped|zigzag|contiguous]
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/nccl_communicator.h"
#include "engine/ring_attention.h"

namespace {

using namespace burst;
using namespace burst::engine;

struct Opts {
  int world = 2, heads = 32, kv_heads = 32, head_dim = 128, reps = 5;
  int64_t chunk = 0;
  ShardLayout layout = ShardLayout::kStriped;
  std::vector<int64_t> seqs = {32768, 131072};
  std::string out;
};

int fail(int rank, const std::string& what) {
  std::fprintf(stderr, "burst-bench-ring rank %d: %s\n", rank, what.c_str());
  return 1;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The positions of this rank's rows of a plan, row by row.
std::vector<int64_t> positions_of(const ShardPlan& plan, int rank) {
  std::vector<int64_t> positions;
  for (const auto& sg : plan.segments(rank)) {
    for (int64_t i = 0; i < sg.len; ++i) positions.push_back(sg.position(i));
  }
  return positions;
}

// One chunk of the chunked prefill: this rank's rows of it, and its output by each ring.
struct Chunk {
  ShardPlan plan;
  Tensor q, k, v, out[2];
  std::vector<int64_t> positions;
};

// The prompt of `seq` tokens cut into o.chunk-token chunks, random q, k, v on this rank's rows;
// *rows_total: this rank's rows of all of them.
Result<std::vector<Chunk>> make_chunks(const Opts& o, int rank, Backend& be, int64_t seq,
                                       int64_t* rows_total) {
  const int64_t qw = int64_t{o.heads} * o.head_dim, kvw = int64_t{o.kv_heads} * o.head_dim;
  std::vector<Chunk> chunks;
  for (int64_t start = 0; start < seq; start += o.chunk) {
    Chunk c;
    c.plan = ShardPlan::make(o.layout, std::min(o.chunk, seq - start), o.world, start);
    const int64_t rows = c.plan.local_rows(rank);
    *rows_total += rows;
    for (auto [t, w] : {std::pair{&c.q, qw}, {&c.k, kvw}, {&c.v, kvw}, {&c.out[0], qw},
                        {&c.out[1], qw}}) {
      auto a = be.alloc({rows, w}, be.compute_dtype());
      if (!a.ok()) return Status::error("chunked " + std::to_string(seq) + ": " + a.message());
      *t = a.take();
    }
    const auto salt = static_cast<uint64_t>(1000 * chunks.size() + 10 * rank);
    be.fill_random(c.q, 11 + salt, 1.f);
    be.fill_random(c.k, 23 + salt, 1.f);
    be.fill_random(c.v, 37 + salt, 1.f);
    c.positions = positions_of(c.plan, rank);
    chunks.push_back(std::move(c));
  }
  return chunks;
}

// The largest difference between the two rings' outputs, on real rows only (padding rows see
// nothing real): |kv - q| / (2 bf16 ulps of max(|kv|, |q|), at least 2^-14), and the two values.
struct Difference {
  double worst = 0;
  float kv = 0, q = 0;
};

Result<Difference> compare_rings(const std::vector<Chunk>& chunks, int rank, Backend& be,
                                 int64_t qw) {
  Difference d;
  for (const Chunk& c : chunks) {
    std::vector<float> x, y;
    if (!be.download(c.out[0], x).ok() || !be.download(c.out[1], y).ok()) {
      return Status::error("download");
    }
    for (const auto& sg : c.plan.segments(rank)) {
      for (int64_t i = sg.row * qw; i < (sg.row + c.plan.real_len(sg)) * qw; ++i) {
        const auto ix = static_cast<size_t>(i);
        const double tol = 2.0 * std::max({std::fabs(x[ix]), std::fabs(y[ix]), 1.f / 16384}) / 128;
        const double r = std::fabs(x[ix] - y[ix]) / tol;
        if (!(r <= d.worst)) {
          d.worst = r;
          d.kv = x[ix];
          d.q = y[ix];
        }
      }
    }
  }
  return d;
}

// The prompt of `seq` tokens prefilled in o.chunk-token chunks as one sequence, every chunk by
// pass-KV, then every chunk by pass-Q: time per layer of each, and the largest difference.
int run_chunked(const Opts& o, int rank, Backend& be, Communicator& comm, cudaStream_t stream,
                int64_t seq) {
  const int64_t qw = int64_t{o.heads} * o.head_dim;
  int64_t rows_total = 0;
  auto made = make_chunks(o, rank, be, seq, &rows_total);
  if (!made.ok()) return fail(rank, made.message());
  std::vector<Chunk> chunks = made.take();
  auto ring = RingAttention::create(be, comm, {1, o.heads, o.kv_heads, o.head_dim},
                                    rows_total + 512, /*page_size=*/256);
  if (!ring.ok()) return fail(rank, ring.message());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto run = [&](RingPass pass, int slot) -> Result<double> {
    ring.value()->set_pass(pass);
    std::vector<double> ms;
    for (int r = 0; r < std::max(2, o.reps / 2 + 1); ++r) {
      BURST_RETURN_IF_ERROR(comm.barrier());
      cudaEventRecord(a, stream);
      for (Chunk& c : chunks) {
        SeqRows sr;
        sr.seq = 1;
        sr.plan = c.plan;
        BURST_RETURN_IF_ERROR(ring.value()->begin_step({sr}));
        const Status st = ring.value()->attend(0, c.q, c.k, c.v, c.positions, c.out[slot]);
        ring.value()->end_step();
        BURST_RETURN_IF_ERROR(st);
      }
      cudaEventRecord(b, stream);
      BURST_RETURN_IF_ERROR(be.synchronize());
      ring.value()->release(1);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      if (r > 0) ms.push_back(t);  // the first is the warm-up
    }
    return median(ms);
  };
  auto kv = run(RingPass::kKv, 0);
  if (!kv.ok()) return fail(rank, "pass-KV: " + kv.message());
  auto pq = run(RingPass::kQ, 1);
  if (!pq.ok()) return fail(rank, "pass-Q: " + pq.message());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  auto diff = compare_rings(chunks, rank, be, qw);
  if (!diff.ok()) return fail(rank, diff.message());
  const Difference& d = diff.value();
  std::printf("rank %d: %8ld tokens in %ld-token chunks  pass-KV %8.2f ms/layer  pass-Q %8.2f "
              "ms/layer  worst difference %.3g of the tolerance (%g vs %g)%s\n",
              rank, static_cast<long>(seq), static_cast<long>(o.chunk), kv.value(), pq.value(),
              d.worst, d.kv, d.q, d.worst <= 1.0 ? "" : "  FAILED");
  std::fflush(stdout);
  return d.worst <= 1.0 ? 0 : 1;
}

// One hop alone, its median ms: a packed K+V block of `block` bytes, sent to the next rank
// while the previous rank's arrives in the second half of the buffer.
Result<double> time_hop(const Opts& o, int rank, Backend& be, Communicator& comm,
                        cudaStream_t stream, cudaEvent_t a, cudaEvent_t b, size_t block) {
  auto buf = be.alloc({2, static_cast<int64_t>(block / 2)}, DType::kBF16);  // 2 x block bytes
  if (!buf.ok()) return buf.status();
  std::vector<double> hop;
  for (int r = 0; r < o.reps + 1; ++r) {
    comm.barrier();
    cudaEventRecord(a, stream);
    auto h = comm.isendrecv(buf.value().data, (rank + 1) % o.world,
                            static_cast<char*>(buf.value().data) + block,
                            (rank - 1 + o.world) % o.world, block, 7);
    if (!h.ok()) return h.status();
    h.value()->wait();
    cudaEventRecord(b, stream);
    be.synchronize();
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    if (r > 0) hop.push_back(t);
  }
  return median(hop);
}

// Rank 0's line for one length, and its JSON object appended to json.
void report_length(const Opts& o, size_t si, double ring_ms, double compute_ms, double hop_ms,
                   size_t block, std::ostringstream& json) {
  const int64_t seq = o.seqs[si];
  const double flops = 4.0 * seq * seq * o.head_dim * o.heads / 2 / o.world;  // causal, per GPU
  const double exposed = std::max(0.0, ring_ms - compute_ms);
  std::printf("%8ld tokens  %d GPUs  ring %8.2f ms/layer  compute alone %8.2f ms "
              "(%5.1f TFLOP/s/GPU, %7.2f ms/step)  hop %6.2f ms (%5.1f GB/s, %.0f MiB)  "
              "exposed %6.2f ms = %4.1f%%\n",
              static_cast<long>(seq), o.world, ring_ms, compute_ms, flops / compute_ms / 1e9,
              compute_ms / o.world, hop_ms, block / hop_ms / 1e6, block / 1048576.0, exposed,
              100.0 * exposed / compute_ms);
  std::fflush(stdout);
  json << (si ? "," : "") << "{\"seq\":" << seq << ",\"world\":" << o.world
       << ",\"ring_ms\":" << ring_ms << ",\"compute_ms\":" << compute_ms
       << ",\"hop_ms\":" << hop_ms << ",\"block_bytes\":" << block
       << ",\"exposed_ms\":" << exposed << "}";
}

// Length o.seqs[si] in one chunk: the ring's time per layer, the same without transfers
// (compute alone) and one hop alone; rank 0 reports them.
int run_length(const Opts& o, int rank, Backend& be, Communicator& comm, cudaStream_t stream,
               size_t si, std::ostringstream& json) {
  const int64_t seq = o.seqs[si];
  const auto plan = ShardPlan::make(o.layout, seq, o.world);
  const int64_t rows = plan.local_rows(rank);
  const int64_t qw = int64_t{o.heads} * o.head_dim, kvw = int64_t{o.kv_heads} * o.head_dim;
  auto q = be.alloc({rows, qw}, be.compute_dtype());
  auto k = be.alloc({rows, kvw}, be.compute_dtype());
  auto v = be.alloc({rows, kvw}, be.compute_dtype());
  auto out = be.alloc({rows, qw}, be.compute_dtype());
  for (auto* t : {&q, &k, &v, &out}) {
    if (!t->ok()) return fail(rank, "seq " + std::to_string(seq) + ": " + t->message());
  }
  be.fill_random(q.value(), 11 + rank, 1.f);
  be.fill_random(k.value(), 23 + rank, 1.f);
  be.fill_random(v.value(), 37 + rank, 1.f);
  auto ring = RingAttention::create(be, comm, {1, o.heads, o.kv_heads, o.head_dim}, rows + 8);
  if (!ring.ok()) return fail(rank, ring.message());
  const std::vector<int64_t> positions = positions_of(plan, rank);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto time_ring = [&](bool transfers) -> Result<double> {
    ring.value()->set_transfers(transfers);
    std::vector<double> ms;
    for (int r = 0; r < o.reps + 1; ++r) {
      BURST_RETURN_IF_ERROR(comm.barrier());  // every rank starts the layer together
      // Each rep is the prefill of one fresh sequence: the whole prompt in one chunk.
      ring.value()->clear();
      engine::SeqRows whole;
      whole.plan = plan;
      BURST_RETURN_IF_ERROR(ring.value()->begin_step({whole}));
      cudaEventRecord(a, stream);
      BURST_RETURN_IF_ERROR(ring.value()->attend(0, q.value(), k.value(), v.value(), positions,
                                                 out.value()));
      ring.value()->end_step();
      cudaEventRecord(b, stream);
      BURST_RETURN_IF_ERROR(be.synchronize());
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      if (r > 0) ms.push_back(t);  // the first is the warm-up
    }
    return median(ms);
  };
  auto with = time_ring(true);
  if (!with.ok()) return fail(rank, with.message());
  auto without = time_ring(false);
  if (!without.ok()) return fail(rank, without.message());
  const size_t block = static_cast<size_t>(2 * rows * kvw * dtype_size(be.compute_dtype()));
  auto hop = time_hop(o, rank, be, comm, stream, a, b, block);
  if (!hop.ok()) return fail(rank, hop.message());
  if (rank == 0) report_length(o, si, with.value(), without.value(), hop.value(), block, json);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 0;
}

int run_rank(const Opts& o, int rank, const std::string& store) {
  auto tuning = Tuning::from_env();  // BURST_PDL, BURST_PEER_GATHER, BURST_ATTN_KERNEL
  if (!tuning.ok()) return fail(rank, tuning.message());
  auto backend = make_cuda_backend(rank, tuning.value());
  if (!backend.ok()) return fail(rank, backend.message());
  auto streams = cuda_streams(*backend.value());
  if (!streams.ok()) return fail(rank, streams.message());
  const cudaStream_t stream = streams.value().compute;
  auto comm = make_nccl_communicator({rank, o.world, rank, store, stream,
                                      std::chrono::milliseconds(120000), nullptr,
                                      tuning.value().peer_gather});
  if (!comm.ok()) return fail(rank, comm.message());
  Backend& be = *backend.value();
  std::ostringstream json;
  json << "[";
  for (size_t si = 0; si < o.seqs.size(); ++si) {
    if (const int e = run_length(o, rank, be, *comm.value(), stream, si, json)) return e;
    if (o.chunk > 0) {
      if (const int e = run_chunked(o, rank, be, *comm.value(), stream, o.seqs[si])) return e;
    }
  }
  json << "]\n";
  if (rank == 0 && !o.out.empty()) std::ofstream(o.out) << json.str();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--world") o.world = std::stoi(v);
    else if (f == "--heads") o.heads = std::stoi(v);
    else if (f == "--kv-heads") o.kv_heads = std::stoi(v);
    else if (f == "--head-dim") o.head_dim = std::stoi(v);
    else if (f == "--reps") o.reps = std::stoi(v);
    else if (f == "--out") o.out = v;
    else if (f == "--chunk") o.chunk = std::stoll(v);
    else if (f == "--layout") {
      if (!parse_shard_layout(v, &o.layout)) {
        std::fprintf(stderr, "burst-bench-ring: --layout is striped, zigzag or contiguous\n");
        return 2;
      }
    }
    else if (f == "--seq") {
      o.seqs.clear();
      std::stringstream ss(v);
      for (std::string x; std::getline(ss, x, ',');) o.seqs.push_back(std::stoll(x));
    } else {
      std::fprintf(stderr, "burst-bench-ring: unknown flag %s\n", f.c_str());
      return 2;
    }
  }
  char tmpl[] = "/tmp/burst-ring-XXXXXX";
  const std::string store = mkdtemp(tmpl);
  // Fork before any CUDA call: a CUDA context does not survive fork(). A rank ends with exit(),
  // not _exit(), so what it registered with atexit runs (libburst_ktrace.so, loaded as
  // CUDA_INJECTION64_PATH, writes its last kernel records then); stdio is flushed first so no
  // buffered parent output is written once per rank.
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) std::exit(run_rank(o, r, store));
    pids.push_back(pid);
  }
  int worst = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    worst = std::max(worst, WIFEXITED(st) ? WEXITSTATUS(st) : 128);
  }
  return worst;
}
