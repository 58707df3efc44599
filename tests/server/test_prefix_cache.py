"""Prefix caching end to end, through real burst-server and burst-worker processes (CPU,
kjv-tiny, freed KV pages poisoned with NaN in every worker: a request that read a page after it
was freed would not give the cold tokens):
- a request whose prompt starts with a cached document gives the same greedy tokens and
  logprobs (within 1e-3) as the same request served cold, for 1 to 4 workers, with documents
  that end inside a page, at a block boundary and inside a chunk, and chunk sizes that divide
  neither the prompt nor the blocks;
- usage.prompt_tokens_details.cached_tokens is exact (non-streaming, the final chunk of a
  stream with include_usage, chat, gRPC), and so are the prefix-cache metrics;
- the next turn of a chat hits the previous turn's pages, its answer included;
- 300 mixed requests (shared and unshared prefixes, cancels and disconnects at random points)
  on a pool small enough to force eviction: every completed request gives its cold tokens,
  and afterwards no request holds a page (only the cache's blocks stay);
- the warm-up request (--warmup-tokens) runs before the server is ready and leaves nothing.
Run: /usr/bin/python3 test_prefix_cache.py --build BUILD_DIR."""
import http.client
import json
import os
import random

from harness import HAVE_KJV, Server, check, compile_protos, run, run_at_most, sse_chunks

os.environ["BURST_POISON_FREED_KV"] = "1"  # the servers' workers inherit it
PAGE = 16  # a CPU rank's KV page (engine::kDefaultKvPageSize)
VOCAB = 32000 if HAVE_KJV else 4099


