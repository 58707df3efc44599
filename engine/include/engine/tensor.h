// A tensor is a typed, shaped view of memory that a Backend allocated (host or device). Shapes
// are row-major; the model uses 1-D (vectors), 2-D ([tokens, features]) and 3-D views.
#pragma once

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace burst::engine {

using kernels::DType;

inline int64_t dtype_size(DType t) {
  return t == DType::kF32 || t == DType::kI32 ? 4 : t == DType::kFP8E4M3 ? 1 : 2;
}
const char* dtype_name(DType t);

enum class DeviceKind { kCpu, kCuda };

struct Tensor {
  std::shared_ptr<void> storage;  // keeps the allocation alive; views share it
  void* data = nullptr;
  DType dtype = DType::kF32;
  DeviceKind device = DeviceKind::kCpu;
  std::vector<int64_t> shape;

  // A tensor of this shape that holds no memory yet (what a Backend's alloc starts from).
  static Tensor unallocated(std::vector<int64_t> shape, DType dtype, DeviceKind device);
  int64_t numel() const {
    return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  }
  int64_t bytes() const { return numel() * dtype_size(dtype); }
  int64_t dim(int i) const { return shape.at(static_cast<size_t>(i)); }
  bool empty() const { return data == nullptr; }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  // Element i of the storage, whatever the dtype, as a T*.
  template <typename T = void>
  T* at(int64_t i) const {
    return reinterpret_cast<T*>(static_cast<char*>(data) + i * dtype_size(dtype));
  }
  // Rows [begin, begin + count) of a tensor whose first dimension is rows.
  Tensor rows(int64_t begin, int64_t count) const;
  std::string describe() const;
  // Why this shape cannot be allocated ("negative dimension in f32[2,-1]"), or "" when it can.
  std::string shape_problem() const;
};

}  // namespace burst::engine
