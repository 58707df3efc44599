#include "frontend/prefix_cache.h"

#include <algorithm>

namespace burst::server {

uint64_t PrefixCache::hash_of(int64_t parent, const int32_t* tokens, int64_t n) {
  // An FNV-style mix of the parent id and the token ids, a word at a time. Lookups compare the ids themselves, so the
  // hash only spreads buckets.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
    h ^= h >> 29;
  };
  mix(static_cast<uint64_t>(parent));
  for (int64_t i = 0; i < n; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h;
}

int64_t PrefixCache::find(int64_t parent, const int32_t* tokens) const {
  const uint64_t h = hash_of(parent, tokens, block_tokens_);
  const auto [lo, hi] = by_hash_.equal_range(h);
  for (auto it = lo; it != hi; ++it) {
    const Block& b = blocks_.at(it->second);
    if (b.parent == parent && std::equal(b.tokens.begin(), b.tokens.end(), tokens)) {
      return it->second;
    }
  }
  return -1;
}

std::vector<int64_t> PrefixCache::match(const std::vector<int32_t>& tokens,
                                        int64_t max_blocks) const {
  std::vector<int64_t> ids;
  int64_t parent = -1;
  for (int64_t k = 0; k < max_blocks && (k + 1) * block_tokens_ <= static_cast<int64_t>(tokens.size());
       ++k) {
    const int64_t id = find(parent, tokens.data() + k * block_tokens_);
    if (id < 0) break;
    ids.push_back(id);
    parent = id;
  }
  return ids;
}

void PrefixCache::acquire(const std::vector<int64_t>& ids) {
  for (int64_t id : ids) {
    Block& b = blocks_.at(id);
    if (b.refs++ == 0) {
      lru_.erase(lru_pos_.at(id));
      lru_pos_.erase(id);
    }
  }
}

void PrefixCache::release(const std::vector<int64_t>& ids) {
  ++clock_;
  for (int64_t id : ids) {
    const auto it = blocks_.find(id);
    if (it == blocks_.end()) continue;
    Block& b = it->second;
    b.last_use = clock_;
    if (--b.refs == 0) {
      lru_pos_[id] = lru_.emplace(LruKey{b.last_use, -b.depth}, id);
    }
  }
}

std::pair<int64_t, bool> PrefixCache::insert(int64_t parent, const int32_t* tokens) {
  if (const int64_t id = find(parent, tokens); id >= 0) {
    acquire({id});
    return {id, false};
  }
  const int64_t id = next_id_++;
  Block b;
  b.parent = parent;
  b.depth = parent < 0 ? 0 : blocks_.at(parent).depth + 1;
  b.hash = hash_of(parent, tokens, block_tokens_);
  b.tokens.assign(tokens, tokens + block_tokens_);
  b.refs = 1;
  by_hash_.emplace(b.hash, id);
  blocks_.emplace(id, std::move(b));
  return {id, true};
}

void PrefixCache::unlink(int64_t id) {
  const Block& b = blocks_.at(id);
  const auto [lo, hi] = by_hash_.equal_range(b.hash);
  for (auto it = lo; it != hi; ++it) {
    if (it->second == id) {
      by_hash_.erase(it);
      break;
    }
  }
  blocks_.erase(id);
}

std::vector<int64_t> PrefixCache::evict(int64_t n) {
  std::vector<int64_t> out;
  while (static_cast<int64_t>(out.size()) < n && !lru_.empty()) {
    const int64_t id = lru_.begin()->second;
    lru_.erase(lru_.begin());
    lru_pos_.erase(id);
    unlink(id);
    out.push_back(id);
  }
  return out;
}

int PrefixCache::refs(int64_t id) const {
  const auto it = blocks_.find(id);
  return it == blocks_.end() ? 0 : it->second.refs;
}

int64_t PrefixCache::references() const {
  int64_t n = 0;
  for (const auto& [id, b] : blocks_) n += b.refs;
  return n;
}

void PrefixCache::clear() {
  blocks_.clear();
  by_hash_.clear();
  lru_.clear();
  lru_pos_.clear();
}

}  // namespace burst::server
