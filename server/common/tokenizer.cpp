// Tokenizer over Debian's SentencePiece (libsentencepiece 0.1.97). Contract: load() never throws
// and never aborts on a bad path or file (it reads the bytes itself, so a directory or a garbage
// file is a Status, not a libstdc++ exception from inside SentencePiece); encode() accepts only
// well-formed UTF-8 and names the offending byte offset otherwise, and agrees id for id with
// `spm_encode --output_format=id` on valid text; decode() is SentencePiece's. StreamDecoder
// returns, piece by piece, exactly the bytes that decode(prompt + generated) adds to
// decode(prompt), never splitting a UTF-8 character. A long text is cut at points no token can
// span (find_cut says why they are safe for the model at hand) and its pieces are encoded on the
// process's EncodePool; the concatenated ids equal those of encoding the text whole.
#include "common/tokenizer.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "common/spm_abi.h"

namespace burst::server {
namespace {

// A tokenizer.model is ~0.5 MB; anything this large is not one, and reading it whole would only
// waste memory before the protobuf parser rejects it.
constexpr std::uintmax_t kMaxModelBytes = 64u << 20;

// U+FFFD as SentencePiece writes it for each byte of an incomplete or invalid byte-fallback run.
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

// U+2581, the piece-level stand-in for a space.
constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";

std::string offset_error(size_t offset, const char* why) {
  return "invalid UTF-8 at byte offset " + std::to_string(offset) + ": " + why;
}

}  // namespace

// Well-formed UTF-8 as in Unicode table 3-7: no overlongs, no surrogates (U+D800..U+DFFF), nothing
// above U+10FFFF, no truncated sequence. SentencePiece would otherwise map such bytes silently,
// and the caller asked for an error instead.
Status validate_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c == 0xE0) {
      len = 3, lo = 0xA0;  // below is an overlong 3-byte form
    } else if (c == 0xED) {
      len = 3, hi = 0x9F;  // above is a surrogate
    } else if (c >= 0xE1 && c <= 0xEF) {
      len = 3;
    } else if (c == 0xF0) {
      len = 4, lo = 0x90;  // below is an overlong 4-byte form
    } else if (c >= 0xF1 && c <= 0xF3) {
      len = 4;
    } else if (c == 0xF4) {
      len = 4, hi = 0x8F;  // above is past U+10FFFF
    } else if (c >= 0x80 && c <= 0xBF) {
      return Status::error(offset_error(i, "unexpected continuation byte"));
    } else if (c == 0xC0 || c == 0xC1) {
      return Status::error(offset_error(i, "overlong 2-byte sequence"));
    } else {
      return Status::error(offset_error(i, "byte is never valid in UTF-8"));
    }
    if (i + 1 >= n) return Status::error(offset_error(i, "truncated sequence"));
    if (s[i + 1] < lo || s[i + 1] > hi) {
      if (s[i + 1] >= 0x80 && s[i + 1] <= 0xBF) {
        return Status::error(offset_error(i, "overlong, surrogate or above U+10FFFF"));
      }
      return Status::error(offset_error(i, "truncated sequence"));
    }
    for (size_t k = 2; k < len; ++k) {
      if (i + k >= n || s[i + k] < 0x80 || s[i + k] > 0xBF) {
        return Status::error(offset_error(i, "truncated sequence"));
      }
    }
    i += len;
  }
  return Status();
}

namespace {

// Length of the longest prefix of `text` that ends on a UTF-8 character boundary. SentencePiece
// only emits whole characters, so this is a guard, not a path the tests expect to take.
size_t complete_prefix(std::string_view text) {
  const size_t n = text.size();
  // The last non-continuation byte within reach of a 4-byte sequence is the last lead byte.
  size_t p = n;
  while (p > 0 && n - p < 4) {
    --p;
    if ((static_cast<unsigned char>(text[p]) & 0xC0) != 0x80) {
      const auto lead = static_cast<unsigned char>(text[p]);
      const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
      return n - p >= need ? n : p;
    }
  }
  return n;  // only continuation bytes in reach: waiting cannot complete them
}

}  // namespace

