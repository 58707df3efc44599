"""Shared by the end-to-end server tests: starts a real burst-server on free ports (it writes
them to a port file), waits for /health, and always stops it (SIGTERM, then SIGKILL). The model
is models/kjv-tiny once it exists, else the odd-linear golden fixture (vocab 4099) with the real
tokenizer: prompts are then chosen to tokenize below id 4099."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KJV = os.path.join(ROOT, "models", "kjv-tiny")
TOKENIZER = os.path.join(KJV, "tokenizer.model")
HAVE_KJV = os.path.exists(os.path.join(KJV, "config.json"))
MODEL = KJV if HAVE_KJV else os.path.join(ROOT, "tests", "fixtures", "golden", "odd-linear", "model")
# Tokenizes to ids < 4099, so it works on both models.
PROMPT = "And God said" if HAVE_KJV else "And the was"
# Genesis 1:1-4 (kjv-tiny's training text): a prompt of ~80 tokens whose log-probabilities the
# FP8 tests compare; the fallback model gets a short one.
KJV_PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was "
               "without form, and void; and darkness was upon the face of the deep. And the "
               "Spirit of God moved upon the face of the waters. And God said, Let there be "
               "light: and there was light. And God saw the light, that it was good: and God "
               "divided the light from the darkness.") if HAVE_KJV else "And the was"


def build_dir():
    for i, a in enumerate(sys.argv):
        if a == "--build" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return os.environ.get("BURST_BUILD_DIR", os.path.join(ROOT, "build"))


class Server:
    def __init__(self, *extra, workers=2, wait_healthy=True, omp_passive=True):
        self.dir = tempfile.mkdtemp(prefix="burst-srv-test-")
        self.port_file = os.path.join(self.dir, "ports.json")
        self.log_path = os.path.join(self.dir, "server.log")
        args = [os.path.join(build_dir(), "bin", "burst-server"), "--model", MODEL,
                "--tokenizer", TOKENIZER, "--workers", str(workers), "--threads-per-worker", "1",
                "--http-port", "0", "--grpc-port", "0", "--port-file", self.port_file,
                *[str(e) for e in extra]]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        if not omp_passive:  # the server's own default for its workers
            env.pop("OMP_WAIT_POLICY")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 60
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("burst-server did not start:\n" + self.read_log())
            time.sleep(0.05)
        ports = json.load(open(self.port_file))
        self.http_port, self.grpc_port = ports["http_port"], ports["grpc_port"]
        self.worker_port = ports.get("worker_port", -1)  # --remote-workers: where they join
        if wait_healthy:
            self.wait_healthy()

    def wait_healthy(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("burst-server never became healthy:\n" + self.read_log())

    def request(self, method, path, body=None, headers=None, timeout=60):
        c = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        h = dict(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, dict(r.getheaders())

    def json(self, method, path, body=None, headers=None):
        status, data, _ = self.request(method, path, body, headers)
        return status, json.loads(data)

    def worker_pids(self):
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    stat = open(f"/proc/{d}/stat").read()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        pids.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        return pids

    def metric(self, name):
        """A sample's value by name and labels as written here; the model_name label every
        sample carries is left out of the comparison."""
        _, data, _ = self.request("GET", "/metrics")
        for line in data.decode().splitlines():
            line = re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", line).replace("{}", "")
            line = line.replace(",}", "}")
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def kv_held(self):
        """KV tokens that requests hold: those in use less the prefix cache's blocks that no
        request uses (they stay, for later requests that start with the same tokens)."""
        return (self.metric("burst:kv_cache_used_tokens")
                - self.metric("burst:kv_cache_cached_tokens"))

    def wait_kv_released(self, timeout=30):
        """True once no request holds KV and none runs (a finished request's pages are
        released by the next step, and the gauges follow that step)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.kv_held() == 0 and self.metric("burst:num_requests_running") == 0:
                return True
            time.sleep(0.05)
        return False

    def read_log(self):
        try:
            return open(self.log_path, errors="replace").read()[-6000:]
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def compile_protos(*protos, proto_path=os.path.join(ROOT, "proto"), out=None):
    """Python message and gRPC stubs of protos (paths under proto_path), made by protoc and
    Debian's grpc_python_plugin into `out` (default: a fresh temporary directory), which is put
    on sys.path so that they import. Returns `out`."""
    out = out or tempfile.mkdtemp(prefix="burst-pb-")
    subprocess.run(["protoc", f"--proto_path={proto_path}", f"--python_out={out}",
                    f"--grpc_out={out}", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                    *protos], check=True)
    if out not in sys.path:
        sys.path.insert(0, out)
    return out


def sse_events(resp):
    """Yields (event_name, data) from an http.client response of text/event-stream; comment
    lines are yielded as ("comment", text)."""
    event, data = None, []
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode().rstrip("\r\n")
        if line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            yield event, "\n".join(data)
            event, data = None, []


def sse_chunks(resp):
    """The JSON chunks of an OpenAI SSE stream, in order, up to data: [DONE] (comments and
    keep-alives left out)."""
    for ev, data in sse_events(resp):
        if ev == "comment":
            continue
        if data == "[DONE]":
            return
        yield json.loads(data)


def kill_mid_stream(events, pid):
    """SIGKILLs pid while an SSE stream runs; returns (error object or None, seconds until the
    stream ended)."""
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    error = None
    for ev, data in events:
        if data == "[DONE]":
            break
        if ev != "comment" and "error" in json.loads(data):
            error = json.loads(data)["error"]
    return error, time.time() - t0


def run_at_most(fn, n, width):
    """fn(0), ..., fn(n - 1), each on its own thread started in order, at most `width` at once
    (a thread waits for the oldest running one to end)."""
    threads = []
    for i in range(n):
        t = threading.Thread(target=fn, args=(i,))
        t.start()
        threads.append(t)
        if len(threads) >= width:
            threads.pop(0).join()
    for t in threads:
        t.join()


def check_bad_option_refused(flag, server_value, worker_value, expected):
    """burst-server refuses `flag server_value` at start, burst-worker `flag worker_value` with
    exit 2, both saying `expected` (the choices the option takes)."""
    r = subprocess.run([os.path.join(build_dir(), "bin", "burst-server"), flag, server_value,
                        "--http-port", "0", "--grpc-port", "-1"],
                       capture_output=True, text=True, timeout=60)
    check(r.returncode != 0, f"server {flag} {server_value}: exit {r.returncode}")
    check(expected in r.stderr + r.stdout, (r.stderr + r.stdout)[-500:])
    w = subprocess.run([os.path.join(build_dir(), "bin", "burst-worker"), flag, worker_value],
                       capture_output=True, text=True, timeout=60)
    check(w.returncode == 2, f"worker {flag} {worker_value}: exit {w.returncode}")
    check(expected in w.stderr, w.stderr[-500:])


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def run(tests):
    failed = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            print(f"ok   {t.__name__} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {t.__name__}: {type(e).__name__}: {e}", flush=True)
    print(f"{len(tests) - failed}/{len(tests)} passed")
    sys.exit(1 if failed else 0)
