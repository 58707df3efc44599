// Server metrics in the Prometheus text exposition format (version 0.0.4), thread-safe. Names
// follow vLLM's where one exists (burst: prefix instead of vllm:), and every burst: sample
// carries vLLM's model_name label, so existing dashboards map over: time_to_first_token_seconds,
// inter_token_latency_seconds (also under vLLM's older time_per_output_token_seconds),
// e2e_request_latency_seconds, request_queue_time_seconds, request_prefill_time_seconds,
// request_decode_time_seconds, request_inference_time_seconds, iteration_tokens,
// request_prompt_tokens, request_generation_tokens (histograms, time buckets up to 600 s:
// long-context prefills take minutes), prompt/generation token counters,
// request_success_total{finished_reason}, running/waiting request gauges and KV-cache use; HTTP
// errors by status. The process_* family (resident and virtual memory, CPU seconds, open and
// most file descriptors, start time) is Prometheus's standard one, read from /proc at each
// scrape, without a model_name label as every exporter writes it. README.md has the table of
// vLLM's names beside burst's.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace burst::server {

class Histogram {
 public:
  Histogram(std::string name, std::string help);  // time buckets, 1 ms .. 600 s
  Histogram(std::string name, std::string help, std::vector<double> bounds);
  void observe(double v);
  // `labels`: e.g. model_name="m" (empty: none), put before le on every sample.
  void render(std::string* out, const std::string& labels = "") const;
  // The same samples under another name and help (a name vLLM renamed, kept for dashboards).
  void render_as(std::string* out, const std::string& name, const std::string& help,
                 const std::string& labels) const;

 private:
  std::string name_, help_;
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

struct Metrics {
  Histogram ttft{"burst:time_to_first_token_seconds",
                 "Time from request arrival to its first token (queue + prefill)."};
  // Time between consecutive tokens: rendered as inter_token_latency_seconds (vLLM v1's name)
  // and as time_per_output_token_seconds (its earlier one, which dashboards query).
  Histogram tpot{"burst:inter_token_latency_seconds", "Time between consecutive tokens."};
  Histogram e2e{"burst:e2e_request_latency_seconds", "Time from arrival to the last token."};
  Histogram queue{"burst:request_queue_time_seconds", "Time a request waited in the queue."};
  Histogram prefill_time{"burst:request_prefill_time_seconds",
                         "Time from admission to the end of a request's prefill."};
  Histogram decode_time{"burst:request_decode_time_seconds",
                        "Time from a request's first token to its last."};
  Histogram iteration_tokens{"burst:iteration_tokens",
                             "Tokens per engine step (decode tokens + prefill chunk tokens).",
                             {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                              32768, 65536, 131072}};
  Histogram inference_time{"burst:request_inference_time_seconds",
                           "Time a request spent running: from admission to its last token "
                           "(prefill + decode)."};
  Histogram request_prompt_tokens{"burst:request_prompt_tokens",
                                  "Prompt tokens per finished request.", token_buckets()};
  Histogram request_generation_tokens{"burst:request_generation_tokens",
                                      "Generated tokens per finished request.", token_buckets()};
  std::atomic<uint64_t> prompt_tokens{0};
  std::atomic<uint64_t> generation_tokens{0};
  std::atomic<uint64_t> requests_ok{0};         // finished (stop, length)
  std::atomic<uint64_t> success_stop{0};        // of requests_ok: EOS or a stop string
  std::atomic<uint64_t> success_length{0};      // of requests_ok: max_tokens
  // An HTTP response with status >= 400, counted by status.
  void count_http_error(int status);
  // A request that ran: its prompt and generated tokens, and its running time (admission to
  // its last token).
  void request_ran(int64_t prompt_tokens, int64_t generated_tokens, double inference_s);
  std::atomic<uint64_t> requests_cancelled{0};  // client gone or cancelled
  std::atomic<uint64_t> requests_failed{0};     // worker failure or internal error
  std::atomic<uint64_t> requests_rejected{0};   // admission: too large, queue full, draining
  std::atomic<uint64_t> worker_restarts{0};
  std::atomic<uint64_t> lookahead_steps{0};    // decode steps sent before the one before returned
  std::atomic<uint64_t> lookahead_dropped{0};  // their rows of sequences that had ended meanwhile
  std::atomic<int64_t> running{0};
  std::atomic<int64_t> waiting{0};
  std::atomic<uint64_t> prefix_cache_queries{0};  // prompt tokens looked up in the prefix cache
  std::atomic<uint64_t> prefix_cache_hits{0};     // of those, found there (not computed)
  std::atomic<uint64_t> prefix_cache_evictions{0};  // blocks evicted to make room
  std::atomic<int64_t> kv_used_tokens{0};  // tokens of the KV pages in use, all ranks
  std::atomic<int64_t> kv_cached_tokens{0};  // of those, held by prefix blocks alone
  std::atomic<int64_t> kv_capacity_tokens{0};
  std::atomic<int> healthy{0};
  std::string model_name;  // the model_name label of every sample; set before serving

  std::string render() const;

 private:
  static std::vector<double> token_buckets();  // 1, 2, 5, 10, ... 1e6
  mutable std::mutex http_mu_;
  std::map<int, uint64_t> http_errors_;  // by status
};

}  // namespace burst::server
