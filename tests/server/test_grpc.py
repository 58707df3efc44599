"""End-to-end test of burst-server's gRPC API with the Python gRPC client (Debian
python3-grpcio), stubs generated from proto/burst/v1/burst.proto by protoc and Debian's
grpc_python_plugin: a streaming Generate (started, tokens, finished; text equal to the HTTP
API's), Tokenize, ModelInfo, the error codes, the API key, the grpc.health.v1 service, and the
limits for slow and idle clients (bounded threads, a deadline for a call's message, handshake and
idle-connection deadlines; one client's many idle connections served around and closed, its
calls beyond --grpc-max-calls-per-client refused).
Run: /usr/bin/python3 test_grpc.py --build BUILD_DIR."""
import os
import socket
import subprocess
import tempfile
import threading
import time

import grpc

from harness import HAVE_KJV, PROMPT, Server, check, compile_protos, run

KEY = "grpc-key"
MD = [("authorization", "Bearer " + KEY)]
HEALTH_PROTO = """syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health { rpc Check(HealthCheckRequest) returns (HealthCheckResponse); }
"""

out = tempfile.mkdtemp(prefix="burst-pb-")
with open(os.path.join(out, "health.proto"), "w") as f:
    f.write(HEALTH_PROTO)
compile_protos("burst/v1/burst.proto", out=out)
compile_protos("health.proto", proto_path=out, out=out)
from burst.v1 import burst_pb2, burst_pb2_grpc  # noqa: E402
import health_pb2, health_pb2_grpc  # noqa: E402

srv = None
stub = None


def code_of(fn):
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_generate_stream():
    req = burst_pb2.GenerateRequest(text=PROMPT, max_tokens=10,
                                    sampling=burst_pb2.SamplingParams(temperature=0))
    events = list(stub.Generate(req, metadata=MD, timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    check(kinds[0] == "started" and kinds[-1] == "finished", f"event order {kinds}")
    check(events[0].started.prompt_tokens > 1, "prompt token count")
    toks = [e.token for e in events if e.WhichOneof("event") == "token"]
    check(toks[0].ttft_ms > 0, "ttft on the first token")
    fin = events[-1].finished
    check(fin.finish_reason == "length" and fin.completion_tokens == 10, f"{fin}")
    text = "".join(t.text for t in toks)
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 10,
                                                 "temperature": 0})
    check(text == r["choices"][0]["text"], f"gRPC {text!r} != HTTP {r['choices'][0]['text']!r}")


def test_defaults_and_parameters_as_http():
    def gen_text(**kw):
        events = list(stub.Generate(burst_pb2.GenerateRequest(text=PROMPT, **kw), metadata=MD,
                                    timeout=60))
        toks = [e.token for e in events if e.WhichOneof("event") == "token"]
        return "".join(t.text for t in toks), toks, events[-1].finished

    # Unset temperature: 1.0, as HTTP's default; the same seed gives HTTP's text.
    a, _, _ = gen_text(max_tokens=12, sampling=burst_pb2.SamplingParams(seed=5))
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "seed": 5})
    check(a == r["choices"][0]["text"], f"default temperature: {a!r} != HTTP's {r}")
    # Logprobs: the same values as HTTP's.
    _, toks, _ = gen_text(max_tokens=4, logprobs=True, top_logprobs=2,
                          sampling=burst_pb2.SamplingParams(temperature=0))
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                 "temperature": 0, "logprobs": 2})
    want = r["choices"][0]["logprobs"]["token_logprobs"]
    got = [t.logprob for t in toks if t.id >= 0]
    check(len(got) == 4 and max(abs(x - y) for x, y in zip(got, want)) < 1e-6
          and all(len(t.top_logprobs) == 2 for t in toks if t.id >= 0), f"{got} vs {want}")
    # logit_bias, min_tokens, ignore_eos, penalties.
    text, _, _ = gen_text(max_tokens=3, sampling=burst_pb2.SamplingParams(
        temperature=0, logit_bias={3186: 100}))
    check(text == " world world world", f"logit_bias: {text!r}")
    _, _, fin = gen_text(max_tokens=6, min_tokens=2, sampling=burst_pb2.SamplingParams(
        temperature=0, logit_bias={2: 100}))
    check(fin.finish_reason == "stop" and fin.completion_tokens == 3, f"min_tokens: {fin}")
    _, _, fin = gen_text(max_tokens=5, ignore_eos=True, sampling=burst_pb2.SamplingParams(
        temperature=0, logit_bias={2: 100}))
    check(fin.finish_reason == "length" and fin.completion_tokens == 5, f"ignore_eos: {fin}")
    c, d = code_of(lambda: gen_text(max_tokens=3, sampling=burst_pb2.SamplingParams(
        presence_penalty=3)))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "presence_penalty" in d, f"{c} {d}")


