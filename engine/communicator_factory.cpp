#include "engine/communicator_factory.h"

#ifdef BURST_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/nccl_communicator.h"
#endif

namespace burst::engine {

Result<std::unique_ptr<Communicator>> make_communicator(Backend& backend,
                                                        const CommunicatorOptions& options) {
  if (backend.device() == DeviceKind::kCuda) {
#ifdef BURST_HAVE_CUDA
    auto streams = cuda_streams(backend);
    if (!streams.ok()) return streams.status();
    NcclOptions o;
    o.rank = options.rank;
    o.world_size = options.world_size;
    o.device = streams.value().device;
    o.store_dir = options.store_dir;
    o.store = options.store;
    o.compute_stream = streams.value().compute;
    o.timeout = options.timeout;
    return make_nccl_communicator(o);
#else
    return Status::error("this build has no CUDA");
#endif
  }
  GlooOptions o;
  o.rank = options.rank;
  o.world_size = options.world_size;
  o.store_dir = options.store_dir;
  o.store = options.store;
  o.hostname = options.host;
  o.timeout = options.timeout;
  return make_gloo_communicator(o);
}

}  // namespace burst::engine