namespace {

// Just enough of the protobuf wire format to read a tokenizer.model's settings: Debian installs
// no sentencepiece_model.pb.h, and the module's protobuf stays out of this process's symbol
// scope. Every read is bounds-checked; a malformed model only turns splitting off (SentencePiece
// itself has accepted it by then).
class WireReader {
 public:
  explicit WireReader(std::string_view bytes) : rest_(bytes) {}
  bool empty() const { return rest_.empty(); }
  bool varint(uint64_t* v) {
    uint64_t out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (rest_.empty()) return false;
      const auto b = static_cast<unsigned char>(rest_[0]);
      rest_.remove_prefix(1);
      out |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *v = out;
        return true;
      }
    }
    return false;
  }
  // The next field's number and wire type.
  bool key(uint32_t* field, uint32_t* type) {
    uint64_t k = 0;
    if (!varint(&k) || (k >> 3) == 0 || (k >> 3) > std::numeric_limits<uint32_t>::max()) {
      return false;
    }
    *field = static_cast<uint32_t>(k >> 3);
    *type = static_cast<uint32_t>(k & 7);
    return true;
  }
  // A length-delimited field's bytes (wire type 2).
  bool bytes(std::string_view* out) {
    uint64_t n = 0;
    if (!varint(&n) || n > rest_.size()) return false;
    *out = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return true;
  }
  // A varint field's value, when the field has the varint wire type.
  bool varint_field(uint32_t type, uint64_t* v) { return type == 0 && varint(v); }
  bool skip(uint32_t type) {
    uint64_t v = 0;
    std::string_view s;
    switch (type) {
      case 0:
        return varint(&v);
      case 1:
        return advance(8);
      case 2:
        return bytes(&s);
      case 5:
        return advance(4);
      default:
        return false;  // groups: sentencepiece_model.proto has none
    }
  }

 private:
  bool advance(size_t n) {
    if (n > rest_.size()) return false;
    rest_.remove_prefix(n);
    return true;
  }
  std::string_view rest_;
};

// Where text may be cut for this model; can_split false when anything below does not hold.
struct CutRule {
  bool can_split = false;
  bool dummy_prefix = true;
  std::vector<std::string> joins_space;
};

