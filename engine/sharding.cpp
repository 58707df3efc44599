#include "engine/sharding.h"

#include <algorithm>

namespace burst::engine {

ShardPlan ShardPlan::make(ShardLayout layout, int64_t prompt_len, int world, int64_t start) {
  ShardPlan p;
  p.layout = layout;
  p.world = world;
  p.start = start;
  p.prompt_len = prompt_len;
  const int64_t parts = layout == ShardLayout::kZigzag ? 2 * int64_t{world} : world;
  p.chunk = (prompt_len + parts - 1) / parts;
  p.padded_len = p.chunk * parts;
  return p;
}

std::vector<Segment> ShardPlan::segments(int rank) const {
  if (layout == ShardLayout::kContiguous) return {{start + rank * chunk, 0, chunk}};
  return {{start + rank * chunk, 0, chunk},
          {start + (2 * int64_t{world} - 1 - rank) * chunk, chunk, chunk}};
}

int64_t ShardPlan::local_rows(int) const {
  return layout == ShardLayout::kZigzag ? 2 * chunk : chunk;
}

int64_t ShardPlan::real_len(const Segment& s) const {
  return std::clamp<int64_t>(start + prompt_len - s.pos, 0, s.len);
}

int64_t ShardPlan::real_rows(int rank) const {
  int64_t n = 0;
  for (const Segment& s : segments(rank)) n += real_len(s);
  return n;
}

int ShardPlan::owner(int64_t pos, int64_t* row) const {
  pos -= start;
  const int64_t c = pos / chunk;
  if (layout == ShardLayout::kContiguous) {
    *row = pos - c * chunk;
    return static_cast<int>(c);
  }
  if (c < world) {
    *row = pos - c * chunk;
    return static_cast<int>(c);
  }
  *row = chunk + pos - c * chunk;
  return static_cast<int>(2 * int64_t{world} - 1 - c);
}

}  // namespace burst::engine
