// Safetensors loading: valid files read back byte-exact, and every kind of malformed file (cut,
// lying header, bad JSON, bad entries, overlaps, hostile shard names) is refused with an error
// that names the file and the tensor. The files are built here, byte by byte, in a fresh
// temporary directory.
#include "models/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <limits>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

namespace burst::models {
namespace {

using nlohmann::json;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "burst_st_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (p != nullptr) path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string u64_le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// The raw format: 8-byte little-endian header length, the header text, the data section.
std::string raw_file(const std::string& header, const std::string& data) {
  return u64_le(header.size()) + header + data;
}

template <typename T>
std::string bytes_of(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

uint16_t bf16_bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact for the values used (<= 8 mantissa bits)
}

struct Spec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// A well-formed file: tensors laid out back to back in the order given, header padded with
// spaces to a multiple of 8 as the reference writer does.
std::string build(const std::vector<Spec>& specs, bool with_metadata = true) {
  json header = json::object();
  if (with_metadata) header["__metadata__"] = {{"format", "pt"}};
  std::string data;
  for (const auto& s : specs) {
    header[s.name] = {{"dtype", s.dtype},
                      {"shape", s.shape},
                      {"data_offsets", {data.size(), data.size() + s.bytes.size()}}};
    data += s.bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';
  return raw_file(text, data);
}

const std::vector<float> kBf16Values = {1.f, -2.f, 0.5f, 3.25f, -0.125f, 65536.f};
const std::vector<uint16_t> kF16Bits = {0x3C00, 0xC000, 0x3800, 0x7BFF};  // 1, -2, 0.5, 65504
const std::vector<float> kF32Values = {1.5f, -7.25f, 1e-3f, 3e38f};

std::vector<Spec> sample_specs() {
  std::vector<uint16_t> bf16;
  for (float f : kBf16Values) bf16.push_back(bf16_bits(f));
  return {
      {"a.bf16", "BF16", {2, 3}, bytes_of(bf16)},
      {"b.f16", "F16", {4}, bytes_of(kF16Bits)},
      {"c.f32", "F32", {2, 2}, bytes_of(kF32Values)},
      {"d.step", "I64", {1}, bytes_of(std::vector<int64_t>{42})},
  };
}

// Opens `bytes` written as DIR/NAME and returns the error message (empty when it opened).
std::string open_error(const TempDir& dir, const std::string& name, const std::string& bytes) {
  write_file(dir.file(name), bytes);
  auto f = SafetensorsFile::open(dir.file(name));
  return f.ok() ? std::string() : f.message();
}

// Asserts that opening fails with a message naming the file and containing every `parts`.
void expect_refused(const std::string& bytes, const std::vector<std::string>& parts) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string msg = open_error(dir, "bad.safetensors", bytes);
  ASSERT_FALSE(msg.empty()) << "a malformed file was accepted";
  EXPECT_NE(msg.find(dir.file("bad.safetensors")), std::string::npos) << msg;
  for (const auto& p : parts) {
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' in: " << msg;
  }
}

std::string entry(const std::string& name, const std::string& body) {
  return "{\"" + name + "\":" + body + "}";
}

TEST(Safetensors, ValidFileReadsBackExactValues) {
  TempDir dir;
  write_file(dir.file("model.safetensors"), build(sample_specs()));
  auto file = SafetensorsFile::open(dir.file("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file.value()->tensors().size(), 4u);  // __metadata__ is not a tensor

  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok()) << w.message();
  const WeightFiles& weights = w.value();

  auto a = weights.get("a.bf16", {2, 3});
  ASSERT_TRUE(a.ok()) << a.message();
  EXPECT_EQ(a.value().dtype, engine::DType::kBF16);
  EXPECT_EQ(a.value().file_dtype, "BF16");
  EXPECT_EQ(a.value().nbytes, 12);
  EXPECT_EQ(a.value().file, dir.file("model.safetensors"));
  for (size_t i = 0; i < kBf16Values.size(); ++i) {
    uint16_t bits = 0;
    std::memcpy(&bits, static_cast<const char*>(a.value().data) + 2 * i, 2);
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f = 0;
    std::memcpy(&f, &u, 4);
    EXPECT_EQ(f, kBf16Values[i]) << i;
  }

  auto b = weights.get("b.f16", {4});
  ASSERT_TRUE(b.ok()) << b.message();
  EXPECT_EQ(b.value().dtype, engine::DType::kF16);
  EXPECT_EQ(b.value().shape, (std::vector<int64_t>{4}));
  std::vector<uint16_t> f16(4);
  std::memcpy(f16.data(), b.value().data, 8);
  EXPECT_EQ(f16, kF16Bits);

  auto c = weights.get("c.f32", {2, 2});
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ(c.value().dtype, engine::DType::kF32);
  std::vector<float> f32(4);
  std::memcpy(f32.data(), c.value().data, 16);
  EXPECT_EQ(f32, kF32Values);

  // Validated, listed, but not something the engine loads.
  EXPECT_TRUE(weights.contains("d.step"));
  auto d = weights.get("d.step", {1});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.message().find("d.step"), std::string::npos) << d.message();
  EXPECT_NE(d.message().find("I64"), std::string::npos) << d.message();
  EXPECT_NE(d.message().find("model.safetensors"), std::string::npos) << d.message();
}

TEST(Safetensors, EmptyTensorsAndUnpaddedHeaderAreFine) {
  // Zero-element tensors own no bytes, so they may share an offset with anything.
  std::string header =
      "{\"e\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]},"
      "\"x\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},"
      "\"z\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[3,5]}}";
  TempDir dir;
  EXPECT_EQ(open_error(dir, "ok.safetensors", raw_file(header, "abcde")), "");
}

TEST(Safetensors, WrongShapeRequested) {
  TempDir dir;
  write_file(dir.file("model.safetensors"), build(sample_specs()));
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok()) << w.message();
  auto r = w.value().get("a.bf16", {3, 2});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("a.bf16"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("model.safetensors"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("[2, 3]"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("[3, 2]"), std::string::npos) << r.message();
}

TEST(Safetensors, MissingTensor) {
  TempDir dir;
  write_file(dir.file("model.safetensors"), build(sample_specs()));
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok()) << w.message();
  EXPECT_FALSE(w.value().contains("lm_head.weight"));
  auto r = w.value().get("lm_head.weight", {1});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.message(), "missing tensor lm_head.weight (in " + dir.path() + ")");
}

TEST(Safetensors, DirectoryWithoutWeights) {
  TempDir dir;
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find(dir.path()), std::string::npos) << w.message();
}