def test_stop_token_ids():
    """sampling.stop_token_ids: the generation ends with "stop" at the id, whose text is not
    sent; an id outside the vocabulary is INVALID_ARGUMENT naming the field."""
    def gen(**sampling):
        req = burst_pb2.GenerateRequest(text=PROMPT, max_tokens=8, ignore_eos=True,
                                        sampling=burst_pb2.SamplingParams(temperature=0,
                                                                          **sampling))
        events = list(stub.Generate(req, metadata=MD, timeout=60))
        return [e.token for e in events if e.WhichOneof("event") == "token"], events[-1].finished

    toks, _ = gen()
    ids = [t.id for t in toks]
    check(ids[2] not in ids[:2], f"the third id must be new for this test: {ids}")
    got, fin = gen(stop_token_ids=[ids[2]])
    check([t.id for t in got] == ids[:2] and "".join(t.text for t in got) ==
          toks[0].text + toks[1].text, f"stopped at {ids[2]}: {got}")
    check(fin.finish_reason == "stop" and fin.completion_tokens == 3, f"{fin}")
    info = stub.ModelInfo(burst_pb2.ModelInfoRequest(), metadata=MD)
    for bad, words in [([info.vocab_size], f"{info.vocab_size} is not one"),
                       ([-3], "-3 is not one"), ([1] * 65, "up to 64")]:
        c, d = code_of(lambda: gen(stop_token_ids=bad))
        check(c == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in d and words in d,
              f"{bad}: {c} {d}")


def test_min_p_and_include_stop_str():
    """sampling.min_p (1: only the most likely id, so a hot sampler draws greedy's text) and
    include_stop_str_in_output (the stop string, or a stop token id's text, is sent), with
    HTTP's checks."""
    def gen(max_tokens=8, stop=(), include=False, **sampling):
        req = burst_pb2.GenerateRequest(text=PROMPT, max_tokens=max_tokens, ignore_eos=True,
                                        stop=list(stop), include_stop_str_in_output=include,
                                        sampling=burst_pb2.SamplingParams(**sampling))
        events = list(stub.Generate(req, metadata=MD, timeout=60))
        toks = [e.token for e in events if e.WhichOneof("event") == "token"]
        return "".join(t.text for t in toks), toks, events[-1].finished

    greedy, toks, _ = gen(max_tokens=20, temperature=0)
    hot, _, _ = gen(max_tokens=20, temperature=5, seed=11)
    pinned, _, _ = gen(max_tokens=20, temperature=5, seed=11, min_p=1)
    check(pinned == greedy != hot, f"min_p 1: {pinned!r}, greedy {greedy!r}, hot {hot!r}")
    c, d = code_of(lambda: gen(temperature=1, min_p=1.5))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "'min_p' must be in [0, 1]" in d
          and "1.5" in d, f"{c} {d}")
    stop = greedy[4:7]
    cut = greedy.index(stop)
    for include, want in [(False, greedy[:cut]), (True, greedy[:cut + len(stop)])]:
        text, _, fin = gen(max_tokens=20, stop=[stop], include=include, temperature=0)
        check(text == want and fin.finish_reason == "stop", f"{include}: {text!r} {want!r}")
    ids = [t.id for t in toks]
    check(ids[2] not in ids[:2], f"the third id must be new for this test: {ids}")
    got, gtoks, fin = gen(include=True, temperature=0, stop_token_ids=[ids[2]])
    check([t.id for t in gtoks] == ids[:3] and got == "".join(t.text for t in toks[:3])
          and fin.finish_reason == "stop" and fin.completion_tokens == 3,
          f"stop id {ids[2]} with its text: {gtoks} {fin}")


