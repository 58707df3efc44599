// LLaMA config parsing: real Hugging Face config.json files map onto the right fields (GQA,
// rope_scaling, list-valued eos), every wrong type or range is refused naming the field and the
// file, and the presets hold the published LLaMA-2 shapes. Server config: where the shipped data
// is found (flag, environment, installed layout, never the build tree), presets without a model
// directory, and every shipped configs/*.json parses.
#include "models/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "frontend/server_config.h"

namespace burst::models {
namespace {

using nlohmann::json;

constexpr char kSource[] = "ckpt/config.json";

// meta-llama/Llama-2-7b-hf's config.json, verbatim.
constexpr char kLlama7b[] = R"({
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

json llama7b() { return json::parse(kLlama7b); }

Result<LlamaConfig> parse(const json& j) { return parse_config_json(j.dump(), kSource); }

// Asserts the config is refused with a message naming the source and containing `parts`.
void expect_refused(const json& j, std::initializer_list<std::string> parts) {
  auto r = parse(j);
  ASSERT_FALSE(r.ok()) << "accepted: " << j.dump();
  EXPECT_NE(r.message().find(kSource), std::string::npos) << r.message();
  for (const auto& p : parts) {
    EXPECT_NE(r.message().find(p), std::string::npos) << "'" << p << "' in: " << r.message();
  }
}

TEST(Config, Llama2_7bHuggingFace) {
  auto r = parse_config_json(kLlama7b, kSource);
  ASSERT_TRUE(r.ok()) << r.message();
  const LlamaConfig& c = r.value();
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 11008);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.f);
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, engine::DType::kF16);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
}

TEST(Config, GqaWithLinearRopeScaling) {
  json j = llama7b();
  j["hidden_size"] = 8192;
  j["intermediate_size"] = 28672;
  j["num_hidden_layers"] = 80;
  j["num_attention_heads"] = 64;
  j["num_key_value_heads"] = 8;
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  j["torch_dtype"] = "bfloat16";
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().num_heads, 64);
  EXPECT_EQ(r.value().num_kv_heads, 8);
  EXPECT_EQ(r.value().head_dim, 128);
  EXPECT_FLOAT_EQ(r.value().rope_theta, 500000.f);
  EXPECT_EQ(r.value().rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 2.f);
  EXPECT_EQ(r.value().torch_dtype, engine::DType::kBF16);
}

TEST(Config, DynamicRopeScalingAndNewSpellings) {
  json j = llama7b();
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 4}};
  j.erase("torch_dtype");
  j["dtype"] = "float32";  // transformers >= 4.56 spelling
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.kind, RopeScaling::Kind::kDynamic);
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 4.f);
  EXPECT_EQ(r.value().torch_dtype, engine::DType::kF32);

  j["rope_scaling"] = {{"rope_type", "default"}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 1.f);
}

// transformers 5 writes rope_parameters (type, factor and rope_theta together) instead of
// rope_scaling + rope_theta: the shape of the golden fixtures' config.json files.
TEST(Config, RopeParametersOfTransformers5) {
  json j = llama7b();
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 500.0}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.kind, RopeScaling::Kind::kLinear);
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 2.f);
  EXPECT_FLOAT_EQ(r.value().rope_theta, 500.f);

  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.kind, RopeScaling::Kind::kNone);

  j["rope_parameters"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  r = parse(j);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("rope_parameters.rope_type"), std::string::npos) << r.message();
}

