// Secrets compared without leaking where they differ: the worker token the coordinator sends
// its workers (metadata key kWorkerTokenKey) and the API key of the HTTP and gRPC frontends.
#pragma once

#include <string>

namespace burst::server {

// The gRPC metadata key every WorkerControl / WorkerRegistry call carries the token in.
inline constexpr char kWorkerTokenKey[] = "x-burst-worker-token";

// Constant-time comparison (the time taken does not depend on where the texts differ).
bool token_equal(const std::string& expected, const std::string& got);

}  // namespace burst::server
