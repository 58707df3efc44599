// The parts of Communicator shared by every implementation, and the one-rank communicator.
#include "engine/communicator.h"

#include <cstring>
#include <vector>

#include "engine/dtype_convert.h"
#include "kernels/ops.h"

namespace burst::engine {

namespace {

// Completes when both halves of an exchange have.
class PairHandle final : public CommHandle {
 public:
  PairHandle(std::unique_ptr<CommHandle> a, std::unique_ptr<CommHandle> b)
      : a_(std::move(a)), b_(std::move(b)) {}
  Status wait() override {
    Status first = a_->wait();
    Status second = b_->wait();  // always wait on both: the buffers stay in use until then
    return first.ok() ? second : first;
  }

 private:
  std::unique_ptr<CommHandle> a_, b_;
};

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Result<std::unique_ptr<CommHandle>> isend(const void*, size_t, int peer, int) override {
    return Status::error("local communicator: a send to rank " + std::to_string(peer) +
                         " in a group of one");
  }
  Result<std::unique_ptr<CommHandle>> irecv(void*, size_t, int peer, int) override {
    return Status::error("local communicator: a receive from rank " + std::to_string(peer) +
                         " in a group of one");
  }
  Status all_gather(const void* in, void* out, size_t bytes) override {
    if (in != out && bytes > 0) std::memmove(out, in, bytes);
    return {};
  }
  Status broadcast(void*, size_t, int root) override {
    if (root != 0) return Status::error("local communicator: broadcast from rank " +
                                        std::to_string(root) + " in a group of one");
    return {};
  }
  Status all_reduce_sum(void*, int64_t, DType) override { return {}; }
  Status barrier() override { return {}; }
  std::string transport() const override { return "local (one rank)"; }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

Result<std::unique_ptr<CommHandle>> Communicator::isendrecv(const void* send, int send_peer,
                                                            void* recv, int recv_peer,
                                                            size_t bytes, int tag) {
  auto s = isend(send, bytes, send_peer, tag);
  if (!s.ok()) return s.status();
  auto r = irecv(recv, bytes, recv_peer, tag);
  if (!r.ok()) {
    s.value()->wait();  // do not abandon a posted send
    return r.status();
  }
  return std::unique_ptr<CommHandle>(new PairHandle(s.take(), r.take()));
}

namespace {

// Element i of host memory of dtype (fp32 or bf16) as fp32, and back (one rounding).
float load_f32(const void* base, int64_t i, DType dtype) {
  float v;
  if (dtype == DType::kF32) {
    std::memcpy(&v, static_cast<const char*>(base) + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(base) + 2 * i, 2);
  return bf16_to_f32(h);
}

void store_f32(void* base, int64_t i, float v, DType dtype) {
  if (dtype == DType::kF32) {
    std::memcpy(static_cast<char*>(base) + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = f32_to_bf16(v);
  std::memcpy(static_cast<char*>(base) + 2 * i, &h, 2);
}

}  // namespace

Status Communicator::all_reduce_add(void* partial, void* x, int64_t count, DType dtype) {
  BURST_RETURN_IF_ERROR(all_reduce_sum(partial, count, dtype));
  if (dtype == DType::kF16) return Status::error("all_reduce_add: fp16 is not supported");
  for (int64_t i = 0; i < count; ++i) {
    store_f32(x, i, load_f32(x, i, dtype) + load_f32(partial, i, dtype), dtype);
  }
  return {};
}

Result<bool> Communicator::all_reduce_add_norm(void* partial, void* x, DType dtype,
                                               const NormAfter& norm) {
  if (dtype != DType::kF32 || norm.rows < 0 || norm.dim <= 0) return false;
  BURST_RETURN_IF_ERROR(all_reduce_add(partial, x, norm.rows * norm.dim, dtype));
  kernels::rms_norm_cpu(static_cast<const float*>(x), static_cast<const float*>(norm.w),
                        static_cast<float*>(norm.h), norm.rows, norm.dim, norm.eps);
  return true;
}

Status Communicator::all_reduce_sum(void* data, int64_t count, DType dtype) {
  if (count < 0) return Status::error("all_reduce_sum: negative count");
  const int world = world_size();
  if (world == 1 || count == 0) return {};
  if (dtype == DType::kF16) return Status::error("all_reduce_sum: fp16 is not supported");
  const auto bytes = static_cast<size_t>(count * dtype_size(dtype));
  std::vector<char> all(bytes * static_cast<size_t>(world));
  BURST_RETURN_IF_ERROR(all_gather(data, all.data(), bytes));
  // Rank order, fp32 sums, one rounding: every rank computes the same bits.
  std::vector<float> sum(static_cast<size_t>(count), 0.f);
  for (int r = 0; r < world; ++r) {
    const char* block = all.data() + bytes * static_cast<size_t>(r);
    for (int64_t i = 0; i < count; ++i) sum[static_cast<size_t>(i)] += load_f32(block, i, dtype);
  }
  for (int64_t i = 0; i < count; ++i) store_f32(data, i, sum[static_cast<size_t>(i)], dtype);
  return {};
}

}  // namespace burst::engine
