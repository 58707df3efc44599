#include "frontend/server_config.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/cli.h"
#include "engine/kv_pages.h"
#include "engine/sharding.h"
#include "group/worker_registry.h"

namespace burst::server {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One table drives the JSON keys, the flags (the key with '-' for '_') and --help, so the three
// can never disagree: a new setting is a member of ServerConfig and one row here.
struct Field {
  enum class Kind { kString, kInt, kInt64, kPath };
  const char* key;
  Kind kind;
  void* target;
  const char* metavar;  // the value's name in --help; nullptr: a flag without a value (sets 1)
  const char* help;
};

// The model, its workers and how they split it.
std::vector<Field> model_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"model", K::kPath, &c->model, "DIR",
       "a Hugging Face LLaMA directory (config.json, *.safetensors)"},
      {"preset", K::kString, &c->preset, "NAME",
       "random weights of a LLaMA-2 shape (1b, 7b, 13b, 70b; no model directory); the tokenizer "
       "is --tokenizer FILE or the data directory's models/kjv-tiny/tokenizer.model"},
      {"random_weights", K::kInt64, &c->random_weights, "SEED", "the preset's weights' seed"},
      {"tokenizer", K::kPath, &c->tokenizer, "FILE",
       "tokenizer.model (default: MODEL/tokenizer.model)"},
      {"chat_template", K::kPath, &c->chat_template, "FILE",
       "the chat template, Jinja (or a tokenizer_config.json with one; default: the model's "
       "tokenizer_config.json chat_template, else LLaMA-2's)"},
      {"model_name", K::kString, &c->model_name, "NAME",
       "the name clients use (default: the model directory's name)"},
      {"device", K::kString, &c->device, "D", "cpu (default) or cuda"},
      {"workers", K::kInt, &c->workers, "N",
       "burst-worker processes (default 2): tp x the ring's ranks"},
      {"tp", K::kInt, &c->tp, "T",
       "tensor parallelism (default 1): each T consecutive workers split every layer's weights "
       "(Megatron), the BurstAttention ring joins the groups"},
      {"threads_per_worker", K::kInt, &c->threads_per_worker, "N",
       "threads per CPU worker (0: cores / workers)"},
      {"layout", K::kString, &c->layout, "L",
       "sequence sharding: striped (default; prefix caching needs it), zigzag or contiguous"},
  };
}

// Where the APIs listen, who may call them, and how remote workers join.
std::vector<Field> access_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"host", K::kString, &c->host, "ADDR",
       "the address HTTP and gRPC bind (default 127.0.0.1)"},
      {"grpc_port", K::kInt, &c->grpc_port, "P",
       "the gRPC port (default 50051); 0 picks a free port, -1 disables gRPC"},
      {"http_port", K::kInt, &c->http_port, "P",
       "the HTTP port (default 8080); 0 picks a free port, -1 disables HTTP"},
      {"port_file", K::kString, &c->port_file, "FILE",
       "write {\"http_port\": N, \"grpc_port\": M, \"worker_port\": W} once bound"},
      {"api_key", K::kString, &c->api_key, "KEY",
       "require \"Authorization: Bearer KEY\" (HTTP) / authorization metadata (gRPC); also "
       "$BURST_API_KEY (a flag's value shows in ps: prefer the file or the environment)"},
      {"api_key_file", K::kPath, &c->api_key_file, "F",
       "the API key from file F (surrounding whitespace removed)"},
      {"metrics_require_key", K::kInt, &c->metrics_require_key, "0|1",
       "1: /metrics requires the API key too (401 without); 0 (default): /metrics, like "
       "/health, /ping, gRPC Health and reflection, answers without"},
      {"remote_workers", K::kInt, &c->remote_workers, "N",
       "multi-node: spawn no worker; wait for N `burst-worker --join HOST:PORT` (same model as "
       "the server) to register, then serve. Until they have, /health answers 503: waiting for "
       "workers (k/N registered)"},
      {"worker_listen", K::kString, &c->worker_listen, "HOST:PORT",
       "where remote workers register and rendezvous (default 0.0.0.0:50052; port 0: any free "
       "port). Workers must present the cluster token ($BURST_CLUSTER_TOKEN, or a file named by "
       "$BURST_CLUSTER_TOKEN_FILE) on every call"},
      {"insecure_cluster", K::kInt, &c->insecure_cluster, nullptr,
       "with --remote-workers: start without a cluster token, so that any host that reaches "
       "--worker-listen can join the group and drive the workers (without this flag such a "
       "server refuses to start; config key: 1)"},
  };
}

