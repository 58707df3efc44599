// The index of prefix caching, on the planner's side: which blocks of tokens the ranks hold as
// prefix blocks (runtime::PublishBlock), found by a hash chain over token ids, with reference
// counts and LRU eviction. A block is block_tokens consecutive tokens at positions
// [k x block_tokens, (k + 1) x block_tokens) of some sequence, whose KV is one page on every
// ring rank (striped layout); it is named by an id and identified by its parent block (the
// block before it, or none) and its token ids, so equal ids after equal prefixes find the same
// block. Ids are compared whole on every lookup: a hash collision can cost a lookup, never a
// wrong block. Pure: no threads, no clock (a use counter orders LRU), tested in
// tests/unit/prefix_cache_test.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

namespace burst::server {

class PrefixCache {
 public:
  explicit PrefixCache(int64_t block_tokens = 1) : block_tokens_(block_tokens) {}

  int64_t block_tokens() const { return block_tokens_; }
  // The ids of the cached blocks that `tokens` starts with, in order, at most max_blocks.
  std::vector<int64_t> match(const std::vector<int32_t>& tokens, int64_t max_blocks) const;
  // A sequence holds these blocks (its prefix) / lets them go. An unreferenced block can be
  // evicted.
  void acquire(const std::vector<int64_t>& ids);
  void release(const std::vector<int64_t>& ids);
  // Block tokens [0, block_tokens) after `parent` (-1: the first block of a sequence): the id
  // of an equal cached block (inserted false) or a new one (inserted true), held once by the
  // caller either way (so a block's parent is held whenever it is, and LRU never evicts a
  // parent before its children).
  std::pair<int64_t, bool> insert(int64_t parent, const int32_t* tokens);
  // Takes up to n unreferenced blocks out, least recently used first (a block before the
  // blocks that extend it: children go first), and returns their ids.
  std::vector<int64_t> evict(int64_t n);
  int64_t evictable() const { return static_cast<int64_t>(lru_.size()); }
  int64_t size() const { return static_cast<int64_t>(blocks_.size()); }
  // References held by sequences, over all blocks (0 when no sequence runs).
  int64_t references() const;
  bool contains(int64_t id) const { return blocks_.count(id) != 0; }
  int refs(int64_t id) const;  // 0 for an unknown id
  void clear();

 private:
  struct Block {
    int64_t parent = -1;
    int64_t depth = 0;  // blocks before it
    uint64_t hash = 0;
    std::vector<int32_t> tokens;
    int refs = 0;
    uint64_t last_use = 0;
  };
  // LRU order of unreferenced blocks: oldest use first, deeper first among equals.
  using LruKey = std::pair<uint64_t, int64_t>;  // (last_use, -depth)
  static uint64_t hash_of(int64_t parent, const int32_t* tokens, int64_t n);
  int64_t find(int64_t parent, const int32_t* tokens) const;
  void unlink(int64_t id);

  int64_t block_tokens_;
  int64_t next_id_ = 1;
  uint64_t clock_ = 0;
  std::unordered_map<int64_t, Block> blocks_;
  std::unordered_multimap<uint64_t, int64_t> by_hash_;
  std::multimap<LruKey, int64_t> lru_;
  std::unordered_map<int64_t, std::multimap<LruKey, int64_t>::iterator> lru_pos_;
};

}  // namespace burst::server