// NousResearch/Yarn-Llama-2-7b-128k's rope fields (transformers 4 spelling, "finetuned" ignored).
TEST(Config, YarnOfTheLlama2At128kCheckpoints) {
  json j = llama7b();
  j["max_position_embeddings"] = 131072;
  j["rope_scaling"] = {{"factor", 32.0},
                       {"original_max_position_embeddings", 4096},
                       {"type", "yarn"},
                       {"finetuned", true}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  const RopeScaling& y = r.value().rope_scaling;
  EXPECT_EQ(y.kind, RopeScaling::Kind::kYarn);
  EXPECT_FLOAT_EQ(y.factor, 32.f);
  EXPECT_EQ(y.original_max_position_embeddings, 4096);
  EXPECT_FLOAT_EQ(y.beta_fast, 32.f);
  EXPECT_FLOAT_EQ(y.beta_slow, 1.f);
  EXPECT_TRUE(y.truncate);
  EXPECT_EQ(y.attention_factor, 0.f);  // derived from the factor (models/rope.h)
  EXPECT_EQ(y.mscale, 0.f);
  EXPECT_EQ(y.mscale_all_dim, 0.f);
  EXPECT_EQ(r.value().max_position_embeddings, 131072);
}

// How transformers 5 resolves the original context and the factor, and the optional fields.
TEST(Config, YarnResolution) {
  json j = llama7b();
  j.erase("rope_scaling");
  j["max_position_embeddings"] = 16384;
  // No original context anywhere: max_position_embeddings.
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"rope_theta", 500000.0}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.original_max_position_embeddings, 16384);
  EXPECT_FLOAT_EQ(r.value().rope_theta, 500000.f);

  // factor null: max_position_embeddings / original.
  j["rope_parameters"] = {
      {"rope_type", "yarn"}, {"factor", nullptr}, {"original_max_position_embeddings", 2048}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 8.f);
  EXPECT_EQ(r.value().rope_scaling.original_max_position_embeddings, 2048);

  // An explicit factor is kept even where the ratio says otherwise (transformers 5 warns).
  j["rope_parameters"] = {
      {"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 2048}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 2.f);

  // A top-level original_max_position_embeddings wins over the rope object's.
  j["original_max_position_embeddings"] = 4096;
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().rope_scaling.original_max_position_embeddings, 4096);
  j.erase("original_max_position_embeddings");

  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 40},         {"beta_fast", 16},
                          {"beta_slow", 2.5},    {"truncate", false},    {"attention_factor", 0.8},
                          {"mscale", 0.707},     {"mscale_all_dim", 1.0}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  const RopeScaling& y = r.value().rope_scaling;
  EXPECT_FLOAT_EQ(y.factor, 40.f);
  EXPECT_FLOAT_EQ(y.beta_fast, 16.f);
  EXPECT_FLOAT_EQ(y.beta_slow, 2.5f);
  EXPECT_FALSE(y.truncate);
  EXPECT_FLOAT_EQ(y.attention_factor, 0.8f);
  EXPECT_FLOAT_EQ(y.mscale, 0.707f);
  EXPECT_FLOAT_EQ(y.mscale_all_dim, 1.f);

  // factor 1 is allowed (no scaling at all), mscale 0 means "not given".
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 1}, {"mscale", 0}};
  r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_FLOAT_EQ(r.value().rope_scaling.factor, 1.f);
}

TEST(Config, BadYarn) {
  auto yarn = [](const json& fields) {
    json j = llama7b();
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
    for (const auto& [k, v] : fields.items()) j["rope_scaling"][k] = v;
    return j;
  };
  json j = yarn(json::object());
  j["rope_scaling"].erase("factor");
  expect_refused(j, {"\"rope_scaling.factor\"", "missing"});
  expect_refused(yarn({{"factor", 0.5}}), {"\"rope_scaling.factor\"", "[1, 1e6]", "0.5"});
  expect_refused(yarn({{"factor", "32"}}), {"\"rope_scaling.factor\"", "number", "string"});
  // null derives the factor, and 4096 / 8192 would shrink the frequencies' spacing.
  expect_refused(yarn({{"factor", nullptr}, {"original_max_position_embeddings", 8192}}),
                 {"\"rope_scaling.factor\"", "null", "4096 / 8192 = 0.5", "below 1"});
  expect_refused(yarn({{"original_max_position_embeddings", 4096.0}}),
                 {"\"rope_scaling.original_max_position_embeddings\"", "integer", "float"});
  expect_refused(yarn({{"original_max_position_embeddings", 0}}),
                 {"\"rope_scaling.original_max_position_embeddings\"", "[1, "});
  j = yarn(json::object());
  j["original_max_position_embeddings"] = "4096";
  expect_refused(j, {"\"original_max_position_embeddings\"", "integer", "string"});
  expect_refused(yarn({{"beta_fast", 0}}),
                 {"\"rope_scaling.beta_fast\"", "must be in (0.0, 1000000.0]"});
  expect_refused(yarn({{"beta_slow", -1.0}}), {"\"rope_scaling.beta_slow\""});
  expect_refused(yarn({{"beta_fast", 1}, {"beta_slow", 32}}),
                 {"\"rope_scaling.beta_fast\"", "(1) is below beta_slow (32)"});
  expect_refused(yarn({{"beta_fast", "32"}}), {"\"rope_scaling.beta_fast\"", "number"});
  expect_refused(yarn({{"truncate", "yes"}}), {"\"rope_scaling.truncate\"", "boolean"});
  expect_refused(yarn({{"truncate", nullptr}}), {"\"rope_scaling.truncate\"", "boolean", "null"});
  expect_refused(yarn({{"attention_factor", 0}}), {"\"rope_scaling.attention_factor\""});
  expect_refused(yarn({{"attention_factor", -1.0}}), {"\"rope_scaling.attention_factor\""});
  expect_refused(yarn({{"mscale", -0.5}}), {"\"rope_scaling.mscale\"", "must be in [0.0, 1000.0]"});
  expect_refused(yarn({{"mscale_all_dim", "1"}}), {"\"rope_scaling.mscale_all_dim\"", "number"});
  // The transformers 5 spelling names its own object.
  j = llama7b();
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 0.25}};
  expect_refused(j, {"\"rope_parameters.factor\""});
}