// Context, KV cache, scheduling and prefill: what the engine holds and runs.
std::vector<Field> engine_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"max_context", K::kInt64, &c->max_context, "N",
       "longest prompt (0: the model's max_position_embeddings)"},
      {"kv_capacity", K::kInt64, &c->kv_capacity, "N",
       "KV tokens of the group, shared by all requests (0: on GPUs this server spawns, what "
       "--kv-memory-percent of each GPU holds beside the weights and activations; otherwise the "
       "max context)"},
      {"kv_memory_percent", K::kInt, &c->kv_memory_percent, "P",
       "with --kv-capacity 0 on GPUs: the share of each GPU to fill (90)"},
      {"max_tokens_limit", K::kInt, &c->max_tokens_limit, "N",
       "largest max_tokens accepted (0: the KV capacity)"},
      {"max_queue", K::kInt, &c->max_queue, "N",
       "waiting requests beyond which new ones get 503 (default 64)"},
      {"max_running", K::kInt, &c->max_running, "N", "sequences batched at once (default 64)"},
      {"max_batched_tokens", K::kInt64, &c->max_batched_tokens, "T",
       "tokens per engine step (0: chunk + max(max-running, chunk / 4))"},
      {"prefill_chunk", K::kInt64, &c->prefill_chunk, "T",
       "prompt tokens per prefill chunk (0: 256 on CPU; on CUDA 8192 with one worker, 2048 x "
       "workers with more)"},
      {"prefill_chunk_decoding", K::kInt64, &c->prefill_chunk_decoding, "T",
       "the chunk while other sequences decode, which bounds their inter-token time (0: 2048 on "
       "CUDA, --prefill-chunk on CPU)"},
      {"decode_lookahead", K::kInt, &c->decode_lookahead, "0|1",
       "1 (default): while every running sequence decodes, send the next decode step before the "
       "current one's tokens come back, so the workers start it at once (a sequence that ends "
       "meanwhile costs one wasted row); 0: one step at a time"},
      {"prefix_caching", K::kInt, &c->prefix_caching, "0|1",
       "1 (default): a prompt that starts with blocks of tokens computed before (ring ranks x "
       "the KV page size tokens each, of a finished or a running request, its answer included) "
       "reuses their KV pages on every rank and prefills only the rest; unused blocks are "
       "evicted least recently used first when pages run out. Needs the striped layout. "
       "--no-prefix-caching: 0"},
      {"kv_cache_dtype", K::kString, &c->kv_cache_dtype, "D",
       "what the KV cache holds: auto (default: the compute dtype, bf16 on GPUs, fp32 on CPUs) "
       "or fp8 (fp8_e4m3: e4m3 with a scale per token and KV head, about half the bytes of "
       "bf16, so about twice the tokens; the ring passes FP8 blocks, decode reads FP8). "
       "Accuracy: README"},
      {"attention_dtype", K::kString, &c->attention_dtype, "D",
       "prefill attention's products: auto (default; bf16 is the same: the compute dtype) or "
       "fp8 (q, k, v and P in e4m3 with block scales and a Hadamard rotation of q and k: the "
       "Hopper FP8 kernel, head_dim 128 or 64; CPU workers emulate it). Accuracy and speed: "
       "README"},
      {"warmup_tokens", K::kInt64, &c->warmup_tokens, "N",
       "before the workers serve (at start and after a restart), one request of N tokens runs "
       "through them, so that the first request is as fast as the next (-1, the default: the "
       "max context, at most 131072, on GPUs; none on CPUs)"},
  };
}

