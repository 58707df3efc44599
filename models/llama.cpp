// LlamaModel: weights (from safetensors or a seeded generator) and the forward pass. The layer
// graph is written once against engine::Backend; attention goes through an AttentionContext so
// the same code runs one process or a BurstAttention ring.
#include "models/llama.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "models/rope.h"
#include "models/safetensors.h"

namespace burst::models {

using engine::Tensor;

// Every weight of the model with its HF name, its full shape (what the file holds, what
// random init draws) and this rank's part of it (rows or columns under tensor parallelism).
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;   // the whole weight
  WeightFiles::Window window;   // this rank's part (whole: rows and cols -1)
  Tensor* dst;
  bool is_norm;
  std::vector<int64_t> local_shape() const {
    std::vector<int64_t> l = shape;
    if (window.rows >= 0) l[0] = window.rows;
    if (window.cols >= 0) l[1] = window.cols;
    return l;
  }
};

namespace {

// The part of a weight made of `blocks` blocks of `block` rows (or columns) from block
// `first_block` on: a rank's heads, or its share of the MLP.
WeightFiles::Window rows_of(int64_t first_block, int64_t blocks, int64_t block) {
  return {first_block * block, blocks * block, 0, -1};
}
WeightFiles::Window cols_of(int64_t first_block, int64_t blocks, int64_t block) {
  return {0, -1, first_block * block, blocks * block};
}

std::vector<WeightSpec> weight_specs(const LlamaConfig& c, TensorParallel tp, Tensor& embed,
                                     Tensor& final_norm, Tensor& lm_head,
                                     std::vector<LayerWeights>& layers) {
  const int64_t d = c.hidden_size, f = c.intermediate_size, hd = c.head_dim;
  const int64_t qd = c.num_heads * hd, kvd = c.num_kv_heads * hd;
  const WeightFiles::Window whole;
  const bool split = tp.size > 1;
  // Query heads [t H/T, (t+1) H/T); KV heads [t KV/T, ...) or, when T exceeds them, the one
  // head those queries read (t / (T / KV)).
  const int64_t heads = c.num_heads / tp.size;
  const int64_t kv_heads = std::max<int64_t>(1, c.num_kv_heads / tp.size);
  const int64_t kv_first = c.num_kv_heads >= tp.size ? tp.rank * kv_heads
                                                     : tp.rank / (tp.size / c.num_kv_heads);
  const int64_t ff = f / tp.size;
  const auto q_rows = split ? rows_of(tp.rank * heads, heads, hd) : whole;
  const auto kv_rows = split ? rows_of(kv_first, kv_heads, hd) : whole;
  const auto o_cols = split ? cols_of(tp.rank * heads, heads, hd) : whole;
  const auto ff_rows = split ? rows_of(tp.rank, 1, ff) : whole;
  const auto ff_cols = split ? cols_of(tp.rank, 1, ff) : whole;
  std::vector<WeightSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, d}, whole, &embed, false});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights& L = layers[static_cast<size_t>(i)];
    s.push_back({p + "input_layernorm.weight", {d}, whole, &L.attn_norm, true});
    s.push_back({p + "self_attn.q_proj.weight", {qd, d}, q_rows, &L.wq, false});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, d}, kv_rows, &L.wk, false});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, d}, kv_rows, &L.wv, false});
    s.push_back({p + "self_attn.o_proj.weight", {d, qd}, o_cols, &L.wo, false});
    s.push_back({p + "post_attention_layernorm.weight", {d}, whole, &L.mlp_norm, true});
    s.push_back({p + "mlp.gate_proj.weight", {f, d}, ff_rows, &L.w_gate, false});
    s.push_back({p + "mlp.up_proj.weight", {f, d}, ff_rows, &L.w_up, false});
    s.push_back({p + "mlp.down_proj.weight", {d, f}, ff_cols, &L.w_down, false});
  }
  s.push_back({"model.norm.weight", {d}, whole, &final_norm, true});
  if (!c.tie_word_embeddings) {
    s.push_back({"lm_head.weight", {c.vocab_size, d}, whole, &lm_head, false});
  }
  return s;
}

