"""End-to-end tests of burst-server's HTTP front end against bursts and hostile clients, on the
embedded default (kjv-tiny, 2 CPU workers), with raw sockets where a well-behaved client library
would hide the fault: the listen backlog and a burst of 64 streams with no reset; 200 slow-header
clients dropped with 408 while a normal client is served; pipelined requests answered in order;
smuggling-style framing refused with 400 and the connection closed; a non-streaming client that
disconnects cancels its request (KV back to 0, the next request not delayed); requests abandoned
while they wait leave the queue at once (a later one is not refused "queue full"); 8 MB prompts
refused before tokenizing (HTTP and gRPC) with the server's RSS bounded, and a batch of prompts
held to the byte limit in all; the connection limit
answered with 503; a client that half-closes its connection gets its answer (a full close still
cancels); one client's idle connections neither lock others out (a per-client limit, idle
keep-alive connections closed to make room) nor leave threads behind.
Run: /usr/bin/python3 test_hostile.py --build BUILD_DIR."""
import http.client
import json
import re
import select
import socket
import subprocess
import threading
import time

from harness import PROMPT, Server, check, compile_protos, run, sse_events

HEADER_TIMEOUT_MS = 2000
BODY_TIMEOUT_MS = 1500
srv = None


def connect(server=None, timeout=30, source=None):
    """A TCP connection to the server's HTTP port; `source`: the local address to connect from
    (127.0.0.2 and the like are other clients on the loopback)."""
    return socket.create_connection(("127.0.0.1", (server or srv).http_port), timeout=timeout,
                                    source_address=(source, 0) if source else None)


