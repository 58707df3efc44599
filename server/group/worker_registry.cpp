// The coordinator side of multi-node (server/group/include/group/worker_registry.h): MemoryStore
// (the rendezvous keys of each generation) and WorkerRegistry (the Join streams of remote
// workers, forming and dissolving the group). The worker's client of the store is in
// registry_store.cpp; the cluster token, model fingerprint and addresses in
// cluster_identity.cpp.
#include "group/worker_registry.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>

#include "burst/v1/worker.grpc.pb.h"

namespace burst::server {

namespace pb = burst::v1::internal;

namespace {

// A store call never waits longer than this, whatever the caller asked: a handler thread of
// the coordinator is held for that long.
constexpr std::chrono::milliseconds kMaxStoreWait{10 * 60 * 1000};
// How often a Join handler looks at its call: a member whose worker died is noticed within this.
constexpr std::chrono::milliseconds kMemberPoll{50};

}  // namespace

// ---- MemoryStore ----------------------------------------------------------------------------

Status MemoryStore::check_epoch(uint64_t epoch) const {
  if (epoch == epoch_) return {};
  return Status::error("rendezvous store: generation " + std::to_string(epoch) +
                       " is over (the group was dissolved; now " + std::to_string(epoch_) + ")");
}

Status MemoryStore::set(uint64_t epoch, const std::string& key, const std::vector<char>& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    BURST_RETURN_IF_ERROR(check_epoch(epoch));
    values_[key] = value;
  }
  cv_.notify_all();
  return {};
}

Result<std::vector<char>> MemoryStore::get(uint64_t epoch, const std::string& key,
                                           std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return epoch != epoch_ || values_.count(key) > 0; });
  BURST_RETURN_IF_ERROR(check_epoch(epoch));
  auto it = values_.find(key);
  if (it == values_.end()) {
    return Status::error("rendezvous store: key '" + key + "' timed out after " +
                         std::to_string(timeout.count()) + " ms");
  }
  return it->second;
}

Status MemoryStore::wait(uint64_t epoch, const std::vector<std::string>& keys,
                         std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto missing = [&]() -> const std::string* {
    for (const auto& k : keys) {
      if (!values_.count(k)) return &k;
    }
    return nullptr;
  };
  cv_.wait_for(lock, timeout, [&] { return epoch != epoch_ || !missing(); });
  BURST_RETURN_IF_ERROR(check_epoch(epoch));
  if (const std::string* k = missing()) {
    return Status::error("rendezvous store: key '" + *k + "' timed out after " +
                         std::to_string(timeout.count()) + " ms");
  }
  return {};
}

void MemoryStore::reset(uint64_t epoch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    epoch_ = epoch;
    values_.clear();
  }
  cv_.notify_all();  // waiters of the old epoch fail now instead of at their timeout
}

uint64_t MemoryStore::epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_;
}

namespace {

// The coordinator's own view of one generation's keys.
class StoreView final : public engine::RendezvousStore {
 public:
  StoreView(MemoryStore& store, uint64_t epoch) : store_(store), epoch_(epoch) {}
  Status set(const std::string& key, const std::vector<char>& value) override {
    return store_.set(epoch_, key, value);
  }
  Result<std::vector<char>> get(const std::string& key,
                                std::chrono::milliseconds timeout) override {
    return store_.get(epoch_, key, timeout);
  }
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return store_.wait(epoch_, keys, timeout);
  }

 private:
  MemoryStore& store_;
  uint64_t epoch_;
};

// "vocab: server 32000, worker 4099; layers: ..." for the fields two fingerprints disagree on.
std::string fingerprint_difference(const std::string& server, const std::string& worker) {
  auto fields = [](const std::string& text) {
    std::map<std::string, std::string> out;
    size_t i = 0;
    while (i < text.size()) {
      const size_t eq = text.find('=', i);
      if (eq == std::string::npos) break;
      // A value ends where the next " key=" starts (weights=... holds spaces).
      size_t end = text.find('=', eq + 1);
      end = end == std::string::npos ? text.size() : text.rfind(' ', end);
      out[text.substr(i, eq - i)] = text.substr(eq + 1, end - eq - 1);
      i = end + 1;
    }
    return out;
  };
  const auto a = fields(server), b = fields(worker);
  std::string diff;
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    const std::string other = it == b.end() ? "(none)" : it->second;
    if (other == value) continue;
    diff += (diff.empty() ? "" : "; ") + key + ": server " + value + ", worker " + other;
  }
  return diff.empty() ? "the fingerprints differ" : diff;
}

