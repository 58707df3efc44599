// Sequence sharding of one prompt (or one chunk of it) across N ranks.
// - Striped (the default): position p lives on rank p mod N, at local row p / N of the
//   sequence on that rank (Striped Attention, Brandon et al. 2023). A chunk [start, start + len)
//   gives rank r the positions congruent to r in it: one segment of stride N. Every rank gets
//   the same causal work (each ring step is one causal block, its diagonal shifted by at most
//   one row) and the same KV memory, and, because the owner of a position does not depend on
//   where a chunk starts or how long it is, a sequence's cache is laid out the same way however
//   it was chunked and whatever the decode steps added (a decode token at p is cached on rank
//   p mod N too): a cached prefix is a run of whole pages on every rank that another request
//   can reuse (prefix caching).
// - Zigzag: the chunk is padded to a multiple of 2N and cut into 2N equal parts; rank r holds
//   parts r and 2N-1-r. Kept for comparison: its layout depends on the chunk's bounds.
// - Contiguous: N parts, rank r holds part r (kept for comparison).
// Positions stay absolute: a token's RoPE angle and its mask use its position. Padding (rows
// past the chunk's end, so that every rank holds as many rows) sits at each rank's tail:
// causal masking keeps it out of every real token's attention, and it is never cached or
// sampled.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace burst::engine {

// Positions pos, pos + stride, ... (len of them) held by one rank, at rows [row, row + len) of
// its local arrays.
struct Segment {
  int64_t pos = 0;
  int64_t row = 0;
  int64_t len = 0;
  int64_t stride = 1;
  int64_t position(int64_t i) const { return pos + i * stride; }
};

// The starts a kernel's causal mask takes for query segment q against key segment k (both of
// one stride): key j is visible to query i iff k.position(j) <= q.position(i), which is
// kv_start + j <= q_start + i. Exact for stride 1 (the positions themselves) and for stride
// s > 1 (q_start 0, kv_start ceil((k.pos - q.pos) / s)).
struct MaskStarts {
  int64_t q_start = 0;
  int64_t kv_start = 0;
};
MaskStarts mask_starts(const Segment& q, const Segment& k);

enum class ShardLayout { kStriped, kZigzag, kContiguous };
// "striped", "zigzag", "contiguous" (flags and configs); parse is false for any other name.
const char* shard_layout_name(ShardLayout layout);
bool parse_shard_layout(std::string_view name, ShardLayout* layout);

struct ShardPlan {
  ShardLayout layout = ShardLayout::kStriped;
  int world = 1;
  int64_t start = 0;       // absolute position of the first token
  int64_t prompt_len = 0;  // real tokens, at positions [start, start + prompt_len)
  int64_t padded_len = 0;  // rows over all ranks, padding included
  int64_t chunk = 0;       // rows of one part (striped: of each rank)

  static ShardPlan make(ShardLayout layout, int64_t prompt_len, int world, int64_t start = 0);
  // The segments of `rank`, in local row order, at absolute positions.
  std::vector<Segment> segments(int rank) const;
  int64_t local_rows(int rank) const;  // padding included
  // Real (not padding) rows of `rank`: what it caches of this plan.
  int64_t real_rows(int rank) const;
  // Real rows of a segment (its leading rows; the rest is padding).
  int64_t real_len(const Segment& s) const;
  // The rank whose rows hold absolute position `pos` (start <= pos < start + prompt_len), and
  // the local row.
  int owner(int64_t pos, int64_t* row) const;
};

}  // namespace burst::engine
