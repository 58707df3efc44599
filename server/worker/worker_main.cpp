// burst-worker: one rank of a worker group. Loads the model, joins the group's communicator
// (Gloo on CPU, NCCL on GPU), holds its shard of every sequence's KV cache (paged), and runs
// the steps its coordinator sends over one Session stream of the internal WorkerControl gRPC
// service (proto/burst/v1/worker.proto). Every rank runs the same steps in lockstep; rank 0
// samples and returns the tokens.
//
// Two ways to start:
// - spawned by a local coordinator (--rank --world --store --port-file): rendezvous through a
//   directory, control service on loopback, port written to the port file; dies with its parent.
//   After a communicator error the group is broken (a peer died or hung): the worker reports the
//   error on the call, then exits with code 3 so the coordinator restarts the group instead of
//   reusing a half-dead ring.
// - --join HOST:PORT (multi-node): registers with burst-server's WorkerRegistry, which checks
//   the model and hands out rank and world size once the group is complete; the communicator
//   meets through the coordinator's store, the control service listens on the advertised
//   address and is published through the same store. When the group breaks or is dissolved (a
//   peer died, the coordinator restarted it or went away), the worker re-executes itself and
//   registers again: a fresh process, because a communicator that saw a failure (Gloo pairs
//   closed, NCCL kernels stuck on a dead peer) cannot be reused or even safely destroyed.
//   Refusals (another model, one worker too many) end the process with code 4.
#include <grpcpp/grpcpp.h>
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <dirent.h>
#include <fcntl.h>

#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "burst/v1/worker.grpc.pb.h"
#include "engine/backend.h"
#include "engine/ring_attention.h"
#include "runtime/batch_runner.h"
#include "common/logging.h"
#include "engine/kv_pages.h"
#include "group/step_codec.h"
#include "group/worker_registry.h"
#ifdef BURST_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/nccl_communicator.h"
#endif

namespace {

namespace pb = burst::v1::internal;
using namespace burst;
using server::decode_plan;
using server::encode_result;
using server::reports_progress;

constexpr int kExitBroken = 3;
constexpr int kExitRefused = 4;  // --join: the coordinator refused this worker
constexpr int kRejoin = 100;     // --join: leave the group and register again (not an exit code)
// Set in the environment of a re-executed --join worker: it comes back from a broken group.
constexpr const char* kRejoinEnv = "BURST_WORKER_REJOIN";

struct Args {
  models::ModelSpec model;
  int rank = -1, world = 0, threads = 0;
  std::string store, port_file, progress_file, device = "cpu";
  int64_t kv_capacity = 4096;  // 0: from the GPU's memory (kv_memory_fraction, kv_reserve_bytes)
  double kv_memory_fraction = 0.9;
  int64_t kv_reserve_bytes = 0;
  int comm_timeout_ms = 30000;
  std::string join, advertise_host;
  std::string cluster_token_file;  // --join: the cluster token's file (else $BURST_CLUSTER_TOKEN)
  bool local_flags = false;  // any of --rank --world --store --port-file --kv-capacity ...
};

constexpr const char* kUsage =
    R"(usage: burst-worker (--model DIR | --preset NAME --random-weights SEED) --rank R --world N
                    --store DIR --port-file FILE [--progress-file FILE] [--device D]
                    [--kv-capacity TOKENS] [--kv-memory-fraction F] [--kv-reserve-bytes B]
                    [--threads T] [--comm-timeout-ms MS]
   or: burst-worker (--model DIR | --preset NAME --random-weights SEED) --join HOST:PORT
                    [--advertise-host H] [--cluster-token-file F] [--device D] [--threads T]
   or: burst-worker --version | --help

The first form is started by burst-server / burst-generate --workers N (with the group's secret
in $BURST_WORKER_SECRET); the second joins `burst-server --remote-workers N --worker-listen
HOST:PORT` (multi-node), which sends rank, world size and KV capacity.

