// Multi-node rendezvous. WorkerRegistry is the coordinator side (burst-server --remote-workers N
// --worker-listen HOST:PORT): it serves the WorkerRegistry gRPC service (proto/burst/v1/
// worker.proto) where `burst-worker --join HOST:PORT` registers, checks that every worker loaded
// the coordinator's model, hands out ranks once N workers joined, and serves the rendezvous store
// their communicator meets through. RegistryStore is the worker side of that store.
// Sources: worker_registry.cpp (the coordinator: MemoryStore, WorkerRegistry), registry_store.cpp
// (the worker's store client), cluster_identity.cpp (cluster token, model fingerprint, addresses).
//
// Membership: a worker holds its Join stream open for as long as it belongs to the group. The
// stream breaking (process killed; a silent host is caught by HTTP/2 keepalive within ~3 s)
// removes the worker: before the group formed it just frees the slot; after, the group is
// dissolved (every other member is told to leave and rejoin) and on_member_lost runs, so the
// request in flight fails at once. Each incarnation of the group has a generation number; the
// store's keys belong to one generation, so a worker of a dissolved group can never read or
// write its successor's keys.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/auth.h"
#include "engine/attention_dtype.h"
#include "engine/kv_pages.h"
#include "engine/rendezvous_store.h"
#include "models/config.h"
#include "models/llama.h"

namespace grpc {
class Channel;
class Server;
}  // namespace grpc

namespace burst::server {

// What a worker must agree on with the coordinator: the model's architecture, vocabulary and
// special tokens, and the weights' identity (the random seed of a preset, or the total size of
// the safetensors files of a directory: paths differ between hosts, sizes do not). One line of
// text, so a mismatch can be shown to the operator as is.
std::string model_fingerprint(const models::LlamaConfig& config, const models::ModelSpec& spec);

// The store the ranks of one group meet through, kept in the coordinator's memory. Every call
// names the generation (epoch) it belongs to; reset() starts the next generation, dropping the
// keys and failing every call still waiting on the old one.
class MemoryStore {
 public:
  Status set(uint64_t epoch, const std::string& key, const std::vector<char>& value);
  Result<std::vector<char>> get(uint64_t epoch, const std::string& key,
                                std::chrono::milliseconds timeout);
  Status wait(uint64_t epoch, const std::vector<std::string>& keys,
              std::chrono::milliseconds timeout);
  void reset(uint64_t epoch);
  uint64_t epoch() const;

 private:
  Status check_epoch(uint64_t epoch) const;  // under mu_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t epoch_ = 0;
  std::map<std::string, std::vector<char>> values_;
};

struct RegistryOptions {
  std::string listen;  // HOST:PORT the workers connect to (port 0: any free port)
  int world_size = 1;
  // Tensor parallelism: ranks are handed out host by host, so that the tp consecutive ranks of
  // a tensor-parallel group share a node (a group that must span hosts is warned about).
  int tp = 1;
  std::string fingerprint;        // model_fingerprint() of the coordinator's model
  std::string device_kind = "cpu";  // "cpu" or "cuda": the communicator every rank must use
  // 0 (CUDA): each rank sizes its pool from its GPU's memory (kv_rows_from_memory) with these
  // two, as local ranks do; the ranks report their pages and the ledger takes the fewest.
  int64_t kv_capacity_per_rank = 0;
  double kv_memory_fraction = 0.9;
  int64_t kv_reserve_bytes = 0;
  engine::KvCacheDtype kv_cache_dtype = engine::KvCacheDtype::kAuto;  // every rank's pool
  engine::AttentionDtype attention_dtype = engine::AttentionDtype::kAuto;  // every rank's
  std::chrono::milliseconds comm_timeout{30000};
  // Workers must present it (kWorkerTokenKey) on Join and every Store call; the group sends it
  // on every WorkerControl call. Empty: start() takes cluster_token_from_env(); still empty:
  // any host that reaches `listen` may join (a warning says so).
  std::string cluster_token;
};

class WorkerRegistry {
 public:
  static Result<std::unique_ptr<WorkerRegistry>> start(RegistryOptions options);
  ~WorkerRegistry();  // tells the members to leave, then stops the service
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  int port() const { return port_; }
  const RegistryOptions& options() const { return options_; }
  // Workers holding a slot of the forming (or formed) group.
  int registered() const;
  // "waiting for workers (k/N registered on HOST:PORT)", for /health and refusals.
  std::string waiting_status() const;
  // Waits up to max_wait for N workers; the formed group's generation, or nullopt.
  std::optional<uint64_t> wait_formed(std::chrono::milliseconds max_wait);
  // Tells every member to leave (they rejoin) and opens the next generation. Does nothing to a
  // group that is still forming, so workers waiting for their peers keep their slots.
  void dissolve(const std::string& reason);
  // Runs (on a gRPC thread, no lock held) when a member of a formed group goes away; the group
  // has been dissolved already.
  void set_on_member_lost(std::function<void(uint64_t generation, const std::string& why)> fn);
  // The store, as seen by the coordinator for one generation.
  std::shared_ptr<engine::RendezvousStore> store_view(uint64_t generation);
  MemoryStore& store() { return store_; }

