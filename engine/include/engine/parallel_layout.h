// The ranks of a worker group as tensor parallelism x context parallelism (tp x cp): the tp
// ranks of one tensor-parallel group are consecutive (one node: their all-reduces stay on its
// links), and the BurstAttention ring joins the ranks of equal tensor-parallel index across
// the groups. rank = cp_index * tp + tp_index. tp 1 is a ring of every rank (the layout
// before tensor parallelism); cp 1 is tensor parallelism alone.
#pragma once

#include <memory>
#include <string>

#include "engine/status.h"

namespace burst::engine {

struct ParallelLayout {
  int tp = 1;
  int cp = 1;

  int world() const { return tp * cp; }
  int tp_index(int rank) const { return rank % tp; }
  int cp_index(int rank) const { return rank / tp; }
  // The layout of `workers` ranks with tensor parallelism `tp`, or why there is none.
  static Result<ParallelLayout> of(int workers, int tp) {
    if (tp < 1) return Status::error("--tp " + std::to_string(tp) + ": must be 1 or more");
    if (workers < 1) return Status::error("need at least one worker");
    if (workers % tp != 0) {
      return Status::error("--tp " + std::to_string(tp) + " does not divide the " +
                           std::to_string(workers) + " workers (workers = tp x the ring's ranks)");
    }
    return ParallelLayout{tp, workers / tp};
  }
  std::string describe() const {
    return "tp " + std::to_string(tp) + " x cp " + std::to_string(cp);
  }
};

}  // namespace burst::engine
