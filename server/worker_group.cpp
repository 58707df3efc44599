#include "server/worker_group.h"

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "burst/v1/worker.grpc.pb.h"
#include "server/worker_registry.h"

namespace burst::server {

namespace pb = burst::v1::internal;
namespace fs = std::filesystem;

struct WorkerGroup::Rank {
  int rank = 0;
  pid_t pid = 0;  // local: 0 once reaped; remote: 0
  std::string port_file;  // local
  std::string address;    // of its control service
  std::unique_ptr<pb::WorkerControl::Stub> stub;
};

namespace {

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

std::string rank_name(const WorkerGroup::Rank& r) {
  return "worker rank " + std::to_string(r.rank) +
         (r.pid ? " (pid " + std::to_string(r.pid) + ")" : " (" + r.address + ")");
}

}  // namespace

std::string default_worker_binary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "burst-worker" : (self.parent_path() / "burst-worker").string();
}

int64_t kv_capacity_per_rank(int64_t total, int ranks) {
  return (total + ranks - 1) / ranks + 4;
}

WorkerGroup::WorkerGroup(WorkerGroupOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<WorkerGroup>> WorkerGroup::start(WorkerGroupOptions options) {
  if (options.workers < 1) return Status::error("workers must be >= 1");
  if (options.registry) {
    if (options.registry->options().world_size != options.workers) {
      return Status::error("the worker registry expects " +
                           std::to_string(options.registry->options().world_size) +
                           " workers, the group " + std::to_string(options.workers));
    }
    std::unique_ptr<WorkerGroup> g(new WorkerGroup(std::move(options)));
    WorkerGroup* self = g.get();
    g->options_.registry->set_on_member_lost([self](uint64_t generation, const std::string& why) {
      if (generation == self->generation_.load()) self->mark_dead(why);
    });
    return g;
  }
  if (options.worker_binary.empty()) options.worker_binary = default_worker_binary();
  if (access(options.worker_binary.c_str(), X_OK) != 0) {
    return Status::error("worker binary " + options.worker_binary + " is not executable");
  }
  std::unique_ptr<WorkerGroup> g(new WorkerGroup(std::move(options)));
  BURST_RETURN_IF_ERROR(g->spawn());
  return g;
}

WorkerGroup::~WorkerGroup() {
  if (options_.registry) options_.registry->set_on_member_lost(nullptr);
  stop_all();
}

std::vector<int> WorkerGroup::pids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  if (remote()) return out;  // not our processes (other hosts, perhaps)
  for (const auto& r : ranks_) out.push_back(r->pid);
  return out;
}

