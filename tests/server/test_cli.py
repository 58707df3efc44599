"""The command lines of burst-server, burst-worker and burst-generate (CLI11): --flag=value as
well as --flag value, the last of a repeated flag wins, an unknown flag is named as one (not as
a missing value), a flag without its value says so, --help lists every flag each parser takes,
and a running server logs the config file it read and says "off" for a disabled API (never
"127.0.0.1:-1")."""
import glob
import json
import os
import re
import subprocess
import tempfile

from harness import MODEL, PROMPT, ROOT, TOKENIZER, Server, build_dir, check, run


def exe(name):
    return os.path.join(build_dir(), "bin", name)


def cli(name, *args):
    p = subprocess.run([exe(name), *[str(a) for a in args]], capture_output=True, timeout=120)
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def resolved(*args):
    """burst-server --check-config's resolved settings."""
    code, out, err = cli("burst-server", "--model", MODEL, "--check-config", *args)
    check(code == 0, f"--check-config {args}: {code} {err}")
    return json.loads(out)


def test_equals_form_and_last_flag_wins():
    c = resolved("--max-queue=7", "--http-port=-1", "--model-name=a b", "--max-running", "5",
                 "--max-running", "9", "--no-prefix-caching")
    check(c["max_queue"] == 7 and c["http_port"] == -1 and c["model_name"] == "a b"
          and c["max_running"] == 9 and c["prefix_caching"] == 0, f"resolved: {c}")
    # Flags override the config file, wherever --config stands.
    d = tempfile.mkdtemp(prefix="burst-cli-")
    cfg = os.path.join(d, "c.json")
    with open(cfg, "w") as f:
        json.dump({"model": MODEL, "max_queue": 3, "workers": 3}, f)
    c = resolved("--max-queue", "11", f"--config={cfg}")
    check(c["max_queue"] == 11 and c["workers"] == 3, f"flag over file: {c}")
    # burst-generate: --flag=value on a real run.
    code, out, err = cli("burst-generate", f"--model={MODEL}", f"--prompt={PROMPT}",
                         "--max-tokens=3", "--temperature=0")
    check(code == 0 and "generated 3 tokens" in err, f"burst-generate --x=v: {code} {err}")


def test_errors_name_the_flag():
    for name, base in [("burst-server", ["--model", MODEL]),
                       ("burst-generate", ["--model", MODEL, "--prompt", "x"]),
                       ("burst-worker", ["--model", MODEL, "--rank", "0", "--world", "1"])]:
        code, out, err = cli(name, *base, "--bogus-flag", "1")
        first = err.splitlines()[0] if err else ""
        check(code == 2 and first == f"{name}: unknown flag --bogus-flag", f"{name}: {first!r}")
        code, out, err = cli(name, *base, "--bogus-flag=1")
        check(code == 2 and "unknown flag --bogus-flag" in err.splitlines()[0], f"{name}: {err}")
        code, out, err = cli(name, *base, "--threads" if name == "burst-worker" else "--tp")
        check(code == 2 and "missing value for --" in err.splitlines()[0], f"{name}: {err}")
        code, out, err = cli(name, *base, "--tp=many")
        check(code == 2 and err.splitlines()[0] == f"{name}: bad value 'many' for --tp",
              f"{name}: {err}")
        check("usage: " + name in err, f"{name}: the usage follows the error: {err}")
        code, out, err = cli(name, *base, "stray")
        check(code == 2 and "unexpected argument stray" in err, f"{name}: {err}")


def test_help_lists_every_flag():
    # Each program's flags, read from its sources: a flag added without a description fails.
    sources = {"burst-worker": glob.glob(os.path.join(ROOT, "server", "worker", "*.cpp")),
               "burst-generate": [os.path.join(ROOT, "server", "frontend", "generate_main.cpp")]}
    for name, files in sources.items():
        src = "".join(open(f).read() for f in files)
        flags = set(re.findall(r'add_(?:option|flag)\("(--[a-z-]+)"', src))
        code, out, err = cli(name, "--help")
        check(code == 0 and out.startswith("usage: " + name) and len(flags) >= 15,
              f"{name} --help: {code}, {len(flags)} flags, {out[:200]!r}")
        listed = set(re.findall(r"^  (?:-h,)?(--[a-z-]+)", out, re.M))
        check(flags <= listed, f"{name} --help lacks {sorted(flags - listed)}")
    code, out, err = cli("burst-server", "--help")
    listed = set(re.findall(r"^  (?:-h,)?(--[a-z-]+)", out, re.M))
    keys = resolved()
    want = {"--" + k.replace("_", "-") for k in keys} | {
        "--config", "--data-dir", "--check-config", "--version", "--help", "--no-prefix-caching"}
    check(code == 0 and want <= listed, f"burst-server --help lacks {sorted(want - listed)}")
    # Every description is there, not just the name.
    check(re.search(r"^  --max-queue N +waiting requests beyond", out, re.M), out[:2000])


def test_server_logs_its_config_file_and_disabled_port():
    d = tempfile.mkdtemp(prefix="burst-cli-")
    cfg = os.path.join(d, "server.json")
    with open(cfg, "w") as f:
        json.dump({"model": MODEL, "tokenizer": TOKENIZER, "max_queue": 5}, f)
    srv = Server(f"--config={cfg}", "--grpc-port=-1", workers=1)
    try:
        check(srv.grpc_port == -1, f"port file grpc_port: {srv.grpc_port}")
        st, _, _ = srv.request("GET", "/health")
        check(st == 200, f"health {st}")
    finally:
        srv.stop()
    log = open(srv.log_path, errors="replace").read()
    check(f"config file: {cfg}" in log, f"config file not logged:\n{log[-3000:]}")
    serving = [line for line in log.splitlines() if "serving model" in line]
    check(serving and "gRPC off" in serving[0] and ":-1" not in serving[0]
          and re.search(r"HTTP 127\.0\.0\.1:\d+,", serving[0]), f"serving line: {serving}")


if __name__ == "__main__":
    run([test_equals_form_and_last_flag_wins, test_errors_name_the_flag,
         test_help_lists_every_flag, test_server_logs_its_config_file_and_disabled_port])
