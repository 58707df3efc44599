// make_backend: a device name to a backend. A source of its own (the burst_devices library
// with the communicator factory), so that code that never makes a backend (burst-server)
// links no CUDA: the CUDA backend is built into burst_engine_cuda, linked only here.
#include <cstdlib>

#include "engine/backend.h"

namespace burst::engine {

Result<std::unique_ptr<Backend>> make_backend(const std::string& spec, const Tuning& tuning) {
  if (spec == "cpu") return make_cpu_backend(true, tuning);
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0) {
    int device = 0;
    if (spec.size() > 5) {
      char* end = nullptr;
      const long d = std::strtol(spec.c_str() + 5, &end, 10);
      if (*end != '\0' || d < 0 || d > 1024) {
        return Status::error("bad device '" + spec + "' (expected cpu, cuda or cuda:N)");
      }
      device = static_cast<int>(d);
    }
    return make_cuda_backend(device, tuning);
  }
  return Status::error("unknown device '" + spec + "' (expected cpu, cuda or cuda:N)");
}

#ifndef BURST_HAVE_CUDA
Result<std::unique_ptr<Backend>> make_cuda_backend(int, const Tuning&) {
  return Status::error("this build of burst has no CUDA backend (nvcc was not found at build)");
}
#endif

}  // namespace burst::engine
