// The precision of prefill attention's products (--attention-dtype), a rank's setting that the
// ring applies to every prefill launch (RingAttention::create).
#pragma once

#include <string>

#include "engine/status.h"

namespace burst::engine {

// kAuto is the compute dtype (bf16 on GPUs, fp32 on CPUs); kFp8 rounds q, k, v and P to e4m3
// (kernels/attention.h: AttnParams::qkv_fp8; the Hopper FP8 kernel on GPUs, its emulation on
// CPUs). Decode steps are not affected.
enum class AttentionDtype { kAuto, kFp8 };
// "auto" or "bf16" -> kAuto, "fp8" -> kFp8; anything else an error naming the choices.
Result<AttentionDtype> parse_attention_dtype(const std::string& name);
const char* attention_dtype_name(AttentionDtype dtype);

}  // namespace burst::engine
