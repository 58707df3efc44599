// LlamaModel: weights (from safetensors or a seeded generator) and the forward pass. The layer
// graph is written once against engine::Backend; attention goes through an AttentionContext so
// the same code runs one process or a BurstAttention ring.
#include "models/llama.h"

#include <algorithm>
#include <cmath>

#include "models/rope.h"
#include "models/safetensors.h"

namespace burst::models {

using engine::Tensor;

// Every weight of the model with its HF name, shape and (for random init) fan-in.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  Tensor* dst;
  bool is_norm;
};

namespace {

std::vector<WeightSpec> weight_specs(const LlamaConfig& c, Tensor& embed, Tensor& final_norm,
                                     Tensor& lm_head, std::vector<LayerWeights>& layers) {
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  const int64_t qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  std::vector<WeightSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, d}, &embed, false});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& L = layers[static_cast<size_t>(i)];
    s.push_back({p + "input_layernorm.weight", {d}, &L.attn_norm, true});
    s.push_back({p + "self_attn.q_proj.weight", {qd, d}, &L.wq, false});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, d}, &L.wk, false});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, d}, &L.wv, false});
    s.push_back({p + "self_attn.o_proj.weight", {d, qd}, &L.wo, false});
    s.push_back({p + "post_attention_layernorm.weight", {d}, &L.mlp_norm, true});
    s.push_back({p + "mlp.gate_proj.weight", {f, d}, &L.w_gate, false});
    s.push_back({p + "mlp.up_proj.weight", {f, d}, &L.w_up, false});
    s.push_back({p + "mlp.down_proj.weight", {d, f}, &L.w_down, false});
  }
  s.push_back({"model.norm.weight", {d}, &final_norm, true});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, d}, &lm_head, false});
  return s;
}

