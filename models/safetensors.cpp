// Safetensors reading: mmap a file, validate every byte of its header before any tensor is
// handed out, and resolve tensor names across the shards of a model directory.
//
// Contract (see safetensors.h): the file is untrusted. A file is
//   [u64 little-endian N][N bytes of JSON header][data section]
// and open() fails, naming the file and (where there is one) the tensor, unless: the file has
// at least 8 bytes; 8 + N <= file size and N <= 100 MiB; the header is a JSON object whose
// entries are "__metadata__" (an object of strings) or objects with exactly "dtype" (a known
// dtype string), "shape" (an array of non-negative integers) and "data_offsets" (two
// non-negative integers begin <= end <= data size); end - begin == numel * dtype size, computed
// without overflow; and no two non-empty tensors share a byte. Nothing throws out of this file.
#include "models/safetensors.h"

#include "models/config.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>
#include <utility>

namespace burst::models {
namespace {

using nlohmann::json;

// Real headers are at most a few MiB (70B: ~800 tensors, ~100 KiB); the cap bounds the JSON
// parser's memory on a hostile file. 100 MiB is also the limit of the reference implementation.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr std::streamoff kMaxIndexBytes = 64 << 20;
constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

struct DTypeInfo {
  const char* name;
  int64_t size;
  bool loadable;  // the engine takes it (F32, F16, BF16)
  engine::DType dtype;
};

// Every dtype a checkpoint may carry next to the weights, so that its entry can be validated
// (size check, overlap check) even though the engine never loads it.
constexpr DTypeInfo kDTypes[] = {
    {"F64", 8, false, engine::DType::kF32}, {"F32", 4, true, engine::DType::kF32},
    {"F16", 2, true, engine::DType::kF16},  {"BF16", 2, true, engine::DType::kBF16},
    {"I64", 8, false, engine::DType::kF32}, {"I32", 4, false, engine::DType::kF32},
    {"I16", 2, false, engine::DType::kF32}, {"I8", 1, false, engine::DType::kF32},
    {"U8", 1, false, engine::DType::kF32},  {"BOOL", 1, false, engine::DType::kF32},
};

const DTypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A value for an error message. Containers are named, not dumped: dump() recurses, and a
// hostile header nests arrays deep enough to overflow the stack.
std::string brief(const json& v) {
  if (v.is_structured()) return std::string("a JSON ") + v.type_name();
  std::string s = v.dump();
  return s.size() > 64 ? s.substr(0, 64) + "..." : s;
}

std::string brief_offsets(const json& v) {
  if (!v.is_array() || v.size() != 2) return brief(v);
  // Appended piece by piece: `"[" + std::string&&` trips a GCC 12 -Wrestrict false positive.
  std::string s = "[";
  s += brief(v[0]);
  s += ", ";
  s += brief(v[1]);
  s += "]";
  return s;
}

// True, with `out` set, when `v` is a JSON integer in [0, INT64_MAX].
bool non_negative_int(const json& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    out = v.get<int64_t>();
    return out >= 0;
  }
  return false;
}

// Parses one tensor entry; `data_size` is the length of the data section; `data` its start.
Status parse_entry(const std::string& path, const std::string& name, const json& entry,
                   const unsigned char* data, uint64_t data_size, TensorView& view) {
  auto fail = [&](const std::string& what) {
    return Status::error(path + ": tensor \"" + name + "\": " + what);
  };
  if (!entry.is_object()) return fail(std::string("entry is a ") + entry.type_name());
  for (const auto& [key, _] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return fail("unexpected key \"" + key + "\"");
    }
  }
  auto dt = entry.find("dtype");
  auto sh = entry.find("shape");
  auto off = entry.find("data_offsets");
  if (dt == entry.end()) return fail("missing \"dtype\"");
  if (sh == entry.end()) return fail("missing \"shape\"");
  if (off == entry.end()) return fail("missing \"data_offsets\"");

  if (!dt->is_string()) return fail("\"dtype\" is not a string");
  const std::string& dtype_name = dt->get_ref<const std::string&>();
  const DTypeInfo* info = find_dtype(dtype_name);
  if (info == nullptr) return fail("unknown dtype \"" + dtype_name + "\"");

