#include "group/worker_group.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <thread>

#include "burst/v1/worker.grpc.pb.h"
#include "common/logging.h"
#include "engine/parallel_layout.h"
#include "group/worker_registry.h"
#include "worker_group_internal.h"

namespace burst::server {

namespace pb = burst::v1::internal;
namespace fs = std::filesystem;

namespace {

// Where a spawned rank writes its loading progress: beside its port file.
std::string progress_file(const WorkerGroup::Rank& r) { return r.port_file + ".progress"; }

// Follows the ranks' loading while a local group starts: reads their progress files every
// 200 ms, publishes the sum to the owner's StartProgress (what /health shows) and logs it
// every 5 s, so a load of minutes is seen moving (and a stuck one seen stuck).
class LoadWatch {
 public:
  using Clock = std::chrono::steady_clock;
  LoadWatch(std::shared_ptr<StartProgress> progress,
            const std::vector<std::unique_ptr<WorkerGroup::Rank>>& ranks)
      : progress_(std::move(progress)), ranks_(ranks) {
    if (progress_) {
      progress_->bytes_done = 0;
      progress_->bytes_total = 0;
    }
  }
  // Over (the group serves, or the start failed): nothing is loading any more.
  ~LoadWatch() {
    if (progress_) progress_->bytes_done = progress_->bytes_total = 0;
  }

  void poll() {
    const auto now = Clock::now();
    if (now - last_read_ < std::chrono::milliseconds(200)) return;
    last_read_ = now;
    done_ = total_ = 0;
    int reporting = 0;
    for (const auto& rk : ranks_) {
      int64_t d = 0, t = 0;
      std::ifstream f(progress_file(*rk));
      if (f >> d >> t && t > 0) {
        done_ += d;
        total_ += t;
        ++reporting;
      }
    }
    // Until every rank has reported its total, the sum would overstate the fraction.
    if (reporting < static_cast<int>(ranks_.size())) done_ = total_ = 0;
    if (progress_) {
      progress_->bytes_total = total_;
      progress_->bytes_done = done_;
    }
    if (now - last_log_ >= std::chrono::seconds(5)) {
      last_log_ = now;
      spdlog::info("worker group starting: {}", describe());
    }
  }

  std::string describe() const {
    if (total_ == 0) return "no rank has reported loading progress yet";
    return "weights loaded " + bytes_progress(done_, total_) + " over " +
           std::to_string(ranks_.size()) + " rank(s)";
  }

 private:
  std::shared_ptr<StartProgress> progress_;
  const std::vector<std::unique_ptr<WorkerGroup::Rank>>& ranks_;
  Clock::time_point last_read_{}, last_log_ = Clock::now();
  int64_t done_ = 0, total_ = 0;
};

// A duration from the environment, if set: a whole number of milliseconds >= 0.
Status env_ms(const char* name, std::chrono::milliseconds& out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return {};
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 86'400'000) {
    return Status::error(std::string("$") + name + " must be a whole number of milliseconds in " +
                         "[0, 86400000], got '" + v + "'");
  }
  out = std::chrono::milliseconds(x);
  return {};
}

constexpr const char* kRunDirPrefix = "burst-group-";

std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  return t && *t ? std::string(t) : std::string("/tmp");
}

// Removes burst-group-<pid>-XXXXXX directories (ours: same uid) whose coordinator is gone.
void remove_stale_run_dirs(const std::string& dir) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return;
  const std::string prefix = kRunDirPrefix;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return;
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos || dash == prefix.size()) continue;  // no pid in the name
    const std::string pid_text = name.substr(prefix.size(), dash - prefix.size());
    if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) {
      continue;
    }
    struct stat st {};
    if (lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to ask)
    std::error_code rm;
    fs::remove_all(it->path(), rm);
  }
}

}  // namespace

StderrRelay::StderrRelay(int fd, int rank) : fd_(fd), rank_(rank) {
  thread_ = std::thread([this] { run(); });
}

StderrRelay::~StderrRelay() {
  done_ = true;
  thread_.join();
  close(fd_);
}

