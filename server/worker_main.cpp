// burst-worker: one rank of a worker group. Loads the model, joins the group's communicator
// (Gloo on CPU, NCCL on GPU), holds its KV-cache shard, and runs Generate commands from its coordinator over
// the internal WorkerControl gRPC service (proto/burst/v1/worker.proto). Every rank runs the
// same request in lockstep; rank 0 streams the tokens. After a communicator error the group is
// broken (a peer died or hung): the worker reports the error on the call, then exits with code 3
// so the coordinator restarts the group instead of reusing a half-dead ring.
#include <grpcpp/grpcpp.h>
#include <omp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "burst/v1/worker.grpc.pb.h"
#include "engine/backend.h"
#include "engine/ring_attention.h"
#include "models/generator.h"
#ifdef BURST_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/nccl_communicator.h"
#endif

namespace {

namespace pb = burst::v1::internal;
using namespace burst;

constexpr int kExitBroken = 3;

struct Args {
  models::ModelSpec model;
  int rank = -1, world = 0, threads = 0;
  std::string store, port_file, device = "cpu";
  int64_t kv_capacity = 4096;
  int comm_timeout_ms = 30000;
};

[[noreturn]] void usage(const std::string& msg) {
  std::cerr << "burst-worker: " << msg << "\n"
            << "usage: burst-worker (--model DIR | --preset NAME --random-weights SEED) --rank R "
               "--world N --store DIR --port-file FILE [--device cpu] [--kv-capacity TOKENS] "
               "[--threads T] [--comm-timeout-ms MS]\n"
               "Started by burst-server / burst-generate --workers N, not by hand.\n";
  std::exit(2);
}

int64_t to_int(const std::string& flag, const std::string& v) {
  std::istringstream is(v);
  int64_t x = 0;
  if (!(is >> x) || !is.eof()) usage("bad value '" + v + "' for " + flag);
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage("missing value for " + f);
    const std::string v = argv[++i];
    if (f == "--model") a.model.dir = v;
    else if (f == "--preset") a.model.preset = v;
    else if (f == "--random-weights") a.model.random_seed = static_cast<uint64_t>(to_int(f, v));
    else if (f == "--rank") a.rank = static_cast<int>(to_int(f, v));
    else if (f == "--world") a.world = static_cast<int>(to_int(f, v));
    else if (f == "--store") a.store = v;
    else if (f == "--port-file") a.port_file = v;
    else if (f == "--device") a.device = v;
    else if (f == "--kv-capacity") a.kv_capacity = to_int(f, v);
    else if (f == "--threads") a.threads = static_cast<int>(to_int(f, v));
    else if (f == "--comm-timeout-ms") a.comm_timeout_ms = static_cast<int>(to_int(f, v));
    else usage("unknown flag " + f);
  }
  if (a.world < 1 || a.rank < 0 || a.rank >= a.world) usage("need 0 <= --rank < --world");
  if (a.store.empty() || a.port_file.empty()) usage("need --store and --port-file");
  if (a.kv_capacity < 1) usage("--kv-capacity must be > 0");
  return a;
}

class WorkerService final : public pb::WorkerControl::Service {
 public:
  WorkerService(const Args& args, models::LlamaModel& model, engine::Communicator& comm,
                engine::RingAttention& ring)
      : args_(args), model_(model), comm_(comm), ring_(ring) {}