TEST(Config, DefaultsForOptionalFields) {
  json j = {{"hidden_size", 64},
            {"intermediate_size", 172},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"vocab_size", 512}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  const LlamaConfig& c = r.value();
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.f);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::kNone);
  EXPECT_EQ(c.torch_dtype, engine::DType::kF32);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
}

TEST(Config, ExplicitHeadDimEosListAndTiedEmbeddings) {
  json j = llama7b();
  j["hidden_size"] = 3072;
  j["num_attention_heads"] = 24;
  j["num_key_value_heads"] = 8;
  j["head_dim"] = 256;  // not hidden / heads: allowed when given
  j["vocab_size"] = 128256;
  j["bos_token_id"] = 128000;
  j["eos_token_id"] = {128001, 128008, 128009};
  j["tie_word_embeddings"] = true;
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().head_dim, 256);
  EXPECT_EQ(r.value().bos_token_id, 128000);
  EXPECT_EQ(r.value().eos_token_id, 128001);
  EXPECT_TRUE(r.value().tie_word_embeddings);
}

TEST(Config, WrongTypes) {
  auto with = [](const std::string& field, const json& value) {
    json j = llama7b();
    j[field] = value;
    return j;
  };
  expect_refused(with("hidden_size", "4096"), {"\"hidden_size\"", "integer", "string"});
  expect_refused(with("hidden_size", 4096.0), {"\"hidden_size\"", "integer", "float"});
  expect_refused(with("num_hidden_layers", true), {"\"num_hidden_layers\"", "integer"});
  expect_refused(with("num_key_value_heads", json::array({8})), {"\"num_key_value_heads\""});
  expect_refused(with("rms_norm_eps", "1e-5"), {"\"rms_norm_eps\"", "number"});
  expect_refused(with("rope_theta", json::object()), {"\"rope_theta\""});
  expect_refused(with("tie_word_embeddings", "false"), {"\"tie_word_embeddings\"", "boolean"});
  expect_refused(with("torch_dtype", 16), {"\"torch_dtype\""});
  expect_refused(with("torch_dtype", "int8"), {"\"torch_dtype\"", "int8"});
  expect_refused(with("eos_token_id", "2"), {"\"eos_token_id\""});
  expect_refused(with("eos_token_id", json::array()), {"\"eos_token_id\"", "empty"});
  expect_refused(with("eos_token_id", json::array({"2"})), {"eos_token_id[0]"});
  expect_refused(with("rope_scaling", "linear"), {"\"rope_scaling\""});
  expect_refused(with("rope_scaling", {{"type", "linear"}, {"factor", "2"}}),
                 {"rope_scaling.factor", "number"});
  expect_refused(with("rope_scaling", {{"type", 1}, {"factor", 2}}), {"rope_scaling.type"});
  expect_refused(with("head_dim", "128"), {"\"head_dim\""});
}

TEST(Config, MissingRequiredFields) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "vocab_size"}) {
    json j = llama7b();
    j.erase(field);
    expect_refused(j, {std::string("\"") + field + "\"", "missing"});
    j[field] = nullptr;  // null counts as absent
    expect_refused(j, {std::string("\"") + field + "\"", "missing"});
  }
}