// HTTP: request and response sizes, connections, timeouts, CORS.
std::vector<Field> http_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"max_body_bytes", K::kInt64, &c->max_body_bytes, "B",
       "largest HTTP request body (default 8 MiB)"},
      {"max_prompt_bytes", K::kInt64, &c->max_prompt_bytes, "B",
       "prompt text (bytes) refused with 413 / RESOURCE_EXHAUSTED before it is tokenized (0, "
       "the default: max context x the longest token's text, the most text that can fit the "
       "context)"},
      {"max_response_bytes", K::kInt64, &c->max_response_bytes, "B",
       "an HTTP completion whose response could grow past B bytes (prompts x sequences x "
       "echoed prompt and max_tokens, x logprobs) is refused with 400 before it runs (default "
       "32 MiB; 0: no limit)"},
      {"http_backlog", K::kInt, &c->http_backlog, "N",
       "listen backlog of the HTTP socket (default 1024; capped by the kernel's "
       "net.core.somaxconn)"},
      {"http_max_connections", K::kInt, &c->http_max_connections, "N",
       "open HTTP connections at most; more get 503 at once (default 512)"},
      {"http_max_connections_per_client", K::kInt, &c->http_max_connections_per_client, "N",
       "open HTTP connections from one address at most (default 256; 0: no limit; behind a "
       "proxy every client is the proxy). At either limit the connection idle longest between "
       "requests is closed to make room; only when none idles does the newcomer get 503"},
      {"http_header_timeout_ms", K::kInt, &c->http_header_timeout_ms, "MS",
       "a request's head must arrive within this (from its first byte; from the accept for a "
       "connection's first request), else 408 (default 10000)"},
      {"http_body_timeout_ms", K::kInt, &c->http_body_timeout_ms, "MS",
       "its body within this after the head, else 408 (default 30000)"},
      {"allowed_origins", K::kString, &c->allowed_origins, "LIST",
       "CORS: origins browsers may call the HTTP API from, comma-separated or a JSON array "
       "(vLLM's form), e.g. https://app.example.com; * for any. Default: none (CORS off: no "
       "preflight answered, no CORS header sent)"},
      {"allowed_methods", K::kString, &c->allowed_methods, "LIST",
       "CORS: methods a preflight may ask for (default *)"},
      {"allowed_headers", K::kString, &c->allowed_headers, "LIST",
       "CORS: request headers a preflight may ask for (default *: whatever is asked, "
       "Authorization included)"},
      {"allow_credentials", K::kInt, &c->allow_credentials, nullptr,
       "CORS: answer Access-Control-Allow-Credentials: true, so that pages may send cookies and "
       "HTTP authentication; the allowed origin is then echoed, never * (config key: 1)"},
  };
}

// gRPC: threads, calls per client, timeouts and connection lifetimes.
std::vector<Field> grpc_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"grpc_max_threads", K::kInt, &c->grpc_max_threads, "N",
       "gRPC server threads at most (default 256); a call holds one while it runs, calls beyond "
       "get RESOURCE_EXHAUSTED at once"},
      {"grpc_max_calls_per_client", K::kInt, &c->grpc_max_calls_per_client, "N",
       "Burst calls (Generate, Chat, Tokenize, ModelInfo) one client address runs at once at "
       "most (default 128; 0: no limit; behind a proxy every client is the proxy); more get "
       "RESOURCE_EXHAUSTED at once. gRPC has no per-client connection cap"},
      {"grpc_message_timeout_ms", K::kInt, &c->grpc_message_timeout_ms, "MS",
       "a call's request message must arrive within this after the call starts, else the call "
       "is cancelled (default 30000)"},
      {"grpc_handshake_timeout_ms", K::kInt, &c->grpc_handshake_timeout_ms, "MS",
       "a new connection must complete its HTTP/2 handshake within this, else it is closed "
       "(default 10000)"},
      {"grpc_max_connection_idle_ms", K::kInt, &c->grpc_max_connection_idle_ms, "MS",
       "a connection without calls for this long is closed (a GOAWAY; clients reconnect when "
       "they next call) (default 300000)"},
      {"grpc_max_connection_age_ms", K::kInt, &c->grpc_max_connection_age_ms, "MS",
       "a connection older than this is asked to go away; its calls get --drain-timeout-ms to "
       "finish (default 0: no limit)"},
      {"grpc_keepalive_ms", K::kInt, &c->grpc_keepalive_ms, "MS",
       "the server pings a connection silent for this long and closes it if the ping is not "
       "answered within 20 s (default 60000)"},
  };
}

// Keep-alive, drain and start timeouts, and logging.
std::vector<Field> lifecycle_fields(ServerConfig* c) {
  using K = Field::Kind;
  return {
      {"keepalive_ms", K::kInt, &c->keepalive_ms, "MS",
       "SSE keep-alive comment interval while no token is ready (default 5000)"},
      {"drain_timeout_ms", K::kInt, &c->drain_timeout_ms, "MS",
       "SIGTERM: how long requests in flight may finish (default 30000)"},
      {"start_timeout_ms", K::kInt, &c->start_timeout_ms, "MS",
       "how long the worker group may take to start, loading the weights included (0, the "
       "default: 120 s + 30 s per GB of weights per worker; kjv-tiny 120 s, 7b on GPUs 524 s); "
       "progress is logged every 5 s and shown on /health"},
      {"log_level", K::kString, &c->log_level, "LEVEL",
       "trace, debug, info (default), warn, error, critical or off"},
      {"log_format", K::kString, &c->log_format, "F",
       "text (default) or json (one object per line); logs go to stderr, with one access-log "
       "line per HTTP request (status, route, latency, request id)"},
  };
}

