// Tensor parallelism's pieces that need no group: which layouts a model takes (and the words
// of a refusal), a rank reading only its slices of a checkpoint (bytes read, by hand), and the
// random presets' slices holding exactly the whole model's values at their place, and a
// checkpoint sharded over files. The layouts
// through real processes against Hugging Face are tests/unit/sharded_model_test.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../one_sequence.h"
#include "engine/backend.h"
#include "engine/parallel_layout.h"
#include "engine/ring_attention.h"
#include "models/config.h"
#include "models/llama.h"

namespace burst::models {
namespace {

const std::string kOddLinear =
    std::string(BURST_SOURCE_DIR) + "/tests/fixtures/golden/odd-linear/model";

LlamaConfig shape(int64_t heads, int64_t kv_heads, int64_t intermediate) {
  LlamaConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = intermediate;
  c.head_dim = 16;
  c.hidden_size = heads * 16;
  return c;
}

TEST(TensorParallel, LayoutsTheModelTakes) {
  // LLaMA-2 70B: 64 heads, 8 KV heads, 28672: tp 1, 2, 4, 8 (and 16: KV heads replicated).
  for (int tp : {1, 2, 4, 8, 16}) {
    EXPECT_EQ(tensor_parallel_error(shape(64, 8, 28672), tp), "") << tp;
  }
  const std::string three = tensor_parallel_error(shape(64, 8, 28672), 3);
  EXPECT_NE(three.find("64 attention heads"), std::string::npos) << three;
  // 6 heads, 2 KV heads: tp 3 splits the heads but neither divides nor multiplies the KV heads.
  const std::string kv = tensor_parallel_error(shape(6, 2, 200), 3);
  EXPECT_NE(kv.find("2 KV heads"), std::string::npos) << kv;
  const std::string mlp = tensor_parallel_error(shape(4, 4, 100), 8);
  EXPECT_NE(mlp.find("4 attention heads"), std::string::npos) << mlp;
  const std::string ff = tensor_parallel_error(shape(8, 8, 100), 8);
  EXPECT_NE(ff.find("intermediate size 100"), std::string::npos) << ff;
  EXPECT_NE(tensor_parallel_error(shape(8, 8, 100), 0), "");

  EXPECT_TRUE(engine::ParallelLayout::of(8, 4).ok());
  EXPECT_EQ(engine::ParallelLayout::of(8, 4).value().cp, 2);
  const auto bad = engine::ParallelLayout::of(6, 4);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("does not divide the 6 workers"), std::string::npos);
  EXPECT_FALSE(engine::ParallelLayout::of(4, 0).ok());
  // Ranks of one tensor-parallel group are consecutive; the ring takes equal indices.
  const engine::ParallelLayout l{4, 2};
  EXPECT_EQ(l.tp_index(6), 2);
  EXPECT_EQ(l.cp_index(6), 1);
}

TEST(TensorParallel, ABadLayoutIsRefusedBeforeAnyWeightIsRead) {
  auto backend = engine::make_cpu_backend();
  auto m = LlamaModel::load(*backend, kOddLinear, nullptr, {0, 4});  // 6 heads
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.message().find("6 attention heads"), std::string::npos) << m.message();
  auto r = LlamaModel::load(*backend, kOddLinear, nullptr, {2, 2});  // rank outside the group
  ASSERT_FALSE(r.ok());
}

// odd-linear (fp16 file): hidden 96, 6 heads and 2 KV heads of 16, intermediate 200, 3 layers,
// vocab 4099, an LM head of its own. A rank of tp T reads the replicated embedding, LM head and
// norms whole, and 1/T of q, k, v, o, gate, up and down.
int64_t odd_linear_rank_bytes(int64_t t) {
  const int64_t d = 96, qd = 96, kvd = 32, f = 200, layers = 3, vocab = 4099;
  const int64_t replicated = 2 * vocab * d + d + layers * 2 * d;
  const int64_t per_layer = (qd / t) * d + 2 * (kvd / t) * d + d * (qd / t) + 3 * (f / t) * d;
  return 2 * (replicated + layers * per_layer);
}

TEST(TensorParallel, ARankReadsOnlyItsSlices) {
  auto backend = engine::make_cpu_backend();
  auto whole = LlamaModel::load(*backend, kOddLinear);
  ASSERT_TRUE(whole.ok()) << whole.message();
  EXPECT_EQ(whole.value()->file_bytes_read(), odd_linear_rank_bytes(1));
  for (int rank : {0, 1}) {
    auto m = LlamaModel::load(*backend, kOddLinear, nullptr, {rank, 2});
    ASSERT_TRUE(m.ok()) << m.message();
    EXPECT_EQ(m.value()->file_bytes_read(), odd_linear_rank_bytes(2)) << "rank " << rank;
    // What it holds is what it read (fp32 on the CPU backend: twice the fp16 bytes).
    EXPECT_EQ(m.value()->weight_bytes(), 2 * odd_linear_rank_bytes(2));
    const engine::AttentionShape s = m.value()->attention_shape();
    EXPECT_EQ(s.heads, 3);
    EXPECT_EQ(s.kv_heads, 1);
  }
}

