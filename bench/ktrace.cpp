// libburst_ktrace.so: a GPU timeline of any CUDA process, without nsys (the GPU machines have
// none). Loaded by the CUDA driver itself: CUDA_INJECTION64_PATH=/path/libburst_ktrace.so makes
// every process that initialises CUDA (burst-worker under burst-server too: the environment is
// inherited) call InitializeInjection(), which turns on CUPTI's activity records for kernels,
// memcpys and memsets (and, with BURST_KTRACE_API=1, the host's runtime-API calls). Records go
// to $BURST_KTRACE_DIR (default /tmp)/ktrace_<pid>.tsv as they complete (CUPTI flushes every
// 100 ms, so a process killed later loses at most its last 100 ms), one line each:
//   kind  start_ns  end_ns  device  stream  correlation  name
// kind: K kernel, C memcpy, S memset, A runtime API call (host thread id in the stream column).
// Timestamps are CUPTI's (one clock for host and device). bench/gpu/ktrace_report.py turns a
// file into per-step kernel time and gaps. Concurrent-kernel records do not serialise kernels,
// but the tracing is not free: a 7B decode step of short chained kernels took 2-5x longer under
// it on an H200 (docs/benchmarks.md), so read it for long kernels (prefill), not for those.
#include <cupti.h>
#include <cxxabi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

std::mutex g_mu;
FILE* g_out = nullptr;
constexpr size_t kBufferBytes = 4 << 20;

void report(CUptiResult r, const char* what, int line) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "ktrace: %s (%s:%d, pid %d): %s\n", what, __FILE__, line,
               static_cast<int>(getpid()), msg ? msg : "?");
}
#define KTRACE_TRY(call) report((call), #call, __LINE__)

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : out) {
    if (c == '\t' || c == '\n') c = ' ';
  }
  return out;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mu);
  CUpti_Activity* rec = nullptr;
  // One line of the file (the header's columns); `lane` is the stream, or the host thread.
  auto line = [](char kind, uint64_t start, uint64_t end, uint32_t device, uint32_t lane,
                 uint32_t correlation, const std::string& name) {
    std::fprintf(g_out, "%c\t%llu\t%llu\t%u\t%u\t%u\t%s\n", kind,
                 static_cast<unsigned long long>(start), static_cast<unsigned long long>(end),
                 device, lane, correlation, name.c_str());
  };
  while (g_out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        line('K', k->start, k->end, k->deviceId, k->streamId, k->correlationId,
             demangle(k->name));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        line('C', m->start, m->end, m->deviceId, m->streamId, m->correlationId,
             "memcpy kind " + std::to_string(m->copyKind) + ", " + std::to_string(m->bytes) +
                 " bytes");
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        line('S', m->start, m->end, m->deviceId, m->streamId, m->correlationId,
             "memset " + std::to_string(m->bytes) + " bytes");
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        line('A', a->start, a->end, 0, a->threadId, a->correlationId, name ? name : "?");
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped > 0 && g_out) std::fprintf(g_out, "D\t0\t0\t0\t0\t0\t%zu records dropped\n", dropped);
  if (g_out) std::fflush(g_out);
  std::free(buffer);
}

void flush_at_exit() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection(void) {
  const char* dir = std::getenv("BURST_KTRACE_DIR");
  const std::string path = std::string(dir && *dir ? dir : "/tmp") + "/ktrace_" +
                           std::to_string(static_cast<int>(getpid())) + ".tsv";
  g_out = std::fopen(path.c_str(), "w");
  if (!g_out) {
    std::fprintf(stderr, "ktrace: cannot write %s\n", path.c_str());
    return 0;
  }
  KTRACE_TRY(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  KTRACE_TRY(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  KTRACE_TRY(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  KTRACE_TRY(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  const char* api = std::getenv("BURST_KTRACE_API");
  if (api && std::strcmp(api, "1") == 0) KTRACE_TRY(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME));
  KTRACE_TRY(cuptiActivityFlushPeriod(100));
  std::atexit(flush_at_exit);
  return 1;
}