// Every setting, in --help's order: the tables above, one after another.
std::vector<Field> fields(ServerConfig* c) {
  std::vector<Field> all;
  for (auto* part : {model_fields, access_fields, engine_fields, http_fields, grpc_fields,
                     lifecycle_fields}) {
    std::vector<Field> rows = part(c);
    all.insert(all.end(), rows.begin(), rows.end());
  }
  return all;
}

const Field* find_field(const std::vector<Field>& table, const std::string& key) {
  for (const Field& f : table) {
    if (key == f.key) return &f;
  }
  return nullptr;
}

// "max_queue" -> "--max-queue".
std::string flag_of(const std::string& key) {
  std::string flag = "--" + key;
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

constexpr const char* kSynopsis =
    R"(usage: burst-server [--config FILE] [--model DIR | --preset 1b|7b|13b|70b --random-weights SEED]
                    [--FLAG VALUE | --FLAG=VALUE ...] [--check-config] [--version] [--help]

Every setting is a flag below and a key of the JSON config file (--config FILE: keys as the
flags, with '_' for '-'); flags override the file. Without --config: the data directory's
configs/cpu-tiny.json (the tiny model on 2 CPU workers). Usage errors exit 2.
)";

// The settings given as flags, by config key; what --config, --data-dir and the actions ask.
struct Flags {
  std::map<std::string, std::string> values;
  std::string config_path, data_dir;
  bool no_prefix_caching = false;
};

// An App that knows every flag; parsing fills *flags (values stay text until the config file is
// read, so a flag overrides the file whatever their order on the command line).
std::unique_ptr<CLI::App> server_cli(Flags* flags, ServerActions* actions) {
  auto app = make_cli("burst-server", kSynopsis);
  app->add_option("--config", flags->config_path,
                  "JSON config (keys as the flags, with '_' for '-'); flags override it. Without "
                  "it: the data directory's configs/cpu-tiny.json (tiny model, 2 CPU workers)")
      ->type_name("FILE");
  app->add_option("--data-dir", flags->data_dir,
                  "the shipped configs/ and models/ (else $BURST_DATA_DIR, else "
                  "<exe>/../share/burst, else the source tree or install prefix built in)")
      ->type_name("DIR");
  app->add_flag("--check-config", actions->check_config,
                "validate the config and flags, print the resolved settings as JSON and exit "
                "(0: valid, 2: not); model files are checked only where present");
  app->add_flag("--version", actions->version, "print the version and build, then exit");
  ServerConfig scratch;
  for (const Field& f : fields(&scratch)) {
    const std::string key = f.key;
    if (f.metavar == nullptr) {
      app->add_flag_callback(flag_of(key), [flags, key] { flags->values[key] = "1"; }, f.help);
      continue;
    }
    app->add_option_function<std::string>(
           flag_of(key), [flags, key](const std::string& v) { flags->values[key] = v; }, f.help)
        ->type_name(f.metavar);
  }
  app->add_flag("--no-prefix-caching", flags->no_prefix_caching,
                "vLLM's spelling of --prefix-caching 0");
  return app;
}

// A relative path from a config file: as given if it exists from here, else from the config
// file's parent directory (configs/x.json -> the repository root).
std::string resolve(const std::string& p, const fs::path& config_path) {
  if (p.empty() || fs::path(p).is_absolute() || fs::exists(p)) return p;
  const fs::path alt = fs::absolute(config_path).parent_path().parent_path() / p;
  return fs::exists(alt) ? alt.lexically_normal().string() : p;
}

Status set_from_string(const std::string& flag, const Field& f, const std::string& text) {
  try {
    size_t used = 0;
    switch (f.kind) {
      case Field::Kind::kString:
      case Field::Kind::kPath:
        *static_cast<std::string*>(f.target) = text;
        return {};
      case Field::Kind::kInt:
        *static_cast<int*>(f.target) = std::stoi(text, &used);
        break;
      case Field::Kind::kInt64:
        *static_cast<int64_t*>(f.target) = std::stoll(text, &used);
        break;
    }
    if (used != text.size()) return Status::error("bad value '" + text + "' for " + flag);
  } catch (const std::exception&) {
    return Status::error("bad value '" + text + "' for " + flag);
  }
  return {};
}

