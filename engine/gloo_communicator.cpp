// GlooCommunicator: the CPU Communicator over Gloo's TCP transport (Debian libgloo, 2022-05).
//
// Contract (engine/communicator.h): isend/irecv post a transfer and return a handle whose wait()
// blocks until the buffer may be reused/read; matching is by (peer, tag) in posting order;
// all_gather/broadcast/barrier are collectives every rank calls in the same order. Every call
// returns a Status naming this rank and the peer; no Gloo exception escapes. A dead or silent
// peer turns into an error within options.timeout, never a hang.
//
// Gloo behaviour this file leans on (checked against the installed library):
// - Rendezvous is a FileStore in options.store_dir, or options.store (a RendezvousStore, e.g.
//   the coordinator's network store) behind an adapter, under a PrefixStore namespace; Gloo
//   waits for every peer's address with the context timeout, so a rank that never joins is an
//   error. The adapter turns store errors into gloo::IoException, which join() reports.
// - Unbound buffers match by (peer, slot) FIFO per pair. Point-to-point slots live in their own
//   prefix (kP2pSlotPrefix << 56), far above the slots Gloo's collectives use, so a tag can never
//   collide with a collective.
// - A receive matched with a larger send makes Gloo's loop thread throw EnforceNotMet, which
//   std::terminate()s the receiving process. The slot therefore also carries a 24-bit hash of
//   the byte count: a size mismatch then never matches and ends as a timeout error naming both
//   sides (same-size messages keep their (peer, tag) posting order).
// - A timed-out wait makes Gloo close every pair of the context ("Application timeout caused
//   pair closure"), and a peer's death closes its pair: after any error this communicator is
//   broken for good and the group must be rebuilt (the frontend restarts the worker group).
// - Gloo writes with writev(2), which raises SIGPIPE on a socket whose peer died; the default
//   action would kill the worker instead of returning an error, so joining sets SIGPIPE to
//   SIG_IGN when it still has the default action (a process-wide setting; servers want it anyway).
#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>

#include "engine/communicator.h"

namespace burst::engine {
namespace {

// Top byte of a point-to-point slot; Gloo's collectives use prefixes 0x01..0x08 (and plain
// small slots from Context::nextSlot), so 0x40 keeps user tags out of their way.
constexpr uint64_t kP2pSlotPrefix = 0x40;
constexpr const char* kStorePrefix = "burst-gloo";

// Slot layout: [63:56] kP2pSlotPrefix, [55:32] hash of the byte count, [31:0] tag (tag >= 0).
uint64_t p2p_slot(int tag, size_t bytes) {
  uint64_t h = static_cast<uint64_t>(bytes) * 0x9E3779B97F4A7C15ull;  // Fibonacci hashing
  h = (h >> 40) & 0xFFFFFFull;
  return (kP2pSlotPrefix << 56) | (h << 32) | static_cast<uint32_t>(tag);
}

// The text of whatever Gloo (or the standard library under it) threw.
std::string current_exception_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

Status gloo_error(const std::string& what, int rank, const std::string& detail) {
  return Status::error("gloo " + what + " on rank " + std::to_string(rank) + ": " + detail);
}

// A posted send or receive. Owns the Gloo buffer that describes the caller's memory.
class GlooHandle final : public CommHandle {
 public:
  enum class Kind { kSend, kRecv };

  GlooHandle(std::unique_ptr<gloo::transport::UnboundBuffer> buffer, Kind kind, int rank, int peer,
             int tag, std::chrono::milliseconds timeout)
      : buffer_(std::move(buffer)),
        kind_(kind),
        rank_(rank),
        peer_(peer),
        tag_(tag),
        timeout_(timeout) {}

  // A handle dropped without wait() still waits (bounded by the timeout): Gloo's loop thread
  // may otherwise write into the caller's memory, or read it, after the caller let it go.
  ~GlooHandle() override {
    if (!waited_) (void)wait();
  }

  Status wait() override {
    if (waited_) return status_;
    waited_ = true;
    if (!buffer_) return status_;  // zero bytes: nothing was posted
    try {
      // Orders the caller's next use of the buffer after the transfer: a receive has landed
      // in full, a send has been handed to the socket (Gloo no longer reads the buffer).
      const bool completed = kind_ == Kind::kSend ? buffer_->waitSend(nullptr, timeout_)
                                                  : buffer_->waitRecv(nullptr, timeout_);
      if (!completed) status_ = error("aborted by Gloo");
    } catch (...) {
      status_ = error(current_exception_text());
    }
    return status_;
  }

 private:
  Status error(const std::string& detail) const {
    const bool send = kind_ == Kind::kSend;
    return Status::error(std::string("gloo ") + (send ? "isend to" : "irecv from") + " peer " +
                         std::to_string(peer_) + " on rank " + std::to_string(rank_) + " (tag " +
                         std::to_string(tag_) + ", " + std::to_string(buffer_->size) +
                         " bytes): " + detail);
  }

  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  Kind kind_;
  int rank_;
  int peer_;
  int tag_;
  std::chrono::milliseconds timeout_;
  bool waited_ = false;
  Status status_;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context,
                   std::chrono::milliseconds timeout)
      : context_(std::move(context)), timeout_(timeout) {}

  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }
  std::string transport() const override { return "gloo (tcp)"; }

  Result<std::unique_ptr<CommHandle>> isend(const void* data, size_t bytes, int peer,
                                            int tag) override {
    // Gloo only reads a send buffer; its API takes void* for both directions.
    return post(const_cast<void*>(data), bytes, peer, tag, GlooHandle::Kind::kSend);
  }

  Result<std::unique_ptr<CommHandle>> irecv(void* data, size_t bytes, int peer, int tag) override {
    return post(data, bytes, peer, tag, GlooHandle::Kind::kRecv);
  }