std::chrono::milliseconds clamp_wait(int64_t ms) {
  return std::clamp(std::chrono::milliseconds(ms), std::chrono::milliseconds(0), kMaxStoreWait);
}

}  // namespace

// ---- WorkerRegistry -------------------------------------------------------------------------

struct WorkerRegistry::Member {
  std::string peer;  // as gRPC saw the connection
  std::string host;  // as the worker advertises itself
  int64_t pid = 0;
  uint64_t generation = 0;
  int rank = -1;
  bool assigned = false;  // under mu_: the group formed; rank is set
  bool leave = false;     // under mu_: dissolved; the handler tells the worker and returns
  std::string leave_reason;

  std::string name() const {
    return (rank >= 0 ? "worker rank " + std::to_string(rank) : std::string("worker")) + " (" +
           host + ", pid " + std::to_string(pid) + ")";
  }
};

class WorkerRegistry::Service final : public pb::WorkerRegistry::Service {
 public:
  explicit Service(WorkerRegistry& r) : r_(r) {}

  // Every call must carry the cluster token when there is one.
  grpc::Status authorize(const grpc::ServerContext* ctx) const {
    const std::string& token = r_.options_.cluster_token;
    if (token.empty()) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    const auto it = md.find(kWorkerTokenKey);
    const std::string got = it == md.end() ? "" : std::string(it->second.data(), it->second.size());
    if (it != md.end() && token_equal(token, got)) return grpc::Status::OK;
    return {grpc::StatusCode::UNAUTHENTICATED,
            std::string(it == md.end() ? "no" : "a wrong") +
                " cluster token: start burst-worker with the server's token ($" +
                kClusterTokenEnv + " or --cluster-token-file)"};
  }

