// The seam between a model and the runtime that batches its sequences: one forward over a
// ForwardBatch (the rows of every sequence of a step, where their logits or sampled ids go)
// through an AttentionContext (the ring on every rank, whatever the world size). The runtime
// (runtime/batch_runner.h) sees only this interface: a second architecture implements Model
// and needs nothing else of the runtime.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/attention_context.h"
#include "engine/backend.h"
#include "engine/sampler.h"

namespace burst::models {

// Called after each layer of a forward with the number of layers done; an error stops the
// forward and is returned by it (how a prefill is cancelled between layers).
using LayerHook = std::function<Status(int64_t layers_done)>;

// Rows [row, row + rows) of a forward belong to one sequence of length seq_len (what dynamic
// RoPE scales by): a batch of several sequences passes one span per sequence.
struct RopeSpan {
  int64_t row = 0, rows = 0, seq_len = 0;
};

// Rows of a forward whose next token is drawn on the backend (Backend::sample) rather than
// returned as logits: no logits leave the device for them, only the ids. Row rows[i] of the
// batch is sampled with params[i] and uniforms[i] (Sampler::draw_uniform of its sequence).
struct SampleRows {
  std::vector<int64_t> rows;
  std::vector<engine::SamplingParams> params;
  std::vector<double> uniforms;
  // Queue the draw and return without its ids (Backend::sample_queued): `sampled` stays empty
  // and Backend::sampled() hands them over later.
  bool queued = false;
  size_t size() const { return rows.size(); }
};

// The rows of one forward: token ids at absolute positions (a shard of a sequence sees only
// part of its positions), the RoPE span of each sequence, which rows' logits come back to the
// host (`logit_rows`, indices into ids) and which rows are drawn on the backend (`sample`).
struct ForwardBatch {
  std::vector<int32_t> ids;
  // Rows whose id the backend drew in the step before and still holds (Backend::embedding's
  // DrawnId: the decode lookahead); their entry in ids is not read.
  std::vector<engine::Backend::DrawnId> drawn;
  std::vector<int64_t> positions;
  // Must tile the rows in order (of_sequence makes the one span of a single sequence).
  std::vector<RopeSpan> spans;
  std::vector<int64_t> logit_rows;
  SampleRows sample;

  // The rows of one sequence of length seq_len (0: max(positions) + 1).
  static ForwardBatch of_sequence(std::vector<int32_t> ids, std::vector<int64_t> positions,
                                  std::vector<int64_t> logit_rows = {}, int64_t seq_len = 0);
};

// What a forward returns: vocab_size fp32 logits per logit row (in logit_rows order), one id
// per sampled row (in sample order; empty when the draw was queued).
struct ForwardOutput {
  std::vector<float> logits;
  std::vector<int32_t> sampled;
};

// What the runtime needs to know of a model, whatever its architecture and its config's shape.
struct ModelInfo {
  int64_t num_layers = 0;
  int64_t vocab_size = 0;
  int32_t eos_token_id = -1;  // -1: none
};

class Model {
 public:
  virtual ~Model() = default;
  virtual ModelInfo info() const = 0;
  virtual engine::Backend& backend() const = 0;
  // The KV shape an attention context for this model holds (per rank).
  virtual engine::AttentionShape attention_shape() const = 0;
  // Runs the batch through every layer; `out` is overwritten. after_layer, when set, runs after
  // every layer (an error stops the forward and is returned).
  virtual Status forward(const ForwardBatch& batch, engine::AttentionContext& attn,
                         ForwardOutput& out, const LayerHook& after_layer = nullptr) = 0;
};

}  // namespace burst::models
