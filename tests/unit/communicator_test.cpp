// GlooCommunicator across real processes: every test forks N ranks that rendezvous through a
// fresh mkdtemp store, run their checks and _exit() with a code (0 = all checks held; failures
// are printed to stderr). The parent only waits, with a deadline, and asserts the codes: gtest
// assertions never run in a child. Covers the ring exchange (1 byte to ~5 MB), out-of-order
// waits over several tags, FIFO matching per (peer, tag), all_gather, broadcast from a non-zero
// root, barrier, and the failure paths (dead peer, silent peer, send to a dead peer), which must
// return an error naming rank and peer within the timeout, never hang or die of SIGPIPE.
#include "engine/communicator.h"
#include "engine/dtype_convert.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace burst::engine {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Odd sizes on purpose: 1 byte, sub-page, just over 64 KiB, and ~5 MB (several socket buffers).
constexpr size_t kPayloadSizes[] = {1, 7, 4093, 65537, 5 * 1024 * 1024 + 3};
constexpr auto kGroupDeadline = std::chrono::seconds(20);

// Bytes rank `from` sends under `tag`: reproducible on the receiver without any exchange.
std::vector<uint8_t> payload(int from, int tag, size_t bytes) {
  std::mt19937_64 rng(static_cast<uint64_t>(from) * 1000003u + static_cast<uint64_t>(tag) * 7919u +
                      bytes);
  std::vector<uint8_t> out(bytes);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// A failed check inside a child: says which rank and why, and yields the child's exit code.
int fail(int rank, const std::string& what) {
  std::fprintf(stderr, "[rank %d] %s\n", rank, what.c_str());
  return 1;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

using RankBody = std::function<int(const GlooOptions& options)>;

// Forks `n` ranks running `body`, waits for all of them (killing stragglers at the deadline)
// and returns each rank's exit code; a rank killed by signal s reads as 128 + s.
std::vector<int> run_group(int n, const RankBody& body,
                           milliseconds timeout = milliseconds(10000)) {
  char dir_template[] = "/tmp/burst-comm-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (!dir) {
    ADD_FAILURE() << "mkdtemp failed";
    return {};
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      GlooOptions options;
      options.rank = r;
      options.world_size = n;
      options.store_dir = dir;
      options.timeout = timeout;
      int code = 1;
      try {
        code = body(options);
      } catch (...) {
        code = fail(r, "exception escaped the rank body");
      }
      // _exit: skip the parent's atexit handlers and static destructors (gtest state).
      std::fflush(stderr);
      _exit(code);
    }
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      break;
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), -1);
  size_t left = pids.size();
  const auto deadline = Clock::now() + kGroupDeadline;
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -1) continue;
      int wstatus = 0;
      if (waitpid(pids[i], &wstatus, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : 128 + WTERMSIG(wstatus);
        --left;
      }
    }
    if (left > 0 && Clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (codes[i] != -1) continue;
        ADD_FAILURE() << "rank " << i << " hung past the deadline; killing it";
        kill(pids[i], SIGKILL);
        waitpid(pids[i], nullptr, 0);
        codes[i] = 128 + SIGKILL;
      }
      left = 0;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return codes;
}