Status WorkerGroup::spawn() {
  char tmpl[] = "/tmp/burst-group-XXXXXX";
  if (!mkdtemp(tmpl)) return Status::error("cannot create the group's run directory in /tmp");
  run_dir_ = tmpl;
  const std::string store = run_dir_ + "/store";
  fs::create_directories(store);
  const int n = options_.workers;
  const int64_t per_rank = kv_capacity_per_rank(options_.kv_capacity, n);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = options_.threads_per_worker > 0 ? options_.threads_per_worker
                                                      : std::max(1, cores / n);
  ranks_.clear();
  for (int r = 0; r < n; ++r) {
    auto rk = std::make_unique<Rank>();
    rk->rank = r;
    rk->port_file = run_dir_ + "/port-" + std::to_string(r);
    std::string device = options_.device;
    if (device == "cuda") device = "cuda:" + std::to_string(r);  // one GPU per rank
    std::vector<std::string> args = {
        options_.worker_binary, "--rank", std::to_string(r), "--world", std::to_string(n),
        "--store", store, "--port-file", rk->port_file, "--device", device,
        "--kv-capacity", std::to_string(per_rank), "--threads", std::to_string(threads),
        "--comm-timeout-ms", std::to_string(options_.comm_timeout.count())};
    if (!options_.model.dir.empty()) {
      args.insert(args.end(), {"--model", options_.model.dir});
    } else {
      args.insert(args.end(), {"--preset", options_.model.preset, "--random-weights",
                               std::to_string(options_.model.random_seed)});
    }
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid < 0) return Status::error("fork failed while starting worker rank " + std::to_string(r));
    if (pid == 0) {
      execv(argv[0], argv.data());
      _exit(127);
    }
    rk->pid = pid;
    ranks_.push_back(std::move(rk));
  }

  // Wait for every rank's port file, failing early if a rank dies during start-up.
  std::vector<std::string> addresses;
  const auto deadline = std::chrono::steady_clock::now() + options_.start_timeout;
  for (auto& rk : ranks_) {
    while (!fs::exists(rk->port_file)) {
      for (auto& other : ranks_) {
        int status = 0;
        if (other->pid && waitpid(other->pid, &status, WNOHANG) == other->pid) {
          const std::string why = rank_name(*other) + " " + describe_exit(status) +
                                  " during start-up (its stderr above says why)";
          other->pid = 0;
          stop_all();
          return Status::error(why);
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        stop_all();
        return Status::error(rank_name(*rk) + " did not start within " +
                             std::to_string(options_.start_timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int port = 0;
    std::ifstream(rk->port_file) >> port;
    addresses.push_back("127.0.0.1:" + std::to_string(port));
  }
  if (Status st = connect(addresses); !st.ok()) {
    stop_all();
    return st;
  }
  stopping_ = false;
  supervisor_ = std::thread([this] { supervise(); });
  return {};
}

Status WorkerGroup::connect(const std::vector<std::string>& addresses) {
  const int n = static_cast<int>(addresses.size());
  if (ranks_.empty()) {
    for (int r = 0; r < n; ++r) {
      ranks_.push_back(std::make_unique<Rank>());
      ranks_.back()->rank = r;
    }
  }
  for (auto& rk : ranks_) {
    rk->address = addresses[static_cast<size_t>(rk->rank)];
    grpc::ChannelArguments ch_args;
    ch_args.SetMaxSendMessageSize(256 << 20);
    ch_args.SetMaxReceiveMessageSize(256 << 20);
    rk->stub = pb::WorkerControl::NewStub(
        grpc::CreateCustomChannel(rk->address, grpc::InsecureChannelCredentials(), ch_args));
  }
  for (auto& rk : ranks_) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pb::PingResponse pong;
    const grpc::Status st = rk->stub->Ping(&ctx, pb::PingRequest(), &pong);
    if (!st.ok()) {
      return Status::error(rank_name(*rk) + " does not answer: " + st.error_message());
    }
    if (pong.rank() != rk->rank || pong.world_size() != n) {
      return Status::error(rank_name(*rk) + " answers as rank " + std::to_string(pong.rank()) +
                           " of " + std::to_string(pong.world_size()) + ", expected rank " +
                           std::to_string(rk->rank) + " of " + std::to_string(n));
    }
    if (rk->rank == 0) info_ = {pong.vocab_size(), pong.eos_token_id(), pong.device()};
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    death_.clear();
  }
  healthy_ = true;
  return {};
}

void WorkerGroup::mark_dead(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (death_.empty()) death_ = why;
  healthy_ = false;
  // Unblock the request in flight at once instead of waiting on the survivors, which only
  // notice the dead peer at their communicator timeout.
  for (auto* ctx : in_flight_) ctx->TryCancel();
}

Result<bool> WorkerGroup::await_remote(std::chrono::milliseconds max_wait) {
  if (!remote()) return Status::error("await_remote: this worker group spawns its workers");
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (healthy_) return true;
  WorkerRegistry& reg = *options_.registry;
  const auto generation = reg.wait_formed(max_wait);
  if (!generation) return false;
  // Each rank publishes its control address once its communicator is up (every rank has
  // connected to every other): wait for all of them, as long as a communicator may take.
  auto store = reg.store_view(*generation);
  std::vector<std::string> addresses;
  for (int r = 0; r < options_.workers; ++r) {
    auto a = store->get("control/" + std::to_string(r), options_.comm_timeout);
    if (!a.ok()) {
      const std::string why = "worker rank " + std::to_string(r) + " of generation " +
                              std::to_string(*generation) +
                              " did not publish its control address: " + a.message();
      reg.dissolve(why);
      return Status::error(why);
    }
    addresses.emplace_back(a.value().begin(), a.value().end());
  }
  ranks_.clear();
  generation_ = *generation;
  if (Status st = connect(addresses); !st.ok()) {
    reg.dissolve(st.message());
    ranks_.clear();
    return st;
  }
  // A member may have left between forming and our pings: the registry dissolved the group
  // then, before generation_ was ours to compare. Do not serve a dissolved group.
  if (reg.store().epoch() != *generation) {
    healthy_ = false;
    ranks_.clear();
    return Status::error("worker group generation " + std::to_string(*generation) +
                         " was dissolved while connecting");
  }
  return true;
}

std::string WorkerGroup::waiting_status() const {
  if (!remote() || healthy_) return "";
  return options_.registry->waiting_status();
}

void WorkerGroup::supervise() {
  while (!stopping_) {
    for (auto& rk : ranks_) {
      int status = 0;
      if (rk->pid == 0 || waitpid(rk->pid, &status, WNOHANG) != rk->pid) continue;
      const std::string why = rank_name(*rk) + " " + describe_exit(status);
      rk->pid = 0;
      mark_dead(why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void WorkerGroup::stop_all() {
  stopping_ = true;
  if (supervisor_.joinable()) supervisor_.join();
  healthy_ = false;
  if (remote()) {
    // The workers are not ours to stop: they leave the group and wait to join the next one.
    options_.registry->dissolve("the coordinator stopped the group");
    ranks_.clear();
    generation_ = 0;
    return;
  }
  for (auto& rk : ranks_) {
    if (rk->pid && rk->stub) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      pb::ShutdownResponse resp;
      rk->stub->Shutdown(&ctx, pb::ShutdownRequest(), &resp);
    }
  }
  // Polite first (Shutdown, then SIGTERM), then SIGKILL: stop_all must always return.
  for (int sig : {0, SIGTERM, SIGKILL}) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    for (auto& rk : ranks_) {
      if (rk->pid && sig) kill(rk->pid, sig);
    }
    bool all = false;
    while (!all && std::chrono::steady_clock::now() < until) {
      all = true;
      for (auto& rk : ranks_) {
        if (rk->pid && waitpid(rk->pid, nullptr, WNOHANG) == rk->pid) rk->pid = 0;
        all = all && rk->pid == 0;
      }
      if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (all) break;
  }
  if (!run_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(run_dir_, ec);
    run_dir_.clear();
  }
}

Status WorkerGroup::restart() {
  std::lock_guard<std::mutex> lock(run_mu_);
  stop_all();
  if (remote()) return {};
  return spawn();
}

Result<GroupStats> WorkerGroup::generate(const models::GenerateRequest& request,
                                         const models::TokenCallback& on_token,
                                         const models::ProgressCallback& on_progress) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  const int64_t need = static_cast<int64_t>(request.prompt.size()) + request.max_tokens;
  if (need > options_.kv_capacity) {
    return Status::error("the request needs " + std::to_string(need) +
                         " KV tokens (prompt + max_tokens); the group holds " +
                         std::to_string(options_.kv_capacity));
  }
  pb::WorkerGenerateRequest req;
  req.mutable_prompt()->Add(request.prompt.begin(), request.prompt.end());
  req.set_max_tokens(request.max_tokens);
  req.set_temperature(request.sampling.temperature);
  req.set_top_k(request.sampling.top_k);
  req.set_top_p(request.sampling.top_p);
  req.set_seed(request.sampling.seed);
  req.set_stop_at_eos(request.stop_at_eos);
  req.set_report_progress(static_cast<bool>(on_progress));
  req.set_layout(options_.layout == engine::ShardLayout::kContiguous ? pb::CONTIGUOUS
                                                                     : pb::ZIGZAG);
  const size_t n = ranks_.size();
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx(n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!healthy_) return Status::error("worker group unavailable: " + death_);
    for (auto& c : ctx) {
      c = std::make_unique<grpc::ClientContext>();
      in_flight_.push_back(c.get());
    }
  }
  // Ranks 1..N-1 stream nothing but their final message; drain them on their own threads.
  std::vector<grpc::Status> finish(n);
  std::vector<std::thread> readers;
  for (size_t r = 1; r < n; ++r) {
    readers.emplace_back([&, r] {
      auto reader = ranks_[r]->stub->Generate(ctx[r].get(), req);
      pb::WorkerEvent ev;
      while (reader->Read(&ev)) {
      }
      finish[r] = reader->Finish();
    });
  }
  GroupStats out;
  bool cancelled = false, done = false;
  {
    auto reader = ranks_[0]->stub->Generate(ctx[0].get(), req);
    pb::WorkerEvent ev;
    while (reader->Read(&ev)) {
      if (ev.has_token()) {
        ++out.stats.generated_tokens;
        if (!cancelled && !on_token(ev.token().id())) {
          cancelled = true;
          ctx[0]->TryCancel();  // rank 0 sees it at the next token and stops every rank
        }
      } else if (ev.has_progress()) {
        if (!cancelled && !on_progress(ev.progress().fraction())) {
          cancelled = true;
          ctx[0]->TryCancel();  // rank 0 sees it after the current layer
        }
      } else if (ev.has_done()) {
        const auto& d = ev.done();
        out.stats.finish_reason = d.finish_reason();
        out.stats.prompt_tokens = d.prompt_tokens();
        out.stats.generated_tokens = d.generated_tokens();
        out.stats.prefill_ms = d.prefill_ms();
        out.stats.decode_ms = d.decode_ms();
        out.ring_compute_ms = d.ring_compute_ms();
        out.ring_wait_ms = d.ring_wait_ms();
        done = true;
      }
    }
    finish[0] = reader->Finish();
  }
  for (auto& t : readers) t.join();
  if (remote()) {
    // A remote rank's control channel that breaks is a lost rank, like a dead local process
    // (its Join stream may still look alive, e.g. one port cut off by a firewall).
    for (size_t r = 0; r < n; ++r) {
      if (finish[r].error_code() != grpc::StatusCode::UNAVAILABLE) continue;
      const std::string why = rank_name(*ranks_[r]) +
                              " cannot be reached over its control channel: " +
                              finish[r].error_message();
      mark_dead(why);
      options_.registry->dissolve(why);
      break;
    }
  }
  std::string death;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.clear();
    death = death_;
  }
  if (!death.empty()) return Status::error("request failed: " + death);
  if (cancelled) {
    out.stats.prompt_tokens = static_cast<int64_t>(request.prompt.size());
    out.stats.finish_reason = "cancelled";
    return out;
  }
  std::string errors;
  for (size_t r = 0; r < n; ++r) {
    if (!finish[r].ok()) errors += (errors.empty() ? "" : "; ") + finish[r].error_message();
  }
  if (!errors.empty()) return Status::error(errors);
  if (!done) return Status::error("worker rank 0 ended the stream without a result");
  return out;
}

}  // namespace burst::server
