"""End-to-end tests of burst-server's HTTP API with real processes and curl / http.client:
OpenAI completions and chat (stream and not), SSE details (usage chunk, [DONE], progress events,
keep-alive comments), /health, /v1/models, /tokenize, /metrics, every bad-input class, the API
key, greedy equality with burst-generate, 16 concurrent clients, 200 cancelled streams with the
KV use back to zero, CORS for browsers (--allowed-origins), and SIGTERM draining. Run: python3 test_http.py --build BUILD_DIR."""
import http.client
import json
import os
import subprocess
import tempfile
import threading
import time

from harness import (HAVE_KJV, MODEL, PROMPT, ROOT, TOKENIZER, Server, build_dir, check, run,
                     sse_chunks, sse_events)

KEY = "test-key-123"
AUTH = {"Authorization": "Bearer " + KEY}
srv = None
KEY_FILE = None


def post(path, body, headers=AUTH):
    return srv.json("POST", path, body, headers)


def curl(*args):
    return subprocess.run(["curl", "-sS", "--max-time", "60", *args], capture_output=True,
                          check=False).stdout.decode(errors="replace")


def stream(path, body, headers=AUTH):
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    c.request("POST", path, body=json.dumps(body), headers={**headers,
                                                             "Content-Type": "application/json"})
    r = c.getresponse()
    return c, r


def generate_cli(prompt, n):
    out = subprocess.run([os.path.join(build_dir(), "bin", "burst-generate"), "--model", MODEL,
                          "--tokenizer", TOKENIZER, "--prompt", prompt, "--max-tokens", str(n),
                          "--temperature", "0"], capture_output=True, check=True)
    text = out.stdout.decode()
    check(text.startswith(prompt), "burst-generate echoes the prompt first")
    return text[len(prompt):].rstrip("\n")


def test_health_models_tokenize():
    check(srv.json("GET", "/health") == (200, {"status": "ok"}), "health ok")
    st, m = srv.json("GET", "/v1/models", headers=AUTH)
    check(st == 200 and m["object"] == "list" and m["data"][0]["id"] == os.path.basename(MODEL),
          f"models: {m}")
    st, t = post("/tokenize", {"prompt": "Hello world!"})
    check(st == 200 and t["tokens"] == [1, 15043, 3186, 29991] and t["count"] == 4, f"{t}")


def test_completion_matches_burst_generate():
    want = generate_cli(PROMPT, 12)
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    check(st == 200, f"status {st}: {r}")
    check(r["choices"][0]["text"] == want, f"server {r['choices'][0]['text']!r} != cli {want!r}")
    check(r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length",
          f"usage {r['usage']}")
    # The same over SSE, assembled from the chunks.
    c, resp = stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                         "stream": True, "stream_options": {"include_usage": True}})
    check(resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream"),
          "SSE content type")
    text, usage, done, finish = "", None, False, None
    for ev, data in sse_events(resp):
        if ev == "comment":
            continue
        if data == "[DONE]":
            done = True
            break
        j = json.loads(data)
        check(j["object"] == "text_completion", f"chunk object {j}")
        if j["choices"]:
            text += j["choices"][0]["text"]
            finish = j["choices"][0]["finish_reason"] or finish
        if j.get("usage"):
            usage = j["usage"]
    c.close()
    check(done and text == want and finish == "length", f"stream {text!r} done={done}")
    cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens")
    check(isinstance(cached, int) and 0 <= cached < r["usage"]["prompt_tokens"],
          f"usage.prompt_tokens_details.cached_tokens: {usage}")
    check(usage == {"prompt_tokens": r["usage"]["prompt_tokens"], "completion_tokens": 12,
                    "total_tokens": r["usage"]["prompt_tokens"] + 12,
                    "prompt_tokens_details": {"cached_tokens": cached}}, f"usage {usage}")


def test_curl_sse_and_progress():
    body = json.dumps({"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
                       "return_progress": True})
    out = curl("-N", f"http://127.0.0.1:{srv.http_port}/v1/completions", "-H",
               "Authorization: Bearer " + KEY, "-H", "Content-Type: application/json", "-d", body)
    # Progress is a data chunk with no choices and a progress object (what SDKs' standard
    # loops pass over), never a named event.
    check("event:" not in out, f"no named events: {out[:300]}")
    progress = [json.loads(line[6:]) for line in out.splitlines()
                if line.startswith("data: {") and '"progress"' in line]
    check(progress and all(p["choices"] == [] and p["object"] == "text_completion"
                           for p in progress), f"progress chunks: {progress}")
    fractions = [p["progress"]["prefilled_fraction"] for p in progress]
    check(fractions[0] == 0 and fractions[-1] == 1.0 and fractions == sorted(fractions),
          f"fractions {fractions}")
    check(out.rstrip().endswith("data: [DONE]"), f"ends with [DONE]: {out[-200:]}")
    check('"usage"' not in out, "no usage without stream_options.include_usage")


def test_keepalive_while_queued():
    # A batch of one (--max-running 1): a long request holds it; a second stream waits in the
    # queue and must get keep-alive comments (--keepalive-ms 100).
    one = Server("--max-running", 1, "--keepalive-ms", 100)
    try:
        def request(body):
            c = http.client.HTTPConnection("127.0.0.1", one.http_port, timeout=60)
            c.request("POST", "/v1/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            return c, c.getresponse()

        def long_request():
            c, r = request({"prompt": PROMPT, "max_tokens": 150, "temperature": 0})
            r.read()
            c.close()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.1)
        c, resp = request({"prompt": PROMPT, "max_tokens": 2, "stream": True})
        comments = 0
        for ev, data in sse_events(resp):
            if ev == "comment":
                comments += 1
            if data == "[DONE]":
                break
        c.close()
        t.join()
        check(comments >= 1, f"keep-alive comments while queued: {comments}")
    finally:
        one.stop()


def test_chat():
    body = {"messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "Who made the heaven?"}],
            "max_tokens": 8, "temperature": 0}
    st, r = post("/v1/chat/completions", body)
    if not HAVE_KJV:
        # The fixture's vocabulary (4099) cannot hold the template's [INST] ids: a clear 400.
        check(st == 400 and "vocabulary" in r["error"]["message"], f"{st} {r}")
        return
    check(st == 200 and r["object"] == "chat.completion", f"{st} {r}")
    msg = r["choices"][0]["message"]
    check(msg["role"] == "assistant" and isinstance(msg["content"], str), f"{msg}")
    c, resp = stream("/v1/chat/completions", {**body, "stream": True})
    text, role = "", None
    for j in sse_chunks(resp):
        check(j["object"] == "chat.completion.chunk", f"{j}")
        d = j["choices"][0]["delta"]
        role = d.get("role", role)
        text += d.get("content", "")
    c.close()
    check(role == "assistant" and text == msg["content"], f"stream {text!r} vs {msg['content']!r}")


def test_stop_string():
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0})
    full = r["choices"][0]["text"]
    stop = full[4:7] if len(full) > 8 else None
    check(stop and stop.strip(), f"need some text to cut: {full!r}")
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                                     "stop": [stop]})
    check(st == 200 and r["choices"][0]["finish_reason"] == "stop", f"{r}")
    check(r["choices"][0]["text"] == full[:full.index(stop)], f"{r['choices'][0]['text']!r}")


def test_min_p():
    """vLLM's min_p: 1 keeps only the most likely id, so a hot sampler draws greedy's text; 0.9
    at T=3 keeps few; 0 is off."""
    base = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    st, greedy = post("/v1/completions", {**base, "temperature": 0})
    check(st == 200, f"{st} {greedy}")
    want = greedy["choices"][0]["text"]
    hot = {**base, "temperature": 5, "seed": 11}
    st, r = post("/v1/completions", {**hot, "min_p": 1})
    check(st == 200 and r["choices"][0]["text"] == want,
          f"min_p 1 at T=5 is greedy: {r['choices'][0]['text']!r} vs {want!r}")
    st, off = post("/v1/completions", {**hot, "min_p": 0})
    st2, unset = post("/v1/completions", hot)
    check(off["choices"][0]["text"] == unset["choices"][0]["text"] != want,
          f"min_p 0 is off: {off['choices'][0]['text']!r} {unset['choices'][0]['text']!r}")
    # Chat takes it too (the same table).
    if HAVE_KJV:
        msgs = [{"role": "user", "content": "Who made the heaven?"}]
        st, g = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                              "temperature": 0})
        st, m = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                              "temperature": 4, "seed": 3, "min_p": 1.0})
        check(st == 200 and m["choices"][0]["message"] == g["choices"][0]["message"],
              f"chat min_p 1: {m} vs {g}")