  --model DIR       a Hugging Face LLaMA directory (config.json, *.safetensors)
  --preset NAME     random weights of a LLaMA-2 shape: 1b, 7b, 13b or 70b
  --random-weights SEED  the preset's weights' seed
  --device D        cpu (default), cuda or cuda:N
  --threads T       CPU threads (0: cores / world size; with --join: all cores)
  --rank R, --world N  this worker's rank and the group's size (spawned form)
  --store DIR       the group's rendezvous directory (spawned form)
  --port-file FILE  where the control service's port is written once the rank is up
  --progress-file FILE  where loading progress ("BYTES_DONE BYTES_TOTAL") is written while the
                    weights load; the coordinator reads it (spawned form)
  --kv-capacity TOKENS  KV rows this rank caches (spawned form; default 4096); 0 on a GPU:
                    as many as its memory holds once the weights are in
  --kv-memory-fraction F  with --kv-capacity 0: the share of the GPU this process may fill
                    (default 0.9)
  --kv-reserve-bytes B  with --kv-capacity 0: bytes kept free for activations (default 0)
  --comm-timeout-ms MS  the communicator's timeout (spawned form; default 30000)
  --join HOST:PORT  register with burst-server's worker registry (multi-node)
  --advertise-host H  the address the server and the other workers reach this one at
                    (default: this host's address on the route to the server)
  --cluster-token-file F  the cluster token (else $BURST_CLUSTER_TOKEN)
  --version         print the version and build, exit
  --help            print this, exit
SIGTERM stops the worker at any moment, loading included.
)";

[[noreturn]] void usage(const std::string& msg) {
  std::cerr << "burst-worker: " << msg << "\n" << kUsage;
  std::exit(2);
}

// How the process ends: Shutdown, SIGTERM, a broken group, or (--join) the group dissolved.
class ExitSignal {
 public:
  void request(int code) {
    std::lock_guard<std::mutex> lock(mu_);
    if (code_ < 0) code_ = code;
    cv_.notify_all();
  }
  int wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return code_ >= 0; });
    return code_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int code_ = -1;
};
ExitSignal g_exit;

std::string g_who = "burst-worker";  // how messages name this process

int fail(const std::string& msg) {
  std::cerr << g_who << ": error: " << msg << std::endl;
  return 1;
}

void say(const std::string& msg) { std::cerr << g_who << ": " << msg << std::endl; }

std::atomic<bool> g_in_group{false};
// SIGTERM came / this process is about to re-execute itself (rejoin). Each side sets its flag
// first and then reads the other's (sequentially consistent), so a SIGTERM that arrives while a
// dissolved group is being left is never lost to the re-execution: one of the two exits.
std::atomic<bool> g_terminated{false};
std::atomic<bool> g_leaving{false};

int64_t to_int(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  int64_t x = 0;
  if (!(is >> x) || !is.eof()) usage("bad value '" + v + "' for " + flag);
  return x;
}

// A number in (0, 1].
double to_fraction(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  double x = 0;
  if (!(is >> x) || !is.eof() || !(x > 0 && x <= 1)) {
    usage("bad value '" + v + "' for " + flag + " (a number in (0, 1])");
  }
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    // The only flags without a value.
    if (f == "--help" || f == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (f == "--version") {
      std::cout << burst::server::version_string("burst-worker") << "\n";
      std::exit(0);
    }
    if (i + 1 >= argc) usage("missing value for " + f);
    const std::string v = argv[++i];
    const bool local = f == "--rank" || f == "--world" || f == "--store" ||
                       f == "--port-file" || f == "--progress-file" || f == "--kv-capacity" ||
                       f == "--kv-memory-fraction" || f == "--kv-reserve-bytes" ||
                       f == "--comm-timeout-ms";
    a.local_flags = a.local_flags || local;
    if (f == "--model") a.model.dir = v;
    else if (f == "--preset") a.model.preset = v;
    else if (f == "--random-weights") a.model.random_seed = static_cast<uint64_t>(to_int(f, v));
    else if (f == "--rank") a.rank = static_cast<int>(to_int(f, v));
    else if (f == "--world") a.world = static_cast<int>(to_int(f, v));
    else if (f == "--store") a.store = v;
    else if (f == "--port-file") a.port_file = v;
    else if (f == "--progress-file") a.progress_file = v;
    else if (f == "--device") a.device = v;
    else if (f == "--kv-capacity") a.kv_capacity = to_int(f, v);
    else if (f == "--kv-memory-fraction") a.kv_memory_fraction = to_fraction(f, v);
    else if (f == "--kv-reserve-bytes") a.kv_reserve_bytes = to_int(f, v);
    else if (f == "--threads") a.threads = static_cast<int>(to_int(f, v));
    else if (f == "--comm-timeout-ms") a.comm_timeout_ms = static_cast<int>(to_int(f, v));
    else if (f == "--join") a.join = v;
    else if (f == "--advertise-host") a.advertise_host = v;
    else if (f == "--cluster-token-file") a.cluster_token_file = v;
    else usage("unknown flag " + f);
  }
  if (a.threads < 0) usage("--threads must be >= 0");
  if (!a.join.empty()) {
    if (a.local_flags) {
      usage("--rank, --world, --store, --port-file, --progress-file, --kv-capacity and "
            "--comm-timeout-ms come from the server with --join; drop them");
    }
    if (auto hp = burst::server::split_host_port(a.join); !hp.ok()) {
      usage("--join: " + hp.message());
    }
    return a;
  }
  if (!a.advertise_host.empty()) usage("--advertise-host needs --join");
  if (!a.cluster_token_file.empty()) usage("--cluster-token-file needs --join");
  if (a.world < 1 || a.rank < 0 || a.rank >= a.world) usage("need 0 <= --rank < --world");
  if (a.store.empty() || a.port_file.empty()) usage("need --store and --port-file");
  if (a.kv_capacity < 0) usage("--kv-capacity must be >= 0 (0: from the GPU's memory)");
  if (a.kv_reserve_bytes < 0) usage("--kv-reserve-bytes must be >= 0");
  return a;
}