// Reads the settings find_cut's argument rests on from the model proto (field numbers and
// defaults of sentencepiece_model.proto):
// - BPE (trainer_spec.model_type = 2): encoding merges adjacent symbols into vocabulary pieces
//   and nothing else (bpe_model.cc); unigram's lattice is not argued here.
// - The identity normaliser with no rules (normalizer_spec.precompiled_charsmap empty),
//   remove_extra_whitespaces off, escape_whitespaces on, whitespace as a prefix
//   (trainer_spec.treat_whitespace_as_suffix off): normalising is then per character, ' ' ->
//   U+2581, plus one U+2581 before the text when add_dummy_prefix (recorded, either way works).
// - No USER_DEFINED piece (matched whole before BPE, and frozen) and no UNUSED piece (BPE splits
//   those back by a table shared across the whole text).
// - U+2581 alone is a NORMAL piece, so the first token after a cut is never <unk> (without byte
//   fallback SentencePiece fuses a run of <unk> into one).
// And it collects joins_space: each character that precedes a U+2581 inside a NORMAL piece.
// The model's own proto is read, not LLaMA-2's settings assumed, so another tokenizer.model
// whose settings differ is encoded whole rather than cut where a token could span the cut.
CutRule cut_rule_from_model(std::string_view model) {
  const CutRule no;  // what a malformed or unexpected model gets

  uint64_t model_type = 1;  // UNIGRAM, the proto default
  bool suffix = false, charsmap = false, remove_extra = true, escape = true, odd_piece = false;
  bool space_piece = false;
  CutRule rule;
  // U+2581 always: then a cut never follows a space, and a piece after a cut is never a lone
  // space, which the dummy prefix could not stand for (SentencePiece encodes "" as no tokens).
  rule.joins_space.emplace_back(kSpaceSymbol);
  WireReader top(model);
  while (!top.empty()) {
    uint32_t field = 0, type = 0;
    if (!top.key(&field, &type)) return no;
    if (type != 2 || field > 3) {
      if (!top.skip(type)) return no;
      continue;
    }
    std::string_view message;
    if (!top.bytes(&message)) return no;
    WireReader r(message);
    std::string_view piece;
    uint64_t piece_type = 1;  // NORMAL
    while (!r.empty()) {
      uint32_t f = 0, t = 0;
      uint64_t v = 0;
      if (!r.key(&f, &t)) return no;
      bool read = false;
      if (field == 1 && f == 1) {  // SentencePiece.piece
        read = t == 2 && r.bytes(&piece);
      } else if (field == 1 && f == 3) {  // SentencePiece.type
        read = r.varint_field(t, &piece_type);
      } else if (field == 2 && f == 3) {  // TrainerSpec.model_type
        read = r.varint_field(t, &model_type);
      } else if (field == 2 && f == 24) {  // TrainerSpec.treat_whitespace_as_suffix
        read = r.varint_field(t, &v);
        suffix = v != 0;
      } else if (field == 3 && f == 2) {  // NormalizerSpec.precompiled_charsmap
        std::string_view map;
        read = t == 2 && r.bytes(&map);
        charsmap = !map.empty();
      } else if (field == 3 && f == 3) {  // NormalizerSpec.add_dummy_prefix
        read = r.varint_field(t, &v);
        rule.dummy_prefix = v != 0;
      } else if (field == 3 && f == 4) {  // NormalizerSpec.remove_extra_whitespaces
        read = r.varint_field(t, &v);
        remove_extra = v != 0;
      } else if (field == 3 && f == 5) {  // NormalizerSpec.escape_whitespaces
        read = r.varint_field(t, &v);
        escape = v != 0;
      } else {
        read = r.skip(t);
      }
      if (!read) return no;
    }
    if (field != 1) continue;
    if (piece_type == 4 || piece_type == 5) odd_piece = true;
    if (piece_type != 1) continue;
    if (piece == kSpaceSymbol) space_piece = true;
    for (size_t at = piece.find(kSpaceSymbol, 1); at != std::string_view::npos;
         at = piece.find(kSpaceSymbol, at + 1)) {
      size_t start = at - 1;  // back to the lead byte of the character before it
      while (start > 0 && (static_cast<unsigned char>(piece[start]) & 0xC0) == 0x80) --start;
      const std::string_view before = piece.substr(start, at - start);
      if (std::find(rule.joins_space.begin(), rule.joins_space.end(), before) ==
          rule.joins_space.end()) {
        rule.joins_space.emplace_back(before);
      }
    }
  }
  rule.can_split = model_type == 2 && !suffix && !charsmap && !remove_extra && escape &&
                   !odd_piece && space_piece;
  return rule;
}

// The process's encode helpers: encode_threads() - 1 threads, made on the first split encode
// and kept for the life of the process, so a server with many requests in flight runs at most
// that many helpers beside the requests' own threads. A caller never waits for a helper to come
// free: it claims pieces itself and helpers claim the rest as they can, so a busy pool degrades
// to encoding on the caller, never to a queue behind other requests.
class EncodePool {
 public:
  // Never destroyed: its helpers may still be parked when the process exits, and a static
  // destructor would have to join them after other statics are gone.
  static EncodePool& instance() {
    static EncodePool* pool = new EncodePool(Tokenizer::encode_threads() - 1);
    return *pool;
  }
  size_t helpers() const { return threads_.size(); }

