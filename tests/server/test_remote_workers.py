"""Multi-node workers, on one host: burst-server --remote-workers 2 spawns nothing and answers
503 "waiting for workers (k/N registered ...)" until two `burst-worker --join 127.0.0.1:PORT`
registered; then it serves the same greedy text as burst-generate. A worker with another model
and a third worker are refused (exit code 4, a message naming why) while the server keeps
waiting / serving. A remote worker SIGKILLed mid-stream fails the request with a 503-style error
within 5 s, /health goes 503, the survivor registers again by itself, and a fresh --join worker
brings the group back with the same text; a SIGTERM while the group dissolves stops the worker.
Four joined workers at tp 2 serve the same text. The server and the workers share a cluster
token through $BURST_CLUSTER_TOKEN (test_cluster_token.py checks the refusals).
Run: /usr/bin/python3 test_remote_workers.py --build
DIR."""
import http.client
import json
import os
import subprocess
import time

from harness import (HAVE_KJV, MODEL, PROMPT, ROOT, TOKENIZER, Server, build_dir, check,
                     kill_mid_stream, run, sse_events)

# A model that is not the server's: the other tiny fixture.
OTHER = os.path.join(ROOT, "tests", "fixtures", "golden",
                     "odd-dynamic" if not HAVE_KJV else "odd-linear", "model")
REFUSED = 4  # burst-worker's exit code when the server refuses it

srv = None
workers = []  # every burst-worker started here (killed at the end)
expected = None  # burst-generate's greedy text for PROMPT


def start_worker(model=MODEL, name="w"):
    log = open(os.path.join(srv.dir, f"{name}-{len(workers)}.log"), "wb")
    p = subprocess.Popen([os.path.join(build_dir(), "bin", "burst-worker"), "--model", model,
                          "--join", f"127.0.0.1:{srv.worker_port}", "--threads", "1"],
                         stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    p.log_path = log.name
    workers.append(p)
    return p


def log_of(p):
    return open(p.log_path, errors="replace").read()


def health():
    st, data, _ = srv.request("GET", "/health")
    return st, json.loads(data)


def wait_for(cond, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n" + srv.read_log())


def greedy_text(max_tokens=20):
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens,
                                                  "temperature": 0})
    check(st == 200, f"completion: {st} {r}")
    return r["choices"][0]["text"]


def test_waits_for_workers_then_serves_burst_generate_text():
    st, h = health()
    check(st == 503 and h["status"] == "waiting" and "0/2 registered" in h["message"],
          f"health before any worker: {st} {h}")
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    check(st == 503 and "waiting for workers (0/2" in r["error"]["message"],
          f"a request while waiting is refused at once: {st} {r}")
    start_worker()
    wait_for(lambda: "1/2 registered" in health()[1].get("message", ""), "1/2 registered")
    # Another model is refused with a clear message; the server keeps its slot free.
    bad = start_worker(OTHER, "mismatch")
    code = bad.wait(30)
    out = log_of(bad)
    check(code == REFUSED and "refused by the server: model mismatch (" in out and
          "vocab: server" in out, f"mismatching worker: exit {code}\n{out}")
    st, h = health()
    check(st == 503 and "1/2 registered" in h["message"], f"still waiting: {h}")
    start_worker()
    srv.wait_healthy(60)
    text = greedy_text()
    check(text and PROMPT + text == expected, f"remote text {text!r} vs burst-generate "
          f"{expected!r}")


def test_extra_worker_refused():
    extra = start_worker(name="extra")
    code = extra.wait(30)
    out = log_of(extra)
    check(code == REFUSED and "one too many" in out, f"extra worker: exit {code}\n{out}")
    check(health()[0] == 200, "the group still serves")