def test_include_stop_str_in_output():
    """The stop string stays at the end of the text; a stop token id's text is sent."""
    base = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    st, r = post("/v1/completions", base)
    full = r["choices"][0]["text"]
    stop = full[4:7]
    check(len(full) > 8 and stop.strip(), f"need some text to cut: {full!r}")
    cut = full.index(stop)
    for include, want in [(False, full[:cut]), (True, full[:cut + len(stop)]),
                          (None, full[:cut])]:
        body = {**base, "stop": [stop, "zzzz"]}
        if include is not None:
            body["include_stop_str_in_output"] = include
        st, r = post("/v1/completions", body)
        check(st == 200 and r["choices"][0]["finish_reason"] == "stop"
              and r["choices"][0]["text"] == want,
              f"include {include}: {r['choices'][0]['text']!r}, want {want!r}")
        # Streamed, the chunks add up to the same text.
        c, resp = stream("/v1/completions", {**body, "stream": True})
        text = "".join(ch["text"] for j in sse_chunks(resp) for ch in j["choices"])
        c.close()
        check(text == want, f"stream include {include}: {text!r}, want {want!r}")
    # A stop token id (the 3rd token drawn, as test_stop_token_ids finds it): its text is sent
    # with the flag (the output is then the 3 tokens' text), not without (2 tokens' text).
    base = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    three = post("/v1/completions", {**base, "max_tokens": 3})[1]["choices"][0]["text"]
    two = post("/v1/completions", {**base, "max_tokens": 2})[1]["choices"][0]["text"]
    prompt_ids = post("/tokenize", {"prompt": PROMPT})[1]["tokens"]
    gen = post("/tokenize", {"prompt": PROMPT + three})[1]["tokens"][len(prompt_ids):]
    check(len(gen) == 3 and gen[2] not in gen[:2] and len(three) > len(two), f"ids {gen}")
    for include, want in [(False, two), (True, three)]:
        for extra in [{}, {"stream": True}]:
            body = {**base, "max_tokens": 8, "stop_token_ids": [gen[2]],
                    "include_stop_str_in_output": include, **extra}
            if extra:
                conn, resp = stream("/v1/completions", body)
                text = "".join(ch["text"] for j in sse_chunks(resp) for ch in j["choices"])
                conn.close()
            else:
                st, r = post("/v1/completions", body)
                text = r["choices"][0]["text"]
                check(r["choices"][0]["finish_reason"] == "stop", f"{r}")
            check(text == want, f"stop id, include {include} {extra}: {text!r}, want {want!r}")
    # gRPC has the same field: test_grpc.py.


def test_continuous_usage_stats():
    """stream_options.continuous_usage_stats: usage (so far) in every chunk, counting up to the
    final usage."""
    body = {"prompt": [PROMPT, PROMPT + " unto"], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    c, resp = stream("/v1/completions", body)
    chunks = list(sse_chunks(resp))
    c.close()
    usages = [j.get("usage") for j in chunks]
    check(all(u is not None for u in usages), f"a chunk without usage: {chunks}")
    final = usages[-1]
    check(chunks[-1]["choices"] == [] and final["completion_tokens"] == 12
          and final["total_tokens"] == final["prompt_tokens"] + 12, f"final usage {final}")
    completions = [u["completion_tokens"] for u in usages]
    check(completions == sorted(completions) and completions[0] < 12,
          f"usage counts up: {completions}")
    token_chunks = [j for j in chunks if j["choices"] and j["choices"][0]["text"]]
    check(len(token_chunks) >= 10 and
          all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages),
          f"{len(token_chunks)} token chunks; usages {usages}")
    # Chat, without include_usage: every chunk still carries it (no usage-only chunk at the end).
    if HAVE_KJV:
        c, resp = stream("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Who made the heaven?"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}})
        chunks = list(sse_chunks(resp))
        c.close()
        check(all(j["choices"] for j in chunks) and
              [j["usage"]["completion_tokens"] for j in chunks][-1] == 4, f"chat: {chunks}")


def test_accepted_no_op_parameters():
    """metadata, service_tier, user, skip_special_tokens: accepted and change nothing."""
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    st, plain = post("/v1/completions", base)
    st, r = post("/v1/completions", {**base, "metadata": {"team": "a"}, "service_tier": "auto",
                                     "user": "u1", "skip_special_tokens": True})
    check(st == 200 and r["choices"][0]["text"] == plain["choices"][0]["text"], f"{st} {r}")
    st, r = post("/v1/completions", {**base, "skip_special_tokens": False})
    check(st == 200 and r["choices"][0]["text"] == plain["choices"][0]["text"], f"{st} {r}")
    if HAVE_KJV:
        st, r = post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Who made the heaven?"}], "max_tokens": 2,
            "metadata": {"k": "v"}, "service_tier": "default", "user": "x",
            "skip_special_tokens": True, "add_generation_prompt": True})
        check(st == 200, f"chat no-ops: {st} {r}")


def test_add_generation_prompt():
    """Chat's add_generation_prompt: with a template that writes an assistant header (a model
    whose tokenizer_config.json has a chat_template), false leaves it off the prompt's end."""
    if not HAVE_KJV:
        return
    model = tempfile.mkdtemp(prefix="burst-chatml-")
    for f in os.listdir(MODEL):
        os.symlink(os.path.join(MODEL, f), os.path.join(model, f))
    if os.path.exists(os.path.join(model, "tokenizer_config.json")):
        os.unlink(os.path.join(model, "tokenizer_config.json"))
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template":
                   "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
                   " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|im_start|>assistant\\n' }}{% endif %}"}, f)
    other = Server("--model", model, workers=1)
    try:
        msgs = [{"role": "user", "content": "Who made the heaven?"}]
        counts = {}
        for flag in [True, False, None]:
            body = {"messages": msgs, "max_tokens": 1}
            if flag is not None:
                body["add_generation_prompt"] = flag
            st, r = other.json("POST", "/v1/chat/completions", body)
            check(st == 200, f"add_generation_prompt {flag}: {st} {r}")
            counts[flag] = r["usage"]["prompt_tokens"]
        st, header = other.json("POST", "/tokenize", {"prompt": "<|im_start|>assistant\n",
                                                      "add_special_tokens": False})
        check(counts[None] == counts[True] == counts[False] + header["count"],
              f"prompt tokens {counts}, the header is {header['count']}")
    finally:
        other.stop()