// A 0|1 setting.
Status check_switch(const char* key, int value) {
  if (value != 0 && value != 1) return Status::error(std::string(key) + " must be 0 or 1");
  return {};
}

// Request and response sizes, the SSE keep-alive, HTTP connections and the CORS lists.
Status check_http_limits(const ServerConfig& c) {
  if (c.max_body_bytes < 1024) return Status::error("max_body_bytes must be >= 1024");
  if (c.keepalive_ms < 10) return Status::error("keepalive_ms must be >= 10");
  if (c.max_prompt_bytes < 0) return Status::error("max_prompt_bytes must be >= 0");
  if (c.max_response_bytes < 0) {
    return Status::error("max_response_bytes must be >= 0 (0: no limit)");
  }
  if (c.http_backlog < 1) return Status::error("http_backlog must be >= 1");
  if (c.http_max_connections < 1) return Status::error("http_max_connections must be >= 1");
  if (c.http_max_connections_per_client < 0) {
    return Status::error("http_max_connections_per_client must be >= 0 (0: no limit)");
  }
  for (const auto& [key, text] : {std::pair<std::string, const std::string*>{
                                      "allowed_origins", &c.allowed_origins},
                                  {"allowed_methods", &c.allowed_methods},
                                  {"allowed_headers", &c.allowed_headers}}) {
    auto list = parse_cors_list(*text, key);
    if (!list.ok()) return list.status();
  }
  return {};
}

// gRPC threads, calls per client, timeouts and connection age.
Status check_grpc_limits(const ServerConfig& c) {
  // gRPC's sync server keeps up to 2 threads polling for calls besides those running calls.
  if (c.grpc_max_threads < 4) return Status::error("grpc_max_threads must be >= 4");
  if (c.grpc_max_calls_per_client < 0) {
    return Status::error("grpc_max_calls_per_client must be >= 0 (0: no limit)");
  }
  for (const auto& [key, ms] : {std::pair<const char*, int>{"grpc_message_timeout_ms",
                                                            c.grpc_message_timeout_ms},
                                {"grpc_handshake_timeout_ms", c.grpc_handshake_timeout_ms},
                                {"grpc_max_connection_idle_ms", c.grpc_max_connection_idle_ms},
                                {"grpc_keepalive_ms", c.grpc_keepalive_ms}}) {
    if (ms < 10) return Status::error(std::string(key) + " must be >= 10");
  }
  if (c.grpc_max_connection_age_ms < 0) {
    return Status::error("grpc_max_connection_age_ms must be >= 0 (0: no limit)");
  }
  return {};
}