def test_chat_add_generation_prompt():
    """ChatRequest.add_generation_prompt reaches the template (unset: true). LLaMA-2's compiled-in
    template ends the user's turn with [/INST] either way (as Hugging Face's LLaMA-2 template,
    which does not read the flag); test_http.py runs a template that does."""
    if not HAVE_KJV:
        return
    msgs = [burst_pb2.ChatMessage(role="user", content="Who made the heaven?")]
    counts = []
    for kw in [{}, {"add_generation_prompt": True}, {"add_generation_prompt": False}]:
        events = list(stub.Chat(burst_pb2.ChatRequest(messages=msgs, max_tokens=1, **kw),
                                metadata=MD, timeout=60))
        counts.append(events[0].started.prompt_tokens)
    check(counts[0] == counts[1] == counts[2] > 10, f"prompt tokens {counts}")


def test_one_port_when_port_is_zero():
    """--grpc-port 0 binds one free port, the one the port file reports (no second listener)."""
    pid = srv.proc.pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ["tcp", "tcp6"]:
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, this process's own socket
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    check(ports == {srv.http_port, srv.grpc_port},
          f"listening on {sorted(ports)}; reported http {srv.http_port} grpc {srv.grpc_port}")


def test_shutdown_with_an_idle_channel_is_prompt():
    """SIGTERM with a client's gRPC channel open and idle: the server exits at once (it took
    the 5 s of gRPC's shutdown deadline: 35 s after SIGTERM with the 30 s drain)."""
    import signal
    other = Server(workers=1)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{other.grpc_port}")
        info = burst_pb2_grpc.BurstStub(ch).ModelInfo(burst_pb2.ModelInfoRequest(), timeout=30)
        check(info.vocab_size > 0, f"{info}")
        t0 = time.time()
        other.proc.send_signal(signal.SIGTERM)
        other.proc.wait(30)
        took = time.time() - t0
        print(f"exited {took:.2f} s after SIGTERM with an idle channel open")
        check(other.proc.returncode == 0 and took < 2.5, f"exit {other.proc.returncode} "
              f"after {took:.2f} s")
        ch.close()
    finally:
        other.stop()


def test_chat():
    msgs = [burst_pb2.ChatMessage(role="user", content="Who made the heaven?")]
    req = burst_pb2.ChatRequest(messages=msgs, max_tokens=8,
                                sampling=burst_pb2.SamplingParams(temperature=0))
    code, detail = code_of(lambda: list(stub.Chat(req, metadata=MD, timeout=60)))
    if not HAVE_KJV:
        # The fixture's vocabulary cannot hold the template's [INST] ids.
        check(code == grpc.StatusCode.INVALID_ARGUMENT, f"{code} {detail}")
        return
    events = list(stub.Chat(req, metadata=MD, timeout=60))
    text = "".join(e.token.text for e in events if e.WhichOneof("event") == "token")
    st, r = srv.json("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Who made the heaven?"}], "max_tokens": 8,
        "temperature": 0})
    check(text == r["choices"][0]["message"]["content"], f"gRPC chat {text!r} != HTTP {r}")
    bad = burst_pb2.ChatRequest(messages=[burst_pb2.ChatMessage(role="assistant", content="x")])
    c, d = code_of(lambda: list(stub.Chat(bad, metadata=MD, timeout=30)))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "alternate" in d, f"{c} {d}")


def test_access_log():
    list(stub.Generate(burst_pb2.GenerateRequest(text=PROMPT, max_tokens=2), timeout=60,
                       metadata=[*MD, ("x-request-id", "grpc-77")]))
    code_of(lambda: list(stub.Generate(burst_pb2.GenerateRequest(text=PROMPT, max_tokens=0),
                                       metadata=[*MD, ("x-request-id", "grpc-78")])))
    import time
    deadline, lines = time.time() + 10, []
    while time.time() < deadline:
        lines = [ln for ln in open(srv.log_path, errors="replace").read().splitlines()
                 if "access gRPC /burst.v1.Burst/Generate" in ln]
        if any("grpc-78" in ln for ln in lines):
            break
        time.sleep(0.1)
    ok = [ln for ln in lines if "request_id=grpc-77" in ln]
    bad = [ln for ln in lines if "request_id=grpc-78" in ln]
    check(ok and " OK " in ok[0] and "completion_tokens=2" in ok[0], f"access: {ok}")
    check(bad and "INVALID_ARGUMENT" in bad[0] and "max_tokens" in bad[0], f"access: {bad}")