int64_t shape_bytes(const std::vector<int64_t>& shape, engine::DType dtype) {
  int64_t n = engine::dtype_size(dtype);
  for (int64_t d : shape) n *= d;
  return n;
}

// Buffers HF LLaMA checkpoints may carry that no weight reads: transformers before 4.31 saved
// each layer's RoPE inverse frequencies (model.layers.N.self_attn.rotary_emb.inv_freq; the
// LLaMA-2 *-hf checkpoints hold them); the engine derives its own from the config.
bool harmless_extra(const std::string& name) {
  const std::string tail = "rotary_emb.inv_freq";
  return name.size() >= tail.size() &&
         name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
}

// Why a tensor the weight list does not name is there, in the config's words.
std::string unused_reason(const LlamaConfig& c, const std::string& name) {
  const std::string layers = "model.layers.";
  if (name.rfind(layers, 0) == 0) {
    const size_t dot = name.find('.', layers.size());
    const std::string index = name.substr(layers.size(), dot - layers.size());
    if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
        index.size() < 10 && std::stoll(index) >= c.num_layers) {
      return "config.json gives num_hidden_layers " + std::to_string(c.num_layers) +
             ", but the checkpoint has layer " + index + " (a config of another model?)";
    }
  }
  if (name == "lm_head.weight" && c.tie_word_embeddings) {
    return "config.json gives tie_word_embeddings true (the output head is the embedding "
           "table), but the checkpoint has its own head";
  }
  return "no weight of a LlamaForCausalLM of this config has that name";
}

// The checkpoint against the config, before any weight is read (by header and name only, so a
// tensor-parallel rank, which reads only its slices, checks the same thing as a whole load):
//  - every tensor is one the model reads, or a harmless buffer: a tensor no weight reads means
//    the config describes another model (fewer layers, a tied head) and would run silently;
//  - a 16-bit dtype the config declares (bfloat16 / float16) is the header dtype of at least
//    one weight. F16 and BF16 have the same size, so bytes of one labelled the other pass every
//    size check and load as garbage. A float32 declaration is not held against half-precision
//    headers (a converter that upcasts in memory writes it, models/kjv-tiny does; the values
//    load exactly), nor a 16-bit one against F32 headers (no 16-bit bytes can pass as F32).
// WeightFiles::read also judges the bytes of every 16-bit matrix against its header dtype.
Status check_checkpoint(const LlamaConfig& c, const WeightFiles& files,
                        const std::string& model_dir) {
  Tensor embed, final_norm, lm_head;
  std::vector<LayerWeights> layers(static_cast<size_t>(c.num_layers));
  const auto specs = weight_specs(c, TensorParallel{0, 1}, embed, final_norm, lm_head, layers);
  std::set<std::string> wanted;
  for (const auto& w : specs) wanted.insert(w.name);
  for (const auto& name : files.names()) {
    if (wanted.count(name) != 0 || harmless_extra(name)) continue;
    const TensorView* v = files.find(name);
    return Status::error((v != nullptr ? v->file : model_dir) + ": tensor \"" + name +
                         "\" is not used by the model: " + unused_reason(c, name) +
                         "; refused rather than served with part of the checkpoint ignored");
  }
  const bool half = c.torch_dtype == engine::DType::kF16 || c.torch_dtype == engine::DType::kBF16;
  if (c.torch_dtype_field.empty() || !half) return {};
  const std::string declared = c.torch_dtype == engine::DType::kF16 ? "F16" : "BF16";
  const std::string other = c.torch_dtype == engine::DType::kF16 ? "BF16" : "F16";
  const TensorView* example = nullptr;
  for (const auto& w : specs) {
    const TensorView* v = files.find(w.name);
    if (v == nullptr) continue;  // read() names the missing tensor
    if (v->file_dtype == declared) return {};
    if (v->file_dtype == other && example == nullptr) example = v;
  }
  if (example == nullptr) return {};
  return Status::error(model_dir + "/config.json: field \"" + c.torch_dtype_field + "\" is \"" +
                       (declared == "F16" ? "float16" : "bfloat16") +
                       "\", but no weight's header dtype is " + declared + " (tensor \"" +
                       example->name + "\" in " + example->file + " is " + other +
                       "): one of the two names the wrong 16-bit type, and " + other +
                       " bytes read as " + declared + " (or the reverse) are garbage");
}

}  // namespace