  grpc::Status Generate(grpc::ServerContext* ctx, const pb::WorkerGenerateRequest* req,
                        grpc::ServerWriter<pb::WorkerEvent>* writer) override {
    std::lock_guard<std::mutex> lock(run_mu_);  // one request at a time on the ring
    if (broken_) return {grpc::StatusCode::UNAVAILABLE, where() + "the worker group is broken"};
    models::GenerateRequest r;
    r.prompt.assign(req->prompt().begin(), req->prompt().end());
    r.max_tokens = req->max_tokens();
    r.sampling = {req->temperature(), req->top_k(), req->top_p(), req->seed()};
    r.stop_at_eos = req->stop_at_eos();
    for (int32_t id : r.prompt) {
      if (id < 0 || id >= model_.config().vocab_size) {
        return {grpc::StatusCode::INVALID_ARGUMENT,
                where() + "token id " + std::to_string(id) + " outside the vocabulary"};
      }
    }
    const auto layout = req->layout() == pb::CONTIGUOUS ? engine::ShardLayout::kContiguous
                                                        : engine::ShardLayout::kZigzag;
    // Refuse what cannot run before any collective: every rank sees the same request and the
    // same capacity, so all refuse together and the ring stays usable. Only failures inside
    // the run (a peer gone, a device error) break the group.
    const std::string bad = engine::validate(r.sampling);
    if (r.prompt.empty() || r.max_tokens <= 0 || !bad.empty()) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              where() + (!bad.empty() ? bad : "empty prompt or max_tokens <= 0")};
    }
    const auto plan = engine::ShardPlan::make(layout, static_cast<int64_t>(r.prompt.size()),
                                              comm_.world_size());
    const int64_t decode_share = (r.max_tokens + comm_.world_size() - 1) / comm_.world_size();
    if (plan.local_rows(comm_.rank()) + decode_share > ring_.capacity()) {
      return {grpc::StatusCode::RESOURCE_EXHAUSTED,
              where() + std::to_string(r.prompt.size()) + " prompt tokens + " +
                  std::to_string(r.max_tokens) + " new ones exceed the KV capacity of " +
                  std::to_string(ring_.capacity()) + " tokens per rank"};
    }
    bool client_gone = false;
    auto on_token = [&](int32_t id) {
      // Only rank 0 streams; a cancelled call or a failed write stops every rank.
      pb::WorkerEvent ev;
      ev.mutable_token()->set_id(id);
      if (ctx->IsCancelled() || !writer->Write(ev)) client_gone = true;
      return !client_gone;
    };
    auto on_progress = [&](double fraction) {
      // Checked after every prefill layer: a coordinator that cancels the call mid-prefill
      // stops every rank at the next layer instead of after the whole prompt.
      if (req->report_progress()) {
        pb::WorkerEvent ev;
        ev.mutable_progress()->set_fraction(fraction);
        if (!writer->Write(ev)) client_gone = true;
      }
      if (ctx->IsCancelled()) client_gone = true;
      return !client_gone;
    };
    auto stats = models::generate_sharded(model_, ring_, comm_, layout, r, on_token, on_progress);
    if (!stats.ok()) {
      // A failed collective leaves the communicator unusable (see communicator.h).
      broken_ = true;
      request_exit(kExitBroken);
      return {grpc::StatusCode::INTERNAL, where() + stats.message()};
    }
    const auto& s = stats.value();
    pb::WorkerEvent ev;
    auto* d = ev.mutable_done();
    d->set_finish_reason(s.finish_reason);
    d->set_prompt_tokens(s.prompt_tokens);
    d->set_generated_tokens(s.generated_tokens);
    d->set_prefill_ms(s.prefill_ms);
    d->set_decode_ms(s.decode_ms);
    d->set_ring_compute_ms(ring_.stats().compute_ms);
    d->set_ring_wait_ms(ring_.stats().wait_ms);
    writer->Write(ev);
    return grpc::Status::OK;
  }

  grpc::Status Ping(grpc::ServerContext*, const pb::PingRequest*,
                    pb::PingResponse* out) override {
    out->set_rank(comm_.rank());
    out->set_world_size(comm_.world_size());
    out->set_kv_capacity(ring_.capacity());
    out->set_vocab_size(static_cast<int32_t>(model_.config().vocab_size));
    out->set_eos_token_id(model_.config().eos_token_id);
    out->set_device(model_.backend().name());
    return grpc::Status::OK;
  }

  grpc::Status Shutdown(grpc::ServerContext*, const pb::ShutdownRequest*,
                        pb::ShutdownResponse*) override {
    request_exit(0);
    return grpc::Status::OK;
  }

  // Blocks until Shutdown or a broken group asks the worker to exit; returns the exit code.
  int wait_for_exit() {
    std::unique_lock<std::mutex> lock(exit_mu_);
    exit_cv_.wait(lock, [&] { return exit_code_ >= 0; });
    return exit_code_;
  }
  void request_exit(int code) {
    std::lock_guard<std::mutex> lock(exit_mu_);
    if (exit_code_ < 0) exit_code_ = code;
    exit_cv_.notify_all();
  }

 private:
  std::string where() const { return "burst-worker rank " + std::to_string(args_.rank) + ": "; }

  const Args& args_;
  models::LlamaModel& model_;
  engine::Communicator& comm_;
  engine::RingAttention& ring_;
  std::mutex run_mu_;
  bool broken_ = false;
  std::mutex exit_mu_;
  std::condition_variable exit_cv_;
  int exit_code_ = -1;
};

int fail(const Args& a, const std::string& msg) {
  std::cerr << "burst-worker rank " << a.rank << ": error: " << msg << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Die with the coordinator: a worker must never outlive the process that supervises it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);  // inherited by every thread created below
  const Args a = parse(argc, argv);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  omp_set_num_threads(a.threads > 0 ? a.threads : std::max(1, cores / a.world));

  auto backend = engine::make_backend(a.device);
  if (!backend.ok()) return fail(a, backend.message());
  auto model = models::load_model(*backend.value(), a.model);
  if (!model.ok()) return fail(a, model.message());
  const auto timeout = std::chrono::milliseconds(a.comm_timeout_ms);
  Result<std::unique_ptr<engine::Communicator>> comm = Status::error("no communicator");
  if (backend.value()->device() == engine::DeviceKind::kCuda) {
#ifdef BURST_HAVE_CUDA
    auto streams = engine::cuda_streams(*backend.value());
    if (!streams.ok()) return fail(a, streams.message());
    comm = engine::make_nccl_communicator(
        {a.rank, a.world, streams.value().device, a.store, streams.value().compute, timeout});
#endif
  } else {
    comm = engine::make_gloo_communicator({a.rank, a.world, a.store, "127.0.0.1", timeout});
  }
  if (!comm.ok()) return fail(a, comm.message());
  auto ring = engine::RingAttention::create(*backend.value(), *comm.value(),
                                            model.value()->attention_shape(), a.kv_capacity);
  if (!ring.ok()) return fail(a, ring.message());

  WorkerService service(a, *model.value(), *comm.value(), *ring.value());
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(256 << 20);  // a 1M-token prompt is ~4 MiB of ids
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return fail(a, "cannot start the control service on 127.0.0.1");
  {
    // Write then rename: the coordinator never reads a half-written port.
    const std::string tmp = a.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    if (std::rename(tmp.c_str(), a.port_file.c_str()) != 0) return fail(a, "cannot write port file");
  }
  // SIGTERM (blocked in every thread since main's start) is taken by this thread with
  // sigwait, so the exit path runs in normal context, not in a signal handler.
  std::thread([&service] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    if (sigwait(&set, &sig) == 0) service.request_exit(0);
  }).detach();
  const int code = service.wait_for_exit();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::_Exit(code);  // skip destructors of a possibly broken communicator
}
