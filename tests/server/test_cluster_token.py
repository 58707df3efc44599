"""Multi-node is secure by default: burst-server --remote-workers refuses to start without a
cluster token (exit code 2, naming $BURST_CLUSTER_TOKEN and --insecure-cluster; --check-config
notes it), starts with a token ($BURST_CLUSTER_TOKEN or $BURST_CLUSTER_TOKEN_FILE) and then
refuses a worker without it, and starts without one only with --insecure-cluster, where a
worker without a token joins and the group serves. docker-compose.multinode.yml passes the
token to every frontend and worker service, binds the registry to BURST_SERVER and the API to
BURST_BIND, and the docs give the one-liner that makes the token."""
import os
import re
import subprocess
import tempfile

import yaml

from harness import MODEL, PROMPT, ROOT, TOKENIZER, Server, build_dir, check, run


def env_without_token(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("BURST_CLUSTER")}
    e.update(extra, OMP_WAIT_POLICY="PASSIVE")
    return e


def server_args(*extra):
    return [os.path.join(build_dir(), "bin", "burst-server"), "--model", MODEL, "--tokenizer",
            TOKENIZER, "--remote-workers", "1", "--worker-listen", "127.0.0.1:0",
            "--http-port", "0", "--grpc-port", "-1", *extra]


def worker(port, env):
    return subprocess.Popen([os.path.join(build_dir(), "bin", "burst-worker"), "--model", MODEL,
                             "--join", f"127.0.0.1:{port}", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def test_refused_without_a_token():
    p = subprocess.run(server_args(), capture_output=True, timeout=60, env=env_without_token())
    err = p.stderr.decode(errors="replace")
    check(p.returncode == 2 and "without a cluster token" in err and "BURST_CLUSTER_TOKEN" in err
          and "--insecure-cluster" in err and "serving model" not in err,
          f"no token: exit {p.returncode}: {err[-600:]}")
    # --check-config accepts the config and says the server would refuse to start.
    p = subprocess.run(server_args("--check-config"), capture_output=True, timeout=60,
                       env=env_without_token())
    check(p.returncode == 0 and "will refuse to start" in p.stderr.decode(),
          f"--check-config: {p.returncode} {p.stderr.decode()[-400:]}")
    # An empty token file is an error, not "no token".
    empty = os.path.join(tempfile.mkdtemp(prefix="burst-token-"), "empty")
    open(empty, "w").close()
    p = subprocess.run(server_args(), capture_output=True, timeout=60,
                       env=env_without_token(BURST_CLUSTER_TOKEN_FILE=empty))
    check(p.returncode != 0 and "serving model" not in p.stderr.decode(errors="replace"),
          f"empty token file: {p.returncode}")


def test_token_starts_and_guards_the_registry():
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("BURST_CLUSTER")}
    os.environ["BURST_CLUSTER_TOKEN"] = "the-cluster-secret"
    try:
        srv = Server("--remote-workers", 1, "--worker-listen", "127.0.0.1:0", workers=1,
                     wait_healthy=False)
    finally:
        del os.environ["BURST_CLUSTER_TOKEN"]
        os.environ.update(old)
    try:
        w = worker(srv.worker_port, env_without_token())
        out = w.communicate(timeout=60)[0].decode(errors="replace")
        check(w.returncode == 4 and "cluster token" in out, f"tokenless worker: {w.returncode}")
        st, _, _ = srv.request("GET", "/health")
        check(st == 503, f"still waiting: {st}")
    finally:
        srv.stop()


def test_insecure_cluster_flag():
    old = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("BURST_CLUSTER")}
    try:
        srv = Server("--remote-workers", 1, "--worker-listen", "127.0.0.1:0", "--insecure-cluster",
                     workers=1, wait_healthy=False)
    finally:
        os.environ.update(old)
    w = None
    try:
        w = worker(srv.worker_port, env_without_token())
        srv.wait_healthy(60)
        st, r = srv.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        check(st == 200 and r["usage"]["completion_tokens"] == 3, f"served: {st} {r}")
        check("any host that reaches" in srv.read_log(), "the registry warns")
    finally:
        srv.stop()
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()


def test_compose_and_docs():
    compose = yaml.safe_load(open(os.path.join(ROOT, "docker-compose.multinode.yml")))
    services = compose["services"]
    for name in ["frontend", "workers", "frontend-cpu", "worker-cpu"]:
        env = services[name]["environment"]
        check(str(env.get("BURST_CLUSTER_TOKEN", "")).startswith("${BURST_CLUSTER_TOKEN"),
              f"{name} does not pass BURST_CLUSTER_TOKEN: {env}")
    cmd = services["frontend"]["command"]
    listen = cmd[cmd.index("--worker-listen") + 1]
    host = cmd[cmd.index("--host") + 1]
    check(listen.startswith("${BURST_SERVER") and host.startswith("${BURST_BIND"),
          f"frontend binds {listen} and {host}")
    check("--insecure-cluster" not in cmd, "the compose file runs a secure cluster")
    one_liner = re.compile(r"BURST_CLUSTER_TOKEN=\$\(openssl rand -hex 32\)")
    for doc in ["README.md", os.path.join("docs", "deploy.md"), "docker-compose.multinode.yml"]:
        text = open(os.path.join(ROOT, doc)).read()
        check(one_liner.search(text), f"{doc} lacks the token one-liner")
        check("no authentication" not in text, f"{doc} still says the registry has none")


if __name__ == "__main__":
    run([test_refused_without_a_token, test_token_starts_and_guards_the_registry,
         test_insecure_cluster_flag, test_compose_and_docs])
