// Keeps burst-server's resident memory near what it uses. A large request (megabytes of prompt:
// the body, its JSON tree, the tokenizer's pieces, the token ids) allocates a few hundred MB on
// the HTTP or gRPC thread that serves it, all freed when it ends. glibc's malloc hands each
// thread an arena of its own (up to 8 per core) and keeps what is freed there for reuse instead
// of returning it to the system, so every large request could leave its peak behind in another
// arena: 29 MB -> 2 GB after 20 prompts of 2 MiB (docs/reliability.md, "Memory"). Not a leak,
// but unbounded in practice. Two bounds, both glibc's own:
// - fewer arenas (M_ARENA_MAX, set before any thread starts): the server's threads mostly wait,
//   so a few arenas cost no contention that matters, and freed memory is reused across threads;
// - a trimmer thread: every interval it asks malloc how much it holds free (mallinfo2) and,
//   past a threshold, hands the free pages back (malloc_trim: every arena, MADV_DONTNEED on the
//   free pages inside the heaps, not just at their top).
// $MALLOC_ARENA_MAX, when set, wins over the arena bound (glibc reads it itself).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace burst::server {

struct HeapOptions {
  int arena_max = 4;                    // 0: glibc's default (8 x cores)
  int64_t trim_above_bytes = 64 << 20;  // free bytes held by malloc that trigger a trim
  std::chrono::milliseconds interval{1000};
};

// Applies arena_max (call first thing in main, before any thread exists) and starts the
// trimmer; the destructor stops it.
class HeapKeeper {
 public:
  explicit HeapKeeper(HeapOptions options = {});
  ~HeapKeeper();
  HeapKeeper(const HeapKeeper&) = delete;
  HeapKeeper& operator=(const HeapKeeper&) = delete;

 private:
  void run();

  HeapOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace burst::server
