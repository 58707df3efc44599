// burst-worker's command line: the two forms (spawned by a local coordinator, or --join).
#pragma once

#include <cstdint>
#include <string>

#include "engine/attention_dtype.h"
#include "engine/kv_pages.h"
#include "models/llama.h"

namespace burst::worker {

struct Args {
  models::ModelSpec model;
  int rank = -1, world = 0, threads = 0;
  int tp = 1;  // tensor parallelism: the group is tp x (world / tp) (engine::ParallelLayout)
  std::string store, port_file, progress_file, device = "cpu";
  int64_t kv_capacity = 4096;  // 0: from the GPU's memory (kv_memory_fraction, kv_reserve_bytes)
  double kv_memory_fraction = 0.9;
  int64_t kv_reserve_bytes = 0;
  engine::KvCacheDtype kv_cache_dtype = engine::KvCacheDtype::kAuto;  // --kv-cache-dtype
  engine::AttentionDtype attention_dtype = engine::AttentionDtype::kAuto;  // --attention-dtype
  int comm_timeout_ms = 30000;
  std::string join, advertise_host;
  std::string cluster_token_file;  // --join: the cluster token's file (else $BURST_CLUSTER_TOKEN)
  bool local_flags = false;  // any of --rank --world --store --port-file --kv-capacity ...
  // A test of prefix caching: freed KV pages are filled with NaN (PagedKvCache::
  // set_poison_freed), so a request that reads a page after it was freed gives garbage, not
  // plausible tokens. $BURST_POISON_FREED_KV=1 turns it on too (spawned workers inherit it).
  bool poison_freed_kv = false;
  // Logging (common/logging.h): a spawned worker inherits the server's through the
  // environment ($BURST_LOG_LEVEL, $BURST_LOG_FORMAT); the flags override it.
  std::string log_level = "info", log_format = "text";
};

// The arguments; --help and --version print and exit 0, a bad command line prints the usage
// and exits 2.
Args parse_args(int argc, char** argv);

}  // namespace burst::worker