  // Runs task(i) for every i in [0, n) on the calling thread and on up to `helpers` pool
  // threads; returns when all n calls have returned. task must not throw.
  void run(size_t n, size_t helpers, const std::function<void(size_t)>& task) {
    auto batch = std::make_shared<Batch>(task, n);
    const size_t asked = std::min({helpers, threads_.size(), n > 0 ? n - 1 : 0});
    if (asked > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < asked; ++k) queue_.push_back(batch);
    }
    if (asked == 1) wake_.notify_one();
    if (asked > 1) wake_.notify_all();
    drain(*batch);
    // Pieces a helper claimed may still be running: `task` and what it writes to live in the
    // caller's frame, so return only after the last one has finished.
    std::unique_lock<std::mutex> lock(batch->mu);
    batch->done.wait(lock, [&] { return batch->left == 0; });
  }

 private:
  struct Batch {
    Batch(const std::function<void(size_t)>& t, size_t count) : task(&t), n(count), left(count) {}
    const std::function<void(size_t)>* task;
    const size_t n;
    std::atomic<size_t> next{0};
    std::atomic<size_t> left;  // calls not yet returned
    std::mutex mu;             // with `done`: the caller's wait for left == 0
    std::condition_variable done;
  };

  explicit EncodePool(size_t helpers) {
    for (size_t k = 0; k < helpers; ++k) {
      try {
        threads_.emplace_back([this] { serve(); });
      } catch (const std::system_error&) {
        break;  // fewer helpers: callers encode more of their pieces themselves
      }
    }
  }

  // Claims the batch's pieces one at a time until none is left. A batch entry that reaches a
  // helper after its caller took every piece claims nothing and is dropped.
  static void drain(Batch& b) {
    for (size_t i = b.next.fetch_add(1); i < b.n; i = b.next.fetch_add(1)) {
      (*b.task)(i);
      if (b.left.fetch_sub(1) == 1) {
        // Taking the mutex orders this notify after the caller's test of `left` or its wait:
        // without it the caller could test, miss this notify, and sleep for ever.
        std::lock_guard<std::mutex> lock(b.mu);
        b.done.notify_all();
      }
    }
  }

  void serve() {
    for (;;) {
      std::shared_ptr<Batch> batch;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return !queue_.empty(); });
        batch = std::move(queue_.front());
        queue_.pop_front();
      }
      drain(*batch);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Batch>> queue_;  // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace

// The functions of libburst_spm.so, resolved once per process.
struct Tokenizer::Module {
  decltype(&burst_spm_load) load;
  decltype(&burst_spm_free) free;
  decltype(&burst_spm_vocab_size) vocab_size;
  decltype(&burst_spm_bos) bos;
  decltype(&burst_spm_eos) eos;
  decltype(&burst_spm_piece_kind) piece_kind;
  decltype(&burst_spm_piece) piece;
  decltype(&burst_spm_encode) encode;
  decltype(&burst_spm_decode) decode;
  decltype(&burst_spm_release) release;
};

namespace {

// RTLD_DEEPBIND: the module and libsentencepiece resolve their protobuf symbols to their own
// copy, not to the process's libprotobuf (which gRPC loaded). RTLD_LOCAL keeps theirs out of
// the global scope.
Result<const Tokenizer::Module*> load_module() {
  static Tokenizer::Module module;
  static std::string error;
  static const bool loaded = [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("BURST_SPM_MODULE")) candidates.emplace_back(env);
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) candidates.push_back((self.parent_path() / "libburst_spm.so").string());
    candidates.emplace_back(BURST_SPM_MODULE_DEFAULT);
    void* handle = nullptr;
    for (const auto& path : candidates) {
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle) break;
      const char* why = dlerror();
      error += (error.empty() ? "" : "; ") + path + ": " + (why ? why : "not loadable");
    }
    if (!handle) return false;
    bool ok = true;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, name));
      if (!fn) {
        ok = false;
        error = std::string("libburst_spm.so lacks ") + name;
      }
    };
    bind(module.load, "burst_spm_load");
    bind(module.free, "burst_spm_free");
    bind(module.vocab_size, "burst_spm_vocab_size");
    bind(module.bos, "burst_spm_bos");
    bind(module.eos, "burst_spm_eos");
    bind(module.piece_kind, "burst_spm_piece_kind");
    bind(module.piece, "burst_spm_piece");
    bind(module.encode, "burst_spm_encode");
    bind(module.decode, "burst_spm_decode");
    bind(module.release, "burst_spm_release");
    return ok;
  }();
  if (!loaded) return Status::error("tokenizer: cannot load the SentencePiece module (" + error + ")");
  return &module;
}

}  // namespace

