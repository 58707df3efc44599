#include "engine/sharding.h"

#include <algorithm>

namespace burst::engine {

namespace {

// floor(a / b) for b > 0 and any a.
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

}  // namespace

MaskStarts mask_starts(const Segment& q, const Segment& k) {
  if (q.stride == 1 && k.stride == 1) return {q.pos, k.pos};
  // k.pos + j s <= q.pos + i s  <=>  j + ceil((k.pos - q.pos) / s) <= i (j, i integers).
  return {0, -floor_div(q.pos - k.pos, q.stride)};
}

const char* shard_layout_name(ShardLayout layout) {
  switch (layout) {
    case ShardLayout::kZigzag: return "zigzag";
    case ShardLayout::kContiguous: return "contiguous";
    case ShardLayout::kStriped: break;
  }
  return "striped";
}

bool parse_shard_layout(std::string_view name, ShardLayout* layout) {
  for (ShardLayout l : {ShardLayout::kStriped, ShardLayout::kZigzag, ShardLayout::kContiguous}) {
    if (name == shard_layout_name(l)) {
      *layout = l;
      return true;
    }
  }
  return false;
}

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
  switch (layout) {
    case ShardLayout::kStriped: {
      // The first position of the chunk that is congruent to rank mod world.
      const int64_t first = start + ((rank - start) % world + world) % world;
      return {{first, 0, chunk, world}};
    }
    case ShardLayout::kContiguous:
      return {{start + rank * chunk, 0, chunk}};
    case ShardLayout::kZigzag:
      break;
  }
  return {{start + rank * chunk, 0, chunk},
          {start + (2 * int64_t{world} - 1 - rank) * chunk, chunk, chunk}};
}

int64_t ShardPlan::local_rows(int) const {
  return layout == ShardLayout::kZigzag ? 2 * chunk : chunk;
}

int64_t ShardPlan::real_len(const Segment& s) const {
  const int64_t end = start + prompt_len;
  if (s.pos >= end) return 0;
  return std::min<int64_t>(s.len, (end - s.pos + s.stride - 1) / s.stride);
}

int64_t ShardPlan::real_rows(int rank) const {
  int64_t n = 0;
  for (const Segment& s : segments(rank)) n += real_len(s);
  return n;
}

int ShardPlan::owner(int64_t pos, int64_t* row) const {
  if (layout == ShardLayout::kStriped) {
    const int r = static_cast<int>(pos % world);
    *row = (pos - segments(r)[0].pos) / world;
    return r;
  }
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