def test_sigkill_remote_worker_then_fresh_worker_rejoins():
    alive = [w for w in workers if w.poll() is None]
    check(len(alive) == 2, f"two live workers: {[w.pid for w in alive]}")
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    events = sse_events(c.getresponse())
    next(events)
    victim, survivor = alive[1], alive[0]
    error, took = kill_mid_stream(events, victim.pid)
    c.close()
    check(error is not None and error["type"] == "service_unavailable", f"error event {error}")
    check(took < 5, f"failed within 5 s (took {took:.2f} s)")
    st, h = health()
    check(st == 503, f"/health after the kill: {st} {h}")
    # The survivor registers again by itself (same process id: it re-executes itself).
    wait_for(lambda: "1/2 registered" in health()[1].get("message", ""), "the survivor rejoins")
    check(survivor.poll() is None, "the survivor did not exit:\n" + log_of(survivor))
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    check(st == 503, f"a request without a group gets 503: {st} {r}")
    start_worker(name="fresh")
    srv.wait_healthy(60)
    text = greedy_text()
    check(PROMPT + text == expected, f"after the rejoin {text!r} vs {expected!r}")
    check(srv.metric("burst:worker_restarts_total") >= 1, "the restart is counted")


def test_tensor_parallel_joined_group():
    # 4 joined workers at tp 2 (two tensor-parallel groups, a ring of 2): each loads only its
    # slice once it has its rank, and the group serves burst-generate's text.
    tp_srv = Server("--remote-workers", "4", "--tp", "2", "--worker-listen", "127.0.0.1:0",
                    wait_healthy=False)
    joined = []
    try:
        for i in range(4):
            log = open(os.path.join(tp_srv.dir, f"tp-{i}.log"), "wb")
            joined.append(subprocess.Popen(
                [os.path.join(build_dir(), "bin", "burst-worker"), "--model", MODEL, "--join",
                 f"127.0.0.1:{tp_srv.worker_port}", "--threads", "1"],
                stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE")))
        tp_srv.wait_healthy(60)
        st, r = tp_srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 20,
                                                        "temperature": 0})
        check(st == 200, f"completion: {st} {r}")
        text = r["choices"][0]["text"]
        check(PROMPT + text == expected, f"tp 2 joined text {text!r} vs burst-generate "
              f"{expected!r}")
    finally:
        tp_srv.stop()
        for w in joined:
            if w.poll() is None:
                w.kill()
            w.wait()


def test_sigterm_while_the_group_dissolves():
    # One worker SIGKILLed, the other SIGTERMed as it leaves the dissolved group to register
    # again: it must stop (exit 0), not re-execute itself and go on registering.
    alive = [w for w in workers if w.poll() is None]
    check(len(alive) == 2, f"two live workers: {[w.pid for w in alive]}")
    before = log_of(alive[1])
    alive[0].kill()
    # The moment the survivor says why it leaves the group (then it stops its control service,
    # up to 2 s, and re-executes itself): the SIGTERM lands in that window.
    wait_for(lambda: any(w in log_of(alive[1])[len(before):]
                         for w in ("told to leave", "lost the server", "closed the membership")),
             "the survivor leaving its group", timeout=15)
    alive[1].terminate()
    try:
        rc = alive[1].wait(timeout=8)
    except subprocess.TimeoutExpired:
        raise AssertionError("SIGTERM lost while the group dissolved:\n" + log_of(alive[1]))
    check(rc == 0, f"exit code {rc}:\n" + log_of(alive[1]))


if __name__ == "__main__":
    gen = subprocess.run([os.path.join(build_dir(), "bin", "burst-generate"), "--model", MODEL,
                          "--tokenizer", TOKENIZER, "--prompt", PROMPT, "--max-tokens", "20",
                          "--temperature", "0"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    if gen.returncode != 0:
        raise SystemExit("burst-generate failed:\n" + gen.stderr)
    expected = gen.stdout.rstrip("\n")
    # The servers and every worker started here inherit it.
    os.environ["BURST_CLUSTER_TOKEN"] = "test-remote-workers-token"
    srv = Server("--remote-workers", "2", "--worker-listen", "127.0.0.1:0", wait_healthy=False)
    try:
        run([test_waits_for_workers_then_serves_burst_generate_text, test_extra_worker_refused,
             test_sigkill_remote_worker_then_fresh_worker_rejoins,
             test_sigterm_while_the_group_dissolves, test_tensor_parallel_joined_group])
    finally:
        srv.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
