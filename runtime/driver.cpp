#include "runtime/driver.h"

#include <algorithm>
#include <chrono>

namespace burst::runtime {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

std::string validate(const GenerateRequest& request) {
  if (request.prompt.empty()) return "the prompt is empty";
  if (request.max_tokens <= 0) return "max_tokens must be > 0";
  if (request.prefill_chunk < 0) return "prefill_chunk must be >= 0";
  return engine::validate(request.sampling);
}

Result<GenerateStats> generate(StepRunner& runner, const GenerateRequest& request,
                               const TokenCallback& on_token, const ProgressCallback& on_progress,
                               uint64_t id) {
  if (const std::string bad = validate(request); !bad.empty()) {
    return Status::error(StatusCode::kInvalidArgument, bad);
  }
  const auto n = static_cast<int64_t>(request.prompt.size());
  const int64_t need = n + request.max_tokens;
  if (need > runner.kv_capacity_tokens()) {
    return Status::error(StatusCode::kResourceExhausted,
                         "the request needs " + std::to_string(need) +
                             " KV tokens (prompt + max_tokens); the group holds " +
                             std::to_string(runner.kv_capacity_tokens()));
  }
  const int64_t chunk = request.prefill_chunk > 0 ? request.prefill_chunk : n;
  GenerateStats stats;
  stats.prompt_tokens = n;
  auto t0 = Clock::now();
  bool cancelled = false;
  Result<StepResult> r = StepResult{};
  for (int64_t start = 0; start < n && !cancelled; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    StepPlan plan;
    plan.layout = request.layout;
    plan.seqs.push_back(prefill_work(id, request.prompt, start, len, request.sampling));
    StepProgress layer;
    if (on_progress) {
      // Layers before the last; the chunk's end is reported once the step is back.
      layer = [&](int done, int layers) {
        const double f = (static_cast<double>(start) + static_cast<double>(len) * done / layers) /
                         static_cast<double>(n);
        if (done < layers && !cancelled && !on_progress(f)) cancelled = true;
        return !cancelled;
      };
    }
    r = runner.run_step(plan, layer);
    if (!r.ok() && r.code() == StatusCode::kCancelled && cancelled) break;
    if (!r.ok()) return r.status();
    if (on_progress && !cancelled && !on_progress(static_cast<double>(start + len) / n)) {
      cancelled = true;
    }
  }
  stats.prefill_ms = ms_since(t0);
  t0 = Clock::now();
  int64_t pos = n;
  while (!cancelled) {
    const int32_t token = r.value().tokens.at(0).token;
    ++stats.generated_tokens;
    if (!on_token(token)) {
      cancelled = true;
      break;
    }
    if (request.stop_at_eos && token == runner.eos_token_id()) {
      stats.finish_reason = FinishReason::kStop;
      break;
    }
    if (stats.generated_tokens >= request.max_tokens) {
      stats.finish_reason = FinishReason::kLength;
      break;
    }
    StepPlan plan;
    plan.seqs.push_back(decode_work(id, token, pos++, n, request.sampling));
    r = runner.run_step(plan, nullptr);
    if (!r.ok()) return r.status();
  }
  if (r.ok()) {
    stats.ring_compute_ms = r.value().ring_compute_ms;
    stats.ring_wait_ms = r.value().ring_wait_ms;
  }
  stats.decode_ms = ms_since(t0);
  if (cancelled) stats.finish_reason = FinishReason::kCancelled;
  // Free the sequence's pages on every rank now.
  StepPlan done;
  done.release.push_back(id);
  auto freed = runner.run_step(done, nullptr);
  if (!freed.ok()) return freed.status();
  return stats;
}

Result<std::unique_ptr<LocalStepRunner>> LocalStepRunner::create(models::Model& model,
                                                                 int64_t capacity,
                                                                 int page_size,
                                                                 engine::KvCacheDtype kv_dtype,
                                                                 engine::AttentionDtype attention) {
  std::unique_ptr<LocalStepRunner> r(new LocalStepRunner(model));
  r->comm_ = engine::make_local_communicator();
  if (page_size <= 0) page_size = engine::kv_page_size(model.backend());
  auto ring = engine::RingAttention::create(model.backend(), *r->comm_, model.attention_shape(),
                                            capacity, page_size, kv_dtype, attention);
  if (!ring.ok()) return ring.status();
  r->ring_ = ring.take();
  r->batch_ = std::make_unique<BatchRunner>(model, *r->ring_, *r->comm_);
  return r;
}

Result<StepResult> LocalStepRunner::run_step(const StepPlan& plan, const StepProgress& on_layer) {
  bool stopped = false;
  models::LayerHook hook;
  if (on_layer) {
    const int layers = model_.info().num_layers;
    hook = [&](int64_t done) -> Status {
      if (on_layer(static_cast<int>(done), layers)) return {};
      stopped = true;
      return Status::error(StatusCode::kCancelled, "cancelled during the prefill");
    };
  }
  auto r = batch_->step(plan, hook);
  if (!r.ok()) {
    // A failed step leaves the ring mid-step: this one-rank group starts afresh (what a worker
    // group's restart is to its ranks), so the runner stays usable.
    batch_->release_all();
    if (stopped) return Status::error(StatusCode::kCancelled, "cancelled during the prefill");
  }
  return r;
}

}  // namespace burst::runtime
