// Tokenizer over Debian's SentencePiece (libsentencepiece 0.1.97). Contract: load() never throws
// and never aborts on a bad path or file (it reads the bytes itself, so a directory or a garbage
// file is a Status, not a libstdc++ exception from inside SentencePiece); encode() accepts only
// well-formed UTF-8 and names the offending byte offset otherwise, and agrees id for id with
// `spm_encode --output_format=id` on valid text; decode() is SentencePiece's. StreamDecoder
// returns, piece by piece, exactly the bytes that decode(prompt + generated) adds to
// decode(prompt), never splitting a UTF-8 character.
#include "common/tokenizer.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
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

Result<std::vector<int>> Tokenizer::encode(std::string_view text, bool add_bos,
                                           bool add_eos) const {
  BURST_RETURN_IF_ERROR(validate_utf8(text));
  if (add_bos && bos_id() < 0) return Status::error("tokenizer: model has no BOS piece");
  if (add_eos && eos_id() < 0) return Status::error("tokenizer: model has no EOS piece");
  char err[512] = {0};
  size_t count = 0;
  int* pieces = module_->encode(spm_, text.data(), text.size(), &count, err, sizeof err);
  if (!pieces) return Status::error(std::string("tokenizer: encode failed: ") + err);
  std::vector<int> ids;
  ids.reserve(count + 2);
  if (add_bos) ids.push_back(bos_id());
  ids.insert(ids.end(), pieces, pieces + count);
  if (add_eos) ids.push_back(eos_id());
  module_->release(pieces);
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