TEST(Config, BadRopeScaling) {
  json j = llama7b();
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  expect_refused(j, {"longrope", "rope_scaling.rope_type", "supported: linear, dynamic, yarn"});
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 8.0}};
  expect_refused(j, {"llama3"});
  j["rope_scaling"] = {{"type", "linear"}};
  expect_refused(j, {"rope_scaling.factor", "missing"});
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 0}};
  expect_refused(j, {"rope_scaling.factor"});
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", -2.0}};
  expect_refused(j, {"rope_scaling.factor"});
  j["rope_scaling"] = {{"factor", 2.0}};
  expect_refused(j, {"rope_scaling", "type"});
}

TEST(Config, HeadsNotDivisible) {
  json j = llama7b();
  j["num_key_value_heads"] = 5;
  expect_refused(j, {"num_attention_heads", "num_key_value_heads", "divisible"});
  j = llama7b();
  j["num_attention_heads"] = 48;  // 4096 / 48 is not an integer
  j["num_key_value_heads"] = 48;
  expect_refused(j, {"hidden_size", "divisible"});
  j["head_dim"] = 86;  // an explicit head_dim lifts that requirement
  EXPECT_TRUE(parse(j).ok()) << parse(j).message();
  j["head_dim"] = 85;
  expect_refused(j, {"head_dim", "even"});
  j.erase("head_dim");
  j["num_attention_heads"] = 4096;  // head_dim 1: odd
  j["num_key_value_heads"] = 4096;
  expect_refused(j, {"head_dim", "even"});
}

TEST(Config, RangeChecks) {
  auto with = [](const std::string& field, const json& value) {
    json j = llama7b();
    j[field] = value;
    return j;
  };
  expect_refused(with("hidden_size", 0), {"\"hidden_size\""});
  expect_refused(with("hidden_size", -4096), {"\"hidden_size\""});
  expect_refused(with("hidden_size", 2'000'000), {"\"hidden_size\""});
  expect_refused(with("hidden_size", 18446744073709551615ull), {"\"hidden_size\""});
  expect_refused(with("num_hidden_layers", 0), {"\"num_hidden_layers\""});
  expect_refused(with("intermediate_size", int64_t{1} << 40), {"\"intermediate_size\""});
  expect_refused(with("vocab_size", int64_t{1} << 40), {"\"vocab_size\""});
  expect_refused(with("max_position_embeddings", 0), {"\"max_position_embeddings\""});
  expect_refused(with("rms_norm_eps", 0), {"\"rms_norm_eps\""});
  expect_refused(with("rms_norm_eps", -1e-5), {"\"rms_norm_eps\""});
  expect_refused(with("rope_theta", 0), {"\"rope_theta\""});
  expect_refused(with("rope_theta", 1e300), {"\"rope_theta\""});
  expect_refused(with("eos_token_id", 32000), {"\"eos_token_id\""});  // == vocab_size
  expect_refused(with("bos_token_id", -1), {"\"bos_token_id\""});
}

// Every token id names a row of the embedding table: each element of a list (the engine stops
// on any of them), pad_token_id too (-1 is the "none" of old LLaMA conversions).
TEST(Config, TokenIdsInsideTheVocabulary) {
  auto with = [](const std::string& field, const json& value) {
    json j = llama7b();
    j[field] = value;
    return j;
  };
  expect_refused(with("eos_token_id", json::array({2, 32000})),
                 {"\"eos_token_id[1]\"", "vocabulary [0, 32000)", "got 32000"});
  expect_refused(with("eos_token_id", json::array({2, -3})), {"\"eos_token_id[1]\"", "got -3"});
  expect_refused(with("bos_token_id", 40000), {"\"bos_token_id\"", "[0, 32000)", "got 40000"});
  expect_refused(with("pad_token_id", 32000), {"\"pad_token_id\"", "(or -1: none)", "got 32000"});
  expect_refused(with("pad_token_id", -2), {"\"pad_token_id\"", "got -2"});
  expect_refused(with("pad_token_id", 18446744073709551615ull),
                 {"\"pad_token_id\"", "got 18446744073709551615"});
  expect_refused(with("pad_token_id", "0"), {"\"pad_token_id\"", "integer", "string"});
  expect_refused(with("bos_token_id", -1), {"\"bos_token_id\"", "got -1"});  // -1 is pad's only
  for (const json& pad : {json(-1), json(nullptr), json(0), json(31999)}) {
    auto r = parse(with("pad_token_id", pad));
    EXPECT_TRUE(r.ok()) << pad.dump() << ": " << r.message();
  }
  auto r = parse(with("eos_token_id", json::array({2, 31999, 0})));
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().eos_token_id, 2);
}

