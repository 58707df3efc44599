#include "worker/worker_args.h"

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "common/cli.h"
#include "common/logging.h"
#include "engine/parallel_layout.h"
#include "group/worker_registry.h"

namespace burst::worker {
namespace {

// The synopsis; the flags' descriptions are where each flag is declared (add_flags).
constexpr const char* kSynopsis =
    R"(usage: burst-worker (--model DIR | --preset NAME --random-weights SEED) --rank R --world N
                    --store DIR --port-file FILE [--progress-file FILE] [--device D]
                    [--kv-capacity TOKENS] [--kv-memory-fraction F] [--kv-reserve-bytes B]
                    [--kv-cache-dtype auto|fp8] [--threads T] [--comm-timeout-ms MS] [--tp T]
   or: burst-worker (--model DIR | --preset NAME --random-weights SEED) --join HOST:PORT
                    [--advertise-host H] [--cluster-token-file F] [--device D] [--threads T]
   or: burst-worker --version | --help

The first form is started by burst-server / burst-generate --workers N (with the group's secret
in $BURST_WORKER_SECRET); the second joins `burst-server --remote-workers N --worker-listen
HOST:PORT` (multi-node), which sends rank, world size and KV capacity. Flags take --flag VALUE
or --flag=VALUE. SIGTERM stops the worker at any moment, loading included.
)";

// The spawned form's flags: with --join the server sends these.
constexpr const char* kLocalFlags[] = {
    "--rank",        "--world",          "--store",          "--port-file",       "--progress-file",
    "--kv-capacity", "--kv-memory-fraction", "--kv-reserve-bytes", "--comm-timeout-ms", "--tp",
    "--kv-cache-dtype"};

[[noreturn]] void usage(const CLI::App& app, const std::string& msg) {
  std::cerr << "burst-worker: " << msg << "\n" << app.help();
  std::exit(2);
}

// Every flag, bound to its field of `a`, with its --help line.
void add_flags(CLI::App& app, Args& a, bool& version) {
  app.add_option("--model", a.model.dir, "a Hugging Face LLaMA directory (config.json, "
                 "*.safetensors)")->type_name("DIR");
  app.add_option("--preset", a.model.preset, "random weights of a LLaMA-2 shape: 1b, 7b, 13b or "
                 "70b")->type_name("NAME");
  app.add_option("--random-weights", a.model.random_seed, "the preset's weights' seed")
      ->type_name("SEED");
  app.add_option("--device", a.device, "cpu (default), cuda or cuda:N")->type_name("D");
  app.add_option("--threads", a.threads, "CPU threads (0: cores / world size; with --join: all "
                 "cores)")->type_name("T");
  app.add_option("--rank", a.rank, "this worker's rank (spawned form)")->type_name("R");
  app.add_option("--world", a.world, "the group's size (spawned form)")->type_name("N");
  app.add_option("--tp", a.tp, "tensor parallelism (spawned form; default 1): ranks [k T, "
                 "(k+1) T) split each layer's weights, the ring joins the ranks of equal index "
                 "mod T")->type_name("T");
  app.add_option("--store", a.store, "the group's rendezvous directory (spawned form)")
      ->type_name("DIR");
  app.add_option("--port-file", a.port_file, "where the control service's port is written once "
                 "the rank is up")->type_name("FILE");
  app.add_option("--progress-file", a.progress_file, "where loading progress (\"BYTES_DONE "
                 "BYTES_TOTAL\") is written while the weights load; the coordinator reads it "
                 "(spawned form)")->type_name("FILE");
  app.add_option("--kv-capacity", a.kv_capacity, "KV rows this rank caches (spawned form; "
                 "default 4096); 0 on a GPU: as many as its memory holds once the weights are "
                 "in")->type_name("TOKENS");
  app.add_option("--kv-memory-fraction", a.kv_memory_fraction, "with --kv-capacity 0: the share "
                 "of the GPU this process may fill, in (0, 1] (default 0.9)")
      ->type_name("F")
      ->check([](const std::string& v) -> std::string {
        double x = 0;
        std::istringstream is(v);
        return (is >> x) && is.eof() && x > 0 && x <= 1 ? "" : "a number in (0, 1]";
      });
  app.add_option("--kv-reserve-bytes", a.kv_reserve_bytes, "with --kv-capacity 0: bytes kept "
                 "free for activations (default 0)")->type_name("B");
  burst::server::add_kv_cache_dtype_option(app, a.kv_cache_dtype,
                                           "what the KV pool holds: auto (the compute dtype; "
                                           "default) or fp8 (FP8 rows, kernels/kv_fp8.h) "
                                           "(spawned form)");
  burst::server::add_attention_dtype_option(app, a.attention_dtype,
                                            "prefill attention's products: auto (the compute "
                                            "dtype; default) or fp8 (e4m3: the Hopper FP8 "
                                            "kernel, emulated on CPUs) (spawned form)");
  app.add_option("--comm-timeout-ms", a.comm_timeout_ms, "the communicator's timeout (spawned "
                 "form; default 30000)")->type_name("MS");
  app.add_option("--poison-freed-kv", a.poison_freed_kv, "1: fill freed KV pages with NaN (a "
                 "test; also $BURST_POISON_FREED_KV=1)")->type_name("0|1");
  app.add_option("--join", a.join, "register with burst-server's worker registry (multi-node)")
      ->type_name("HOST:PORT");
  app.add_option("--advertise-host", a.advertise_host, "the address the server and the other "
                 "workers reach this one at (default: this host's address on the route to the "
                 "server)")->type_name("H");
  app.add_option("--cluster-token-file", a.cluster_token_file, "the cluster token (else "
                 "$BURST_CLUSTER_TOKEN)")->type_name("F");
  app.add_option("--log-level", a.log_level, "trace, debug, info (default), warn, error, "
                 "critical or off (default: $BURST_LOG_LEVEL, which burst-server sets for the "
                 "workers it starts)")->type_name("LEVEL");
  app.add_option("--log-format", a.log_format, "text (default) or json: one JSON object per line "
                 "with the rank (default: $BURST_LOG_FORMAT, set by burst-server)")
      ->type_name("F");
  app.add_flag("--version", version, "print the version and build, exit");
}

// The flags each form needs or refuses.
void check(const CLI::App& app, const Args& a) {
  if (a.threads < 0) usage(app, "--threads must be >= 0");
  if (!a.join.empty()) {
    if (a.local_flags) {
      usage(app, "--rank, --world, --store, --port-file, --progress-file, --kv-capacity, "
            "--kv-cache-dtype, --comm-timeout-ms and --tp come from the server with --join; "
            "drop them");
    }
    if (auto hp = burst::server::split_host_port(a.join); !hp.ok()) {
      usage(app, "--join: " + hp.message());
    }
    return;
  }
  if (!a.advertise_host.empty()) usage(app, "--advertise-host needs --join");
  if (!a.cluster_token_file.empty()) usage(app, "--cluster-token-file needs --join");
  if (a.world < 1 || a.rank < 0 || a.rank >= a.world) usage(app, "need 0 <= --rank < --world");
  if (a.store.empty() || a.port_file.empty()) usage(app, "need --store and --port-file");
  if (auto layout = engine::ParallelLayout::of(a.world, a.tp); !layout.ok()) {
    usage(app, layout.message());
  }
  if (a.kv_capacity < 0) usage(app, "--kv-capacity must be >= 0 (0: from the GPU's memory)");
  if (a.kv_reserve_bytes < 0) usage(app, "--kv-reserve-bytes must be >= 0");
}

}  // namespace

Args parse_args(int argc, char** argv) {
  Args a;
  if (const char* p = std::getenv("BURST_POISON_FREED_KV"); p != nullptr) {
    a.poison_freed_kv = std::string(p) == "1";
  }
  if (const char* p = std::getenv(burst::server::kLogLevelEnv); p != nullptr) a.log_level = p;
  if (const char* p = std::getenv(burst::server::kLogFormatEnv); p != nullptr) a.log_format = p;
  auto app = burst::server::make_cli("burst-worker", kSynopsis);
  bool version = false, help = false;
  add_flags(*app, a, version);
  const std::string error = burst::server::parse_cli(*app, argc, argv, &help);
  if (help) {
    std::cout << app->help();
    std::exit(0);
  }
  if (!error.empty()) usage(*app, error);
  if (version) {
    std::cout << burst::server::version_string("burst-worker") << "\n";
    std::exit(0);
  }
  for (const char* f : kLocalFlags) a.local_flags = a.local_flags || app->count(f) > 0;
  check(*app, a);
  return a;
}

}  // namespace burst::worker