void expect_all_zero(const std::vector<int>& codes, int n) {
  ASSERT_EQ(codes.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " (see its stderr)";
}

int ring_exchange(const GlooOptions& options) {
  auto joined = make_gloo_communicator(options);
  if (!joined.ok()) return fail(options.rank, joined.message());
  auto& comm = *joined.value();
  const int n = comm.world_size();
  const int rank = comm.rank();
  if (rank != options.rank || n != options.world_size) return fail(rank, "rank/size mismatch");
  const int next = (rank + 1) % n;
  const int prev = (rank - 1 + n) % n;
  int tag = 0;
  for (size_t bytes : kPayloadSizes) {
    const auto out = payload(rank, tag, bytes);
    std::vector<uint8_t> in(bytes, 0);
    auto recv = comm.irecv(in.data(), bytes, prev, tag);
    auto send = comm.isend(out.data(), bytes, next, tag);
    if (!recv.ok()) return fail(rank, recv.message());
    if (!send.ok()) return fail(rank, send.message());
    // Receive first: every rank sends before it waits, so no wait order can deadlock the ring.
    const Status rs = recv.value()->wait();
    if (!rs.ok()) return fail(rank, rs.message());
    const Status ss = send.value()->wait();
    if (!ss.ok()) return fail(rank, ss.message());
    if (in != payload(prev, tag, bytes)) {
      return fail(rank, "ring payload of " + std::to_string(bytes) + " bytes corrupted");
    }
    ++tag;
  }
  // Orders this rank's exit after every peer finished reading what it sent.
  const Status b = comm.barrier();
  return b.ok() ? 0 : fail(rank, b.message());
}

// Four tags outstanding at once (two of equal size, so only the tag tells them apart), receives
// posted in reverse tag order and waited in yet another order; then two messages under one tag,
// which must arrive in posting order.
int outstanding_tags(const GlooOptions& options) {
  auto joined = make_gloo_communicator(options);
  if (!joined.ok()) return fail(options.rank, joined.message());
  auto& comm = *joined.value();
  const int n = comm.world_size();
  const int rank = comm.rank();
  const int next = (rank + 1) % n;
  const int prev = (rank - 1 + n) % n;
  constexpr int kTags = 4;
  const size_t sizes[kTags] = {3, 1 << 20, 3, 77777};
  std::vector<std::vector<uint8_t>> out(kTags), in(kTags);
  std::vector<std::unique_ptr<CommHandle>> sends(kTags), recvs(kTags);
  for (int t = kTags - 1; t >= 0; --t) {
    in[t].assign(sizes[t], 0);
    auto r = comm.irecv(in[t].data(), sizes[t], prev, 100 + t);
    if (!r.ok()) return fail(rank, r.message());
    recvs[t] = r.take();
  }
  for (int t = 0; t < kTags; ++t) {
    out[t] = payload(rank, 100 + t, sizes[t]);
    auto s = comm.isend(out[t].data(), sizes[t], next, 100 + t);
    if (!s.ok()) return fail(rank, s.message());
    sends[t] = s.take();
  }
  for (int t : {2, 0, 3, 1}) {
    const Status st = recvs[t]->wait();
    if (!st.ok()) return fail(rank, st.message());
    if (in[t] != payload(prev, 100 + t, sizes[t])) {
      return fail(rank, "tag " + std::to_string(100 + t) + " delivered the wrong bytes");
    }
  }
  for (int t : {3, 1, 2, 0}) {
    const Status st = sends[t]->wait();
    if (!st.ok()) return fail(rank, st.message());
  }

  const auto first = payload(rank, 1, 4099);
  const auto second = payload(rank, 2, 4099);
  std::vector<uint8_t> got_first(4099), got_second(4099);
  auto r1 = comm.irecv(got_first.data(), got_first.size(), prev, 9);
  auto r2 = comm.irecv(got_second.data(), got_second.size(), prev, 9);
  auto s1 = comm.isend(first.data(), first.size(), next, 9);
  auto s2 = comm.isend(second.data(), second.size(), next, 9);
  if (!r1.ok() || !r2.ok() || !s1.ok() || !s2.ok()) return fail(rank, "posting tag 9 failed");
  for (auto* h : {&r2, &r1, &s2, &s1}) {
    const Status st = h->value()->wait();
    if (!st.ok()) return fail(rank, st.message());
  }
  if (got_first != payload(prev, 1, 4099) || got_second != payload(prev, 2, 4099)) {
    return fail(rank, "same-tag messages not matched in posting order");
  }
  // Orders this rank's exit after every peer finished reading what it sent.
  const Status b = comm.barrier();
  return b.ok() ? 0 : fail(rank, b.message());
}

int collectives(const GlooOptions& options) {
  auto joined = make_gloo_communicator(options);
  if (!joined.ok()) return fail(options.rank, joined.message());
  auto& comm = *joined.value();
  const int n = comm.world_size();
  const int rank = comm.rank();

  // all_gather: block r must come from rank r, on every rank.
  constexpr size_t kBlock = 1001;
  const auto mine = payload(rank, 500, kBlock);
  std::vector<uint8_t> gathered(kBlock * n, 0);
  Status st = comm.all_gather(mine.data(), gathered.data(), kBlock);
  if (!st.ok()) return fail(rank, st.message());
  for (int r = 0; r < n; ++r) {
    const auto want = payload(r, 500, kBlock);
    if (!std::equal(want.begin(), want.end(), gathered.begin() + r * kBlock)) {
      return fail(rank, "all_gather block " + std::to_string(r) + " is not rank " +
                            std::to_string(r) + "'s data");
    }
  }
  // In place: the input already sits in this rank's block of the output.
  std::vector<uint8_t> in_place(kBlock * n, 0);
  std::copy(mine.begin(), mine.end(), in_place.begin() + rank * kBlock);
  st = comm.all_gather(in_place.data() + rank * kBlock, in_place.data(), kBlock);
  if (!st.ok()) return fail(rank, st.message());
  if (in_place != gathered) return fail(rank, "in-place all_gather differs");

  // broadcast from the last rank (non-zero for every n >= 2).
  const int root = n - 1;
  constexpr size_t kBcast = 777777;
  std::vector<uint8_t> data =
      rank == root ? payload(root, 600, kBcast) : std::vector<uint8_t>(kBcast, 0xAB);
  st = comm.broadcast(data.data(), kBcast, root);
  if (!st.ok()) return fail(rank, st.message());
  if (data != payload(root, 600, kBcast)) return fail(rank, "broadcast data differs from root's");

  // barrier: rank 0 arrives 300 ms late and leaves a marker first; no rank may get past the
  // barrier before that marker exists, and every rank must have waited for it.
  const auto marker = std::filesystem::path(options.store_dir) / "rank0-arrived";
  const auto start = Clock::now();
  if (rank == 0) {
    std::this_thread::sleep_for(milliseconds(300));
    std::ofstream(marker) << "here";
  }
  st = comm.barrier();
  if (!st.ok()) return fail(rank, st.message());
  if (!std::filesystem::exists(marker)) return fail(rank, "left the barrier before rank 0 came");
  if (seconds_since(start) < 0.25) return fail(rank, "barrier did not wait for rank 0");
  // Orders this rank's exit after every peer finished the checks above.
  st = comm.barrier();
  return st.ok() ? 0 : fail(rank, st.message());
}

class CommunicatorGroupTest : public ::testing::TestWithParam<int> {};

// all_reduce_sum: random (never zero) values of odd count, fp32 and bf16; every rank gets the
// sum in rank order in fp32 rounded once (computed here independently from each rank's
// reproducible input), bit for bit the same on every rank.
int all_reduce(const GlooOptions& options) {
  auto joined = make_gloo_communicator(options);
  if (!joined.ok()) return fail(options.rank, joined.message());
  auto& comm = *joined.value();
  const int n = comm.world_size(), rank = comm.rank();
  constexpr int64_t kCount = 1237;
  auto value = [](int r, int64_t i) {
    std::mt19937 g(static_cast<uint32_t>(r * 100003 + i));
    return std::uniform_real_distribution<float>(0.25f, 4.f)(g) * (i % 3 == 0 ? -1.f : 1.f);
  };
  std::vector<float> f32(kCount);
  std::vector<uint16_t> bf16(kCount);
  for (int64_t i = 0; i < kCount; ++i) {
    f32[static_cast<size_t>(i)] = value(rank, i);
    bf16[static_cast<size_t>(i)] = f32_to_bf16(value(rank, i));
  }
  Status st = comm.all_reduce_sum(f32.data(), kCount, DType::kF32);
  if (st.ok()) st = comm.all_reduce_sum(bf16.data(), kCount, DType::kBF16);
  if (!st.ok()) return fail(rank, st.message());
  for (int64_t i = 0; i < kCount; ++i) {
    float want = 0.f, want_bf = 0.f;
    for (int r = 0; r < n; ++r) {
      want += value(r, i);
      want_bf += bf16_to_f32(f32_to_bf16(value(r, i)));
    }
    if (f32[static_cast<size_t>(i)] != want) {
      return fail(rank, "fp32 sum differs at " + std::to_string(i));
    }
    if (bf16[static_cast<size_t>(i)] != f32_to_bf16(want_bf)) {
      return fail(rank, "bf16 sum differs at " + std::to_string(i));
    }
  }
  // all_reduce_add: x += the sum of the partials (x the same on every rank).
  std::vector<float> partial(kCount), x(kCount, 1.5f);
  for (int64_t i = 0; i < kCount; ++i) partial[static_cast<size_t>(i)] = value(rank, i);
  st = comm.all_reduce_add(partial.data(), x.data(), kCount, DType::kF32);
  if (!st.ok()) return fail(rank, st.message());
  for (int64_t i = 0; i < kCount; ++i) {
    float sum = 0.f;
    for (int r = 0; r < n; ++r) sum += value(r, i);
    if (x[static_cast<size_t>(i)] != 1.5f + sum) {
      return fail(rank, "all_reduce_add differs at " + std::to_string(i));
    }
  }
  if (comm.all_reduce_sum(f32.data(), 3, DType::kF16).ok()) {
    return fail(rank, "fp16 on the host path is refused, not summed wrongly");
  }
  const Status b = comm.barrier();
  return b.ok() ? 0 : fail(rank, b.message());
}

TEST_P(CommunicatorGroupTest, AllReduceSumAndAddAreTheRankOrderSumOnEveryRank) {
  expect_all_zero(run_group(GetParam(), all_reduce), GetParam());
}

TEST_P(CommunicatorGroupTest, RingExchangeOddSizes) {
  expect_all_zero(run_group(GetParam(), ring_exchange), GetParam());
}

TEST_P(CommunicatorGroupTest, OutstandingTagsCompleteInAnyWaitOrder) {
  expect_all_zero(run_group(GetParam(), outstanding_tags), GetParam());
}

TEST_P(CommunicatorGroupTest, AllGatherBroadcastBarrier) {
  expect_all_zero(run_group(GetParam(), collectives), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommunicatorGroupTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

constexpr auto kShortTimeout = milliseconds(2000);

// Checks a failed wait on rank 0: an error, within the timeout (plus slack), naming both sides.
int expect_peer_error(const Status& st, Clock::time_point start, double max_seconds) {
  const double took = seconds_since(start);
  if (st.ok()) return fail(0, "wait succeeded although peer 1 is gone");
  if (took > max_seconds) {
    return fail(0, "error took " + std::to_string(took) + " s: " + st.message());
  }
  const std::string& m = st.message();
  if (m.find("rank 0") == std::string::npos || m.find("peer 1") == std::string::npos) {
    return fail(0, "error does not name rank 0 and peer 1: " + m);
  }
  std::fprintf(stderr, "[rank 0] expected error after %.2f s: %s\n", took, m.c_str());
  return 0;
}

TEST(CommunicatorFailureTest, DeadPeerFailsPendingReceive) {
  const auto codes = run_group(
      2,
      [](const GlooOptions& options) {
        auto joined = make_gloo_communicator(options);
        if (!joined.ok()) return fail(options.rank, joined.message());
        auto& comm = *joined.value();
        // Orders rank 1's death after rank 0 is fully connected, so the failure under test is
        // the receive's, not the join's.
        const Status b = comm.barrier();
        if (!b.ok()) return fail(options.rank, b.message());
        if (options.rank == 1) {
          std::this_thread::sleep_for(milliseconds(200));
          raise(SIGKILL);
        }
        std::vector<uint8_t> in(1 << 20);
        const auto start = Clock::now();
        auto recv = comm.irecv(in.data(), in.size(), 1, 5);
        // Either the post or the wait may see the dead peer; both must be an error.
        const Status st = recv.ok() ? recv.value()->wait() : recv.status();
        return expect_peer_error(st, start, 4.0);
      },
      kShortTimeout);
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 0) << "rank 0 must get an error, not hang or crash";
  EXPECT_EQ(codes[1], 128 + SIGKILL);
}

TEST(CommunicatorFailureTest, SilentPeerTimesOut) {
  const auto codes = run_group(
      2,
      [](const GlooOptions& options) {
        auto joined = make_gloo_communicator(options);
        if (!joined.ok()) return fail(options.rank, joined.message());
        auto& comm = *joined.value();
        std::vector<uint8_t> in(4096);
        const auto start = Clock::now();
        if (options.rank == 1) {
          // Rank 1 stays alive but never sends; its own receive must end in an error too, once
          // rank 0 gives up (Gloo closes the pairs after a timeout).
          auto recv = comm.irecv(in.data(), in.size(), 0, 6);
          const Status st = recv.ok() ? recv.value()->wait() : recv.status();
          return st.ok() ? fail(1, "receive from a timed-out peer succeeded") : 0;
        }
        auto recv = comm.irecv(in.data(), in.size(), 1, 5);
        const Status st = recv.ok() ? recv.value()->wait() : recv.status();
        if (seconds_since(start) < 1.5) return fail(0, "timed out early: " + st.message());
        return expect_peer_error(st, start, 4.0);
      },
      kShortTimeout);
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(CommunicatorFailureTest, PeerDyingMidSendIsAnErrorNotSigpipe) {
  const auto codes = run_group(
      2,
      [](const GlooOptions& options) {
        auto joined = make_gloo_communicator(options);
        if (!joined.ok()) return fail(options.rank, joined.message());
        auto& comm = *joined.value();
        // Gloo writes a send only once the receiver has posted its receive, so rank 1 posts a
        // large one (~90 ms on loopback) and dies mid-transfer. Rank 0 must get an error, not
        // a hang and not death by SIGPIPE from writing to the closed socket. (Observed with
        // Debian's Gloo: a death mid-transfer surfaces only at the timeout, while a death with
        // no transfer in flight surfaces at once as "Connection closed by peer".)
        constexpr size_t kBytes = size_t{128} << 20;
        std::vector<uint8_t> buf(kBytes, static_cast<uint8_t>(options.rank));
        if (options.rank == 1) {
          auto recv = comm.irecv(buf.data(), kBytes, 0, 7);
          if (!recv.ok()) return fail(1, recv.message());
          // Orders rank 0's send after this receive was posted (same socket, FIFO).
          const Status b = comm.barrier();
          if (!b.ok()) return fail(1, b.message());
          std::this_thread::sleep_for(milliseconds(5));
          raise(SIGKILL);
        }
        // Orders the send after rank 1 posted its receive.
        const Status b = comm.barrier();
        if (!b.ok()) return fail(0, b.message());
        const auto start = Clock::now();
        Status st;
        // The first send may complete into socket buffers before rank 1 dies; the next ones
        // cannot.
        for (int i = 0; i < 8 && st.ok(); ++i) {
          auto send = comm.isend(buf.data(), kBytes, 1, 7);
          st = send.ok() ? send.value()->wait() : send.status();
        }
        return expect_peer_error(st, start, 4.0);
      },
      kShortTimeout);
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 0) << "rank 0 must get an error (128 + 13 would be death by SIGPIPE)";
  EXPECT_EQ(codes[1], 128 + SIGKILL);
}

TEST(CommunicatorFailureTest, SizeMismatchIsAnErrorNotACrash) {
  const auto codes = run_group(
      2,
      [](const GlooOptions& options) {
        auto joined = make_gloo_communicator(options);
        if (!joined.ok()) return fail(options.rank, joined.message());
        auto& comm = *joined.value();
        std::vector<uint8_t> buf(1 << 20, 1);
        // Rank 0 sends 1 MiB where rank 1 expects 1 byte: both must see an error (Gloo alone
        // would terminate rank 1 from its loop thread).
        auto handle = options.rank == 0 ? comm.isend(buf.data(), buf.size(), 1, 3)
                                        : comm.irecv(buf.data(), 1, 0, 3);
        const Status st = handle.ok() ? handle.value()->wait() : handle.status();
        return st.ok() ? fail(options.rank, "mismatched transfer succeeded") : 0;
      },
      kShortTimeout);
  expect_all_zero(codes, 2);
}

TEST(CommunicatorTest, RejectsBadArguments) {
  GlooOptions options;
  options.rank = 2;
  options.world_size = 2;
  options.store_dir = "/tmp/unused";
  auto bad_rank = make_gloo_communicator(options);
  EXPECT_FALSE(bad_rank.ok());
  EXPECT_NE(bad_rank.message().find("rank 2"), std::string::npos) << bad_rank.message();
  options.rank = 0;
  options.store_dir.clear();
  EXPECT_FALSE(make_gloo_communicator(options).ok());

  const auto codes = run_group(2, [](const GlooOptions& opts) {
    auto joined = make_gloo_communicator(opts);
    if (!joined.ok()) return fail(opts.rank, joined.message());
    auto& comm = *joined.value();
    uint8_t byte = 0;
    if (comm.isend(&byte, 1, comm.rank(), 0).ok()) return fail(opts.rank, "send to self posted");
    if (comm.irecv(&byte, 1, 2, 0).ok()) return fail(opts.rank, "recv from rank 2 posted");
    if (comm.isend(&byte, 1, 1 - comm.rank(), -1).ok()) return fail(opts.rank, "tag -1 posted");
    if (comm.broadcast(&byte, 1, 5).ok()) return fail(opts.rank, "broadcast root 5 accepted");
    // Zero bytes complete at once and keep the group usable.
    auto empty = comm.isend(nullptr, 0, 1 - comm.rank(), 0);
    if (!empty.ok() || !empty.value()->wait().ok()) return fail(opts.rank, "zero-byte send");
    const Status b = comm.barrier();
    return b.ok() ? 0 : fail(opts.rank, b.message());
  });
  expect_all_zero(codes, 2);
}

}  // namespace
}  // namespace burst::engine
