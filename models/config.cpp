// LLaMA-2 configuration from a Hugging Face config.json, and the built-in architecture presets.
//
// Contract: config.json is untrusted text. Every field is type-checked (integers must be JSON
// integers, floats any JSON number, booleans booleans) and range-checked; every error names the
// source file and the field. Nothing throws: nlohmann is used with exceptions disabled for
// parsing and every remaining call is inside one catch-all, so no exception leaves this file.
#include "models/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>
#include <system_error>

namespace burst::models {
namespace {

using nlohmann::json;

// Far past any real LLaMA-family model, yet small enough that products of these sizes (weight
// counts, KV-cache bytes) computed downstream in int64 cannot overflow.
constexpr int64_t kMaxHiddenSize = 1'000'000;
constexpr int64_t kMaxIntermediateSize = 4'000'000;
constexpr int64_t kMaxLayers = 10'000;
constexpr int64_t kMaxHeads = 10'000;
constexpr int64_t kMaxHeadDim = 16'384;
constexpr int64_t kMaxVocab = 16'000'000;
constexpr int64_t kMaxPositions = kMaxPositionEmbeddings;
// A config.json is a few KiB; refuse to slurp anything that cannot be one.
constexpr std::streamoff kMaxConfigBytes = 16 << 20;

const char* type_name(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "float";
  return v.type_name();
}

// A number as a person writes it (4, 0.5, 1e+06), for messages about derived values.
std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

class FieldReader {
 public:
  // `prefix` names the object inside the file ("rope_scaling."): errors quote prefix + field.
  FieldReader(const json& root, const std::string& source, std::string prefix = "")
      : root_(root), source_(source), prefix_(std::move(prefix)) {}

  Status error(const std::string& field, const std::string& what) const {
    return Status::error(source_ + ": field \"" + prefix_ + field + "\" " + what);
  }

  const std::string& source() const { return source_; }

  // nullptr when the field is absent or null; the caller picks the default or reports it missing.
  const json* find(const std::string& field) const {
    auto it = root_.find(field);
    if (it == root_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Status get_int(const std::string& field, bool required, int64_t lo, int64_t hi,
                 int64_t& out) const {
    const json* v = find(field);
    if (v == nullptr) {
      return required ? error(field, "is missing (required)") : Status();
    }
    return to_int(field, *v, lo, hi, out);
  }

  Status to_int(const std::string& field, const json& v, int64_t lo, int64_t hi,
                int64_t& out) const {
    // A float such as 4096.0 is refused too: a writer that emits one has a bug worth seeing.
    if (!v.is_number_integer()) {
      // The value too: 1e30 or a number past 64 bits is a float to the JSON parser.
      return error(field, std::string("must be an integer, got ") + type_name(v) +
                              (v.is_number() ? " " + v.dump() : ""));
    }
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) return out_of_range(field, v, lo, hi);
      out = static_cast<int64_t>(u);
    } else {
      out = v.get<int64_t>();
    }
    if (out < lo || out > hi) return out_of_range(field, v, lo, hi);
    return Status();
  }

  Status get_float(const std::string& field, bool required, double lo_exclusive, double hi,
                   float& out) const {
    const json* v = find(field);
    if (v == nullptr) {
      return required ? error(field, "is missing (required)") : Status();
    }
    if (!v->is_number()) {
      return error(field, std::string("must be a number, got ") + type_name(*v));
    }
    double d = v->get<double>();
    // NaN fails both comparisons' negations, so test the good range, not the bad one.
    if (!(d > lo_exclusive && d <= hi)) {
      return error(field, "must be in (" + json(lo_exclusive).dump() + ", " + json(hi).dump() +
                              "], got " + v->dump());
    }
    out = static_cast<float>(d);
    return Status();
  }

  // An optional number in [lo, hi] (lo itself allowed, unlike get_float).
  Status get_float_closed(const std::string& field, double lo, double hi, float& out) const {
    const json* v = find(field);
    if (v == nullptr) return Status();
    if (!v->is_number()) {
      return error(field, std::string("must be a number, got ") + type_name(*v));
    }
    const double d = v->get<double>();
    if (!(d >= lo && d <= hi)) {
      return error(
          field, "must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " + v->dump());
    }
    out = static_cast<float>(d);
    return Status();
  }