def test_response_size_is_bounded():
    """echo + logprobs over many long prompts: refused before anything runs, naming the sizes
    and the limit; smaller asks pass and the server keeps serving."""
    # (test_hostile.py sends the reported case itself: 64 prompts of 1900 ids.)
    ids = [[450] * 10] * 64
    for body in [{"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1000},
                 {"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1000,
                  "stream": True}]:
        st, data, _ = srv.request("POST", "/v1/completions", json.dumps(body),
                                  {**AUTH, "Content-Type": "application/json"})
        err = json.loads(data)["error"]
        check(st == 400 and err["param"] == "logprobs" and "64 prompt(s)" in err["message"]
              and "10 echoed prompt + 1000 max_tokens" in err["message"]
              and "20 top logprobs" in err["message"] and "MB" in err["message"]
              and "33554432 bytes (--max-response-bytes)" in err["message"], f"{st} {err}")
    # Without logprobs the same ask is small; with fewer prompts it fits.
    st, r = post("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 2})
    check(st == 200 and len(r["choices"]) == 64, f"{st}")
    st, r = post("/v1/completions", {"prompt": ids[:2], "echo": True, "logprobs": 20,
                                     "max_tokens": 2})
    check(st == 200 and len(r["choices"][1]["logprobs"]["top_logprobs"]) == 12, f"{st} {r}")


def expect_error(status, path, body, fragment="", headers=AUTH, raw=False, param=None):
    st, data, hdr = srv.request("POST", path, body if raw else json.dumps(body),
                                {**headers, "Content-Type": "application/json"})
    check(st == status, f"{path} {str(body)[:80]!r}: status {st}, want {status}: {data[:300]!r}")
    j = json.loads(data)
    check("error" in j and isinstance(j["error"]["message"], str) and j["error"]["type"],
          f"OpenAI-style error object: {j}")
    check(fragment.lower() in j["error"]["message"].lower(),
          f"message {j['error']['message']!r} lacks {fragment!r}")
    check(param is None or j["error"]["param"] == param,
          f"error.param {j['error'].get('param')!r}, want {param!r}: {j}")
    return hdr


def test_bad_inputs():
    c = "/v1/completions"
    expect_error(400, c, b"{not json", "JSON", raw=True)
    expect_error(400, c, b"[1, 2]", "object", raw=True)
    expect_error(400, c, {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens")
    expect_error(400, c, {"prompt": 42}, "prompt")
    expect_error(400, c, {"prompt": PROMPT, "temperature": "hot"}, "temperature")
    expect_error(404, c, {"prompt": PROMPT, "model": "gpt-17"}, "gpt-17")
    expect_error(400, c, {"prompt": ""}, "empty")
    expect_error(400, c, {"prompt": []}, "empty")
    expect_error(400, c, {"prompt": [1] * 5000, "max_tokens": 1}, "limit")
    expect_error(400, c, b'{"prompt": "caf\xe9 \xff"}', "", raw=True)
    expect_error(400, c, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens")
    expect_error(400, c, {"prompt": PROMPT, "max_tokens": -3}, "max_tokens")
    expect_error(400, c, {"prompt": PROMPT, "max_tokens": 10 ** 9}, "max_tokens")
    expect_error(400, c, {"prompt": PROMPT, "temperature": -0.5}, "temperature")
    expect_error(400, c, {"prompt": PROMPT, "top_p": 0}, "top_p")
    expect_error(400, c, {"prompt": PROMPT, "top_p": 1.5}, "top_p")
    expect_error(400, c, {"prompt": [1, 99999999]}, "vocabulary", param="prompt")
    expect_error(400, "/v1/chat/completions", {"messages": []}, "messages")
    expect_error(400, "/v1/chat/completions", {"messages": [{"role": "user"}]}, "content")
    expect_error(400, "/v1/chat/completions",
                 {"messages": [{"role": "assistant", "content": "hi"}]}, "alternate")
    # Fits the context limit but never the KV capacity: 413 (RESOURCE_EXHAUSTED).
    st, m = srv.json("GET", "/v1/models", headers=AUTH)
    cap = m["data"][0]["max_model_len"]
    expect_error(413, c, {"prompt": [1] * (cap - 2), "max_tokens": 10}, "capacity",
                 param="max_tokens")
    # Over the context by itself: error.param names the prompt (chat: the messages).
    expect_error(400, c, {"prompt": [1] * (cap + 1)}, "over the model's limit", param="prompt")
    expect_error(400, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "light " * (cap + 8)}]},
                 "over the model's limit", param="messages")
    expect_error(413, c, b'{"prompt": "' + b"a" * 70000 + b'"}', "size", raw=True)
    st, data, _ = srv.request("GET", "/v1/nowhere", headers=AUTH)
    check(st == 404 and "error" in json.loads(data), f"unknown route: {st} {data!r}")
    expect_error(401, c, {"prompt": PROMPT}, "missing", headers={})
    expect_error(401, c, {"prompt": PROMPT}, "wrong", headers={"Authorization": "Bearer nope"})
    # ... and the server still serves.
    st, r = post(c, {"prompt": PROMPT, "max_tokens": 2})
    check(st == 200, f"still serving: {st} {r}")


def test_refused_and_validated_parameters():
    c, chat = "/v1/completions", "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Who made the heaven?"}]

    def refused(path, extra, param, status=400):
        base = {"prompt": PROMPT} if path == c else {"messages": msgs}
        st, data, _ = srv.request("POST", path, json.dumps({**base, "max_tokens": 2, **extra}),
                                  {**AUTH, "Content-Type": "application/json"})
        j = json.loads(data)
        check(st == status and j["error"]["param"] == param and param in j["error"]["message"],
              f"{path} {extra}: want {status} naming {param!r}, got {st} {j}")

    for extra, param in [
            ({"suffix": "amen"}, "suffix"), ({"best_of": 0}, "best_of"),
            ({"best_of": 2, "stream": True}, "best_of"), ({"best_of": 2, "n": 3}, "best_of"),
            ({"echo": "yes"}, "echo"), ({"n": 65}, "n"), ({"n": 0}, "n"),
            ({"n": 2, "prompt": [PROMPT] * 33}, "prompt"),
            ({"frequency_penalty": "abc"}, "frequency_penalty"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"logit_bias": {"abc": 1}}, "logit_bias"),
            ({"logit_bias": {"32000": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": [1]}, "logit_bias"),
            ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5}, "min_tokens"),
            ({"ignore_eos": "yes"}, "ignore_eos"), ({"logprobs": 21}, "logprobs"),
            ({"logprobs": True}, "logprobs"), ({"seed": 1.5}, "seed"),
            ({"top_k": "x"}, "top_k"), ({"stream": 1}, "stream"),
            ({"stream_options": {"include_usage": True, "frobnicate": True}},
             "stream_options.frobnicate"),
            ({"stream_options": {"continuous_usage_stats": 1}}, "continuous_usage_stats"),
            ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": "x"}, "min_p"),
            ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
            ({"metadata": ["a"]}, "metadata"), ({"metadata": {"k": 1}}, "metadata"),
            ({"service_tier": 1}, "service_tier"),
            ({"skip_special_tokens": "no"}, "skip_special_tokens"),
            ({"add_generation_prompt": False}, "add_generation_prompt"),  # chat only
            ({"user": 7}, "user"), ({"max_completion_tokens": "x"}, "max_completion_tokens"),
            ({"tools": [{"type": "function"}]}, "tools"),
            ({"frobnicate": 1}, "frobnicate")]:
        refused(c, extra, param)
    for extra, param in [
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ({"tool_choice": "auto"}, "tool_choice"),
            ({"functions": [{"name": "f"}]}, "functions"),
            ({"function_call": "auto"}, "function_call"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"response_format": "text"}, "response_format"),
            ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {}}, "audio"),
            ({"store": True}, "store"), ({"top_logprobs": 2}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logprobs": 3}, "logprobs"), ({"suffix": "x"}, "suffix"),
            ({"frequency_penalty": "abc"}, "frequency_penalty"),
            ({"add_generation_prompt": 0}, "add_generation_prompt")]:
        refused(chat, extra, param)
    # Their neutral values are accepted.
    st, r = post(chat, {"messages": msgs, "max_tokens": 2, "tools": [], "tool_choice": "none",
                        "response_format": {"type": "text"}, "n": 1, "user": "u1",
                        "parallel_tool_calls": False, "store": False, "modalities": ["text"]})
    check(st == 200 or not HAVE_KJV, f"neutral chat parameters: {st} {r}")
    st, r = post(c, {"prompt": PROMPT, "max_tokens": 2, "suffix": "", "best_of": 1,
                     "echo": False, "n": 1, "presence_penalty": 0, "logit_bias": {}})
    check(st == 200, f"neutral completion parameters: {st} {r}")
    # max_completion_tokens wins over max_tokens.
    st, r = post(chat if HAVE_KJV else c,
                 {**({"messages": msgs} if HAVE_KJV else {"prompt": PROMPT}),
                  "max_tokens": 9, "max_completion_tokens": 3, "temperature": 0,
                  "ignore_eos": True})
    check(st == 200 and r["usage"]["completion_tokens"] == 3, f"max_completion_tokens: {r}")


