"""Model directories the server must refuse (issue 42, item 20), end to end: burst-server exits
with a message naming the file and the field instead of serving a wrong model or restarting its
workers forever. Config fields are refused by the server before any worker starts (eos_token_id
outside the vocabulary, rope_theta 1e-300, max_position_embeddings 2^30); what only the workers
see in the weights (a config of 1 layer over a checkpoint of 6, BF16 bytes whose header says
F16) fails the worker group's start the same way twice, and the server gives up and exits 1
saying why, after exactly two starts. Run: /usr/bin/python3 test_bad_model.py --build BUILD"""
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time

from harness import HAVE_KJV, KJV, TOKENIZER, build_dir, check, run

TMP = tempfile.mkdtemp(prefix="burst-bad-model-")


def model_dir(name, config_changes, weights=None):
    """kjv-tiny with config.json changed, and its weights (or `weights` bytes)."""
    d = os.path.join(TMP, name)
    os.makedirs(d)
    cfg = json.load(open(os.path.join(KJV, "config.json")))
    cfg.update(config_changes)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    target = os.path.join(d, "model.safetensors")
    if weights is None:
        shutil.copyfile(os.path.join(KJV, "model.safetensors"), target)
    else:
        with open(target, "wb") as f:
            f.write(weights)
    return d


def relabelled_f16():
    """kjv-tiny's BF16 weights with every header dtype F16: the bytes are BF16's."""
    raw = open(os.path.join(KJV, "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__":
            check(v["dtype"] == "BF16", f"{k} is {v['dtype']}")
            v["dtype"] = "F16"
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


def serve(d, timeout=180):
    """Runs burst-server on d until it exits; returns (exit code, seconds, log text)."""
    log = os.path.join(TMP, os.path.basename(d) + ".log")
    args = [os.path.join(build_dir(), "bin", "burst-server"), "--model", d, "--tokenizer",
            TOKENIZER, "--workers", "2", "--threads-per-worker", "1", "--http-port", "0",
            "--grpc-port", "0"]
    t0 = time.time()
    with open(log, "wb") as f:
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
    return rc, time.time() - t0, open(log, errors="replace").read()


def test_config_fields_refused_at_start():
    cases = [("eos", {"eos_token_id": [2, 40000]}, 'field "eos_token_id[1]"'),
             ("theta", {"rope_theta": 1e-300}, 'field "rope_theta"'),
             ("positions", {"max_position_embeddings": 2 ** 30},
              'field "max_position_embeddings"')]
    for name, change, field in cases:
        d = model_dir(name, change)
        rc, secs, log = serve(d, timeout=60)
        check(rc == 1, f"{name}: exit code {rc}\n{log[-3000:]}")
        check(os.path.join(d, "config.json") in log and field in log,
              f"{name}: the message names neither the file nor {field}:\n{log[-3000:]}")
        check("starting 2 worker" not in log, f"{name}: workers were started")


def check_gave_up(name, rc, log, reason):
    check(rc == 1, f"{name}: exit code {rc} (None: still running, restarting forever)\n"
          f"{log[-4000:]}")
    check("failed to start twice in a row the same way" in log,
          f"{name}: no give-up message:\n{log[-4000:]}")
    check(reason in log, f"{name}: the workers' reason ({reason}) is not in the log")
    starts = log.count("worker group failed to start: ")
    check(starts == 2, f"{name}: {starts} failed starts, want exactly 2")


def test_unused_layers_stop_the_restarts():
    d = model_dir("one-layer", {"num_hidden_layers": 1})
    rc, secs, log = serve(d)
    check_gave_up("one layer over six", rc, log, "is not used by the model")
    check("model.layers.1." in log, "the message names a tensor it does not use")
    print(f"  exited after {secs:.1f} s")


def test_bf16_bytes_under_an_f16_header_stop_the_restarts():
    d = model_dir("relabelled", {"torch_dtype": "bfloat16"}, relabelled_f16())
    rc, _, log = serve(d)
    check_gave_up("F16 header over BF16 bytes", rc, log, 'field "torch_dtype" is "bfloat16"')


if __name__ == "__main__":
    if not HAVE_KJV:
        print("needs models/kjv-tiny")
        raise SystemExit(77)
    try:
        run([test_config_fields_refused_at_start, test_unused_layers_stop_the_restarts,
             test_bf16_bytes_under_an_f16_header_stop_the_restarts])
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