def test_tokenize_and_model_info():
    r = stub.Tokenize(burst_pb2.TokenizeRequest(text="Hello world!", add_bos=True), metadata=MD)
    check(list(r.ids) == [1, 15043, 3186, 29991], f"{r.ids}")
    info = stub.ModelInfo(burst_pb2.ModelInfoRequest(), metadata=MD)
    check(info.workers == 2 and info.device == "cpu" and info.max_context > 0, f"{info}")


def test_errors():
    def gen(**kw):
        return lambda: list(stub.Generate(burst_pb2.GenerateRequest(**kw), metadata=kw.pop(
            "_md", MD), timeout=30))

    c, d = code_of(gen(text=PROMPT, max_tokens=0))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in d, f"{c} {d}")
    c, d = code_of(gen(text="", max_tokens=3))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "empty" in d, f"{c} {d}")
    c, d = code_of(gen(text=PROMPT, max_tokens=3,
                       sampling=burst_pb2.SamplingParams(temperature=-1)))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in d, f"{c} {d}")
    c, d = code_of(gen(text=PROMPT, max_tokens=3, sampling=burst_pb2.SamplingParams(top_p=2)))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in d, f"{c} {d}")
    # min_tokens over max_tokens, given or Chat's default, names both values as received.
    c, d = code_of(gen(text=PROMPT, max_tokens=3, min_tokens=9))
    check(c == grpc.StatusCode.INVALID_ARGUMENT and "(9)" in d and "(3)" in d, f"{c} {d}")
    if HAVE_KJV:
        chat = burst_pb2.ChatRequest(
            messages=[burst_pb2.ChatMessage(role="user", content="Who made the heaven?")],
            min_tokens=2 ** 31 - 1)
        c, d = code_of(lambda: list(stub.Chat(chat, metadata=MD, timeout=30)))
        check(c == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in d
              and "2147483647" in d, f"min_tokens over Chat's default max_tokens: {c} {d}")
    # An unknown model is NOT_FOUND, as HTTP's 404, on both calls that name one.
    c, d = code_of(gen(text=PROMPT, max_tokens=3, model="nope"))
    check(c == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in d, f"Generate: {c} {d}")
    c, d = code_of(lambda: list(stub.Chat(burst_pb2.ChatRequest(
        messages=[burst_pb2.ChatMessage(role="user", content="Who made the heaven?")],
        model="nope", max_tokens=2), metadata=MD, timeout=30)))
    check(c == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in d, f"Chat: {c} {d}")
    info = stub.ModelInfo(burst_pb2.ModelInfoRequest(), metadata=MD)
    ids = burst_pb2.TokenIds(ids=[1] * (info.max_context - 2))
    c, d = code_of(gen(token_ids=ids, max_tokens=10))
    check(c == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{c} {d}")
    c, d = code_of(lambda: list(stub.Generate(burst_pb2.GenerateRequest(text=PROMPT,
                                                                         max_tokens=2))))
    check(c == grpc.StatusCode.UNAUTHENTICATED, f"{c} {d}")
    c, d = code_of(lambda: stub.ModelInfo(burst_pb2.ModelInfoRequest(),
                                          metadata=[("authorization", "Bearer x")]))
    check(c == grpc.StatusCode.UNAUTHENTICATED, f"{c} {d}")


def test_malformed_requests():
    """Raw bytes that are not the method's message: INVALID_ARGUMENT naming the fault (gRPC's
    own parser answered INTERNAL with empty details)."""
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}")

    def raw(method, data, streaming=True, md=MD):
        path = "/burst.v1.Burst/" + method
        if streaming:
            call = ch.unary_stream(path, request_serializer=None, response_deserializer=None)
            return code_of(lambda: list(call(data, metadata=md, timeout=30)))
        call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        return code_of(lambda: call(data, metadata=md, timeout=30))

    bad_utf8 = b"\x41\xff\xfe"  # 'A', then two bytes never valid in UTF-8
    cases = [
        # text (field 2) says 5 bytes, 2 follow
        ("Generate", b"\x12\x05ab", True, ["malformed", "burst.v1.GenerateRequest"]),
        # a tag with wire type 7 (none such)
        ("Generate", b"\x0f\x01", True, ["malformed"]),
        ("Generate", b"\x12\x03" + bad_utf8 + b"\x20\x05", True,
         ["burst.v1.GenerateRequest.text", "UTF-8", "byte offset 1"]),
        ("Generate", b"\x20\x05\x32\x03" + bad_utf8, True,
         ["burst.v1.GenerateRequest.stop[0]", "UTF-8"]),
        # messages[1].content: a good message, then one with bad content
        ("Chat", b"\x12\x06\x0a\x04user" + b"\x12\x05\x12\x03" + bad_utf8, True,
         ["burst.v1.ChatRequest.messages[1].content", "UTF-8"]),
        # a nested message cut short: messages[0] claims 9 bytes inside its 2
        ("Chat", b"\x12\x02\x0a\x09", True, ["malformed", "messages[0]"]),
        ("Tokenize", b"\x0a\x03" + bad_utf8, False, ["burst.v1.TokenizeRequest.text", "UTF-8"]),
        ("Tokenize", b"\xff\xff\xff", False, ["malformed"]),
        ("ModelInfo", b"\x0a", False, ["malformed", "burst.v1.ModelInfoRequest"]),
    ]
    for method, data, streaming, words in cases:
        c, d = raw(method, data, streaming)
        check(c == grpc.StatusCode.INVALID_ARGUMENT and all(w in d for w in words),
              f"{method} {data!r}: {c} {d!r}")
    # Checked before protobuf's parser sees the bytes: it would log invalid UTF-8 itself, a line
    # a client could write into the server's log at will.
    log = open(srv.log_path, errors="replace").read()
    check("libprotobuf" not in log, "protobuf logged: " + log[log.find("libprotobuf"):][:200])
    # The key is checked before the bytes are read.
    c, d = raw("Generate", b"\x12\x05ab", md=[])
    check(c == grpc.StatusCode.UNAUTHENTICATED, f"no key: {c} {d}")
    # Raw bytes of a well-formed request still work, and the server keeps serving.
    good = burst_pb2.TokenizeRequest(text="Hello world!", add_bos=True).SerializeToString()
    c, d = raw("Tokenize", good, False)
    check(c == grpc.StatusCode.OK, f"good raw bytes: {c} {d}")
    r = stub.Tokenize(burst_pb2.TokenizeRequest(text="Hello world!", add_bos=True), metadata=MD)
    check(list(r.ids) == [1, 15043, 3186, 29991], f"{r.ids}")


