// burst-server: the frontend process. Reads the config (--config FILE, flags override; default
// configs/cpu-tiny.json), loads the tokenizer, starts the scheduler (which spawns and supervises
// the worker group, or with --remote-workers N waits for N `burst-worker --join` to register
// with the WorkerRegistry started here), then serves HTTP (OpenAI-compatible) and gRPC. Binds
// 127.0.0.1 unless told otherwise. SIGTERM/SIGINT drain: new requests get 503/UNAVAILABLE,
// requests in flight get drain_timeout_ms to finish and are then cancelled, the listeners close,
// the workers stop, and the process exits 0. Usage errors exit 2; start-up failures exit 1. --check-config validates
// the config and flags, prints the resolved settings and exits (deployment checks, CI).
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <spdlog/spdlog.h>

#include "models/config.h"
#include "models/llama.h"
#include "frontend/grpc_api.h"
#include "engine/kv_pages.h"
#include "common/heap.h"
#include "frontend/http_api.h"
#include "common/logging.h"
#include "frontend/metrics.h"
#include "frontend/scheduler.h"
#include "frontend/server_config.h"
#include "common/chat_template.h"
#include "common/tokenizer.h"
#include "group/grpc_logging.h"
#include "group/worker_registry.h"

namespace {

// A flag, not sigwait: blocking the signals would be inherited by the forked workers.
volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

int fail(const std::string& msg) {
  spdlog::error("{}", msg);
  return 1;
}

bool is_cuda(const burst::server::ServerConfig& cfg) { return cfg.device.rfind("cuda", 0) == 0; }

// Open files: the soft limit up to the hard one (at most 2^20), as Go's runtime and nginx do.
// Every connection is a descriptor, and gRPC has no per-client connection cap to offer (HTTP
// has one): with the usual soft limit of 1024, a client holding a thousand idle gRPC
// connections would leave no descriptor for an HTTP accept or a worker's pipe until the idle
// deadline closes them.
void raise_open_files_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t want = lim.rlim_max == RLIM_INFINITY
                          ? rlim_t{1} << 20
                          : std::min<rlim_t>(lim.rlim_max, rlim_t{1} << 20);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < want) {
    const rlim_t before = lim.rlim_cur;
    lim.rlim_cur = want;
    if (setrlimit(RLIMIT_NOFILE, &lim) == 0) {
      spdlog::info("open files limit raised from {} to {}", before, want);
    }
  }
}

// Multi-node is secure by default: a group of remote workers needs the cluster token, which the
// registry requires of every worker on every call. Without one anybody who reaches the
// registry could join the group and drive the workers: refused unless --insecure-cluster.
// Returns why the server must not start, or "".
std::string cluster_token_missing(const burst::server::ServerConfig& cfg) {
  using namespace burst::server;
  if (cfg.remote_workers == 0) return "";
  auto token = cluster_token_from_env();
  if (!token.ok()) return token.message();
  if (!token.value().empty() || cfg.insecure_cluster == 1) return "";
  return std::string("--remote-workers without a cluster token: set $") + kClusterTokenEnv +
         " (or $" + kClusterTokenFileEnv + ", a file holding it) for the server and every "
         "burst-worker --join, e.g. " + kClusterTokenEnv + "=$(openssl rand -hex 32); or give "
         "--insecure-cluster to let any host that reaches " + cfg.worker_listen +
         " join the group";
}

// --check-config: the server config is valid once parsed; the model's config.json and the
// tokenizer are checked where they exist (a deployment's model often lives on another host or
// volume), and a preset's shape always. 0: usable; 2: refused.
int check_config(const burst::server::ServerConfig& cfg) {
  namespace fs = std::filesystem;
  std::cout << burst::server::config_to_json(cfg) << "\n";
  std::error_code ec;
  if (!cfg.preset.empty()) {
    auto m = burst::models::preset_config(cfg.preset);
    if (!m.ok()) {
      std::cerr << "burst-server: " << m.message() << "\n";
      return 2;
    }
  } else if (fs::is_directory(cfg.model, ec)) {
    auto m = burst::models::load_config(cfg.model);
    if (!m.ok()) {
      std::cerr << "burst-server: " << m.message() << "\n";
      return 2;
    }
  } else {
    std::cerr << "burst-server: note: model directory " << cfg.model
              << " is not on this host (not checked)\n";
  }
  if (!fs::exists(cfg.tokenizer, ec)) {
    std::cerr << "burst-server: note: tokenizer " << cfg.tokenizer
              << " is not on this host (not checked)\n";
  }
  if (const std::string why = cluster_token_missing(cfg); !why.empty()) {
    std::cerr << "burst-server: note: the server will refuse to start here: " << why << "\n";
  }
  std::cerr << "burst-server: config ok (data directory: "
            << (cfg.data_dir.empty() ? "none" : cfg.data_dir) << ")\n";
  return 0;
}