TEST(Safetensors, TruncatedInHeader) {
  std::string good = build(sample_specs());
  uint64_t header_len = good.size() - 8 - (12 + 8 + 16 + 8);
  expect_refused(good.substr(0, 8 + header_len / 2), {"header length"});
}

TEST(Safetensors, TruncatedInData) {
  std::string good = build(sample_specs());
  // The last tensor in the data section (d.step) now runs past the end.
  expect_refused(good.substr(0, good.size() - 3), {"d.step", "past the data section"});
}

TEST(Safetensors, EveryPrefixOfAValidFileIsRefused) {
  // Each cut lands in the length, the header or a tensor, and none of them may be accepted or
  // read past the mapping (this is the case the sanitizer run leans on).
  std::string good = build(sample_specs());
  TempDir dir;
  for (size_t n = 0; n < good.size(); ++n) {
    std::string msg = open_error(dir, "cut.safetensors", good.substr(0, n));
    EXPECT_NE(msg.find("cut.safetensors"), std::string::npos) << "prefix " << n << ": " << msg;
  }
  EXPECT_EQ(open_error(dir, "cut.safetensors", good), "");
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  // Flipped bytes anywhere must give a clean error or a file whose views lie inside it.
  std::string good = build(sample_specs());
  std::mt19937 rng(1234);
  TempDir dir;
  for (int iter = 0; iter < 300; ++iter) {
    std::string bad = good;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      bad[rng() % bad.size()] = static_cast<char>(rng() & 0xff);
    }
    write_file(dir.file("x.safetensors"), bad);
    auto f = SafetensorsFile::open(dir.file("x.safetensors"));
    if (!f.ok()) {
      EXPECT_NE(f.message().find("x.safetensors"), std::string::npos) << f.message();
      continue;
    }
    for (const auto& [name, v] : f.value()->tensors()) {
      const char* p = static_cast<const char*>(v.data);
      volatile char sink = 0;
      // Touch the first and last byte: ASan/valgrind flag a view outside the mapping.
      if (v.nbytes > 0) sink = static_cast<char>(p[0] ^ p[v.nbytes - 1]);
      (void)sink;
    }
  }
}

