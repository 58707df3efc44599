// The worker side of the coordinator's rendezvous store (RegistryStore,
// server/group/include/group/worker_registry.h): set / get / wait as WorkerRegistry RPCs of one
// generation, with the cluster token and a deadline of the store's own wait plus slack.
#include <grpcpp/grpcpp.h>

#include "burst/v1/worker.grpc.pb.h"
#include "group/worker_registry.h"

namespace burst::server {

namespace pb = burst::v1::internal;

// ---- RegistryStore (worker side) ------------------------------------------------------------

struct RegistryStore::Impl {
  std::unique_ptr<pb::WorkerRegistry::Stub> stub;
  uint64_t generation = 0;
  std::string token;

  // One store RPC: the token, a deadline of the store's own wait plus slack (so a slow network
  // is not taken for a missing key), this generation; `what` names the call in errors.
  template <typename Req, typename Resp, typename Call>
  Status call(Call rpc, Req& req, Resp& resp, std::chrono::milliseconds wait,
              const std::string& what) const {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata(kWorkerTokenKey, token);
    ctx.set_deadline(std::chrono::system_clock::now() + wait + std::chrono::seconds(10));
    req.set_generation(generation);
    const grpc::Status st = (stub.get()->*rpc)(&ctx, req, &resp);
    if (st.ok()) return {};
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
  pb::StoreSetRequest req;
  req.set_key(key);
  req.set_value(std::string(value.begin(), value.end()));
  pb::StoreSetResponse resp;
  return impl_->call(&pb::WorkerRegistry::Stub::StoreSet, req, resp,
                     std::chrono::milliseconds(0), "set '" + key + "'");
}

Result<std::vector<char>> RegistryStore::get(const std::string& key,
                                             std::chrono::milliseconds timeout) {
  pb::StoreGetRequest req;
  req.set_key(key);
  req.set_timeout_ms(timeout.count());
  pb::StoreGetResponse resp;
  BURST_RETURN_IF_ERROR(impl_->call(&pb::WorkerRegistry::Stub::StoreGet, req, resp, timeout,
                                    "get '" + key + "'"));
  return std::vector<char>(resp.value().begin(), resp.value().end());
}

Status RegistryStore::wait(const std::vector<std::string>& keys,
                           std::chrono::milliseconds timeout) {
  pb::StoreWaitRequest req;
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(timeout.count());
  pb::StoreWaitResponse resp;
  return impl_->call(&pb::WorkerRegistry::Stub::StoreWait, req, resp, timeout,
                     "wait (" + std::to_string(keys.size()) + " keys)");
}

}  // namespace burst::server
