// The gRPC server's limits for slow and idle clients, as the HTTP front end has its own:
// - threads: grpc++'s sync server starts a thread for every call that arrives while none
//   polls, without bound (1000 calls that never sent their message held 1552 threads); a
//   ResourceQuota bounds them (--grpc-max-threads), and a call beyond gets RESOURCE_EXHAUSTED
//   at once;
// - the request message: the Burst methods read their message inside the handler (GrpcApi
//   installs them as streamed, to refuse a bad message with INVALID_ARGUMENT), so a call that
//   never sends one held its thread forever. An interceptor notes when each call starts and
//   when its first message arrives; a watchdog ends calls still waiting after
//   --grpc-message-timeout-ms with DEADLINE_EXCEEDED, which wakes their handler's read;
// - connections: a handshake deadline (gRPC's default is 120 s for a connection that never
//   speaks HTTP/2), max idle and max age (GOAWAY), keepalive pings for vanished peers;
// - one client: the Burst calls one address runs at once (--grpc-max-calls-per-client), so that
//   one client cannot hold every thread; gRPC C++ (1.51) has no per-client connection cap.
// GrpcApi makes one and applies it to the ServerBuilder it builds its server with; the limits
// must outlive that server (the interceptors and the watchdog refer to them).
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "frontend/server_config.h"

namespace grpc {
class ServerBuilder;
class ServerContextBase;
}  // namespace grpc

namespace burst::server {

class GrpcLimits {
 public:
  // Starts the watchdog; `config` must outlive this object.
  explicit GrpcLimits(const ServerConfig& config);
  ~GrpcLimits();
  GrpcLimits(const GrpcLimits&) = delete;
  GrpcLimits& operator=(const GrpcLimits&) = delete;

  // Sets the builder's thread quota, the interceptor that watches each call's message and the
  // connection limits (channel arguments). Call once, before BuildAndStart.
  void apply(grpc::ServerBuilder& builder);

  // Whether the watchdog cancelled this call (its message was late): its handler's failed read
  // is then DEADLINE_EXCEEDED, as the client saw, not a client's cancel. Valid while it runs.
  bool cancelled_late(const grpc::ServerContextBase* ctx) const;

  // A Burst call of the client at `peer` (gRPC's "ipv4:ADDR:PORT", "ipv6:[ADDR]:PORT"; the
  // port is left out) while it runs. Not admitted when that client already runs
  // --grpc-max-calls-per-client calls: the call is then to end at once with refusal().
  class ClientCall {
   public:
    ClientCall(const GrpcLimits& limits, const std::string& peer);
    ~ClientCall();
    ClientCall(const ClientCall&) = delete;
    ClientCall& operator=(const ClientCall&) = delete;
    bool admitted() const { return admitted_; }
    // RESOURCE_EXHAUSTED "too many calls from ADDR: ..." naming the flag.
    std::string refusal() const;

   private:
    const GrpcLimits& limits_;
    std::string client_;
    bool admitted_ = false;
  };

 private:
  class Interceptor;
  class InterceptorFactory;
  struct Waiting {
    std::chrono::steady_clock::time_point deadline;
    std::string method;
  };

  void watch(grpc::ServerContextBase* ctx, const char* method);
  void forget(grpc::ServerContextBase* ctx);
  void ended(grpc::ServerContextBase* ctx);
  void watch_loop();

  const ServerConfig& cfg_;
  const std::chrono::milliseconds message_timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<grpc::ServerContextBase*, Waiting> waiting_;
  std::set<const grpc::ServerContextBase*> cancelled_;  // by the watchdog, until the call ends
  mutable std::map<std::string, int> client_calls_;  // Burst calls running, by client address
  bool stop_ = false;
  std::thread watchdog_;  // last: started once the members above exist
};

}  // namespace burst::server