void StderrRelay::run() {
  std::string pending;
  char buf[4096];
  std::chrono::steady_clock::time_point give_up{};
  for (;;) {
    if (done_ && give_up == std::chrono::steady_clock::time_point{}) {
      give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
    if (done_ && std::chrono::steady_clock::now() > give_up) break;
    pollfd p{fd_, POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) break;
    if (ready <= 0) {
      if (done_) break;  // the rank is gone and its pipe idle: nothing more will come
      continue;
    }
    const ssize_t n = read(fd_, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) break;  // every writer closed its end
    pending.append(buf, static_cast<size_t>(n));
    size_t begin = 0;
    for (size_t nl; (nl = pending.find('\n', begin)) != std::string::npos; begin = nl + 1) {
      std::string_view line(pending.data() + begin, nl - begin);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (!line.empty()) relay_worker_line(line, rank_);
    }
    pending.erase(0, begin);
    while (pending.size() > kMaxLine) {
      std::string head = utf8_cut(pending, kMaxLine);
      if (head.empty()) head = pending.substr(0, kMaxLine);  // not UTF-8 at all
      relay_worker_line(head, rank_);
      pending.erase(0, head.size());
    }
  }
  if (!pending.empty()) relay_worker_line(pending, rank_);
}

std::string default_worker_binary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "burst-worker" : (self.parent_path() / "burst-worker").string();
}

std::chrono::milliseconds default_start_timeout(int64_t weight_bytes_per_rank) {
  return std::chrono::milliseconds(120000 + weight_bytes_per_rank * 30 / 1000000);
}

int64_t WorkerGroup::kv_capacity_tokens() const {
  if (options_.kv_capacity > 0) return options_.kv_capacity;
  // Every rank's rows: a request's exact need per rank is checked against the pages at
  // admission (the scheduler's ledger); this total is for limits and metrics.
  // The tp ranks of a tensor-parallel group hold the same rows (each its heads of them).
  return int64_t{options_.ring_size()} * info_.kv_pages * info_.kv_page_size;
}

WorkerGroup::WorkerGroup(WorkerGroupOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<WorkerGroup>> WorkerGroup::start(WorkerGroupOptions options) {
  if (options.workers < 1) return Status::error("workers must be >= 1");
  if (auto layout = engine::ParallelLayout::of(options.workers, options.tp); !layout.ok()) {
    return layout.status();
  }
  if (options.registry && options.registry->options().tp != options.tp) {
    return Status::error("the worker registry hands out tp " +
                         std::to_string(options.registry->options().tp) + ", the group runs tp " +
                         std::to_string(options.tp));
  }
  BURST_RETURN_IF_ERROR(env_ms("BURST_WORKER_HEARTBEAT_MS", options.heartbeat_interval));
  BURST_RETURN_IF_ERROR(env_ms("BURST_WORKER_HEARTBEAT_TIMEOUT_MS", options.heartbeat_timeout));
  BURST_RETURN_IF_ERROR(env_ms("BURST_WORKER_STEP_TIMEOUT_MS", options.step_timeout));
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
  if (options.worker_binary.empty()) {
    // $BURST_WORKER_BINARY: a wrapper around burst-worker (numactl, a debugger, a test's).
    const char* b = std::getenv("BURST_WORKER_BINARY");
    options.worker_binary = b && *b ? b : default_worker_binary();
  }
  if (access(options.worker_binary.c_str(), X_OK) != 0) {
    return Status::error("worker binary " + options.worker_binary + " is not executable");
  }
  std::unique_ptr<WorkerGroup> g(new WorkerGroup(std::move(options)));
  BURST_RETURN_IF_ERROR(g->spawn());
  return g;
}

WorkerGroup::~WorkerGroup() {
  if (options_.registry) options_.registry->set_on_member_lost(nullptr);
  if (session_) {
    // Going away: cancel the streams rather than wait for the ranks to finish their sessions.
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.clear();
    }
    for (auto& c : session_->ctx) c->TryCancel();
    for (auto& st : session_->streams) st->Finish();
    session_.reset();
  }
  stop_all();
}

std::vector<int> WorkerGroup::pids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  if (remote()) return out;  // not our processes (other hosts, perhaps)
  for (const auto& r : ranks_) out.push_back(r->pid);
  return out;
}

// The run directory (rendezvous store, port files) lives only until the ranks have met: it is
// removed as soon as every rank answers, so even a SIGKILLed coordinator leaves nothing behind
// once its group started. One killed during start-up leaves its directory, named after its
// pid: the next start removes those of coordinators that no longer run.
Result<std::string> WorkerGroup::make_run_dir() {
  const std::string tmp = temp_dir();
  remove_stale_run_dirs(tmp);
  std::string tmpl = tmp + "/" + kRunDirPrefix + std::to_string(getpid()) + "-XXXXXX";
  if (!mkdtemp(tmpl.data())) {
    return Status::error("cannot create the group's run directory in " + tmp + ": " +
                         std::strerror(errno));
  }
  fs::create_directories(tmpl + "/store");
  return tmpl;
}