using engine::kv_page_size;

class WorkerService final : public pb::WorkerControl::Service {
 public:
  WorkerService(models::LlamaModel& model, engine::Communicator& comm,
                engine::RingAttention& ring, std::string token)
      : model_(model), comm_(comm), ring_(ring), runner_(model, ring, comm),
        token_(std::move(token)) {}

  // Every call must carry the group's token (burst::server::kWorkerTokenKey): the port is
  // reachable by every local user (and, --join, by the network), the token only by the
  // coordinator. Compared in constant time.
  grpc::Status authorize(const grpc::ServerContext* ctx) const {
    if (token_.empty()) return grpc::Status::OK;  // --join without a cluster token
    const auto& md = ctx->client_metadata();
    const auto it = md.find(burst::server::kWorkerTokenKey);
    const std::string got = it == md.end() ? "" : std::string(it->second.data(), it->second.size());
    if (it != md.end() && burst::server::token_equal(token_, got)) return grpc::Status::OK;
    return {grpc::StatusCode::UNAUTHENTICATED,
            where() + (it == md.end() ? "no" : "a wrong") +
                " worker token: only this worker's coordinator may call it"};
  }

  // The step loop: one StepRequest in, one final StepReply out (rank 0: the sampled tokens),
  // in order, until the coordinator closes the stream. Every rank gets the same requests.
  // Requests are read by a thread of their own, so that while a step whose ids are still on
  // their way runs on the device (BatchRunner::launch) the next request, once it is here, is
  // launched behind it before that step's reply is written: the device goes from one step to
  // the next without waiting for the host's turnaround (the ids' copy, the reply, the read
  // and the next step's planning). BURST_OVERLAP=0 in the environment replies to every step
  // before reading the next (A/B timing).
  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<pb::StepReply, pb::StepRequest>* stream) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    std::lock_guard<std::mutex> lock(run_mu_);  // one coordinator session at a time
    if (broken_) return {grpc::StatusCode::UNAVAILABLE, where() + "the worker group is broken"};
    runner_.release_all();  // a new session starts from an empty cache
    RequestReader reader(stream);
    grpc::Status status = serve(*stream, reader);
    if (!status.ok() || !reader.ended()) ctx->TryCancel();  // ends the reader's Read
    reader.join();
    runner_.release_all();  // the coordinator is gone or done: free every page
    return status;
  }

  grpc::Status Ping(grpc::ServerContext* ctx, const pb::PingRequest*,
                    pb::PingResponse* out) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    out->set_rank(comm_.rank());
    out->set_world_size(comm_.world_size());
    out->set_kv_capacity(ring_.capacity());
    out->set_kv_page_size(ring_.cache().page_size());
    out->set_vocab_size(static_cast<int32_t>(model_.config().vocab_size));
    out->set_eos_token_id(model_.config().eos_token_id);
    out->set_device(model_.backend().name());
    return grpc::Status::OK;
  }

  grpc::Status Shutdown(grpc::ServerContext* ctx, const pb::ShutdownRequest*,
                        pb::ShutdownResponse*) override {
    if (grpc::Status a = authorize(ctx); !a.ok()) return a;
    g_exit.request(0);
    return grpc::Status::OK;
  }

 private:
  using Stream = grpc::ServerReaderWriter<pb::StepReply, pb::StepRequest>;

  // Reads the session's requests on its own thread into a queue.
  class RequestReader {
   public:
    explicit RequestReader(Stream* stream) : thread_([this, stream] { run(stream); }) {}
    ~RequestReader() { join(); }
    void join() {
      if (thread_.joinable()) thread_.join();
    }
    bool ended() const {
      std::lock_guard<std::mutex> lock(mu_);
      return ended_;
    }
    enum class Got { kRequest, kEnded, kStopped };
    // The next request (kRequest), or kEnded once the stream ended and every request was
    // taken. With `stop`, kStopped as soon as stop() holds (before a queued request): it is
    // polled (the caller's wait for a device event) without sleeping.
    Got next(pb::StepRequest& out, const std::function<bool()>& stop) {
      for (;;) {
        if (stop && stop()) return Got::kStopped;
        std::unique_lock<std::mutex> lock(mu_);
        if (!queue_.empty()) {
          out = std::move(queue_.front());
          queue_.pop_front();
          return Got::kRequest;
        }
        if (ended_) return Got::kEnded;
        if (stop) {
          lock.unlock();
          std::this_thread::yield();
          continue;
        }
        cv_.wait(lock, [&] { return !queue_.empty() || ended_; });
      }
    }

   private:
    void run(Stream* stream) {
      pb::StepRequest req;
      while (stream->Read(&req)) {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(req));
        cv_.notify_one();
      }
      std::lock_guard<std::mutex> lock(mu_);
      ended_ = true;
      cv_.notify_one();
    }

    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<pb::StepRequest> queue_;
    bool ended_ = false;
    std::thread thread_;  // last: starts once the members above exist
  };

  // The loop behind Session: at most one launched step whose reply is not written yet.
  grpc::Status serve(Stream& stream, RequestReader& reader) {
    const int layers = static_cast<int>(model_.config().num_layers);
    static const bool overlap = [] {
      const char* env = std::getenv("BURST_OVERLAP");
      return env == nullptr || std::string(env) != "0";
    }();
    int pending = 0;  // steps launched whose reply is not written yet
    bool write_failed = false;
    // Finishes the oldest launched step and writes its reply; an error means a broken group.
    auto reply_oldest = [&]() -> Status {
      auto result = runner_.finish();
      if (!result.ok()) return result.status();
      --pending;
      pb::StepReply reply = encode_result(result.value(), layers);
      if (!stream.Write(reply)) write_failed = true;
      return {};
    };
    auto broken = [&](const Status& st) {
      // A failed collective leaves the communicator unusable (see communicator.h). A rank
      // short of KV pages is no exception: the others may be inside the forward already. The
      // coordinator keeps the same page ledger as the ranks, so this means a bug, not load.
      broken_ = true;
      // Said here too: the coordinator often learns of the exit (and cancels the session)
      // before this status reaches it, and then names only the exit code.
      say("a step failed, leaving the group: " + st.message());
      g_exit.request(kExitBroken);
      return grpc::Status(grpc::StatusCode::INTERNAL, where() + st.message());
    };
    pb::StepRequest req;
    while (!write_failed) {
      const auto got = runner_.launched()
                           ? reader.next(req, [&] { return runner_.finish_ready(); })
                           : reader.next(req, nullptr);
      if (got != RequestReader::Got::kRequest) {
        if (runner_.launched()) {
          if (Status st = reply_oldest(); !st.ok()) return broken(st);
          continue;
        }
        break;  // the stream ended
      }
      const runtime::StepPlan plan = decode_plan(req);
      const bool progress = reports_progress(req);
      // Refuse what cannot run before any collective: every rank holds the same state and sees
      // the same plan, so all refuse together and the ring stays usable.
      const Status bad = runner_.validate(plan);
      // The step before is answered first unless this one queues behind it without holding
      // the host (BatchRunner::queues: a decode step; a prefill chunk's launch could hold it
      // and so delay that reply), and always before progress events (written as it runs).
      if (runner_.launched() && (!overlap || progress || !bad.ok() || !runner_.queues(plan))) {
        if (Status st = reply_oldest(); !st.ok()) return broken(st);
      }
      if (!bad.ok()) {
        pb::StepReply reply;
        reply.set_final(true);
        reply.set_layers(layers);
        reply.set_error_code(static_cast<int32_t>(bad.code()));
        reply.set_error(where() + bad.message());
        if (!stream.Write(reply)) break;
        continue;
      }
      models::LayerHook hook;
      if (progress && comm_.rank() == 0) {
        // Rank 0 reports each layer; a lost write only loses a progress event.
        hook = [&](int64_t done) -> Status {
          if (done < layers) {
            pb::StepReply p;
            p.set_layers_done(static_cast<int32_t>(done));
            p.set_layers(layers);
            stream.Write(p);
          }
          return {};
        };
      }
      if (Status st = runner_.launch(plan, hook); !st.ok()) return broken(st);
      ++pending;
      // The step before (if any) is answered now, behind this one's queued work; this one
      // once its ids are in or the next request was launched behind it (the loop's wait).
      while (runner_.launched() && (pending > 1 || !overlap)) {
        if (Status st = reply_oldest(); !st.ok()) return broken(st);
      }
    }
    return grpc::Status::OK;
  }

  std::string where() const { return "burst-worker rank " + std::to_string(comm_.rank()) + ": "; }

  models::LlamaModel& model_;
  engine::Communicator& comm_;
  engine::RingAttention& ring_;
  runtime::BatchRunner runner_;
  std::mutex run_mu_;
  bool broken_ = false;
  const std::string token_;
};

