#include "worker/worker_rank.h"

#include <chrono>
#include <cstdio>
#include <fstream>

#include "common/logging.h"
#include "engine/kv_pages.h"
#ifdef BURST_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace burst::worker {

models::LoadProgress load_reporter(const WorkerProcess& process,
                                   const std::string& progress_file) {
  using Clock = std::chrono::steady_clock;
  auto last = std::make_shared<Clock::time_point>();
  auto last_log = std::make_shared<Clock::time_point>(Clock::now());
  return [&process, progress_file, last, last_log](int64_t done, int64_t total) {
    const auto now = Clock::now();
    if (!progress_file.empty()) {
      if (done < total && now - *last < std::chrono::milliseconds(200)) return;
      *last = now;
      const std::string tmp = progress_file + ".tmp";
      std::ofstream(tmp) << done << " " << total << "\n";
      std::rename(tmp.c_str(), progress_file.c_str());
    } else if (done == total || now - *last_log >= std::chrono::seconds(5)) {
      *last_log = now;
      process.say("loading the weights: " + burst::server::bytes_progress(done, total));
    }
  };
}

Result<engine::RankCommunicators> join_communicators(const WorkerProcess& process, int tp,
                                                     engine::Backend& backend,
                                                     const engine::CommunicatorOptions& options) {
  auto layout = engine::ParallelLayout::of(options.world_size, tp);
  if (!layout.ok()) return layout.status();
  auto comms = engine::make_rank_communicators(backend, options, layout.value());
  if (!comms.ok()) return comms.status();
  if (options.rank == 0) {
    if (layout.value().cp > 1) process.say("ring: " + comms.value().ring->transport());
    if (layout.value().tp > 1) {
      process.say(layout.value().describe() + "; tensor-parallel group: " +
                  comms.value().tp->transport());
    }
  }
  return comms;
}

namespace {

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return std::string(b);
}

// Bytes of one cached token on this rank: K and V of its KV heads in every layer.
int64_t kv_token_bytes(const engine::AttentionShape& s, const engine::Backend& backend,
                       engine::KvCacheDtype dtype) {
  return int64_t{s.layers} * 2 * engine::kv_row_bytes(backend, s, dtype);
}

#ifdef BURST_HAVE_CUDA

// kv_rows with --kv-capacity 0 on a CUDA backend.
Result<int64_t> kv_rows_from_gpu(const WorkerProcess& process, const Args& a,
                                 engine::Backend& backend, const models::LlamaModel& model) {
  auto mem = engine::cuda_memory_info(backend);
  if (!mem.ok()) return mem.status();
  const engine::AttentionShape s = model.attention_shape();
  const int64_t row_bytes = kv_token_bytes(s, backend, a.kv_cache_dtype);
  const int64_t rows = engine::kv_rows_from_memory(
      mem.value().free, mem.value().total, a.kv_memory_fraction, a.kv_reserve_bytes, row_bytes,
      engine::kv_page_size(backend));
  const double free = static_cast<double>(mem.value().free);
  if (rows <= 0) {
    return Status::error("no GPU memory left for the KV cache: " + gib(free) + " free of " +
                         gib(static_cast<double>(mem.value().total)) +
                         " with the weights in; " + std::to_string(a.kv_memory_fraction) +
                         " of the device may be used, " +
                         gib(static_cast<double>(a.kv_reserve_bytes)) +
                         " is kept for activations (set --kv-capacity, or a larger fraction)");
  }
  process.say("KV cache sized from GPU memory: " + std::to_string(rows) + " tokens, " +
              gib(static_cast<double>(rows * row_bytes)) + " (" + gib(free) + " were free)");
  return rows;
}
#endif

}  // namespace

Result<int64_t> kv_rows(const WorkerProcess& process, const Args& a, engine::Backend& backend,
                        const models::LlamaModel& model) {
  if (a.kv_capacity > 0) return a.kv_capacity;
#ifdef BURST_HAVE_CUDA
  if (backend.device() == engine::DeviceKind::kCuda) {
    return kv_rows_from_gpu(process, a, backend, model);
  }
#else
  (void)process;
  (void)backend;
  (void)model;
#endif
  return Status::error("--kv-capacity 0 (from the GPU's memory) needs a CUDA device");
}

Result<std::unique_ptr<engine::RingAttention>> open_ring(const WorkerProcess& process,
                                                         const Args& a, engine::Backend& backend,
                                                         const models::LlamaModel& model,
                                                         engine::Communicator& comm) {
  auto capacity = kv_rows(process, a, backend, model);
  if (!capacity.ok()) return capacity.status();
  // The memory plan of this rank, said once: its weights (its tensor-parallel share), its KV
  // pool (its heads of its ring shard), and what the device has left for activations and the
  // ring's blocks once both are in. The weights were checked against free memory before the
  // first byte was read (Backend::check_fits), the pool before it is allocated.
  const engine::AttentionShape s = model.attention_shape();
  const int64_t kv_bytes = capacity.value() * kv_token_bytes(s, backend, a.kv_cache_dtype);
  auto ring = engine::RingAttention::create(backend, comm, s, capacity.value(),
                                            engine::kv_page_size(backend), a.kv_cache_dtype,
                                            a.attention_dtype);
  if (!ring.ok()) return ring.status();
  ring.value()->cache_mut().set_poison_freed(a.poison_freed_kv);
  std::string plan = "memory plan: weights " + gib(static_cast<double>(model.weight_bytes())) +
                     (model.tensor_parallel().size > 1
                          ? " (1/" + std::to_string(model.tensor_parallel().size) +
                                " of the layers)"
                          : "") +
                     ", KV cache " + gib(static_cast<double>(kv_bytes)) + " (" +
                     std::to_string(capacity.value()) + " tokens, " + std::to_string(s.kv_heads) +
                     " KV heads" +
                     (a.kv_cache_dtype == engine::KvCacheDtype::kFp8 ? ", fp8" : "") + ")" +
                     (a.attention_dtype == engine::AttentionDtype::kFp8 ? ", attention fp8" : "");
#ifdef BURST_HAVE_CUDA
  if (backend.device() == engine::DeviceKind::kCuda) {
    if (auto mem = engine::cuda_memory_info(backend); mem.ok()) {
      plan += ", " + gib(static_cast<double>(mem.value().free)) +
              " left for activations and the ring's blocks";
    }
  }
#endif
  process.say(plan);
  return ring;
}

}  // namespace burst::worker
