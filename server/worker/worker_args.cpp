#include "worker/worker_args.h"

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "common/logging.h"
#include "engine/parallel_layout.h"
#include "group/worker_registry.h"

namespace burst::worker {
namespace {

constexpr const char* kUsage =
    R"(usage: burst-worker (--model DIR | --preset NAME --random-weights SEED) --rank R --world N
                    --store DIR --port-file FILE [--progress-file FILE] [--device D]
                    [--kv-capacity TOKENS] [--kv-memory-fraction F] [--kv-reserve-bytes B]
                    [--threads T] [--comm-timeout-ms MS] [--tp T]
   or: burst-worker (--model DIR | --preset NAME --random-weights SEED) --join HOST:PORT
                    [--advertise-host H] [--cluster-token-file F] [--device D] [--threads T]
   or: burst-worker --version | --help

The first form is started by burst-server / burst-generate --workers N (with the group's secret
in $BURST_WORKER_SECRET); the second joins `burst-server --remote-workers N --worker-listen
HOST:PORT` (multi-node), which sends rank, world size and KV capacity.

  --model DIR       a Hugging Face LLaMA directory (config.json, *.safetensors)
  --preset NAME     random weights of a LLaMA-2 shape: 1b, 7b, 13b or 70b
  --random-weights SEED  the preset's weights' seed
  --device D        cpu (default), cuda or cuda:N
  --threads T       CPU threads (0: cores / world size; with --join: all cores)
  --rank R, --world N  this worker's rank and the group's size (spawned form)
  --tp T            tensor parallelism (spawned form; default 1): ranks [k T, (k+1) T) split
                    each layer's weights, the ring joins the ranks of equal index mod T
  --store DIR       the group's rendezvous directory (spawned form)
  --port-file FILE  where the control service's port is written once the rank is up
  --progress-file FILE  where loading progress ("BYTES_DONE BYTES_TOTAL") is written while the
                    weights load; the coordinator reads it (spawned form)
  --kv-capacity TOKENS  KV rows this rank caches (spawned form; default 4096); 0 on a GPU:
                    as many as its memory holds once the weights are in
  --kv-memory-fraction F  with --kv-capacity 0: the share of the GPU this process may fill
                    (default 0.9)
  --kv-reserve-bytes B  with --kv-capacity 0: bytes kept free for activations (default 0)
  --comm-timeout-ms MS  the communicator's timeout (spawned form; default 30000)
  --poison-freed-kv 1  fill freed KV pages with NaN (a test; also $BURST_POISON_FREED_KV=1)
  --join HOST:PORT  register with burst-server's worker registry (multi-node)
  --advertise-host H  the address the server and the other workers reach this one at
                    (default: this host's address on the route to the server)
  --cluster-token-file F  the cluster token (else $BURST_CLUSTER_TOKEN)
  --version         print the version and build, exit
  --help            print this, exit
SIGTERM stops the worker at any moment, loading included.
)";

[[noreturn]] void usage(const std::string& msg) {
  std::cerr << "burst-worker: " << msg << "\n" << kUsage;
  std::exit(2);
}

int64_t to_int(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  int64_t x = 0;
  if (!(is >> x) || !is.eof()) usage("bad value '" + v + "' for " + flag);
  return x;
}

// A number in (0, 1].
double to_fraction(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  double x = 0;
  if (!(is >> x) || !is.eof() || !(x > 0 && x <= 1)) {
    usage("bad value '" + v + "' for " + flag + " (a number in (0, 1])");
  }
  return x;
}

// Sets the flag `f` to `v`; an unknown flag is a usage error.
void set_flag(Args& a, const std::string& f, const std::string& v) {
  const bool local = f == "--rank" || f == "--world" || f == "--store" ||
                     f == "--port-file" || f == "--progress-file" || f == "--kv-capacity" ||
                     f == "--kv-memory-fraction" || f == "--kv-reserve-bytes" ||
                     f == "--comm-timeout-ms" || f == "--tp";
  a.local_flags = a.local_flags || local;
  if (f == "--model") a.model.dir = v;
  else if (f == "--preset") a.model.preset = v;
  else if (f == "--random-weights") a.model.random_seed = static_cast<uint64_t>(to_int(f, v));
  else if (f == "--rank") a.rank = static_cast<int>(to_int(f, v));
  else if (f == "--world") a.world = static_cast<int>(to_int(f, v));
  else if (f == "--store") a.store = v;
  else if (f == "--port-file") a.port_file = v;
  else if (f == "--progress-file") a.progress_file = v;
  else if (f == "--device") a.device = v;
  else if (f == "--kv-capacity") a.kv_capacity = to_int(f, v);
  else if (f == "--kv-memory-fraction") a.kv_memory_fraction = to_fraction(f, v);
  else if (f == "--kv-reserve-bytes") a.kv_reserve_bytes = to_int(f, v);
  else if (f == "--threads") a.threads = static_cast<int>(to_int(f, v));
  else if (f == "--tp") a.tp = static_cast<int>(to_int(f, v));
  else if (f == "--comm-timeout-ms") a.comm_timeout_ms = static_cast<int>(to_int(f, v));
  else if (f == "--join") a.join = v;
  else if (f == "--advertise-host") a.advertise_host = v;
  else if (f == "--cluster-token-file") a.cluster_token_file = v;
  else if (f == "--poison-freed-kv") a.poison_freed_kv = to_int(f, v) != 0;
  else usage("unknown flag " + f);
}

// The flags each form needs or refuses.
void check(const Args& a) {
  if (a.threads < 0) usage("--threads must be >= 0");
  if (!a.join.empty()) {
    if (a.local_flags) {
      usage("--rank, --world, --store, --port-file, --progress-file, --kv-capacity, "
            "--comm-timeout-ms and --tp come from the server with --join; drop them");
    }
    if (auto hp = burst::server::split_host_port(a.join); !hp.ok()) {
      usage("--join: " + hp.message());
    }
    return;
  }
  if (!a.advertise_host.empty()) usage("--advertise-host needs --join");
  if (!a.cluster_token_file.empty()) usage("--cluster-token-file needs --join");
  if (a.world < 1 || a.rank < 0 || a.rank >= a.world) usage("need 0 <= --rank < --world");
  if (a.store.empty() || a.port_file.empty()) usage("need --store and --port-file");
  if (auto layout = engine::ParallelLayout::of(a.world, a.tp); !layout.ok()) {
    usage(layout.message());
  }
  if (a.kv_capacity < 0) usage("--kv-capacity must be >= 0 (0: from the GPU's memory)");
  if (a.kv_reserve_bytes < 0) usage("--kv-reserve-bytes must be >= 0");
}

}  // namespace

Args parse_args(int argc, char** argv) {
  Args a;
  if (const char* p = std::getenv("BURST_POISON_FREED_KV"); p != nullptr) {
    a.poison_freed_kv = std::string(p) == "1";
  }
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    // The only flags without a value.
    if (f == "--help" || f == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (f == "--version") {
      std::cout << burst::server::version_string("burst-worker") << "\n";
      std::exit(0);
    }
    if (i + 1 >= argc) usage("missing value for " + f);
    set_flag(a, f, argv[++i]);
  }
  check(a);
  return a;
}

}  // namespace burst::worker