// What a GPU rank keeps free beside its KV pool (--kv-capacity 0) for a prefill chunk's
// activations and the cached prefix gathered for the ring (one layer's K and V of the rank's
// share of the longest prompt), twice over, plus 1 GiB for libraries' workspaces. With FP8
// attention, also its workspace: q, k and v of the rank's share at one byte an element, and
// their scales (under 1 % of that; 2 % is kept).
int64_t kv_activation_reserve(const burst::models::LlamaConfig& m, int64_t max_context,
                              int workers, int64_t chunk, bool fp8_attention) {
  const int64_t bf16 = 2;
  const int64_t kv_row = 2 * m.num_kv_heads * m.head_dim * bf16;
  const int64_t share = (max_context + workers - 1) / std::max(1, workers);
  const int64_t per_token = 8 * m.hidden_size * bf16 + 3 * m.intermediate_size * bf16;
  const int64_t fp8_workspace =
      fp8_attention ? share * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim * 102 / 100 : 0;
  return (int64_t{1} << 30) + 2 * (share * kv_row + chunk * per_token) + fp8_workspace;
}

// The flags (CLI11, frontend/server_config.h). Returns the config, or the exit code when the
// process is done already (--help, --version, --check-config, a usage error).
std::variant<burst::server::ServerConfig, int> parse_flags(int argc, char** argv) {
  using namespace burst::server;
  ServerActions actions;
  auto parsed = parse_server_args(argc, argv, &actions);
  if (actions.help) {
    std::cout << server_help();
    return 0;
  }
  if (!parsed.ok()) {
    std::cerr << "burst-server: " << parsed.message() << "\n\n" << server_help();
    return 2;
  }
  if (actions.version) {
    std::cout << version_string("burst-server") << "\n";
    return 0;
  }
  ServerConfig cfg = parsed.take();
  if (actions.check_config) return check_config(cfg);
  if (burst::Status st = setup_logging("burst-server", cfg.log_level, cfg.log_format); !st.ok()) {
    std::cerr << "burst-server: " << st.message() << "\n";
    return 2;
  }
  if (log_is_json()) route_grpc_logs();
  return cfg;
}

// The limits left at 0 in the config, from the model and the tokenizer. Returns whether the KV
// pool is sized from GPU memory.
bool resolve_limits(burst::server::ServerConfig& cfg, const burst::models::LlamaConfig& model,
                    const burst::server::Tokenizer& tokenizer) {
  if (cfg.max_context == 0) cfg.max_context = model.max_position_embeddings;
  // The KV pool: on GPUs (spawned here or joined), by default as large as each GPU holds once
  // the weights are in (kv_memory_percent of the device, less a reserve for activations), so a
  // long prompt leaves room for others; else kv_capacity tokens, by default the max context.
  const bool kv_from_memory = cfg.kv_capacity == 0 && is_cuda(cfg);
  if (cfg.kv_capacity == 0 && !kv_from_memory) cfg.kv_capacity = cfg.max_context;
  if (cfg.max_tokens_limit == 0) {
    cfg.max_tokens_limit = static_cast<int>(kv_from_memory ? cfg.max_context : cfg.kv_capacity);
  }
  // No token stands for more text than the vocabulary's longest piece, so longer text can never
  // fit max_context tokens: refusing it untokenized never refuses a prompt that would fit.
  if (cfg.max_prompt_bytes == 0) {
    cfg.max_prompt_bytes = cfg.max_context * static_cast<int64_t>(tokenizer.max_piece_bytes());
  }
  return kv_from_memory;
}

