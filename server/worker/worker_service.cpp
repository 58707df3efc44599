#include "worker/worker_service.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>

#include "common/auth.h"
#include "group/step_codec.h"

namespace burst::worker {

using server::decode_plan;
using server::encode_result;
using server::reports_progress;

// Reads the session's requests on its own thread into a queue.
class WorkerService::RequestReader {
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
class WorkerService::StepLoop {
 public:
  StepLoop(WorkerService& service, Stream& stream, RequestReader& reader)
      : service_(service), runner_(service.runner_), stream_(stream), reader_(reader),
        layers_(static_cast<int>(service.model_.config().num_layers)),
        overlap_(service.model_.backend().tuning().overlap_steps) {}

  grpc::Status run() {
    pb::StepRequest req;
    while (!write_failed_) {
      const auto got = runner_.launched()
                           ? reader_.next(req, [&] { return runner_.finish_ready(); })
                           : reader_.next(req, nullptr);
      if (got != RequestReader::Got::kRequest) {
        if (runner_.launched()) {
          if (Status st = reply_oldest(); !st.ok()) return service_.leave_broken_group(st);
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
      if (runner_.launched() &&
          (!overlap_ || progress || !bad.ok() || !runner_.queues(plan))) {
        if (Status st = reply_oldest(); !st.ok()) return service_.leave_broken_group(st);
      }
      if (!bad.ok()) {
        if (!refuse(bad)) break;
        continue;
      }
      if (Status st = runner_.launch(plan, progress_hook(progress)); !st.ok()) {
        return service_.leave_broken_group(st);
      }
      ++pending_;
      // The step before (if any) is answered now, behind this one's queued work; this one
      // once its ids are in or the next request was launched behind it (the loop's wait).
      while (runner_.launched() && (pending_ > 1 || !overlap_)) {
        if (Status st = reply_oldest(); !st.ok()) return service_.leave_broken_group(st);
      }
    }
    return grpc::Status::OK;
  }

 private:
  // Finishes the oldest launched step and writes its reply; an error means a broken group.
  Status reply_oldest() {
    auto result = runner_.finish();
    if (!result.ok()) return result.status();
    --pending_;
    pb::StepReply reply = encode_result(result.value(), layers_);
    if (!stream_.Write(reply)) write_failed_ = true;
    return {};
  }

  // Answers a plan validate() refused; false when the reply could not be written.
  bool refuse(const Status& bad) {
    pb::StepReply reply;
    reply.set_final(true);
    reply.set_layers(layers_);
    reply.set_error_code(static_cast<int32_t>(bad.code()));
    reply.set_error(service_.where() + bad.message());
    return stream_.Write(reply);
  }

  models::LayerHook progress_hook(bool progress) {
    if (!progress || service_.place_.rank != 0) return nullptr;
    // Rank 0 reports each layer; a lost write only loses a progress event.
    return [this](int64_t done) -> Status {
      if (done < layers_) {
        pb::StepReply p;
        p.set_layers_done(static_cast<int32_t>(done));
        p.set_layers(layers_);
        stream_.Write(p);
      }
      return {};
    };
  }

  WorkerService& service_;
  runtime::BatchRunner& runner_;
  Stream& stream_;
  RequestReader& reader_;
  const int layers_;
  // Tuning::overlap_steps (BURST_OVERLAP): false answers every step before the next is read.
  const bool overlap_;
  int pending_ = 0;  // steps launched whose reply is not written yet
  bool write_failed_ = false;
};

WorkerService::WorkerService(WorkerProcess& process, models::LlamaModel& model,
                             engine::Communicator& ring_comm, engine::RingAttention& ring,
                             std::string token, Place place)
    : process_(process), model_(model), place_(place), ring_(ring),
      runner_(model, ring, ring_comm), token_(std::move(token)) {}

// Every call must carry the group's token (burst::server::kWorkerTokenKey): the port is
// reachable by every local user (and, --join, by the network), the token only by the
// coordinator. Compared in constant time.
grpc::Status WorkerService::authorize(const grpc::ServerContext* ctx) const {
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
// and the next step's planning). Tuning::overlap_steps off (BURST_OVERLAP=0) replies to every
// step before reading the next (A/B timing).
grpc::Status WorkerService::Session(grpc::ServerContext* ctx, Stream* stream) {
  if (grpc::Status a = authorize(ctx); !a.ok()) return a;
  std::lock_guard<std::mutex> lock(run_mu_);  // one coordinator session at a time
  if (broken_) return {grpc::StatusCode::UNAVAILABLE, where() + "the worker group is broken"};
  runner_.release_all();  // a new session starts from an empty cache
  RequestReader reader(stream);
  grpc::Status status = StepLoop(*this, *stream, reader).run();
  if (!status.ok() || !reader.ended()) ctx->TryCancel();  // ends the reader's Read
  reader.join();
  runner_.release_all();  // the coordinator is gone or done: free every page
  return status;
}

grpc::Status WorkerService::Ping(grpc::ServerContext* ctx, const pb::PingRequest*,
                                 pb::PingResponse* out) {
  if (grpc::Status a = authorize(ctx); !a.ok()) return a;
  out->set_rank(place_.rank);
  out->set_world_size(place_.world);
  out->set_kv_capacity(ring_.capacity());
  out->set_kv_page_size(ring_.cache().page_size());
  out->set_vocab_size(static_cast<int32_t>(model_.config().vocab_size));
  out->set_eos_token_id(model_.config().eos_token_id);
  out->set_device(model_.backend().name());
  return grpc::Status::OK;
}

grpc::Status WorkerService::Shutdown(grpc::ServerContext* ctx, const pb::ShutdownRequest*,
                                     pb::ShutdownResponse*) {
  if (grpc::Status a = authorize(ctx); !a.ok()) return a;
  process_.request_exit(0);
  return grpc::Status::OK;
}

grpc::Status WorkerService::leave_broken_group(const Status& st) {
  // A failed collective leaves the communicator unusable (see communicator.h). A rank
  // short of KV pages is no exception: the others may be inside the forward already. The
  // coordinator keeps the same page ledger as the ranks, so this means a bug, not load.
  broken_ = true;
  // Said here too: the coordinator often learns of the exit (and cancels the session)
  // before this status reaches it, and then names only the exit code.
  process_.say("a step failed, leaving the group: " + st.message());
  process_.request_exit(kExitBroken);
  return grpc::Status(grpc::StatusCode::INTERNAL, where() + st.message());
}

std::string WorkerService::where() const {
  return "burst-worker rank " + std::to_string(place_.rank) + ": ";
}

std::string bracketed_host(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

std::unique_ptr<grpc::Server> start_control(WorkerService& service, const std::string& host,
                                            int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(bracketed_host(host) + ":0", grpc::InsecureServerCredentials(), port);
  builder.SetMaxReceiveMessageSize(256 << 20);  // a 1M-token prompt is ~4 MiB of ids
  builder.RegisterService(&service);
  return builder.BuildAndStart();
}

}  // namespace burst::worker
