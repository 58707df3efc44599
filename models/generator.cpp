#include "models/generator.h"

#include <chrono>
#include <numeric>

namespace burst::models {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

Status validate(const GenerateRequest& request) {
  if (request.prompt.empty()) return Status::error("the prompt is empty");
  if (request.max_tokens <= 0) return Status::error("max_tokens must be > 0");
  const std::string bad = engine::validate(request.sampling);
  if (!bad.empty()) return Status::error(bad);
  return {};
}

// The stats of a request cancelled before its first token.
GenerateStats cancelled_in_prefill(int64_t prompt_tokens, double prefill_ms) {
  GenerateStats s;
  s.prompt_tokens = prompt_tokens;
  s.prefill_ms = prefill_ms;
  s.finish_reason = "cancelled";
  return s;
}
}  // namespace

Result<GenerateStats> generate(LlamaModel& model, engine::AttentionContext& cache,
                               const GenerateRequest& request, const TokenCallback& on_token,
                               const ProgressCallback& on_progress) {
  const auto& c = model.config();
  const auto n = static_cast<int64_t>(request.prompt.size());
  BURST_RETURN_IF_ERROR(validate(request));
  if (n > cache.capacity()) {
    return Status::error("the prompt has " + std::to_string(n) + " tokens; the KV cache holds " +
                         std::to_string(cache.capacity()));
  }
  cache.clear();
  engine::Sampler sampler(request.sampling);
  GenerateStats stats;
  stats.prompt_tokens = n;
  std::vector<int64_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), 0);
  std::vector<float> logits;
  auto t0 = std::chrono::steady_clock::now();
  bool cancelled = false;
  LayerHook hook;
  if (on_progress) {
    hook = [&](int64_t done) -> Status {
      if (on_progress(static_cast<double>(done) / c.num_layers)) return {};
      cancelled = true;
      return Status::error("cancelled during the prefill");
    };
  }
  // Every token is drawn on the model's backend (no logits to the host: nothing here reads
  // them), with this request's random stream: the uniform sampler.sample() would use.
  std::vector<int32_t> sampled;
  auto last_row = [&](int64_t row) {
    return SampleRows{{row}, {request.sampling}, {sampler.draw_uniform()}};
  };
  Status st = model.forward(request.prompt, positions, cache, {}, logits, last_row(n - 1), sampled,
                            {{0, n, n}}, hook);
  if (cancelled) {
    cache.clear();
    return cancelled_in_prefill(n, ms_since(t0));
  }
  if (!st.ok()) return st;
  int32_t token = sampled.at(0);
  stats.prefill_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  int64_t pos = n;
  while (true) {
    ++stats.generated_tokens;
    if (!on_token(token)) {
      stats.finish_reason = "cancelled";
      break;
    }
    if (request.stop_at_eos && token == c.eos_token_id) {
      stats.finish_reason = "stop";
      break;
    }
    if (stats.generated_tokens >= request.max_tokens || pos >= cache.capacity()) {
      stats.finish_reason = "length";
      break;
    }
    sampled.clear();
    st = model.forward({token}, {pos}, cache, {}, logits, last_row(0), sampled, {{0, 1, pos + 1}});
    if (!st.ok()) return st;
    token = sampled.at(0);
    ++pos;
  }
  stats.decode_ms = ms_since(t0);
  cache.clear();
  return stats;
}

Result<GenerateStats> generate_sharded(LlamaModel& model, engine::RingAttention& ring,
                                       engine::Communicator& comm, engine::ShardLayout layout,
                                       const GenerateRequest& request,
                                       const TokenCallback& on_token,
                                       const ProgressCallback& on_progress) {
  const auto& c = model.config();
  const int rank = comm.rank();
  const auto n = static_cast<int64_t>(request.prompt.size());
  BURST_RETURN_IF_ERROR(validate(request));
  // One sequence through the batch runner: a prefill step of the whole prompt, then one decode
  // step per token. Rank 0 samples; {token, stop} is broadcast so every rank feeds the same
  // token to the next step and stops at the same one.
  constexpr uint64_t kSeq = 0;
  BatchRunner runner(model, ring, comm);
  runner.release_all();
  GenerateStats stats;
  stats.prompt_tokens = n;
  auto t0 = std::chrono::steady_clock::now();
  // After every layer rank 0 says whether to go on (its client may be gone); every rank takes
  // part in the broadcast, so all stop at the same layer and the ring never half-runs.
  bool cancelled = false;
  const LayerHook hook = [&](int64_t done) -> Status {
    int32_t go_on = 1;
    if (rank == 0 && on_progress) go_on = on_progress(double(done) / c.num_layers) ? 1 : 0;
    BURST_RETURN_IF_ERROR(comm.broadcast(&go_on, sizeof go_on, 0));
    if (go_on) return {};
    cancelled = true;
    return Status::error(StatusCode::kCancelled, "cancelled during the prefill");
  };
  StepPlan plan;
  plan.layout = layout;
  plan.seqs.push_back(prefill_work(kSeq, request.prompt, 0, n, request.sampling));
  auto r = runner.step(plan, hook);
  if (cancelled) {
    runner.release_all();
    return cancelled_in_prefill(n, ms_since(t0));
  }
  if (!r.ok()) return r.status();
  // {token, stop}: rank 0 decides both, so a cancel on rank 0 stops every rank at once.
  int32_t msg[2] = {0, 0};
  if (rank == 0) msg[0] = r.value().tokens.at(0).token;
  BURST_RETURN_IF_ERROR(comm.broadcast(msg, sizeof msg, 0));
  stats.prefill_ms = ms_since(t0);
  t0 = std::chrono::steady_clock::now();
  int64_t pos = n;
  while (true) {
    const int32_t token = msg[0];
    ++stats.generated_tokens;
    if (rank == 0 && !on_token(token)) msg[1] = 1;
    if (request.stop_at_eos && token == c.eos_token_id) {
      stats.finish_reason = "stop";
    } else if (stats.generated_tokens >= request.max_tokens) {
      stats.finish_reason = "length";
    }
    // Every rank reaches the same decision from the same broadcast values, except a cancel,
    // which only rank 0 sees: share it.
    BURST_RETURN_IF_ERROR(comm.broadcast(&msg[1], sizeof msg[1], 0));
    if (msg[1]) {
      stats.finish_reason = "cancelled";
      break;
    }
    if (!stats.finish_reason.empty()) break;
    StepPlan d;
    d.seqs.push_back(decode_work(kSeq, token, pos, n, request.sampling));
    r = runner.step(d);
    if (!r.ok()) return r.status();
    if (rank == 0) msg[0] = r.value().tokens.at(0).token;
    BURST_RETURN_IF_ERROR(comm.broadcast(msg, sizeof msg, 0));
    ++pos;
  }
  stats.decode_ms = ms_since(t0);
  runner.release_all();
  return stats;
}

}  // namespace burst::models