// rope_theta is a base above 1 and finite; real checkpoints use 1e4 (LLaMA-2) to 1e7.
TEST(Config, RopeThetaAbsurdValuesRefusedWithTheRange) {
  auto with = [](const json& value) {
    json j = llama7b();
    j["rope_theta"] = value;
    return j;
  };
  for (const json& bad :
       {json(1e-300), json(1), json(1.0), json(0.5), json(-10000.0), json(1e13)}) {
    expect_refused(with(bad), {"\"rope_theta\"", "finite", "(1, 1e12]", "1e4 to 1e7"});
  }
  // Past a double: JSON has no infinity, and the parser refuses 1e400 rather than round it.
  std::string text = kLlama7b;
  text.replace(text.find("\"rope_scaling\""), 0, "\"rope_theta\": 1e400, ");
  EXPECT_FALSE(parse_config_json(text, kSource).ok());
  json params = llama7b();
  params["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e-300}};
  expect_refused(params, {"\"rope_parameters.rope_theta\"", "(1, 1e12]"});
  for (double good : {1.5, 500.0, 10000.0, 500000.0, 1e7, 1e12}) {
    auto r = parse(with(good));
    ASSERT_TRUE(r.ok()) << good << ": " << r.message();
    EXPECT_FLOAT_EQ(r.value().rope_theta, static_cast<float>(good));
  }
}

// max_position_embeddings sizes per-sequence buffers: at most 16M tokens.
TEST(Config, MaxPositionEmbeddingsBounded) {
  json j = llama7b();
  j["max_position_embeddings"] = int64_t{1} << 30;
  expect_refused(j,
                 {"\"max_position_embeddings\"", "[2, 16777216]", "16M tokens", "got 1073741824"});
  j["max_position_embeddings"] = kMaxPositionEmbeddings + 1;
  expect_refused(j, {"\"max_position_embeddings\"", "got 16777217"});
  j["max_position_embeddings"] = kMaxPositionEmbeddings;
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().max_position_embeddings, 16777216);
  // Yarn's pretraining context has the same bound.
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"original_max_position_embeddings", int64_t{1} << 30}};
  expect_refused(j, {"\"rope_scaling.original_max_position_embeddings\"", "got 1073741824"});
}

// The field that declared the dtype is kept: the loader quotes it when the headers disagree.
TEST(Config, DtypeFieldIsRemembered) {
  json j = llama7b();
  auto r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value().torch_dtype_field, "torch_dtype");
  EXPECT_EQ(r.value().torch_dtype, engine::DType::kF16);
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";
  r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value().torch_dtype_field, "dtype");
  EXPECT_EQ(r.value().torch_dtype, engine::DType::kBF16);
  j.erase("dtype");
  r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value().torch_dtype_field, "");
}

// What the engine does not implement is refused, naming the field, not run as LLaMA.
TEST(Config, ArchitecturesTheEngineCannotRunAreRefused) {
  auto with = [](const std::string& field, const json& value) {
    json j = llama7b();
    j[field] = value;
    return j;
  };
  expect_refused(with("hidden_act", "gelu"), {"\"hidden_act\"", "gelu", "silu"});
  expect_refused(with("hidden_activation", "gelu_pytorch_tanh"), {"\"hidden_activation\""});
  expect_refused(with("attention_bias", true), {"\"attention_bias\"", "true"});
  expect_refused(with("mlp_bias", true), {"\"mlp_bias\""});
  expect_refused(with("attention_bias", "no"), {"\"attention_bias\"", "boolean"});
  expect_refused(with("architectures", json::array({"BertForMaskedLM"})),
                 {"\"architectures[0]\"", "BertForMaskedLM", "LlamaForCausalLM"});
  expect_refused(with("architectures", json::array()), {"\"architectures\""});
  expect_refused(with("architectures", "LlamaForCausalLM"), {"\"architectures\""});
  expect_refused(with("model_type", "bert"), {"\"model_type\"", "bert"});
  expect_refused(with("max_position_embeddings", 1), {"\"max_position_embeddings\"", "[2, "});
  // Accepted: the spellings real LLaMA checkpoints use.
  EXPECT_TRUE(parse(with("hidden_act", "swish")).ok());
  EXPECT_TRUE(parse(with("attention_bias", false)).ok());
  EXPECT_TRUE(parse(with("max_position_embeddings", 2)).ok());
}