  struct Member;   // one Join stream (defined in worker_registry.cpp)
  class Service;   // the gRPC service

 private:
  explicit WorkerRegistry(RegistryOptions options);
  void leave_all(const std::string& reason);  // under mu_
  void member_gone(Member* m, const std::string& why);

  RegistryOptions options_;
  int port_ = 0;
  std::string address_;  // listen's host with the bound port
  MemoryStore store_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 1;  // under mu_
  bool formed_ = false;      // under mu_: the members of generation_ have their ranks
  bool stopping_ = false;    // under mu_
  std::vector<Member*> members_;  // under mu_: in join order (rank order once formed)
  std::mutex cb_mu_;
  std::function<void(uint64_t, const std::string&)> on_member_lost_;  // under cb_mu_
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
};

// The worker's side of the coordinator's store: one generation, over the registry's channel.
class RegistryStore final : public engine::RendezvousStore {
 public:
  // `token`: sent with every call (the cluster token; "" for none).
  RegistryStore(std::shared_ptr<grpc::Channel> channel, uint64_t generation,
                std::string token = "");
  ~RegistryStore() override;
  Status set(const std::string& key, const std::vector<char>& value) override;
  Result<std::vector<char>> get(const std::string& key,
                                std::chrono::milliseconds timeout) override;
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Authentication of the internal port (WorkerControl, WorkerRegistry): every call carries a
// token as gRPC metadata under this key. Local groups: a per-group secret the coordinator makes
// at spawn and hands to its workers through the environment ($BURST_WORKER_SECRET, never the
// command line). Multi-node: a shared cluster token ($BURST_CLUSTER_TOKEN, or a file named by
// $BURST_CLUSTER_TOKEN_FILE / burst-worker --cluster-token-file), checked by the registry on
// Join and the Store calls and by the workers' control service.
inline constexpr char kWorkerSecretEnv[] = "BURST_WORKER_SECRET";
inline constexpr char kClusterTokenEnv[] = "BURST_CLUSTER_TOKEN";
inline constexpr char kClusterTokenFileEnv[] = "BURST_CLUSTER_TOKEN_FILE";
// 32 random bytes from the kernel, as 64 hex digits.
Result<std::string> random_token();
// A token file's text without surrounding whitespace; an empty or unreadable file is an error.
Result<std::string> read_token_file(const std::string& path);
// The cluster token from $BURST_CLUSTER_TOKEN or the file named by $BURST_CLUSTER_TOKEN_FILE;
// "" when neither is set.
Result<std::string> cluster_token_from_env();

// The local address this host uses to reach `host` (the route's source address; no packet is
// sent): what a worker advertises to its peers unless told otherwise.
Result<std::string> local_address_towards(const std::string& host, int port);

// Splits "HOST:PORT" ("[v6]:PORT" too); an error names the text.
Result<std::pair<std::string, int>> split_host_port(const std::string& text);

}  // namespace burst::server
