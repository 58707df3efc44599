// The C ABI of libburst_spm.so (server/common/spm/spm_module.cpp): SentencePiece kept in its own
// symbol scope (see the module's header comment for why). Strings and id arrays it returns are
// malloc'ed by the module and released with burst_spm_release.
#pragma once

#include <cstddef>

extern "C" {

struct BurstSpm;

enum BurstSpmPieceKind { kBurstSpmControl = 1, kBurstSpmUnknown = 2, kBurstSpmUnused = 4,
                         kBurstSpmByte = 8 };

BurstSpm* burst_spm_load(const char* bytes, size_t n, char* err, size_t err_cap);
void burst_spm_free(BurstSpm* h);
int burst_spm_vocab_size(const BurstSpm* h);
int burst_spm_bos(const BurstSpm* h);
int burst_spm_eos(const BurstSpm* h);
int burst_spm_piece_kind(const BurstSpm* h, int id);
char* burst_spm_piece(const BurstSpm* h, int id, size_t* len);
int* burst_spm_encode(const BurstSpm* h, const char* text, size_t n, size_t* count, char* err,
                      size_t err_cap);
char* burst_spm_decode(const BurstSpm* h, const int* ids, size_t n, size_t* len);
void burst_spm_release(void* p);

}  // extern "C"