def test_cancel():
    call = stub.Generate(burst_pb2.GenerateRequest(text=PROMPT, max_tokens=200), metadata=MD)
    next(call)
    next(call)
    call.cancel()
    import time
    deadline = time.time() + 20
    while time.time() < deadline and srv.metric("burst:num_requests_running") != 0:
        time.sleep(0.1)
    check(srv.kv_held() == 0, "KV freed after a gRPC cancel")


def test_health_service():
    h = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
    for service in ["", "burst.v1.Burst"]:
        r = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        check(r.status == health_pb2.HealthCheckResponse.SERVING, f"{service!r}: {r}")


def threads_of(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise KeyError("Threads")


def start_calls_without_a_message(channel, n, release, timeout):
    """n Generate calls on `channel` whose headers go out and whose message never does (until
    `release` is set): their threads, started, and the list each appends (code, details,
    seconds) to when its call ends."""
    generate = channel.stream_stream("/burst.v1.Burst/Generate",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)

    def no_message():
        release.wait()
        return
        yield

    results = []

    def call():
        t0 = time.time()
        try:
            list(generate(no_message(), timeout=timeout))
            results.append(("OK", "", time.time() - t0))
        except grpc.RpcError as e:
            results.append((e.code(), e.details(), time.time() - t0))

    calls = [threading.Thread(target=call) for _ in range(n)]
    for t in calls:
        t.start()
    return calls, results


def test_calls_without_a_message_are_bounded_and_cancelled():
    # 200 Generate calls that open and never send their message. Each used to hold a server
    # thread with no deadline (1000 such calls: 1552 threads). Now at most --grpc-max-threads
    # run (the others get RESOURCE_EXHAUSTED at once), those end with DEADLINE_EXCEEDED after
    # --grpc-message-timeout-ms, a normal call is served, and the threads go back down.
    small = Server("--grpc-max-threads", 32, "--grpc-message-timeout-ms", 1500)
    release = threading.Event()
    try:
        threads0 = threads_of(small.proc.pid)
        channel = grpc.insecure_channel(f"127.0.0.1:{small.grpc_port}")
        t0 = time.time()
        calls, results = start_calls_without_a_message(channel, 200, release, 60)
        time.sleep(1.0)
        held = threads_of(small.proc.pid)
        for t in calls:
            t.join(10)
        ended = time.time() - t0
        codes = {}
        for code, _, _ in results:
            codes[code] = codes.get(code, 0) + 1
        print(f"200 calls without a message: server threads {threads0} -> {held}, all ended "
              f"after {ended:.1f} s: {codes}")
        check(held <= threads0 + 32 + 4, f"threads {threads0} -> {held} (at most 32 more)")
        check(len(results) == 200 and set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED,
                                                     grpc.StatusCode.RESOURCE_EXHAUSTED},
              f"how they ended: {codes}")
        timed_out = [d for c, d, _ in results if c == grpc.StatusCode.DEADLINE_EXCEEDED]
        check(timed_out and "--grpc-message-timeout-ms" in timed_out[0] and ended < 6,
              f"cancelled after the message deadline: {timed_out[:1]}, {ended:.1f} s")
        events = list(burst_pb2_grpc.BurstStub(channel).Generate(
            burst_pb2.GenerateRequest(text=PROMPT, max_tokens=3), timeout=30))
        check(events[-1].finished.completion_tokens == 3, f"a normal call: {events[-1]}")
        deadline = time.time() + 8
        while time.time() < deadline and threads_of(small.proc.pid) > threads0 + 4:
            time.sleep(0.2)
        check(threads_of(small.proc.pid) <= threads0 + 4,
              f"threads back down: {threads0} -> {threads_of(small.proc.pid)}")
        channel.close()
    finally:
        release.set()
        small.stop()