// Out-of-range numbers are quoted exactly as written: no wrap-around, no rounding.
TEST(Config, OutOfRangeNumbersQuotedExactly) {
  auto message = [](const std::string& field, const std::string& number) {
    std::string text = kLlama7b;
    const std::string key = "\"" + field + "\": ";
    const size_t at = text.find(key);
    const size_t end = text.find_first_of(",\n}", at + key.size());
    text.replace(at + key.size(), end - at - key.size(), number);
    auto r = parse_config_json(text, kSource);
    return r.ok() ? std::string("accepted") : r.message();
  };
  EXPECT_NE(message("hidden_size", "18446744073709551615").find("got 18446744073709551615"),
            std::string::npos);
  EXPECT_NE(message("vocab_size", "1e30").find("got float 1e+30"), std::string::npos)
      << message("vocab_size", "1e30");
  EXPECT_NE(message("num_hidden_layers", "99999999999999999999999").find("float"),
            std::string::npos);
  EXPECT_NE(message("eos_token_id", "2147483648").find("got 2147483648"), std::string::npos);
  EXPECT_NE(message("eos_token_id", "-2147483649").find("got -2147483649"), std::string::npos);
  EXPECT_NE(message("max_position_embeddings", "1073741825").find("got 1073741825"),
            std::string::npos);
  EXPECT_NE(message("rms_norm_eps", "2").find("must be in (0.0, 1.0], got 2"), std::string::npos)
      << message("rms_norm_eps", "2");
}

TEST(Config, FifoOrDirectoryConfigRefusedWithoutHanging) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "burst_cfg_XXXXXX").string();
  ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;
  ASSERT_EQ(::mkfifo((dir + "/config.json").c_str(), 0600), 0);
  auto r = load_config(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find(dir + "/config.json is a FIFO, not a regular file"),
            std::string::npos)
      << r.message();
  std::filesystem::remove(dir + "/config.json");
  std::filesystem::create_directory(dir + "/config.json");
  r = load_config(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("is a directory"), std::string::npos) << r.message();
  std::filesystem::remove_all(dir);
}

TEST(Config, NotJsonOrNotAnObject) {
  auto r = parse_config_json("{\"hidden_size\": 4096,", kSource);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find(kSource), std::string::npos) << r.message();
  r = parse_config_json("[4096]", kSource);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("object"), std::string::npos) << r.message();
  r = parse_config_json("", kSource);
  ASSERT_FALSE(r.ok());
  // Deep nesting where a number belongs: refused by type, without recursing per level.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  r = parse_config_json("{\"hidden_size\": " + deep + "}", kSource);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("hidden_size"), std::string::npos) << r.message();
  // Every prefix of a real config must fail cleanly (none of them is a complete object).
  std::string text = kLlama7b;
  for (size_t n = 0; n + 1 < text.size(); ++n) {
    EXPECT_FALSE(parse_config_json(text.substr(0, n), kSource).ok()) << n;
  }
}

TEST(Config, LoadFromDirectory) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "burst_cfg_XXXXXX").string();
  ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
  const std::string dir = tmpl;
  {
    std::ofstream out(dir + "/config.json");
    out << kLlama7b;
  }
  auto r = load_config(dir);
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(r.value().hidden_size, 4096);
  {
    std::ofstream out(dir + "/config.json");
    out << R"({"hidden_size": "big"})";
  }
  r = load_config(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find(dir + "/config.json"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("hidden_size"), std::string::npos) << r.message();
  std::filesystem::remove_all(dir);
  r = load_config(dir);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find(dir + "/config.json"), std::string::npos) << r.message();
}

