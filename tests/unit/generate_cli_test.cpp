// burst-generate as a user runs it: bad arguments give the usage and exit code 2; a real run on
// a fixture model exits 0 and prints its stats line.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <sys/wait.h>

#include <vector>

namespace {

struct CliRun {
  int code;
  std::string out;
};

CliRun run(const std::string& args) {
  const std::string cmd = std::string(BURST_BINARY_DIR) + "/bin/burst-generate " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  CliRun r{-1, {}};
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

const std::string kModel = std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-linear/model";

TEST(GenerateCli, BadArgumentsExitTwoWithUsage) {
  for (const std::string& args : std::vector<std::string>{"", "--model", "--model x --preset 7b --prompt a", "--preset 7b --prompt a",
        "--model " + kModel + " --prompt-tokens 5 --max-tokens 0",
        "--model " + kModel + " --prompt-tokens 5 --temperature -1",
        "--model " + kModel + " --prompt-tokens 5 --top-p 0",
        "--model " + kModel + " --prompt-tokens 5 --max-tokens abc",
        "--model " + kModel + " --prompt-tokens 5 --bogus 1",
        "--model " + kModel + " --prompt-tokens 5 --workers 2 --prefill-chunk -1"}) {
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("usage: burst-generate"), std::string::npos) << args;
  }
}

TEST(GenerateCli, MissingModelIsAnErrorNotACrash) {
  const CliRun r = run("--model /nonexistent/dir --prompt hi");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;
}

TEST(GenerateCli, RunsAFixtureModelFromTokenIds) {
  const CliRun r = run("--model " + kModel + " --prompt-tokens 12 --max-tokens 5 --temperature 0");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("prompt 12 tokens"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("generated 5 tokens"), std::string::npos) << r.out;
  // Through workers on the CPU it also reports the ring's compute and exposed communication
  // (host clock: exact there; on a GPU it would only time the queueing, so it is not printed).
  const CliRun w = run("--model " + kModel +
                       " --prompt-tokens 12 --max-tokens 3 --temperature 0 --workers 2");
  ASSERT_EQ(w.code, 0) << w.out;
  EXPECT_NE(w.out.find("ring attention"), std::string::npos) << w.out;
  EXPECT_NE(w.out.find("exposed communication"), std::string::npos) << w.out;
}


}  // namespace

namespace {

std::string stdout_of(const std::string& args) {
  const std::string cmd =
      std::string(BURST_BINARY_DIR) + "/bin/burst-generate " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

// The "done when": the tiny model's greedy text is the same in-process and over 1..4
// worker processes (BurstAttention ring over Gloo).
TEST(GenerateCli, TinyModelTextIdenticalForOneToFourWorkers) {
  const std::string base = "--model " + std::string(BURST_SOURCE_DIR) +
                           "/models/kjv-tiny --prompt 'And God said' --max-tokens 24 "
                           "--temperature 0";
  const std::string want = stdout_of(base);
  ASSERT_GT(want.size(), std::string("And God said").size() + 20) << want;
  EXPECT_EQ(want.rfind("And God said", 0), 0u) << want;
  for (int n = 1; n <= 4; ++n) {
    EXPECT_EQ(stdout_of(base + " --workers " + std::to_string(n)), want) << n << " workers";
  }
  // Chunked prefill (each chunk one ring pass over the cached prefix) gives the same text; 3
  // tokens a chunk leaves a short last chunk and chunks smaller than the ring.
  EXPECT_EQ(stdout_of(base + " --workers 3 --prefill-chunk 3"), want) << "3 workers, chunk 3";
  // Tensor parallelism (kjv-tiny: 2 heads, 1 KV head, replicated on both ranks of a group):
  // tp 2 alone, and tp 2 x a ring of 2, chunked.
  EXPECT_EQ(stdout_of(base + " --workers 2 --tp 2"), want) << "tp 2";
  EXPECT_EQ(stdout_of(base + " --workers 4 --tp 2 --prefill-chunk 5"), want) << "tp 2 x cp 2";
}

// Layouts that cannot work are refused before any worker starts, saying why.
TEST(GenerateCli, BadTensorParallelLayoutsAreRefused) {
  const CliRun uneven = run("--model " + kModel + " --prompt-tokens 5 --workers 3 --tp 2");
  EXPECT_EQ(uneven.code, 2) << uneven.out;
  EXPECT_NE(uneven.out.find("does not divide the 3 workers"), std::string::npos) << uneven.out;
  const CliRun alone = run("--model " + kModel + " --prompt-tokens 5 --tp 2");
  EXPECT_EQ(alone.code, 2) << alone.out;
  // odd-linear has 6 attention heads.
  const CliRun heads = run("--model " + kModel + " --prompt-tokens 5 --workers 4 --tp 4");
  EXPECT_EQ(heads.code, 1) << heads.out;
  EXPECT_NE(heads.out.find("6 attention heads"), std::string::npos) << heads.out;
}

// The in-process engine prefills in chunks too (the same driver as the workers'): chunks of 5
// over a 12-token prompt give the unchunked run's greedy tokens.
TEST(GenerateCli, InProcessChunkedPrefillGivesTheSameTokens) {
  const std::string args =
      "--model " + kModel + " --prompt-tokens 12 --max-tokens 6 --temperature 0";
  const std::string whole = stdout_of(args);
  const std::string chunked = stdout_of(args + " --prefill-chunk 5");
  ASSERT_GT(whole.size(), 6u) << whole;  // ids, each followed by a space
  EXPECT_EQ(chunked, whole);
}

}  // namespace
