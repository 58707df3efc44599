"""The FP8 KV cache (--kv-cache-dtype fp8) end to end, through real burst-server and burst-worker
processes (CPU, kjv-tiny):
- prompt log-probabilities (echo) of a KJV passage with the FP8 cache against the fp32 cache:
  different (an FP8 cache that changed nothing would not be one), by less than 0.3 nats a token
  on average (0.18 measured; kjv-tiny's own cost is measured in tests/unit/kv_fp8_model_test.cpp);
- the FP8 cache gives the same tokens however the prompt is cut: whole, in chunks of 37 and 5,
  on 1 and 3 workers, batched beside other requests, with the prompt's first blocks reused from
  the prefix cache (every key was rounded once, when it was computed);
- a bad --kv-cache-dtype value stops the server at start with a message naming the choices.
Run: /usr/bin/python3 test_kv_fp8.py --build BUILD_DIR."""
import json
import threading

from harness import KJV_PASSAGE as PROMPT, Server, check, check_bad_option_refused, run



def complete(srv, prompt, max_tokens=16, echo=False):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if echo:
        body.update(echo=True, logprobs=1)
    status, data, _ = srv.request("POST", "/v1/completions", body, timeout=120)
    check(status == 200, f"HTTP {status}: {data[:300]!r}")
    return json.loads(data)


def test_fp8_costs_little_and_is_not_free():
    ref = Server(workers=2)
    try:
        a = complete(ref, PROMPT, echo=True)
    finally:
        ref.stop()
    fp8 = Server("--kv-cache-dtype", "fp8", workers=2)
    try:
        b = complete(fp8, PROMPT, echo=True)
        log = fp8.read_log()
    finally:
        fp8.stop()
    la = a["choices"][0]["logprobs"]["token_logprobs"][1:]  # the first token has none
    lb = b["choices"][0]["logprobs"]["token_logprobs"][1:]
    check(len(la) == len(lb) and len(la) > 40, f"{len(la)} vs {len(lb)} logprobs")
    diffs = sorted(abs(x - y) for x, y in zip(la, lb))
    mean = sum(diffs) / len(diffs)
    print(f"  fp8 vs fp32 cache over {len(diffs)} tokens: |dlogp| mean {mean:.5f}, max "
          f"{diffs[-1]:.5f} nats; text {'same' if a['choices'][0]['text'] == b['choices'][0]['text'] else 'differs'}")
    check(mean < 0.3, f"mean |dlogp| {mean}")
    check(diffs[-1] > 0, "the FP8 cache changed no log-probability")
    check("fp8" in log, "the memory plan does not say fp8:\n" + log[-2000:])


def test_fp8_tokens_do_not_depend_on_chunks_workers_batching_or_reuse():
    want = None
    for workers, chunk in ((1, 0), (1, 5), (3, 37), (3, 0)):
        flags = ["--kv-cache-dtype", "fp8"] + (["--prefill-chunk", chunk] if chunk else [])
        srv = Server(*flags, workers=workers)
        try:
            got = complete(srv, PROMPT)["choices"][0]["text"]
            # Beside three other requests in the same steps.
            others, errors = [], []

            def other(i):
                try:
                    others.append(complete(srv, PROMPT[: 40 + 30 * i], max_tokens=8))
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)
            threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            batched = complete(srv, PROMPT)
            for t in threads:
                t.join()
            check(not errors, f"{errors}")
            # The second time the prompt's blocks come from the prefix cache.
            cached = batched["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        finally:
            srv.stop()
        what = f"{workers} workers, chunk {chunk or 'whole'}"
        if want is None:
            want = got
        check(got == want, f"{what}: {got!r} vs {want!r}")
        check(batched["choices"][0]["text"] == want, f"{what}, batched and cached "
              f"({cached} tokens): {batched['choices'][0]['text']!r} vs {want!r}")


def test_bad_value_is_refused_at_start():
    check_bad_option_refused("--kv-cache-dtype", "fp8_e5m2", "int4", "auto, fp8 or fp8_e4m3")


if __name__ == "__main__":
    run([test_fp8_costs_little_and_is_not_free,
         test_fp8_tokens_do_not_depend_on_chunks_workers_batching_or_reuse,
         test_bad_value_is_refused_at_start])
