// WorkerService: the rank's side of the internal WorkerControl gRPC service
// (proto/burst/v1/worker.proto). Session runs the coordinator's steps in order on this rank's
// BatchRunner, Ping says what the rank holds, Shutdown ends the process.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <string>

#include "burst/v1/worker.grpc.pb.h"
#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "models/llama.h"
#include "runtime/batch_runner.h"
#include "worker/worker_process.h"

namespace burst::worker {

namespace pb = ::burst::v1::internal;

class WorkerService final : public pb::WorkerControl::Service {
 public:
  // This worker's rank in the whole group (tensor-parallel ranks included) and the group's size.
  struct Place {
    int rank = 0, world = 1;
  };
  // `ring_comm`: the rank's context-parallel ring (its BatchRunner's group); `token`: what
  // every call must carry (empty: --join without a cluster token, none).
  WorkerService(WorkerProcess& process, models::LlamaModel& model,
                engine::Communicator& ring_comm, engine::RingAttention& ring, std::string token,
                Place place);

  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<pb::StepReply, pb::StepRequest>* stream) override;
  grpc::Status Ping(grpc::ServerContext* ctx, const pb::PingRequest*,
                    pb::PingResponse* out) override;
  grpc::Status Shutdown(grpc::ServerContext* ctx, const pb::ShutdownRequest*,
                        pb::ShutdownResponse*) override;

 private:
  using Stream = grpc::ServerReaderWriter<pb::StepReply, pb::StepRequest>;
  class RequestReader;
  class StepLoop;

  grpc::Status authorize(const grpc::ServerContext* ctx) const;
  // A step failed: the group is broken and the process leaves it; the status for the call.
  grpc::Status leave_broken_group(const Status& st);
  std::string where() const;

  WorkerProcess& process_;
  models::LlamaModel& model_;
  const Place place_;
  engine::RingAttention& ring_;
  runtime::BatchRunner runner_;
  std::mutex run_mu_;
  bool broken_ = false;
  const std::string token_;
};

// `host` as the host part of an address: an IPv6 address in brackets.
std::string bracketed_host(const std::string& host);

// The control service on HOST:0 (an IPv6 address without brackets is fine); its port goes to
// *port, 0 when it could not listen.
std::unique_ptr<grpc::Server> start_control(WorkerService& service, const std::string& host,
                                            int* port);

}  // namespace burst::worker
