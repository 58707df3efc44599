#include "common/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

namespace burst::server {

namespace {

void append_escaped(const char* p, size_t n, std::string* out) {
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(p[i]);
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          *out += static_cast<char>(c);
        }
    }
  }
}

// %* in the JSON pattern: the message, escaped for a JSON string.
class EscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string out;
    append_escaped(msg.payload.data(), msg.payload.size(), &out);
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<EscapedMessage>();
  }
};

std::shared_ptr<spdlog::logger> g_access;  // json format only; set once, before serving

}  // namespace

void log_access(int level, const std::string& text, const std::string& json_fields) {
  const auto lvl = static_cast<spdlog::level::level_enum>(level);
  if (g_access) {
    g_access->log(lvl, "{}", json_fields);
  } else {
    spdlog::log(lvl, "{}", text);
  }
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  append_escaped(s.data(), s.size(), &out);
  return out + "\"";
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
                     const std::string& format) {
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
  if (format == "json") {
    // Access records carry their fields as members of the object, not inside "msg".
    // Its own sink: a sink has one formatter.
    g_access = std::make_shared<spdlog::logger>(
        "access", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    g_access->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        "{\"time\":\"%Y-%m-%dT%H:%M:%S.%fZ\",\"level\":\"%l\",\"logger\":\"access\",%v}",
        spdlog::pattern_time_type::utc));
    g_access->set_level(lvl);
    g_access->flush_on(spdlog::level::info);
    auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    f->add_flag<EscapedMessage>('*').set_pattern(
        "{\"time\":\"%Y-%m-%dT%H:%M:%S.%fZ\",\"level\":\"%l\",\"logger\":\"%n\",\"msg\":\"%*\"}");
    logger->set_formatter(std::move(f));
  } else {
    logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return {};
}

}  // namespace burst::server