def test_n_and_prompt_batches():
    def one(prompt, seed, n=1):
        st, r = post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "seed": seed,
                                         "n": n})
        check(st == 200, f"{st} {r}")
        return r
    alone = [one(PROMPT, 7)["choices"][0]["text"], one(PROMPT, 8)["choices"][0]["text"]]
    r = one(PROMPT, 7, n=2)
    got = {c["index"]: c["text"] for c in r["choices"]}
    check(got == {0: alone[0], 1: alone[1]}, f"n=2: choice i samples with seed + i: {got} "
          f"vs {alone}")
    check(r["usage"]["prompt_tokens"] == one(PROMPT, 7)["usage"]["prompt_tokens"]
          and r["usage"]["completion_tokens"] == 16, f"usage counts the prompt once: {r['usage']}")
    # A batch of prompts, n = 2 each, streamed: choice p * n + j; equal to the requests alone.
    second = "In the beginning" if HAVE_KJV else "And the"
    body = {"prompt": [PROMPT, second], "max_tokens": 6, "temperature": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    c2, resp = stream("/v1/completions", body)
    texts, finishes, usage = {}, {}, None
    for j in sse_chunks(resp):
        for ch in j["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            finishes[ch["index"]] = ch["finish_reason"] or finishes.get(ch["index"])
        usage = j.get("usage") or usage
    c2.close()
    want = [post("/v1/completions", {"prompt": p, "max_tokens": 6,
                                     "temperature": 0})[1]["choices"][0]["text"]
            for p in [PROMPT, second]]
    check(texts == {0: want[0], 1: want[0], 2: want[1], 3: want[1]},
          f"batch x n: {texts} vs {want}")
    check(all(finishes[i] for i in range(4)) and usage["completion_tokens"] == 24,
          f"finishes {finishes} usage {usage}")
    # echo: the prompt's text first (string and token-id prompts; streaming too).
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                     "echo": True})
    plain = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                     "temperature": 0})[1]["choices"][0]["text"]
    check(r["choices"][0]["text"] == PROMPT + plain, f"echo: {r['choices'][0]['text']!r}")
    ids = post("/tokenize", {"prompt": PROMPT})[1]["tokens"]
    st, r = post("/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                     "echo": True})
    check(r["choices"][0]["text"] == PROMPT + plain, f"echo of ids: {r['choices'][0]['text']!r}")
    c3, resp = stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                          "echo": True, "stream": True})
    first = next(json.loads(d) for e, d in sse_events(resp) if e != "comment")
    c3.close()
    check(first["choices"][0]["text"] == PROMPT, f"streamed echo first: {first}")
    # best_of 3, n 1: the most likely of seeds s, s+1, s+2 (cumulative logprob).
    cands = []
    for seed in (21, 22, 23):
        r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "seed": seed,
                                     "logprobs": 0})[1]["choices"][0]
        cands.append((sum(r["logprobs"]["token_logprobs"]), r["text"]))
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "seed": 21,
                                     "best_of": 3})
    check(st == 200 and len(r["choices"]) == 1 and r["choices"][0]["text"] == max(cands)[1]
          and r["choices"][0]["logprobs"] is None and r["usage"]["completion_tokens"] == 18,
          f"best_of: {r} vs {cands}")
    if HAVE_KJV:
        st, r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who?"}],
                                              "max_tokens": 4, "n": 3, "seed": 1})
        check(st == 200 and sorted(c["index"] for c in r["choices"]) == [0, 1, 2], f"{r}")


def prompt_logprobs(server, prompt, headers=AUTH, stream_it=False):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    if not stream_it:
        st, r = server.json("POST", "/v1/completions", body, headers)
        check(st == 200, f"{st} {r}")
        return r["choices"][0]["logprobs"], r["choices"][0]["text"]
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
              headers={**headers, "Content-Type": "application/json"})
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    text = ""
    for j in sse_chunks(c.getresponse()):
        for ch in j["choices"]:
            text += ch["text"]
            for k in lp:
                lp[k] += (ch["logprobs"] or {}).get(k, [])
    c.close()
    return lp, text


def test_echo_prompt_logprobs_any_worker_count():
    ids = post("/tokenize", {"prompt": PROMPT})[1]["tokens"]
    lp, text = prompt_logprobs(srv, PROMPT)
    n = len(ids)
    check(text.startswith(PROMPT) and len(lp["tokens"]) == n + 1
          and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
          and all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:]),
          f"echo + logprobs: {lp}")
    slp, stext = prompt_logprobs(srv, PROMPT, stream_it=True)
    check(stext == text and slp["tokens"] == lp["tokens"] and all(
        (a is None and b is None) or abs(a - b) < 1e-6
        for a, b in zip(slp["token_logprobs"], lp["token_logprobs"])), f"streamed: {slp}")
    # A long prompt (about 1500 tokens, 6 prefill chunks): each rank scores its own shard of each
    # chunk; 1, 2 and 3 workers agree within fp32 noise.
    text = "And God said, Let there be light: and there was light. " * 110
    long_ids = post("/tokenize", {"prompt": text})[1]["tokens"][:1500]
    got = {2: prompt_logprobs(srv, long_ids)[0]["token_logprobs"]}
    for w in (1, 3):
        other = Server(workers=w)
        try:
            got[w] = prompt_logprobs(other, long_ids, headers={})[0]["token_logprobs"]
        finally:
            other.stop()
    for w in (2, 3):
        check(len(got[w]) == len(got[1]) == 1501, f"{w} workers: {len(got[w])} entries")
        worst = max(abs(a - b) for a, b in zip(got[w][1:1500], got[1][1:1500]))
        check(worst < 1e-3, f"{w} workers vs 1: prompt logprobs differ by {worst}")


def test_echo_with_max_tokens_zero():
    # The prompt alone (lm-eval's scoring): its text, its logprobs, no token, "length", usage 0.
    ids = post("/tokenize", {"prompt": PROMPT})[1]["tokens"]
    one, _ = prompt_logprobs(srv, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    st, r = post("/v1/completions", body)
    check(st == 200, f"max_tokens 0 with echo: {st} {r}")
    ch = r["choices"][0]
    lp = ch["logprobs"]
    check(ch["text"] == PROMPT and ch["finish_reason"] == "length", f"the prompt alone: {ch}")
    check(r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids),
          f"usage: {r['usage']}")
    check(lp["tokens"] == one["tokens"][:len(ids)] and lp["token_logprobs"][0] is None
          and all(abs(a - b) < 1e-6 for a, b in zip(lp["token_logprobs"][1:],
                                                      one["token_logprobs"][1:len(ids)])),
          f"the prompt's logprobs, as with a token after them: {lp} vs {one}")
    c, resp = stream("/v1/completions", {**body, "stream": True})
    chunks = list(sse_chunks(resp))
    c.close()
    text = "".join(ch["text"] for j in chunks for ch in j["choices"])
    reasons = [ch["finish_reason"] for j in chunks for ch in j["choices"] if ch["finish_reason"]]
    check(text == PROMPT and reasons == ["length"], f"streamed: {text!r} {reasons}")
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    check(st == 200 and r["choices"][0]["text"] == PROMPT, f"echo without logprobs: {st} {r}")
    # Without echo 0 asks for nothing: refused, saying so.
    st, data, _ = srv.request("POST", "/v1/completions",
                              json.dumps({"prompt": PROMPT, "max_tokens": 0}),
                              {**AUTH, "Content-Type": "application/json"})
    j = json.loads(data)
    check(st == 400 and j["error"]["param"] == "max_tokens" and "echo" in j["error"]["message"]
          and "got 0" in j["error"]["message"], f"max_tokens 0 without echo: {st} {j}")


def test_echo_text_offsets_index_the_text():
    # The offsets index the returned text: "And God said" + completion, " God" at 3 (the
    # dummy-prefix space of "▁And" is not in the text).
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True,
                                     "logprobs": 0, "temperature": 0})
    check(st == 200, f"{st} {r}")
    text = r["choices"][0]["text"]
    lp = r["choices"][0]["logprobs"]
    offsets, tokens = lp["text_offset"], lp["tokens"]
    check(offsets == sorted(offsets) and offsets[0] == 0, f"offsets: {offsets}")
    for tok, off in zip(tokens, offsets):
        if tok.startswith(" ") and off > 0:
            check(text[off:off + len(tok)] == tok, f"{tok!r} at {off} in {text!r}: {offsets}")
    n = len(post("/tokenize", {"prompt": PROMPT})[1]["tokens"])
    check(len(tokens) > n and offsets[n] == len(PROMPT),
          f"the first completion token at the prompt's end: {offsets} {tokens}")
    if HAVE_KJV:
        check(offsets[:4] == [0, 0, 3, 7], f"'And God said': {offsets[:4]} {tokens[:4]}")


