// The LLaMA-2 forward, written once against engine::Backend: embedding, per layer RMSNorm ->
// q/k/v projections -> RoPE (absolute positions) -> attention through an AttentionContext
// (local KV cache or the BurstAttention ring) -> o projection + residual -> RMSNorm -> SwiGLU
// MLP + residual; final RMSNorm and the LM head only for the rows whose logits are wanted.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/attention_context.h"
#include "engine/backend.h"
#include "engine/communicator.h"
#include "models/config.h"
#include "models/model.h"

namespace burst::models {

struct LayerWeights {
  engine::Tensor attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down;
};

// Called after each weight is loaded or generated: bytes of the model's weights (in the
// backend's compute dtype) done so far, of all. A 7B model takes minutes: this is what shows it.
using LoadProgress = std::function<void(int64_t bytes_done, int64_t bytes_total)>;

struct WeightSpec;  // one weight: name, shape, this rank's part, destination (llama.cpp)

// This rank's place in a tensor-parallel group (Megatron-style): q, k, v, gate and up are split
// by output rows (column-parallel), o and down by input columns (row-parallel, one all-reduce
// after each); rank r holds query heads [r H/T, (r+1) H/T) and the KV heads they read (a KV
// head is replicated on T / KV ranks when T exceeds the KV heads), and 1/T of the MLP. The
// embedding, the norms and the LM head are replicated: every rank computes the same logits and
// draws the same tokens. size 1 is the whole model.
struct TensorParallel {
  int rank = 0;
  int size = 1;
};
// Empty when `config` splits over `tp` ranks, else why not (named for the user: heads,
// KV heads, intermediate size).
std::string tensor_parallel_error(const LlamaConfig& config, int tp);

class LlamaModel final : public Model {
 public:
  // Loads config.json and the safetensors weights of an HF model directory onto the backend.
  // With tp.size > 1, only this rank's slices are read (WeightFiles::read).
  static Result<std::unique_ptr<LlamaModel>> load(engine::Backend& backend,
                                                  const std::string& model_dir,
                                                  const LoadProgress& on_progress = nullptr,
                                                  TensorParallel tp = {});
  // A model of `config` with weights drawn from a counter-based generator keyed by `seed`
  // (uniform, scaled by 1/sqrt(fan_in); norms at 1): the benchmark presets need no files.
  // With tp.size > 1, this rank's slices of the very model tp.size 1 draws.
  static Result<std::unique_ptr<LlamaModel>> random(engine::Backend& backend,
                                                    const LlamaConfig& config, uint64_t seed,
                                                    const LoadProgress& on_progress = nullptr,
                                                    TensorParallel tp = {});

  const LlamaConfig& config() const { return config_; }
  ModelInfo info() const override {
    return {config_.num_layers, config_.vocab_size, config_.eos_token_id};
  }
  engine::Backend& backend() const override { return backend_; }
  // This rank's heads (a tensor-parallel rank's share).
  engine::AttentionShape attention_shape() const override;
  const TensorParallel& tensor_parallel() const { return tp_; }
  // The group the row-parallel products are summed over (size tp.size, this rank tp.rank);
  // needed before the first forward when tp.size > 1.
  void set_tensor_parallel_comm(engine::Communicator& comm) { tp_comm_ = &comm; }
  // Bytes of this rank's weights.
  int64_t weight_bytes() const;
  // Bytes of tensor data load() read from the weight files (0 for random weights).
  int64_t file_bytes_read() const { return file_bytes_read_; }
  // Rows of MLP work per chunk in long prefills (bounds activation memory).
  void set_mlp_chunk_rows(int64_t rows) { mlp_chunk_rows_ = rows; }

  // Runs the batch through every layer (Model::forward); the LM head runs once over the logit
  // rows and the sampled rows together, and only over them.
  Status forward(const ForwardBatch& batch, engine::AttentionContext& attn, ForwardOutput& out,
                 const LayerHook& after_layer = nullptr) override;

