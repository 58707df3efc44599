#include "runtime/step.h"

namespace burst::runtime {

SeqWork prefill_work(uint64_t id, const std::vector<int32_t>& prompt, int64_t start, int64_t len,
                     const engine::SamplingParams& sampling) {
  SeqWork w;
  w.id = id;
  w.tokens.assign(prompt.begin() + start, prompt.begin() + start + len);
  w.start = start;
  w.prompt_len = static_cast<int64_t>(prompt.size());
  w.sample = start + len == w.prompt_len;
  w.sampling = sampling;
  return w;
}

SeqWork decode_work(uint64_t id, int32_t token, int64_t pos, int64_t prompt_len,
                    const engine::SamplingParams& sampling) {
  SeqWork w;
  w.id = id;
  w.decode = true;
  w.tokens = {token};
  w.start = pos;
  w.prompt_len = prompt_len;
  w.sample = true;
  w.sampling = sampling;
  return w;
}

}  // namespace burst::runtime
