// Model directories the loader must refuse before serving, each with an error that names the
// file and the field or tensor: a config dtype no weight header has, 16-bit bytes under the
// other 16-bit name, token ids outside the vocabulary, an absurd rope_theta or context, and
// tensors the config does not use (more layers than num_hidden_layers, a head under tied
// embeddings), also under tensor parallelism, where a rank reads only its slices. The
// directories are the golden fixtures copied into a temporary directory and edited.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "models/llama.h"

namespace burst::models {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::string kOddLinear =
    std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-linear/model";
const std::string kOddYarn =
    std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-yarn/model";

// A copy of a fixture's model directory, removed with the object.
class ModelCopy {
 public:
  explicit ModelCopy(const std::string& from) {
    std::string tmpl = (fs::temp_directory_path() / "burst_md_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return;
    dir_ = tmpl;
    for (const auto& e : fs::directory_iterator(from)) {
      fs::copy_file(e.path(), dir_ + "/" + e.path().filename().string());
    }
  }
  ~ModelCopy() {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  const std::string& dir() const { return dir_; }

  void edit_config(const std::function<void(json&)>& edit) const {
    json c = json::parse(std::ifstream(dir_ + "/config.json"));
    edit(c);
    std::ofstream(dir_ + "/config.json", std::ios::trunc) << c.dump(2);
  }

  // Rewrites model.safetensors: `edit` changes the header and may append to the data section
  // (new entries' offsets are its to set).
  void edit_weights(const std::function<void(json&, std::string&)>& edit) const {
    const std::string path = dir_ + "/model.safetensors";
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
    json header = json::parse(bytes.substr(8, n));
    std::string data = bytes.substr(8 + n);
    edit(header, data);
    const std::string text = header.dump();
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << len << text << data;
  }

 private:
  std::string dir_;
};

// Every tensor's header dtype set to `dtype` (same size: the bytes stay as they are).
void relabel(json& header, const std::string& dtype) {
  for (auto& [name, e] : header.items()) {
    if (name != "__metadata__") e["dtype"] = dtype;
  }
}

void add_tensor(json& header, std::string& data, const std::string& name,
                const std::vector<float>& values) {
  header[name] = {{"dtype", "F32"},
                  {"shape", {values.size()}},
                  {"data_offsets", {data.size(), data.size() + 4 * values.size()}}};
  std::string b(4 * values.size(), '\0');
  std::memcpy(b.data(), values.data(), b.size());
  data += b;
}

// Loads `dir` (whole, or as rank `rank` of `tp`) and expects a refusal holding every `parts`.
void expect_refused(const std::string& dir, const std::vector<std::string>& parts,
                    TensorParallel tp = {0, 1}) {
  auto backend = engine::make_cpu_backend();
  auto m = LlamaModel::load(*backend, dir, nullptr, tp);
  ASSERT_FALSE(m.ok()) << "loaded " << dir << " (rank " << tp.rank << " of " << tp.size << ")";
  for (const auto& p : parts) {
    EXPECT_NE(m.message().find(p), std::string::npos) << "'" << p << "' in: " << m.message();
  }
}

Status load(const std::string& dir, TensorParallel tp = {0, 1}) {
  auto backend = engine::make_cpu_backend();
  auto m = LlamaModel::load(*backend, dir, nullptr, tp);
  return m.ok() ? Status() : m.status();
}

TEST(ModelDir, FixturesAndDeclaredDtypesThatFitLoad) {
  ModelCopy linear(kOddLinear);
  ASSERT_TRUE(load(linear.dir()).ok());
  // float32 over F16 headers: a converter that upcast in memory writes it; the values load
  // exactly, and no 16-bit bytes can pass for F32.
  linear.edit_config([](json& c) { c["dtype"] = "float32"; });
  const Status st = load(linear.dir());
  EXPECT_TRUE(st.ok()) << st.message();
  // No declaration: nothing to hold the headers against.
  linear.edit_config([](json& c) { c.erase("dtype"); });
  EXPECT_TRUE(load(linear.dir()).ok());
  // models/kjv-tiny says float32 over BF16 weights.
  const Status kjv = load(std::string(BURST_SOURCE_DIR) + "/models/kjv-tiny");
  EXPECT_TRUE(kjv.ok()) << kjv.message();
}

TEST(ModelDir, ConfigDtypeThatNoWeightHasIsRefused) {
  ModelCopy linear(kOddLinear);  // F16 headers
  linear.edit_config([](json& c) { c["dtype"] = "bfloat16"; });
  expect_refused(linear.dir(),
                 {linear.dir() + "/config.json", "field \"dtype\" is \"bfloat16\"",
                  "no weight's header dtype is BF16", "model.embed_tokens.weight", "is F16"});
  expect_refused(linear.dir(), {"field \"dtype\""}, {1, 2});
  ModelCopy yarn(kOddYarn);  // BF16 headers
  yarn.edit_config([](json& c) {
    c.erase("dtype");
    c["torch_dtype"] = "float16";
  });
  expect_refused(yarn.dir(), {"field \"torch_dtype\" is \"float16\"",
                              "no weight's header dtype "
                              "is F16",
                              "is BF16"});
}

TEST(ModelDir, HeaderThatNamesTheOtherHalfTypeIsRefused) {
  // F16 bytes under BF16 headers, the config agreeing with the headers.
  ModelCopy linear(kOddLinear);
  linear.edit_config([](json& c) { c["dtype"] = "bfloat16"; });
  linear.edit_weights([](json& h, std::string&) { relabel(h, "BF16"); });
  expect_refused(linear.dir(),
                 {linear.dir() + "/model.safetensors", "declared BF16", "its bytes are F16"});
  expect_refused(linear.dir(), {"declared BF16", "its bytes are F16"}, {1, 2});
  // BF16 bytes under F16 headers.
  ModelCopy yarn(kOddYarn);
  yarn.edit_config([](json& c) { c["dtype"] = "float16"; });
  yarn.edit_weights([](json& h, std::string&) { relabel(h, "F16"); });
  expect_refused(yarn.dir(),
                 {yarn.dir() + "/model.safetensors", "declared F16", "its bytes are BF16"});
}

TEST(ModelDir, ConfigFieldsOutOfRangeAreRefusedBeforeTheWeights) {
  struct Case {
    const char* field;
    json value;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"eos_token_id", 4099, {"\"eos_token_id\"", "vocabulary [0, 4099)", "got 4099"}},
      {"eos_token_id", json::array({2, 5000}), {"\"eos_token_id[1]\"", "got 5000"}},
      {"bos_token_id", -1, {"\"bos_token_id\"", "got -1"}},
      {"pad_token_id", 4099, {"\"pad_token_id\"", "got 4099"}},
      {"max_position_embeddings",
       int64_t{1} << 30,
       {"\"max_position_embeddings\"", "16M tokens", "got 1073741824"}},
  };
  for (const auto& c : cases) {
    ModelCopy linear(kOddLinear);
    linear.edit_config([&](json& j) { j[c.field] = c.value; });
    auto parts = c.parts;
    parts.push_back(linear.dir() + "/config.json");
    expect_refused(linear.dir(), parts);
  }
  // odd-linear keeps rope_theta inside rope_parameters (transformers 5).
  ModelCopy linear(kOddLinear);
  linear.edit_config([](json& j) { j["rope_parameters"]["rope_theta"] = 1e-300; });
  expect_refused(linear.dir(), {linear.dir() + "/config.json", "\"rope_parameters.rope_theta\"",
                                "finite and in (1, 1e12]", "got 1e-300"});
}

TEST(ModelDir, TensorsTheConfigDoesNotUseAreRefused) {
  // Three layers in the checkpoint, one in the config: layers 1 and 2 would be ignored.
  ModelCopy linear(kOddLinear);
  linear.edit_config([](json& c) { c["num_hidden_layers"] = 1; });
  const std::vector<std::string> parts = {linear.dir() + "/model.safetensors",
                                          "tensor \"model.layers.1.", "not used by the model",
                                          "num_hidden_layers 1", "layer 1"};
  expect_refused(linear.dir(), parts);
  // A tensor-parallel rank reads only its slices: the check is by name, the same on each rank.
  expect_refused(linear.dir(), parts, {0, 2});
  expect_refused(linear.dir(), parts, {1, 2});

  // A tied config over a checkpoint with its own head.
  ModelCopy tied(kOddLinear);
  tied.edit_config([](json& c) { c["tie_word_embeddings"] = true; });
  expect_refused(tied.dir(), {"tensor \"lm_head.weight\"", "tie_word_embeddings true"});

  // A name no LLaMA weight has.
  ModelCopy odd(kOddLinear);
  odd.edit_weights([](json& h, std::string& data) {
    add_tensor(h, data, "model.layers.0.self_attn.q_norm.weight", std::vector<float>(16, 1.f));
  });
  expect_refused(odd.dir(), {"tensor \"model.layers.0.self_attn.q_norm.weight\"",
                             "no weight of a LlamaForCausalLM"});
}

TEST(ModelDir, RotaryInverseFrequencyBuffersAreHarmless) {
  // transformers before 4.31 saved every layer's RoPE inv_freq (the LLaMA-2 *-hf checkpoints
  // hold them); the engine computes its own from the config.
  ModelCopy linear(kOddLinear);
  linear.edit_weights([](json& h, std::string& data) {
    for (int i = 0; i < 3; ++i) {
      add_tensor(h, data, "model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq",
                 std::vector<float>(8, 0.5f));
    }
  });
  const Status whole = load(linear.dir());
  EXPECT_TRUE(whole.ok()) << whole.message();
  const Status rank = load(linear.dir(), {1, 2});
  EXPECT_TRUE(rank.ok()) << rank.message();
}

}  // namespace
}  // namespace burst::models
