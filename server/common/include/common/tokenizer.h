// The LLaMA-2 tokenizer over Debian's SentencePiece library (libsentencepiece), loaded from the
// model directory's tokenizer.model (rebuilt from npm by scripts/make_tokenizer.py).
// SentencePiece runs inside libburst_spm.so, loaded on first use from $BURST_SPM_MODULE, else
// beside the running executable, else the build tree (common/spm_abi.h says why).
// A long text is cut where no token can span the cut, and its pieces are encoded at once on a
// pool of threads shared by the process; the ids are those of encoding it whole.
#pragma once

#include <cstddef>
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
  // are not valid UTF-8 are an error (the caller reports it), not silently replaced. A text of
  // kSplitMinBytes or more is cut into pieces of about kPieceBytes, encoded on the calling
  // thread and the process's pool (encode_split), when the model allows cutting it; the ids are
  // the same either way.
  Result<std::vector<int>> encode(std::string_view text, bool add_bos, bool add_eos) const;

  // encode() with its split spelled out, for tests and bench/bench_tokenize.cpp.
  struct Split {
    // About this many bytes a piece: each cut goes at the first safe point at least this far
    // past the previous one. 0: encode()'s choice. >= the text's size: the whole text, one piece.
    size_t piece_bytes = 0;
    // At most this many threads encode the pieces, the calling thread included (the process's
    // pool gives at most encode_threads()). 0: encode_threads().
    size_t threads = 0;
  };
  // *pieces (when not null) gets the number of pieces the text was encoded as (1: whole).
  Result<std::vector<int>> encode_split(std::string_view text, bool add_bos, bool add_eos,
                                        const Split& split, size_t* pieces = nullptr) const;
  // Whether this model's settings and vocabulary allow cutting text at all (tokenizer.cpp,
  // cut_rule_from_model, lists what it checks); when not, every text is encoded whole.
  bool can_split() const { return can_split_; }
  // Threads that encode one text at most: the caller plus the helpers of the process's pool,
  // min(hardware_concurrency, kMaxEncodeThreads).
  static size_t encode_threads();
  static constexpr size_t kMaxEncodeThreads = 16;
  // SentencePiece's BPE keeps a heap over all of a text's symbol pairs, so its time per byte
  // grows with the text (about 3x from 2 KB to 500 KB: docs/benchmarks.md): pieces of about
  // kPieceBytes are cheaper even on one thread. Below kSplitMinBytes a text is encoded whole.
  static constexpr size_t kPieceBytes = 2 << 10;
  static constexpr size_t kSplitMinBytes = 4 << 10;
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
  // Offset of the first safe cut at or after `from` (text[cut] is a space), or npos.
  size_t find_cut(std::string_view text, size_t from) const;
  const Module* module_ = nullptr;
  BurstSpm* spm_ = nullptr;
  // Where text may be cut, read from the model at load (tokenizer.cpp says why it is safe).
  bool can_split_ = false;
  bool dummy_prefix_ = true;  // SentencePiece puts a U+2581 before the text
  // Characters that some piece joins to a following U+2581 (LLaMA-2: U+2581 itself, in its
  // pieces of whitespace runs), ' ' written as U+2581: a cut is never placed after one of them.
  std::vector<std::string> joins_space_;
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
