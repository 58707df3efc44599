// Tensor helpers: row views and descriptions for error messages.
#include "engine/tensor.h"

#include <sstream>

namespace burst::engine {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kFP8E4M3: return "fp8e4m3";
    case DType::kI32: return "i32";
  }
  return "?";
}

Tensor Tensor::unallocated(std::vector<int64_t> shape, DType dtype, DeviceKind device) {
  Tensor t;
  t.dtype = dtype;
  t.device = device;
  t.shape = std::move(shape);
  return t;
}

std::string Tensor::shape_problem() const {
  for (int64_t d : shape) {
    if (d < 0) return "negative dimension in " + describe();
  }
  return "";
}

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  Tensor v = *this;
  const int64_t row_elems = shape.empty() || shape[0] == 0 ? 0 : numel() / shape[0];
  v.data = static_cast<char*>(data) + begin * row_elems * dtype_size(dtype);
  v.shape[0] = count;
  return v;
}

std::string Tensor::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? "," : "") << shape[i];
  os << "]";
  return os.str();
}

}  // namespace burst::engine