TEST(Safetensors, HeaderLengthLargerThanFile) {
  expect_refused(u64_le(1000) + std::string(10, '{'), {"header length 1000", "past the end"});
}

TEST(Safetensors, HeaderLengthAbsurd) {
  expect_refused(u64_le(uint64_t{1} << 63) + "{}", {"header length 9223372036854775808"});
  expect_refused(u64_le(~uint64_t{0}) + "{}", {"header length"});
}

TEST(Safetensors, HeaderNotJson) {
  expect_refused(raw_file("{\"a\": {\"dtype\": ", ""), {"not valid JSON"});
  expect_refused(raw_file(std::string("{\0}", 3), ""), {"not valid JSON"});
}

TEST(Safetensors, HeaderNotAnObject) {
  expect_refused(raw_file("[1, 2, 3]", ""), {"not an object"});
  expect_refused(raw_file("\"text\"", ""), {"not an object"});
}

TEST(Safetensors, MetadataMustBeStrings) {
  expect_refused(raw_file("{\"__metadata__\":{\"format\":1}}", ""), {"__metadata__", "format"});
  expect_refused(raw_file("{\"__metadata__\":[]}", ""), {"__metadata__"});
}

TEST(Safetensors, EntryNotAnObject) {
  expect_refused(raw_file(entry("w", "[0, 4]"), "abcd"), {"\"w\"", "array"});
}

TEST(Safetensors, EntryMissingDataOffsets) {
  expect_refused(raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1]}"), "abcd"),
                 {"\"w\"", "missing \"data_offsets\""});
}

TEST(Safetensors, EntryMissingDtypeOrShape) {
  expect_refused(raw_file(entry("w", "{\"shape\":[1],\"data_offsets\":[0,4]}"), "abcd"),
                 {"\"w\"", "missing \"dtype\""});
  expect_refused(raw_file(entry("w", "{\"dtype\":\"F32\",\"data_offsets\":[0,4]}"), "abcd"),
                 {"\"w\"", "missing \"shape\""});
}

TEST(Safetensors, EntryWithExtraKey) {
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}"),
               "abcd"),
      {"\"w\"", "unexpected key \"x\""});
}

TEST(Safetensors, WrongDtype) {
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"float32\",\"shape\":[1],\"data_offsets\":[0,4]}"), "abcd"),
      {"\"w\"", "unknown dtype \"float32\""});
  expect_refused(raw_file(entry("w", "{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}"), "abcd"),
                 {"\"w\"", "dtype"});
}

TEST(Safetensors, BadShapes) {
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[-1,1],\"data_offsets\":[0,4]}"), "abcd"),
      {"\"w\"", "-1"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}"), "abcd"),
      {"\"w\"", "shape"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}"), "abcd"),
      {"\"w\"", "shape"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}"), "abcd"),
      {"\"w\"", "shape"});
}

TEST(Safetensors, DeeplyNestedHeaderDoesNotOverflowTheStack) {
  // Neither parsing, nor the error message, nor freeing the JSON may recurse per level.
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[" + deep + "],\"data_offsets\":[0,4]}"),
               "abcd"),
      {"\"w\"", "shape"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" + deep + ",4]}"),
               "abcd"),
      {"\"w\"", "data_offsets"});
  expect_refused(raw_file(deep, ""), {"not an object"});
}

TEST(Safetensors, ShapeOverflow) {
  // 2^40 * 2^40 elements wraps a 64-bit count; it must be caught, not compared after wrapping.
  expect_refused(raw_file(entry("w",
                                "{\"dtype\":\"F32\",\"shape\":[1099511627776,"
                                "1099511627776],\"data_offsets\":[0,0]}"),
                          ""),
                 {"\"w\"", "overflows"});
  // 2^62 elements fit, 2^62 * 4 bytes do not.
  expect_refused(raw_file(entry("w",
                                "{\"dtype\":\"F32\",\"shape\":[4611686018427387904],"
                                "\"data_offsets\":[0,0]}"),
                          ""),
                 {"\"w\"", "overflows"});
  // A dimension past INT64_MAX is not a valid dimension at all.
  expect_refused(raw_file(entry("w",
                                "{\"dtype\":\"U8\",\"shape\":[18446744073709551615],"
                                "\"data_offsets\":[0,0]}"),
                          ""),
                 {"\"w\"", "shape"});
}

