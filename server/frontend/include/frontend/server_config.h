// burst-server's configuration: a JSON file (--config FILE; unknown keys are errors, so a typo
// never silently falls back to a default) overridden by command-line flags. The defaults are
// the data directory's configs/cpu-tiny.json: the tiny KJV model on 2 CPU workers, bound to
// 127.0.0.1. Relative paths in a config file resolve against the current directory, or else
// against the config file's parent directory (the data directory for configs/*.json: the
// repository root, or PREFIX/share/burst once installed), so the shipped configs work from any
// directory.
//
// The data directory (configs/, models/kjv-tiny) is, first match wins: --data-dir DIR,
// $BURST_DATA_DIR, <executable>/../share/burst (an installed tree, wherever it was copied), the
// source tree the binary was built from (development builds; -DBURST_DATA_FROM_SOURCE=OFF
// removes it), the install prefix's share/burst. Never the build tree.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/status.h"

namespace burst::server {

struct ServerConfig {
  std::string model;        // Hugging Face LLaMA directory
  std::string preset;       // or an architecture preset (7b, 13b, 70b) with random weights:
  int64_t random_weights = 0;  // their seed (benchmarks; the tokenizer still comes from a file)
  std::string tokenizer;    // tokenizer.model (default: MODEL/tokenizer.model)
  std::string model_name;   // the name clients use (default: the model directory's name)
  std::string device = "cpu";
  int workers = 2;
  int tp = 1;  // tensor parallelism: workers = tp x the ring's ranks (engine::ParallelLayout)
  int threads_per_worker = 0;  // 0: cores / workers
  std::string layout = "striped";
  std::string host = "127.0.0.1";
  int grpc_port = 50051;  // 0: any free port; -1: no gRPC
  int http_port = 8080;   // 0: any free port; -1: no HTTP
  std::string port_file;  // written once both ports are bound: {"http_port": N, "grpc_port": M}
  std::string api_key;    // empty: no authentication (also read from $BURST_API_KEY)
  std::string api_key_file;  // the API key from a file (not visible in ps), instead of api_key
  // 1: /metrics requires the API key as the API does; 0 (default): it answers without, as
  // /health, /ping, gRPC Health and reflection always do (docs/reliability.md says why).
  int metrics_require_key = 0;
  // Multi-node: > 0 spawns no worker and waits for this many `burst-worker --join HOST:PORT`
  // (the group's world size; "workers" is then unused), listening for them on worker_listen.
  int remote_workers = 0;
  std::string worker_listen = "0.0.0.0:50052";  // no authentication: a cluster network only
  int64_t max_context = 0;   // longest prompt accepted; 0: the model's max_position_embeddings
  // KV tokens of the group, shared by every request; 0: on GPUs this server spawns, as many as
  // kv_memory_percent of each GPU holds beside the weights and activations; else max_context.
  int64_t kv_capacity = 0;
  int kv_memory_percent = 90;
  // Largest max_tokens accepted; 0: kv_capacity (max_context when sized from memory).
  int max_tokens_limit = 0;
  int max_queue = 64;        // waiting requests beyond which new ones get 503
  int max_running = 64;      // sequences batched at once (continuous batching)
  int64_t max_batched_tokens = 0;  // tokens per step; 0: chunk + max(max_running, chunk/4)
  int64_t prefill_chunk = 0;  // prompt tokens per prefill chunk; 0: see kServerUsage
  // Prefill chunk while other sequences decode (their inter-token time is one step); 0: 2048 on
  // cuda, prefill_chunk on cpu.
  int64_t prefill_chunk_decoding = 0;
  // 1: while every running sequence decodes, the next decode step goes to the workers before
  // the replies of the current one are read (Scheduler, "lookahead"); 0: one step at a time.
  int decode_lookahead = 1;
  int prefix_caching = 1;  // requests reuse the KV of prompt blocks computed before
  int64_t warmup_tokens = -1;  // the warm-up request's tokens; -1: the longest prompt on GPUs
                               // (at most 128K), none on CPUs
  int64_t max_body_bytes = 8 << 20;
  // Prompt text (bytes) refused before tokenizing; 0: max_context x the tokenizer's longest
  // piece, the most text max_context tokens can stand for.
  int64_t max_prompt_bytes = 0;
  // The HTTP front end (http_frontend.h).
  int http_backlog = 1024;           // listen() backlog (the kernel caps it at somaxconn)
  int http_max_connections = 512;    // beyond: 503 at once
  int http_max_connections_per_client = 256;  // from one peer address; 0: no limit
  int http_header_timeout_ms = 10000;  // a request's head must arrive within this
  int http_body_timeout_ms = 30000;    // its body within this after the head
  // CORS (vLLM's flags): comma lists (or JSON arrays) of the origins browsers may call from
  // (empty: CORS off, no CORS header), and the methods and request headers they may use.
  std::string allowed_origins;
  std::string allowed_methods = "*";
  std::string allowed_headers = "*";
  // gRPC limits: sync-server threads (a call holds one while it runs), how long a call's
  // request message, a new connection's HTTP/2 handshake, an idle connection and any
  // connection may take or live, and the keepalive ping interval.
  int grpc_max_threads = 256;
  int grpc_message_timeout_ms = 30000;
  int grpc_handshake_timeout_ms = 10000;
  int grpc_max_connection_idle_ms = 300000;
  int grpc_max_connection_age_ms = 0;  // 0: no limit
  int grpc_keepalive_ms = 60000;
  int keepalive_ms = 5000;   // SSE keep-alive comment interval while no token is ready
  int drain_timeout_ms = 30000;  // SIGTERM: in-flight requests get this long, then are cancelled
  // Spawn to serving, the weights' loading included; 0: scaled to the weights' size
  // (default_start_timeout in worker_group.h: 120 s + 30 s per GB each rank holds).
  int start_timeout_ms = 0;
  std::string log_level = "info";   // trace, debug, info, warn, error, critical, off
  std::string log_format = "text";  // text or json (one JSON object per line), on stderr
  // Not a config key: where the shipped data was found (empty: nowhere), for messages.
  std::string data_dir;
};

constexpr const char* kServerUsage =
    R"(usage: burst-server [--config FILE] [--model DIR | --preset 1b|7b|13b|70b --random-weights SEED]
                    [--tokenizer FILE] [--model-name NAME] [--data-dir DIR] [--check-config]
                    [--device cpu|cuda] [--workers N] [--tp T] [--threads-per-worker N]
                    [--layout striped|zigzag|contiguous] [--host ADDR] [--grpc-port P] [--http-port P]
                    [--port-file FILE] [--api-key KEY | --api-key-file F]
                    [--metrics-require-key 0|1] [--max-context N]
                    [--kv-capacity N] [--kv-memory-percent P]
                    [--max-tokens-limit N] [--max-queue N] [--max-running N]
                    [--max-batched-tokens T] [--prefill-chunk T] [--prefill-chunk-decoding T]
                    [--decode-lookahead 0|1] [--prefix-caching 0|1 | --no-prefix-caching]
                    [--warmup-tokens N] [--max-body-bytes B]
                    [--max-prompt-bytes B] [--http-backlog N] [--http-max-connections N]
                    [--http-max-connections-per-client N]
                    [--http-header-timeout-ms MS] [--http-body-timeout-ms MS]
                    [--allowed-origins LIST] [--allowed-methods LIST] [--allowed-headers LIST]
                    [--grpc-max-threads N] [--grpc-message-timeout-ms MS]
                    [--grpc-handshake-timeout-ms MS] [--grpc-max-connection-idle-ms MS]
                    [--grpc-max-connection-age-ms MS] [--grpc-keepalive-ms MS]
                    [--keepalive-ms MS] [--drain-timeout-ms MS] [--start-timeout-ms MS]
                    [--log-level LEVEL] [--log-format text|json]
                    [--remote-workers N [--worker-listen HOST:PORT]] [--version] [--help]