// Joins the communicator: NCCL for a CUDA backend, Gloo otherwise. `store` (multi-node) or
// `store_dir` (one host) is the rendezvous; `host` is what Gloo binds and advertises.
Result<std::unique_ptr<engine::Communicator>> open_communicator(
    engine::Backend& backend, int rank, int world, const std::string& store_dir,
    std::shared_ptr<engine::RendezvousStore> store, const std::string& host,
    std::chrono::milliseconds timeout) {
  if (backend.device() == engine::DeviceKind::kCuda) {
#ifdef BURST_HAVE_CUDA
    auto streams = engine::cuda_streams(backend);
    if (!streams.ok()) return streams.status();
    engine::NcclOptions o;
    o.rank = rank;
    o.world_size = world;
    o.device = streams.value().device;
    o.store_dir = store_dir;
    o.store = std::move(store);
    o.compute_stream = streams.value().compute;
    o.timeout = timeout;
    return engine::make_nccl_communicator(o);
#else
    return Status::error("this build has no CUDA");
#endif
  }
  engine::GlooOptions o;
  o.rank = rank;
  o.world_size = world;
  o.store_dir = store_dir;
  o.store = std::move(store);
  o.hostname = host;
  o.timeout = timeout;
  return engine::make_gloo_communicator(o);
}

