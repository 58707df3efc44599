// The parts of Communicator shared by every implementation, and the one-rank communicator.
#include "engine/communicator.h"

#include <cstring>

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

}  // namespace burst::engine
