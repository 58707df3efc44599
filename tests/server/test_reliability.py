"""Faults and hostile conditions against real burst-server processes (docs/reliability.md):
a worker stopped with SIGSTOP (hung, not dead) mid-stream and while idle, drain with queued
streams, SIGKILL of the server (no run directory left), the internal worker port without its
secret, and model directories the loader must refuse. Run:
/usr/bin/python3 test_reliability.py --build DIR."""
import http.client
import json
import os
import signal
import subprocess
import tempfile
import threading
import time

from harness import PROMPT, Server, build_dir, check, run, sse_events


def stream_request(srv, max_tokens=240, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=timeout)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    return c, c.getresponse()


def read_to_end(events):
    """(error object or None, final choice or None) of the rest of an SSE stream."""
    error, final = None, None
    for ev, data in events:
        if data == "[DONE]":
            break
        if ev == "comment" or ev == "progress":
            continue
        j = json.loads(data)
        if "error" in j:
            error = j["error"]
        elif j.get("choices") and j["choices"][0].get("finish_reason") is not None:
            final = j["choices"][0]
    return error, final


class HealthWatch:
    """Polls /health every 50 ms on a thread; remembers every status seen."""

    def __init__(self, srv):
        self.srv, self.seen, self.stop = srv, [], False
        self.t = threading.Thread(target=self.loop, daemon=True)
        self.t.start()

    def loop(self):
        while not self.stop:
            try:
                self.seen.append(self.srv.request("GET", "/health", timeout=5)[0])
            except OSError:
                pass
            time.sleep(0.05)

    def done(self):
        self.stop = True
        self.t.join()
        return self.seen


def resume(pid):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def test_sigstop_worker_mid_stream():
    with Server() as srv:
        c, resp = stream_request(srv)
        events = sse_events(resp)
        next(events)
        pids = srv.worker_pids()
        check(len(pids) == 2, f"two workers: {pids}")
        watch = HealthWatch(srv)
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.time()
        try:
            error, _ = read_to_end(events)
            took = time.time() - t0
            c.close()
            check(error is not None and error["type"] == "service_unavailable",
                  f"error event {error}")
            check("heartbeat" in error["message"], f"the message says why: {error['message']}")
            check(took < 10, f"failed within 10 s (took {took:.2f} s)")
            srv.wait_healthy()
            seen = watch.done()
            check(503 in seen, f"/health turned 503 meanwhile: {sorted(set(seen))}")
            st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
            check(st == 200 and r["usage"]["completion_tokens"] == 4, f"next request: {st} {r}")
            check(set(srv.worker_pids()).isdisjoint(pids), "fresh workers")
        finally:
            watch.stop = True
            resume(pids[1])


def test_sigstop_idle_worker():
    with Server() as srv:
        pids = srv.worker_pids()
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.time()
        try:
            status = 200
            while status == 200 and time.time() - t0 < 15:
                status = srv.request("GET", "/health")[0]
                time.sleep(0.05)
            took = time.time() - t0
            check(status == 503, f"/health turned 503 (last {status})")
            check(took < 10, f"within 10 s (took {took:.2f} s)")
            srv.wait_healthy()
            st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
            check(st == 200 and r["usage"]["completion_tokens"] == 3, f"next request: {st} {r}")
            check(srv.metric("burst_worker_restarts_total") >= 1, "restart counted")
        finally:
            resume(pids[0])


def test_drain_timeout_ends_streams_with_a_message():
    # One sequence runs at a time: two streams wait in the queue when SIGTERM comes, and the
    # running one cannot finish 2000 tokens within the 300 ms drain.
    srv = Server("--drain-timeout-ms", 300, "--max-running", 1, "--keepalive-ms", 100)
    try:
        streams = [stream_request(srv, max_tokens=2000) for _ in range(3)]
        deadline = time.time() + 20
        while (srv.metric("burst_num_requests_running") != 1 or
               srv.metric("burst_num_requests_waiting") != 2) and time.time() < deadline:
            time.sleep(0.02)
        check(srv.metric("burst_num_requests_waiting") == 2, "two streams queued")
        srv.proc.send_signal(signal.SIGTERM)
        results = []
        for c, resp in streams:
            results.append(read_to_end(sse_events(resp)))
            c.close()
        rc = srv.proc.wait(timeout=40)
        for error, final in results:
            # Never a silent end: an error event with a message, or a finish_reason.
            check(error is not None or (final and final["finish_reason"]),
                  f"a stream ended without saying why: {results}")
        errors = [e for e, _ in results if e]
        check(len(errors) == 3, f"every stream was cut by the drain: {results}")
        check(all(e["type"] == "service_unavailable" and "drain timeout" in e["message"]
                  for e in errors), f"messages: {errors}")
        check(sum("before it started" in e["message"] for e in errors) == 2, f"{errors}")
        check(rc == 0, f"exit code {rc}")
    finally:
        srv.stop()


def test_sigkill_server_leaves_no_run_dir():
    tmp = tempfile.mkdtemp(prefix="burst-rel-tmp-")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(tmp, f"burst-group-{dead.pid}-AbCdEf")
    os.makedirs(os.path.join(stale, "store"))
    open(os.path.join(stale, "port-0"), "w").write("1\n")
    alive = os.path.join(tmp, f"burst-group-{os.getpid()}-XyZxYz")  # a coordinator that runs
    os.makedirs(alive)
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tmp
    try:
        srv = Server()
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old
    try:
        check(not os.path.exists(stale), "the stale run directory of a dead coordinator is gone")
        check(os.path.exists(alive), "a running coordinator's directory is kept")
        left = [d for d in os.listdir(tmp) if d != os.path.basename(alive)]
        check(not left, f"no run directory once the group started: {left}")
        pids = srv.worker_pids()
        srv.proc.kill()
        srv.proc.wait()
        deadline = time.time() + 10
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        left = [d for d in os.listdir(tmp) if d != os.path.basename(alive)]
        check(not left, f"nothing left after SIGKILL of the server: {left}")
    finally:
        srv.stop()
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    run([test_sigstop_worker_mid_stream, test_sigstop_idle_worker,
         test_drain_timeout_ends_streams_with_a_message, test_sigkill_server_leaves_no_run_dir])
