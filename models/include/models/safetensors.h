// Reading Hugging Face safetensors checkpoints: one `model.safetensors`, or shards listed by
// `model.safetensors.index.json`. Files are mmapped read-only; nothing is copied until the
// engine uploads a tensor.
//
// The bytes are untrusted. open() validates everything before any tensor is handed out: the
// 8-byte little-endian header length (inside the file, <= 100 MiB), the header JSON (an object
// of objects with "dtype", "shape", "data_offsets"; optional "__metadata__" of strings), known
// dtypes, non-negative shapes without overflow, offsets with begin <= end <= data size,
// end - begin == numel * dtype size, and no two tensors overlapping. Every error names the file
// and, where there is one, the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/status.h"
#include "engine/tensor.h"

namespace burst::models {

struct TensorView {
  std::string name;
  std::string file;              // path of the file that holds it
  engine::DType dtype = engine::DType::kF32;  // meaningful only for F32, F16 and BF16
  std::string file_dtype;        // as the file spells it: "BF16", "I64", ... (all are validated)
  std::vector<int64_t> shape;
  // Inside the mmapped file. Not necessarily aligned to the element size (writers that do not
  // pad the header leave it odd), so read it with memcpy, not through a typed pointer.
  const void* data = nullptr;
  int64_t nbytes = 0;
};

class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
};

// All weight files of a model directory.
class WeightFiles {
 public:
  // DIR/model.safetensors.index.json when present (its "weight_map" names the shard of every
  // tensor; shard names must be plain file names inside DIR), else DIR/model.safetensors.
  static Result<WeightFiles> open_dir(const std::string& model_dir);

  // The tensor `name` with exactly `shape` (dtype F32, F16 or BF16), or an error naming the
  // file and the tensor: missing, wrong shape, unsupported dtype, NaN or infinite values, or
  // (a 2-D F16 / BF16 tensor) bytes of the other 16-bit type. $BURST_SKIP_WEIGHT_CHECK=1 skips
  // the two value checks.
  Result<TensorView> get(const std::string& name, const std::vector<int64_t>& shape) const;
  bool contains(const std::string& name) const;
  // The header entry of `name` (nullptr when absent): dtype and shape, without reading data.
  const TensorView* find(const std::string& name) const;
  // Every tensor name of the directory, sorted: what a loader checks its weight list against.
  std::vector<std::string> names() const;

  // A part of a tensor: rows [row0, row0 + rows) and, for a 2-D tensor, columns [col0, col0 +
  // cols) (-1: all of them). A tensor-parallel rank reads only its slices.
  struct Window {
    int64_t row0 = 0, rows = -1, col0 = 0, cols = -1;
  };
  struct Slice {
    const void* data = nullptr;  // row-major [rows, cols]; unaligned: read through memcpy
    engine::DType dtype = engine::DType::kF32;
    int64_t nbytes = 0;
  };
  // get(name, shape), then the window: the whole tensor is handed out where it lies in the
  // mapping; a part is copied into `buffer` (only its bytes are read, row by row). Refuses a
  // window outside the tensor, and (as get() does) NaN or infinite values inside the window, and
  // a 2-D F16 or BF16 tensor whose bytes are the other 16-bit type (check_dtype_bytes).
  Result<Slice> read(const std::string& name, const std::vector<int64_t>& shape,
                     const Window& window, std::vector<char>& buffer) const;
  // Bytes of tensor data handed out by read() so far (what this process read of the files).
  int64_t bytes_read() const { return bytes_read_; }

 private:
  static Status check_header(const TensorView& v, const std::vector<int64_t>& shape);
  static Status check_finite(const TensorView& v, const void* data, int64_t nbytes);
  // Refuses 2-D F16 bytes labelled BF16 and BF16 bytes labelled F16 by the magnitude band such
  // bytes land in (safetensors.cpp says why no real weight matrix does).
  static Status check_dtype_bytes(const TensorView& v, const void* data, int64_t nbytes);
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
  std::string dir_;
  mutable int64_t bytes_read_ = 0;
};

}  // namespace burst::models