// The ranks' environment: this process's, with the group's secret (only processes given it,
// through the environment, which other users cannot read, never argv, can drive the workers'
// control service) and a passive OpenMP wait policy unless the operator chose one: with
// libgomp's default, idle threads spin between a step's parallel regions, and a CPU group
// (ranks, the coordinator, gRPC threads on a few cores) ran the embedded default 8x slower
// (hol_probe: 8.9 s against 1.1 s for a 1500-token request). libgomp reads it at load.
std::vector<std::string> WorkerGroup::worker_environment() const {
  std::vector<std::string> env;
  const std::string secret_var = std::string(kWorkerSecretEnv) + "=";
  for (char** e = environ; e && *e; ++e) {
    if (std::strncmp(*e, secret_var.c_str(), secret_var.size()) != 0) env.emplace_back(*e);
  }
  env.push_back(secret_var + token_);
  const bool wait_policy_set = std::any_of(env.begin(), env.end(), [](const std::string& e) {
    return e.rfind("OMP_WAIT_POLICY=", 0) == 0;
  });
  if (!wait_policy_set) env.push_back("OMP_WAIT_POLICY=PASSIVE");
  return env;
}

// burst-worker's command line for rank r.
std::vector<std::string> WorkerGroup::worker_args(const Rank& rk, const std::string& store) const {
  const int n = options_.workers;
  // 0: each rank sizes its pool from its GPU's memory.
  const int64_t per_rank = options_.kv_capacity > 0
                               ? engine::kv_capacity_per_rank(options_.kv_capacity,
                                                              options_.ring_size(),
                                                              options_.prefill_chunk)
                               : 0;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int threads = options_.threads_per_worker > 0 ? options_.threads_per_worker
                                                      : std::max(1, cores / n);
  std::string device = options_.device;
  if (device == "cuda") device = "cuda:" + std::to_string(rk.rank);  // one GPU per rank
  std::vector<std::string> args = {
      options_.worker_binary, "--rank", std::to_string(rk.rank), "--world", std::to_string(n),
      "--store", store, "--port-file", rk.port_file, "--device", device,
      "--kv-capacity", std::to_string(per_rank), "--threads", std::to_string(threads),
      "--comm-timeout-ms", std::to_string(options_.comm_timeout.count()),
      "--progress-file", progress_file(rk), "--tp", std::to_string(options_.tp)};
  if (per_rank == 0) {
    args.insert(args.end(), {"--kv-memory-fraction", std::to_string(options_.kv_memory_fraction),
                             "--kv-reserve-bytes", std::to_string(options_.kv_reserve_bytes)});
  }
  if (options_.kv_cache_dtype != engine::KvCacheDtype::kAuto) {
    args.insert(args.end(),
                {"--kv-cache-dtype", engine::kv_cache_dtype_name(options_.kv_cache_dtype)});
  }
  if (options_.attention_dtype != engine::AttentionDtype::kAuto) {
    args.insert(args.end(),
                {"--attention-dtype", engine::attention_dtype_name(options_.attention_dtype)});
  }
  if (!options_.model.dir.empty()) {
    args.insert(args.end(), {"--model", options_.model.dir});
  } else {
    args.insert(args.end(), {"--preset", options_.model.preset, "--random-weights",
                             std::to_string(options_.model.random_seed)});
  }
  return args;
}