def test_idle_connections_are_closed():
    # A connection that never speaks HTTP/2 is closed after --grpc-handshake-timeout-ms (gRPC's
    # own default: 120 s), one without calls after --grpc-max-connection-idle-ms (default:
    # never); the client reconnects on its next call.
    small = Server("--grpc-handshake-timeout-ms", 1000, "--grpc-max-connection-idle-ms", 1000)
    try:
        s = socket.create_connection(("127.0.0.1", small.grpc_port), timeout=10)
        t0 = time.time()
        try:
            data = s.recv(4096)
            while data:
                data = s.recv(4096)
        except ConnectionResetError:
            pass
        except socket.timeout:
            check(False, "a silent connection is still open after 10 s")
        silent = time.time() - t0
        s.close()
        check(silent < 3, f"a silent connection closed after {silent:.1f} s")

        def established():
            out = subprocess.run(["ss", "-tnH", "state", "established",
                                  f"( dport = :{small.grpc_port} )"], capture_output=True,
                                 text=True, check=True).stdout
            return len(out.splitlines())

        channel = grpc.insecure_channel(f"127.0.0.1:{small.grpc_port}")
        stub2 = burst_pb2_grpc.BurstStub(channel)
        stub2.ModelInfo(burst_pb2.ModelInfoRequest(), timeout=10)
        check(established() == 1, "one connection after a call")
        t0 = time.time()
        while time.time() - t0 < 8 and established() > 0:
            time.sleep(0.1)
        idle = time.time() - t0
        print(f"gRPC: a silent connection closed after {silent:.1f} s, an idle one after "
              f"{idle:.1f} s")
        check(established() == 0 and idle < 4, f"an idle connection closed after {idle:.1f} s")
        stub2.ModelInfo(burst_pb2.ModelInfoRequest(), timeout=10)  # reconnects
        channel.close()
    finally:
        small.stop()


def test_one_client_cannot_hold_every_call():
    # --grpc-max-calls-per-client 8: 20 calls of one client that never send their message; 8
    # run (until the message deadline), the 12 others get RESOURCE_EXHAUSTED naming the flag at
    # once, the health service still answers, and once they end the client is served again.
    small = Server("--grpc-max-calls-per-client", 8, "--grpc-message-timeout-ms", 1500)
    release = threading.Event()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{small.grpc_port}")
        calls, results = start_calls_without_a_message(channel, 20, release, 30)
        time.sleep(0.5)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        for t in calls:
            t.join(15)
        refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        late = [r for r in results if r[0] == grpc.StatusCode.DEADLINE_EXCEEDED]
        print(f"20 calls of one client: {len(late)} ran to the message deadline, "
              f"{len(refused)} refused in at most {max((r[2] for r in refused), default=0):.2f} s")
        check(len(late) == 8 and len(refused) == 12, f"how they ended: {results}")
        check(all("--grpc-max-calls-per-client" in r[1] and r[2] < 1.5 for r in refused),
              f"refused at once, naming the flag: {refused[:1]}")
        check(health.status == health_pb2.HealthCheckResponse.SERVING, f"health: {health}")
        events = list(burst_pb2_grpc.BurstStub(channel).Generate(
            burst_pb2.GenerateRequest(text=PROMPT, max_tokens=2), timeout=30))
        check(events[-1].finished.completion_tokens == 2, f"served again: {events[-1]}")
        channel.close()
    finally:
        release.set()
        small.stop()