  // Whether the worker's device and model are the group's.
  grpc::Status check_worker(const pb::JoinRequest& req) const {
    const RegistryOptions& o = r_.options_;
    if (req.device_kind() != o.device_kind) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "device mismatch: this server's group runs on " + o.device_kind +
                  " workers (its \"device\" setting); this worker runs on " + req.device_kind()};
    }
    if (req.fingerprint() != o.fingerprint) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "model mismatch (" + fingerprint_difference(o.fingerprint, req.fingerprint()) +
                  "): start the worker with the server's model [" + o.fingerprint + "]"};
    }
    return grpc::Status::OK;
  }

  // m joins the current generation, unless the server stops or the group is full; the last
  // member to join forms the group.
  grpc::Status add_member(Member& m, bool rejoin) {
    std::lock_guard<std::mutex> lock(r_.mu_);
    if (r_.stopping_) return {grpc::StatusCode::UNAVAILABLE, "the server is shutting down"};
    const int n = r_.options_.world_size;
    if (static_cast<int>(r_.members_.size()) >= n) {
      // A worker whose own group just broke may race the coordinator noticing it: it waits
      // (UNAVAILABLE: retry). A fresh worker beyond N is an operator mistake: refused.
      return {rejoin ? grpc::StatusCode::UNAVAILABLE : grpc::StatusCode::RESOURCE_EXHAUSTED,
              "the group is full: " + std::to_string(n) + " of " + std::to_string(n) +
                  " workers are registered (generation " + std::to_string(r_.generation_) +
                  "); this worker is one too many"};
    }
    m.generation = r_.generation_;
    r_.members_.push_back(&m);
    spdlog::info("{} joined from {} ({}/{} registered)", m.name(), m.peer, r_.members_.size(),
                 n);
    if (static_cast<int>(r_.members_.size()) == n) form_group();
    return grpc::Status::OK;
  }

  // Under mu_, with every member registered: ranks in join order, host by host, given only
  // now: a worker that leaves while the group forms must not leave a hole in the ranks, and a
  // tensor-parallel group's ranks should share a node.
  void form_group() {
    const RegistryOptions& o = r_.options_;
    const int n = o.world_size;
    std::stable_sort(r_.members_.begin(), r_.members_.end(),
                     [](const Member* a, const Member* b) { return a->host < b->host; });
    for (int i = 0; i < n; ++i) {
      r_.members_[i]->rank = i;
      r_.members_[i]->assigned = true;
      if (o.tp > 1 && i % o.tp != 0 && r_.members_[i]->host != r_.members_[i - 1]->host) {
        spdlog::warn("tensor-parallel group {} spans hosts {} and {}: its all-reduces "
                     "cross the network (start a multiple of tp = {} workers on each host)",
                     i / o.tp, r_.members_[i - 1]->host, r_.members_[i]->host, o.tp);
      }
    }
    r_.formed_ = true;
    spdlog::info("worker group generation {} formed: {} workers", r_.generation_, n);
    r_.cv_.notify_all();
  }

  // What a member is told once the group formed: its rank and the group's settings.
  pb::JoinEvent assigned_event(const Member& m) const {
    const RegistryOptions& o = r_.options_;
    pb::JoinEvent ev;
    auto* a = ev.mutable_assigned();
    a->set_rank(m.rank);
    a->set_world_size(o.world_size);
    a->set_generation(m.generation);
    a->set_kv_capacity(o.kv_capacity_per_rank);
    a->set_kv_memory_fraction(o.kv_memory_fraction);
    a->set_kv_reserve_bytes(o.kv_reserve_bytes);
    a->set_tp(o.tp);
    a->set_kv_cache_dtype(engine::kv_cache_dtype_name(o.kv_cache_dtype));
    a->set_attention_dtype(engine::attention_dtype_name(o.attention_dtype));
    a->set_comm_timeout_ms(o.comm_timeout.count());
    return ev;
  }

  grpc::Status Join(grpc::ServerContext* ctx, const pb::JoinRequest* req,
                    grpc::ServerWriter<pb::JoinEvent>* writer) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) {
      spdlog::warn("refused a worker from {}: {}", ctx->peer(), a.error_message());
      return a;
    }
    if (grpc::Status c = check_worker(*req); !c.ok()) return c;
    Member m;
    m.peer = ctx->peer();
    m.host = req->host().empty() ? m.peer : req->host();
    m.pid = req->pid();
    if (grpc::Status added = add_member(m, req->rejoin()); !added.ok()) return added;
    bool sent = false;
    while (true) {
      bool to_send = false;
      {
        std::unique_lock<std::mutex> lock(r_.mu_);
        r_.cv_.wait_for(lock, kMemberPoll, [&] { return (m.assigned && !sent) || m.leave; });
        if (m.leave) {
          pb::JoinEvent ev;
          ev.mutable_leave()->set_reason(m.leave_reason);
          lock.unlock();
          writer->Write(ev);
          return grpc::Status::OK;
        }
        to_send = m.assigned && !sent;
      }
      if (ctx->IsCancelled()) {
        r_.member_gone(&m, "its Join stream broke (the process died or its host is unreachable)");
        return {grpc::StatusCode::CANCELLED, "the worker left"};
      }
      if (to_send) {
        if (!writer->Write(assigned_event(m))) {
          r_.member_gone(&m, "its Join stream broke before it got its rank");
          return {grpc::StatusCode::CANCELLED, "the worker left"};
        }
        sent = true;
      }
    }
  }

  grpc::Status StoreSet(grpc::ServerContext* ctx, const pb::StoreSetRequest* req,
                        pb::StoreSetResponse*) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    const Status st = r_.store_.set(req->generation(), req->key(),
                                    std::vector<char>(req->value().begin(), req->value().end()));
    if (!st.ok()) return {grpc::StatusCode::FAILED_PRECONDITION, st.message()};
    return grpc::Status::OK;
  }

  grpc::Status StoreGet(grpc::ServerContext* ctx, const pb::StoreGetRequest* req,
                        pb::StoreGetResponse* out) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    auto v = r_.store_.get(req->generation(), req->key(), clamp_wait(req->timeout_ms()));
    if (!v.ok()) return error_of(req->generation(), v.message());
    out->set_value(std::string(v.value().begin(), v.value().end()));
    return grpc::Status::OK;
  }

  grpc::Status StoreWait(grpc::ServerContext* ctx, const pb::StoreWaitRequest* req,
                         pb::StoreWaitResponse*) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    const std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    const Status st = r_.store_.wait(req->generation(), keys, clamp_wait(req->timeout_ms()));
    if (!st.ok()) return error_of(req->generation(), st.message());
    return grpc::Status::OK;
  }

 private:
  grpc::Status error_of(uint64_t generation, const std::string& msg) const {
    return {r_.store_.epoch() == generation ? grpc::StatusCode::DEADLINE_EXCEEDED
                                            : grpc::StatusCode::FAILED_PRECONDITION,
            msg};
  }

  WorkerRegistry& r_;
};

