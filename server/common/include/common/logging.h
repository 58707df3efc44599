// Version and build information of every burst binary, and the server's logging: one line per
// record on stderr (stdout stays free for a program's output), as text or as JSON lines, at a
// chosen level.
#pragma once

#include <string>

#include "engine/status.h"

namespace burst::server {

constexpr const char* kVersion = "0.1.0";

// "NAME 0.1.0 (CPU+CUDA build, Release, GCC 12.2.0, built Nov 23 2026 11:00:00)".
std::string version_string(const std::string& binary);

// The default logger: stderr, `level` (trace, debug, info, warn, error, critical, off) and
// `format` (text: "[time] [binary] [level] message"; json: {"time", "level", "logger", "msg"}
// per line, time in UTC). An unknown level or format is an error and changes nothing.
Status setup_logging(const std::string& binary, const std::string& level,
                     const std::string& format);

// "1.2 of 4.4 GB (27%)": weights loaded of all, for the loading log lines and /health.
std::string bytes_progress(int64_t done, int64_t total);

// JSON string escaping (quotes included) for log lines built by hand.
std::string json_quote(const std::string& s);

// One access-log record at `level` (spdlog's: 1 debug, 2 info, 3 warn): `text` in the text
// format; in the json format an object with time, level, logger "access" and `json_fields`
// (a fragment of JSON members, e.g. "status":200,"path":"/x").
void log_access(int level, const std::string& text, const std::string& json_fields);

}  // namespace burst::server
