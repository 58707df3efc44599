#include "worker/worker_join.h"

#include <dirent.h>
#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "burst/v1/worker.grpc.pb.h"
#include "common/auth.h"
#include "group/worker_registry.h"
#include "worker/worker_rank.h"
#include "worker/worker_service.h"

namespace burst::worker {
namespace {

namespace srv = burst::server;

// Set in the environment of a re-executed --join worker: it comes back from a broken group.
constexpr const char* kRejoinEnv = "BURST_WORKER_REJOIN";

// What registering set up, for the member it leads to.
struct Registration {
  std::shared_ptr<grpc::Channel> channel;  // to the registry, which also serves the store
  std::string token;                       // the cluster token (empty: none)
  std::string host;                        // the address this worker is reached at
};

// Replaces this process with a fresh copy of itself that registers again (see the top of
// worker_main.cpp for why not in-process). Descriptors are not inherited: the old group's
// sockets close.
[[noreturn]] void rejoin(WorkerProcess& process, char** argv) {
  if (process.begin_leaving()) std::_Exit(0);  // asked to stop while the group dissolved: stop
  DIR* d = opendir("/proc/self/fd");
  if (d) {
    while (dirent* e = readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd > 2) fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    closedir(d);
  }
  setenv(kRejoinEnv, "1", 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the coordinator notice
  execv("/proc/self/exe", argv);
  process.fail(std::string("cannot re-execute /proc/self/exe to rejoin: ") +
               std::strerror(errno));
  std::_Exit(1);
}

// The cluster token: --cluster-token-file, else the environment (empty: none).
Result<std::string> join_token(const Args& a) {
  return a.cluster_token_file.empty() ? srv::cluster_token_from_env()
                                      : srv::read_token_file(a.cluster_token_file);
}

// The address the other ranks and the server reach this worker at: --advertise-host, else the
// local address of the route towards the server.
Result<std::string> advertised_host(const Args& a) {
  if (!a.advertise_host.empty()) return a.advertise_host;
  const auto hp = srv::split_host_port(a.join).value();
  auto local = srv::local_address_towards(hp.first, hp.second);
  if (!local.ok()) {
    return Status::error("cannot find this host's address towards " + a.join + ": " +
                         local.message() + " (set --advertise-host)");
  }
  return local.value();
}

std::shared_ptr<grpc::Channel> registry_channel(const std::string& target) {
  grpc::ChannelArguments ch_args;
  // Keepalive: a coordinator that vanished without closing the connection is noticed within
  // ~4 s, and this worker goes back to registering.
  ch_args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  ch_args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  ch_args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  ch_args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), ch_args);
}

// The membership stream: a leave event or its end (the coordinator is gone) ends the group for
// this worker, which then registers again.
void watch_membership(WorkerProcess& process, grpc::ClientReader<pb::JoinEvent>& reader) {
  std::thread([&process, &reader] {
    pb::JoinEvent next;
    std::string why = "the server closed the membership stream";
    while (reader.Read(&next)) {
      if (next.has_leave()) {
        why = "told to leave: " + next.leave().reason();
        break;
      }
    }
    if (why.rfind("told", 0) != 0) {
      const grpc::Status st = reader.Finish();
      if (!st.ok()) why = "lost the server: " + st.error_message();
    }
    process.say(why);
    process.request_exit(kRejoin);
  }).detach();
}

// A member of the group the server assigned: the communicator through the server's store, the
// KV pool, the control service (its address into the store), then serving until the membership
// stream ends or a signal. Returns only the exit code of a set-up failure; otherwise it exits,
// or re-executes itself to register again.
int serve_as_member(WorkerProcess& process, const Args& a, engine::Backend& backend,
                    char** argv, const Registration& reg,
                    grpc::ClientReader<pb::JoinEvent>& reader, const pb::JoinAssigned& as) {
  process.set_who("burst-worker rank " + std::to_string(as.rank()) + " (join " + a.join + ")",
                  as.rank());
  process.say("joined as rank " + std::to_string(as.rank()) + " of " +
              std::to_string(as.world_size()) + " (generation " +
              std::to_string(as.generation()) + ")");
  if (a.threads == 0) {
    // Every rank on its own host gets all of its cores.
    omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  }
  auto store = std::make_shared<srv::RegistryStore>(reg.channel, as.generation(), reg.token);
  engine::CommunicatorOptions co;
  co.rank = as.rank();
  co.world_size = as.world_size();
  co.store = store;
  co.host = reg.host;
  co.timeout = std::chrono::milliseconds(as.comm_timeout_ms());
  const int tp = std::max(1, as.tp());
  auto comms = join_communicators(process, tp, backend, co);
  if (!comms.ok()) {
    process.say("error: " + comms.message() + "; registering again");
    rejoin(process, argv);
  }
  // The weights once the rank is known: a tensor-parallel rank reads only its slices. The
  // communicators came first, so that ranks loading at different speeds do not run into
  // their timeout.
  models::ModelSpec spec = a.model;
  spec.tp = {as.rank() % tp, tp};
  auto loaded = models::load_model(backend, spec, load_reporter(process, ""));
  if (!loaded.ok()) return process.fail(loaded.message());
  models::LlamaModel& model = *loaded.value();
  model.set_tensor_parallel_comm(*comms.value().tp);
  // The pool the coordinator assigned, or (0) what this GPU holds with the coordinator's
  // fraction and activation reserve, as a local rank would. A rank that cannot hold its KV
  // shard fails its set-up.
  Args sized = a;
  sized.kv_capacity = as.kv_capacity();
  sized.kv_memory_fraction = as.kv_memory_fraction();
  sized.kv_reserve_bytes = as.kv_reserve_bytes();
  // An empty dtype (a coordinator older than the field) means the compute dtype.
  auto kv_dtype = engine::parse_kv_cache_dtype(as.kv_cache_dtype().empty() ? "auto"
                                                                           : as.kv_cache_dtype());
  if (!kv_dtype.ok()) return process.fail("the coordinator's " + kv_dtype.message());
  sized.kv_cache_dtype = kv_dtype.value();
  auto attention = engine::parse_attention_dtype(as.attention_dtype().empty()
                                                     ? "auto"
                                                     : as.attention_dtype());
  if (!attention.ok()) return process.fail("the coordinator's " + attention.message());
  sized.attention_dtype = attention.value();
  auto ring = open_ring(process, sized, backend, model, *comms.value().ring);
  if (!ring.ok()) return process.fail(ring.message());
  WorkerService service(process, model, *comms.value().ring, *ring.value(), reg.token,
                        {as.rank(), as.world_size()});
  int port = 0;
  std::unique_ptr<grpc::Server> server = start_control(service, reg.host, &port);
  if (!server || port == 0) {
    return process.fail("cannot start the control service on " + reg.host +
                        " (--advertise-host must be an address of this host)");
  }
  const std::string address = bracketed_host(reg.host) + ":" + std::to_string(port);
  if (Status st = store->set("control/" + std::to_string(as.rank()),
                             std::vector<char>(address.begin(), address.end()));
      !st.ok()) {
    process.say("error: " + st.message() + "; registering again");
    rejoin(process, argv);
  }
  process.enter_group();
  watch_membership(process, reader);
  const int code = process.wait_exit();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (code == kRejoin || code == kExitBroken) rejoin(process, argv);
  std::_Exit(code);  // Shutdown or SIGTERM; skip destructors of a possibly broken communicator
}

// The registration request: this worker's model, device and address.
pb::JoinRequest join_request(const Args& a, const engine::Backend& backend,
                             const models::LlamaConfig& config, const std::string& host) {
  pb::JoinRequest req;
  req.set_fingerprint(srv::model_fingerprint(config, a.model));
  req.set_device_kind(backend.device() == engine::DeviceKind::kCuda ? "cuda" : "cpu");
  req.set_host(host);
  req.set_pid(getpid());
  req.set_rejoin(std::getenv(kRejoinEnv) != nullptr);
  return req;
}

bool is_refusal(grpc::StatusCode code) {
  return code == grpc::StatusCode::FAILED_PRECONDITION ||
         code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
         code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::INVALID_ARGUMENT;
}

}  // namespace

