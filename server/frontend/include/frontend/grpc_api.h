// The public gRPC API (proto/burst/v1/burst.proto): Generate (server streaming), Tokenize,
// ModelInfo, plus the standard grpc.health.v1.Health service (SERVING only while the worker
// group serves) and server reflection, so grpcurl works without the proto file. Requests are
// translated into plain ScheduledRequest structs here: protobuf never reaches the scheduler.
// The options (sampling, stop, logprobs, ...) are read by their names from the request and its
// `sampling` message and checked by HTTP's table (request_options.h), so both APIs agree.
// With an API key set, every Burst call needs "authorization: Bearer KEY" metadata (health and
// reflection stay open, as load balancers and grpcurl discovery need them). The server takes
// the limits for slow and idle clients from the config (grpc_limits.h).
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "frontend/grpc_limits.h"
#include "frontend/scheduler.h"
#include "frontend/server_config.h"
#include "common/tokenizer.h"

namespace grpc {
class Server;
class Service;
}

namespace burst::server {

class GrpcApi {
 public:
  GrpcApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer);
  ~GrpcApi();
  // Binds config.host:config.grpc_port (0: any free port) and serves, with the config's
  // limits for slow and idle clients (GrpcLimits).
  Result<int> start();
  // Stops accepting calls; calls still running get until the deadline.
  void stop();

  class Service;

 private:
  const ServerConfig& config_;
  Scheduler& scheduler_;
  const Tokenizer& tokenizer_;
  GrpcLimits limits_;  // outlives service_ and server_ (its interceptors use it)
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Service> reflection_v1_;  // beside gRPC's own v1alpha
  std::unique_ptr<grpc::Server> server_;
  std::thread health_thread_;  // mirrors scheduler health into grpc.health.v1
  std::atomic<bool> stop_{false};
};

}  // namespace burst::server