Status validate(const ServerConfig& c) {
  if (c.model.empty() && c.preset.empty()) {
    return Status::error("no model (set \"model\" or --model, or --preset)");
  }
  if (c.workers < 1 || c.workers > 64) return Status::error("workers must be in 1..64");
  if (c.tp < 1 || c.tp > 8) {
    return Status::error("tp must be in 1..8 (a tensor-parallel group lies on one node's GPUs)");
  }
  if (const int n = c.remote_workers > 0 ? c.remote_workers : c.workers; n % c.tp != 0) {
    return Status::error("tp " + std::to_string(c.tp) + " does not divide the " +
                         std::to_string(n) + " workers (workers = tp x the ring's ranks)");
  }
  if (auto kv = engine::parse_kv_cache_dtype(c.kv_cache_dtype); !kv.ok()) return kv.status();
  if (auto at = engine::parse_attention_dtype(c.attention_dtype); !at.ok()) return at.status();
  engine::ShardLayout layout;
  if (!engine::parse_shard_layout(c.layout, &layout)) {
    return Status::error("layout must be striped, zigzag or contiguous, got \"" + c.layout +
                         "\"");
  }
  for (int p : {c.grpc_port, c.http_port}) {
    if (p < -1 || p > 65535) return Status::error("ports must be in -1..65535");
  }
  if (c.grpc_port == -1 && c.http_port == -1) return Status::error("both APIs are disabled");
  if (c.max_queue < 0) return Status::error("max_queue must be >= 0");
  if (c.max_running < 1) return Status::error("max_running must be >= 1");
  if (c.max_batched_tokens < 0) return Status::error("max_batched_tokens must be >= 0");
  if (c.prefill_chunk < 0) return Status::error("prefill_chunk must be >= 0");
  if (c.prefill_chunk_decoding < 0) return Status::error("prefill_chunk_decoding must be >= 0");
  BURST_RETURN_IF_ERROR(check_switch("insecure_cluster", c.insecure_cluster));
  BURST_RETURN_IF_ERROR(check_switch("metrics_require_key", c.metrics_require_key));
  BURST_RETURN_IF_ERROR(check_switch("allow_credentials", c.allow_credentials));
  if (c.warmup_tokens < -1) return Status::error("warmup_tokens must be >= -1 (-1: the default)");
  BURST_RETURN_IF_ERROR(check_switch("prefix_caching", c.prefix_caching));
  BURST_RETURN_IF_ERROR(check_switch("decode_lookahead", c.decode_lookahead));
  if (c.kv_memory_percent < 1 || c.kv_memory_percent > 100) {
    return Status::error("kv_memory_percent must be in 1..100");
  }
  BURST_RETURN_IF_ERROR(check_http_limits(c));
  BURST_RETURN_IF_ERROR(check_grpc_limits(c));
  if (c.http_header_timeout_ms < 10 || c.http_body_timeout_ms < 10) {
    return Status::error("http_header_timeout_ms and http_body_timeout_ms must be >= 10");
  }
  if (c.drain_timeout_ms < 0) return Status::error("drain_timeout_ms must be >= 0");
  if (c.start_timeout_ms < 0) {
    return Status::error("start_timeout_ms must be >= 0 (0: scaled to the model's size)");
  }
  if (c.remote_workers < 0 || c.remote_workers > 64) {
    return Status::error("remote_workers must be in 0..64");
  }
  if (c.remote_workers > 0) {
    auto hp = split_host_port(c.worker_listen);
    if (!hp.ok()) return Status::error("worker_listen: " + hp.message());
  }
  if (c.log_format != "text" && c.log_format != "json") {
    return Status::error("log_format must be text or json");
  }
  for (const char* l : {"trace", "debug", "info", "warn", "error", "critical", "off"}) {
    if (c.log_level == l) break;
    if (std::string(l) == "off") {
      return Status::error("log_level must be trace, debug, info, warn, error, critical or off");
    }
  }
  if (c.max_context < 0 || c.kv_capacity < 0 || c.max_tokens_limit < 0) {
    return Status::error("max_context, kv_capacity and max_tokens_limit must be >= 0");
  }
  return {};
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) ||
           std::strchr("!#$%&'*+-.^_`|~", ch) != nullptr;
  });
}

// SCHEME://HOST[:PORT], as a browser writes an Origin header (no path, no trailing slash).
bool is_origin(std::string_view s) {
  const size_t sep = s.find("://");
  if (sep == std::string_view::npos || sep == 0) return false;
  const std::string_view scheme = s.substr(0, sep), rest = s.substr(sep + 3);
  auto ok = [](std::string_view part, const char* extra) {
    return !part.empty() && std::all_of(part.begin(), part.end(), [&](char ch) {
      return std::isalnum(static_cast<unsigned char>(ch)) || std::strchr(extra, ch) != nullptr;
    });
  };
  return ok(scheme, "+-.") && ok(rest, "-.:[]");
}

}  // namespace

Result<std::vector<std::string>> parse_cors_list(const std::string& text,
                                                 const std::string& key) {
  std::vector<std::string> items;
  const size_t first = text.find_first_not_of(" \t");
  if (first != std::string::npos && text[first] == '[') {
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_array()) {
      return Status::error(key + ": not a JSON array of strings: " + text);
    }
    for (const auto& e : j) {
      if (!e.is_string()) return Status::error(key + ": not a JSON array of strings: " + text);
      items.push_back(e.get<std::string>());
    }
  } else {
    for (size_t pos = 0; pos <= text.size();) {
      const size_t comma = std::min(text.find(',', pos), text.size());
      items.push_back(text.substr(pos, comma - pos));
      pos = comma + 1;
    }
  }
  std::vector<std::string> out;
  for (std::string& item : items) {
    const size_t b = item.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    item = item.substr(b, item.find_last_not_of(" \t") - b + 1);
    if (key == "allowed_origins" && item.size() > 1 && item.back() == '/') item.pop_back();
    const bool valid = item == "*" || (key == "allowed_origins" ? item == "null" || is_origin(item)
                                                                : is_token(item));
    if (!valid) {
      return Status::error(key + ": \"" + item + "\" is not " +
                           (key == "allowed_origins" ? "an origin (SCHEME://HOST[:PORT], or *)"
                                                     : "a name (or *)"));
    }
    out.push_back(item);
  }
  return out;
}

