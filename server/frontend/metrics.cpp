#include "frontend/metrics.h"

#include <cstdio>

namespace burst::server {

namespace {

// Sub-millisecond to ten minutes: a 128K-token prefill queued behind another takes minutes.
const std::vector<double> kBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                      0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10,   20,  40,
                                      80,    160,   300,  600};

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string braced(const std::string& labels) { return labels.empty() ? "" : "{" + labels + "}"; }

void scalar(std::string* out, const std::string& labels, const char* name, const char* type,
            const char* help, double v) {
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" +
          name + braced(labels) + " " + num(v) + "\n";
}

// A label value in the exposition format: backslash, quote and newline escaped.
std::string label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

Histogram::Histogram(std::string name, std::string help)
    : name_(std::move(name)), help_(std::move(help)), bounds_(kBuckets),
      counts_(kBuckets.size() + 1, 0) {}

Histogram::Histogram(std::string name, std::string help, std::vector<double> bounds)
    : name_(std::move(name)), help_(std::move(help)), bounds_(std::move(bounds)),
      counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string* out, const std::string& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string pre = labels.empty() ? "" : labels + ",";
  *out += "# HELP " + name_ + " " + help_ + "\n# TYPE " + name_ + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    *out += name_ + "_bucket{" + pre + "le=\"" + num(bounds_[i]) + "\"} " +
            std::to_string(cumulative) + "\n";
  }
  *out += name_ + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
  *out += name_ + "_sum" + braced(labels) + " " + num(sum_) + "\n" + name_ + "_count" +
          braced(labels) + " " + std::to_string(count_) + "\n";
}

std::string Metrics::render() const {
  std::string out;
  const std::string l = "model_name=\"" + label_value(model_name) + "\"";
  for (const Histogram* h : {&ttft, &tpot, &e2e, &queue, &prefill_time, &decode_time,
                             &iteration_tokens}) {
    h->render(&out, l);
  }
  scalar(&out, l, "burst:prompt_tokens_total", "counter", "Prompt tokens processed.",
         static_cast<double>(prompt_tokens.load()));
  scalar(&out, l, "burst:generation_tokens_total", "counter", "Tokens generated.",
         static_cast<double>(generation_tokens.load()));
  scalar(&out, l, "burst:lookahead_steps_total", "counter",
         "Decode steps sent before the step before them returned (--decode-lookahead).",
         static_cast<double>(lookahead_steps.load()));
  scalar(&out, l, "burst:lookahead_dropped_tokens_total", "counter",
         "Tokens of lookahead steps dropped: their sequence had ended in the step before.",
         static_cast<double>(lookahead_dropped.load()));
  out += "# HELP burst:requests_total Requests by outcome.\n# TYPE burst:requests_total counter\n";
  const std::pair<const char*, uint64_t> outcomes[] = {
      {"ok", requests_ok.load()},
      {"cancelled", requests_cancelled.load()},
      {"failed", requests_failed.load()},
      {"rejected", requests_rejected.load()}};
  for (const auto& [label, v] : outcomes) {
    out += "burst:requests_total{" + l + ",outcome=\"" + label + "\"} " + std::to_string(v) +
           "\n";
  }
  out += "# HELP burst:request_success_total Finished requests by finish reason (vLLM's "
         "request_success_total).\n# TYPE burst:request_success_total counter\n";
  const std::pair<const char*, uint64_t> reasons[] = {{"stop", success_stop.load()},
                                                      {"length", success_length.load()},
                                                      {"abort", requests_cancelled.load()}};
  for (const auto& [label, v] : reasons) {
    out += "burst:request_success_total{" + l + ",finished_reason=\"" + label + "\"} " +
           std::to_string(v) + "\n";
  }
  scalar(&out, l, "burst:http_errors_total", "counter", "HTTP responses with a 4xx or 5xx status.",
         static_cast<double>(http_errors.load()));
  scalar(&out, l, "burst:worker_restarts_total", "counter",
         "Worker-group restarts after a failure.", static_cast<double>(worker_restarts.load()));
  scalar(&out, l, "burst:num_requests_running", "gauge", "Requests on the workers.",
         static_cast<double>(running.load()));
  scalar(&out, l, "burst:num_requests_waiting", "gauge", "Requests in the queue.",
         static_cast<double>(waiting.load()));
  scalar(&out, l, "burst:kv_cache_used_tokens", "gauge", "Tokens held in the workers' KV shards.",
         static_cast<double>(kv_used_tokens.load()));
  scalar(&out, l, "burst:kv_cache_cached_tokens", "gauge",
         "Of the KV tokens held, those of prefix-cache blocks no running request uses.",
         static_cast<double>(kv_cached_tokens.load()));
  scalar(&out, l, "burst:prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
         static_cast<double>(prefix_cache_queries.load()));
  scalar(&out, l, "burst:prefix_cache_hits_total", "counter",
         "Prompt tokens found in the prefix cache (vLLM's prefix_cache_hits).",
         static_cast<double>(prefix_cache_hits.load()));
  scalar(&out, l, "burst:prefix_cache_evicted_blocks_total", "counter",
         "Prefix-cache blocks evicted (least recently used) to make room for requests.",
         static_cast<double>(prefix_cache_evictions.load()));
  scalar(&out, l, "burst:kv_cache_capacity_tokens", "gauge", "KV capacity (tokens, whole group).",
         static_cast<double>(kv_capacity_tokens.load()));
  const int64_t cap = kv_capacity_tokens.load();
  scalar(&out, l, "burst:kv_cache_usage_perc", "gauge", "KV-cache use, 0 to 1.",
         cap > 0 ? static_cast<double>(kv_used_tokens.load()) / static_cast<double>(cap) : 0.0);
  scalar(&out, l, "burst:healthy", "gauge", "1 when the worker group serves requests.",
         healthy.load());
  return out;
}

}  // namespace burst::server