def test_max_and_min_tokens_refusals_name_the_value():
    c = "/v1/completions"
    st, m = srv.json("GET", "/v1/models", headers=AUTH)
    cap = m["data"][0]["max_model_len"]
    for body, fragment, wrong, param in [
            ({"max_tokens": 2 ** 64 - 1}, "18446744073709551615", "must be > 0", "max_tokens"),
            ({"max_tokens": 10 ** 12}, "1000000000000", "1073741824", "max_tokens"),
            ({"max_tokens": cap * 64}, str(cap * 64), "1073741824", "max_tokens"),
            ({"min_tokens": 2 ** 40}, "1099511627776", "1073741824", "min_tokens"),
            ({"max_tokens": 3, "min_tokens": 5}, "(5)", "1073741824", "min_tokens")]:
        st, data, _ = srv.request("POST", c, json.dumps({"prompt": PROMPT, **body}),
                                  {**AUTH, "Content-Type": "application/json"})
        err = json.loads(data)["error"]
        msg = err["message"]
        check(st == 400 and fragment in msg and wrong not in msg and err["param"] == param,
              f"{body}: {st} {err}")
    # min_tokens within the default max_tokens (16) is taken.
    st, r = post(c, {"prompt": PROMPT, "min_tokens": 4})
    check(st == 200, f"min_tokens 4: {st} {r}")


def test_prompt_ids_named_as_sent():
    """A prompt id outside the vocabulary is named as sent, whatever its width."""
    for bad in [2 ** 31, 2 ** 64 - 1, 2 ** 40, -2 ** 31 - 1, -1, 32000 if HAVE_KJV else 4099]:
        st, data, _ = srv.request("POST", "/v1/completions",
                                  json.dumps({"prompt": [1, bad], "max_tokens": 1}),
                                  {**AUTH, "Content-Type": "application/json"})
        err = json.loads(data)["error"]
        check(st == 400 and err["param"] == "prompt" and f"id {bad} is outside" in err["message"],
              f"{bad}: {st} {err}")


def test_routes_and_content_types():
    st, m = srv.json("GET", "/v1/models/" + os.path.basename(MODEL), headers=AUTH)
    check(st == 200 and m["id"] == os.path.basename(MODEL) and m["object"] == "model", f"{m}")
    st, m = srv.json("GET", "/v1/models/gpt-17", headers=AUTH)
    check(st == 404 and m["error"]["code"] == "model_not_found", f"{st} {m}")
    st, t = post("/tokenize", {"prompt": "Hello world!"})
    st, d = post("/detokenize", {"tokens": t["tokens"]})
    check(st == 200 and d["prompt"] == "Hello world!", f"detokenize: {st} {d}")
    expect_error(400, "/detokenize", {"tokens": [1, 10 ** 9]}, "tokens")
    st, v = srv.json("GET", "/version", headers=AUTH)
    check(st == 200 and v["version"] and "burst-server" in v["build"], f"version: {v}")
    # Not JSON: 415 naming the type, whatever the size (curl -d sends a form type).
    for body in [b'{"prompt": "x"}', b'{"prompt": "' + b"a" * 9000 + b'"}']:
        for ctype in ["application/x-www-form-urlencoded", "text/plain"]:
            st, data, _ = srv.request("POST", "/v1/completions", body,
                                      {**AUTH, "Content-Type": ctype})
            j = json.loads(data)
            check(st == 415 and ctype in j["error"]["message"]
                  and "application/json" in j["error"]["message"], f"{ctype}: {st} {j}")
    out = curl(f"http://127.0.0.1:{srv.http_port}/v1/completions", "-H",
               "Authorization: Bearer " + KEY, "-d", '{"prompt": "' + "a" * 9000 + '"}')
    check('"Content-Type' in out or "Content-Type" in out, f"curl -d: {out[:300]}")
    # JSON with a charset is JSON.
    st, data, _ = srv.request("POST", "/v1/completions",
                              json.dumps({"prompt": PROMPT, "max_tokens": 1}),
                              {**AUTH, "Content-Type": "application/json; charset=utf-8"})
    check(st == 200, f"charset: {st} {data[:200]!r}")
    # /ping is /health (vLLM, SageMaker), GET or POST, without the API key.
    for method in ["GET", "POST"]:
        st, data, _ = srv.request(method, "/ping")
        check(st == 200 and json.loads(data)["status"] == "ok", f"{method} /ping: {st} {data}")
    # A known path with another method: 405 and Allow; an unknown path stays 404.
    for method, path, allow in [("GET", "/v1/completions", "POST"),
                                ("DELETE", "/health", "GET"), ("PUT", "/tokenize", "POST"),
                                ("POST", "/v1/models", "GET")]:
        st, data, hdr = srv.request(method, path, headers=AUTH)
        j = json.loads(data)
        check(st == 405 and allow in hdr.get("Allow", "") and method in j["error"]["message"],
              f"{method} {path}: {st} {hdr} {j}")
    st, data, _ = srv.request("POST", "/v1/nowhere", headers=AUTH)
    check(st == 404, f"unknown route: {st} {data!r}")


def test_cors():
    # Off by default: no preflight answered, no CORS header (the suite's server has none set).
    st, _, hdr = srv.request("OPTIONS", "/v1/completions", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"})
    check(st != 204 and not any(k.lower().startswith("access-control") for k in hdr),
          f"CORS off: {st} {hdr}")
    origin = "https://app.example.com"
    web = Server("--api-key-file", KEY_FILE, "--grpc-port", -1, "--allowed-origins",
                 f"{origin}, http://localhost:3000", "--allowed-headers",
                 "authorization,content-type,x-request-id")
    try:
        # The preflight needs no key (browsers send none on it): 204 with the grants.
        st, data, hdr = web.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        check(st == 204 and data == b"" and hdr.get("Access-Control-Allow-Origin") == origin
              and "POST" in hdr.get("Access-Control-Allow-Methods", "") and
              "authorization" in hdr.get("Access-Control-Allow-Headers", "").lower() and
              hdr.get("Vary") == "Origin", f"preflight: {st} {hdr} {data!r}")
        # A disallowed origin, or a header not in --allowed-headers: 400 naming it, no grant.
        for h, word in [({"Origin": "https://evil.example.com"}, "origin"),
                        ({"Origin": origin, "Access-Control-Request-Headers": "x-secret"},
                         "x-secret")]:
            st, data, hdr = web.request("OPTIONS", "/v1/completions", headers={
                "Access-Control-Request-Method": "POST", **h})
            check(st == 400 and word in json.loads(data)["error"]["message"] and
                  "Access-Control-Allow-Origin" not in hdr, f"refused preflight: {st} {hdr}")
        # The request itself still needs the key; its answers carry the origin: a completion,
        # an SSE stream, an error, the 401.
        body = json.dumps({"prompt": PROMPT, "max_tokens": 3})
        for payload, headers, want in [
                (body, AUTH, 200),
                (json.dumps({"prompt": PROMPT, "max_tokens": 3, "stream": True}), AUTH, 200),
                (json.dumps({"prompt": 42}), AUTH, 400), (body, {}, 401)]:
            st, data, hdr = web.request("POST", "/v1/completions", payload, {
                **headers, "Origin": origin, "Content-Type": "application/json"})
            check(st == want and hdr.get("Access-Control-Allow-Origin") == origin and
                  "X-Request-Id" in hdr.get("Access-Control-Expose-Headers", ""),
                  f"{want}: {st} {hdr} {data[:200]!r}")
        st, data, hdr = web.request("POST", "/v1/completions", body, {
            **AUTH, "Origin": "https://evil.example.com", "Content-Type": "application/json"})
        check(st == 200 and "Access-Control-Allow-Origin" not in hdr,
              f"a disallowed origin gets no CORS header (the browser blocks it): {hdr}")
    finally:
        web.stop()
    # --allow-credentials: the grant, and the origin echoed even under "*" (browsers refuse a
    # credentialed answer whose allowed origin is "*"); an unlisted origin still gets nothing.
    cred = Server("--api-key-file", KEY_FILE, "--grpc-port", -1, "--allowed-origins", "*",
                  "--allow-credentials")
    try:
        st, data, hdr = cred.request("OPTIONS", "/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization"})
        check(st == 204 and hdr.get("Access-Control-Allow-Origin") == origin and
              hdr.get("Access-Control-Allow-Credentials") == "true" and
              hdr.get("Access-Control-Allow-Headers") == "authorization" and
              hdr.get("Vary") == "Origin", f"credentialed preflight: {st} {hdr}")
        st, data, hdr = cred.request("POST", "/v1/completions", json.dumps(
            {"prompt": PROMPT, "max_tokens": 2}), {**AUTH, "Origin": "http://localhost:3000",
                                                    "Content-Type": "application/json"})
        check(st == 200 and hdr.get("Access-Control-Allow-Origin") == "http://localhost:3000"
              and hdr.get("Access-Control-Allow-Credentials") == "true",
              f"credentialed request: {st} {hdr}")
    finally:
        cred.stop()
    web = Server("--api-key-file", KEY_FILE, "--grpc-port", -1, "--allowed-origins", origin,
                 "--allow-credentials")
    try:
        st, data, hdr = web.request("POST", "/v1/completions", json.dumps(
            {"prompt": PROMPT, "max_tokens": 2}), {**AUTH, "Origin": "https://evil.example.com",
                                                    "Content-Type": "application/json"})
        check(st == 200 and not any(k.lower().startswith("access-control") for k in hdr),
              f"credentials: an unlisted origin gets no CORS header: {hdr}")
    finally:
        web.stop()
    # vLLM's JSON-list form is taken; an origin with a path is refused by name.
    server = os.path.join(build_dir(), "bin", "burst-server")
    ok = subprocess.run([server, "--model", MODEL, "--check-config", "--allowed-origins",
                         '["https://a.example", "http://b.example:8000"]'], capture_output=True)
    check(ok.returncode == 0 and b'"https://a.example' in ok.stdout, f"JSON list: {ok.stderr!r}")
    bad = subprocess.run([server, "--model", MODEL, "--check-config", "--allowed-origins",
                          "https://a.example/app"], capture_output=True)
    check(bad.returncode == 2 and b"allowed_origins" in bad.stderr and b"not an origin" in
          bad.stderr, f"bad origin: {bad.returncode} {bad.stderr!r}")


