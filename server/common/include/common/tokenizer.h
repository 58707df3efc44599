// The LLaMA-2 tokenizer over Debian's SentencePiece library (libsentencepiece), loaded from the
// model directory's tokenizer.model (rebuilt from npm by scripts/make_tokenizer.py).
// SentencePiece runs inside libburst_spm.so, loaded on first use from $BURST_SPM_MODULE, else
// beside the running executable, else the build tree (common/spm_abi.h says why).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/status.h"

struct BurstSpm;

namespace burst::server {

// OK when text is well-formed UTF-8; else an error naming the first bad byte's offset and why.
Status validate_utf8(std::string_view text);

class Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& model_path);
  ~Tokenizer();

  // Encodes UTF-8 text; BOS (id 1) first when add_bos, EOS (id 2) last when add_eos. Bytes that
  // are not valid UTF-8 are an error (the caller reports it), not silently replaced.
  Result<std::vector<int>> encode(std::string_view text, bool add_bos, bool add_eos) const;
  // Decodes ids to text (control tokens vanish; byte pieces join into UTF-8; an incomplete or
  // invalid byte sequence becomes U+FFFD per byte). Ids outside [0, vocab_size) are skipped: the
  // engine never samples them, and decode has no error channel.
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int bos_id() const;
  int eos_id() const;
  std::string piece(int id) const;  // empty for an id outside [0, vocab_size)
  // piece(id) with SentencePiece's word marker U+2581 shown as a space (what logprobs print).
  std::string piece_text(int id) const;
  // The most input bytes one token can stand for: the longest piece_text (a byte piece: 1).
  // With SentencePiece's identity normaliser (LLaMA's) text of B bytes needs at least
  // B / max_piece_bytes() tokens, which bounds prompt text by bytes before tokenizing it.
  size_t max_piece_bytes() const;

  struct Module;  // the loaded libburst_spm.so (one per process, tokenizer.cpp)

 private:
  friend class StreamDecoder;
  Tokenizer() = default;
  bool is_byte(int id) const;
  const Module* module_ = nullptr;
  BurstSpm* spm_ = nullptr;
  // A normal piece whose text has no leading U+2581 (e.g. "a"), or -1. StreamDecoder decodes
  // its window after this piece: the window's first word keeps its space, and no byte piece
  // before the window can join the window's bytes into one character.
  int anchor_id_ = -1;
};

// Streaming detokenization for generation: feed ids one at a time, get the new text. Never
// emits half a UTF-8 character (a byte-fallback sequence is held back until it completes), and
// keeps the leading space of a word that continues the prompt (SentencePiece drops the space
// of the first piece it decodes, so decoding starts from the prompt's last token). Each push
// decodes only the ids since the last point where all text was emitted, so a long generation
// costs O(window) per token, not O(history). context_id outside [0, vocab_size) means no prompt:
// the output then equals decode(ids), first space dropped.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tok, int context_id);
  // Text completed by this id (possibly empty).
  std::string push(int id);
  // Whatever is still held back (an incomplete UTF-8 sequence decodes to U+FFFD here).
  std::string flush();

 private:
  std::string window_text() const;  // decode(ids_) minus the context's prefix_len_ bytes

  const Tokenizer& tok_;
  std::vector<int> ids_;   // [context] + ids pushed since all text was last emitted
  size_t prefix_len_ = 0;  // bytes of decode(context) that are not ours
  size_t emitted_ = 0;     // bytes of the window's text already returned
};

}  // namespace burst::server
