#include "common/heap.h"

#include <malloc.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

namespace burst::server {

HeapKeeper::HeapKeeper(HeapOptions options) : options_(options) {
  if (options_.arena_max > 0 && std::getenv("MALLOC_ARENA_MAX") == nullptr) {
    mallopt(M_ARENA_MAX, options_.arena_max);
  }
  if (options_.interval.count() > 0) thread_ = std::thread([this] { run(); });
}

HeapKeeper::~HeapKeeper() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HeapKeeper::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, options_.interval, [this] { return stop_; })) {
    // fordblks: bytes in free chunks of every arena (mmapped chunks are returned at free).
    const struct mallinfo2 mi = mallinfo2();
    if (static_cast<int64_t>(mi.fordblks) <= options_.trim_above_bytes) continue;
    const auto t0 = std::chrono::steady_clock::now();
    malloc_trim(0);
    spdlog::debug(
        "heap: returned free memory to the system ({} MB were free in malloc's "
        "arenas; {:.1f} ms)",
        mi.fordblks >> 20,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
}

}  // namespace burst::server