  if (!sh->is_array()) return fail("\"shape\" is not an array");
  std::vector<int64_t> shape;
  // numel and bytes in uint64 with explicit overflow checks: a hostile shape such as
  // [2^40, 2^40] must not wrap around to a small size that passes the offsets check.
  uint64_t numel = 1;
  for (const auto& d : *sh) {
    int64_t dim = 0;
    if (!non_negative_int(d, dim)) {
      return fail("\"shape\" entry " + brief(d) + " is not a non-negative integer");
    }
    shape.push_back(dim);
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) {
      return fail("shape " + shape_text(shape) + "... overflows the element count");
    }
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(info->size), &nbytes) ||
      nbytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return fail("shape " + shape_text(shape) + " overflows the byte count");
  }

  if (!off->is_array() || off->size() != 2) {
    return fail("\"data_offsets\" is not an array of two integers");
  }
  int64_t begin = 0;
  int64_t end = 0;
  if (!non_negative_int((*off)[0], begin) || !non_negative_int((*off)[1], end)) {
    return fail("\"data_offsets\" " + brief_offsets(*off) + " are not non-negative integers");
  }
  if (begin > end) return fail("\"data_offsets\" " + brief_offsets(*off) + " are reversed");
  if (static_cast<uint64_t>(end) > data_size) {
    return fail("\"data_offsets\" " + brief_offsets(*off) + " run past the data section (" +
                std::to_string(data_size) + " bytes)");
  }
  if (static_cast<uint64_t>(end - begin) != nbytes) {
    return fail("\"data_offsets\" " + brief_offsets(*off) + " hold " + std::to_string(end - begin) +
                " bytes, but " + dtype_name + " " + shape_text(shape) + " needs " +
                std::to_string(nbytes));
  }

  view.name = name;
  view.file = path;
  view.dtype = info->dtype;
  view.file_dtype = dtype_name;
  view.shape = std::move(shape);
  view.data = data + begin;
  view.nbytes = end - begin;
  return Status();
}

Status check_overlaps(const std::string& path, const std::map<std::string, TensorView>& tensors,
                      const unsigned char* data) {
  struct Span {
    int64_t begin;
    int64_t end;
    const std::string* name;
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const auto& [name, view] : tensors) {
    // An empty tensor owns no byte, so it cannot overlap anything (and may share its offset).
    if (view.nbytes == 0) continue;
    int64_t begin = static_cast<const unsigned char*>(view.data) - data;
    spans.push_back({begin, begin + view.nbytes, &name});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  // Sorted by begin, an overlap always shows between neighbours of the running maximum end.
  const Span* last = nullptr;
  for (const auto& s : spans) {
    if (last != nullptr && s.begin < last->end) {
      return Status::error(path + ": tensor \"" + *s.name + "\" [" + std::to_string(s.begin) +
                           ", " + std::to_string(s.end) + ") overlaps tensor \"" + *last->name +
                           "\" [" + std::to_string(last->begin) + ", " + std::to_string(last->end) +
                           ")");
    }
    if (last == nullptr || s.end > last->end) last = &s;
  }
  return Status();
}

// Reads a small text file whole (the index); bounded so a hostile path cannot exhaust memory.
Result<std::string> read_small_file(const std::string& path, std::streamoff limit) {
  return read_regular_file(path, static_cast<int64_t>(limit));
}

// The first non-finite value (NaN or +-Inf) of a tensor, by its bits: a float's exponent is all
// ones exactly then. Returns the element index or -1. Reads unaligned data through memcpy.
int64_t first_non_finite(const void* data, int64_t nbytes, const std::string& file_dtype) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (file_dtype == "F32") {
    const int64_t n = nbytes / 4;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t x;
      std::memcpy(&x, p + 4 * i, 4);
      if ((x & 0x7f800000u) == 0x7f800000u) return i;
    }
  } else if (file_dtype == "BF16" || file_dtype == "F16") {
    const uint16_t mask = file_dtype == "BF16" ? 0x7f80 : 0x7c00;
    const int64_t n = nbytes / 2;
    for (int64_t i = 0; i < n; ++i) {
      uint16_t x;
      std::memcpy(&x, p + 2 * i, 2);
      if ((x & mask) == mask) return i;
    }
  }
  return -1;
}

