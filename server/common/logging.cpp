#include "common/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string_view>

#include <nlohmann/json.hpp>

namespace burst::server {

namespace {

// Where a trailing UTF-8 character that `s` cuts short begins, or s.size() when none is cut.
size_t complete_prefix(std::string_view s) {
  // A character is at most 4 bytes: look back over at most 3 continuation bytes for its lead.
  size_t i = s.size(), back = 0;
  while (i > 0 && back < 3 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) {
    --i;
    ++back;
  }
  if (i == 0) return s.size();
  const unsigned char lead = static_cast<unsigned char>(s[i - 1]);
  const size_t len = lead >= 0xF0 && lead < 0xF8 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  // Not a lead byte, or its character is whole: nothing is cut (an invalid byte is replaced
  // by the escaping, not removed).
  if (len == 1 || lead >= 0xF8 || back + 1 >= len) return s.size();
  return i - 1;
}

// `s` as a JSON string (quotes included), valid UTF-8: nlohmann::json escapes it, replacing
// bytes that are not UTF-8 by U+FFFD.
std::string escaped(std::string_view s) {
  return nlohmann::json(std::string(s.substr(0, complete_prefix(s))))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// %* in the JSON pattern: the message as a JSON string (quotes included).
class EscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string out = escaped(std::string_view(msg.payload.data(), msg.payload.size()));
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<EscapedMessage>();
  }
};

std::unique_ptr<spdlog::formatter> json_formatter(int rank) {
  auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
  const std::string rank_field = rank >= 0 ? ",\"rank\":" + std::to_string(rank) : "";
  f->add_flag<EscapedMessage>('*').set_pattern(
      "{\"time\":\"%Y-%m-%dT%H:%M:%S.%fZ\",\"level\":\"%l\",\"logger\":\"%n\"" + rank_field +
      ",\"msg\":%*}");
  return f;
}

std::shared_ptr<spdlog::logger> g_access;  // json format only; set once, before serving
// json format only: writes whole records as given (the workers' relayed stderr lines). Its
// sink, like the others, takes spdlog's one console mutex, so lines never interleave.
std::shared_ptr<spdlog::logger> g_raw;
std::atomic<bool> g_json{false};

// Now in UTC as the records' "time": 2026-11-28T13:04:05.123456Z.
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof(buf) - n, ".%06lldZ", static_cast<long long>(micros));
  return buf;
}

// Whether a raw line speaks of trouble (NCCL WARN, "error:", "Aborted", "failed"): its record
// is a warning then, else info.
bool sounds_bad(std::string_view line) {
  std::string low(line.substr(0, 512));
  std::transform(low.begin(), low.end(), low.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* word : {"error", "warn", "fail", "fatal", "abort", "panic", "terminate"}) {
    if (low.find(word) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

void log_access(int level, const std::string& text, const std::string& json_fields) {
  const auto lvl = static_cast<spdlog::level::level_enum>(level);
  if (g_access) {
    g_access->log(lvl, "{}", json_fields);
  } else {
    spdlog::log(lvl, "{}", text);
  }
}

std::string json_quote(const std::string& s) { return escaped(s); }

std::string worker_line_record(std::string_view line, int rank, int* level) {
  const bool object = !line.empty() && line.front() == '{';
  // accept() checks the whole line, strings' UTF-8 included: a record cut short or holding
  // raw bytes is wrapped like any other text.
  if (object && nlohmann::json::accept(line)) {
    *level = -1;
    return std::string(line);
  }
  *level = sounds_bad(line) ? spdlog::level::warn : spdlog::level::info;
  return "{\"time\":\"" + utc_now() + "\",\"level\":\"" +
         (*level == spdlog::level::warn ? "warning" : "info") +
         "\",\"logger\":\"burst-worker\",\"rank\":" + std::to_string(rank) +
         ",\"msg\":" + escaped(line) + "}";
}

void relay_worker_line(std::string_view line, int rank) {
  int level = 0;
  const std::string record = worker_line_record(line, rank, &level);
  if (!g_raw) {  // text format: the line as the worker wrote it
    std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
    return;
  }
  if (level >= 0 &&
      !spdlog::default_logger()->should_log(static_cast<spdlog::level::level_enum>(level))) {
    return;
  }
  g_raw->log(spdlog::level::critical, "{}", record);
}

std::string utf8_cut(const std::string& s, size_t max_bytes) {
  if (s.size() <= max_bytes) return s;
  const std::string_view head(s.data(), max_bytes);
  return std::string(head.substr(0, complete_prefix(head)));
}

bool log_is_json() { return g_json; }

void set_log_rank(int rank) {
  if (g_json) spdlog::default_logger()->set_formatter(json_formatter(rank));
}

std::string bytes_progress(int64_t done, int64_t total) {
  char buf[96];
  std::snprintf(
      buf, sizeof(buf), "%.2f of %.2f GB (%d%%)", static_cast<double>(done) / 1e9,
      static_cast<double>(total) / 1e9,
      total > 0 ? static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total))
                : 0);
  return buf;
}

std::string version_string(const std::string& binary) {
#ifdef BURST_HAVE_CUDA
  const char* kind = "CPU+CUDA build";
#else
  const char* kind = "CPU-only build";
#endif
#ifdef NDEBUG
  const char* type = "optimised";
#else
  const char* type = "debug";
#endif
#if defined(__clang__)
  const std::string compiler = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  const std::string compiler = std::string("GCC ") + __VERSION__;
#else
  const std::string compiler = "unknown compiler";
#endif
  return binary + " " + kVersion + " (" + kind + ", " + type + ", " + compiler + ", built " +
         __DATE__ + " " + __TIME__ + ")";
}

Status setup_logging(const std::string& binary, const std::string& level,
                     const std::string& format, int rank) {
  const auto lvl = spdlog::level::from_str(level);
  // from_str answers "off" for any name it does not know.
  if (lvl == spdlog::level::off && level != "off") {
    return Status::error("unknown log level '" + level +
                         "' (trace, debug, info, warn, error, critical, off)");
  }
  if (format != "text" && format != "json") {
    return Status::error("unknown log format '" + format + "' (text or json)");
  }
  spdlog::sink_ptr sink;
  if (format == "json") {
    sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  } else {
    sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  }
  auto logger = std::make_shared<spdlog::logger>(binary, sink);
  g_access.reset();
  g_raw.reset();
  if (format == "json") {
    g_raw =
        std::make_shared<spdlog::logger>("raw", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    g_raw->set_pattern("%v");
    g_raw->flush_on(spdlog::level::trace);
    // Access records carry their fields as members of the object, not inside "msg".
    // Its own sink: a sink has one formatter.
    g_access = std::make_shared<spdlog::logger>(
        "access", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    g_access->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "{\"time\":\"%Y-%m-%dT%H:%M:%S.%fZ\",\"level\":\"%l\",\"logger\":\"access\",%v}",
        spdlog::pattern_time_type::utc));
    g_access->set_level(lvl);
    g_access->flush_on(spdlog::level::info);
    logger->set_formatter(json_formatter(rank));
  } else {
    logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  g_json = format == "json";
  // The workers this process spawns log alike (their stderr is this process's).
  setenv(kLogLevelEnv, level.c_str(), 1);
  setenv(kLogFormatEnv, format.c_str(), 1);
  return {};
}

}  // namespace burst::server