  --config FILE     JSON config (keys as the flags, with '_' for '-'); flags override it.
                    Without it: the data directory's configs/cpu-tiny.json (tiny model, 2 CPU
                    workers)
  --data-dir DIR    the shipped configs/ and models/ (else $BURST_DATA_DIR, else
                    <exe>/../share/burst, else the source tree or install prefix built in)
  --model DIR       a Hugging Face LLaMA directory (config.json, *.safetensors)
  --preset NAME     random weights of a LLaMA-2 shape (no model directory); the tokenizer is
                    --tokenizer FILE or the data directory's models/kjv-tiny/tokenizer.model
  --random-weights SEED  the preset's weights' seed
  --tokenizer FILE  tokenizer.model (default: MODEL/tokenizer.model)
  --model-name NAME the name clients use (default: the model directory's name)
  --check-config    validate the config and flags, print the resolved settings as JSON and
                    exit (0: valid, 2: not); model files are checked only where present
  --device D        cpu (default) or cuda
  --workers N       burst-worker processes (default 2): tp x the ring's ranks
  --tp T            tensor parallelism (default 1): each T consecutive workers split every
                    layer's weights (Megatron), the BurstAttention ring joins the groups
  --threads-per-worker N  threads per CPU worker (0: cores / workers)
  --layout L        sequence sharding: striped (default; prefix caching needs it),
                    zigzag or contiguous
  --host ADDR       the address HTTP and gRPC bind (default 127.0.0.1)
  --grpc-port P     0 picks a free port, -1 disables gRPC (same for --http-port)
  --port-file FILE  write {"http_port": N, "grpc_port": M, "worker_port": W} once bound
  --api-key KEY     require "Authorization: Bearer KEY" (HTTP) / authorization metadata (gRPC);
                    also $BURST_API_KEY (a flag's value shows in ps: prefer the file or the
                    environment)
  --api-key-file F  the API key from file F (surrounding whitespace removed)
  --metrics-require-key 0|1  1: /metrics requires the API key too (401 without); 0 (default):
                    /metrics, like /health, /ping, gRPC Health and reflection, answers without
  --max-context N   longest prompt (0: the model's max_position_embeddings)
  --kv-capacity N   KV tokens of the group, shared by all requests (0: on GPUs this server
                    spawns, what --kv-memory-percent of each GPU holds beside the weights
                    and activations; otherwise the max context)
  --kv-memory-percent P  with --kv-capacity 0 on GPUs: the share of each GPU to fill (90)
  --max-tokens-limit N  largest max_tokens accepted (0: the KV capacity)
  --max-queue N     waiting requests beyond which new ones get 503 (default 64)
  --max-running N   sequences batched at once (default 64)
  --max-batched-tokens T  tokens per engine step (0: chunk + max(max-running, chunk / 4))
  --prefill-chunk T prompt tokens per prefill chunk (0: 256 on CPU; on CUDA 8192 with one
                    worker, 2048 x workers with more)
  --prefill-chunk-decoding T  the chunk while other sequences decode, which bounds their
                    inter-token time (0: 2048 on CUDA, --prefill-chunk on CPU)
  --decode-lookahead 0|1  1 (default): while every running sequence decodes, send the next
                    decode step before the current one's tokens come back, so the workers
                    start it at once (a sequence that ends meanwhile costs one wasted row);
                    0: one step at a time
  --prefix-caching 0|1  1 (default): a prompt that starts with blocks of tokens computed
                    before (ring ranks x the KV page size tokens each, of a finished or a
                    running request, its answer included) reuses their KV pages on every rank
                    and prefills only the rest; unused blocks are evicted least recently used
                    first when pages run out. Needs the striped layout.
                    --no-prefix-caching: 0
  --warmup-tokens N before the workers serve (at start and after a restart), one request of N
                    tokens runs through them, so that the first request is as fast as the
                    next (-1, the default: the max context, at most 131072, on GPUs; none
                    on CPUs)
  --max-body-bytes B  largest HTTP request body (default 8 MiB)
  --max-prompt-bytes B  prompt text (bytes) refused with 413 / RESOURCE_EXHAUSTED before it is
                    tokenized (0, the default: max context x the longest token's text, the most
                    text that can fit the context)
  --http-backlog N  listen backlog of the HTTP socket (default 1024; capped by the kernel's
                    net.core.somaxconn)
  --http-max-connections N  open HTTP connections at most; more get 503 at once (default 512)
  --http-max-connections-per-client N  open HTTP connections from one address at most
                    (default 256; 0: no limit; behind a proxy every client is the proxy). At
                    either limit the connection idle longest between requests is closed to
                    make room; only when none idles does the newcomer get 503
  --http-header-timeout-ms MS  a request's head must arrive within this (from its first byte;
                    from the accept for a connection's first request), else 408 (default 10000)
  --http-body-timeout-ms MS  its body within this after the head, else 408 (default 30000)
  --allowed-origins LIST  CORS: origins browsers may call the HTTP API from, comma-separated
                    or a JSON array (vLLM's form), e.g. https://app.example.com; * for any.
                    Default: none (CORS off: no preflight answered, no CORS header sent)
  --allowed-methods LIST  CORS: methods a preflight may ask for (default *)
  --allowed-headers LIST  CORS: request headers a preflight may ask for (default *: whatever
                    is asked, Authorization included)
  --grpc-max-threads N  gRPC server threads at most (default 256); a call holds one while it
                    runs, calls beyond get RESOURCE_EXHAUSTED at once
  --grpc-message-timeout-ms MS  a call's request message must arrive within this after the
                    call starts, else the call is cancelled (default 30000)
  --grpc-handshake-timeout-ms MS  a new connection must complete its HTTP/2 handshake within
                    this, else it is closed (default 10000)
  --grpc-max-connection-idle-ms MS  a connection without calls for this long is closed (a
                    GOAWAY; clients reconnect when they next call) (default 300000)
  --grpc-max-connection-age-ms MS  a connection older than this is asked to go away; its
                    calls get --drain-timeout-ms to finish (default 0: no limit)
  --grpc-keepalive-ms MS  the server pings a connection silent for this long and closes it
                    if the ping is not answered within 20 s (default 60000)
  --keepalive-ms MS SSE keep-alive comment interval while no token is ready (default 5000)
  --drain-timeout-ms MS  SIGTERM: how long requests in flight may finish (default 30000)
  --start-timeout-ms MS  how long the worker group may take to start, loading the weights
                    included (0, the default: 120 s + 30 s per GB of weights per worker;
                    kjv-tiny 120 s, 7b on GPUs 524 s); progress is logged every 5 s and
                    shown on /health
  --log-level LEVEL trace, debug, info (default), warn, error, critical or off
  --log-format F    text (default) or json (one object per line); logs go to stderr, with one
                    access-log line per HTTP request (status, route, latency, request id)
  --remote-workers N  multi-node: spawn no worker; wait for N `burst-worker --join HOST:PORT`
                    (same model as the server) to register, then serve. Until they have,
                    /health answers 503: waiting for workers (k/N registered)
  --worker-listen HOST:PORT  where remote workers register and rendezvous (default
                    0.0.0.0:50052; port 0: any free port); unauthenticated: cluster network only
  --version         print the version and build, then exit
)";

// Parses argv (defaults, then --config, then the other flags). An error message means usage
// error (exit 2); --help sets help.
Result<ServerConfig> parse_server_args(int argc, char** argv, bool* help);

// A CORS list (--allowed-origins, --allowed-methods, --allowed-headers): comma-separated, or
// a JSON array of strings as vLLM takes it; entries trimmed. Origins must be "*", "null" or
// SCHEME://HOST[:PORT]; methods and header names tokens. `key` names the setting in errors.
Result<std::vector<std::string>> parse_cors_list(const std::string& text, const std::string& key);

// Reads a config file over `base` (for tests and the embedded default).
Status apply_config_file(const std::string& path, ServerConfig* config);

// The data directory (see the top of this file). `explicit_dir` is --data-dir (empty: none),
// `exe` this executable's path. Empty when none qualifies (an implicit candidate qualifies when
// it holds configs/cpu-tiny.json); `looked` (optional) receives every place tried.
Result<std::string> find_data_dir(const std::string& explicit_dir, const std::filesystem::path& exe,
                                  std::vector<std::string>* looked = nullptr);

// The resolved settings as a JSON object with the config file's keys (api_key redacted).
std::string config_to_json(const ServerConfig& config);

}  // namespace burst::server
