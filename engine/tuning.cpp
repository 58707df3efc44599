// Tuning::from_env: the one place the A/B switches are read from the environment.
#include "engine/tuning.h"

#include <cstdlib>
#include <cstring>

namespace burst::engine {
namespace {

// Off only when the variable says 0 (its first character), as the A/B scripts set it.
bool on_unless_zero(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || v[0] != '0';
}

}  // namespace

Result<Tuning> Tuning::from_env() {
  Tuning t;
  const char* overlap = std::getenv("BURST_OVERLAP");
  t.overlap_steps = overlap == nullptr || std::strcmp(overlap, "0") != 0;
  t.pdl = on_unless_zero("BURST_PDL");
  t.peer_gather = on_unless_zero("BURST_PEER_GATHER");
  if (const char* k = std::getenv("BURST_ATTN_KERNEL"); k && *k && std::strcmp(k, "auto") != 0) {
    if (std::strcmp(k, "sm80") != 0) {
      return Status::error(std::string("BURST_ATTN_KERNEL must be auto or sm80, got '") + k +
                           "'");
    }
    t.prefill_kernel = PrefillKernel::kSm80;
  }
  return t;
}

}  // namespace burst::engine