 private:
  LlamaModel(engine::Backend& backend, LlamaConfig config, TensorParallel tp)
      : backend_(backend), config_(std::move(config)), tp_(tp) {}
  static Result<std::unique_ptr<LlamaModel>> create(engine::Backend& backend, LlamaConfig config,
                                                    TensorParallel tp);
  // out (a scratch [rows, hidden]) = the row-parallel partial product of this rank; summed over
  // the group, then added to x. Without tensor parallelism: x += the product, in the GEMM.
  // `next`, when given, is the RMSNorm that reads x next: where the group's sum can norm x in
  // the same pass (Communicator::all_reduce_add_norm) it does, and next->ready says so.
  Status row_parallel(const engine::Tensor& in, const engine::Tensor& w, engine::Tensor& x,
                      engine::Tensor& scratch, engine::Backend::Norm* next = nullptr);
  // Allocates each weight and runs fill(weight, index) on it, in order, reporting progress.
  Status fill_weights(const LoadProgress& on_progress,
                      const std::function<Status(const WeightSpec&, uint64_t)>& fill);
  Status ensure_scratch(int64_t rows);
  // Rows that share their RoPE frequencies (dynamic scaling makes sequences differ), with
  // their positions; the spans must tile the rows in order.
  struct RopeRun {
    int64_t row, rows;
    std::vector<float> inv_freq;
    std::vector<int64_t> positions;
  };
  Status rope_runs(const std::vector<int64_t>& positions, const std::vector<RopeSpan>& spans,
                   std::vector<RopeRun>& runs) const;
  // Decoder layer l over the first `rows` rows of the activation scratch (x_ in and out).
  // normed: in, h_ already holds layer l's attention norm of x; out, it holds layer l + 1's.
  Status layer(int64_t l, const std::vector<RopeRun>& runs, const std::vector<int64_t>& positions,
               engine::AttentionContext& attn, int64_t rows, bool& normed);
  // Final norm and LM head of head_rows (logit rows first, then the sampled rows): the first
  // n_logits rows' logits to the host, the rest drawn by the backend into `sampled`.
  Status lm_head(int64_t rows, const std::vector<int64_t>& head_rows, int64_t n_logits,
                 const SampleRows& sample, std::vector<float>& logits,
                 std::vector<int32_t>& sampled);

  engine::Backend& backend_;
  LlamaConfig config_;
  TensorParallel tp_;
  engine::Communicator* tp_comm_ = nullptr;
  int64_t file_bytes_read_ = 0;
  engine::Tensor embed_, final_norm_, lm_head_;  // lm_head_ aliases embed_ when tied
  std::vector<LayerWeights> layers_;
  int64_t mlp_chunk_rows_ = 4096;
  // Activation scratch, grown to the largest forward seen.
  int64_t scratch_rows_ = 0;
  engine::Tensor x_, h_, q_, k_, v_, attn_out_, gate_, up_;
  // LM-head scratch for the selected rows, grown to the most rows asked for.
  int64_t head_rows_ = 0;
  engine::Tensor head_in_, head_normed_, head_out_;
};

// Bytes of a model's weights of `config` held in `dtype` by one rank of a tensor-parallel group
// of `tp` (every rank of a context-parallel ring holds the same).
int64_t model_weight_bytes(const LlamaConfig& config, engine::DType dtype, int tp = 1);

// Where a model comes from: an HF directory, or a preset with seeded random weights; and this
// rank's tensor-parallel slice of it.
struct ModelSpec {
  std::string dir;
  std::string preset;
  uint64_t random_seed = 0;
  TensorParallel tp;
};
// The spec's config (the directory's config.json or the preset's), without reading weights.
Result<LlamaConfig> model_config(const ModelSpec& spec);
Result<std::unique_ptr<LlamaModel>> load_model(engine::Backend& backend, const ModelSpec& spec,
                                               const LoadProgress& on_progress = nullptr);

}  // namespace burst::models
