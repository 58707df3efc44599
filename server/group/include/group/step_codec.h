// The step on the wire (proto/burst/v1/worker.proto): the one place that knows both the
// runtime's step types and their messages. The coordinator (WorkerGroup) encodes plans and
// decodes rank 0's replies; the worker decodes plans and encodes its replies. Proto3 scalars
// default to 0, so the fields whose "none" is -1 (logprobs, prompt_logprobs, next_token) travel
// as value + 1 and a repetition_penalty of 0 means 1 (none).
#pragma once

#include "burst/v1/worker.pb.h"
#include "runtime/step.h"

namespace burst::server {

// `report_progress`: rank 0 sends a progress reply after each layer of this step.
burst::v1::internal::StepRequest encode_plan(const runtime::StepPlan& plan, bool report_progress);
runtime::StepPlan decode_plan(const burst::v1::internal::StepRequest& req);
bool reports_progress(const burst::v1::internal::StepRequest& req);

// A rank's final reply to a step of a model with `layers` layers (tokens and prompt logprobs
// are rank 0's; the KV pages and rows are this rank's).
burst::v1::internal::StepReply encode_result(const runtime::StepResult& result, int layers);
runtime::StepResult decode_result(const burst::v1::internal::StepReply& reply);

}  // namespace burst::server