def test_request_id_and_access_log():
    st, data, hdr = srv.request("POST", "/v1/completions",
                                json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                                {**AUTH, "Content-Type": "application/json",
                                 "X-Request-Id": "my-req-42"})
    check(st == 200 and hdr.get("X-Request-Id") == "my-req-42", f"X-Request-Id: {hdr}")
    st, data, hdr = srv.request("POST", "/v1/completions", json.dumps({"prompt": 42}),
                                {**AUTH, "Content-Type": "application/json",
                                 "X-Request-Id": "my-bad-43"})
    check(st == 400 and hdr.get("X-Request-Id") == "my-bad-43", f"{st} {hdr}")
    st, data, hdr = srv.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT}),
                                {"Content-Type": "application/json", "X-Request-Id": "my-401"})
    check(st == 401 and hdr.get("X-Request-Id") == "my-401", f"{st} {hdr}")
    st, data, hdr = srv.request("GET", "/v1/models", headers=AUTH)
    check(hdr.get("X-Request-Id", "").startswith("req-"), f"a fresh id: {hdr}")
    st, data, hdr = srv.request("GET", "/v1/models", headers={**AUTH, "X-Request-Id": "a b\"c"})
    check(hdr.get("X-Request-Id", "").startswith("req-"), f"not printable: a fresh id: {hdr}")
    deadline = time.time() + 10
    want = {"my-req-42": " 200 ", "my-bad-43": " 400 ", "my-401": " 401 "}
    while time.time() < deadline:
        log = open(srv.log_path, errors="replace").read()
        lines = {k: [ln for ln in log.splitlines() if "access" in ln and "request_id=" + k in ln]
                 for k in want}
        if all(lines.values()):
            break
        time.sleep(0.1)
    for k, status in want.items():
        check(lines[k] and status in lines[k][0] and "/v1/completions" in lines[k][0]
              and " ms " in lines[k][0], f"access log for {k}: {lines[k]}")
    check("prompt_tokens=" in lines["my-req-42"][0] and "completion_tokens=2" in
          lines["my-req-42"][0], f"tokens in the access log: {lines['my-req-42']}")


def test_logprobs():
    # Completions, non-streaming and streaming: the same tokens and values.
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    st, r = post("/v1/completions", body)
    lp = r["choices"][0]["logprobs"]
    check(st == 200 and len(lp["tokens"]) == 6 and len(lp["token_logprobs"]) == 6
          and len(lp["top_logprobs"]) == 6 and len(lp["text_offset"]) == 6, f"{r}")
    check("".join(lp["tokens"]) == r["choices"][0]["text"], f"tokens {lp['tokens']}")
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        check(len(top) == 3 and v <= 0 and abs(max(top.values()) - v) < 1e-6,
              f"greedy: the token is the most likely: {tok} {v} {top}")
    c2, resp = stream("/v1/completions", {**body, "stream": True})
    toks, vals = [], []
    for j in sse_chunks(resp):
        for ch in j["choices"]:
            if ch["logprobs"]:
                toks += ch["logprobs"]["tokens"]
                vals += ch["logprobs"]["token_logprobs"]
    c2.close()
    check(toks == lp["tokens"] and max(abs(a - b) for a, b in zip(vals, lp["token_logprobs"]))
          < 1e-6, f"stream logprobs {toks} {vals}")
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(r["choices"][0]["logprobs"] is None, "no logprobs unless asked")
    if not HAVE_KJV:
        return
    msgs = [{"role": "user", "content": "Who made the heaven?"}]
    st, r = post("/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0,
                                          "logprobs": True, "top_logprobs": 2})
    content = r["choices"][0]["logprobs"]["content"]
    check(st == 200 and 1 <= len(content) <= 5, f"chat logprobs {r}")
    for e in content:
        check(set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"])
              == 2 and e["bytes"] == list(e["token"].encode()), f"entry {e}")
        check(abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6, f"greedy {e}")


def test_eos_bias_min_tokens_ignore_eos():
    eos = 2
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    st, r = post("/v1/completions", {**base, "logit_bias": {str(eos): 100}})
    check(st == 200 and r["choices"][0]["finish_reason"] == "stop"
          and r["usage"]["completion_tokens"] == 1, f"EOS forced: {r}")
    st, r = post("/v1/completions", {**base, "logit_bias": {str(eos): 100}, "min_tokens": 3})
    check(r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4,
          f"min_tokens 3, then EOS: {r}")
    st, r = post("/v1/completions", {**base, "logit_bias": {str(eos): 100}, "ignore_eos": True})
    check(r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 8,
          f"ignore_eos: {r}")
    st, plain = post("/v1/completions", {**base, "max_tokens": 30})
    st, pen = post("/v1/completions", {**base, "max_tokens": 30, "frequency_penalty": 2,
                                       "presence_penalty": 2})
    check(pen["choices"][0]["text"] != plain["choices"][0]["text"],
          f"penalties change greedy text: {pen['choices'][0]['text']!r}")
    world = 3186  # "▁world" (see test_health_models_tokenize)
    st, r = post("/v1/completions", {**base, "max_tokens": 3, "logit_bias": {str(world): 100}})
    check(r["choices"][0]["text"] == " world" * 3, f"bias +100: {r}")


