#include "engine/communicator_factory.h"

#include <filesystem>

#ifdef BURST_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/nccl_communicator.h"
#endif

namespace burst::engine {

namespace {

class PrefixedStore final : public RendezvousStore {
 public:
  PrefixedStore(std::shared_ptr<RendezvousStore> inner, std::string prefix)
      : inner_(std::move(inner)), prefix_(std::move(prefix) + "/") {}
  Status set(const std::string& key, const std::vector<char>& value) override {
    return inner_->set(prefix_ + key, value);
  }
  Result<std::vector<char>> get(const std::string& key,
                                std::chrono::milliseconds timeout) override {
    return inner_->get(prefix_ + key, timeout);
  }
  Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    return inner_->wait(full, timeout);
  }

 private:
  std::shared_ptr<RendezvousStore> inner_;
  std::string prefix_;
};

// The options of a subgroup's own rendezvous (see CommunicatorOptions::group).
Result<CommunicatorOptions> in_group(CommunicatorOptions o) {
  if (o.group.empty()) return o;
  if (o.store) {
    o.store = prefixed_store(o.store, o.group);
  } else {
    o.store_dir += "/" + o.group;
    std::error_code ec;
    std::filesystem::create_directories(o.store_dir, ec);
    if (ec) return Status::error("cannot create the rendezvous directory " + o.store_dir + ": " +
                                 ec.message());
  }
  o.group.clear();
  return o;
}

}  // namespace

std::shared_ptr<RendezvousStore> prefixed_store(std::shared_ptr<RendezvousStore> store,
                                                const std::string& prefix) {
  return std::make_shared<PrefixedStore>(std::move(store), prefix);
}

Result<std::unique_ptr<Communicator>> make_communicator(Backend& backend,
                                                        const CommunicatorOptions& group_options) {
  auto resolved = in_group(group_options);
  if (!resolved.ok()) return resolved.status();
  const CommunicatorOptions& options = resolved.value();
  if (backend.device() == DeviceKind::kCuda) {
#ifdef BURST_HAVE_CUDA
    auto streams = cuda_streams(backend);
    if (!streams.ok()) return streams.status();
    NcclOptions o;
    o.rank = options.rank;
    o.world_size = options.world_size;
    o.device = streams.value().device;
    o.store_dir = options.store_dir;
    o.store = options.store;
    o.compute_stream = streams.value().compute;
    o.timeout = options.timeout;
    o.peer_gather = backend.tuning().peer_gather;
    return make_nccl_communicator(o);
#else
    return Status::error("this build has no CUDA");
#endif
  }
  GlooOptions o;
  o.rank = options.rank;
  o.world_size = options.world_size;
  o.store_dir = options.store_dir;
  o.store = options.store;
  o.hostname = options.host;
  o.timeout = options.timeout;
  return make_gloo_communicator(o);
}

Result<RankCommunicators> make_rank_communicators(Backend& backend,
                                                  const CommunicatorOptions& options,
                                                  const ParallelLayout& layout) {
  if (layout.world() != options.world_size) {
    return Status::error("layout " + layout.describe() + " is " + std::to_string(layout.world()) +
                         " ranks, the group " + std::to_string(options.world_size));
  }
  const int tp_index = layout.tp_index(options.rank), cp_index = layout.cp_index(options.rank);
  auto join = [&](int rank, int world,
                  const std::string& group) -> Result<std::unique_ptr<Communicator>> {
    if (world == 1) return make_local_communicator();
    CommunicatorOptions o = options;
    o.rank = rank;
    o.world_size = world;
    o.group = group;
    return make_communicator(backend, o);
  };
  RankCommunicators c;
  auto tp = join(tp_index, layout.tp, "tp" + std::to_string(cp_index));
  if (!tp.ok()) return Status::error("the tensor-parallel group: " + tp.message());
  c.tp = tp.take();
  if (layout.tp == 1) {
    auto whole = make_communicator(backend, options);  // the ring is the group, as before
    if (!whole.ok()) return whole.status();
    c.ring = whole.take();
    return c;
  }
  auto ring = join(cp_index, layout.cp, "cp" + std::to_string(tp_index));
  if (!ring.ok()) return Status::error("the context-parallel ring: " + ring.message());
  c.ring = ring.take();
  return c;
}

}  // namespace burst::engine