std::string tensor_parallel_error(const LlamaConfig& c, int tp) {
  const std::string t = "tensor parallelism " + std::to_string(tp);
  if (tp < 1) return t + " is not a group size (give --tp 1 or more)";
  if (tp == 1) return "";
  if (c.num_heads % tp != 0) {
    return t + " does not divide the model's " + std::to_string(c.num_heads) +
           " attention heads (each rank holds an equal share of them)";
  }
  if (c.num_kv_heads % tp != 0 && tp % c.num_kv_heads != 0) {
    return t + " neither divides the model's " + std::to_string(c.num_kv_heads) +
           " KV heads nor is a multiple of them (a rank holds its share of the KV heads, or one "
           "KV head replicated over tp / KV heads ranks)";
  }
  if (c.intermediate_size % tp != 0) {
    return t + " does not divide the model's intermediate size " +
           std::to_string(c.intermediate_size) + " (each rank holds an equal share of the MLP)";
  }
  return "";
}

int64_t model_weight_bytes(const LlamaConfig& config, engine::DType dtype, int tp) {
  Tensor embed, final_norm, lm_head;
  std::vector<LayerWeights> layers(static_cast<size_t>(config.num_layers));
  int64_t bytes = 0;
  const TensorParallel slice{0, std::max(tp, 1)};
  for (const auto& w : weight_specs(config, slice, embed, final_norm, lm_head, layers)) {
    bytes += shape_bytes(w.local_shape(), dtype);
  }
  return bytes;
}

int64_t LlamaModel::weight_bytes() const {
  return model_weight_bytes(config_, backend_.compute_dtype(), tp_.size);
}

