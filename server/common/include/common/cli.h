// The command lines of burst-server, burst-worker and burst-generate, on CLI11 (Debian
// libcli11-dev). One set of conventions for the three: `--flag VALUE` and `--flag=VALUE`; the
// last of a repeated flag wins (a script may append an override to a base command line);
// errors in one wording ("unknown flag --x", "missing value for --x", "bad value 'v' for --x");
// --help prints the program's synopsis, then every flag registered on the App with its
// description, wrapped to 100 columns. A flag is one add_option / add_flag call: --help lists
// it from there.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/attention_dtype.h"
#include "engine/kv_pages.h"

namespace burst::server {

// An App for `program` with burst's conventions; `synopsis` ("usage: PROGRAM ...", one or more
// lines) opens its --help.
std::unique_ptr<CLI::App> make_cli(const std::string& program, const std::string& synopsis);

// --kv-cache-dtype D on `app` into *target (engine::parse_kv_cache_dtype; a bad value is refused
// with its message), with `help` as its --help line.
CLI::Option* add_kv_cache_dtype_option(CLI::App& app, engine::KvCacheDtype& target,
                                       const std::string& help);
// --attention-dtype D likewise (engine::parse_attention_dtype).
CLI::Option* add_attention_dtype_option(CLI::App& app, engine::AttentionDtype& target,
                                        const std::string& help);

// Parses argv into the App's bindings. Returns "" on success or the error; --help / -h sets
// *help and stops (nothing after it is checked).
std::string parse_cli(CLI::App& app, int argc, char** argv, bool* help);

}  // namespace burst::server