def test_stop_token_ids():
    """vLLM's stop_token_ids: sampling one ends the choice with "stop" and its text is not sent;
    an id outside the vocabulary is a 400 naming the parameter (both endpoints)."""
    c = "/v1/completions"
    base = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    st, r = post(c, {**base, "max_tokens": 3, "logprobs": 0})
    check(st == 200, f"{st} {r}")
    pieces = r["choices"][0]["logprobs"]["tokens"]
    # The generated ids: the prompt and the text tokenized together, checked against the pieces
    # the model sampled (the prompt's ids echoed with logprobs name their pieces the same way).
    prompt_ids = post("/tokenize", {"prompt": PROMPT})[1]["tokens"]
    ids = post("/tokenize", {"prompt": PROMPT + r["choices"][0]["text"]})[1]["tokens"]
    gen = ids[len(prompt_ids):]
    st, e = post(c, {"prompt": prompt_ids + gen, "max_tokens": 1, "echo": True, "logprobs": 0})
    check(ids[:len(prompt_ids)] == prompt_ids and len(gen) == 3 and
          e["choices"][0]["logprobs"]["tokens"][len(prompt_ids):len(ids)] == pieces,
          f"generated ids {gen} vs pieces {pieces}: {e}")
    check(gen[2] not in gen[:2], f"the third id must be new for this test: {gen}")
    two = post(c, {**base, "max_tokens": 2})[1]["choices"][0]["text"]
    for extra in [{}, {"stream": True}]:
        body = {**base, "max_tokens": 8, "stop_token_ids": [gen[2], 0], **extra}
        if extra:
            conn, resp = stream(c, body)
            chunks = list(sse_chunks(resp))
            conn.close()
            text = "".join(ch["text"] for j in chunks for ch in j["choices"])
            finish = [ch["finish_reason"] for j in chunks for ch in j["choices"]][-1]
        else:
            st, r = post(c, body)
            check(st == 200, f"{st} {r}")
            text, finish = r["choices"][0]["text"], r["choices"][0]["finish_reason"]
            # The stop id is counted, as EOS is.
            check(r["usage"]["completion_tokens"] == 3, f"usage: {r['usage']}")
        check(text == two and finish == "stop", f"stop_token_ids {extra}: {text!r} {finish} "
              f"(want {two!r}, stop)")
    # min_tokens holds: the id does not stop the sequence before 3 tokens came.
    st, r = post(c, {**base, "max_tokens": 4, "stop_token_ids": [gen[0]], "min_tokens": 3})
    check(r["usage"]["completion_tokens"] == 4, f"min_tokens with stop_token_ids: {r}")
    chat = {"messages": [{"role": "user", "content": "Who?"}]}
    for path, b in [(c, {"prompt": PROMPT}), ("/v1/chat/completions", chat)]:
        for bad, words in [([10 ** 6], "1000000 is not one"), ([-1], "-1 is not one"), (["5"], "token ids"),
                           (5, "array"), ([1] * 65, "up to 64")]:
            st, data, _ = srv.request("POST", path, json.dumps({**b, "stop_token_ids": bad}),
                                      {**AUTH, "Content-Type": "application/json"})
            err = json.loads(data)["error"]
            check(st == 400 and err["param"] == "stop_token_ids" and words in err["message"]
                  and "stop_token_ids" in err["message"], f"{path} {bad}: {st} {err}")


def test_versions_and_help():
    for b in ["burst-server", "burst-generate", "burst-worker"]:
        out = subprocess.run([os.path.join(build_dir(), "bin", b), "--version"],
                             capture_output=True, check=True).stdout.decode()
        check(out.startswith(b + " ") and "build" in out, f"{b} --version: {out!r}")
    # burst-worker --help exits 0 and names every flag its parser takes (read from the sources
    # of server/worker/, wherever the parser lives, so a flag added without its help line fails
    # here).
    import glob
    import re
    worker = subprocess.run([os.path.join(build_dir(), "bin", "burst-worker"), "--help"],
                            capture_output=True)
    src = "".join(open(f).read() for f in sorted(glob.glob(
        os.path.join(ROOT, "server", "worker", "*.cpp"))))
    flags = set(re.findall(r'add_(?:option|flag)\("(--[a-z-]+)"', src))
    text = worker.stdout.decode()
    check(worker.returncode == 0 and len(flags) >= 15 and
          all(f in text for f in flags), f"burst-worker --help: {worker.returncode}, lacks "
          f"{sorted(f for f in flags if f not in text)}")
    server = os.path.join(build_dir(), "bin", "burst-server")
    helptext = subprocess.run([server, "--help"], capture_output=True,
                              check=True).stdout.decode()
    keys = json.loads(subprocess.run([server, "--model", MODEL, "--check-config"],
                                     capture_output=True, check=True).stdout)
    for k in keys:
        check("--" + k.replace("_", "-") in helptext, f"--help lacks --{k}")
    for flag in ["--config", "--data-dir", "--check-config", "--version", "--log-level",
                 "--log-format"]:
        check(flag in helptext, f"--help lacks {flag}")
    # The API key once: a flag and a file together, or an empty file, are refused by name.
    both = subprocess.run([server, "--model", MODEL, "--check-config", "--api-key", "k",
                           "--api-key-file", KEY_FILE], capture_output=True)
    check(both.returncode != 0 and b"not both" in both.stderr, f"key twice: {both.stderr!r}")
    empty = os.path.join(os.path.dirname(KEY_FILE), "empty-key")
    open(empty, "w").close()
    bad = subprocess.run([server, "--model", MODEL, "--check-config", "--api-key-file", empty],
                         capture_output=True)
    check(bad.returncode != 0 and b"--api-key-file" in bad.stderr, f"empty: {bad.stderr!r}")


def test_json_logs():
    js = Server("--log-format", "json", "--log-level", "info")
    try:
        js.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        js.json("POST", "/v1/completions", {"prompt": 42})
        time.sleep(0.3)
    finally:
        js.stop()
    recs, access = [], []
    for line in open(js.log_path, errors="replace").read().splitlines():
        if '"logger":"burst-server"' in line:
            recs.append(json.loads(line))
        if '"logger":"access"' in line:
            access.append(json.loads(line))
    check(recs and all({"time", "level", "logger", "msg"} <= set(r) for r in recs),
          f"JSON log lines: {recs[:3]}")
    # Access records: the fields as members.
    ok = [r for r in access if r["status"] == 200 and r["path"] == "/v1/completions"]
    bad = [r for r in access if r["status"] == 400]
    check(ok and bad and ok[0]["completion_tokens"] == 2 and ok[0]["latency_ms"] >= 0
          and ok[0]["request_id"].startswith("req-") and "prompt" in bad[0]["error"],
          f"access records: {access}")
    bad = subprocess.run([os.path.join(build_dir(), "bin", "burst-server"), "--model", MODEL,
                          "--log-format", "xml"], capture_output=True)
    check(bad.returncode == 2 and b"log_format" in bad.stderr, f"bad format: {bad.stderr!r}")