TEST(Safetensors, BadOffsets) {
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}"), "abcd"),
      {"\"w\"", "reversed"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}"), "abcd"),
      {"\"w\"", "past the data section"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}"), "abcd"),
      {"\"w\"", "data_offsets"});
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}"), "abcd"),
      {"\"w\"", "data_offsets"});
  expect_refused(raw_file(entry("w",
                                "{\"dtype\":\"F32\",\"shape\":[1],"
                                "\"data_offsets\":[18446744073709551612,"
                                "18446744073709551616]}"),
                          "abcd"),
                 {"\"w\"", "data_offsets"});
}

TEST(Safetensors, ByteCountMismatch) {
  expect_refused(
      raw_file(entry("w", "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}"), "abcdefgh"),
      {"\"w\"", "needs 8"});
}

TEST(Safetensors, OverlappingTensors) {
  std::string header =
      "{\"first\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"second\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
  expect_refused(raw_file(header, std::string(12, 'x')), {"first", "second", "overlaps"});
  // Containment, listed in the other order, with a gap-free neighbour in between.
  std::string nested =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[10],\"data_offsets\":[0,10]},"
      "\"c\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]}}";
  expect_refused(raw_file(nested, std::string(12, 'x')), {"\"a\"", "\"b\"", "overlaps"});
}

TEST(Safetensors, EmptyAndSevenByteFiles) {
  expect_refused("", {"0 bytes"});
  expect_refused("1234567", {"7 bytes"});
  expect_refused(u64_le(0), {"not valid JSON"});  // 8 bytes: an empty header is not JSON
}

TEST(Safetensors, NotARegularFileOrAbsent) {
  TempDir dir;
  auto f = SafetensorsFile::open(dir.path());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.message().find(dir.path()), std::string::npos) << f.message();
  auto g = SafetensorsFile::open(dir.file("absent.safetensors"));
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.message().find("absent.safetensors"), std::string::npos) << g.message();
}

// A FIFO named like a weight file would block open() until a writer comes: refused at once,
// whichever file it stands for (single file, index, shard); so is a directory or a device.
TEST(Safetensors, FifoDeviceOrDirectoryRefusedWithoutHanging) {
  {
    TempDir dir;
    ASSERT_EQ(::mkfifo(dir.file("model.safetensors").c_str(), 0600), 0);
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.message().find("is a FIFO, not a regular file"), std::string::npos)
        << w.message();
  }
  {
    TempDir dir;
    ASSERT_EQ(::mkfifo(dir.file("model.safetensors.index.json").c_str(), 0600), 0);
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.message().find("FIFO"), std::string::npos) << w.message();
  }
  {
    TempDir dir;
    ASSERT_EQ(::mkfifo(dir.file("shard.safetensors").c_str(), 0600), 0);
    json index = {{"weight_map", {{"a.bf16", "shard.safetensors"}}}};
    write_file(dir.file("model.safetensors.index.json"), index.dump());
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.message().find("FIFO"), std::string::npos) << w.message();
    EXPECT_NE(w.message().find("a.bf16"), std::string::npos) << w.message();
  }
  {
    TempDir dir;
    std::filesystem::create_directory(dir.file("model.safetensors"));
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.message().find("is a directory"), std::string::npos) << w.message();
  }
  {
    TempDir dir;
    std::filesystem::create_symlink("/dev/zero", dir.file("model.safetensors"));
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.message().find("character device"), std::string::npos) << w.message();
  }
}