Status apply_config_file(const std::string& path, ServerConfig* config) {
  std::ifstream f(path);
  if (!f) return Status::error("cannot read config file " + path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    return Status::error(path + ": " + e.what());
  }
  if (!j.is_object()) return Status::error(path + ": the config must be a JSON object");
  const auto table = fields(config);
  for (const auto& [key, value] : j.items()) {
    const Field* found = find_field(table, key);
    if (found == nullptr) return Status::error(path + ": unknown key \"" + key + "\"");
    const Field& fd = *found;
    const bool want_string = fd.kind == Field::Kind::kString || fd.kind == Field::Kind::kPath;
    if (want_string ? !value.is_string() : !value.is_number_integer()) {
      return Status::error(path + ": \"" + key + "\" must be " +
                           (want_string ? "a string" : "an integer"));
    }
    if (want_string) {
      std::string s = value.get<std::string>();
      if (fd.kind == Field::Kind::kPath) s = resolve(s, path);
      *static_cast<std::string*>(fd.target) = s;
    } else if (fd.kind == Field::Kind::kInt) {
      *static_cast<int*>(fd.target) = value.get<int>();
    } else {
      *static_cast<int64_t*>(fd.target) = value.get<int64_t>();
    }
  }
  return {};
}

Result<std::string> find_data_dir(const std::string& explicit_dir, const fs::path& exe,
                                  std::vector<std::string>* looked) {
  auto tried = [&](const fs::path& p) {
    if (looked) looked->push_back(p.string());
  };
  // An explicit choice is taken as given (or refused), never silently replaced by another.
  const char* env = std::getenv("BURST_DATA_DIR");
  const std::pair<const char*, std::string> explicit_choices[] = {
      {"--data-dir", explicit_dir}, {"BURST_DATA_DIR", env != nullptr ? env : ""}};
  for (const auto& [what, dir] : explicit_choices) {
    if (dir.empty()) continue;
    tried(dir);
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      return Status::error(std::string(what) + ": " + dir + " is not a directory");
    }
    return fs::absolute(dir).lexically_normal().string();
  }
  std::vector<fs::path> candidates;
  if (!exe.empty()) candidates.push_back(exe.parent_path().parent_path() / "share" / "burst");
#ifdef BURST_SOURCE_DATA_DIR
  candidates.emplace_back(BURST_SOURCE_DATA_DIR);
#endif
#ifdef BURST_INSTALL_DATA_DIR
  candidates.emplace_back(BURST_INSTALL_DATA_DIR);
#endif
  for (const auto& dir : candidates) {
    if (dir.empty()) continue;
    tried(dir);
    std::error_code ec;
    if (fs::exists(dir / "configs" / "cpu-tiny.json", ec)) return dir.lexically_normal().string();
  }
  return std::string();
}

std::string config_to_json(const ServerConfig& config) {
  ServerConfig copy = config;
  json j = json::object();
  for (const Field& f : fields(&copy)) {
    const std::string key = f.key;
    switch (f.kind) {
      case Field::Kind::kString:
      case Field::Kind::kPath:
        j[key] = *static_cast<std::string*>(f.target);
        break;
      case Field::Kind::kInt:
        j[key] = *static_cast<int*>(f.target);
        break;
      case Field::Kind::kInt64:
        j[key] = *static_cast<int64_t*>(f.target);
        break;
    }
  }
  if (!config.api_key.empty()) j["api_key"] = "(set)";
  return j.dump(2);
}

// --api-key-file (or "api_key_file") read into api_key; else $BURST_API_KEY when no key is set.
Status resolve_api_key(ServerConfig& c) {
  if (!c.api_key_file.empty()) {
    if (!c.api_key.empty()) {
      return Status::error("give the API key once: --api-key (or \"api_key\") or --api-key-file "
                           "(or \"api_key_file\"), not both");
    }
    auto key = read_token_file(c.api_key_file);
    if (!key.ok()) return Status::error("--api-key-file: " + key.message());
    c.api_key = key.value();
  }
  if (c.api_key.empty()) {
    if (const char* env = std::getenv("BURST_API_KEY")) c.api_key = env;
  }
  return {};
}