// The scheduler's and the worker group's options from the resolved config.
burst::server::SchedulerOptions scheduler_options(const burst::server::ServerConfig& cfg,
                                                  const burst::models::LlamaConfig& model,
                                                  bool kv_from_memory, int64_t weight_bytes) {
  using namespace burst;
  const bool cuda = is_cuda(cfg);
  server::SchedulerOptions so;
  so.group.model = cfg.preset.empty()
                       ? models::ModelSpec{cfg.model, "", 0, {}}
                       : models::ModelSpec{"", cfg.preset,
                                           static_cast<uint64_t>(cfg.random_weights), {}};
  so.group.workers = cfg.workers;
  so.group.tp = cfg.tp;
  so.group.device = cfg.device;
  so.group.kv_capacity = cfg.kv_capacity;
  so.group.threads_per_worker = cfg.threads_per_worker;
  so.group.start_timeout = cfg.start_timeout_ms > 0
                               ? std::chrono::milliseconds(cfg.start_timeout_ms)
                               : server::default_start_timeout(weight_bytes);
  engine::parse_shard_layout(cfg.layout, &so.group.layout);  // checked by the config
  so.group.kv_cache_dtype = engine::parse_kv_cache_dtype(cfg.kv_cache_dtype).value();
  so.group.attention_dtype = engine::parse_attention_dtype(cfg.attention_dtype).value();
  so.max_context = cfg.max_context;
  so.max_prompt_bytes = cfg.max_prompt_bytes;
  so.max_tokens_limit = cfg.max_tokens_limit;
  so.max_queue = cfg.max_queue;
  so.max_running = cfg.max_running;
  so.max_batched_tokens = cfg.max_batched_tokens;
  // A chunk bounds how long decoding sequences and short prompts wait for a long prefill (one
  // step); larger chunks run the ring more efficiently. On GPUs: 2048 rows per GPU on 2 or
  // more (on 2 H200s a 128K prompt 7 % slower than unchunked, a 100-token request beside it
  // answered in 0.07-0.19 s instead of 0.33 s at 8192), 8192 on one (128K +2 % on an H200).
  // docs/benchmarks.md has the trade-off.
  // The ring's ranks: a tensor-parallel group shares its rows.
  const int world = cfg.remote_workers > 0 ? cfg.remote_workers : cfg.workers / cfg.tp;
  const int64_t gpu_chunk = world > 1 ? int64_t{2048} * world : 8192;
  so.group.prefill_chunk = cfg.prefill_chunk > 0 ? cfg.prefill_chunk : cuda ? gpu_chunk : 256;
  // Decoding sequences advance one token per step, so while any decode, a step's prefill chunk
  // is smaller: their inter-token time stays near a 2048-token step instead of an 8192-token
  // one (0.7 s late in a 128K prefill on one H200), and the long prefill loses little.
  so.prefill_chunk_decoding = cfg.prefill_chunk_decoding > 0 ? cfg.prefill_chunk_decoding
                              : cuda ? 2048
                                     : so.group.prefill_chunk;
  so.decode_lookahead = cfg.decode_lookahead == 1;
  so.prefix_caching = cfg.prefix_caching == 1;
  // The warm-up: on GPUs a request as long as the longest prompt (at most 128K tokens: beyond,
  // the start would take minutes), on CPUs none unless asked.
  so.warmup_tokens = cfg.warmup_tokens >= 0 ? cfg.warmup_tokens
                     : cuda                  ? std::min<int64_t>(cfg.max_context, 131072)
                                             : 0;
  so.vocab_size = static_cast<int>(model.vocab_size);
  if (kv_from_memory) {
    so.group.kv_memory_fraction = cfg.kv_memory_percent / 100.0;
    so.group.kv_reserve_bytes = kv_activation_reserve(
        model, cfg.max_context, world, so.group.prefill_chunk,
        so.group.attention_dtype == burst::engine::AttentionDtype::kFp8);
  }
  return so;
}

// Multi-node: the registry `burst-worker --join` registers with; the group is theirs.
burst::Result<std::shared_ptr<burst::server::WorkerRegistry>> start_registry(
    const burst::server::ServerConfig& cfg, const burst::models::LlamaConfig& model,
    bool kv_from_memory, burst::server::SchedulerOptions& so) {
  using namespace burst::server;
  RegistryOptions ro;
  ro.listen = cfg.worker_listen;
  ro.world_size = cfg.remote_workers;
  ro.tp = cfg.tp;
  ro.fingerprint = model_fingerprint(model, so.group.model);
  ro.device_kind = is_cuda(cfg) ? "cuda" : "cpu";
  ro.kv_capacity_per_rank =
      kv_from_memory
          ? 0
          : burst::engine::kv_capacity_per_rank(cfg.kv_capacity, cfg.remote_workers / cfg.tp,
                                                so.group.prefill_chunk);
  ro.kv_memory_fraction = so.group.kv_memory_fraction;
  ro.kv_reserve_bytes = so.group.kv_reserve_bytes;
  ro.kv_cache_dtype = so.group.kv_cache_dtype;
  ro.attention_dtype = so.group.attention_dtype;
  ro.comm_timeout = so.group.comm_timeout;
  auto r = WorkerRegistry::start(ro);
  if (!r.ok()) return r.status();
  std::shared_ptr<WorkerRegistry> registry = r.take();
  so.group.workers = cfg.remote_workers;
  so.group.registry = registry;
  spdlog::info("multi-node: waiting for {} `burst-worker --join` on {} (port {}); model [{}]",
               cfg.remote_workers, cfg.worker_listen, registry->port(), ro.fingerprint);
  return registry;
}