WorkerRegistry::WorkerRegistry(RegistryOptions options) : options_(std::move(options)) {
  store_.reset(generation_);
}

Result<std::unique_ptr<WorkerRegistry>> WorkerRegistry::start(RegistryOptions options) {
  if (options.world_size < 1) return Status::error("the worker registry needs world_size >= 1");
  auto hp = split_host_port(options.listen);
  if (!hp.ok()) return Status::error("worker listen address: " + hp.message());
  if (options.cluster_token.empty()) {
    auto token = cluster_token_from_env();
    if (!token.ok()) return token.status();
    options.cluster_token = token.value();
  }
  if (options.cluster_token.empty()) {
    spdlog::warn("no cluster token (${} or ${}): any host that reaches {} can join the worker "
                 "group and drive the workers",
                 kClusterTokenEnv, kClusterTokenFileEnv, options.listen);
  }
  std::unique_ptr<WorkerRegistry> r(new WorkerRegistry(std::move(options)));
  r->service_ = std::make_unique<Service>(*r);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(r->options_.listen, grpc::InsecureServerCredentials(), &r->port_);
  // Keepalive: a member whose host vanished without closing its connection (power loss, a
  // cut link) is dropped within ~3 s, which ends its Join stream. Workers ping us every 2 s
  // to notice the coordinator's loss the same way; accept that without strikes.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.RegisterService(r->service_.get());
  r->server_ = builder.BuildAndStart();
  if (!r->server_ || r->port_ == 0) {
    return Status::error("cannot listen for workers on " + r->options_.listen +
                         " (address in use or not local?)");
  }
  const std::string& host = hp.value().first;
  r->address_ = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                std::to_string(r->port_);
  return r;
}

WorkerRegistry::~WorkerRegistry() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    leave_all("the server is shutting down");
  }
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

int WorkerRegistry::registered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(members_.size());
}

std::string WorkerRegistry::waiting_status() const {
  return "waiting for workers (" + std::to_string(registered()) + "/" +
         std::to_string(options_.world_size) + " registered on " + address_ + ")";
}

std::optional<uint64_t> WorkerRegistry::wait_formed(std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, max_wait, [&] { return formed_ || stopping_; });
  if (!formed_) return std::nullopt;
  return generation_;
}

void WorkerRegistry::leave_all(const std::string& reason) {
  for (Member* m : members_) {
    m->leave = true;
    m->leave_reason = reason;
  }
  members_.clear();
  formed_ = false;
  ++generation_;
  store_.reset(generation_);
  cv_.notify_all();
}

void WorkerRegistry::dissolve(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!formed_) return;
  spdlog::warn("dissolving worker group generation {}: {}", generation_, reason);
  leave_all(reason);
}

void WorkerRegistry::member_gone(Member* m, const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_);
  if (m->leave) return;  // dissolved already; no longer listed
  auto it = std::find(members_.begin(), members_.end(), m);
  if (it == members_.end()) return;
  if (!formed_) {
    members_.erase(it);
    spdlog::warn("{} left before the group formed: {} ({}/{} registered)", m->name(), why,
                 members_.size(), options_.world_size);
    return;
  }
  const uint64_t generation = generation_;
  const std::string msg = m->name() + " left: " + why;
  spdlog::error("worker group generation {} lost {}", generation, msg);
  leave_all(msg);
  lock.unlock();
  // cb_mu_, not mu_: the callback takes the group's locks, and set_on_member_lost(nullptr)
  // must wait for a callback in progress before its owner goes away.
  std::lock_guard<std::mutex> cb_lock(cb_mu_);
  if (on_member_lost_) on_member_lost_(generation, msg);
}

void WorkerRegistry::set_on_member_lost(
    std::function<void(uint64_t generation, const std::string& why)> fn) {
  std::lock_guard<std::mutex> lock(cb_mu_);
  on_member_lost_ = std::move(fn);
}

std::shared_ptr<engine::RendezvousStore> WorkerRegistry::store_view(uint64_t generation) {
  return std::make_shared<StoreView>(store_, generation);
}

}  // namespace burst::server