engine::AttentionShape LlamaModel::attention_shape() const {
  const int kv = static_cast<int>(config_.num_kv_heads);
  return {static_cast<int>(config_.num_layers), static_cast<int>(config_.num_heads) / tp_.size,
          std::max(1, kv / tp_.size), static_cast<int>(config_.head_dim),
          rope_logit_scale(config_)};
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::create(engine::Backend& backend,
                                                       LlamaConfig config, TensorParallel tp) {
  if (tp.rank < 0 || tp.rank >= tp.size) {
    return Status::error("tensor-parallel rank " + std::to_string(tp.rank) +
                         " outside a group of " + std::to_string(tp.size));
  }
  if (std::string e = tensor_parallel_error(config, tp.size); !e.empty()) {
    return Status::error(e);
  }
  return std::unique_ptr<LlamaModel>(new LlamaModel(backend, std::move(config), tp));
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::load(engine::Backend& backend,
                                                     const std::string& model_dir,
                                                     const LoadProgress& on_progress,
                                                     TensorParallel tp) {
  auto config = load_config(model_dir);
  if (!config.ok()) return config.status();
  // A layout the model cannot take is refused before any weight is read.
  auto m = create(backend, config.take(), tp);
  if (!m.ok()) return m.status();
  auto files = WeightFiles::open_dir(model_dir);
  if (!files.ok()) return files.status();
  BURST_RETURN_IF_ERROR(check_checkpoint(m.value()->config(), files.value(), model_dir));
  std::vector<char> buffer;
  BURST_RETURN_IF_ERROR(m.value()->fill_weights(on_progress, [&](const WeightSpec& w, uint64_t) {
    auto part = files.value().read(w.name, w.shape, w.window, buffer);
    if (!part.ok()) return part.status();
    return backend.upload(part.value().data, part.value().dtype, *w.dst);
  }));
  m.value()->file_bytes_read_ = files.value().bytes_read();
  return m;
}

Result<std::unique_ptr<LlamaModel>> LlamaModel::random(engine::Backend& backend,
                                                       const LlamaConfig& config, uint64_t seed,
                                                       const LoadProgress& on_progress,
                                                       TensorParallel tp) {
  auto m = create(backend, config, tp);
  if (!m.ok()) return m.status();
  BURST_RETURN_IF_ERROR(m.value()->fill_weights(on_progress, [&](const WeightSpec& w,
                                                                 uint64_t index) {
    // Norm weights are 1; the others Uniform(-a, a) with a = 1/sqrt(fan_in), which keeps
    // activations O(1) through the layers; a slice draws the whole weight's values at its place.
    if (w.is_norm) return backend.fill(*w.dst, 1.f);
    const float a = 1.f / std::sqrt(static_cast<float>(w.shape.back()));
    engine::Backend::RandomWindow window;
    if (w.shape.size() == 2) {
      window = {w.shape[1], std::max<int64_t>(w.window.row0, 0),
                std::max<int64_t>(w.window.col0, 0)};
    }
    return backend.fill_random(*w.dst, seed * 1000003ull + index, a, window);
  }));
  return m;
}

Status LlamaModel::fill_weights(const LoadProgress& on_progress,
                                const std::function<Status(const WeightSpec&, uint64_t)>& fill) {
  layers_.resize(static_cast<size_t>(config_.num_layers));
  const engine::DType dt = backend_.compute_dtype();
  const int64_t total = weight_bytes();
  BURST_RETURN_IF_ERROR(backend_.check_fits(
      total, tp_.size > 1 ? "this rank's share of the model's weights" : "the model's weights"));
  // Each weight is allocated just before it is filled, so the progress counts the time of both
  // (allocating touches the memory too: on CPU, most of a load).
  int64_t done = 0;
  uint64_t index = 0;
  if (on_progress) on_progress(0, total);
  for (auto& w : weight_specs(config_, tp_, embed_, final_norm_, lm_head_, layers_)) {
    auto t = backend_.alloc(w.local_shape(), dt);
    if (!t.ok()) return Status::error("allocating " + w.name + ": " + t.message());
    *w.dst = t.take();
    BURST_RETURN_IF_ERROR(fill(w, index++));
    done += shape_bytes(w.local_shape(), dt);
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
  const engine::AttentionShape a = attention_shape();
  const int64_t qw = int64_t{a.heads} * a.head_dim, kvw = int64_t{a.kv_heads} * a.head_dim;
  const int64_t ff = c.intermediate_size / tp_.size;
  const Want wants[] = {
      {&x_, {rows, c.hidden_size}}, {&h_, {rows, c.hidden_size}},  {&q_, {rows, qw}},
      {&k_, {rows, kvw}},           {&v_, {rows, kvw}},            {&attn_out_, {rows, qw}},
      {&gate_, {mlp_rows, ff}},     {&up_, {mlp_rows, ff}},
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
                         int64_t rows, bool& normed) {
  const LayerWeights& L = layers_[static_cast<size_t>(l)];
  Tensor x = x_.rows(0, rows), h = h_.rows(0, rows), q = q_.rows(0, rows);
  Tensor k = k_.rows(0, rows), v = v_.rows(0, rows), a = attn_out_.rows(0, rows);
  const engine::AttentionShape shape = attention_shape();
  const int heads = shape.heads, kv_heads = shape.kv_heads, hd = shape.head_dim;
  const float eps = config_.rms_norm_eps;
  const engine::Backend::Norm attn_norm{L.attn_norm, eps, h, normed};
  normed = false;
  if (runs.size() == 1) {  // rope_runs tiles the rows: one run covers them all
    BURST_RETURN_IF_ERROR(backend_.norm_project_rope(
        x, attn_norm, {{L.wq, q}, {L.wk, k}, {L.wv, v}},
        {heads, kv_heads, hd, runs[0].positions, runs[0].inv_freq}));
  } else {
    BURST_RETURN_IF_ERROR(
        backend_.norm_project(x, attn_norm, {{L.wq, q}, {L.wk, k}, {L.wv, v}}));
    for (const RopeRun& r : runs) {
      Tensor qr = q.rows(r.row, r.rows), kr = k.rows(r.row, r.rows);
      BURST_RETURN_IF_ERROR(
          backend_.rope_qk(qr, heads, kr, kv_heads, hd, r.positions, r.inv_freq));
    }
  }
  BURST_RETURN_IF_ERROR(attn.attend(static_cast<int>(l), q, k, v, positions, a));
  // The MLP is token-local: chunks bound the [rows, intermediate] activations of long
  // prefills without changing any result. In one chunk (a decode step), each row-parallel sum
  // may norm x for the RMSNorm that follows it.
  const bool one_chunk = rows <= mlp_chunk_rows_;
  engine::Backend::Norm mlp_norm{L.mlp_norm, eps, h};
  BURST_RETURN_IF_ERROR(row_parallel(a, L.wo, x, h, one_chunk ? &mlp_norm : nullptr));
  for (int64_t r0 = 0; r0 < rows; r0 += mlp_chunk_rows_) {
    const int64_t n = std::min(mlp_chunk_rows_, rows - r0);
    Tensor xc = x.rows(r0, n), hc = h.rows(r0, n);
    Tensor gate = gate_.rows(0, n), up = up_.rows(0, n);
    BURST_RETURN_IF_ERROR(backend_.norm_swiglu(xc, {L.mlp_norm, eps, hc, mlp_norm.ready},
                                               L.w_gate, L.w_up, gate, up));
    if (one_chunk && l + 1 < config_.num_layers) {  // the next layer's attention norm
      engine::Backend::Norm next{layers_[static_cast<size_t>(l + 1)].attn_norm, eps, h};
      BURST_RETURN_IF_ERROR(row_parallel(gate, L.w_down, xc, hc, &next));
      normed = next.ready;
    } else {
      BURST_RETURN_IF_ERROR(row_parallel(gate, L.w_down, xc, hc));  // xc += down(gate)
    }
  }
  return {};
}

Status LlamaModel::row_parallel(const Tensor& in, const Tensor& w, Tensor& x, Tensor& scratch,
                                engine::Backend::Norm* next) {
  if (tp_.size == 1) return backend_.gemm(in, w, x, /*accumulate=*/true);
  if (tp_comm_ == nullptr) {
    return Status::error("forward: tensor parallelism " + std::to_string(tp_.size) +
                         " without its communicator (set_tensor_parallel_comm)");
  }
  BURST_RETURN_IF_ERROR(backend_.gemm(in, w, scratch, /*accumulate=*/false));
  if (next != nullptr) {
    const engine::Communicator::NormAfter norm{next->w.data, next->eps, next->h.data,
                                               x.dim(0), x.dim(1)};
    auto fused = tp_comm_->all_reduce_add_norm(scratch.data, x.data, scratch.dtype, norm);
    if (!fused.ok()) return fused.status();
    next->ready = fused.value();
    if (next->ready) return {};
  }
  return tp_comm_->all_reduce_add(scratch.data, x.data, scratch.numel(), scratch.dtype);
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
  BURST_RETURN_IF_ERROR(backend_.embedding(embed_, ids, batch.drawn, x));
  bool normed = false;  // h holds the next layer's attention norm of x (layer)
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    BURST_RETURN_IF_ERROR(layer(l, runs, positions, attn, rows, normed));
    if (after_layer) BURST_RETURN_IF_ERROR(after_layer(l + 1));
  }
  if (head_rows.empty()) return backend_.synchronize();
  // Final norm and LM head only for the wanted rows (the last prompt position, in prefill).
  return lm_head(rows, head_rows, static_cast<int64_t>(batch.logit_rows.size()), sample,
                 out.logits, out.sampled);
}

Result<LlamaConfig> model_config(const ModelSpec& spec) {
  if (spec.dir.empty() == spec.preset.empty()) {
    return Status::error("give exactly one of a model directory or a preset");
  }
  return spec.dir.empty() ? preset_config(spec.preset) : load_config(spec.dir);
}

Result<std::unique_ptr<LlamaModel>> load_model(engine::Backend& backend, const ModelSpec& spec,
                                               const LoadProgress& on_progress) {
  if (spec.dir.empty() == spec.preset.empty()) {
    return Status::error("give exactly one of a model directory or a preset");
  }
  if (!spec.dir.empty()) return LlamaModel::load(backend, spec.dir, on_progress, spec.tp);
  auto config = preset_config(spec.preset);
  if (!config.ok()) return config.status();
  return LlamaModel::random(backend, config.value(), spec.random_seed, on_progress, spec.tp);
}

}  // namespace burst::models