// NaN or infinite weights are refused, naming the tensor and the element.
TEST(Safetensors, NonFiniteWeightsRefused) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    Spec spec;
    std::vector<int64_t> shape;
  };
  const std::vector<Case> cases = {
      {{"w.f32", "F32", {3}, bytes_of(std::vector<float>{1.f, nan, 2.f})}, {3}},
      {{"w.f32", "F32", {2}, bytes_of(std::vector<float>{-inf, 2.f})}, {2}},
      {{"w.bf16", "BF16", {2}, bytes_of(std::vector<uint16_t>{0x3f80, 0x7f80})}, {2}},
      {{"w.f16", "F16", {2}, bytes_of(std::vector<uint16_t>{0x3c00, 0x7e00})}, {2}},
  };
  for (const auto& c : cases) {
    TempDir dir;
    write_file(dir.file("model.safetensors"), build({c.spec}));
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_TRUE(w.ok()) << w.message();
    auto r = w.value().get(c.spec.name, c.shape);
    ASSERT_FALSE(r.ok()) << c.spec.name;
    EXPECT_NE(r.message().find("\"" + c.spec.name + "\" holds a NaN or infinite value"),
              std::string::npos)
        << r.message();
  }
  // Finite extremes (65504 in F16, 3e38 in F32) are fine.
  TempDir dir;
  write_file(dir.file("model.safetensors"), build(sample_specs()));
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(w.value().get("b.f16", {4}).ok());
  EXPECT_TRUE(w.value().get("c.f32", {2, 2}).ok());
}

// F16 bits of a float in F16's normal range (truncated mantissa); 0 below it (2^-14).
uint16_t f16_bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
  if (e <= 0) return sign;
  return static_cast<uint16_t>(sign | (e << 10) | ((u >> 13) & 0x3ff));
}

// A weight matrix as training leaves it: normal, sigma 0.02 (LLaMA's initializer_range).
std::vector<float> weight_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 0.02f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// One 16-bit type's bytes under the other's name pass every size check; the magnitudes they
// read as give them away (safetensors.cpp: misread_dtype), for whole tensors and for windows.
TEST(Safetensors, HalfPrecisionBytesUnderTheOtherNameRefused) {
  const auto values = weight_values(96 * 64, 7);
  std::vector<uint16_t> as_f16, as_bf16;
  for (float x : values) {
    as_f16.push_back(f16_bits(x));
    as_bf16.push_back(bf16_bits(x));
  }
  struct Case {
    std::string header_dtype;
    std::vector<uint16_t> bits;
    std::string bytes_are;  // "" when the label is right
  };
  const std::vector<Case> cases = {{"F16", as_bf16, "BF16"},
                                   {"BF16", as_f16, "F16"},
                                   {"F16", as_f16, ""},
                                   {"BF16", as_bf16, ""}};
  for (const auto& c : cases) {
    TempDir dir;
    write_file(dir.file("model.safetensors"),
               build({{"w", c.header_dtype, {96, 64}, bytes_of(c.bits)},
                      // A norm vector near 1 is not judged: its magnitudes are its design.
                      {"norm",
                       c.header_dtype,
                       {64},
                       bytes_of(std::vector<uint16_t>(c.bits.begin(), c.bits.begin() + 64))}}));
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_TRUE(w.ok()) << w.message();
    EXPECT_TRUE(w.value().get("norm", {64}).ok());
    auto whole = w.value().get("w", {96, 64});
    std::vector<char> buffer;
    auto window = w.value().read("w", {96, 64}, {48, 48, 0, 32}, buffer);
    if (c.bytes_are.empty()) {
      EXPECT_TRUE(whole.ok()) << whole.message();
      EXPECT_TRUE(window.ok()) << window.message();
      continue;
    }
    for (const std::string& msg : {whole.message(), window.message()}) {
      ASSERT_FALSE(msg.empty()) << c.header_dtype << " label over " << c.bytes_are << " bytes";
      for (const std::string& part :
           {dir.file("model.safetensors"), std::string("tensor \"w\""),
            "declared " + c.header_dtype, "its bytes are " + c.bytes_are}) {
        EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' in: " << msg;
      }
    }
    ::setenv("BURST_SKIP_WEIGHT_CHECK", "1", 1);
    EXPECT_TRUE(w.value().get("w", {96, 64}).ok());
    ::unsetenv("BURST_SKIP_WEIGHT_CHECK");
  }
  // Too few non-zero values to judge a law: a small matrix of ones loads as F16.
  TempDir dir;
  write_file(dir.file("model.safetensors"),
             build({{"small", "F16", {8, 8}, bytes_of(std::vector<uint16_t>(64, 0x3C00))}}));
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(w.value().get("small", {8, 8}).ok());
}