// A checkpoint sharded over two files (model.safetensors.index.json): odd-linear's tensors
// split between them, every layer's q/k/v in one file and its o/MLP in the other. Each rank
// of tp 2 reads its slices across both files, exactly the bytes it reads from the one file,
// and the whole model from the shards is the model from the one file (same logits).
std::string shard_odd_linear(const std::string& dir) {
  namespace fs = std::filesystem;
  std::ifstream in(kOddLinear + "/model.safetensors", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  }
  const auto header = nlohmann::json::parse(bytes.substr(8, header_len));
  const std::string data = bytes.substr(8 + header_len);
  nlohmann::json heads[2] = {nlohmann::json::object(), nlohmann::json::object()};
  std::string datas[2];
  nlohmann::json weight_map = nlohmann::json::object();
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    const int f = name.find("self_attn.q") != std::string::npos ||
                          name.find("self_attn.k") != std::string::npos ||
                          name.find("self_attn.v") != std::string::npos ||
                          name.find("embed") != std::string::npos
                      ? 0
                      : 1;
    const auto begin = e["data_offsets"][0].get<uint64_t>();
    const auto end = e["data_offsets"][1].get<uint64_t>();
    nlohmann::json entry = e;
    entry["data_offsets"] = {datas[f].size(), datas[f].size() + (end - begin)};
    datas[f] += data.substr(begin, end - begin);
    heads[f][name] = entry;
    weight_map[name] = "part-" + std::to_string(f) + ".safetensors";
  }
  for (int f = 0; f < 2; ++f) {
    const std::string h = heads[f].dump();
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((h.size() >> (8 * i)) & 0xff);
    std::ofstream(dir + "/part-" + std::to_string(f) + ".safetensors", std::ios::binary)
        << len << h << datas[f];
  }
  std::ofstream(dir + "/model.safetensors.index.json")
      << nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}}.dump();
  fs::copy_file(kOddLinear + "/config.json", dir + "/config.json");
  return dir;
}

TEST(TensorParallel, ShardedCheckpointsSliceAcrossFiles) {
  char tmpl[] = "/tmp/burst-tp-shards-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = shard_odd_linear(tmpl);
  auto backend = engine::make_cpu_backend();
  for (int rank : {0, 1}) {
    auto m = LlamaModel::load(*backend, dir, nullptr, {rank, 2});
    ASSERT_TRUE(m.ok()) << m.message();
    EXPECT_EQ(m.value()->file_bytes_read(), odd_linear_rank_bytes(2)) << "rank " << rank;
  }
  auto whole = LlamaModel::load(*backend, dir);
  auto one_file = LlamaModel::load(*backend, kOddLinear);
  ASSERT_TRUE(whole.ok() && one_file.ok());
  std::vector<float> logits[2];
  int i = 0;
  auto local = engine::make_local_communicator();
  for (LlamaModel* m : {whole.value().get(), one_file.value().get()}) {
    auto ring = engine::RingAttention::create(*backend, *local, m->attention_shape(), 64);
    ASSERT_TRUE(ring.ok());
    const std::vector<int32_t> ids = {1, 17, 400, 3, 99, 4000};
    const auto plan = engine::ShardPlan::make(engine::ShardLayout::kZigzag, 6, 1);
    const Status st = burst::testing::forward_chunk(*m, *ring.value(), 0, plan, ids,
                                                    {0, 1, 2, 3, 4, 5}, {5}, logits[i++], 6);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  ASSERT_EQ(logits[0].size(), 4099u);  // odd-linear's vocabulary: one row of logits
  EXPECT_EQ(logits[0], logits[1]);
  std::filesystem::remove_all(dir);
}

// A slice drawn with its window holds the whole matrix's values there (the random presets give
// every layout the same model).
TEST(TensorParallel, RandomWindowsAreSlicesOfTheWholeMatrix) {
  auto backend = engine::make_cpu_backend();
  const int64_t rows = 7, cols = 11;
  auto whole = backend->alloc({rows, cols}, engine::DType::kF32);
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE(backend->fill_random(whole.value(), 99, 0.5f).ok());
  struct W { int64_t row0, nrows, col0, ncols; };
  for (const W w : {W{2, 3, 0, 11}, W{0, 7, 4, 5}, W{5, 2, 9, 2}}) {
    auto part = backend->alloc({w.nrows, w.ncols}, engine::DType::kF32);
    ASSERT_TRUE(part.ok());
    ASSERT_TRUE(backend->fill_random(part.value(), 99, 0.5f, {cols, w.row0, w.col0}).ok());
    for (int64_t r = 0; r < w.nrows; ++r) {
      for (int64_t c = 0; c < w.ncols; ++c) {
        EXPECT_EQ(part.value().as<float>()[r * w.ncols + c],
                  whole.value().as<float>()[(w.row0 + r) * cols + w.col0 + c])
            << r << "," << c;
      }
    }
  }
}

}  // namespace
}  // namespace burst::models
