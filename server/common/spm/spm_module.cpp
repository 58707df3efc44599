// libburst_spm.so: SentencePiece in its own symbol scope. Debian's libsentencepiece embeds a
// protobuf-lite 3.14 and exports its symbols; in a process that also loads libprotobuf 3.21
// (every burst process: gRPC) whichever copy the dynamic linker finds first breaks the other
// (libprotobuf's static initialisers crash, or sentencepiece's version check aborts the load).
// This module is the only code linked against libsentencepiece; the tokenizer dlopen()s it with
// RTLD_LOCAL | RTLD_DEEPBIND, so sentencepiece binds to its own protobuf and none of its symbols
// enter the global scope. The ABI is plain C (server/common/include/common/spm_abi.h); every buffer it
// returns is malloc'ed here and freed by burst_spm_release. No exception leaves the module.
#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/spm_abi.h"

#define BURST_SPM_EXPORT extern "C" __attribute__((visibility("default")))

struct BurstSpm {
  sentencepiece::SentencePieceProcessor sp;
};

namespace {

void set_error(char* err, size_t cap, const std::string& msg) {
  if (!err || cap == 0) return;
  const size_t n = std::min(cap - 1, msg.size());
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

// A malloc'ed copy (never null on success, even for zero bytes, so null always means failure).
char* copy_out(const std::string& s, size_t* len) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (!p) return nullptr;
  std::memcpy(p, s.data(), s.size());
  p[s.size()] = '\0';
  if (len) *len = s.size();
  return p;
}

}  // namespace

BURST_SPM_EXPORT BurstSpm* burst_spm_load(const char* bytes, size_t n, char* err,
                                          size_t err_cap) {
  try {
    auto* h = new BurstSpm();
    const auto st = h->sp.LoadFromSerializedProto(std::string(bytes, n));
    if (!st.ok()) {
      set_error(err, err_cap, st.ToString());
      delete h;
      return nullptr;
    }
    return h;
  } catch (const std::exception& e) {
    set_error(err, err_cap, e.what());
  } catch (...) {
    set_error(err, err_cap, "unknown exception");
  }
  return nullptr;
}

BURST_SPM_EXPORT void burst_spm_free(BurstSpm* h) { delete h; }

BURST_SPM_EXPORT int burst_spm_vocab_size(const BurstSpm* h) { return h->sp.GetPieceSize(); }
BURST_SPM_EXPORT int burst_spm_bos(const BurstSpm* h) { return h->sp.bos_id(); }
BURST_SPM_EXPORT int burst_spm_eos(const BurstSpm* h) { return h->sp.eos_id(); }

BURST_SPM_EXPORT int burst_spm_piece_kind(const BurstSpm* h, int id) {
  if (id < 0 || id >= h->sp.GetPieceSize()) return 0;
  return (h->sp.IsControl(id) ? kBurstSpmControl : 0) |
         (h->sp.IsUnknown(id) ? kBurstSpmUnknown : 0) |
         (h->sp.IsUnused(id) ? kBurstSpmUnused : 0) | (h->sp.IsByte(id) ? kBurstSpmByte : 0);
}

BURST_SPM_EXPORT char* burst_spm_piece(const BurstSpm* h, int id, size_t* len) {
  if (id < 0 || id >= h->sp.GetPieceSize()) return nullptr;
  try {
    return copy_out(h->sp.IdToPiece(id), len);
  } catch (...) {
    return nullptr;
  }
}

BURST_SPM_EXPORT int* burst_spm_encode(const BurstSpm* h, const char* text, size_t n,
                                       size_t* count, char* err, size_t err_cap) {
  try {
    std::vector<int> ids;
    const auto st = h->sp.Encode(absl::string_view(text, n), &ids);
    if (!st.ok()) {
      set_error(err, err_cap, st.ToString());
      return nullptr;
    }
    int* out = static_cast<int*>(std::malloc(sizeof(int) * (ids.size() + 1)));
    if (!out) {
      set_error(err, err_cap, "out of memory");
      return nullptr;
    }
    if (!ids.empty()) std::memcpy(out, ids.data(), sizeof(int) * ids.size());
    *count = ids.size();
    return out;
  } catch (const std::exception& e) {
    set_error(err, err_cap, e.what());
  } catch (...) {
    set_error(err, err_cap, "unknown exception");
  }
  return nullptr;
}

BURST_SPM_EXPORT char* burst_spm_decode(const BurstSpm* h, const int* ids, size_t n,
                                        size_t* len) {
  try {
    std::string text;
    if (!h->sp.Decode(std::vector<int>(ids, ids + n), &text).ok()) return nullptr;
    return copy_out(text, len);
  } catch (...) {
    return nullptr;
  }
}

BURST_SPM_EXPORT void burst_spm_release(void* p) { std::free(p); }