  Status get_bool(const std::string& field, bool& out) const {
    const json* v = find(field);
    if (v == nullptr) return Status();
    if (!v->is_boolean()) {
      return error(field, std::string("must be a boolean, got ") + type_name(*v));
    }
    out = v->get<bool>();
    return Status();
  }

 private:
  Status out_of_range(const std::string& field, const json& v, int64_t lo, int64_t hi) const {
    return error(field, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                            "], got " + v.dump());
  }

  const json& root_;
  const std::string& source_;
  std::string prefix_;
};

// Yarn's fields, resolved as transformers 5 resolves them (standardize_rope_params and
// _compute_yarn_parameters in modeling_rope_utils.py); models/rope.cpp computes with them.
// Values transformers only warns about (factor below 1, beta_fast below beta_slow) are refused:
// they give frequencies no checkpoint was trained with. "finetuned" (written by the YaRN
// authors' checkpoints) and other keys are ignored, as there.
Status parse_yarn(const FieldReader& root, const std::string& field, const json& v,
                  int64_t max_positions, RopeScaling& out) {
  const FieldReader r(v, root.source(), field + ".");
  out.kind = RopeScaling::Kind::kYarn;
  // The pretraining context: a top-level original_max_position_embeddings wins over the rope
  // object's (transformers 5 gives the top-level one priority, as Phi-3 writes it), and
  // max_position_embeddings stands in when neither is given.
  int64_t orig = max_positions;
  BURST_RETURN_IF_ERROR(
      r.get_int("original_max_position_embeddings", false, 1, kMaxPositions, orig));
  BURST_RETURN_IF_ERROR(
      root.get_int("original_max_position_embeddings", false, 1, kMaxPositions, orig));
  out.original_max_position_embeddings = orig;

  // factor is required; null derives it as the ratio of the two contexts (transformers 5;
  // transformers 4 derived it whenever the rope object named the original context).
  auto f = v.find("factor");
  if (f == v.end()) {
    return r.error("factor",
                   "is missing (required for yarn; null derives it as "
                   "max_position_embeddings / original_max_position_embeddings)");
  }
  double factor = 0;
  if (f->is_null()) {
    factor = static_cast<double>(max_positions) / static_cast<double>(orig);
    if (!(factor >= 1)) {
      return r.error("factor",
                     "is null and max_position_embeddings / "
                     "original_max_position_embeddings = " +
                         std::to_string(max_positions) + " / " + std::to_string(orig) + " = " +
                         number_text(factor) + " is below 1");
    }
  } else {
    if (!f->is_number()) {
      return r.error("factor", std::string("must be a number, got ") + type_name(*f));
    }
    factor = f->get<double>();
    if (!(factor >= 1 && factor <= 1e6)) {
      return r.error("factor", "must be in [1, 1e6] for yarn, got " + f->dump());
    }
  }
  out.factor = static_cast<float>(factor);

  // beta_fast / beta_slow count rotations over the original context; the correction range
  // takes their logarithm, so both must be positive, and the ramp runs from fast to slow.
  BURST_RETURN_IF_ERROR(r.get_float("beta_fast", false, 0.0, 1e6, out.beta_fast));
  BURST_RETURN_IF_ERROR(r.get_float("beta_slow", false, 0.0, 1e6, out.beta_slow));
  if (out.beta_fast < out.beta_slow) {
    return r.error("beta_fast", "(" + number_text(out.beta_fast) + ") is below beta_slow (" +
                                    number_text(out.beta_slow) + ")");
  }
  // transformers reads a null truncate as false, not as the default true: refuse the guess.
  if (auto t = v.find("truncate"); t != v.end() && t->is_null()) {
    return r.error("truncate", "must be a boolean, got null");
  }
  BURST_RETURN_IF_ERROR(r.get_bool("truncate", out.truncate));
  BURST_RETURN_IF_ERROR(r.get_float("attention_factor", false, 0.0, 1e3, out.attention_factor));
  // 0 means "not given" to transformers too (it tests them for truth).
  BURST_RETURN_IF_ERROR(r.get_float_closed("mscale", 0.0, 1e3, out.mscale));
  BURST_RETURN_IF_ERROR(r.get_float_closed("mscale_all_dim", 0.0, 1e3, out.mscale_all_dim));
  return Status();
}

// `field` is "rope_scaling" (transformers 4) or "rope_parameters" (transformers 5, which also
// moves rope_theta inside it); both hold the rope type and its factor. max_positions: the
// config's max_position_embeddings (yarn's default original context).
Status parse_rope_scaling(const FieldReader& r, const std::string& field, const json* v,
                          int64_t max_positions, RopeScaling& out) {
  out = RopeScaling{};
  if (v == nullptr) return Status();
  if (!v->is_object()) {
    return r.error(field, std::string("must be an object or null, got ") + type_name(*v));
  }
  // Newer transformers write "rope_type"; older checkpoints write "type". Prefer the new name.
  const json* type = nullptr;
  std::string type_field = field + ".rope_type";
  if (auto it = v->find("rope_type"); it != v->end()) {
    type = &*it;
  } else if (auto it2 = v->find("type"); it2 != v->end()) {
    type = &*it2;
    type_field = field + ".type";
  }
  if (type == nullptr) return r.error(field, "has neither \"rope_type\" nor \"type\"");
  if (!type->is_string()) {
    return r.error(type_field, std::string("must be a string, got ") + type_name(*type));
  }
  const std::string& kind = type->get_ref<const std::string&>();
  if (kind == "default") return Status();  // transformers' spelling of "no scaling"
  if (kind == "yarn") return parse_yarn(r, field, *v, max_positions, out);
  if (kind == "linear") {
    out.kind = RopeScaling::Kind::kLinear;
  } else if (kind == "dynamic") {
    out.kind = RopeScaling::Kind::kDynamic;
  } else {
    return r.error(type_field, "is \"" + kind +
                                   "\", which is not supported (supported: linear, dynamic, "
                                   "yarn, default)");
  }
  auto f = v->find("factor");
  if (f == v->end() || f->is_null()) return r.error(field + ".factor", "is missing");
  if (!f->is_number()) {
    return r.error(field + ".factor", std::string("must be a number, got ") + type_name(*f));
  }
  double factor = f->get<double>();
  if (!(factor > 0 && factor <= 1e6)) {
    return r.error(field + ".factor", "must be in (0, 1e6], got " + f->dump());
  }
  out.factor = static_cast<float>(factor);
  return Status();
}

Status parse_dtype(const FieldReader& r, engine::DType& out, std::string& out_field) {
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  std::string field = "torch_dtype";
  const json* v = r.find(field);
  if (v == nullptr) {
    field = "dtype";
    v = r.find(field);
  }
  if (v == nullptr) return Status();
  if (!v->is_string()) {
    return r.error(field, std::string("must be a string, got ") + type_name(*v));
  }
  const std::string& s = v->get_ref<const std::string&>();
  if (s == "float32") {
    out = engine::DType::kF32;
  } else if (s == "bfloat16") {
    out = engine::DType::kBF16;
  } else if (s == "float16") {
    out = engine::DType::kF16;
  } else {
    return r.error(field, "is \"" + s + "\"; expected float32, bfloat16 or float16");
  }
  out_field = field;
  return Status();
}

// A token id (an integer, or a list of them: checkpoints list several end tokens and the first
// is the canonical one) must name a row of the embedding table: every element is checked, since
// the engine compares sampled ids against all of them. `none_ok`: -1 means "no such token" (old
// LLaMA conversions write pad_token_id -1).
Status parse_token_id(const FieldReader& r, const std::string& field, int64_t vocab, bool none_ok,
                      int32_t* out) {
  const json* v = r.find(field);
  if (v == nullptr) return Status();
  std::vector<std::pair<std::string, const json*>> ids;
  if (v->is_array()) {
    if (v->empty()) return r.error(field, "is an empty list");
    for (size_t i = 0; i < v->size(); ++i) {
      ids.emplace_back(field + "[" + std::to_string(i) + "]", &(*v)[i]);
    }
  } else {
    ids.emplace_back(field, v);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& [name, id] = ids[i];
    int64_t value = 0;
    if (!id->is_number_integer()) return r.to_int(name, *id, 0, vocab - 1, value);  // the type
    if (id->is_number_unsigned()) {
      const uint64_t u = id->get<uint64_t>();
      value = u > static_cast<uint64_t>(vocab) ? vocab : static_cast<int64_t>(u);
    } else {
      value = id->get<int64_t>();
    }
    if (none_ok && value == -1) continue;
    if (value < 0 || value >= vocab) {
      return r.error(name, "must be in the vocabulary [0, " + std::to_string(vocab) +
                               ") of vocab_size " + std::to_string(vocab) +
                               (none_ok ? " (or -1: none)" : "") + ", got " + id->dump());
    }
    // vocab <= kMaxVocab < 2^31, so this fits.
    if (i == 0 && out != nullptr) *out = static_cast<int32_t>(value);
  }
  return Status();
}

// The RoPE base: frequencies are theta^(-2i/d), so theta <= 1 leaves every pair turning at least
// once per position (1e-300 underflows them to infinities), and a non-finite one is no base.
Status get_rope_theta(const FieldReader& r, float& out) {
  const json* v = r.find("rope_theta");
  if (v == nullptr) return Status();
  if (!v->is_number()) {
    return r.error("rope_theta", std::string("must be a number, got ") + type_name(*v));
  }
  const double d = v->get<double>();
  if (!(d > 1 && d <= kMaxRopeTheta)) {  // NaN fails too
    return r.error("rope_theta", "must be finite and in (1, 1e12] (released models use 1e4 to "
                                 "1e7), got " + v->dump());
  }
  out = static_cast<float>(d);
  return Status();
}

// What the engine implements is one architecture: LLaMA (RMSNorm, SwiGLU MLP, RoPE, no
// biases). A config that asks for something else is refused, naming the field, instead of
// being run as LLaMA and producing garbage.
Status check_architecture(const FieldReader& r) {
  auto string_field = [&](const std::string& field, const json& v,
                          std::string& out) -> Status {
    if (!v.is_string()) {
      return r.error(field, std::string("must be a string, got ") + type_name(v));
    }
    out = v.get<std::string>();
    return Status();
  };
  if (const json* v = r.find("architectures"); v != nullptr) {
    if (!v->is_array() || v->empty()) {
      return r.error("architectures", "must be a non-empty list of strings");
    }
    for (size_t i = 0; i < v->size(); ++i) {
      std::string a;
      const std::string field = "architectures[" + std::to_string(i) + "]";
      BURST_RETURN_IF_ERROR(string_field(field, (*v)[i], a));
      if (a != "LlamaForCausalLM" && a != "LLaMAForCausalLM") {
        return r.error(field, "is \"" + a + "\"; the engine runs LlamaForCausalLM only");
      }
    }
  }
  if (const json* v = r.find("model_type"); v != nullptr) {
    std::string t;
    BURST_RETURN_IF_ERROR(string_field("model_type", *v, t));
    if (t != "llama") return r.error("model_type", "is \"" + t + "\"; the engine runs \"llama\" only");
  }
  for (const char* field : {"hidden_act", "hidden_activation"}) {
    if (const json* v = r.find(field); v != nullptr) {
      std::string act;
      BURST_RETURN_IF_ERROR(string_field(field, *v, act));
      if (act != "silu" && act != "swish") {
        return r.error(field, "is \"" + act + "\"; the engine implements the SwiGLU MLP (silu) only");
      }
    }
  }
  for (const char* field : {"attention_bias", "mlp_bias"}) {
    bool bias = false;
    BURST_RETURN_IF_ERROR(r.get_bool(field, bias));
    if (bias) return r.error(field, "is true; the engine has no bias terms (LLaMA has none)");
  }
  return Status();
}

Result<LlamaConfig> parse_config(const json& root, const std::string& source) {
  if (!root.is_object()) {
    return Status::error(source + ": config must be a JSON object, got " + type_name(root));
  }
  FieldReader r(root, source);
  LlamaConfig c;
  BURST_RETURN_IF_ERROR(check_architecture(r));
  BURST_RETURN_IF_ERROR(r.get_int("hidden_size", true, 1, kMaxHiddenSize, c.hidden_size));
  BURST_RETURN_IF_ERROR(
      r.get_int("intermediate_size", true, 1, kMaxIntermediateSize, c.intermediate_size));
  BURST_RETURN_IF_ERROR(r.get_int("num_hidden_layers", true, 1, kMaxLayers, c.num_layers));
  BURST_RETURN_IF_ERROR(r.get_int("num_attention_heads", true, 1, kMaxHeads, c.num_heads));
  c.num_kv_heads = c.num_heads;
  BURST_RETURN_IF_ERROR(r.get_int("num_key_value_heads", false, 1, kMaxHeads, c.num_kv_heads));
  BURST_RETURN_IF_ERROR(r.get_int("vocab_size", true, 1, kMaxVocab, c.vocab_size));
  // Refused past 16M tokens with its own words: per-sequence tables are sized from it, and a
  // value such as 2^30 is a typo, not a context length.
  if (const json* v = r.find("max_position_embeddings"); v != nullptr) {
    const Status st = r.to_int("max_position_embeddings", *v, 2, kMaxPositions,
                               c.max_position_embeddings);
    if (!st.ok() && v->is_number_integer()) {
      return r.error("max_position_embeddings",
                     "must be in [2, " + std::to_string(kMaxPositions) +
                         "] (at most 16M tokens: the engine sizes per-sequence buffers from it, "
                         "and released models stop at 10M), got " + v->dump());
    }
    BURST_RETURN_IF_ERROR(st);
  }
  BURST_RETURN_IF_ERROR(r.get_float("rms_norm_eps", false, 0.0, 1.0, c.rms_norm_eps));
  BURST_RETURN_IF_ERROR(get_rope_theta(r, c.rope_theta));
  if (const json* params = r.find("rope_parameters"); params != nullptr) {
    BURST_RETURN_IF_ERROR(parse_rope_scaling(r, "rope_parameters", params,
                                             c.max_position_embeddings, c.rope_scaling));
    if (params->is_object()) {
      FieldReader pr(*params, source, "rope_parameters.");
      BURST_RETURN_IF_ERROR(get_rope_theta(pr, c.rope_theta));
    }
  } else {
    BURST_RETURN_IF_ERROR(parse_rope_scaling(r, "rope_scaling", r.find("rope_scaling"),
                                             c.max_position_embeddings, c.rope_scaling));
  }
  BURST_RETURN_IF_ERROR(r.get_bool("tie_word_embeddings", c.tie_word_embeddings));
  BURST_RETURN_IF_ERROR(parse_dtype(r, c.torch_dtype, c.torch_dtype_field));
  BURST_RETURN_IF_ERROR(parse_token_id(r, "bos_token_id", c.vocab_size, false, &c.bos_token_id));
  BURST_RETURN_IF_ERROR(parse_token_id(r, "eos_token_id", c.vocab_size, false, &c.eos_token_id));
  BURST_RETURN_IF_ERROR(parse_token_id(r, "pad_token_id", c.vocab_size, true, nullptr));

  // GQA: every group of num_heads / num_kv_heads query heads shares one KV head.
  if (c.num_heads % c.num_kv_heads != 0) {
    return r.error("num_attention_heads", "(" + std::to_string(c.num_heads) +
                                              ") is not divisible by " + "num_key_value_heads (" +
                                              std::to_string(c.num_kv_heads) + ")");
  }
  if (r.find("head_dim") != nullptr) {
    BURST_RETURN_IF_ERROR(r.get_int("head_dim", true, 1, kMaxHeadDim, c.head_dim));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return r.error("hidden_size", "(" + std::to_string(c.hidden_size) + ") is not divisible by " +
                                        "num_attention_heads (" + std::to_string(c.num_heads) +
                                        ") and no head_dim is given");
    }
    c.head_dim = c.hidden_size / c.num_heads;
    if (c.head_dim > kMaxHeadDim) {
      return r.error("hidden_size", "gives head_dim " + std::to_string(c.head_dim) +
                                        ", more than " + std::to_string(kMaxHeadDim));
    }
  }
  // RoPE rotates pairs of features, so an odd head_dim has a feature with no partner.
  if (c.head_dim % 2 != 0) {
    return r.error("head_dim", "(" + std::to_string(c.head_dim) + ") must be even for RoPE");
  }
  return c;
}

}  // namespace