TEST(Config, Presets) {
  EXPECT_EQ(preset_names(), (std::vector<std::string>{"1b", "7b", "13b", "70b"}));
  struct Want {
    const char* name;
    int64_t hidden, inter, layers, heads, kv, head_dim;
  };
  for (const Want& w :
       {Want{"1b", 2048, 5632, 22, 32, 4, 64}, Want{"7b", 4096, 11008, 32, 32, 32, 128},
        Want{"13b", 5120, 13824, 40, 40, 40, 128}, Want{"70b", 8192, 28672, 80, 64, 8, 128}}) {
    auto r = preset_config(w.name);
    ASSERT_TRUE(r.ok()) << r.message();
    const LlamaConfig& c = r.value();
    EXPECT_EQ(c.hidden_size, w.hidden) << w.name;
    EXPECT_EQ(c.intermediate_size, w.inter) << w.name;
    EXPECT_EQ(c.num_layers, w.layers) << w.name;
    EXPECT_EQ(c.num_heads, w.heads) << w.name;
    EXPECT_EQ(c.num_kv_heads, w.kv) << w.name;
    EXPECT_EQ(c.head_dim, w.head_dim) << w.name;
    EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f) << w.name;
    EXPECT_FLOAT_EQ(c.rope_theta, 10000.f) << w.name;
    EXPECT_EQ(c.rope_scaling.kind, RopeScaling::Kind::kNone) << w.name;
    EXPECT_EQ(c.vocab_size, 32000) << w.name;
    EXPECT_EQ(c.max_position_embeddings, 4096) << w.name;
    EXPECT_EQ(c.torch_dtype, engine::DType::kBF16) << w.name;
    EXPECT_FALSE(c.tie_word_embeddings) << w.name;
    EXPECT_EQ(c.bos_token_id, 1) << w.name;
    EXPECT_EQ(c.eos_token_id, 2) << w.name;
  }
  auto bad = preset_config("8b");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("8b"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("70b"), std::string::npos) << bad.message();
}

}  // namespace
}  // namespace burst::models