// A weight matrix's bytes read as the other 16-bit float type land in a magnitude band that no
// trained or initialised matrix fills:
//  - BF16 bytes read as F16: the F16 exponent is the top five bits of the BF16 one, so every
//    BF16 value in [2^-31, 2^32) reads as an F16 magnitude of at least 0.125. A true F16 matrix
//    with fewer than 1/64 of its non-zero entries below 0.125 needs a spread of several units
//    (for a normal law, sigma > 5); LLaMA matrices have sigma ~0.02, initialisation
//    1/sqrt(fan_in), and the odd-linear fixture has every one of its F16 entries below 0.125.
//  - F16 bytes read as BF16: an F16 value below 0.125 (exponent <= 11) gives a BF16 exponent
//    <= 95, a magnitude below 2^-31. A true BF16 matrix with half its non-zero entries below
//    2^-31 (5e-10) does not exist: kjv-tiny and the BF16 fixtures have none there.
// Only 2-D tensors are judged (norm vectors sit near 1 by design), on an even sample of at most
// kDTypeSample entries, and only with at least kDTypeMinNonZero non-zero ones in it (too few
// values say nothing about a law).
constexpr int64_t kDTypeSample = 4096;
constexpr int64_t kDTypeMinNonZero = 256;

// The other dtype's name when the bytes of a 16-bit tensor are that dtype's, else "".
std::string misread_dtype(const void* data, int64_t nbytes, const std::string& file_dtype,
                          int64_t& low, int64_t& nonzero) {
  const bool f16 = file_dtype == "F16";
  if (!f16 && file_dtype != "BF16") return "";
  const auto* p = static_cast<const unsigned char*>(data);
  const int64_t n = nbytes / 2;
  const int64_t step = std::max<int64_t>(1, n / kDTypeSample);
  low = 0;
  nonzero = 0;
  for (int64_t i = 0; i < n; i += step) {
    uint16_t x;
    std::memcpy(&x, p + 2 * i, 2);
    if ((x & 0x7fff) == 0) continue;
    ++nonzero;
    // F16: exponent field below 12 is |x| < 2^-3; BF16: below 96 is |x| < 2^-31.
    const bool below = f16 ? (x & 0x7c00) < (12 << 10) : (x & 0x7f80) < (96 << 7);
    if (below) ++low;
  }
  if (nonzero < kDTypeMinNonZero) return "";
  if (f16 && low * 64 < nonzero) return "BF16";
  if (!f16 && low * 2 > nonzero) return "F16";
  return "";
}

bool check_weights_enabled() {
  const char* v = std::getenv("BURST_SKIP_WEIGHT_CHECK");
  return v == nullptr || *v == '\0' || std::string(v) == "0";
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  try {
    std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
    file->path_ = path;

    auto opened = open_regular_file(path);
    if (!opened.ok()) return opened.status();
    const int fd = opened.value();
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return Status::error("cannot stat " + path + ": " + errno_text(err));
    }
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8) {
      ::close(fd);
      return Status::error(path + ": file is " + std::to_string(file_size) +
                           " bytes, too short for the 8-byte header length");
    }
    void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_err = errno;
    ::close(fd);  // the mapping keeps the file alive
    if (map == MAP_FAILED) return Status::error("cannot mmap " + path + ": " + errno_text(map_err));
    // Owned from here on: every early return below unmaps through the destructor.
    file->map_ = map;
    file->map_size_ = file_size;
    const auto* bytes = static_cast<const unsigned char*>(map);

    // The length is little-endian by the format, whatever the host is.
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
    if (header_len > kMaxHeaderBytes) {
      return Status::error(path + ": header length " + std::to_string(header_len) +
                           " exceeds the 100 MiB limit");
    }
    // Written as a subtraction: 8 + header_len cannot wrap, but keep the check obviously safe.
    if (header_len > file_size - 8) {
      return Status::error(path + ": header length " + std::to_string(header_len) +
                           " runs past the end of the file (" + std::to_string(file_size) +
                           " bytes)");
    }
    const auto* header = reinterpret_cast<const char*>(bytes + 8);
    json root = json::parse(header, header + header_len, /*cb=*/nullptr,
                            /*allow_exceptions=*/false);
    if (root.is_discarded()) return Status::error(path + ": header is not valid JSON");
    if (!root.is_object()) {
      return Status::error(path + ": header is a JSON " + root.type_name() + ", not an object");
    }

    const unsigned char* data = bytes + 8 + header_len;
    const uint64_t data_size = file_size - 8 - header_len;
    for (const auto& [name, entry] : root.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) return Status::error(path + ": \"__metadata__\" is not an object");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) {
            return Status::error(path + ": \"__metadata__\" value \"" + key + "\" is not a string");
          }
        }
        continue;
      }
      TensorView view;
      BURST_RETURN_IF_ERROR(parse_entry(path, name, entry, data, data_size, view));
      file->tensors_.emplace(name, std::move(view));
    }
    BURST_RETURN_IF_ERROR(check_overlaps(path, file->tensors_, data));
    return file;
  } catch (const std::exception& e) {
    return Status::error(path + ": " + e.what());
  } catch (...) {
    return Status::error(path + ": unknown error while opening");
  }
}