Result<LlamaConfig> parse_config_json(const std::string& text, const std::string& source) {
  try {
    json root = json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) return Status::error(source + ": not valid JSON");
    return parse_config(root, source);
  } catch (const std::exception& e) {
    // Only allocation failure should get here; it must still not cross the library boundary.
    return Status::error(source + ": " + e.what());
  } catch (...) {
    return Status::error(source + ": unknown error while parsing");
  }
}

Result<int> open_regular_file(const std::string& path) {
  // stat first: opening a FIFO blocks until a writer comes, opening a device may act on it.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::error("cannot open " + path + ": " +
                         std::error_code(errno, std::generic_category()).message());
  }
  auto kind = [](mode_t m) -> std::string {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a regular file";
  };
  if (!S_ISREG(st.st_mode)) {
    return Status::error(path + " is " + kind(st.st_mode) + ", not a regular file; refused");
  }
  // O_NONBLOCK: if the path was swapped for a FIFO since the stat, open() still returns.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    return Status::error("cannot open " + path + ": " +
                         std::error_code(errno, std::generic_category()).message());
  }
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::error(path + " is " + kind(st.st_mode) + ", not a regular file; refused");
  }
  return fd;
}

Result<std::string> read_regular_file(const std::string& path, int64_t max_bytes) {
  auto opened = open_regular_file(path);
  if (!opened.ok()) return opened.status();
  const int fd = opened.value();
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 0 || st.st_size > max_bytes) {
    ::close(fd);
    return Status::error(path + ": size " + std::to_string(st.st_size) +
                         " bytes is out of range (at most " + std::to_string(max_bytes) + ")");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return Status::error("cannot read " + path + ": " +
                           (n == 0 ? std::string("the file shrank while read")
                                   : std::error_code(err, std::generic_category()).message()));
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return text;
}