// A preset needs no model directory: its tokenizer is the model directory's when a config also
// names one that has it, else the shipped LLaMA-2 tokenizer.
Status resolve_preset_tokenizer(ServerConfig& c) {
  std::error_code ec;
  if (c.tokenizer.empty() && !c.preset.empty()) {
    const fs::path from_model = c.model.empty() ? fs::path() : fs::path(c.model) / "tokenizer.model";
    const fs::path shipped = c.data_dir.empty() ? fs::path()
                                                : fs::path(c.data_dir) / "models" / "kjv-tiny" /
                                                      "tokenizer.model";
    if (!from_model.empty() && fs::exists(from_model, ec)) {
      c.tokenizer = from_model.string();
    } else if (!shipped.empty() && fs::exists(shipped, ec)) {
      c.tokenizer = shipped.string();
    } else {
      return Status::error("no tokenizer for --preset " + c.preset +
                           ": set --tokenizer FILE (a LLaMA-2 tokenizer.model), or the data "
                           "directory (--data-dir DIR or BURST_DATA_DIR) that ships "
                           "models/kjv-tiny/tokenizer.model");
    }
  }
  return {};
}

std::string server_help() {
  Flags flags;
  ServerActions actions;
  return server_cli(&flags, &actions)->help();
}

Result<ServerConfig> parse_server_args(int argc, char** argv, bool* help) {
  ServerActions actions;
  auto c = parse_server_args(argc, argv, &actions);
  *help = actions.help;
  return c;
}

Result<ServerConfig> parse_server_args(int argc, char** argv, ServerActions* actions) {
  *actions = ServerActions();
  ServerConfig c;
  Flags flags;
  auto app = server_cli(&flags, actions);
  const std::string error = parse_cli(*app, argc, argv, &actions->help);
  if (actions->help) return c;
  if (error == "unknown flag --join") {
    return Status::error("unknown flag --join: it is burst-worker's (burst-worker --join "
                         "HOST:PORT); the server waits for such workers with "
                         "--remote-workers N --worker-listen HOST:PORT");
  }
  if (!error.empty()) return Status::error(error);
  if (actions->version) return c;
  std::string config_path = flags.config_path;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  std::vector<std::string> looked;
  auto data_dir = find_data_dir(flags.data_dir, ec ? fs::path() : self, &looked);
  if (!data_dir.ok()) return data_dir.status();
  c.data_dir = data_dir.value();
  // The embedded default: the data directory's configs/cpu-tiny.json.
  if (config_path.empty() && !c.data_dir.empty()) {
    const fs::path embedded = fs::path(c.data_dir) / "configs" / "cpu-tiny.json";
    if (fs::exists(embedded, ec)) config_path = embedded.string();
  }
  if (!config_path.empty()) {
    BURST_RETURN_IF_ERROR(apply_config_file(config_path, &c));
    c.config_file = fs::absolute(config_path, ec).lexically_normal().string();
  }
  const auto table = fields(&c);
  for (const auto& [key, value] : flags.values) {
    BURST_RETURN_IF_ERROR(set_from_string(flag_of(key), *find_field(table, key), value));
  }
  if (flags.no_prefix_caching) c.prefix_caching = 0;
  BURST_RETURN_IF_ERROR(resolve_api_key(c));
  if (c.model.empty() && c.preset.empty()) {
    std::string where;
    for (const auto& l : looked) where += (where.empty() ? "" : ", ") + l;
    return Status::error("no model: set \"model\" or --model DIR (or --preset NAME "
                         "--random-weights SEED); no default config was found (looked for "
                         "configs/cpu-tiny.json in " + (where.empty() ? "nothing" : where) +
                         "): name the data directory with --data-dir DIR or BURST_DATA_DIR");
  }
  BURST_RETURN_IF_ERROR(resolve_preset_tokenizer(c));
  if (c.tokenizer.empty()) c.tokenizer = c.model + "/tokenizer.model";
  if (c.model_name.empty() && !c.preset.empty()) c.model_name = "llama-2-" + c.preset + "-random";
  // The preset takes the model directory's place (one from the default config included).
  if (!c.preset.empty()) c.model.clear();
  if (c.model_name.empty()) c.model_name = fs::path(c.model).lexically_normal().filename();
  if (c.model_name.empty()) c.model_name = fs::path(c.model).parent_path().filename();
  BURST_RETURN_IF_ERROR(validate(c));
  return c;
}

}  // namespace burst::server