// open_communicator, and rank 0 of a group says how it moves data (NCCL or peer stores).
Result<std::unique_ptr<engine::Communicator>> make_communicator(
    engine::Backend& backend, int rank, int world, const std::string& store_dir,
    std::shared_ptr<engine::RendezvousStore> store, const std::string& host,
    std::chrono::milliseconds timeout) {
  auto comm = open_communicator(backend, rank, world, store_dir, std::move(store), host, timeout);
  if (comm.ok() && world > 1 && rank == 0) say("communicator: " + comm.value()->transport());
  return comm;
}

// The control service on HOST:0; its port, or 0.
std::unique_ptr<grpc::Server> start_control(WorkerService& service, const std::string& host,
                                            int* port) {
  grpc::ServerBuilder builder;
  const std::string bracketed = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  builder.AddListeningPort(bracketed + ":0", grpc::InsecureServerCredentials(), port);
  builder.SetMaxReceiveMessageSize(256 << 20);  // a 1M-token prompt is ~4 MiB of ids
  builder.RegisterService(&service);
  return builder.BuildAndStart();
}

// SIGTERM (blocked in every thread since main's start) is taken by this thread with sigwait,
// so the exit path runs in normal context, not in a signal handler. Started before the model
// loads: a worker that is not in a group yet (loading, joining its communicator, registering)
// has nothing to tear down and exits at once, so a stop never waits for a load of minutes.
void start_sigterm_thread() {
  std::thread([] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    if (sigwait(&set, &sig) != 0) return;
    g_terminated = true;
    g_exit.request(0);
    if (!g_in_group || g_leaving) std::_Exit(0);
  }).detach();
}