def doc(n, seed):
    """n token ids that read like nothing in particular (BOS first), seeded."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(100, min(VOCAB, 4000)) for _ in range(n - 1)]


def complete(srv, prompt, max_tokens=6, stream=False, logprobs=None, timeout=120):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        check(False, f"HTTP {r.status}: {r.read()[:300]!r}")
    if not stream:
        out = json.loads(r.read())
        c.close()
        return out
    text, usage = "", None
    for chunk in sse_chunks(r):
        for ch in chunk.get("choices", []):
            text += ch.get("text", "")
        usage = chunk.get("usage") or usage
    c.close()
    return {"choices": [{"text": text}], "usage": usage}


def cached(out):
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def same_logprobs(a, b, what):
    la, lb = a["choices"][0]["logprobs"]["token_logprobs"], b["choices"][0]["logprobs"]["token_logprobs"]
    check(len(la) == len(lb), f"{what}: {len(la)} logprobs vs {len(lb)}")
    worst = max(abs(x - y) for x, y in zip(la, lb))
    # fp32 on the CPU: the cached prefix is attended in another order of the same sums.
    check(worst < 1e-3, f"{what}: logprobs differ by {worst:g}")


def test_cached_equals_cold_for_1_to_4_workers():
    for workers in (1, 2, 3, 4):
        block = workers * PAGE
        # Documents that end inside a page, at a block boundary, inside a block; questions of
        # a few tokens; chunks of 37 divide neither.
        docs = [doc(3 * block + 5, workers), doc(4 * block, 10 + workers),
                doc(2 * block + PAGE + 3, 20 + workers)]
        questions = [[29871, 1724 % VOCAB, 338], [450, 5696 % VOCAB]]
        cold = Server("--prefill-chunk", 37, "--layout", "contiguous", workers=workers)
        try:
            want = {(d, q): complete(cold, docs[d] + questions[q], logprobs=1)
                    for d in range(len(docs)) for q in range(len(questions))}
            for o in want.values():
                check(cached(o) == 0, "no prefix cache with the contiguous layout")
        finally:
            cold.stop()
        srv = Server("--prefill-chunk", 37, workers=workers)
        try:
            hits0 = srv.metric("burst:prefix_cache_hits_total")
            expect_hits = 0
            for d, dd in enumerate(docs):
                first = complete(srv, dd + questions[0], logprobs=1)
                # Blocks of the document the request before published (none for the first
                # document's first question on a fresh server).
                check(first["choices"][0]["text"] == want[(d, 0)]["choices"][0]["text"],
                      f"{workers} workers, document {d}: {first['choices'][0]['text']!r}")
                check(cached(first) == 0, f"document {d} is new: {cached(first)} cached")
                for stream in (False, True):
                    got = complete(srv, dd + questions[1], logprobs=None if stream else 1,
                                   stream=stream)
                    # Every full block of the document is cached; the question differs.
                    n = len(dd) // block * block
                    expect_hits += n
                    what = f"{workers} workers, document {d} ({len(dd)} tokens), stream {stream}"
                    check(cached(got) == n, f"{what}: {cached(got)} cached tokens, want {n}")
                    check(got["choices"][0]["text"] == want[(d, 1)]["choices"][0]["text"],
                          f"{what}: {got['choices'][0]['text']!r} != cold "
                          f"{want[(d, 1)]['choices'][0]['text']!r}")
                    if not stream:
                        same_logprobs(got, want[(d, 1)], what)
            check(srv.metric("burst:prefix_cache_hits_total") - hits0 == expect_hits,
                  "prefix_cache_hits_total counts the cached tokens exactly")
            check(srv.wait_kv_released(), "no request holds a page once all are done")
            check(srv.metric("burst:kv_cache_cached_tokens") > 0, "the blocks stay cached")
        finally:
            srv.stop()


def test_chat_turns_and_grpc_report_cached_tokens():
    srv = Server("--prefill-chunk", 64, workers=2)
    try:
        messages = [{"role": "user", "content": " ".join(["In the beginning God created the "
                                                          "heaven and the earth."] * 12)}]
        prev_prompt = 0
        for turn in range(3):
            c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=120)
            c.request("POST", "/v1/chat/completions",
                      body=json.dumps({"messages": messages, "max_tokens": 24, "temperature": 0}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            check(r.status == 200, f"chat turn {turn}: HTTP {r.status}")
            out = json.loads(r.read())
            c.close()
            n = cached(out)
            if turn == 0:
                check(n == 0, f"the first turn is new: {n}")
            else:
                # The previous turn's prompt is cached in whole blocks (the last one may differ:
                # the template closes the turn after the answer).
                check(n % (2 * PAGE) == 0 and n >= (prev_prompt // (2 * PAGE) - 1) * 2 * PAGE,
                      f"turn {turn}: {n} cached tokens of {out['usage']['prompt_tokens']} "
                      f"(previous prompt {prev_prompt})")
            prev_prompt = out["usage"]["prompt_tokens"]
            messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
            messages.append({"role": "user", "content": "And then?"})
        # gRPC: the same count in Finished.
        import tempfile
        import grpc
        out_dir = tempfile.mkdtemp(prefix="burst-pb-")
        compile_protos("burst/v1/burst.proto", out=out_dir)
        from burst.v1 import burst_pb2, burst_pb2_grpc
        stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
        block = 2 * PAGE
        ids = doc(5 * block + 7, 99)

        def generate(prompt, n):
            req = burst_pb2.GenerateRequest(token_ids=burst_pb2.TokenIds(ids=prompt), max_tokens=n,
                                            sampling=burst_pb2.SamplingParams(temperature=0),
                                            ignore_eos=True)
            events = list(stub.Generate(req, timeout=60))
            return [e.token.id for e in events if e.WhichOneof("event") == "token"], \
                events[-1].finished

        out, fin = generate(ids, 40)
        check(fin.cached_tokens == 0, "a new prompt over gRPC")
        check(len(out) == 40 and min(out) >= 0, f"40 token ids: {out}")
        # The answer's tokens were fed back (all but the last): the next turn finds blocks of
        # them too, 206 computed tokens, 6 blocks of 32, where the prompt alone had 5.
        _, fin = generate(ids + out + [450], 2)
        check(fin.cached_tokens == (len(ids) + len(out) - 1) // block * block == 6 * block,
              f"the next turn over gRPC: {fin.cached_tokens} cached tokens")
    finally:
        srv.stop()


def test_mixed_load_with_eviction_and_cancels():
    # 4 documents x 5 questions, and prompts that share nothing; a KV pool (per rank 40 pages
    # of 16) that holds about two documents' blocks with a few requests running, so blocks are
    # evicted and pages reused all the time.
    workers = 2
    docs = [doc(180 + 23 * i, 50 + i) for i in range(4)]
    prompts = [docs[d] + doc(3 + q * 5, 1000 + 10 * d + q)[1:] for d in range(4) for q in range(5)]
    prompts += [doc(40 + 17 * i, 2000 + i) for i in range(10)]
    cold = Server("--prefill-chunk", 48, "--layout", "contiguous", workers=1)
    try:
        want = [complete(cold, p, max_tokens=5)["choices"][0]["text"] for p in prompts]
    finally:
        cold.stop()
    srv = Server("--prefill-chunk", 48, "--kv-capacity", 1280, "--max-running", 6,
                 "--max-queue", 400, workers=workers)
    try:
        rng = random.Random(7)
        plan = [(rng.randrange(len(prompts)), rng.random() < 0.3, rng.randrange(6))
                for _ in range(300)]
        results = [None] * len(plan)

        def one(i):
            k, cancel, after = plan[i]
            if not cancel:
                results[i] = complete(srv, prompts[k], max_tokens=5, stream=i % 2 == 0)
                return
            body = {"prompt": prompts[k], "max_tokens": 20, "temperature": 0, "stream": True,
                    "return_progress": True}
            c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=120)
            c.request("POST", "/v1/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            for _ in range(after):  # 0: while queued; more: mid-prefill or mid-decode
                if not r.readline():
                    break
            c.close()
            results[i] = "cancelled"

        run_at_most(one, len(plan), 12)
        hits = 0
        for i, (k, cancel, _) in enumerate(plan):
            check(results[i] is not None, f"request {i} ended")
            if cancel:
                continue
            got = results[i]["choices"][0]["text"]
            check(got == want[k], f"request {i} (prompt {k}): {got!r} != cold {want[k]!r}")
            hits += cached(results[i]) > 0
        check(hits > 50, f"only {hits} requests hit the cache")
        evicted = srv.metric("burst:prefix_cache_evicted_blocks_total")
        check(evicted > 20, f"the pool is small enough to evict: {evicted} blocks evicted")
        check(srv.wait_kv_released(), f"{srv.kv_held()} KV tokens still held after the load")
        log = srv.read_log()
        check("cached)" in log, "the request log line says how many tokens were cached")
        # Still serving, and still the cold tokens.
        check(complete(srv, prompts[0], max_tokens=5)["choices"][0]["text"] == want[0],
              "the first prompt again")
    finally:
        srv.stop()


def test_warm_up_before_serving():
    # The warm-up request runs before /health says ready, through the workers, and leaves
    # nothing behind: no metrics, no KV, no prefix blocks.
    srv = Server("--warmup-tokens", 300, "--prefill-chunk", 64, workers=2)
    try:
        check("warm-up: a 300-token request" in srv.read_log(), "the warm-up ran before ready")
        check(srv.metric("burst:prompt_tokens_total") == 0, "the warm-up is no request")
        out = complete(srv, doc(100, 3))
        check(cached(out) == 0 and out["choices"][0]["text"], f"a request after it: {out}")
        # The gauges come from the workers after each step: pages the warm-up kept would show
        # as held once the request is done.
        check(srv.wait_kv_released(), f"{srv.kv_held()} KV tokens held after the warm-up")
    finally:
        srv.stop()


if __name__ == "__main__":
    run([test_cached_equals_cold_for_1_to_4_workers, test_chat_turns_and_grpc_report_cached_tokens,
         test_mixed_load_with_eviction_and_cancels, test_warm_up_before_serving])
