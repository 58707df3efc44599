#include "worker/worker_local.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "worker/worker_rank.h"
#include "worker/worker_service.h"

namespace burst::worker {

int run_local(WorkerProcess& process, const Args& a, engine::Backend& backend,
              models::LlamaModel& model, const std::string& secret) {
  process.set_who("burst-worker rank " + std::to_string(a.rank), a.rank);
  engine::CommunicatorOptions co;
  co.rank = a.rank;
  co.world_size = a.world;
  co.store_dir = a.store;
  co.host = "127.0.0.1";
  co.timeout = std::chrono::milliseconds(a.comm_timeout_ms);
  auto comms = join_communicators(process, a.tp, backend, co);
  if (!comms.ok()) return process.fail(comms.message());
  model.set_tensor_parallel_comm(*comms.value().tp);
  auto ring = open_ring(process, a, backend, model, *comms.value().ring);
  if (!ring.ok()) return process.fail(ring.message());
  WorkerService service(process, model, *comms.value().ring, *ring.value(), secret,
                        {a.rank, a.world});
  int port = 0;
  std::unique_ptr<grpc::Server> server = start_control(service, "127.0.0.1", &port);
  if (!server || port == 0) return process.fail("cannot start the control service on 127.0.0.1");
  {
    // Write then rename: the coordinator never reads a half-written port.
    const std::string tmp = a.port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    if (std::rename(tmp.c_str(), a.port_file.c_str()) != 0) {
      return process.fail("cannot write the port file " + a.port_file);
    }
  }
  process.enter_group();
  const int code = process.wait_exit();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  std::_Exit(code);  // skip destructors of a possibly broken communicator
}

}  // namespace burst::worker
