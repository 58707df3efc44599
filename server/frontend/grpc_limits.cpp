// GrpcLimits (see the header): the thread quota, the channel arguments for connections, the
// interceptor and watchdog that end calls whose request message does not arrive in time, and
// the count of each client's calls.
#include "frontend/grpc_limits.h"

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/support/server_interceptor.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace burst::server {

GrpcLimits::GrpcLimits(const ServerConfig& config)
    : cfg_(config), message_timeout_(config.grpc_message_timeout_ms),
      watchdog_([this] { watch_loop(); }) {}

GrpcLimits::~GrpcLimits() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watchdog_.join();
}

// A call has started: its message is due within message_timeout_.
void GrpcLimits::watch(grpc::ServerContextBase* ctx, const char* method) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_[ctx] = {std::chrono::steady_clock::now() + message_timeout_, method};
  cv_.notify_all();
}

// Its message arrived, or it ends: no longer watched. Takes the lock the watchdog cancels
// under, so the context outlives any cancel in progress.
void GrpcLimits::forget(grpc::ServerContextBase* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_.erase(ctx);
}

// The call ends (its interceptor goes, before its context does): nothing of it is kept.
void GrpcLimits::ended(grpc::ServerContextBase* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_.erase(ctx);
  cancelled_.erase(ctx);
}

bool GrpcLimits::cancelled_late(const grpc::ServerContextBase* ctx) const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_.count(ctx) > 0;
}

namespace {

// "ipv4:10.0.0.1:5000" -> "ipv4:10.0.0.1", "ipv6:[::1]:5000" -> "ipv6:[::1]"; anything else
// (a Unix socket) as it is.
std::string client_of(const std::string& peer) {
  if (peer.rfind("ipv6:[", 0) == 0) {
    const size_t close = peer.find(']');
    return close == std::string::npos ? peer : peer.substr(0, close + 1);
  }
  if (peer.rfind("ipv4:", 0) == 0) {
    const size_t colon = peer.rfind(':');
    return colon > 4 ? peer.substr(0, colon) : peer;
  }
  return peer;
}

}  // namespace

GrpcLimits::ClientCall::ClientCall(const GrpcLimits& limits, const std::string& peer)
    : limits_(limits), client_(client_of(peer)) {
  const int max = limits_.cfg_.grpc_max_calls_per_client;
  std::lock_guard<std::mutex> lock(limits_.mu_);
  int& running = limits_.client_calls_[client_];
  admitted_ = max <= 0 || running < max;
  if (admitted_) {
    ++running;
  } else if (running == 0) {
    limits_.client_calls_.erase(client_);
  }
}

GrpcLimits::ClientCall::~ClientCall() {
  if (!admitted_) return;
  std::lock_guard<std::mutex> lock(limits_.mu_);
  const auto it = limits_.client_calls_.find(client_);
  if (it != limits_.client_calls_.end() && --it->second <= 0) limits_.client_calls_.erase(it);
}

std::string GrpcLimits::ClientCall::refusal() const {
  return "too many calls from " + client_ + ": this server runs at most " +
         std::to_string(limits_.cfg_.grpc_max_calls_per_client) +
         " at once for one client (--grpc-max-calls-per-client); retry";
}

void GrpcLimits::watch_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    auto next = std::chrono::steady_clock::time_point::max();
    const auto now = std::chrono::steady_clock::now();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (it->second.deadline > now) {
        next = std::min(next, it->second.deadline);
        ++it;
        continue;
      }
      // Thread-safe in gRPC core; ends the call with this status (the client sees it) and
      // fails the handler's pending read, which frees its thread.
      const std::string why = "the request message did not arrive within " +
                              std::to_string(message_timeout_.count()) +
                              " ms of the call's start (--grpc-message-timeout-ms)";
      spdlog::warn("gRPC {} from {}: {}; cancelled", it->second.method, it->first->peer(), why);
      const grpc_call_error err = grpc_call_cancel_with_status(
          it->first->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED, why.c_str(), nullptr);
      if (err != GRPC_CALL_OK) {
        spdlog::warn("gRPC: cancelling a call failed ({})", err);
      } else {
        cancelled_.insert(it->first);
      }
      it = waiting_.erase(it);
    }
    if (next == std::chrono::steady_clock::time_point::max()) {
      cv_.wait(lock);
    } else {
      cv_.wait_until(lock, next);
    }
  }
}

// Watches one call from its start until its first message (POST_RECV_MESSAGE also marks a
// read that found no message) or its status.
class GrpcLimits::Interceptor : public grpc::experimental::Interceptor {
 public:
  Interceptor(GrpcLimits& limits, grpc::experimental::ServerRpcInfo* info)
      : limits_(limits), info_(info) {}
  ~Interceptor() override { limits_.ended(info_->server_context()); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      limits_.watch(info_->server_context(), info_->method());
      watching_ = true;
    }
    if (watching_ &&
        (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) ||
         methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS))) {
      limits_.forget(info_->server_context());
      watching_ = false;
    }
    methods->Proceed();
  }

 private:
  GrpcLimits& limits_;
  grpc::experimental::ServerRpcInfo* info_;
  bool watching_ = false;  // the call's own thread's (hooks of one call run in turn)
};

class GrpcLimits::InterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit InterceptorFactory(GrpcLimits& limits) : limits_(limits) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new Interceptor(limits_, info);
  }

 private:
  GrpcLimits& limits_;
};

void GrpcLimits::apply(grpc::ServerBuilder& builder) {
  // The sync server's threads come from the builder's quota (unbounded without one).
  grpc::ResourceQuota quota("burst-grpc");
  quota.SetMaxThreads(cfg_.grpc_max_threads);
  builder.SetResourceQuota(quota);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> f;
  f.push_back(std::make_unique<InterceptorFactory>(*this));
  builder.experimental().SetInterceptorCreators(std::move(f));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, cfg_.grpc_handshake_timeout_ms);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, cfg_.grpc_max_connection_idle_ms);
  if (cfg_.grpc_max_connection_age_ms > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, cfg_.grpc_max_connection_age_ms);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, cfg_.drain_timeout_ms);
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, cfg_.grpc_keepalive_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
}

}  // namespace burst::server