def open_files(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_many_idle_connections_do_not_exhaust_the_server():
    # 300 connections of one client that finish the HTTP/2 handshake (the preface and an empty
    # SETTINGS frame) and then say nothing. gRPC offers no per-client connection cap: they cost
    # no thread, a descriptor each, until the idle deadline closes them; the open-files limit
    # is raised to the hard one at start so that they do not leave HTTP without descriptors.
    small = Server("--grpc-max-connection-idle-ms", 3000)
    socks = []
    try:
        limits = open(f"/proc/{small.proc.pid}/limits").read()
        line = [x for x in limits.splitlines() if x.startswith("Max open files")][0].split()
        check(line[3] == line[4], f"open files: soft {line[3]}, hard {line[4]}")
        threads0, fds0 = threads_of(small.proc.pid), open_files(small.proc.pid)
        hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", small.grpc_port), timeout=15)
            s.sendall(hello)
            socks.append(s)
        time.sleep(0.5)
        held = open_files(small.proc.pid)
        t0 = time.time()
        channel = grpc.insecure_channel(f"127.0.0.1:{small.grpc_port}")
        events = list(burst_pb2_grpc.BurstStub(channel).Generate(
            burst_pb2.GenerateRequest(text=PROMPT, max_tokens=2), timeout=30))
        channel.close()
        st, _ = small.json("GET", "/health")
        served = time.time() - t0
        threads = threads_of(small.proc.pid)
        print(f"300 idle gRPC connections: descriptors {fds0} -> {held}, threads {threads0} -> "
              f"{threads}, a call and /health served in {served:.2f} s")
        check(events[-1].finished.completion_tokens == 2 and st == 200 and served < 10,
              f"served meanwhile: {st}, {served:.1f} s")
        check(held >= fds0 + 290 and threads <= threads0 + 8,  # a few may still be accepting
              f"descriptors {fds0} -> {held}, threads {threads0} -> {threads}")
        # The server closes every one after the idle deadline (GOAWAY, then EOF).
        closed, deadline = 0, time.time() + 10
        for s in socks:
            s.settimeout(max(0.1, deadline - time.time()))
            try:
                while s.recv(4096):
                    pass
                closed += 1
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
        check(closed == 300, f"{closed} of 300 idle connections closed by the server")
        deadline = time.time() + 5
        while time.time() < deadline and open_files(small.proc.pid) > fds0 + 4:
            time.sleep(0.1)
        check(open_files(small.proc.pid) <= fds0 + 4,
              f"descriptors back: {fds0} -> {open_files(small.proc.pid)}")
    finally:
        for s in socks:
            s.close()
        small.stop()


if __name__ == "__main__":
    srv = Server("--api-key", KEY)
    stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
    srv_headers = {"Authorization": "Bearer " + KEY}
    orig = srv.json
    srv.json = lambda m, p, b=None, h=None: orig(m, p, b, h or srv_headers)
    try:
        run([test_generate_stream, test_defaults_and_parameters_as_http, test_stop_token_ids,
             test_min_p_and_include_stop_str, test_chat_add_generation_prompt,
             test_one_port_when_port_is_zero, test_shutdown_with_an_idle_channel_is_prompt,
             test_chat,
             test_access_log,
             test_tokenize_and_model_info, test_errors, test_malformed_requests, test_cancel,
             test_health_service, test_calls_without_a_message_are_bounded_and_cancelled,
             test_idle_connections_are_closed,
             test_many_idle_connections_do_not_exhaust_the_server,
             test_one_client_cannot_hold_every_call])
    finally:
        srv.stop()