int64_t weight_bytes(const std::vector<int64_t>& shape, engine::DType dtype) {
  int64_t n = engine::dtype_size(dtype);
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

int64_t model_weight_bytes(const LlamaConfig& config, engine::DType dtype) {
  Tensor embed, final_norm, lm_head;
  std::vector<LayerWeights> layers(static_cast<size_t>(config.num_layers));
  int64_t bytes = 0;
  for (const auto& w : weight_specs(config, embed, final_norm, lm_head, layers)) {
    bytes += weight_bytes(w.shape, dtype);
  }
  return bytes;
}

engine::AttentionShape LlamaModel::attention_shape() const {
  return {static_cast<int>(config_.num_layers), static_cast<int>(config_.num_heads),
          static_cast<int>(config_.num_kv_heads), static_cast<int>(config_.head_dim)};
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(engine::Backend& backend,
                                                     const std::string& model_dir,
                                                     const LoadProgress& on_progress) {
  auto config = load_config(model_dir);
  if (!config.ok()) return config.status();
  auto files = WeightFiles::open_dir(model_dir);
  if (!files.ok()) return files.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel(backend, config.take()));
  BURST_RETURN_IF_ERROR(m->fill_weights(on_progress, [&](const WeightSpec& w, uint64_t) {
    auto view = files.value().get(w.name, w.shape);
    if (!view.ok()) return view.status();
    return backend.upload(view.value().data, view.value().dtype, *w.dst);
  }));
  return m;
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::random(engine::Backend& backend,
                                                       const LlamaConfig& config, uint64_t seed,
                                                       const LoadProgress& on_progress) {
  std::unique_ptr<LlamaModel> m(new LlamaModel(backend, config));
  BURST_RETURN_IF_ERROR(m->fill_weights(on_progress, [&](const WeightSpec& w, uint64_t index) {
    // Uniform(-a, a) with a = 1/sqrt(fan_in) keeps activations O(1) through the layers.
    const float a = w.is_norm ? 1.f : 1.f / std::sqrt(static_cast<float>(w.shape.back()));
    return backend.fill_random(*w.dst, seed * 1000003ull + index, a, w.is_norm);
  }));
  return m;
}

Status LlamaModel::fill_weights(const LoadProgress& on_progress,
                                const std::function<Status(const WeightSpec&, uint64_t)>& fill) {
  layers_.resize(static_cast<size_t>(config_.num_layers));
  const engine::DType dt = backend_.compute_dtype();
  const int64_t total = model_weight_bytes(config_, dt);
  BURST_RETURN_IF_ERROR(backend_.check_fits(total, "the model's weights"));
  // Each weight is allocated just before it is filled, so the progress counts the time of both
  // (allocating touches the memory too: on CPU, most of a load).
  int64_t done = 0;
  uint64_t index = 0;
  if (on_progress) on_progress(0, total);
  for (auto& w : weight_specs(config_, embed_, final_norm_, lm_head_, layers_)) {
    auto t = backend_.alloc(w.shape, dt);
    if (!t.ok()) return Status::error("allocating " + w.name + ": " + t.message());
    *w.dst = t.take();
    BURST_RETURN_IF_ERROR(fill(w, index++));
    done += weight_bytes(w.shape, dt);
    if (on_progress) on_progress(done, total);
  }
  if (config_.tie_word_embeddings) lm_head_ = embed_;
  return {};
}

Status LlamaModel::ensure_scratch(int64_t rows) {
  if (rows <= scratch_rows_) return {};
  const auto& c = config_;
  const int64_t mlp_rows = std::min(rows, mlp_chunk_rows_);
  const engine::DType dt = backend_.compute_dtype();
  struct Want { Tensor* t; std::vector<int64_t> shape; };
  const Want wants[] = {
      {&x_, {rows, c.hidden_size}},
      {&h_, {rows, c.hidden_size}},
      {&q_, {rows, c.num_heads * c.head_dim}},
      {&k_, {rows, c.num_kv_heads * c.head_dim}},
      {&v_, {rows, c.num_kv_heads * c.head_dim}},
      {&attn_out_, {rows, c.num_heads * c.head_dim}},
      {&gate_, {mlp_rows, c.intermediate_size}},
      {&up_, {mlp_rows, c.intermediate_size}},
  };
  for (const auto& w : wants) {
    *w.t = Tensor();  // release the old buffer before asking for the larger one
    auto t = backend_.alloc(w.shape, dt);
    if (!t.ok()) return Status::error("activations for " + std::to_string(rows) + " tokens: " +
                                      t.message());
    *w.t = t.take();
  }
  scratch_rows_ = rows;
  return {};
}

ForwardBatch ForwardBatch::of_sequence(std::vector<int32_t> ids, std::vector<int64_t> positions,
                                       std::vector<int64_t> logit_rows, int64_t seq_len) {
  ForwardBatch b;
  if (seq_len <= 0 && !positions.empty()) {
    seq_len = *std::max_element(positions.begin(), positions.end()) + 1;
  }
  b.spans = {{0, static_cast<int64_t>(ids.size()), seq_len}};
  b.ids = std::move(ids);
  b.positions = std::move(positions);
  b.logit_rows = std::move(logit_rows);
  return b;
}

Status LlamaModel::rope_runs(const std::vector<int64_t>& positions,
                             const std::vector<RopeSpan>& spans, std::vector<RopeRun>& runs) const {
  const auto rows = static_cast<int64_t>(positions.size());
  int64_t covered = 0;
  for (const RopeSpan& sp : spans) {
    if (sp.row != covered || sp.rows <= 0 || sp.seq_len <= 0) {
      return Status::error("forward: RoPE spans must tile the rows in order");
    }
    covered += sp.rows;
    std::vector<float> f = rope_inv_freq(config_, sp.seq_len);
    if (!runs.empty() && runs.back().inv_freq == f) {
      runs.back().rows += sp.rows;
    } else {
      runs.push_back({sp.row, sp.rows, std::move(f), {}});
    }
  }
  if (covered != rows) return Status::error("forward: RoPE spans must tile the rows in order");
  for (RopeRun& r : runs) {
    r.positions.assign(positions.begin() + r.row, positions.begin() + r.row + r.rows);
  }
  return {};
}

Status LlamaModel::layer(int64_t l, const std::vector<RopeRun>& runs,
                         const std::vector<int64_t>& positions, engine::AttentionContext& attn,
                         int64_t rows) {
  const auto& c = config_;
  const LayerWeights& L = layers_[static_cast<size_t>(l)];
  Tensor x = x_.rows(0, rows), h = h_.rows(0, rows), q = q_.rows(0, rows);
  Tensor k = k_.rows(0, rows), v = v_.rows(0, rows), a = attn_out_.rows(0, rows);
  const int heads = static_cast<int>(c.num_heads), kv_heads = static_cast<int>(c.num_kv_heads);
  const int hd = static_cast<int>(c.head_dim);
  const float eps = c.rms_norm_eps;
  if (runs.size() == 1) {  // rope_runs tiles the rows: one run covers them all
    BURST_RETURN_IF_ERROR(backend_.norm_project_rope(
        x, {L.attn_norm, eps, h}, {{L.wq, q}, {L.wk, k}, {L.wv, v}},
        {heads, kv_heads, hd, runs[0].positions, runs[0].inv_freq}));
  } else {
    BURST_RETURN_IF_ERROR(
        backend_.norm_project(x, {L.attn_norm, eps, h}, {{L.wq, q}, {L.wk, k}, {L.wv, v}}));
    for (const RopeRun& r : runs) {
      Tensor qr = q.rows(r.row, r.rows), kr = k.rows(r.row, r.rows);
      BURST_RETURN_IF_ERROR(
          backend_.rope_qk(qr, heads, kr, kv_heads, hd, r.positions, r.inv_freq));
    }
  }
  BURST_RETURN_IF_ERROR(attn.attend(static_cast<int>(l), q, k, v, positions, a));
  BURST_RETURN_IF_ERROR(backend_.gemm(a, L.wo, x, /*accumulate=*/true));  // x += o_proj(a)
  // The MLP is token-local: chunks bound the [rows, intermediate] activations of long
  // prefills without changing any result.
  for (int64_t r0 = 0; r0 < rows; r0 += mlp_chunk_rows_) {
    const int64_t n = std::min(mlp_chunk_rows_, rows - r0);
    Tensor xc = x.rows(r0, n), hc = h.rows(r0, n);
    Tensor gate = gate_.rows(0, n), up = up_.rows(0, n);
    BURST_RETURN_IF_ERROR(
        backend_.norm_swiglu(xc, {L.mlp_norm, eps, hc}, L.w_gate, L.w_up, gate, up));
    BURST_RETURN_IF_ERROR(backend_.gemm(gate, L.w_down, xc, /*accumulate=*/true));
  }
  return {};
}

Status LlamaModel::lm_head(int64_t rows, const std::vector<int64_t>& head_rows, int64_t n_logits,
                           const SampleRows& sample, std::vector<float>& logits,
                           std::vector<int32_t>& sampled) {
  const auto& c = config_;
  const auto n = static_cast<int64_t>(head_rows.size());
  // Kept between forwards: every decode step needs them, and a device allocation per token
  // would sit on the hot path (cudaMalloc synchronises).
  if (head_rows_ < n) {
    const engine::DType dt = backend_.compute_dtype();
    for (auto* t : {&head_in_, &head_normed_, &head_out_}) *t = Tensor();
    auto sel = backend_.alloc({n, c.hidden_size}, dt);
    auto normed = backend_.alloc({n, c.hidden_size}, dt);
    auto out = backend_.alloc({n, c.vocab_size}, dt);
    for (auto* t : {&sel, &normed, &out}) {
      if (!t->ok()) return Status::error("lm head: " + t->message());
    }
    head_in_ = sel.take();
    head_normed_ = normed.take();
    head_out_ = out.take();
    head_rows_ = n;
  }
  Tensor x = x_.rows(0, rows);
  Tensor sel = head_in_.rows(0, n), normed = head_normed_.rows(0, n), out = head_out_.rows(0, n);
  for (int64_t i = 0; i < n; ++i) {
    Tensor dst = sel.rows(i, 1);
    BURST_RETURN_IF_ERROR(backend_.copy(x.rows(head_rows[static_cast<size_t>(i)], 1), dst));
  }
  BURST_RETURN_IF_ERROR(backend_.rms_norm(sel, final_norm_, c.rms_norm_eps, normed));
  BURST_RETURN_IF_ERROR(backend_.gemm(normed, lm_head_, out, false));
  if (!sample.rows.empty()) {
    const Tensor drawn_rows = out.rows(n_logits, n - n_logits);
    if (sample.queued) {
      BURST_RETURN_IF_ERROR(backend_.sample_queued(drawn_rows, sample.params, sample.uniforms));
    } else {
      std::vector<int32_t> drawn;
      BURST_RETURN_IF_ERROR(backend_.sample(drawn_rows, sample.params, sample.uniforms, drawn));
      sampled.insert(sampled.end(), drawn.begin(), drawn.end());
    }
  }
  if (n_logits == 0) return {};  // sample() waited for its ids (sample_queued() did not)
  std::vector<float> host;
  BURST_RETURN_IF_ERROR(backend_.download(out.rows(0, n_logits), host));
  logits.insert(logits.end(), host.begin(), host.end());
  return {};
}

Status LlamaModel::forward(const ForwardBatch& batch, engine::AttentionContext& attn,
                           ForwardOutput& out, const LayerHook& after_layer) {
  const std::vector<int32_t>& ids = batch.ids;
  const std::vector<int64_t>& positions = batch.positions;
  const SampleRows& sample = batch.sample;
  out.logits.clear();
  out.sampled.clear();
  const auto rows = static_cast<int64_t>(ids.size());
  if (rows == 0) return Status::error("forward: no tokens");
  if (positions.size() != ids.size()) return Status::error("forward: one position per token");
  // RoPE runs per run of rows that share their frequencies (only dynamic scaling makes them
  // differ between sequences); the runs must tile the rows.
  std::vector<RopeRun> runs;
  BURST_RETURN_IF_ERROR(rope_runs(positions, batch.spans, runs));
  // The LM head's rows: the logit rows, then the sampled rows.
  std::vector<int64_t> head_rows = batch.logit_rows;
  head_rows.insert(head_rows.end(), sample.rows.begin(), sample.rows.end());
  for (int64_t r : head_rows) {
    if (r < 0 || r >= rows) return Status::error("forward: logit row outside the batch");
  }
  if (sample.params.size() != sample.size() || sample.uniforms.size() != sample.size()) {
    return Status::error("forward: one sampling params and one uniform per sampled row");
  }
  BURST_RETURN_IF_ERROR(ensure_scratch(rows));
  Tensor x = x_.rows(0, rows);
  BURST_RETURN_IF_ERROR(backend_.embedding(embed_, ids, x));
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    BURST_RETURN_IF_ERROR(layer(l, runs, positions, attn, rows));
    if (after_layer) BURST_RETURN_IF_ERROR(after_layer(l + 1));
  }
  if (head_rows.empty()) return backend_.synchronize();
  // Final norm and LM head only for the wanted rows (the last prompt position, in prefill).
  return lm_head(rows, head_rows, static_cast<int64_t>(batch.logit_rows.size()), sample,
                 out.logits, out.sampled);
}

Result<std::unique_ptr<LlamaModel>> load_model(engine::Backend& backend, const ModelSpec& spec,
                                               const LoadProgress& on_progress) {
  if (spec.dir.empty() == spec.preset.empty()) {
    return Status::error("give exactly one of a model directory or a preset");
  }
  if (!spec.dir.empty()) return LlamaModel::load(backend, spec.dir, on_progress);
  auto config = preset_config(spec.preset);
  if (!config.ok()) return config.status();
  return LlamaModel::random(backend, config.value(), spec.random_seed, on_progress);
}

}  // namespace burst::models