// Header entries by name, without reading data: what a loader checks its weight list against.
TEST(Safetensors, NamesAndFindReadNoData) {
  TempDir dir;
  write_file(dir.file("model.safetensors"), build(sample_specs()));
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(w.value().names(), (std::vector<std::string>{"a.bf16", "b.f16", "c.f32", "d.step"}));
  const TensorView* v = w.value().find("a.bf16");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->file_dtype, "BF16");
  EXPECT_EQ(v->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w.value().find("absent"), nullptr);
  EXPECT_EQ(w.value().bytes_read(), 0);
}

// Two shards plus an index, as transformers' save_pretrained writes them.
void write_sharded(const TempDir& dir, const json& weight_map) {
  auto specs = sample_specs();
  write_file(dir.file("model-00001-of-00002.safetensors"), build({specs[0], specs[1]}));
  write_file(dir.file("model-00002-of-00002.safetensors"), build({specs[2]}));
  json index = {{"metadata", {{"total_size", 36}}}, {"weight_map", weight_map}};
  write_file(dir.file("model.safetensors.index.json"), index.dump(2));
}

TEST(Safetensors, ShardedDirectoryReadsBack) {
  TempDir dir;
  write_sharded(dir, {{"a.bf16", "model-00001-of-00002.safetensors"},
                      {"b.f16", "model-00001-of-00002.safetensors"},
                      {"c.f32", "model-00002-of-00002.safetensors"}});
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_TRUE(w.ok()) << w.message();
  auto b = w.value().get("b.f16", {4});
  ASSERT_TRUE(b.ok()) << b.message();
  EXPECT_EQ(b.value().file, dir.file("model-00001-of-00002.safetensors"));
  std::vector<uint16_t> f16(4);
  std::memcpy(f16.data(), b.value().data, 8);
  EXPECT_EQ(f16, kF16Bits);
  auto c = w.value().get("c.f32", {2, 2});
  ASSERT_TRUE(c.ok()) << c.message();
  EXPECT_EQ(c.value().file, dir.file("model-00002-of-00002.safetensors"));
  std::vector<float> f32(4);
  std::memcpy(f32.data(), c.value().data, 16);
  EXPECT_EQ(f32, kF32Values);
  auto missing = w.value().get("d.step", {1});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.message(), "missing tensor d.step (in " + dir.path() + ")");
}

TEST(Safetensors, IndexNamesMissingShard) {
  TempDir dir;
  write_sharded(dir, {{"a.bf16", "model-00001-of-00002.safetensors"},
                      {"c.f32", "model-00003-of-00002.safetensors"}});
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("model-00003-of-00002.safetensors"), std::string::npos) << w.message();
  EXPECT_NE(w.message().find("c.f32"), std::string::npos) << w.message();
}

TEST(Safetensors, IndexWithEscapingShardName) {
  for (const std::string shard : {"../x", "..", "sub/model.safetensors", "", "/etc/passwd"}) {
    TempDir dir;
    write_sharded(dir, {{"a.bf16", "model-00001-of-00002.safetensors"}, {"c.f32", shard}});
    auto w = WeightFiles::open_dir(dir.path());
    ASSERT_FALSE(w.ok()) << shard;
    EXPECT_NE(w.message().find("model.safetensors.index.json"), std::string::npos) << w.message();
    EXPECT_NE(w.message().find("\"" + shard + "\""), std::string::npos) << w.message();
    EXPECT_NE(w.message().find("c.f32"), std::string::npos) << w.message();
  }
}

TEST(Safetensors, IndexListsTensorAbsentFromShard) {
  TempDir dir;
  write_sharded(dir, {{"a.bf16", "model-00001-of-00002.safetensors"},
                      {"c.f32", "model-00001-of-00002.safetensors"}});
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("c.f32"), std::string::npos) << w.message();
  EXPECT_NE(w.message().find("model-00001-of-00002.safetensors"), std::string::npos) << w.message();
}

TEST(Safetensors, MalformedIndex) {
  TempDir dir;
  write_file(dir.file("model.safetensors.index.json"), "{\"weight_map\": [1]}");
  auto w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("model.safetensors.index.json"), std::string::npos) << w.message();
  write_file(dir.file("model.safetensors.index.json"), "{\"weight_map\": {\"a\": 3}}");
  w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("\"a\""), std::string::npos) << w.message();
  write_file(dir.file("model.safetensors.index.json"), "not json");
  w = WeightFiles::open_dir(dir.path());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("not valid JSON"), std::string::npos) << w.message();
}

}  // namespace
}  // namespace burst::models