Tokenizer::~Tokenizer() {
  if (spm_) module_->free(spm_);
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& model_path) {
  try {
    std::error_code ec;
    const auto status = std::filesystem::status(model_path, ec);
    if (ec || !std::filesystem::exists(status)) {
      return Status::error("tokenizer: no such file: " + model_path);
    }
    if (!std::filesystem::is_regular_file(status)) {
      return Status::error("tokenizer: not a regular file: " + model_path);
    }
    const auto size = std::filesystem::file_size(model_path, ec);
    if (ec) return Status::error("tokenizer: cannot stat " + model_path + ": " + ec.message());
    if (size > kMaxModelBytes) {
      return Status::error("tokenizer: " + model_path + " is " + std::to_string(size) +
                           " bytes, too large for a tokenizer.model");
    }
    std::ifstream in(model_path, std::ios::binary);
    if (!in) return Status::error("tokenizer: cannot open " + model_path);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) return Status::error("tokenizer: error reading " + model_path);

    auto module = load_module();
    if (!module.ok()) return module.status();
    std::unique_ptr<Tokenizer> tok(new Tokenizer());
    tok->module_ = module.value();
    char err[512] = {0};
    tok->spm_ = tok->module_->load(bytes.data(), bytes.size(), err, sizeof err);
    if (!tok->spm_) return Status::error("tokenizer: cannot load " + model_path + ": " + err);
    CutRule rule = cut_rule_from_model(bytes);
    tok->can_split_ = rule.can_split;
    tok->dummy_prefix_ = rule.dummy_prefix;
    tok->joins_space_ = std::move(rule.joins_space);
    if (tok->vocab_size() <= 0) {
      return Status::error("tokenizer: " + model_path + " has an empty vocabulary");
    }
    // The first normal piece that decodes to visible text with no leading space: "a" style.
    for (int id = 0; id < tok->vocab_size(); ++id) {
      if (tok->module_->piece_kind(tok->spm_, id) != 0) continue;
      const std::string p = tok->piece(id);
      if (!p.empty() && p.compare(0, kSpaceSymbol.size(), kSpaceSymbol) != 0) {
        tok->anchor_id_ = id;
        break;
      }
    }
    return tok;
  } catch (const std::exception& e) {
    return Status::error("tokenizer: cannot load " + model_path + ": " + e.what());
  } catch (...) {
    return Status::error("tokenizer: cannot load " + model_path + ": unknown exception");
  }
}

size_t Tokenizer::encode_threads() {
  static const size_t threads = [] {
    const unsigned hw = std::thread::hardware_concurrency();  // 0: unknown
    return std::clamp<size_t>(hw, 1, kMaxEncodeThreads);
  }();
  return threads;
}