namespace burst::server {
namespace {

namespace fs = std::filesystem;

Result<ServerConfig> parse_flags(std::vector<std::string> args) {
  args.insert(args.begin(), "burst-server");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  bool help = false;
  return parse_server_args(static_cast<int>(argv.size()), argv.data(), &help);
}

// A temporary data directory, removed at the end; BURST_DATA_DIR is unset for the test.
struct DataDir {
  fs::path root;
  DataDir() {
    std::string tmpl = (fs::temp_directory_path() / "burst_data_XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    root = tmpl;
    ::unsetenv("BURST_DATA_DIR");
  }
  ~DataDir() {
    ::unsetenv("BURST_DATA_DIR");
    fs::remove_all(root);
  }
  void write(const fs::path& rel, const std::string& text) const {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  }
};

TEST(ServerConfigData, DefaultConfigFoundWhateverTheBuildDirectory) {
  ::unsetenv("BURST_DATA_DIR");
  auto c = parse_flags({});
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_TRUE(fs::exists(fs::path(c.value().model) / "config.json")) << c.value().model;
  EXPECT_EQ(fs::path(c.value().model).filename(), "kjv-tiny");
  EXPECT_TRUE(fs::exists(c.value().tokenizer)) << c.value().tokenizer;
  EXPECT_TRUE(fs::exists(fs::path(c.value().data_dir) / "configs" / "cpu-tiny.json"));
}

TEST(ServerConfigData, FlagBeatsEnvironmentAndPathsResolveInsideTheDataDirectory) {
  DataDir a, b;
  a.write("configs/cpu-tiny.json", R"({"model": "models/m", "workers": 3})");
  fs::create_directories(a.root / "models/m");
  b.write("configs/cpu-tiny.json", R"({"model": "models/m", "workers": 5})");
  fs::create_directories(b.root / "models/m");

  auto flag = parse_flags({"--data-dir", a.root.string()});
  ASSERT_TRUE(flag.ok()) << flag.message();
  EXPECT_EQ(flag.value().workers, 3);
  EXPECT_EQ(fs::path(flag.value().model), a.root / "models/m");
  EXPECT_EQ(fs::path(flag.value().tokenizer), a.root / "models/m/tokenizer.model");

  ::setenv("BURST_DATA_DIR", b.root.c_str(), 1);
  auto env = parse_flags({});
  ASSERT_TRUE(env.ok()) << env.message();
  EXPECT_EQ(env.value().workers, 5);
  EXPECT_EQ(fs::path(env.value().model), b.root / "models/m");
  auto both = parse_flags({"--data-dir", a.root.string()});
  ASSERT_TRUE(both.ok()) << both.message();
  EXPECT_EQ(both.value().workers, 3);

  ::setenv("BURST_DATA_DIR", (b.root / "missing").c_str(), 1);
  auto missing = parse_flags({});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("BURST_DATA_DIR"), std::string::npos) << missing.message();
}

TEST(ServerConfigData, InstalledTreeFoundFromTheExecutableWhereverItWasCopied) {
  DataDir d;
  d.write("share/burst/configs/cpu-tiny.json", "{}");
  std::vector<std::string> looked;
  auto dir = find_data_dir("", d.root / "bin" / "burst-server", &looked);
  ASSERT_TRUE(dir.ok()) << dir.message();
  EXPECT_EQ(fs::path(dir.value()), d.root / "share/burst");
  ASSERT_FALSE(looked.empty());
  EXPECT_EQ(fs::path(looked[0]), d.root / "share/burst");
  // The build tree is never a candidate: its bin/ has no ../share/burst and nothing else of it
  // is looked at.
  looked.clear();
  auto none = find_data_dir("", d.root / "elsewhere" / "bin" / "burst-server", &looked);
  ASSERT_TRUE(none.ok());
  if (std::string(BURST_BINARY_DIR) != BURST_SOURCE_DIR) {
    for (const auto& l : looked) EXPECT_EQ(l.find(BURST_BINARY_DIR), std::string::npos) << l;
  }
}

TEST(ServerConfigData, PresetNeedsNoModelDirectory) {
  DataDir empty;
  auto no_tok = parse_flags({"--data-dir", empty.root.string(), "--preset", "7b",
                             "--random-weights", "0"});
  ASSERT_FALSE(no_tok.ok());
  EXPECT_NE(no_tok.message().find("--tokenizer"), std::string::npos) << no_tok.message();

  const std::string tok = std::string(BURST_SOURCE_DIR) + "/models/kjv-tiny/tokenizer.model";
  auto with_tok = parse_flags({"--data-dir", empty.root.string(), "--preset", "7b",
                               "--random-weights", "0", "--tokenizer", tok});
  ASSERT_TRUE(with_tok.ok()) << with_tok.message();
  EXPECT_EQ(with_tok.value().model, "");
  EXPECT_EQ(with_tok.value().tokenizer, tok);
  EXPECT_EQ(with_tok.value().model_name, "llama-2-7b-random");

  DataDir shipped;
  shipped.write("models/kjv-tiny/tokenizer.model", "x");
  auto from_data = parse_flags({"--data-dir", shipped.root.string(), "--preset", "13b",
                                "--random-weights", "1"});
  ASSERT_TRUE(from_data.ok()) << from_data.message();
  EXPECT_EQ(fs::path(from_data.value().tokenizer), shipped.root / "models/kjv-tiny/tokenizer.model");

  // Over the default config (which names kjv-tiny): the preset replaces that model, whose
  // directory still lends its tokenizer.
  ::unsetenv("BURST_DATA_DIR");
  auto over_default = parse_flags({"--preset", "7b", "--random-weights", "3"});
  ASSERT_TRUE(over_default.ok()) << over_default.message();
  EXPECT_EQ(over_default.value().model, "");
  EXPECT_EQ(fs::path(over_default.value().tokenizer).filename(), "tokenizer.model");
  EXPECT_TRUE(fs::exists(over_default.value().tokenizer)) << over_default.value().tokenizer;
}

TEST(ServerConfigData, NoModelSaysWhereItLooked) {
  DataDir empty;
  auto r = parse_flags({"--data-dir", empty.root.string()});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("no model"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find(empty.root.string()), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("BURST_DATA_DIR"), std::string::npos) << r.message();
}

// Every shipped config (the deployment ones included) has only known keys of the right types
// and valid values, as `burst-server --config F --check-config` checks in the deploy test.
TEST(ServerConfigData, EveryShippedConfigParses) {
  ::unsetenv("BURST_DATA_DIR");
  int n = 0;
  for (const auto& e : fs::recursive_directory_iterator(std::string(BURST_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".json") continue;
    ++n;
    auto c = parse_flags({"--config", e.path().string()});
    EXPECT_TRUE(c.ok()) << e.path() << ": " << c.message();
  }
  EXPECT_GE(n, 4);
}

}  // namespace
}  // namespace burst::server
