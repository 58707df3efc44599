// The LLaMA-2 tokenizer over Debian's SentencePiece library (libsentencepiece), loaded from the
// model directory's tokenizer.model (rebuilt from npm by scripts/make_tokenizer.py).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/status.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace burst::server {

class Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& model_path);
  ~Tokenizer();

  // Encodes UTF-8 text; BOS (id 1) first when add_bos, EOS (id 2) last when add_eos. Bytes that
  // are not valid UTF-8 are an error (the caller reports it), not silently replaced.
  Result<std::vector<int>> encode(std::string_view text, bool add_bos, bool add_eos) const;
  // Decodes ids to text (control tokens vanish; byte pieces join into UTF-8).
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int bos_id() const;
  int eos_id() const;
  std::string piece(int id) const;

 private:
  Tokenizer() = default;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

// Streaming detokenization for generation: feed ids one at a time, get the new text. Never
// emits half a UTF-8 character (a byte-fallback sequence is held back until it completes), and
// keeps the leading space of a word that continues the prompt (SentencePiece drops the space
// of the first piece it decodes, so decoding starts from the prompt's last token).
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tok, int context_id);
  // Text completed by this id (possibly empty).
  std::string push(int id);
  // Whatever is still held back (an incomplete UTF-8 sequence decodes to U+FFFD here).
  std::string flush();

 private:
  const Tokenizer& tok_;
  std::vector<int> ids_;
  size_t prefix_len_ = 0;  // bytes of decode(context) that are not ours
  size_t emitted_ = 0;     // bytes of our text already returned
};

}  // namespace burst::server