// Why a cut at the offset find_cut returns cannot change any id, for a model cut_rule_from_model
// accepted (the argument follows SentencePiece's Encode: Normalize, bpe::Model::SampleEncode,
// PopulateSentencePieceText).
// 1. Normalising is per character: ' ' becomes U+2581, every other character stays, and one
//    U+2581 goes before the text when dummy_prefix_. So the normalised text T' is the
//    concatenation of the pieces' normalised texts if a piece after a cut, which starts with the
//    space at the cut, is encoded without that space when dummy_prefix_ (the dummy prefix puts
//    the same U+2581 back) and with it otherwise. Such a piece is never only that space, which
//    would normalise to nothing: no cut follows a space (joins_space_ always holds U+2581),
//    and none is placed at the text's last byte.
// 2. BPE starts from one symbol per character and repeatedly merges the adjacent pair whose
//    concatenation is the highest-scoring vocabulary piece (ties: the leftmost). A merge across
//    the cut would make a piece holding the character c before the cut immediately followed by
//    the U+2581 of the space; find_cut only cuts where no NORMAL piece holds c + U+2581
//    (joins_space_: for LLaMA-2 only U+2581 itself, from its pieces of 2 to 16 U+2581: a cut
//    never goes inside a run of spaces or after a literal U+2581; a tab, a newline or any other
//    character before the space is fine), so no pair across the cut ever enters the queue.
//    Merges on each side then only read and change that side's symbols, and the merges of one
//    side happen in the order that side alone would make them (the same scores, and the
//    leftmost of a tie is the leftmost within the side), so each side ends as it would encoded
//    alone.
// 3. Tokens become ids one at a time (byte fallback splits an unknown token into its bytes);
//    the only step joining neighbours fuses a run of <unk> without byte fallback, and the first
//    token after a cut starts with U+2581, a NORMAL piece, so it is never <unk>.
// The same holds at every cut at once, since each argument is about one boundary.
size_t Tokenizer::find_cut(std::string_view text, size_t from) const {
  for (size_t at = std::max<size_t>(from, 1); at + 1 < text.size(); ++at) {
    at = text.find(' ', at);
    if (at == std::string_view::npos || at + 1 == text.size()) return std::string_view::npos;
    // The character before the space, as the normaliser writes it (text is valid UTF-8, so at
    // most three continuation bytes precede its lead byte).
    size_t start = at - 1;
    while (start > 0 && at - start < 4 &&
           (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) {
      --start;
    }
    std::string_view before = text.substr(start, at - start);
    if (before == " ") before = kSpaceSymbol;
    if (std::find(joins_space_.begin(), joins_space_.end(), before) == joins_space_.end()) {
      return at;
    }
  }
  return std::string_view::npos;
}

Result<std::vector<int>> Tokenizer::encode(std::string_view text, bool add_bos,
                                           bool add_eos) const {
  return encode_split(text, add_bos, add_eos, Split{}, nullptr);
}

Result<std::vector<int>> Tokenizer::encode_split(std::string_view text, bool add_bos, bool add_eos,
                                                 const Split& split, size_t* pieces) const {
  BURST_RETURN_IF_ERROR(validate_utf8(text));
  if (add_bos && bos_id() < 0) return Status::error("tokenizer: model has no BOS piece");
  if (add_eos && eos_id() < 0) return Status::error("tokenizer: model has no EOS piece");

  const size_t threads =
      split.threads == 0 ? encode_threads() : std::min(split.threads, encode_threads());
  size_t piece_bytes = split.piece_bytes;
  if (piece_bytes == 0) {
    piece_bytes = text.size() >= kSplitMinBytes ? kPieceBytes : std::numeric_limits<size_t>::max();
  }
  // starts[i] is where piece i begins; each later piece starts with the space of its cut.
  std::vector<size_t> starts{0};
  if (can_split_) {
    for (size_t from = piece_bytes; from < text.size();) {
      const size_t cut = find_cut(text, from);
      if (cut == std::string_view::npos) break;
      starts.push_back(cut);
      if (piece_bytes >= text.size() - cut) break;
      from = cut + piece_bytes;
    }
  }

  std::vector<std::vector<int>> parts(starts.size());
  // The first failure's message, in a fixed buffer since memory may be what ran out.
  std::mutex error_mu;
  char error[512] = {0};
  bool failed = false;  // guarded by error_mu
  // Runs on pool helpers too, so nothing may escape it: a failure is recorded above.
  const std::function<void(size_t)> encode_piece = [&](size_t i) {
    size_t begin = starts[i];
    const size_t end = i + 1 < starts.size() ? starts[i + 1] : text.size();
    if (i > 0 && dummy_prefix_) ++begin;  // the dummy prefix stands for the cut's space
    char err[512] = {0};
    size_t count = 0;
    int* ids = module_->encode(spm_, text.data() + begin, end - begin, &count, err, sizeof err);
    if (ids) {
      bool copied = false;
      try {
        parts[i].assign(ids, ids + count);
        copied = true;
      } catch (const std::bad_alloc&) {
        std::snprintf(err, sizeof err, "out of memory for %zu ids", count);
      }
      module_->release(ids);
      if (copied) return;
    }
    std::lock_guard<std::mutex> lock(error_mu);
    if (!failed) std::memcpy(error, err, sizeof error);
    failed = true;
  };
  if (parts.size() == 1 || threads == 1) {
    for (size_t i = 0; i < parts.size(); ++i) encode_piece(i);
  } else {
    EncodePool::instance().run(parts.size(), threads - 1, encode_piece);
  }

  if (failed) return Status::error(std::string("tokenizer: encode failed: ") + error);
  size_t count = 0;
  for (const auto& part : parts) count += part.size();
  std::vector<int> ids;
  ids.reserve(count + 2);
  if (add_bos) ids.push_back(bos_id());
  for (const auto& part : parts) ids.insert(ids.end(), part.begin(), part.end());
  if (add_eos) ids.push_back(eos_id());
  if (pieces) *pieces = parts.size();
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  const int n = vocab_size();
  std::vector<int> valid;
  valid.reserve(ids.size());
  for (int id : ids) {
    if (id >= 0 && id < n) valid.push_back(id);
  }
  size_t len = 0;
  // Cannot fail for in-range ids; on failure the empty string is the least surprising answer.
  char* text = module_->decode(spm_, valid.data(), valid.size(), &len);
  if (!text) return {};
  std::string out(text, len);
  module_->release(text);
  return out;
}

int Tokenizer::vocab_size() const { return module_->vocab_size(spm_); }
int Tokenizer::bos_id() const { return module_->bos(spm_); }
int Tokenizer::eos_id() const { return module_->eos(spm_); }

std::string Tokenizer::piece_text(int id) const {
  const std::string p = piece(id);
  std::string out;
  for (size_t i = 0; i < p.size();) {
    if (p.compare(i, 3, "\xe2\x96\x81") == 0) {
      out += ' ';
      i += 3;
    } else {
      out += p[i++];
    }
  }
  return out;
}

size_t Tokenizer::max_piece_bytes() const {
  size_t longest = 1;
  for (int id = 0; id < vocab_size(); ++id) {
    if (!is_byte(id)) longest = std::max(longest, piece_text(id).size());
  }
  return longest;
}

std::string Tokenizer::piece(int id) const {
  if (id < 0 || id >= vocab_size()) return {};
  size_t len = 0;
  char* p = module_->piece(spm_, id, &len);
  if (!p) return {};
  std::string out(p, len);
  module_->release(p);
  return out;
}

bool Tokenizer::is_byte(int id) const {
  return id >= 0 && id < vocab_size() && (module_->piece_kind(spm_, id) & kBurstSpmByte) != 0;
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, int context_id) : tok_(tok) {
  if (context_id < 0 || context_id >= tok_.vocab_size()) return;  // no prompt
  // A byte piece as context could join with generated bytes into one character, and then
  // decode(context) would not be a prefix of decode(context + ids); the anchor piece keeps the
  // same effect on the first generated space without that risk.
  int context = context_id;
  if (tok_.is_byte(context) && tok_.anchor_id_ >= 0) context = tok_.anchor_id_;
  ids_.push_back(context);
  prefix_len_ = tok_.decode(ids_).size();
}

std::string StreamDecoder::window_text() const {
  std::string text = tok_.decode(ids_);
  // decode(context) is a prefix of decode(context + ids) for a non-byte context; if a model ever
  // broke that, dropping the whole context text is still the better answer than a crash.
  if (text.size() < prefix_len_) return {};
  return text.substr(prefix_len_);
}

std::string StreamDecoder::push(int id) {
  ids_.push_back(id);
  const std::string text = window_text();
  size_t ready = text.size();
  // Trailing U+FFFD means a byte-fallback character still waiting for its last bytes.
  while (ready >= kReplacement.size() &&
         std::string_view(text).substr(ready - kReplacement.size(), kReplacement.size()) ==
             kReplacement) {
    ready -= kReplacement.size();
  }
  ready = complete_prefix(std::string_view(text).substr(0, ready));
  if (ready <= emitted_) return {};
  std::string out = text.substr(emitted_, ready - emitted_);
  emitted_ = ready;
  if (emitted_ == text.size() && tok_.anchor_id_ >= 0) {
    // Everything so far is out and ends on a whole character, so later ids cannot change it:
    // restart the window after the anchor piece, which keeps the next word's leading space.
    ids_.assign(1, tok_.anchor_id_);
    prefix_len_ = tok_.decode(ids_).size();
    emitted_ = 0;
  }
  return out;
}

std::string StreamDecoder::flush() {
  const std::string text = window_text();
  std::string out = text.size() > emitted_ ? text.substr(emitted_) : std::string();
  // Start clean, as after a full emit, so a reused decoder neither repeats nor loses text.
  ids_.clear();
  prefix_len_ = 0;
  emitted_ = 0;
  if (tok_.anchor_id_ >= 0) {
    ids_.push_back(tok_.anchor_id_);
    prefix_len_ = tok_.decode(ids_).size();
  }
  return out;
}

}  // namespace burst::server
