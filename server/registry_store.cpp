// The worker side of the coordinator's rendezvous store (RegistryStore,
// server/include/server/worker_registry.h): set / get / wait as WorkerRegistry RPCs of one
// generation, with the cluster token and a deadline of the store's own wait plus slack.
#include <grpcpp/grpcpp.h>

#include "burst/v1/worker.grpc.pb.h"
#include "server/worker_registry.h"

namespace burst::server {

namespace pb = burst::v1::internal;

// ---- RegistryStore (worker side) ------------------------------------------------------------

struct RegistryStore::Impl {
  std::unique_ptr<pb::WorkerRegistry::Stub> stub;
  uint64_t generation = 0;
  std::string token;

  void authorize(grpc::ClientContext* ctx) const {
    if (!token.empty()) ctx->AddMetadata(kWorkerTokenKey, token);
  }

  // The RPC gets the store's own wait plus slack, so a slow network is not taken for a
  // missing key.
  static void deadline(grpc::ClientContext* ctx, std::chrono::milliseconds wait) {
    ctx->set_deadline(std::chrono::system_clock::now() + wait + std::chrono::seconds(10));
  }
  static Status error(const std::string& what, const grpc::Status& st) {
    return Status::error("coordinator store " + what + ": " + st.error_message() + " (gRPC code " +
                         std::to_string(static_cast<int>(st.error_code())) + ")");
  }
};

RegistryStore::RegistryStore(std::shared_ptr<grpc::Channel> channel, uint64_t generation,
                             std::string token)
    : impl_(std::make_unique<Impl>()) {
  impl_->stub = pb::WorkerRegistry::NewStub(std::move(channel));
  impl_->generation = generation;
  impl_->token = std::move(token);
}

RegistryStore::~RegistryStore() = default;

Status RegistryStore::set(const std::string& key, const std::vector<char>& value) {
  grpc::ClientContext ctx;
  impl_->authorize(&ctx);
  Impl::deadline(&ctx, std::chrono::milliseconds(0));
  pb::StoreSetRequest req;
  req.set_generation(impl_->generation);
  req.set_key(key);
  req.set_value(std::string(value.begin(), value.end()));
  pb::StoreSetResponse resp;
  const grpc::Status st = impl_->stub->StoreSet(&ctx, req, &resp);
  if (!st.ok()) return Impl::error("set '" + key + "'", st);
  return {};
}

Result<std::vector<char>> RegistryStore::get(const std::string& key,
                                             std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  impl_->authorize(&ctx);
  Impl::deadline(&ctx, timeout);
  pb::StoreGetRequest req;
  req.set_generation(impl_->generation);
  req.set_key(key);
  req.set_timeout_ms(timeout.count());
  pb::StoreGetResponse resp;
  const grpc::Status st = impl_->stub->StoreGet(&ctx, req, &resp);
  if (!st.ok()) return Impl::error("get '" + key + "'", st);
  return std::vector<char>(resp.value().begin(), resp.value().end());
}

Status RegistryStore::wait(const std::vector<std::string>& keys,
                           std::chrono::milliseconds timeout) {
  grpc::ClientContext ctx;
  impl_->authorize(&ctx);
  Impl::deadline(&ctx, timeout);
  pb::StoreWaitRequest req;
  req.set_generation(impl_->generation);
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(timeout.count());
  pb::StoreWaitResponse resp;
  const grpc::Status st = impl_->stub->StoreWait(&ctx, req, &resp);
  if (!st.ok()) return Impl::error("wait (" + std::to_string(keys.size()) + " keys)", st);
  return {};
}

}  // namespace burst::server
