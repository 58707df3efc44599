// One request alone, start to end: the single-request driver of burst-generate and the tests.
// It plans the steps a scheduler would (the prompt in prefill chunks, then one decode step per
// token) and hands each to a StepRunner: a BatchRunner in this process over a one-rank
// communicator (LocalStepRunner), or a group of worker processes (the server's WorkerGroup).
// Either way the tokens come from the same BatchRunner code as the server's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/communicator.h"
#include "engine/ring_attention.h"
#include "engine/sampler.h"
#include "models/model.h"
#include "runtime/batch_runner.h"
#include "runtime/step.h"

namespace burst::runtime {

// Why a sequence stopped.
enum class FinishReason {
  kStop,       // EOS or a stop condition
  kLength,     // max_tokens (or the KV capacity)
  kCancelled,  // the client went away or asked to stop
};
// "stop", "length", "cancelled": the names the OpenAI API uses.
const char* finish_reason_name(FinishReason r);

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 64;
  engine::SamplingParams sampling;
  bool stop_at_eos = true;
  int64_t prefill_chunk = 0;  // prefill in chunks of this many tokens (0: the whole prompt)
  engine::ShardLayout layout = engine::ShardLayout::kStriped;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_ms = 0;  // prompt steps + first sample: the time to first token
  double decode_ms = 0;   // every later token
  FinishReason finish_reason = FinishReason::kLength;
  double ring_compute_ms = 0, ring_wait_ms = 0;  // rank 0's ring, over the request
};

// Called with each sampled token; return false to stop (client gone).
using TokenCallback = std::function<bool(int32_t token)>;
// Called during the prefill with the fraction done; return false to cancel the request before
// its first token (a long prompt takes minutes).
using ProgressCallback = std::function<bool(double fraction)>;
// Called during a step's forward with layers done of all layers; return false to ask the step
// to stop (a runner that cannot stop a step mid-way finishes it; the driver then stops).
using StepProgress = std::function<bool(int layers_done, int layers)>;

// Runs step plans to completion on every rank of a group.
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // The step's result as rank 0 returns it; a step stopped by on_layer returns kCancelled
  // and leaves no sequence of it behind.
  virtual Result<StepResult> run_step(const StepPlan& plan, const StepProgress& on_layer) = 0;
  virtual int32_t eos_token_id() const = 0;
  // KV tokens the group holds (every sequence together).
  virtual int64_t kv_capacity_tokens() const = 0;
};

// What makes a request invalid before any step (empty: nothing), in the API's words.
std::string validate(const GenerateRequest& request);

// Runs `request` as sequence `id` through `runner`; the sequence is released at the end.
Result<GenerateStats> generate(StepRunner& runner, const GenerateRequest& request,
                               const TokenCallback& on_token,
                               const ProgressCallback& on_progress = nullptr, uint64_t id = 1);

// A group of one rank in this process: the model's forward through a one-rank ring.
class LocalStepRunner final : public StepRunner {
 public:
  // capacity: KV tokens (whole pages of page_size; 0: the page size a worker on the model's
  // backend uses, engine::kv_page_size); kv_dtype: what the pool holds (--kv-cache-dtype);
  // attention: the precision of prefill attention (--attention-dtype).
  static Result<std::unique_ptr<LocalStepRunner>> create(
      models::Model& model, int64_t capacity, int page_size = 0,
      engine::KvCacheDtype kv_dtype = engine::KvCacheDtype::kAuto,
      engine::AttentionDtype attention = engine::AttentionDtype::kAuto);
  Result<StepResult> run_step(const StepPlan& plan, const StepProgress& on_layer) override;
  int32_t eos_token_id() const override { return model_.info().eos_token_id; }
  int64_t kv_capacity_tokens() const override { return ring_->capacity(); }
  BatchRunner& batch() { return *batch_; }

 private:
  explicit LocalStepRunner(models::Model& model) : model_(model) {}
  models::Model& model_;
  std::unique_ptr<engine::Communicator> comm_;
  std::unique_ptr<engine::RingAttention> ring_;
  std::unique_ptr<BatchRunner> batch_;
};

}  // namespace burst::runtime
