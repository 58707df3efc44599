// Sequence sharding of one prompt (or one chunk of it) across N ranks. Zigzag (the default): the prompt is padded to
// a multiple of 2N and cut into 2N equal chunks; rank r holds chunks r and 2N-1-r, which gives
// every rank the same causal work and the same KV memory. Contiguous: N chunks, rank r holds
// chunk r (kept for comparison). Positions stay global: a token's RoPE angle and its mask use
// its absolute position. Padding sits at the tail (positions >= prompt_len): causal masking
// keeps it out of every real token's attention, and it is never cached or sampled. A chunk of a
// longer prompt (chunked prefill) is sharded the same way from its first position `start`.
#pragma once

#include <cstdint>
#include <vector>

namespace burst::engine {

// A run of consecutive positions held by one rank, at rows [row, row + len) of its local arrays.
struct Segment {
  int64_t pos = 0;
  int64_t row = 0;
  int64_t len = 0;
};

enum class ShardLayout { kZigzag, kContiguous };

struct ShardPlan {
  ShardLayout layout = ShardLayout::kZigzag;
  int world = 1;
  int64_t start = 0;       // absolute position of the first token
  int64_t prompt_len = 0;  // real tokens, at positions [start, start + prompt_len)
  int64_t padded_len = 0;
  int64_t chunk = 0;

  static ShardPlan make(ShardLayout layout, int64_t prompt_len, int world, int64_t start = 0);
  // The segments of `rank`, in local row order, at absolute positions.
  std::vector<Segment> segments(int rank) const;
  int64_t local_rows(int rank) const;  // padding included
  // Real (not padding) rows of `rank`: what it caches of this plan.
  int64_t real_rows(int rank) const;
  // Real rows of a segment (its leading rows; the rest is padding).
  int64_t real_len(const Segment& s) const;
  // The rank whose rows hold absolute position `pos` (start <= pos < start + padded_len), and
  // the local row.
  int owner(int64_t pos, int64_t* row) const;
};

}  // namespace burst::engine
