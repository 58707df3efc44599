// The parts of Communicator shared by every implementation.
#include "engine/communicator.h"

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

}  // namespace

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
