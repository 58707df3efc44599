// LLaMA-2 model configuration: parsed from a Hugging Face config.json (untrusted bytes: every
// field is type-checked and range-checked) or taken from a built-in preset (7b, 13b, 70b).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/status.h"
#include "engine/tensor.h"

namespace burst::models {

// rope_scaling / rope_parameters as HF transformers reads them; models/rope.h has the formulas.
struct RopeScaling {
  enum class Kind { kNone, kLinear, kDynamic, kYarn };
  Kind kind = Kind::kNone;
  // > 0 (>= 1 for yarn); linear divides positions by it, dynamic grows the base past max, yarn
  // divides the frequencies of the slow pairs by it.
  float factor = 1.f;
  // Yarn only. The context the model was pretrained on (resolved as transformers 5 does: a
  // top-level original_max_position_embeddings, else the rope object's, else
  // max_position_embeddings).
  int64_t original_max_position_embeddings = 0;
  // Pairs that turn more than beta_fast times over that context keep their frequency, pairs
  // that turn fewer than beta_slow times are interpolated (divided by factor), a linear ramp
  // over the pair index blends the ones between. truncate: the ramp's ends are whole pairs.
  float beta_fast = 32.f;
  float beta_slow = 1.f;
  bool truncate = true;
  // HF's attention_scaling m (cos and sin are multiplied by it): attention_factor when > 0, else
  // derived from factor, with mscale / mscale_all_dim when both are non-zero (0: not given).
  float attention_factor = 0.f;
  float mscale = 0.f;
  float mscale_all_dim = 0.f;
};

struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;             // num_hidden_layers
  int64_t num_heads = 0;              // num_attention_heads
  int64_t num_kv_heads = 0;           // num_key_value_heads (defaults to num_heads)
  int64_t head_dim = 0;               // "head_dim" if given, else hidden_size / num_heads
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.f;
  RopeScaling rope_scaling;
  int64_t max_position_embeddings = 2048;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  engine::DType torch_dtype = engine::DType::kF32;  // the checkpoint's declared dtype
  // The field that declared it ("torch_dtype" or "dtype"); empty when config.json names none
  // (the loader then has nothing to hold the weights' header dtypes against).
  std::string torch_dtype_field;
  // Token ids, every one inside [0, vocab_size): each element of a list, and pad_token_id too
  // (read, not kept; -1, the "no pad token" of old LLaMA conversions, is accepted).
  int32_t bos_token_id = 1;
  int32_t eos_token_id = 2;
};

// Bounds a config.json must meet beyond type and sign, each refused with the field and the range:
// max_position_embeddings at most kMaxPositionEmbeddings (the engine sizes per-sequence tables
// from it; released LLaMA-family models stop at 10M), rope_theta finite and in (1,
// kMaxRopeTheta] (released models use 1e4 to 1e7; a base at or below 1 does not rotate).
inline constexpr int64_t kMaxPositionEmbeddings = int64_t{1} << 24;  // 16M tokens
inline constexpr double kMaxRopeTheta = 1e12;

// Parses config.json text; `source` (a file name) is quoted in every error.
Result<LlamaConfig> parse_config_json(const std::string& text, const std::string& source);
// Reads and parses DIR/config.json.
Result<LlamaConfig> load_config(const std::string& model_dir);

// Model files are untrusted paths too: only regular files are opened (a FIFO would block
// open() forever, a device or directory is refused), with a message naming what the path is.
// The descriptor (O_RDONLY | O_CLOEXEC) is the caller's to close.
Result<int> open_regular_file(const std::string& path);
// The whole of a regular file of at most max_bytes.
Result<std::string> read_regular_file(const std::string& path, int64_t max_bytes);

// Built-in architecture presets ("7b", "13b", "70b"; LLaMA-2 shapes, vocab 32000).
Result<LlamaConfig> preset_config(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace burst::models
