// RendezvousStore: the key-value store ranks meet through before their communicator exists
// (Gloo's peer addresses, the NCCL unique id). Without one, a communicator uses a directory
// every rank can see (GlooOptions::store_dir, NcclOptions::store_dir): one host only. Multi-node
// groups pass a store served over the network by their coordinator (group/worker_registry.h).
//
// Contract: set() publishes a value under a key (set once per key); get() blocks until the key
// exists or the timeout passes; wait() blocks until every key exists. Every call returns an
// error naming the key instead of hanging or throwing.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "engine/status.h"

namespace burst::engine {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual Status set(const std::string& key, const std::vector<char>& value) = 0;
  virtual Result<std::vector<char>> get(const std::string& key,
                                        std::chrono::milliseconds timeout) = 0;
  virtual Status wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};

}  // namespace burst::engine
