#include "models/generator.h"

#include <chrono>
#include <numeric>

namespace burst::models {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Result<GenerateStats> generate(LlamaModel& model, engine::AttentionContext& cache,
                               const GenerateRequest& request, const TokenCallback& on_token) {
  const auto& c = model.config();
  const auto n = static_cast<int64_t>(request.prompt.size());
  if (n == 0) return Status::error("the prompt is empty");
  if (request.max_tokens <= 0) return Status::error("max_tokens must be > 0");
  const std::string bad = engine::validate(request.sampling);
  if (!bad.empty()) return Status::error(bad);
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
  Status st = model.forward(request.prompt, positions, cache, {n - 1}, logits);
  if (!st.ok()) return st;
  int32_t token = sampler.sample(logits.data(), c.vocab_size);
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
    logits.clear();
    st = model.forward({token}, {pos}, cache, {0}, logits);
    if (!st.ok()) return st;
    token = sampler.sample(logits.data(), c.vocab_size);
    ++pos;
  }
  stats.decode_ms = ms_since(t0);
  cache.clear();
  return stats;
}

}  // namespace burst::models
