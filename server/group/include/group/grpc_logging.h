// gRPC's own log lines (gpr_log: "E1128 12:00:00.000 ... message") through the default spdlog
// logger, so that with --log-format json the lines gRPC writes on a process's stderr are JSON
// records too. Called once by burst-server and burst-worker after setup_logging.
#pragma once

#include <grpc/support/log.h>
#include <spdlog/spdlog.h>

namespace burst::server {

inline void route_grpc_logs() {
  gpr_set_log_function([](gpr_log_func_args* args) {
    const auto level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                       : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                                 : spdlog::level::debug;
    spdlog::log(level, "grpc {}:{}: {}", args->file != nullptr ? args->file : "?", args->line,
                args->message != nullptr ? args->message : "");
  });
}

}  // namespace burst::server