int run_join(WorkerProcess& process, const Args& a, engine::Backend& backend, char** argv) {
  process.set_who("burst-worker (join " + a.join + ")");
  auto token = join_token(a);
  if (!token.ok()) return process.fail(token.message());
  auto host = advertised_host(a);
  if (!host.ok()) return process.fail(host.message());
  auto config = models::model_config(a.model);
  if (!config.ok()) return process.fail(config.message());
  const pb::JoinRequest req = join_request(a, backend, config.value(), host.value());
  const Registration reg{registry_channel(a.join), token.value(), host.value()};
  auto stub = pb::WorkerRegistry::NewStub(reg.channel);
  process.say(std::string(req.rejoin() ? "registering again" : "registering") + " as " +
              reg.host + " (pid " + std::to_string(getpid()) + ")");

  auto backoff = std::chrono::milliseconds(500);
  while (true) {
    grpc::ClientContext ctx;
    if (!reg.token.empty()) ctx.AddMetadata(srv::kWorkerTokenKey, reg.token);
    auto reader = stub->Join(&ctx, req);
    pb::JoinEvent ev;
    if (reader->Read(&ev) && ev.has_assigned()) {
      return serve_as_member(process, a, backend, argv, reg, *reader, ev.assigned());
    }
    const grpc::Status st = reader->Finish();
    if (is_refusal(st.error_code())) {
      process.say("refused by the server: " + st.error_message());
      return kExitRefused;
    }
    const std::string why = st.ok() ? "told to leave before the group formed: " +
                                          ev.leave().reason()
                                    : st.error_message();
    process.say("cannot register yet (" + why + "); retrying in " +
                std::to_string(backoff.count()) + " ms");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(10000));
  }
}

}  // namespace burst::worker