def read_response(sock_file):
    """One HTTP/1.1 response from a socket's file: (status, headers dict, body bytes) or None at
    EOF. Bodies by Content-Length or chunked."""
    line = sock_file.readline()
    if not line:
        return None
    status = int(line.split()[1])
    headers = {}
    while True:
        h = sock_file.readline().decode().rstrip("\r\n")
        if not h:
            break
        k, v = h.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int(sock_file.readline().split(b";")[0], 16)
            chunk = sock_file.read(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = sock_file.read(int(headers.get("content-length", "0")))
    return status, headers, body


def exchange(data, server=None):
    """Writes raw bytes, reads every response until the server closes: [(status, headers,
    body)], seconds taken."""
    t0 = time.time()
    s = connect(server)
    s.sendall(data)
    f = s.makefile("rb")
    out = []
    while True:
        r = read_response(f)
        if r is None:
            break
        out.append(r)
    s.close()
    return out, time.time() - t0


def completion(body, server=None):
    return json.dumps({"prompt": PROMPT, "temperature": 0, **body}).encode()


def post_bytes(path, body, extra=b""):
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def proc_status(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def vm_rss_kb(pid):
    return proc_status(pid, "VmRSS")


def read_final_response(f):
    """The final response on a socket file, past any interim 1xx ones: (status, headers, body,
    the statuses seen, interim ones included)."""
    seen = []
    while True:
        r = read_response(f)
        if r is None:
            return None, {}, b"", seen
        seen.append(r[0])
        if r[0] >= 200:
            return (*r, seen)


def test_backlog_and_burst_of_64_streams():
    # The listening socket's backlog is what --http-backlog says (ss: Send-Q of a LISTEN socket),
    # capped by the kernel's somaxconn; cpp-httplib's own was 5.
    somaxconn = int(open("/proc/sys/net/core/somaxconn").read())
    out = subprocess.run(["ss", "-ltnH", f"sport = :{srv.http_port}"], capture_output=True,
                         text=True, check=True).stdout.split()
    check(int(out[2]) == min(1024, somaxconn), f"listen backlog: {out}")
    # 64 streams connect at the same moment: every one is answered (no reset, no refusal) and
    # ends with [DONE].
    barrier = threading.Barrier(64)
    results = []

    def one(i):
        try:
            c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=120)
            barrier.wait()
            c.request("POST", "/v1/completions", body=completion(
                {"max_tokens": 4, "stream": True}), headers={"Content-Type": "application/json"})
            r = c.getresponse()
            done = any(d == "[DONE]" for _, d in sse_events(r))
            results.append((r.status, done))
            c.close()
        except Exception as e:  # noqa: BLE001 - a reset is what this test counts
            results.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failures = [r for r in results if r != (200, True)]
    print(f"burst: tried 64 streams, served {64 - len(failures)}, failed {len(failures)}")
    check(len(results) == 64 and not failures, f"{len(failures)} of 64 failed: {failures[:5]}")


def test_slow_header_clients_are_dropped_while_others_are_served():
    # 200 clients send a header byte every 0.5 s (more than cpp-httplib's 128-thread pool had):
    # each is answered 408 once its head is HEADER_TIMEOUT_MS late, and a normal client is
    # served meanwhile.
    slow = []
    for _ in range(200):
        s = connect()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        s.setblocking(False)
        slow.append(s)
    t0 = time.time()
    got = {s: b"" for s in slow}
    closed = set()
    served = {}

    def normal():
        t = time.time()
        st, _ = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        served["status"], served["s"] = st, time.time() - t

    n = threading.Thread(target=normal)
    n.start()
    while len(closed) < len(slow) and time.time() - t0 < HEADER_TIMEOUT_MS / 1000 + 8:
        readable, _, _ = select.select([s for s in slow if s not in closed], [], [], 0.5)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            got[s] += data
            if not data:
                closed.add(s)
        for s in slow:
            if s not in closed and not got[s]:
                try:
                    s.send(b"X")  # a byte of a header name, never finished
                except OSError:
                    pass
    elapsed = time.time() - t0
    n.join(30)
    for s in slow:
        s.close()
    answered = sum(1 for s in slow if got[s].startswith(b"HTTP/1.1 408 "))
    print(f"slow headers: tried 200, 408 {answered}, all closed after {elapsed:.1f} s; "
          f"a normal client meanwhile: {served}")
    check(answered == 200 and len(closed) == 200,
          f"{answered} of 200 slow clients got 408, {len(closed)} closed in {elapsed:.1f} s")
    check(elapsed < HEADER_TIMEOUT_MS / 1000 + 4, f"dropped after {elapsed:.1f} s")
    check(b"did not arrive within" in got[slow[0]], f"the 408 says why: {got[slow[0]][-300:]}")
    check(served.get("status") == 200 and served["s"] < 10,
          f"a normal client is served meanwhile: {served}")


def test_slow_body_gets_408_and_expect_continue_is_answered():
    # A head that announces 100 bytes and sends 10: 408 once the body is BODY_TIMEOUT_MS late.
    t0 = time.time()
    responses, _ = exchange(b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: "
                            b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    check(len(responses) == 1 and responses[0][0] == 408 and
          b"body did not arrive" in responses[0][2], f"slow body: {responses}")
    check(time.time() - t0 < BODY_TIMEOUT_MS / 1000 + 2, f"after {time.time() - t0:.1f} s")
    # curl sends "Expect: 100-continue" before a body over 1 MB and waits up to 1 s for the
    # interim answer: it comes at once, and the 2 MB prompt is refused by its size at once.
    body = json.dumps({"prompt": "a " * 1_000_000, "max_tokens": 1})
    t0 = time.time()
    out = subprocess.run(["curl", "-sS", "-v", "--max-time", "30", "-H",
                          "Content-Type: application/json", "--data-binary", "@-",
                          f"http://127.0.0.1:{srv.http_port}/v1/completions"], input=body,
                         capture_output=True, text=True, check=False)
    secs = time.time() - t0
    check("100 Continue" in out.stderr and "HTTP/1.1 413" in out.stderr and
          "2000000 bytes" in out.stdout, f"curl: {out.stderr[-600:]} {out.stdout[:300]}")
    check(secs < 0.9, f"no wait for the 100-continue timeout: {secs:.2f} s")


def test_pipelined_requests_are_answered_in_order():
    body = completion({"max_tokens": 3})
    data = (post_bytes("/v1/completions", body) + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n" +
            b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    responses, _ = exchange(data)
    check([r[0] for r in responses] == [200, 200, 200], f"{[r[:2] for r in responses]}")
    check(json.loads(responses[0][2])["object"] == "text_completion", "first: the completion")
    check(json.loads(responses[1][2]) == {"status": "ok"}, "second: /health")
    check(json.loads(responses[2][2])["object"] == "list", "third: /v1/models")
    check(responses[2][1].get("connection") == "close", "the last one closes")
    # A chunked request body, with the next request right behind it.
    chunked = (b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n6\r\n{\"prom\r\n0d\r\npt\": \"hello\"}\r\n"
               b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    responses, _ = exchange(chunked)
    check([r[0] for r in responses] == [200, 200], f"chunked: {responses}")
    check(json.loads(responses[0][2])["count"] == 2, f"chunked body read: {responses[0]}")


def test_smuggling_and_malformed_heads_get_400():
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
    cases = [
        ("CL + chunked", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled, 400, "Transfer-Encoding"),
        ("chunked + CL", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: "
         b"chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n" + smuggled, 400, "Content-Length"),
        ("no colon", b"GET /health HTTP/1.1\r\nHost t\r\n\r\n" + smuggled, 400, "no colon"),
        ("space before colon", b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length : 2\r\n"
         b"\r\n{}" + smuggled, 400, "not a token"),
        ("two Content-Lengths", b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n"
         b"Content-Length: 40\r\n\r\n{}" + smuggled, 400, "more than one Content-Length"),
        ("bad Content-Length", b"POST /tokenize HTTP/1.1\r\nHost: t\r\nContent-Length: 2, 2\r\n"
         b"\r\n{}" + smuggled, 400, "not a number"),
        ("obs-fold", b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: 1\r\n  folded\r\n\r\n", 400,
         "folding"),
        ("bare LF", b"GET /health HTTP/1.1\nHost: t\n\n", 400, "bare LF"),
        ("bare CR", b"GET /health HTTP/1.1\r\nX-A: 1\r2\r\n\r\n", 400, "bare CR"),
        ("TE gzip", b"POST /tokenize HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n"
         b"\r\n0\r\n\r\n", 501, "only chunked"),
        ("bad chunk", b"POST /tokenize HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"zz\r\n{}\r\n0\r\n\r\n", 400, "chunk size"),
        ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n", 505, "not supported"),
        ("70 KB head", b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n", 431,
         "over 65536 bytes"),
        ("101 header lines", b"GET /health HTTP/1.1\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n", 431,
         "more than 100"),
        ("unknown method", b"BREW /pot HTTP/1.1\r\nHost: t\r\n\r\n", 501, "method 'BREW'"),
        ("9 KB URL", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, "over 8192"),
        ("garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "request line"),
    ]
    print(f"malformed heads: tried {len(cases)}")
    for name, data, status, words in cases:
        responses, secs = exchange(data)
        check(len(responses) == 1, f"{name}: one response, then close (nothing smuggled): "
                                   f"{[r[:2] for r in responses]}")
        st, headers, body = responses[0]
        msg = json.loads(body)["error"]["message"]
        check(st == status and words in msg, f"{name}: {st} {msg}")
        check(headers.get("connection") == "close" and secs < 3, f"{name}: closed at once")
    st, _ = srv.json("GET", "/health")
    check(st == 200, "still healthy")


def kv_freed_after_close(server, s, what):
    """Waits for the request on socket s to hold KV, closes s, and returns the seconds until
    the server holds none again (10 at most)."""
    deadline = time.time() + 20
    while time.time() < deadline and server.kv_held() == 0:
        time.sleep(0.02)
    check(server.kv_held() > 0, f"{what}: the request runs")
    s.close()
    t0 = time.time()
    while time.time() - t0 < 10 and server.kv_held() > 0:
        time.sleep(0.02)
    freed = time.time() - t0
    print(f"{what}: KV freed {freed:.2f} s after the close")
    check(server.kv_held() == 0, f"{what}: KV never freed")
    return freed


def test_disconnected_non_streaming_request_is_cancelled():
    cancelled0 = srv.metric('burst:requests_total{outcome="cancelled"}')
    s = connect()
    s.sendall(post_bytes("/v1/completions",
                         completion({"max_tokens": 1500, "ignore_eos": True})))
    freed = kv_freed_after_close(srv, s, "disconnected non-streaming request")
    check(freed < 3, f"KV freed {freed:.1f} s after the client left")
    check(srv.metric('burst:requests_total{outcome="cancelled"}') == cancelled0 + 1,
          "counted as cancelled")
    t0 = time.time()
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    check(st == 200 and time.time() - t0 < 5, f"the next request is not delayed: "
                                               f"{time.time() - t0:.1f} s, {st}")


def test_half_closed_client_gets_its_answer():
    # A client that sends its request and then shuts down its sending side (shutdown(SHUT_WR))
    # still reads: its request runs to the end and the answer comes (before: cancelled, "499
    # Internal Server Error"). The server tells it from a close by writing an interim
    # "100 Continue" (a closed socket answers that with a reset).
    want = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 30,
                                                "temperature": 0})[1]["choices"][0]["text"]
    s = connect()
    s.sendall(post_bytes("/v1/completions", completion({"max_tokens": 30})))
    s.shutdown(socket.SHUT_WR)
    f = s.makefile("rb")
    st, headers, body, lines = read_final_response(f)
    s.close()
    check(st == 200, f"half-closed non-streaming request: {lines} {body[:300]!r}")
    r = json.loads(body)
    check(r["choices"][0]["text"] == want and r["usage"]["completion_tokens"] == 30,
          f"the whole completion: {r}")
    # A stream, half-closed: every event to [DONE].
    s = connect()
    s.sendall(post_bytes("/v1/completions", completion({"max_tokens": 30, "stream": True})))
    s.shutdown(socket.SHUT_WR)
    f = s.makefile("rb")
    st, headers, body, lines = read_final_response(f)
    s.close()
    events = [ln[6:] for ln in body.decode().split("\n") if ln.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    check(st == 200 and events and events[-1] == "[DONE]" and text == want,
          f"half-closed stream: {st} {lines} {text!r} vs {want!r}")
    # HTTP/1.0 has no interim answers: a FIN there still counts as the client leaving, and the
    # 499 written (to a client that still reads it here) has its own reason phrase.
    body = completion({"max_tokens": 1500, "ignore_eos": True})
    s = connect()
    s.sendall(f"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    s.shutdown(socket.SHUT_WR)
    data = s.makefile("rb").read()
    s.close()
    check(data.startswith(b"HTTP/1.1 499 Client Closed Request\r\n"),
          f"HTTP/1.0 half-close: {data[:200]!r}")


def test_disconnected_waiting_stream_is_cancelled():
    # A streaming request whose prompt prefills in many small chunks sends nothing for seconds
    # (no progress asked); its client leaves at once. The handler looks at the socket while it
    # waits: KV freed well before a keep-alive write (5 s) or the first token would notice.
    slow = Server("--prefill-chunk", 8, "--grpc-port", -1)
    try:
        prompt = " ".join(["And God said, Let there be light: and there was light."] * 120)
        st, tok = slow.json("POST", "/tokenize", {"prompt": prompt})
        n = len(tok.get("tokens", []))
        check(st == 200 and 1200 < n < 2000, f"prompt tokens: {st} {n}")
        s = connect(slow)
        s.sendall(post_bytes("/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": 4, "stream": True}).encode()))
        freed = kv_freed_after_close(slow, s, "disconnected waiting stream")
        check(freed < 1.5, f"KV freed {freed:.1f} s after the client left")
    finally:
        slow.stop()


def test_abandoned_requests_leave_the_queue():
    # One long request runs (--max-running 1); 10 clients send a request and leave: 4 wait in
    # the queue (--max-queue 4), 6 are refused. The 4 leave the queue at once though the head
    # of the queue never moves: a later request waits (it is not refused "queue full") and is
    # served once the long one ends.
    small = Server("--max-running", 1, "--max-queue", 4, "--grpc-port", -1)
    try:
        long = connect(small)
        long.sendall(post_bytes("/v1/completions",
                                completion({"max_tokens": 1500, "ignore_eos": True})))
        deadline = time.time() + 20
        while time.time() < deadline and small.kv_held() == 0:
            time.sleep(0.02)
        check(small.kv_held() > 0, "the long request runs")
        cancelled0 = small.metric('burst:requests_total{outcome="cancelled"}')
        gone = []
        for _ in range(10):
            s = connect(small)
            s.sendall(post_bytes("/v1/completions", completion({"max_tokens": 4})))
            gone.append(s)
        deadline = time.time() + 5
        while time.time() < deadline and small.metric("burst:num_requests_waiting") < 4:
            time.sleep(0.02)
        time.sleep(0.1)
        check(small.metric("burst:num_requests_waiting") == 4, "4 requests wait")
        for s in gone:
            s.close()
        deadline = time.time() + 5
        while time.time() < deadline and small.metric("burst:num_requests_waiting") > 0:
            time.sleep(0.02)
        check(small.metric("burst:num_requests_waiting") == 0,
              "the abandoned requests left the queue")
        check(small.metric('burst:requests_total{outcome="cancelled"}') == cancelled0 + 4,
              "they count as cancelled")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=small.json(
            "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})))
        t.start()
        t.join(0.5)
        check(t.is_alive(), f"the next request waits, not refused: {result.get('r')}")
        long.close()
        t.join(30)
        st, r = result.get("r", (None, None))
        check(st == 200 and r["usage"]["completion_tokens"] == 4, f"then served: {st} {r}")
    finally:
        small.stop()


def test_huge_prompts_refused_before_tokenizing():
    text = ("And God said, Let there be light: and there was light. " * 150000)[:8_000_000]
    rss0 = vm_rss_kb(srv.proc.pid)
    slowest = 0
    bodies = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        ("/tokenize", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": [PROMPT, text], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
    ]
    for path, body, param in bodies * 2:
        t0 = time.time()
        status, data, _ = srv.request("POST", path, json.dumps(body))
        secs = time.time() - t0
        err = json.loads(data)["error"]
        check(status == 413 and "8000000 bytes" in err["message"] and
              "--max-prompt-bytes" in err["message"] and err["param"] == param,
              f"{path}: {status} {err}")
        # Tokenizing this text takes ~20 s (SentencePiece, this model); receiving and parsing 8 MB
        # of JSON on a loaded 2-core CI machine took up to 1.2 s: 3 s tells the two apart.
        check(secs < 3, f"{path}: refused in {secs:.2f} s")
        slowest = max(slowest, secs)
    grew = vm_rss_kb(srv.proc.pid) - rss0
    print(f"8 MB prompts: tried {len(bodies) * 2}, 413 each, slowest {slowest:.2f} s, server "
          f"RSS {rss0} KB -> {rss0 + grew} KB")
    check(grew < 64_000, f"server RSS grew by {grew} KB over 10 refused 8 MB prompts")
    # 1.5 M token ids with echo: refused by their count before being decoded for the echo (the
    # message is the count's). The time bound allows for parsing 7.5 MB of JSON on a loaded
    # 2-core CI machine (1.1 s seen there once), not for decoding 1.5 M tokens as well.
    t0 = time.time()
    status, data, _ = srv.request("POST", "/v1/completions", json.dumps(
        {"prompt": [450] * 1_500_000, "echo": True, "max_tokens": 1}))
    check(status == 400 and "1500000 tokens, over the model's limit" in data.decode() and
          time.time() - t0 < 3, f"token ids: {status} {data[:200]!r} in {time.time() - t0:.2f} s")
    # The limit is the most text the context can hold: text of exactly the limit reaches the
    # tokenizer (and is refused by the token count), one byte more is refused untokenized.
    limit = int(re.search(r"prompt text limit (\d+) bytes", open(srv.log_path).read()).group(1))
    status, data, _ = srv.request("POST", "/v1/completions",
                                  json.dumps({"prompt": text[:limit], "max_tokens": 1}))
    check(status == 400 and "tokens, over the model's limit" in data.decode(),
          f"at the limit: {status} {data[:200]!r}")
    status, data, _ = srv.request("POST", "/v1/completions",
                                  json.dumps({"prompt": text[:limit + 1], "max_tokens": 1}))
    check(status == 413 and f"{limit + 1} bytes" in data.decode(), f"over: {status}")


def test_batch_prompt_bytes_limited_in_all():
    # 64 prompts each under --max-prompt-bytes: the limit is the request's, refused (400, naming
    # the total and the limit) before any prompt is tokenized; a batch under it in all is served.
    small = Server("--max-prompt-bytes", 1000, "--grpc-port", -1)
    try:
        verse = "And God said, Let there be light: and there was light. " * 20
        text = verse[:999]
        t0 = time.time()
        status, data, _ = small.request("POST", "/v1/completions", json.dumps(
            {"prompt": [text] * 64, "max_tokens": 1}))
        err = json.loads(data)["error"]
        check(status == 400 and "63936 bytes" in err["message"] and "1000 bytes" in err["message"]
              and "--max-prompt-bytes" in err["message"] and err["param"] == "prompt",
              f"64 x 999 bytes: {status} {err}")
        check(time.time() - t0 < 1, f"refused in {time.time() - t0:.2f} s")
        status, data, _ = small.request("POST", "/v1/completions", json.dumps(
            {"prompt": [text, verse[:1001]], "max_tokens": 1}))
        check(status == 413 and "1001 bytes" in data.decode(), f"one over: {status} {data!r}")
        status, data, _ = small.request("POST", "/v1/completions", json.dumps(
            {"prompt": [text[:500], text[:500]], "max_tokens": 1}))
        check(status == 200 and len(json.loads(data)["choices"]) == 2,
              f"2 x 500 bytes: {status} {data[:200]!r}")
    finally:
        small.stop()


def test_huge_prompts_refused_over_grpc():
    compile_protos("burst/v1/burst.proto")
    import grpc
    from burst.v1 import burst_pb2, burst_pb2_grpc
    stub = burst_pb2_grpc.BurstStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
    text = "And God said, Let there be light. " * 90000  # 3 MB: under gRPC's 4 MB message limit
    calls = [
        lambda: list(stub.Generate(burst_pb2.GenerateRequest(text=text, max_tokens=1))),
        lambda: list(stub.Chat(burst_pb2.ChatRequest(
            messages=[burst_pb2.ChatMessage(role="user", content=text)], max_tokens=1))),
        lambda: stub.Tokenize(burst_pb2.TokenizeRequest(text=text)),
    ]
    for call in calls:
        t0 = time.time()
        try:
            call()
            code, msg = None, ""
        except grpc.RpcError as e:
            code, msg = e.code(), e.details()
        check(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-prompt-bytes" in msg,
              f"{code} {msg}")
        check(time.time() - t0 < 1, f"refused in {time.time() - t0:.2f} s")


def test_connection_limit_gets_503():
    small = Server("--http-max-connections", 8, "--grpc-port", -1)
    try:
        # 8 connections the server holds. One it refused is readable at once (its 503): a
        # connection of the harness's start-up health check may still have counted when it
        # came (its close not yet seen by the server); such a one is replaced.
        held = []
        deadline = time.time() + 20
        while time.time() < deadline:
            refused = select.select(held, [], [], 0)[0] if held else []
            for h in refused:
                h.close()
            held = [h for h in held if h not in refused]
            if len(held) == 8:
                time.sleep(0.3)
                if not select.select(held, [], [], 0)[0]:
                    break
                continue
            held.append(connect(small))
            time.sleep(0.05)
        check(len(held) == 8, "8 connections held")
        responses, secs = exchange(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n", small)
        check(len(responses) == 1 and responses[0][0] == 503, f"over the limit: {responses}")
        st, headers, body = responses[0]
        check("too many connections" in json.loads(body)["error"]["message"]
              and headers.get("retry-after") and headers.get("connection") == "close",
              f"503 says why: {headers} {body}")
        check(secs < 2, f"answered at once ({secs:.1f} s)")
        for s in held:
            s.close()
        time.sleep(0.3)
        st, _ = small.json("GET", "/health")
        check(st == 200, "served again once connections closed")
    finally:
        small.stop()


def test_idle_connections_of_one_client_do_not_lock_out_others():
    # One client (127.0.0.2) opens 40 connections and sends nothing: 16 are held
    # (--http-max-connections-per-client), the rest refused 503 at once. Another (127.0.0.3)
    # holds 8 idle keep-alive connections: the server is at --http-max-connections (24). A third
    # client (127.0.0.1) is still served: each of its connections closes an idle keep-alive one
    # to make room (before: 503 on every request while the idle sockets stayed). Once they all
    # close, the worker threads leave again (before: the pool never shrank).
    small = Server("--http-max-connections", 24, "--http-max-connections-per-client", 16,
                   "--grpc-port", -1)
    try:
        pid = small.proc.pid
        time.sleep(0.3)
        threads0 = proc_status(pid, "Threads")
        idle = [connect(small, source="127.0.0.2") for _ in range(40)]
        time.sleep(0.5)
        refused = select.select(idle, [], [], 0)[0]
        answers = [s.recv(4096) for s in refused]
        check(len(refused) == 24 and all(a.startswith(b"HTTP/1.1 503 ") for a in answers) and
              b"--http-max-connections-per-client" in answers[0],
              f"{len(refused)} of 40 refused: {answers[:1]}")
        keep = []
        for _ in range(8):
            s = connect(small, source="127.0.0.3")
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            f = s.makefile("rb")
            r = read_response(f)
            check(r and r[0] == 200, f"keep-alive request: {r}")
            keep.append((s, f))
        busy = proc_status(pid, "Threads")
        statuses = []
        for _ in range(10):
            st, _, _ = small.request("GET", "/v1/models")
            statuses.append(st)
        closed = sum(1 for s, f in keep if select.select([s], [], [], 0)[0] and f.read() == b"")
        print(f"idle connections: threads {threads0} -> {busy} with 24 held; another client "
              f"served {statuses.count(200)} of 10, {closed} idle keep-alive ones closed")
        check(statuses == [200] * 10, f"the third client is served: {statuses}")
        check(closed >= 1, "an idle keep-alive connection made room")
        for s in idle:
            s.close()
        for s, f in keep:
            f.close()  # the socket's descriptor closes with its last file object
            s.close()
        deadline = time.time() + 8
        while time.time() < deadline and proc_status(pid, "Threads") > threads0 + 4:
            time.sleep(0.2)
        after = proc_status(pid, "Threads")
        print(f"threads {after} {time.time() - deadline + 8:.1f} s after the clients left")
        check(busy >= threads0 + 16 and after <= threads0 + 4,
              f"threads {threads0} -> {busy} -> {after}: the pool shrinks back")
    finally:
        small.stop()


def test_echo_logprobs_response_is_bounded():
    """Item 16's amplification: echo + logprobs 20 over 64 prompts of 1900 ids (a 0.8 MB body)
    would come to ~67 MB of JSON, held several times over. Refused before anything runs, with
    the sizes and the limit, and the server's memory stays flat; the server keeps serving."""
    small = Server("--max-body-bytes", 2 << 20, "--max-response-bytes", 50_000_000,
                   "--grpc-port", -1, workers=1)
    try:
        rss0 = vm_rss_kb(small.proc.pid)
        body = json.dumps({"prompt": [[450] * 1900] * 64, "echo": True, "logprobs": 20,
                           "max_tokens": 1})
        t0 = time.time()
        st, data, _ = small.request("POST", "/v1/completions", body,
                                    {"Content-Type": "application/json"})
        took = time.time() - t0
        err = json.loads(data)["error"]
        check(st == 400 and err["param"] == "logprobs" and "64 prompt(s)" in err["message"]
              and "1900 echoed prompt" in err["message"]
              and "50000000 bytes (--max-response-bytes)" in err["message"], f"{st} {err}")
        rss1 = vm_rss_kb(small.proc.pid)
        print(f"refused in {took:.2f} s; RSS {rss0} -> {rss1} KB: {err['message']}")
        check(rss1 - rss0 < 64 * 1024, f"RSS grew {rss1 - rss0} KB")
        st, r = small.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        check(st == 200, f"still serving: {st} {r}")
        # Within the bound (2 of those prompts: 2.3 MB estimated) it runs.
        st, r = small.json("POST", "/v1/completions", {"prompt": [[450] * 1900] * 2,
                                                       "echo": True, "logprobs": 20,
                                                       "max_tokens": 1})
        check(st == 200 and len(r["choices"]) == 2 and
              len(r["choices"][1]["logprobs"]["top_logprobs"]) == 1901, f"within: {st}")
    finally:
        small.stop()


if __name__ == "__main__":
    srv = Server("--http-header-timeout-ms", HEADER_TIMEOUT_MS, "--http-body-timeout-ms",
                 BODY_TIMEOUT_MS)
    try:
        run([test_backlog_and_burst_of_64_streams,
             test_slow_header_clients_are_dropped_while_others_are_served,
             test_slow_body_gets_408_and_expect_continue_is_answered,
             test_pipelined_requests_are_answered_in_order,
             test_smuggling_and_malformed_heads_get_400,
             test_disconnected_non_streaming_request_is_cancelled,
             test_half_closed_client_gets_its_answer,
             test_disconnected_waiting_stream_is_cancelled,
             test_abandoned_requests_leave_the_queue,
             test_huge_prompts_refused_before_tokenizing, test_batch_prompt_bytes_limited_in_all,
             test_huge_prompts_refused_over_grpc,
             test_connection_limit_gets_503,
             test_idle_connections_of_one_client_do_not_lock_out_others,
             test_echo_logprobs_response_is_bounded])
    finally:
        srv.stop()