// Waits for every rank's port file, failing early if a rank dies during start-up, and at once
// when the owner cancels (SIGTERM while loading); the ranks' control addresses, in rank order.
Result<std::vector<std::string>> WorkerGroup::await_ports() {
  std::vector<std::string> addresses;
  LoadWatch watch(options_.start_progress, ranks_);
  const auto deadline = std::chrono::steady_clock::now() + options_.start_timeout;
  for (auto& rk : ranks_) {
    while (!fs::exists(rk->port_file)) {
      for (auto& other : ranks_) {
        int status = 0;
        if (other->pid && waitpid(other->pid, &status, WNOHANG) == other->pid) {
          const std::string why = rank_name(*other) + " " + describe_exit(status) +
                                  " during start-up (its stderr above says why)";
          other->pid = 0;
          return Status::error(why);
        }
      }
      if (options_.start_progress && options_.start_progress->cancel) {
        return Status::error("the start was cancelled (shutting down)");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Status::error(rank_name(*rk) + " did not start within " +
                             std::to_string(options_.start_timeout.count()) + " ms (" +
                             watch.describe() +
                             "; burst-server --start-timeout-ms sets the limit)");
      }
      watch.poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    int port = 0;
    std::ifstream(rk->port_file) >> port;
    addresses.push_back("127.0.0.1:" + std::to_string(port));
  }
  return addresses;
}

Status WorkerGroup::spawn() {
  auto dir = make_run_dir();
  if (!dir.ok()) return dir.status();
  run_dir_ = dir.value();
  const std::string store = run_dir_ + "/store";
  auto secret = random_token();
  if (!secret.ok()) return secret.status();
  token_ = secret.value();
  std::vector<std::string> env = worker_environment();
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  ranks_.clear();
  for (int r = 0; r < options_.workers; ++r) {
    auto rk = std::make_unique<Rank>();
    rk->rank = r;
    rk->port_file = run_dir_ + "/port-" + std::to_string(r);
    std::vector<std::string> args = worker_args(*rk, store);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // json logs: the rank's stderr is a pipe the server relays line by line, so that what it
    // prints without the logger is one JSON record too; text logs: the server's stderr.
    int err_pipe[2] = {-1, -1};
    if (log_is_json() && pipe2(err_pipe, O_CLOEXEC) != 0) {
      stop_all();
      return Status::error(std::string("pipe failed while starting worker rank ") +
                           std::to_string(r) + ": " + std::strerror(errno));
    }
    const pid_t pid = fork();
    if (pid < 0) {
      if (err_pipe[0] >= 0) {
        close(err_pipe[0]);
        close(err_pipe[1]);
      }
      stop_all();  // the ranks already started
      return Status::error("fork failed while starting worker rank " + std::to_string(r));
    }
    if (pid == 0) {
      if (err_pipe[1] >= 0) dup2(err_pipe[1], STDERR_FILENO);  // dup2 clears close-on-exec
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    rk->pid = pid;
    if (err_pipe[0] >= 0) {
      close(err_pipe[1]);
      rk->stderr_relay = std::make_unique<StderrRelay>(err_pipe[0], r);
    }
    ranks_.push_back(std::move(rk));
  }
  auto addresses = await_ports();
  if (!addresses.ok()) {
    stop_all();
    return addresses.status();
  }
  if (Status st = connect(addresses.value()); !st.ok()) {
    stop_all();
    return st;
  }
  // Every rank has joined its communicator (it writes its port file after) and answers: the
  // rendezvous files have served their purpose.
  {
    std::error_code ec;
    fs::remove_all(run_dir_, ec);
    run_dir_.clear();
  }
  stopping_ = false;
  supervisor_ = std::thread([this] { supervise(); });
  return {};
}

void WorkerGroup::authorize(grpc::ClientContext& ctx) const {
  if (!token_.empty()) ctx.AddMetadata(kWorkerTokenKey, token_);
}

Status WorkerGroup::connect(const std::vector<std::string>& addresses) {
  const int n = static_cast<int>(addresses.size());
  if (remote()) token_ = options_.registry->options().cluster_token;
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
    authorize(ctx);
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
    const int64_t pages =
        pong.kv_page_size() > 0 ? pong.kv_capacity() / pong.kv_page_size() : 0;
    if (rk->rank == 0) {
      info_ = {pong.vocab_size(), pong.eos_token_id(), pong.device(), pages,
               pong.kv_page_size()};
    } else {
      // Sized from memory, ranks may differ (another process on a GPU): the ledger uses the
      // fewest.
      info_.kv_pages = std::min(info_.kv_pages, pages);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    death_.clear();
    step_running_ = false;
  }
  healthy_ = true;
  start_monitor();
  return {};
}

void WorkerGroup::start_monitor() {
  stop_monitor();
  const bool heartbeats = options_.heartbeat_interval.count() > 0 &&
                          options_.heartbeat_timeout.count() > 0;
  if (!heartbeats && options_.step_timeout.count() <= 0) return;
  {
    std::lock_guard<std::mutex> lock(monitor_mu_);
    monitor_stop_ = false;
  }
  monitor_ = std::thread([this] { monitor(); });
}

void WorkerGroup::stop_monitor() {
  {
    std::lock_guard<std::mutex> lock(monitor_mu_);
    monitor_stop_ = true;
    if (monitor_ping_) monitor_ping_->TryCancel();
  }
  monitor_cv_.notify_all();
  if (monitor_.joinable()) monitor_.join();
}

void WorkerGroup::monitor() {
  using Clock = std::chrono::steady_clock;
  const auto interval = options_.heartbeat_interval;
  const auto timeout = options_.heartbeat_timeout;
  const bool heartbeats = interval.count() > 0 && timeout.count() > 0;
  std::vector<Clock::time_point> last_ok(ranks_.size(), Clock::now());
  auto ms = [](Clock::duration d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  // Each ping waits at most this long, so a hung rank holds the loop (and stop_monitor())
  // briefly, and the other ranks are still pinged while it does not answer.
  const auto ping_wait = std::min<std::chrono::milliseconds>(
      std::max<std::chrono::milliseconds>(interval, std::chrono::milliseconds(200)), timeout);
  while (true) {
    {
      std::unique_lock<std::mutex> lock(monitor_mu_);
      monitor_cv_.wait_for(lock, heartbeats ? interval : std::chrono::milliseconds(1000),
                           [&] { return monitor_stop_; });
      if (monitor_stop_) return;
    }
    if (!healthy_) continue;  // already failed: restart() stops this thread
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (step_running_ && Clock::now() > step_deadline_) {
        const auto tokens = step_tokens_;
        lock.unlock();
        const std::string why =
            "a step of " + std::to_string(tokens) + " token(s) did not finish within its " +
            "deadline (" + std::to_string(options_.step_timeout.count()) + " ms + " +
            std::to_string(options_.step_ms_per_token) + " ms per token): a worker rank is hung";
        if (remote()) options_.registry->dissolve(why);
        mark_dead(why);
        continue;
      }
    }
    if (!heartbeats) continue;
    for (size_t r = 0; r < ranks_.size() && healthy_; ++r) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + ping_wait);
      authorize(ctx);
      {
        std::lock_guard<std::mutex> lock(monitor_mu_);
        if (monitor_stop_) return;
        monitor_ping_ = &ctx;
      }
      pb::PingResponse pong;
      const grpc::Status st = ranks_[r]->stub->Ping(&ctx, pb::PingRequest(), &pong);
      {
        std::lock_guard<std::mutex> lock(monitor_mu_);
        monitor_ping_ = nullptr;
        if (monitor_stop_) return;
      }
      const auto now = Clock::now();
      if (st.ok()) {
        last_ok[r] = now;
        continue;
      }
      if (now - last_ok[r] > timeout) {
        const std::string why =
            rank_name(*ranks_[r]) + " stopped answering: no heartbeat answered for " +
            ms(now - last_ok[r]) + " ms (limit " + std::to_string(timeout.count()) +
            " ms; the process is stopped or hung; last error: " + st.error_message() + ")";
        if (remote()) options_.registry->dissolve(why);
        mark_dead(why);
        break;
      }
    }
  }
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
  // Each rank publishes its control address once its communicators are up (every rank has
  // connected to every other) and its weights are in (a joined rank loads its tensor-parallel
  // slice once it has its rank): wait for all of them, as long as a start may take.
  auto store = reg.store_view(*generation);
  std::vector<std::string> addresses;
  const auto wait = std::max(options_.comm_timeout, options_.start_timeout);
  for (int r = 0; r < options_.workers; ++r) {
    auto a = store->get("control/" + std::to_string(r), wait);
    if (!a.ok()) {
      const std::string why = "worker rank " + std::to_string(r) + " of generation " +
                              std::to_string(*generation) +
                              " did not publish its control address: " + a.message();
      reg.dissolve(why);
      return Status::error(why);
    }
    addresses.emplace_back(a.value().begin(), a.value().end());
  }
  stop_monitor();
  ranks_.clear();
  generation_ = *generation;
  if (Status st = connect(addresses); !st.ok()) {
    reg.dissolve(st.message());
    stop_monitor();
    ranks_.clear();
    return st;
  }
  // A member may have left between forming and our pings: the registry dissolved the group
  // then, before generation_ was ours to compare. Do not serve a dissolved group.
  if (reg.store().epoch() != *generation) {
    healthy_ = false;
    stop_monitor();
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
  stop_monitor();
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
  bool asked = false;
  for (auto& rk : ranks_) {
    if (rk->pid && rk->stub) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      authorize(ctx);
      pb::ShutdownResponse resp;
      rk->stub->Shutdown(&ctx, pb::ShutdownRequest(), &resp);
      asked = true;
    }
  }
  // Polite first (Shutdown, then SIGTERM), then SIGKILL: stop_all must always return. Ranks
  // still loading have no control service yet: SIGTERM at once (they exit on it).
  for (int sig : {0, SIGTERM, SIGKILL}) {
    if (sig == 0 && !asked) continue;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    for (auto& rk : ranks_) {
      if (rk->pid && sig) {
        kill(rk->pid, sig);
        if (sig == SIGTERM) kill(rk->pid, SIGCONT);  // a stopped (hung) rank takes it too
      }
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
  end_session_locked();
  stop_all();
  if (remote()) return {};
  return spawn();
}

}  // namespace burst::server