// Loading progress: written to `progress_file` ("DONE TOTAL", bytes; write then rename, at most
// every 200 ms and at the end) for the coordinator, which logs it and shows it on /health; a
// --join worker has no file and logs a line every 5 s itself.
models::LoadProgress load_reporter(const std::string& progress_file) {
  using Clock = std::chrono::steady_clock;
  auto last = std::make_shared<Clock::time_point>();
  auto last_log = std::make_shared<Clock::time_point>(Clock::now());
  return [progress_file, last, last_log](int64_t done, int64_t total) {
    const auto now = Clock::now();
    if (!progress_file.empty()) {
      if (done < total && now - *last < std::chrono::milliseconds(200)) return;
      *last = now;
      const std::string tmp = progress_file + ".tmp";
      std::ofstream(tmp) << done << " " << total << "\n";
      std::rename(tmp.c_str(), progress_file.c_str());
    } else if (done == total || now - *last_log >= std::chrono::seconds(5)) {
      *last_log = now;
      say("loading the weights: " + burst::server::bytes_progress(done, total));
    }
  };
}

// The rows of this rank's KV pool: --kv-capacity, or (0) what the GPU holds once the weights
// are in (engine::kv_rows_from_memory), said in the log.
Result<int64_t> kv_rows(const Args& a, engine::Backend& backend,
                        const models::LlamaModel& model) {
  if (a.kv_capacity > 0) return a.kv_capacity;
#ifdef BURST_HAVE_CUDA
  if (backend.device() == engine::DeviceKind::kCuda) {
    auto mem = engine::cuda_memory_info(backend);
    if (!mem.ok()) return mem.status();
    const engine::AttentionShape s = model.attention_shape();
    const int64_t row_bytes = int64_t{s.layers} * 2 * s.kv_heads * s.head_dim *
                              static_cast<int64_t>(engine::dtype_size(backend.compute_dtype()));
    const int64_t rows = engine::kv_rows_from_memory(
        mem.value().free, mem.value().total, a.kv_memory_fraction, a.kv_reserve_bytes,
        row_bytes, kv_page_size(backend));
    auto gib = [](double bytes) {
      char b[32];
      std::snprintf(b, sizeof b, "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
      return std::string(b);
    };
    const double free = static_cast<double>(mem.value().free);
    if (rows <= 0) {
      return Status::error("no GPU memory left for the KV cache: " + gib(free) + " free of " +
                           gib(static_cast<double>(mem.value().total)) +
                           " with the weights in; " + std::to_string(a.kv_memory_fraction) +
                           " of the device may be used, " +
                           gib(static_cast<double>(a.kv_reserve_bytes)) +
                           " is kept for activations (set --kv-capacity, or a larger fraction)");
    }
    say("KV cache sized from GPU memory: " + std::to_string(rows) + " tokens, " +
        gib(static_cast<double>(rows * row_bytes)) + " (" + gib(free) + " were free)");
    return rows;
  }
#else
  (void)backend;
  (void)model;
#endif
  return Status::error("--kv-capacity 0 (from the GPU's memory) needs a CUDA device");
}

int run_local(const Args& a, engine::Backend& backend, models::LlamaModel& model,
              const std::string& secret) {
  g_who = "burst-worker rank " + std::to_string(a.rank);
  auto comm = make_communicator(backend, a.rank, a.world, a.store, nullptr, "127.0.0.1",
                                std::chrono::milliseconds(a.comm_timeout_ms));
  if (!comm.ok()) return fail(comm.message());
  auto capacity = kv_rows(a, backend, model);
  if (!capacity.ok()) return fail(capacity.message());
  auto ring = engine::RingAttention::create(backend, *comm.value(), model.attention_shape(),
                                            capacity.value(), kv_page_size(backend));
  if (!ring.ok()) return fail(ring.message());
  WorkerService service(model, *comm.value(), *ring.value(), secret);
  int port = 0;
  std::unique_ptr<grpc::Server> server = start_control(service, "127.0.0.1", &port);
  if (!server || port == 0) return fail("cannot start the control service on 127.0.0.1");
  {
    // Write then rename: the coordinator never reads a half-written port.
    const std::string tmp = a.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    if (std::rename(tmp.c_str(), a.port_file.c_str()) != 0) {
      return fail("cannot write the port file " + a.port_file);
    }
  }
  g_in_group = true;
  const int code = g_exit.wait();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::_Exit(code);  // skip destructors of a possibly broken communicator
}

// Replaces this process with a fresh copy of itself that registers again (see the top of the
// file for why not in-process). Descriptors are not inherited: the old group's sockets close.
[[noreturn]] void rejoin(char** argv) {
  g_leaving = true;
  if (g_terminated) std::_Exit(0);  // asked to stop while the group dissolved: stop
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
  std::cerr << g_who << ": error: cannot re-execute /proc/self/exe to rejoin: "
            << std::strerror(errno) << std::endl;
  std::_Exit(1);
}

// The cluster token: --cluster-token-file, else the environment (empty: none).
Result<std::string> join_token(const Args& a) {
  namespace srv = burst::server;
  return a.cluster_token_file.empty() ? srv::cluster_token_from_env()
                                      : srv::read_token_file(a.cluster_token_file);
}

// The address the other ranks and the server reach this worker at: --advertise-host, else the
// local address of the route towards the server.
Result<std::string> advertised_host(const Args& a) {
  if (!a.advertise_host.empty()) return a.advertise_host;
  const auto hp = burst::server::split_host_port(a.join).value();
  auto local = burst::server::local_address_towards(hp.first, hp.second);
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

// A member of the group the server assigned: the communicator through the server's store, the
// KV pool, the control service (its address into the store), then serving until the membership
// stream ends or a signal. Returns only the exit code of a set-up failure; otherwise it exits,
// or re-executes itself to register again.
int serve_as_member(const Args& a, engine::Backend& backend,
                                  models::LlamaModel& model, char** argv,
                                  const std::shared_ptr<grpc::Channel>& channel,
                                  const std::string& token, const std::string& host,
                                  grpc::ClientReader<pb::JoinEvent>& reader,
                                  const pb::JoinAssigned& as) {
  namespace srv = burst::server;
  g_who = "burst-worker rank " + std::to_string(as.rank()) + " (join " + a.join + ")";
  say("joined as rank " + std::to_string(as.rank()) + " of " + std::to_string(as.world_size()) +
      " (generation " + std::to_string(as.generation()) + ")");
  if (a.threads == 0) {
    // Every rank on its own host gets all of its cores.
    omp_set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  }
  auto store = std::make_shared<srv::RegistryStore>(channel, as.generation(), token);
  auto comm = make_communicator(backend, as.rank(), as.world_size(), "", store, host,
                                std::chrono::milliseconds(as.comm_timeout_ms()));
  if (!comm.ok()) {
    say("error: " + comm.message() + "; registering again");
    rejoin(argv);
  }
  // The pool the coordinator assigned, or (0) what this GPU holds with the coordinator's
  // fraction and activation reserve, as a local rank would.
  Args sized = a;
  sized.kv_capacity = as.kv_capacity();
  sized.kv_memory_fraction = as.kv_memory_fraction();
  sized.kv_reserve_bytes = as.kv_reserve_bytes();
  auto capacity = kv_rows(sized, backend, model);
  if (!capacity.ok()) return fail(capacity.message());  // cannot hold the KV shard: setup
  auto ring = engine::RingAttention::create(backend, *comm.value(), model.attention_shape(),
                                            capacity.value(), kv_page_size(backend));
  if (!ring.ok()) return fail(ring.message());
  WorkerService service(model, *comm.value(), *ring.value(), token);
  int port = 0;
  std::unique_ptr<grpc::Server> server = start_control(service, host, &port);
  if (!server || port == 0) {
    return fail("cannot start the control service on " + host +
                " (--advertise-host must be an address of this host)");
  }
  const std::string bracketed = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  const std::string address = bracketed + ":" + std::to_string(port);
  if (Status st = store->set("control/" + std::to_string(as.rank()),
                             std::vector<char>(address.begin(), address.end()));
      !st.ok()) {
    say("error: " + st.message() + "; registering again");
    rejoin(argv);
  }
  g_in_group = true;
  // The membership stream: a leave event or its end (the coordinator is gone) ends the group
  // for this worker.
  std::thread([&reader] {
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
    say(why);
    g_exit.request(kRejoin);
  }).detach();
  const int code = g_exit.wait();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (code == kRejoin || code == kExitBroken) rejoin(argv);
  std::_Exit(code);  // Shutdown or SIGTERM; skip destructors of a possibly broken communicator
}

// --join: registers with the server (retrying with backoff until the group forms; a refusal
// ends the process), then serves as the member it was assigned.
int run_join(const Args& a, engine::Backend& backend, models::LlamaModel& model, char** argv) {
  namespace srv = burst::server;
  g_who = "burst-worker (join " + a.join + ")";
  auto token = join_token(a);
  if (!token.ok()) return fail(token.message());
  auto host = advertised_host(a);
  if (!host.ok()) return fail(host.message());
  const bool rejoining = std::getenv(kRejoinEnv) != nullptr;
  pb::JoinRequest req;
  req.set_fingerprint(srv::model_fingerprint(model.config(), a.model));
  req.set_device_kind(backend.device() == engine::DeviceKind::kCuda ? "cuda" : "cpu");
  req.set_host(host.value());
  req.set_pid(getpid());
  req.set_rejoin(rejoining);
  auto channel = registry_channel(a.join);
  auto stub = pb::WorkerRegistry::NewStub(channel);
  say(std::string(rejoining ? "registering again" : "registering") + " as " + host.value() +
      " (pid " + std::to_string(getpid()) + ")");

  auto backoff = std::chrono::milliseconds(500);
  while (true) {
    grpc::ClientContext ctx;
    if (!token.value().empty()) ctx.AddMetadata(srv::kWorkerTokenKey, token.value());
    auto reader = stub->Join(&ctx, req);
    pb::JoinEvent ev;
    if (reader->Read(&ev) && ev.has_assigned()) {
      return serve_as_member(a, backend, model, argv, channel, token.value(), host.value(),
                             *reader, ev.assigned());
    }
    const grpc::Status st = reader->Finish();
    const auto code = st.error_code();
    if (code == grpc::StatusCode::FAILED_PRECONDITION ||
        code == grpc::StatusCode::RESOURCE_EXHAUSTED ||
        code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::INVALID_ARGUMENT) {
      std::cerr << g_who << ": refused by the server: " << st.error_message() << std::endl;
      return kExitRefused;
    }
    const std::string why = st.ok() ? "told to leave before the group formed: " +
                                          ev.leave().reason()
                                    : st.error_message();
    say("cannot register yet (" + why + "); retrying in " + std::to_string(backoff.count()) +
        " ms");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(10000));
  }
}

}  // namespace

