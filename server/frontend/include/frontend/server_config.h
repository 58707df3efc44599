// burst-server's configuration: a JSON file (--config FILE; unknown keys are errors, so a typo
// never silently falls back to a default) overridden by command-line flags (CLI11: one table in
// server_config.cpp gives each setting its JSON key, its flag and its --help line, so a new
// setting is a member here and one row there). The defaults are
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
  std::string chat_template;  // a Jinja chat template file (default: the model's, else LLaMA-2's)
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
  // Workers present the cluster token ($BURST_CLUSTER_TOKEN or $BURST_CLUSTER_TOKEN_FILE) on
  // every call; without a token the server refuses to start unless insecure_cluster is 1.
  std::string worker_listen = "0.0.0.0:50052";
  int insecure_cluster = 0;
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
  int64_t prefill_chunk = 0;  // prompt tokens per prefill chunk; 0: see server_help()
  // Prefill chunk while other sequences decode (their inter-token time is one step); 0: 2048 on
  // cuda, prefill_chunk on cpu.
  int64_t prefill_chunk_decoding = 0;
  // 1: while every running sequence decodes, the next decode step goes to the workers before
  // the replies of the current one are read (Scheduler, "lookahead"); 0: one step at a time.
  int decode_lookahead = 1;
  int prefix_caching = 1;  // requests reuse the KV of prompt blocks computed before
  std::string kv_cache_dtype = "auto";  // auto or fp8 (engine::parse_kv_cache_dtype)
  std::string attention_dtype = "auto";  // auto, bf16 or fp8 (engine::parse_attention_dtype)
  int64_t warmup_tokens = -1;  // the warm-up request's tokens; -1: the longest prompt on GPUs
                               // (at most 128K), none on CPUs
  int64_t max_body_bytes = 8 << 20;
  // Prompt text (bytes) refused before tokenizing; 0: max_context x the tokenizer's longest
  // piece, the most text max_context tokens can stand for.
  int64_t max_prompt_bytes = 0;
  // An HTTP completion whose response could grow past this many bytes (estimated before it
  // runs: prompts x sequences x (echoed prompt + max_tokens) x logprobs) is a 400; 0: no limit.
  int64_t max_response_bytes = 32 << 20;
  // The HTTP front end (http_frontend.h).
  int http_backlog = 1024;           // listen() backlog (the kernel caps it at somaxconn)
  int http_max_connections = 512;    // beyond: 503 at once
  int http_max_connections_per_client = 256;  // from one peer address; 0: no limit
  int http_header_timeout_ms = 10000;  // a request's head must arrive within this
  int http_body_timeout_ms = 30000;    // its body within this after the head
  // CORS (vLLM's flags): comma lists (or JSON arrays) of the origins browsers may call from
  // (empty: CORS off, no CORS header), and the methods and request headers they may use;
  // allow_credentials 1: pages may send cookies and HTTP auth (the origin is echoed, never *).
  std::string allowed_origins;
  std::string allowed_methods = "*";
  std::string allowed_headers = "*";
  int allow_credentials = 0;
  // gRPC limits: sync-server threads (a call holds one while it runs), how long a call's
  // request message, a new connection's HTTP/2 handshake, an idle connection and any
  // connection may take or live, and the keepalive ping interval.
  int grpc_max_threads = 256;
  int grpc_max_calls_per_client = 128;  // Burst calls of one address at once; 0: no limit
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
  // Not config keys: where the shipped data was found (empty: nowhere), for messages, and the
  // config file read (absolute; empty: none), logged at start.
  std::string data_dir;
  std::string config_file;
};

// What the command line asks besides settings: print --help, print --version, or check the
// config and exit (--check-config).
struct ServerActions {
  bool help = false;
  bool version = false;
  bool check_config = false;
};

// Parses argv (defaults, then --config, then the other flags: `--flag VALUE` or
// `--flag=VALUE`, on CLI11). An error message means usage error (exit 2). With help or version
// set, the config is not read and the returned one is the defaults.
Result<ServerConfig> parse_server_args(int argc, char** argv, ServerActions* actions);
// The same, for callers that only need --help.
Result<ServerConfig> parse_server_args(int argc, char** argv, bool* help);

// --help: the synopsis, then every flag with its description.
std::string server_help();

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
