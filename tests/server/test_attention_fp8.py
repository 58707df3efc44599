"""FP8 attention (--attention-dtype fp8) end to end, through real burst-server and burst-worker
processes (CPU workers run the emulation of the Hopper kernel's roundings, kjv-tiny):
- prompt log-probabilities (echo) of a KJV passage with FP8 attention against the default:
  different (an FP8 attention that changed nothing would not be one), by less than 0.3 nats a
  token on average, however the prompt is cut and shared out (whole on one worker, in chunks of
  37 on three): the scales follow the blocks, so the numbers move a little with the cut, but
  never far from the unrounded attention; kjv-tiny's perplexity cost is in
  tests/unit/attention_fp8_model_test.cpp;
- FP8 attention beside the FP8 KV cache (both options at once) stays within the same bound;
- a bad --attention-dtype value stops the server and the worker at start with a message naming
  the choices.
Run: /usr/bin/python3 test_attention_fp8.py --build BUILD_DIR."""
import json

from harness import KJV_PASSAGE as PROMPT, Server, check, check_bad_option_refused, run



def logprobs(*flags, workers=2):
    srv = Server(*flags, workers=workers)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
        status, data, _ = srv.request("POST", "/v1/completions", body, timeout=120)
        check(status == 200, f"HTTP {status}: {data[:300]!r}")
        log = srv.read_log()
    finally:
        srv.stop()
    return json.loads(data)["choices"][0]["logprobs"]["token_logprobs"][1:], log


def compare(ref, got, what):
    check(len(ref) == len(got) and len(ref) > 40, f"{what}: {len(ref)} vs {len(got)} logprobs")
    diffs = sorted(abs(x - y) for x, y in zip(ref, got))
    mean = sum(diffs) / len(diffs)
    p99 = diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))]
    print(f"  {what} against the default over {len(diffs)} tokens: |dlogp| mean {mean:.5f}, "
          f"p99 {p99:.5f}, max {diffs[-1]:.5f} nats")
    check(mean < 0.3, f"{what}: mean |dlogp| {mean}")
    check(diffs[-1] > 0, f"{what}: FP8 attention changed no log-probability")


def test_fp8_attention_costs_little_and_is_not_free():
    ref, _ = logprobs()
    whole, log = logprobs("--attention-dtype", "fp8", workers=1)
    compare(ref, whole, "fp8 attention, 1 worker, whole prompt")
    check("attention fp8" in log, "the start does not say attention fp8:\n" + log[-2000:])
    chunked, _ = logprobs("--attention-dtype", "fp8", "--prefill-chunk", "37", workers=3)
    compare(ref, chunked, "fp8 attention, 3 workers, chunks of 37")
    both, _ = logprobs("--attention-dtype", "fp8", "--kv-cache-dtype", "fp8", workers=2)
    compare(ref, both, "fp8 attention and fp8 KV cache")


def test_bad_value_is_refused_at_start():
    check_bad_option_refused("--attention-dtype", "fp16", "int8", "auto, bf16 or fp8")


if __name__ == "__main__":
    run([test_fp8_attention_costs_little_and_is_not_free, test_bad_value_is_refused_at_start])