int main(int argc, char** argv) {
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);  // inherited by every thread created below
  const Args a = parse(argc, argv);
  // A spawned worker's group secret: taken from the environment and removed from it, so no
  // child of this process inherits it. Without one, a spawned worker would open a control
  // port anyone on this host could drive: it refuses to start.
  std::string secret;
  if (const char* s = std::getenv(burst::server::kWorkerSecretEnv); s != nullptr) secret = s;
  unsetenv(burst::server::kWorkerSecretEnv);
  if (a.join.empty() && secret.empty()) {
    std::cerr << "burst-worker: error: $" << burst::server::kWorkerSecretEnv
              << " is not set: a worker with --rank/--world is started by burst-server or "
                 "burst-generate, which hand it its group's secret"
              << std::endl;
    return 2;
  }
  // Die with the coordinator: a spawned worker must never outlive the process that supervises
  // it. A --join worker has no such parent; it outlives even its server, and registers again.
  if (a.join.empty()) prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (a.join.empty()) g_who = "burst-worker rank " + std::to_string(a.rank);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  omp_set_num_threads(a.threads > 0 ? a.threads : std::max(1, cores / std::max(1, a.world)));

  start_sigterm_thread();
  // A --join worker runs on its own host, started by hand or by its own unit: it says what it
  // is. A spawned one is the coordinator's build, which the coordinator's log names already.
  if (!a.join.empty()) say(burst::server::version_string("burst-worker"));

  auto backend = engine::make_backend(a.device);
  if (!backend.ok()) return fail(backend.message());
  auto model = models::load_model(*backend.value(), a.model, load_reporter(a.progress_file));
  if (!model.ok()) return fail(model.message());
  if (!a.join.empty()) return run_join(a, *backend.value(), *model.value(), argv);
  return run_local(a, *backend.value(), *model.value(), secret);
}
