#include "engine/sharding.h"

namespace burst::engine {

ShardPlan ShardPlan::make(ShardLayout layout, int64_t prompt_len, int world) {
  ShardPlan p;
  p.layout = layout;
  p.world = world;
  p.prompt_len = prompt_len;
  const int64_t parts = layout == ShardLayout::kZigzag ? 2 * int64_t{world} : world;
  p.chunk = (prompt_len + parts - 1) / parts;
  p.padded_len = p.chunk * parts;
  return p;
}

std::vector<Segment> ShardPlan::segments(int rank) const {
  if (layout == ShardLayout::kContiguous) return {{rank * chunk, 0, chunk}};
  return {{rank * chunk, 0, chunk}, {(2 * int64_t{world} - 1 - rank) * chunk, chunk, chunk}};
}

int64_t ShardPlan::local_rows(int) const {
  return layout == ShardLayout::kZigzag ? 2 * chunk : chunk;
}

int ShardPlan::owner(int64_t pos, int64_t* row) const {
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