Result<LlamaConfig> load_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  try {
    auto text = read_regular_file(path, kMaxConfigBytes);
    if (!text.ok()) return text.status();
    return parse_config_json(text.value(), path);
  } catch (const std::exception& e) {
    return Status::error(path + ": " + e.what());
  } catch (...) {
    return Status::error(path + ": unknown error while reading");
  }
}

Result<LlamaConfig> preset_config(const std::string& name) {
  // Shared by all LLaMA-2 sizes (the Meta release's config.json values).
  LlamaConfig c;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 10000.f;
  c.max_position_embeddings = 4096;
  c.vocab_size = 32000;
  c.tie_word_embeddings = false;
  c.torch_dtype = engine::DType::kBF16;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  if (name == "1b") {
    // TinyLlama-1.1B's shape (LLaMA-2 architecture and vocabulary, GQA 32/4): a model a CPU
    // host holds (4.4 GB in fp32), big enough that loading it takes seconds.
    c.hidden_size = 2048;
    c.intermediate_size = 5632;
    c.num_layers = 22;
    c.num_heads = 32;
    c.num_kv_heads = 4;
  } else if (name == "7b") {
    c.hidden_size = 4096;
    c.intermediate_size = 11008;
    c.num_layers = 32;
    c.num_heads = 32;
    c.num_kv_heads = 32;
  } else if (name == "13b") {
    c.hidden_size = 5120;
    c.intermediate_size = 13824;
    c.num_layers = 40;
    c.num_heads = 40;
    c.num_kv_heads = 40;
  } else if (name == "70b") {
    c.hidden_size = 8192;
    c.intermediate_size = 28672;
    c.num_layers = 80;
    c.num_heads = 64;
    c.num_kv_heads = 8;  // the only LLaMA-2 size with GQA
  } else {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    return Status::error("unknown model preset \"" + name + "\" (known: " + known + ")");
  }
  c.head_dim = c.hidden_size / c.num_heads;  // 128 for every LLaMA-2 size, 64 for 1b
  return c;
}

std::vector<std::string> preset_names() { return {"1b", "7b", "13b", "70b"}; }

}  // namespace burst::models