  Status all_gather(const void* in, void* out, size_t bytes) override {
    if (bytes == 0) return Status();
    if (!in || !out) return gloo_error("all_gather", rank(), "null buffer");
    try {
      gloo::AllgatherOptions opts(context_);
      auto* out_bytes = static_cast<uint8_t*>(out);
      auto* own_block = out_bytes + static_cast<size_t>(rank()) * bytes;
      // Gloo copies the input into this rank's block itself; an input that already is that
      // block is passed as "no input" so Gloo never memcpy's a region onto itself.
      if (in != own_block) {
        opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes);
      }
      opts.setOutput(out_bytes, bytes * static_cast<size_t>(world_size()));
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    } catch (...) {
      return gloo_error("all_gather", rank(), current_exception_text());
    }
    return Status();
  }

  Status broadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_size()) {
      return gloo_error("broadcast", rank(), "root " + std::to_string(root) + " out of range");
    }
    if (bytes == 0) return Status();
    if (!data) return gloo_error("broadcast", rank(), "null buffer");
    try {
      // Root sends from `data` (no separate input), the others receive into it.
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(data), bytes);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    } catch (...) {
      return gloo_error("broadcast from root " + std::to_string(root), rank(),
                        current_exception_text());
    }
    return Status();
  }

  Status barrier() override {
    try {
      // Returns only after every rank entered: orders everything a rank did before its
      // barrier() before anything any rank does after it.
      gloo::BarrierOptions opts(context_);
      opts.setTag(next_tag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    } catch (...) {
      return gloo_error("barrier", rank(), current_exception_text());
    }
    return Status();
  }

 private:
  Result<std::unique_ptr<CommHandle>> post(void* data, size_t bytes, int peer, int tag,
                                           GlooHandle::Kind kind) {
    const bool send = kind == GlooHandle::Kind::kSend;
    const std::string what = std::string(send ? "isend to" : "irecv from") + " peer " +
                             std::to_string(peer) + " (tag " + std::to_string(tag) + ")";
    if (peer < 0 || peer >= world_size() || peer == rank()) {
      return gloo_error(what, rank(), "peer must be another rank of the group");
    }
    if (tag < 0) return gloo_error(what, rank(), "tag must be non-negative");
    if (bytes > 0 && !data) return gloo_error(what, rank(), "null buffer");
    // Zero bytes: both sides skip the wire entirely, which keeps (peer, tag) order intact.
    if (bytes == 0) {
      return std::unique_ptr<CommHandle>(
          std::make_unique<GlooHandle>(nullptr, kind, rank(), peer, tag, timeout_));
    }
    try {
      auto buffer = context_->createUnboundBuffer(data, bytes);
      if (send) {
        buffer->send(peer, p2p_slot(tag, bytes));
      } else {
        buffer->recv(peer, p2p_slot(tag, bytes));
      }
      return std::unique_ptr<CommHandle>(
          std::make_unique<GlooHandle>(std::move(buffer), kind, rank(), peer, tag, timeout_));
    } catch (...) {
      return gloo_error(what, rank(), current_exception_text());
    }
  }

  // Collectives get a fresh tag each: every rank calls them in the same order, so the counters
  // agree, and a late message of one collective can never be matched by the next.
  uint32_t next_tag() { return collective_tag_++; }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::chrono::milliseconds timeout_;
  uint32_t collective_tag_ = 0;
};

// Gloo's view of a RendezvousStore. Gloo calls these from connectFullMesh only; errors become
// exceptions there because Gloo's Store interface has no other way to fail.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(RendezvousStore& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    check(store_.set(key, data));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.get(key, timeout_);
    check(v.status());
    return v.take();
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    check(store_.wait(keys, timeout));
  }

 private:
  static void check(const Status& st) {
    if (!st.ok()) throw gloo::IoException("rendezvous store: " + st.message());
  }
  RendezvousStore& store_;
  std::chrono::milliseconds timeout_;
};

void ignore_sigpipe_once() {
  static std::atomic<bool> done{false};
  if (done.exchange(true)) return;
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_communicator(const GlooOptions& options) {
  const int rank = options.rank;
  if (options.world_size < 1 || rank < 0 || rank >= options.world_size) {
    return gloo_error("join", rank,
                      "rank out of range for world size " + std::to_string(options.world_size));
  }
  if (!options.store && options.store_dir.empty()) {
    return gloo_error("join", rank, "neither a store nor a store_dir was given");
  }
  if (options.timeout.count() <= 0) return gloo_error("join", rank, "timeout must be positive");

  if (!options.store) {
    std::error_code ec;
    std::filesystem::create_directories(options.store_dir, ec);
    if (ec) {
      return gloo_error("join", rank,
                        "cannot create store dir " + options.store_dir + ": " + ec.message());
    }
  }
  ignore_sigpipe_once();

  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, options.world_size);
    // Set before connecting: Gloo bounds the wait for peers' addresses and the TCP handshakes
    // with the context timeout, and copies it into every pair.
    context->setTimeout(options.timeout);
    std::unique_ptr<gloo::rendezvous::Store> base;
    if (options.store) {
      base = std::make_unique<StoreAdapter>(*options.store, options.timeout);
    } else {
      base = std::make_unique<gloo::rendezvous::FileStore>(options.store_dir);
    }
    gloo::rendezvous::PrefixStore store(kStorePrefix, *base);
    context->connectFullMesh(store, device);
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(std::move(context), options.timeout));
  } catch (...) {
    const std::string where = options.store ? "network store" : "store " + options.store_dir;
    return gloo_error("join (world size " + std::to_string(options.world_size) + ", " + where +
                          ", address " + options.hostname + ")",
                      rank, current_exception_text());
  }
}

}  // namespace burst::engine