void install_signal_handlers() {
  struct sigaction sa = {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client gone mid-write is an error return, not a process kill
}

// Written whole then renamed, so a reader never sees half a file.
bool write_port_file(const std::string& path, int http_port, int grpc_port, int worker_port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << "{\"http_port\": " << http_port << ", \"grpc_port\": " << grpc_port
      << ", \"worker_port\": " << worker_port << ", \"pid\": " << getpid() << "}\n";
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

// What this server serves, in one log line.
void log_serving(const burst::server::ServerConfig& cfg,
                 const burst::server::SchedulerOptions& so, int64_t weight_bytes,
                 bool kv_from_memory, int http_port, int grpc_port, int workers) {
  // A disabled API says so, not "127.0.0.1:-1".
  auto where = [&](int port) {
    return port < 0 ? std::string("off") : cfg.host + ":" + std::to_string(port);
  };
  spdlog::info("serving model '{}' ({}, {:.2f} GB of weights per worker, start timeout {} s): "
               "HTTP {}, gRPC {}, {} worker(s) on {}, max context {}, KV capacity {}, "
               "prompt text limit {} bytes, auth {}",
               cfg.model_name,
               cfg.preset.empty() ? cfg.model
                                  : "preset " + cfg.preset + ", random weights, seed " +
                                        std::to_string(cfg.random_weights),
               static_cast<double>(weight_bytes) / 1e9,
               std::chrono::duration_cast<std::chrono::seconds>(so.group.start_timeout).count(),
               where(http_port), where(grpc_port), workers,
               cfg.device, cfg.max_context,
               kv_from_memory ? "from GPU memory (" + std::to_string(cfg.kv_memory_percent) +
                                    " % of each GPU)"
                              : std::to_string(cfg.kv_capacity) + " tokens",
               cfg.max_prompt_bytes,
               cfg.api_key.empty() ? "off" : "on");
}

// The tokenizer, and the chat template every chat is rendered with: --chat-template FILE, else
// the model's tokenizer_config.json chat_template, else LLaMA-2's compiled in.
burst::Result<std::unique_ptr<burst::server::Tokenizer>> load_tokenizer_and_chat(
    const burst::server::ServerConfig& cfg) {
  using namespace burst::server;
  auto tok = Tokenizer::load(cfg.tokenizer);
  if (!tok.ok()) return burst::Status::error("tokenizer: " + tok.message());
  std::unique_ptr<Tokenizer> tokenizer = tok.take();
  auto chat = !cfg.chat_template.empty()
                  ? ChatTemplate::from_file(cfg.chat_template, *tokenizer)
                  : ChatTemplate::for_model(cfg.preset.empty() ? cfg.model : "", *tokenizer);
  if (!chat.ok()) return burst::Status::error("chat template: " + chat.message());
  spdlog::info("chat template: {}", chat.value().origin());
  set_chat_template(std::make_shared<const ChatTemplate>(chat.take()));
  return tokenizer;
}

// The APIs the config enables, started: their ports into *http_port and *grpc_port (-1 for one
// disabled), or why one did not start.
burst::Status start_apis(const burst::server::ServerConfig& cfg,
                         burst::server::Scheduler& scheduler, burst::server::Tokenizer& tokenizer,
                         burst::server::Metrics& metrics,
                         std::optional<burst::server::HttpApi>& http,
                         std::optional<burst::server::GrpcApi>& grpc_api, int* http_port,
                         int* grpc_port) {
  if (!cfg.allowed_origins.empty()) {
    spdlog::info("CORS: origins {}, methods {}, headers {}", cfg.allowed_origins,
                 cfg.allowed_methods, cfg.allowed_headers);
  }
  if (cfg.http_port >= 0) {
    http.emplace(cfg, scheduler, tokenizer, metrics);
    auto p = http->start();
    if (!p.ok()) return p.status();
    *http_port = p.value();
  }
  if (cfg.grpc_port >= 0) {
    grpc_api.emplace(cfg, scheduler, tokenizer);
    auto p = grpc_api->start();
    if (!p.ok()) return p.status();
    *grpc_port = p.value();
  }
  return {};
}

// Serves until SIGTERM or SIGINT, then drains the requests in flight (drain_ms at most) and
// stops the APIs; or, when the scheduler gives up on the workers, stops at once. The exit code.
int serve_until_signal(burst::server::Scheduler& scheduler,
                       std::optional<burst::server::HttpApi>& http,
                       std::optional<burst::server::GrpcApi>& grpc_api, int drain_ms) {
  while (g_signal == 0 && scheduler.gave_up().empty()) usleep(50 * 1000);
  if (const std::string why = scheduler.gave_up(); !why.empty()) {
    // The workers fail to start the same way each time: exit saying why, not restart forever.
    if (grpc_api) grpc_api->stop();
    if (http) http->stop();
    return fail(why);
  }
  spdlog::info("signal {}: draining", static_cast<int>(g_signal));
  scheduler.drain(std::chrono::milliseconds(drain_ms));
  // The streams have their final events queued; give the API threads a moment to write them
  // before the listeners close.
  usleep(300 * 1000);
  if (grpc_api) grpc_api->stop();
  if (http) http->stop();
  spdlog::info("stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace burst;
  using namespace burst::server;
  // First, before any thread exists (the arena bound applies to threads created after it).
  HeapKeeper heap;
  (void)setup_logging("burst-server", "info", "text");
  auto flags = parse_flags(argc, argv);
  if (const int* code = std::get_if<int>(&flags)) return *code;
  ServerConfig cfg = std::get<ServerConfig>(std::move(flags));
  spdlog::info("{}", version_string("burst-server"));
  spdlog::info("config file: {}", cfg.config_file.empty() ? "none (defaults and flags)"
                                                          : cfg.config_file);
  raise_open_files_limit();

  // A preset (random weights, for benchmarks) takes the place of the model directory.
  auto model_cfg = cfg.preset.empty() ? models::load_config(cfg.model)
                                      : models::preset_config(cfg.preset);
  if (!model_cfg.ok()) return fail(model_cfg.message());
  auto tok = load_tokenizer_and_chat(cfg);
  if (!tok.ok()) return fail(tok.message());
  std::unique_ptr<Tokenizer> tokenizer = tok.take();
  const bool kv_from_memory = resolve_limits(cfg, model_cfg.value(), *tokenizer);
  // A layout the model cannot take is refused before any worker starts or reads a weight.
  if (std::string e = models::tensor_parallel_error(model_cfg.value(), cfg.tp); !e.empty()) {
    return fail(e);
  }
  // Every rank holds its tensor-parallel share of the model (the ring shards by sequence) in
  // the backend's compute dtype.
  const int64_t weight_bytes = models::model_weight_bytes(
      model_cfg.value(), is_cuda(cfg) ? engine::DType::kBF16 : engine::DType::kF32, cfg.tp);
  SchedulerOptions so = scheduler_options(cfg, model_cfg.value(), kv_from_memory, weight_bytes);
  std::shared_ptr<WorkerRegistry> registry;  // multi-node: outlives the scheduler's group
  if (cfg.remote_workers > 0) {
    if (const std::string why = cluster_token_missing(cfg); !why.empty()) {
      spdlog::error("{}", why);
      return 2;
    }
    auto r = start_registry(cfg, model_cfg.value(), kv_from_memory, so);
    if (!r.ok()) return fail(r.message());
    registry = r.take();
  }

  install_signal_handlers();
  // Request bodies of megabytes come and go on many connection threads. glibc raises its mmap
  // threshold after the first large free, and from then on keeps such buffers in per-thread
  // arenas: five refused 8 MB prompts left 140 MB resident. A fixed threshold keeps every
  // allocation of 1 MiB or more mmapped, so it goes back to the system when freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);

  Metrics metrics;
  metrics.model_name = cfg.model_name;
  Scheduler scheduler(so, *tokenizer, metrics);
  std::optional<HttpApi> http;
  std::optional<GrpcApi> grpc_api;
  int http_port = -1, grpc_port = -1;
  if (const Status st = start_apis(cfg, scheduler, *tokenizer, metrics, http, grpc_api,
                                   &http_port, &grpc_port);
      !st.ok()) {
    return fail(st.message());
  }
  log_serving(cfg, so, weight_bytes, kv_from_memory, http_port, grpc_port,
              registry ? cfg.remote_workers : cfg.workers);
  if (!cfg.port_file.empty() &&
      !write_port_file(cfg.port_file, http_port, grpc_port, registry ? registry->port() : -1)) {
    return fail("cannot write the port file " + cfg.port_file);
  }

  return serve_until_signal(scheduler, http, grpc_api, cfg.drain_timeout_ms);
}
