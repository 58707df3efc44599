// Version and build information of every burst binary, and the logging of the server and its
// workers: one line per record on stderr (stdout stays free for a program's output), as text or
// as JSON lines, at a chosen level. In the json format every line is one JSON object and valid
// UTF-8, whatever a message holds: strings are escaped by nlohmann::json, bytes that are not
// UTF-8 become U+FFFD, and a string that ends in a cut character loses the cut part. A spawned
// worker inherits the server's level and format ($BURST_LOG_LEVEL, $BURST_LOG_FORMAT) and its
// records carry its rank, so the workers' lines in the server's stderr parse like the server's.
// In the json format the server reads each worker's stderr (a pipe) and relays it line by line,
// so that what a worker prints without the logger (NCCL, the C runtime, a crash) is a record too.
#pragma once

#include <string>
#include <string_view>

#include "engine/status.h"

namespace burst::server {

constexpr const char* kVersion = "0.1.0";

// "NAME 0.1.0 (CPU+CUDA build, Release, GCC 12.2.0, built Nov 23 2026 11:00:00)".
std::string version_string(const std::string& binary);

// The environment through which spawned workers inherit the server's logging.
inline constexpr char kLogLevelEnv[] = "BURST_LOG_LEVEL";
inline constexpr char kLogFormatEnv[] = "BURST_LOG_FORMAT";

// The default logger: stderr, `level` (trace, debug, info, warn, error, critical, off) and
// `format` (text: "[time] [binary] [level] message"; json: {"time", "level", "logger", "msg"}
// per line, time in UTC, with "rank" after "logger" when `rank` >= 0). An unknown level or
// format is an error and changes nothing. Sets $BURST_LOG_LEVEL and $BURST_LOG_FORMAT for the
// processes this one starts.
Status setup_logging(const std::string& binary, const std::string& level,
                     const std::string& format, int rank = -1);

// The rank the default logger's JSON records carry from now on (a --join worker learns it after
// registering); -1: none.
void set_log_rank(int rank);

// Whether setup_logging chose the json format.
bool log_is_json();

// At most `max_bytes` of `s`, never ending inside a UTF-8 character.
std::string utf8_cut(const std::string& s, size_t max_bytes);

// "1.2 of 4.4 GB (27%)": weights loaded of all, for the loading log lines and /health.
std::string bytes_progress(int64_t done, int64_t total);

// JSON string escaping (quotes included) for log lines built by hand: nlohmann::json's, with
// bytes that are not UTF-8 replaced by U+FFFD and a character cut at the end (a message cut to
// a byte limit) dropped.
std::string json_quote(const std::string& s);

// A line (without its newline) that a spawned worker of rank `rank` wrote to its stderr, as one
// record of the json format: the line as is when it already is a JSON object (the worker's own
// records), with *level -1; else {"time", "level", "logger": "burst-worker", "rank", "msg": the
// line, escaped as json_quote does}, with *level (spdlog's) warn when the line speaks of
// trouble ("error", "warn", "fail", "fatal", "abort", ...), else info.
std::string worker_line_record(std::string_view line, int rank, int* level);

// Writes worker_line_record's record to stderr (a wrapped line only at the logger's level or
// above), serialized with this process's own records; in the text format, the line itself.
void relay_worker_line(std::string_view line, int rank);

// One access-log record at `level` (spdlog's: 1 debug, 2 info, 3 warn): `text` in the text
// format; in the json format an object with time, level, logger "access" and `json_fields`
// (a fragment of JSON members, e.g. "status":200,"path":"/x").
void log_access(int level, const std::string& text, const std::string& json_fields);

}  // namespace burst::server