Result<WeightFiles> WeightFiles::open_dir(const std::string& model_dir) {
  try {
    WeightFiles w;
    w.dir_ = model_dir;
    const std::string index_path = model_dir + "/" + kIndexName;
    const std::string single_path = model_dir + "/" + kSingleName;

    if (!exists(index_path)) {
      if (!exists(single_path)) {
        return Status::error("no " + std::string(kSingleName) + " or " + kIndexName + " in " +
                             model_dir);
      }
      auto file = SafetensorsFile::open(single_path);
      if (!file.ok()) return file.status();
      w.files_.push_back(std::shared_ptr<SafetensorsFile>(file.take()));
      // Node-based map: the views stay put for as long as the file object lives.
      for (const auto& [name, view] : w.files_.back()->tensors()) w.index_[name] = &view;
      return w;
    }

    auto text = read_small_file(index_path, kMaxIndexBytes);
    if (!text.ok()) return text.status();
    json root = json::parse(text.value(), /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) return Status::error(index_path + ": not valid JSON");
    if (!root.is_object()) return Status::error(index_path + ": not a JSON object");
    auto wm = root.find("weight_map");
    if (wm == root.end()) return Status::error(index_path + ": missing \"weight_map\"");
    if (!wm->is_object()) return Status::error(index_path + ": \"weight_map\" is not an object");

    std::map<std::string, SafetensorsFile*> shards;  // each shard opened once
    for (const auto& [name, shard_json] : wm->items()) {
      if (!shard_json.is_string()) {
        return Status::error(index_path + ": shard of tensor \"" + name + "\" is not a string");
      }
      const std::string& shard = shard_json.get_ref<const std::string&>();
      // Shard names come from the untrusted index: only plain names inside the model directory,
      // so an index cannot make us map "../../etc/shadow" or a path cut short by a NUL.
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
          shard.find('\0') != std::string::npos) {
        return Status::error(index_path + ": shard \"" + shard + "\" of tensor \"" + name +
                             "\" is not a plain file name");
      }
      auto it = shards.find(shard);
      if (it == shards.end()) {
        auto file = SafetensorsFile::open(model_dir + "/" + shard);
        if (!file.ok()) {
          return Status::error(file.message() + " (shard of tensor \"" + name + "\" in " +
                               index_path + ")");
        }
        w.files_.push_back(std::shared_ptr<SafetensorsFile>(file.take()));
        it = shards.emplace(shard, w.files_.back().get()).first;
      }
      const auto& tensors = it->second->tensors();
      auto t = tensors.find(name);
      if (t == tensors.end()) {
        return Status::error(index_path + " lists tensor \"" + name + "\" in " +
                             it->second->path() + ", but that file does not hold it");
      }
      w.index_[name] = &t->second;
    }
    return w;
  } catch (const std::exception& e) {
    return Status::error(model_dir + ": " + e.what());
  } catch (...) {
    return Status::error(model_dir + ": unknown error while opening weights");
  }
}

// A dtype the engine loads and the shape the model expects.
Status WeightFiles::check_header(const TensorView& v, const std::vector<int64_t>& shape) {
  if (v.file_dtype != "F32" && v.file_dtype != "F16" && v.file_dtype != "BF16") {
    return Status::error(v.file + ": tensor \"" + v.name + "\" has dtype " + v.file_dtype +
                         "; the engine loads F32, F16 or BF16");
  }
  if (v.shape != shape) {
    return Status::error(v.file + ": tensor \"" + v.name + "\" has shape " +
                         shape_text(v.shape) + ", expected " + shape_text(shape));
  }
  return {};
}

Result<TensorView> WeightFiles::get(const std::string& name,
                                    const std::vector<int64_t>& shape) const {
  auto it = index_.find(name);
  if (it == index_.end()) return Status::error("missing tensor " + name + " (in " + dir_ + ")");
  const TensorView& v = *it->second;
  BURST_RETURN_IF_ERROR(check_header(v, shape));
  BURST_RETURN_IF_ERROR(check_finite(v, v.data, v.nbytes));
  BURST_RETURN_IF_ERROR(check_dtype_bytes(v, v.data, v.nbytes));
  return v;
}