def test_metrics():
    st, data, hdr = srv.request("GET", "/metrics")
    text = data.decode()
    check(st == 200 and hdr.get("Content-Type", "").startswith("text/plain"), "metrics type")
    for name in ["burst:time_to_first_token_seconds_bucket", "burst:time_per_output_token_seconds",
                 "burst:e2e_request_latency_seconds", "burst:request_queue_time_seconds",
                 "burst:prompt_tokens_total", "burst:generation_tokens_total",
                 "burst:num_requests_running", "burst:num_requests_waiting",
                 "burst:kv_cache_usage_perc", 'le="300"']:
        check(name in text, f"metrics lack {name}")
    check(srv.metric("burst:generation_tokens_total") > 0, "tokens counted")
    name = os.path.basename(MODEL)
    check(f'burst:generation_tokens_total{{model_name="{name}"}}' in text, "model_name label")
    check(f'burst:time_to_first_token_seconds_bucket{{model_name="{name}",le="0.001"}}' in text,
          "model_name on histogram buckets")
    for reason in ["stop", "length", "abort"]:
        check(f'burst:request_success_total{{model_name="{name}",finished_reason="{reason}"}}'
              in text, f"request_success_total {reason}")
    check(srv.metric('burst:request_success_total{finished_reason="length"}') > 0,
          "length finishes counted")
    # The exposition format, as promtool reads it: HELP and TYPE before each family's samples,
    # well-formed sample lines, histogram buckets ending at +Inf equal to _count.
    import re
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                        r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*\})? (\S+)$')
    typed, names = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, n, t = line.split(" ", 3)
            typed[n] = t
            continue
        if line.startswith("#") or not line:
            continue
        m = sample.match(line)
        check(m is not None, f"malformed sample line {line!r}")
        float(m.group(3))
        n = m.group(1)
        base = re.sub(r"_(bucket|sum|count)$", "", n) if n not in typed else n
        check(base in typed, f"{n} has no TYPE line")
        names.add(n)
    for n, t in typed.items():
        if t == "histogram":
            inf = [ln for ln in text.splitlines() if ln.startswith(n + "_bucket") and 'le="+Inf"' in ln]
            cnt = [ln for ln in text.splitlines() if ln.startswith(n + "_count")]
            check(inf and cnt and inf[0].split()[-1] == cnt[0].split()[-1], f"{n}: +Inf != count")
    # promtool (scripts/setup.sh takes it out of Debian's prometheus package), where present.
    # Exit code 1 is a format error; 3 is lint problems, of which only one is accepted: the
    # colon in every name (burst: as vLLM's vllm:; Prometheus keeps colons for recording rules
    # by convention, and ingests them all the same).
    import shutil
    promtool = shutil.which("promtool") or os.path.join(
        ROOT, "build", "third_party", "prometheus", "usr", "bin", "promtool")
    if os.access(promtool, os.X_OK):
        r = subprocess.run([promtool, "check", "metrics"], input=data, capture_output=True)
        problems = [ln for ln in (r.stdout + r.stderr).decode().splitlines()
                    if ln and not ln.endswith("metric names should not contain ':'")]
        check(r.returncode in (0, 3) and not problems,
              f"promtool check metrics: exit {r.returncode}: {problems}")
    else:
        print("note: promtool not found (scripts/setup.sh fetches it): its check is skipped")
    # The Grafana dashboard (deploy/grafana) parses and queries only metrics that exist.
    dash = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "deploy", "grafana", "burst-dashboard.json")))
    queried = {m for p in dash["panels"] for t in p["targets"]
               for m in re.findall(r"burst:[a-z0-9_]+", t["expr"])}
    check(queried and queried <= names, f"dashboard queries missing metrics: {queried - names}")


def test_metrics_require_key():
    # By default /metrics, like /health, answers without the key (the main server has one);
    # --metrics-require-key 1 puts /metrics behind it, /health stays open.
    st, _, _ = srv.request("GET", "/metrics")
    check(st == 200, f"default: /metrics without the key: {st}")
    locked = Server("--api-key-file", KEY_FILE, "--metrics-require-key", 1, "--grpc-port", -1)
    try:
        st, data, _ = locked.request("GET", "/metrics")
        err = json.loads(data)["error"]
        check(st == 401 and err["code"] == "invalid_api_key" and "missing API key" in
              err["message"], f"/metrics without the key: {st} {err}")
        st, _, _ = locked.request("GET", "/metrics", headers={"Authorization": "Bearer nope"})
        check(st == 401, f"/metrics with a wrong key: {st}")
        st, data, _ = locked.request("GET", "/metrics", headers=AUTH)
        check(st == 200 and "burst:num_requests_running" in data.decode(),
              f"/metrics with the key: {st}")
        st, _, _ = locked.request("GET", "/health")
        check(st == 200, f"/health without the key: {st}")
    finally:
        locked.stop()
    bad = subprocess.run([os.path.join(build_dir(), "bin", "burst-server"), "--model", MODEL,
                          "--check-config", "--metrics-require-key", "2"], capture_output=True)
    check(bad.returncode == 2 and b"metrics_require_key must be 0 or 1" in bad.stderr,
          f"--metrics-require-key 2: {bad.returncode} {bad.stderr!r}")


def test_concurrent_clients():
    errors, texts = [], []

    def client(i):
        try:
            st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
            if st != 200:
                errors.append((i, st, r))
            else:
                texts.append(r["choices"][0]["text"])
        except Exception as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(not errors, f"errors: {errors[:3]}")
    check(len(set(texts)) == 1 and len(texts) == 16, "16 greedy answers, all equal")


def test_cancelled_streams_free_kv():
    for i in range(200):
        c, resp = stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 200,
                                             "stream": True, "temperature": 0})
        resp.readline()  # the first chunk has started: the request is on the ring
        c.sock.close()
        c.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        if (srv.kv_held() == 0
                and srv.metric("burst:num_requests_running") == 0
                and srv.metric("burst:num_requests_waiting") == 0):
            break
        time.sleep(0.2)
    check(srv.kv_held() == 0, "KV use back to zero")
    check(srv.metric('burst:requests_total{outcome="cancelled"}') >= 150,
          "disconnects cancel their requests")
    st, r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    check(st == 200, "serves after 200 cancellations")


def test_queue_full_gets_503():
    # A server whose batch holds one sequence and whose queue holds nobody: while one request
    # runs, the next is refused at once with 503 and Retry-After (it does not wait), and the
    # server keeps serving afterwards.
    small = Server("--max-queue", 0, "--max-running", 1)
    try:
        started = threading.Event()

        def long_request():
            c = http.client.HTTPConnection("127.0.0.1", small.http_port, timeout=60)
            c.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}),
                headers={"Content-Type": "application/json"})
            r = c.getresponse()
            check(r.status == 200, f"the first request runs on an idle server: HTTP {r.status}")
            r.readline()  # the request is running once its stream has begun
            started.set()
            r.read()
            c.close()

        t = threading.Thread(target=long_request)
        t.start()
        check(started.wait(30), "the first request started")
        c = http.client.HTTPConnection("127.0.0.1", small.http_port, timeout=30)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        body = json.loads(r.read())
        check(r.status == 503, f"queue full: HTTP {r.status} {body}")
        check(r.getheader("Retry-After") is not None, "Retry-After on 503")
        check("error" in body, f"OpenAI-style error object: {body}")
        t.join()
        # The client sees [DONE] a moment before the scheduler has let go of the finished
        # request; with a zero-length queue a request in that moment is still refused.
        for _ in range(50):
            status, _ = small.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
            if status == 200:
                break
            time.sleep(0.1)
        check(status == 200, f"served after the queue drained: HTTP {status}")
    finally:
        small.stop()


def test_sigterm_drains():
    c, resp = stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 60, "stream": True,
                                         "temperature": 0})
    resp.readline()
    srv.proc.send_signal(15)
    got_done = any(data == "[DONE]" for _, data in sse_events(resp))
    c.close()
    rc = srv.proc.wait(timeout=30)
    check(got_done, "the in-flight stream finished")
    check(rc == 0, f"exit code {rc}")
    check(not srv.worker_pids(), "workers stopped")


if __name__ == "__main__":
    # The key from a file (with the newline an editor leaves): every 401 / 200 below reads it.
    KEY_FILE = os.path.join(tempfile.mkdtemp(prefix="burst-test-http-"), "api-key")
    with open(KEY_FILE, "w") as f:
        f.write(KEY + "\n")
    srv = Server("--api-key-file", KEY_FILE, "--max-body-bytes", 65536, "--keepalive-ms", 100)
    try:
        run([test_health_models_tokenize, test_completion_matches_burst_generate,
             test_curl_sse_and_progress, test_keepalive_while_queued, test_chat, test_stop_string,
             test_bad_inputs, test_refused_and_validated_parameters,
             test_n_and_prompt_batches, test_echo_prompt_logprobs_any_worker_count,
             test_echo_with_max_tokens_zero, test_echo_text_offsets_index_the_text,
             test_max_and_min_tokens_refusals_name_the_value,
             test_routes_and_content_types, test_cors, test_request_id_and_access_log,
             test_logprobs,
             test_eos_bias_min_tokens_ignore_eos, test_stop_token_ids, test_min_p,
             test_include_stop_str_in_output, test_continuous_usage_stats,
             test_accepted_no_op_parameters, test_add_generation_prompt,
             test_response_size_is_bounded, test_prompt_ids_named_as_sent,
             test_versions_and_help, test_json_logs,
             test_metrics, test_metrics_require_key, test_concurrent_clients,
             test_cancelled_streams_free_kv, test_queue_full_gets_503, test_sigterm_drains])
    finally:
        srv.stop()
