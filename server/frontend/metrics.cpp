#include "frontend/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <sstream>
#include <utility>

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

// A counter family with one sample per value of the label `key`, after the labels l.
void labelled_counter(std::string* out, const std::string& l, const std::string& name,
                      const char* help, const char* key,
                      std::initializer_list<std::pair<const char*, uint64_t>> samples) {
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " counter\n";
  for (const auto& [label, v] : samples) {
    *out += name + "{" + l + "," + key + "=\"" + label + "\"} " + std::to_string(v) + "\n";
  }
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

// Prometheus's standard process_* family for this process, from /proc (Linux). A value that
// cannot be read is left out rather than reported as 0.
void append_process_metrics(std::string* out) {
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), {});
  // Fields after the command name, which is in parentheses and may hold spaces: state is
  // field 3, utime 14, stime 15, starttime 22, vsize 23, rss 24 (proc(5)).
  const size_t close = stat.rfind(')');
  std::vector<std::string> f;
  if (close != std::string::npos) {
    std::istringstream is(stat.substr(close + 2));
    for (std::string x; is >> x;) f.push_back(x);
  }
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  auto field = [&](int n) { return std::stod(f[static_cast<size_t>(n - 3)]); };
  if (f.size() >= 22 && ticks > 0) {
    scalar(out, "", "process_cpu_seconds_total", "counter",
           "Total user and system CPU time spent in seconds.", (field(14) + field(15)) / ticks);
    scalar(out, "", "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
           field(23));
    scalar(out, "", "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
           field(24) * page);
    // Boot time (btime in /proc/stat) + the start in clock ticks after boot.
    std::ifstream proc_stat("/proc/stat");
    for (std::string key; proc_stat >> key;) {
      if (key == "btime") {
        double btime = 0;
        if (proc_stat >> btime) {
          scalar(out, "", "process_start_time_seconds", "gauge",
                 "Start time of the process since unix epoch in seconds.",
                 btime + field(22) / ticks);
        }
        break;
      }
    }
  }
  std::error_code ec;
  size_t fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  // The iterator's own descriptor is one of those counted.
  if (!ec && fds > 0) {
    scalar(out, "", "process_open_fds", "gauge", "Number of open file descriptors.",
           static_cast<double>(fds - 1));
  }
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    scalar(out, "", "process_max_fds", "gauge", "Maximum number of open file descriptors.",
           static_cast<double>(lim.rlim_cur));
  }
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
  render_as(out, name_, help_, labels);
}

void Histogram::render_as(std::string* out, const std::string& name, const std::string& help,
                          const std::string& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string pre = labels.empty() ? "" : labels + ",";
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    *out += name + "_bucket{" + pre + "le=\"" + num(bounds_[i]) + "\"} " +
            std::to_string(cumulative) + "\n";
  }
  *out += name + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
  *out += name + "_sum" + braced(labels) + " " + num(sum_) + "\n" + name + "_count" +
          braced(labels) + " " + std::to_string(count_) + "\n";
}

std::vector<double> Metrics::token_buckets() {
  std::vector<double> b;
  for (double decade = 1; decade <= 1e6; decade *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * decade <= 1e6) b.push_back(m * decade);
    }
  }
  return b;
}

void Metrics::count_http_error(int status) {
  std::lock_guard<std::mutex> lock(http_mu_);
  ++http_errors_[status];
}

void Metrics::request_ran(int64_t prompt, int64_t generated, double inference_s) {
  request_prompt_tokens.observe(static_cast<double>(prompt));
  request_generation_tokens.observe(static_cast<double>(generated));
  inference_time.observe(inference_s);
}

std::string Metrics::render() const {
  std::string out;
  const std::string l = "model_name=\"" + label_value(model_name) + "\"";
  for (const Histogram* h : {&ttft, &tpot, &e2e, &queue, &prefill_time, &decode_time,
                             &inference_time, &iteration_tokens, &request_prompt_tokens,
                             &request_generation_tokens}) {
    h->render(&out, l);
  }
  tpot.render_as(&out, "burst:time_per_output_token_seconds",
                 "Time between consecutive tokens (vLLM's earlier name of "
                 "inter_token_latency_seconds).",
                 l);
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
  labelled_counter(&out, l, "burst:requests_total", "Requests by outcome.", "outcome",
                   {{"ok", requests_ok.load()},
                    {"cancelled", requests_cancelled.load()},
                    {"failed", requests_failed.load()},
                    {"rejected", requests_rejected.load()}});
  labelled_counter(&out, l, "burst:request_success_total",
                   "Finished requests by finish reason (vLLM's request_success_total).",
                   "finished_reason",
                   {{"stop", success_stop.load()},
                    {"length", success_length.load()},
                    {"abort", requests_cancelled.load()}});
  out += "# HELP burst:http_errors_total HTTP responses with a 4xx or 5xx status, by status.\n"
         "# TYPE burst:http_errors_total counter\n";
  {
    std::lock_guard<std::mutex> lock(http_mu_);
    // Before any error, one zero sample, so that queries over the family find it.
    if (http_errors_.empty()) out += "burst:http_errors_total{" + l + ",status=\"500\"} 0\n";
    for (const auto& [status, n] : http_errors_) {
      out += "burst:http_errors_total{" + l + ",status=\"" + std::to_string(status) + "\"} " +
             std::to_string(n) + "\n";
    }
  }
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
  append_process_metrics(&out);
  return out;
}

}  // namespace burst::server
