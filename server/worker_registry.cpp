#include "server/worker_registry.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "burst/v1/worker.grpc.pb.h"

namespace burst::server {

namespace pb = burst::v1::internal;
namespace fs = std::filesystem;

namespace {

// A store call never waits longer than this, whatever the caller asked: a handler thread of
// the coordinator is held for that long.
constexpr std::chrono::milliseconds kMaxStoreWait{10 * 60 * 1000};
// How often a Join handler looks at its call: a member whose worker died is noticed within this.
constexpr std::chrono::milliseconds kMemberPoll{50};

std::string float_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string weights_identity(const models::ModelSpec& spec) {
  if (spec.dir.empty()) return "random(" + std::to_string(spec.random_seed) + ")";
  // Paths differ from host to host; the files' count and total size do not.
  int64_t files = 0, bytes = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(spec.dir, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    bytes += static_cast<int64_t>(e.file_size(ec));
  }
  return "safetensors(" + std::to_string(files) + " files, " + std::to_string(bytes) + " bytes)";
}

}  // namespace

Result<std::string> random_token() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::error(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

bool token_equal(const std::string& expected, const std::string& got) {
  // Every byte of `expected` is looked at whatever `got` holds; only the length (not secret:
  // 64 hex digits, or the operator's token) shows.
  volatile unsigned char diff = expected.size() != got.size() ? 1 : 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < got.size() ? static_cast<unsigned char>(got[i]) : 0;
    diff = static_cast<unsigned char>(diff | (static_cast<unsigned char>(expected[i]) ^ g));
  }
  return diff == 0;
}

Result<std::string> read_token_file(const std::string& path) {
  auto text = models::read_regular_file(path, 4096);
  if (!text.ok()) return Status::error("cluster token file: " + text.message());
  std::string t = text.value();
  const auto first = t.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return Status::error("cluster token file " + path + " is empty");
  t = t.substr(first, t.find_last_not_of(" \t\r\n") - first + 1);
  return t;
}

Result<std::string> cluster_token_from_env() {
  const char* t = std::getenv(kClusterTokenEnv);
  if (t != nullptr && *t != '\0') return std::string(t);
  const char* f = std::getenv(kClusterTokenFileEnv);
  if (f != nullptr && *f != '\0') return read_token_file(f);
  return std::string();
}

std::string model_fingerprint(const models::LlamaConfig& c, const models::ModelSpec& spec) {
  std::string rope = "none";
  if (c.rope_scaling.kind == models::RopeScaling::Kind::kLinear) {
    rope = "linear:" + float_text(c.rope_scaling.factor);
  } else if (c.rope_scaling.kind == models::RopeScaling::Kind::kDynamic) {
    rope = "dynamic:" + float_text(c.rope_scaling.factor);
  }
  return "hidden=" + std::to_string(c.hidden_size) +
         " intermediate=" + std::to_string(c.intermediate_size) +
         " layers=" + std::to_string(c.num_layers) + " heads=" + std::to_string(c.num_heads) +
         " kv_heads=" + std::to_string(c.num_kv_heads) +
         " head_dim=" + std::to_string(c.head_dim) + " vocab=" + std::to_string(c.vocab_size) +
         " max_positions=" + std::to_string(c.max_position_embeddings) +
         " rms_eps=" + float_text(c.rms_norm_eps) + " rope_theta=" + float_text(c.rope_theta) +
         " rope_scaling=" + rope + " tied=" + (c.tie_word_embeddings ? "1" : "0") +
         " dtype=" + engine::dtype_name(c.torch_dtype) + " bos=" + std::to_string(c.bos_token_id) +
         " eos=" + std::to_string(c.eos_token_id) + " weights=" + weights_identity(spec);
}

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

  grpc::Status Join(grpc::ServerContext* ctx, const pb::JoinRequest* req,
                    grpc::ServerWriter<pb::JoinEvent>* writer) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) {
      spdlog::warn("refused a worker from {}: {}", ctx->peer(), a.error_message());
      return a;
    }
    const RegistryOptions& o = r_.options_;
    if (req->device_kind() != o.device_kind) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "device mismatch: this server's group runs on " + o.device_kind +
                  " workers (its \"device\" setting); this worker runs on " + req->device_kind()};
    }
    if (req->fingerprint() != o.fingerprint) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "model mismatch (" + fingerprint_difference(o.fingerprint, req->fingerprint()) +
                  "): start the worker with the server's model [" + o.fingerprint + "]"};
    }
    Member m;
    m.peer = ctx->peer();
    m.host = req->host().empty() ? m.peer : req->host();
    m.pid = req->pid();
    {
      std::lock_guard<std::mutex> lock(r_.mu_);
      if (r_.stopping_) return {grpc::StatusCode::UNAVAILABLE, "the server is shutting down"};
      const int n = o.world_size;
      if (static_cast<int>(r_.members_.size()) >= n) {
        // A worker whose own group just broke may race the coordinator noticing it: it waits
        // (UNAVAILABLE: retry). A fresh worker beyond N is an operator mistake: refused.
        return {req->rejoin() ? grpc::StatusCode::UNAVAILABLE
                              : grpc::StatusCode::RESOURCE_EXHAUSTED,
                "the group is full: " + std::to_string(n) + " of " + std::to_string(n) +
                    " workers are registered (generation " + std::to_string(r_.generation_) +
                    "); this worker is one too many"};
      }
      m.generation = r_.generation_;
      r_.members_.push_back(&m);
      spdlog::info("{} joined from {} ({}/{} registered)", m.name(), m.peer,
                   r_.members_.size(), n);
      if (static_cast<int>(r_.members_.size()) == n) {
        // Ranks in join order, given only now: a worker that leaves while the group forms
        // must not leave a hole in the ranks.
        for (int i = 0; i < n; ++i) {
          r_.members_[i]->rank = i;
          r_.members_[i]->assigned = true;
        }
        r_.formed_ = true;
        spdlog::info("worker group generation {} formed: {} workers", r_.generation_, n);
        r_.cv_.notify_all();
      }
    }
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
        pb::JoinEvent ev;
        auto* a = ev.mutable_assigned();
        a->set_rank(m.rank);
        a->set_world_size(o.world_size);
        a->set_generation(m.generation);
        a->set_kv_capacity(o.kv_capacity_per_rank);
        a->set_kv_memory_fraction(o.kv_memory_fraction);
        a->set_kv_reserve_bytes(o.kv_reserve_bytes);
        a->set_comm_timeout_ms(o.comm_timeout.count());
        if (!writer->Write(ev)) {
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

// ---- addresses ------------------------------------------------------------------------------

Result<std::pair<std::string, int>> split_host_port(const std::string& text) {
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::error("'" + text + "' is not [IPV6]:PORT");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return Status::error("'" + text + "' is not HOST:PORT");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) return Status::error("'" + text + "' has no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port) > 65535) {
    return Status::error("'" + text + "' has no valid port (0..65535)");
  }
  return std::make_pair(host, std::stoi(port));
}

Result<std::string> local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) return Status::error("cannot resolve " + host + ": " + gai_strerror(rc));
  std::string out, why = "no address";
  for (addrinfo* a = found; a && out.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, 0);
    if (fd < 0) continue;
    // connect() on a UDP socket only picks the route (and so the source address).
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {};
      const void* addr = local.ss_family == AF_INET6
                             ? static_cast<const void*>(
                                   &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                             : static_cast<const void*>(
                                   &reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, addr, buf, sizeof buf)) out = buf;
    } else {
      why = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (out.empty()) return Status::error("no route to " + host + ": " + why);
  return out;
}

}  // namespace burst::server
