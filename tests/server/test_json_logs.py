"""--log-format json: every line the server's stderr carries during a run is one JSON object in
valid UTF-8, the workers' lines included (they log through the same logger, with their rank, and
what they print to stderr without it is relayed as records by the server): checked over a run
with 2 workers started through a wrapper ($BURST_WORKER_BINARY) that prints raw lines first (one
plain, one with bytes that are not UTF-8, one longer than the relay's 16384-byte piece), a
120-character model name of multibyte characters, a request path percent-encoding bytes that are
not UTF-8, and error messages that the access log cuts at 200 bytes in the middle of multibyte
characters."""
import json
import os
import stat
import subprocess
import tempfile

from harness import MODEL, PROMPT, Server, build_dir, check, run

# 120 characters, 2, 3 and 4 bytes each.
NAME = ("é" * 40) + ("模" * 40) + ("😀" * 40)


# What the wrapper prints raw before it runs burst-worker: as NCCL or the C runtime would.
RAW_PLAIN = "raw line: NCCL INFO ring 00 : 0 1"
LONG = "模" * 7000  # 21000 bytes: relayed in pieces cut between characters


def worker_wrapper():
    path = os.path.join(tempfile.mkdtemp(prefix="burst-test-json-logs-"), "worker-wrapper")
    real = os.path.join(build_dir(), "bin", "burst-worker")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n"
                f"printf '%s\\n' '{RAW_PLAIN}' >&2\n"
                "printf 'raw error: \\377\\376 not UTF-8\\n' >&2\n"
                f"printf '%s\\n' '{LONG}' >&2\n"
                f'exec "{real}" "$@"\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_every_line_is_json():
    os.environ["BURST_WORKER_BINARY"] = worker_wrapper()
    try:
        srv = Server("--log-format", "json", "--log-level", "info", "--model-name", NAME,
                     workers=2)
    finally:
        del os.environ["BURST_WORKER_BINARY"]
    try:
        st, body = srv.json("POST", "/v1/completions",
                            {"model": NAME, "prompt": PROMPT, "max_tokens": 2})
        check(st == 200 and body["model"] == NAME, f"completion: {st} {body}")
        st, _, _ = srv.request("GET", "/v1/%FF%FE%C3%28abc")
        check(st == 404, f"non-UTF-8 path: {st}")
        # Unknown model names whose 404 message the access log cuts at 200 bytes: shifted by one
        # byte each, so that the cut falls inside a 2-, 3- and 4-byte character.
        for shift in range(4):
            st, _ = srv.json("POST", "/v1/completions",
                             {"model": "x" * shift + "模" * 50 + "😀" * 30, "prompt": PROMPT,
                              "max_tokens": 1})
            check(st == 404, f"unknown model: {st}")
    finally:
        code = srv.stop()
    check(code == 0, f"server exit code {code}")
    raw = open(srv.log_path, "rb").read()
    lines = [line for line in raw.split(b"\n") if line.strip()]
    recs, bad = [], []
    for line in lines:
        try:
            rec = json.loads(line.decode("utf-8"))  # strict: raw non-UTF-8 bytes fail here
            check(isinstance(rec, dict), "not an object")
            recs.append(rec)
        except (ValueError, AssertionError) as e:
            bad.append((line[:200], str(e)))
    check(len(lines) >= 10 and not bad, f"{len(bad)} of {len(lines)} lines are not JSON: {bad[:4]}")
    for r in recs:
        check({"time", "level", "logger"} <= set(r) and ("msg" in r or r["logger"] == "access"),
              f"record fields: {r}")
    # The workers' own lines, with their ranks.
    workers = [r for r in recs if r["logger"] == "burst-worker"]
    check({r.get("rank") for r in workers} == {0, 1},
          f"worker records {len(workers)}: ranks {sorted({str(r.get('rank')) for r in workers})}")
    # Their raw stderr lines, relayed as records of their rank: info, or warning when they speak
    # of an error; bytes that are not UTF-8 replaced; a long line in pieces that join up again.
    for rank in (0, 1):
        mine = [r for r in workers if r.get("rank") == rank]
        plain = [r for r in mine if r["msg"] == RAW_PLAIN]
        check(len(plain) == 1 and plain[0]["level"] == "info", f"rank {rank} raw line: {plain}")
        bad = [r for r in mine if r["msg"].startswith("raw error:")]
        check(len(bad) == 1 and bad[0]["level"] == "warning" and
              bad[0]["msg"] == "raw error: \ufffd\ufffd not UTF-8", f"rank {rank} raw bytes: {bad}")
        pieces = [r["msg"] for r in mine if r["msg"].startswith("模")]
        check(len(pieces) == 2 and "".join(pieces) == LONG and
              all(len(p.encode()) <= 16384 for p in pieces),
              f"rank {rank} long line: {[len(p.encode()) for p in pieces]}")
    # The model name whole where the server names it.
    serving = [r for r in recs if r["logger"] == "burst-server" and "serving model" in r["msg"]]
    check(serving and f"'{NAME}'" in serving[0]["msg"], f"serving: {serving}")
    access = [r for r in recs if r["logger"] == "access"]
    paths = [r["path"] for r in access if r.get("status") == 404 and "abc" in r["path"]]
    check(paths and "\ufffd" in paths[0] and paths[0].endswith("(abc"),
          f"non-UTF-8 path recorded as {paths}")
    cut = [r["error"] for r in access if r.get("status") == 404 and
           r.get("error", "").startswith("The model '")]
    check(len(cut) == 4 and all(190 < len(e.encode()) <= 200 and "\ufffd" not in e for e in cut),
          f"cut errors: {[(len(e.encode()), e[-3:]) for e in cut]}")
    check(len({len(e.encode()) for e in cut}) > 1, "the cuts fell at different places")


def test_worker_flags_and_environment():
    # A worker started by hand takes --log-format; a bad one is refused by name.
    worker = os.path.join(build_dir(), "bin", "burst-worker")
    p = subprocess.run([worker, "--model", MODEL, "--join", "127.0.0.1:1", "--log-format", "xml"],
                       capture_output=True, timeout=60)
    check(p.returncode == 2 and b"log format" in p.stderr, f"bad format: {p.stderr!r}")
    # Its own lines (the version, registering, retrying) are JSON records without a rank yet.
    env = dict(os.environ, BURST_LOG_FORMAT="json", BURST_CLUSTER_TOKEN="t")
    p = subprocess.Popen([worker, "--model", MODEL, "--join", "127.0.0.1:1"],
                         stderr=subprocess.PIPE, env=env)
    try:
        out = p.stderr.readline() + p.stderr.readline()
    finally:
        p.terminate()
        p.wait(timeout=30)
    recs = [json.loads(line) for line in out.decode("utf-8").splitlines()]
    check(len(recs) == 2 and all(r["logger"] == "burst-worker" and "rank" not in r for r in recs)
          and recs[0]["msg"].startswith("burst-worker "), f"join worker: {recs}")


if __name__ == "__main__":
    run([test_every_line_is_json, test_worker_flags_and_environment])
