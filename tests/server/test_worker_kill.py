"""A worker SIGKILLed mid-request: the in-flight stream fails with a 503-style error event
within 5 s, /health leaves "ok" (the restart counter moves), the server restarts the worker
group, and the next request succeeds. Run: /usr/bin/python3 test_worker_kill.py --build DIR."""
import http.client
import json
import os
import signal
import time

from harness import PROMPT, Server, check, kill_mid_stream, run, sse_events

srv = None


def test_sigkill_worker_mid_stream():
    c = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 240, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = c.getresponse()
    events = sse_events(resp)
    next(events)
    pids = srv.worker_pids()
    check(len(pids) == 2, f"two workers: {pids}")
    error, took = kill_mid_stream(events, pids[1])
    c.close()
    check(error is not None and error["type"] == "service_unavailable", f"error event {error}")
    check(took < 5, f"failed within 5 s (took {took:.2f} s)")
    # Unhealthy was reported (the restart counter), then the group comes back.
    deadline = time.time() + 60
    while srv.metric("burst:worker_restarts_total") < 1 and time.time() < deadline:
        time.sleep(0.05)
    check(srv.metric("burst:worker_restarts_total") >= 1, "the group was restarted")
    srv.wait_healthy()
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    check(st == 200 and r["usage"]["completion_tokens"] == 4, f"next request: {st} {r}")
    check(set(srv.worker_pids()).isdisjoint(pids), "fresh workers")


def test_sigkill_worker_non_stream_503():
    import threading
    result = {}

    def req():
        result["r"] = srv.request("POST", "/v1/completions", {"prompt": PROMPT,
                                                              "max_tokens": 240})

    t = threading.Thread(target=req)
    t.start()
    deadline = time.time() + 10
    while srv.metric("burst:num_requests_running") != 1 and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    os.kill(srv.worker_pids()[0], signal.SIGKILL)
    t.join(10)
    st, data, hdr = result["r"]
    check(st == 503 and "Retry-After" in hdr, f"503 with Retry-After: {st} {data[:200]!r}")
    check(time.time() - t0 < 5, "within 5 s")
    srv.wait_healthy()
    st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    check(st == 200, f"next request: {st}")


if __name__ == "__main__":
    srv = Server()
    try:
        run([test_sigkill_worker_mid_stream, test_sigkill_worker_non_stream_503])
    finally:
        srv.stop()