// NaN/Inf weights would only show as garbage tokens (token 0 for every step): refuse them,
// naming the tensor. One pass over the bits; $BURST_SKIP_WEIGHT_CHECK=1 skips it.
Status WeightFiles::check_finite(const TensorView& v, const void* data, int64_t nbytes) {
  if (!check_weights_enabled()) return {};
  if (const int64_t bad = first_non_finite(data, nbytes, v.file_dtype); bad >= 0) {
    return Status::error(v.file + ": tensor \"" + v.name + "\" holds a NaN or infinite value "
                         "at element " + std::to_string(bad) +
                         (data == v.data ? "" : " of the slice read") +
                         "; the weights are corrupt (set BURST_SKIP_WEIGHT_CHECK=1 to load them "
                         "anyway)");
  }
  return {};
}

Status WeightFiles::check_dtype_bytes(const TensorView& v, const void* data, int64_t nbytes) {
  if (!check_weights_enabled() || v.shape.size() != 2) return {};
  int64_t low = 0, nonzero = 0;
  const std::string other = misread_dtype(data, nbytes, v.file_dtype, low, nonzero);
  if (other.empty()) return {};
  const std::string band = v.file_dtype == "F16" ? "below 0.125" : "below 2^-31";
  return Status::error(
      v.file + ": tensor \"" + v.name + "\" is declared " + v.file_dtype + " in the header, but " +
      std::to_string(low) + " of " + std::to_string(nonzero) + " sampled non-zero values are " +
      band + ": its bytes are " + other + " (a header that names the wrong 16-bit type; set " +
      "BURST_SKIP_WEIGHT_CHECK=1 to load it anyway)");
}

Result<WeightFiles::Slice> WeightFiles::read(const std::string& name,
                                             const std::vector<int64_t>& shape,
                                             const Window& w, std::vector<char>& buffer) const {
  auto it = index_.find(name);
  if (it == index_.end()) return Status::error("missing tensor " + name + " (in " + dir_ + ")");
  const TensorView& v = *it->second;
  const int64_t total_rows = v.shape.empty() ? 1 : v.shape[0];
  const int64_t total_cols = v.shape.size() == 2 ? v.shape[1] : 1;
  const int64_t rows = w.rows < 0 ? total_rows - w.row0 : w.rows;
  const int64_t cols = w.cols < 0 ? total_cols - w.col0 : w.cols;
  if (w.row0 < 0 || w.col0 < 0 || rows < 0 || cols < 0 || w.row0 + rows > total_rows ||
      w.col0 + cols > total_cols || (v.shape.size() != 2 && (w.col0 != 0 || cols != 1))) {
    return Status::error(v.file + ": tensor \"" + name + "\": rows [" + std::to_string(w.row0) +
                         ", +" + std::to_string(rows) + ") x columns [" + std::to_string(w.col0) +
                         ", +" + std::to_string(cols) + ") lie outside its shape " +
                         shape_text(v.shape));
  }
  if (rows == total_rows && cols == total_cols) {
    auto whole = get(name, shape);
    if (!whole.ok()) return whole.status();
    bytes_read_ += whole.value().nbytes;
    return Slice{whole.value().data, whole.value().dtype, whole.value().nbytes};
  }
  BURST_RETURN_IF_ERROR(check_header(v, shape));  // as get() does, without touching the data
  const int64_t elem = v.nbytes / std::max<int64_t>(1, total_rows * total_cols);
  const int64_t row_bytes = cols * elem;
  buffer.resize(static_cast<size_t>(rows * row_bytes));
  const auto* src = static_cast<const char*>(v.data);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(buffer.data() + r * row_bytes,
                src + ((w.row0 + r) * total_cols + w.col0) * elem, static_cast<size_t>(row_bytes));
  }
  const auto nbytes = static_cast<int64_t>(buffer.size());
  BURST_RETURN_IF_ERROR(check_finite(v, buffer.data(), nbytes));
  BURST_RETURN_IF_ERROR(check_dtype_bytes(v, buffer.data(), nbytes));
  bytes_read_ += nbytes;
  return Slice{buffer.data(), v.dtype, nbytes};
}

bool WeightFiles::contains(const std::string& name) const { return index_.count(name) != 0; }

const TensorView* WeightFiles::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

std::vector<std::string> WeightFiles::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, _] : index_) out.push_back(name);
  return out;
}

}  // namespace burst::models
