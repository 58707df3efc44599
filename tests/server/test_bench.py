"""End-to-end test of burst-bench (build/bin/burst-bench, which runs bench/burst_bench.py)
against real burst-server processes, over the OpenAI-compatible HTTP API and over gRPC:
the result JSON's vLLM fields and their values (every request completed, exact prompt lengths
as the server counted them, output lengths, positive TTFTs, ITLs and TPOTs consistent with the
end-to-end latency), burst's server timings, exact-length text prompts (KJV text and random text
cut with the server's tokenizer), errors counted by kind (400 over the context, 401 wrong key,
503 queue full; gRPC INVALID_ARGUMENT, UNAUTHENTICATED, UNAVAILABLE; connection refused),
Ctrl-C ending a run with partial results, the plots, --report, and the prefix-repetition
workload's prefix cache hit rate (from usage and from /metrics; 0 with --no-prefix-caching),
vLLM bench serve's flag names and max_concurrent_requests, and the tree `cmake --install` lays
out. Run: /usr/bin/python3 test_bench.py --build BUILD_DIR."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from harness import HAVE_KJV, TOKENIZER, Server, build_dir, check, run

KEY = "bench-key"
BENCH = os.path.join(build_dir(), "bin", "burst-bench")
TMP = tempfile.mkdtemp(prefix="burst-bench-test-")
# The fallback model (odd-linear) has 4099 ids; kjv-tiny has 32000.
IDS = "259:4099" if not HAVE_KJV else "259:32000"
VLLM_FIELDS = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput",
               "input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts"]
srv = None
max_len = 0
runs = 0


def bench(*args, expect_rc=0, json_out=True):
    """Runs burst-bench; returns (result json or None, stdout, stderr)."""
    global runs
    runs += 1
    out = os.path.join(TMP, f"run{runs}.json")
    cmd = [BENCH, *[str(a) for a in args], "--no-progress", "--token-id-range", IDS]
    if json_out:
        cmd += ["--result-json", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    check(p.returncode == expect_rc,
          f"rc {p.returncode} (want {expect_rc}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return (json.load(open(out)) if json_out else None), p.stdout, p.stderr


def http_url(s=None):
    return f"http://127.0.0.1:{(s or srv).http_port}"


def grpc_addr(s=None):
    return f"127.0.0.1:{(s or srv).grpc_port}"


def check_run(j, n, lens, out_len):
    for f in VLLM_FIELDS + ["mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
                            "p90_tpot_ms", "mean_itl_ms", "p99_e2el_ms"]:
        check(f in j, f"field {f} missing")
    check(j["completed"] == n and j["failed"] == 0, f"completed {j['completed']}, failed "
          f"{j['failed']}: {j['error_counts']}")
    check(j["input_lens"] == lens, f"input_lens {j['input_lens']} != {lens}")
    check(j["server_input_lens"] == lens, f"server counted {j['server_input_lens']}")
    check(j["output_lens"] == [out_len] * n, f"output_lens {j['output_lens']}")
    check(j["total_input_tokens"] == sum(lens), "total_input_tokens")
    check(j["total_output_tokens"] == n * out_len, "total_output_tokens")
    check(all(t > 0 for t in j["ttfts"]), f"ttfts {j['ttfts']}")
    for t, e, itls, tpot in zip(j["ttfts"], j["e2els"], j["itls"], j["tpots"]):
        check(e >= t and len(itls) <= out_len - 1 and all(g >= 0 for g in itls),
              f"ttft {t} e2el {e} itls {itls}")
        check(abs(tpot - (e - t) / (out_len - 1)) < 1e-9, "tpot = (e2el - ttft) / (out - 1)")
        check(t + sum(itls) <= e + 1e-6, "the chunks arrive before the end")
    check(abs(j["request_throughput"] - n / j["duration"]) < 1e-6, "request_throughput")
    check(abs(j["mean_ttft_ms"] - 1000 * sum(j["ttfts"]) / n) < 1e-6, "mean_ttft_ms")
    check(j["p99_ttft_ms"] <= 1000 * max(j["ttfts"]) + 1e-6, "p99 <= max")
    check(j["errors"] == [""] * n and j["error_counts"] == {}, "no errors")
    # burst's own timings, beside usage (HTTP) or in Finished (gRPC)
    check(all(p is not None and p > 0 for p in j["server_prefill_ms"]), "server prefill_ms")
    check(all(q is not None and q >= 0 for q in j["server_queue_ms"]), "server queue_ms")
    check(all(f == "length" for f in j["finish_reasons"]), f"{j['finish_reasons']}")


def test_http_random_ids_and_plots():
    plots = os.path.join(TMP, "plots")
    j, out, err = bench("--base-url", http_url(), "--api-key", KEY, "--input-lens", "16,40",
                        "--output-len", 6, "--ignore-eos", "--num-requests", 6,
                        "--max-concurrency", 2, "--num-warmups", 1, "--seed", 7,
                        "--plot", plots, "--label", "http", "--goodput", "ttft:60000",
                        "tpot:60000")
    check_run(j, 6, [16, 40] * 3, 6)
    check(j["backend"] == "openai" and j["model_id"] and j["seed"] == 7, "run metadata")
    check(abs(j["request_goodput"] - j["request_throughput"]) < 1e-9, "every request is good")
    check("Serving Benchmark Result" in out and "Mean TTFT (ms)" in out and
          "Mean server prefill (ms)" in out, f"summary:\n{out}")
    for name in ["ttft_vs_prompt_len.png", "ttft_cdf.png", "tokens_per_s.png"]:
        p = os.path.join(plots, name)
        check(os.path.exists(p) and os.path.getsize(p) > 2000, f"{p} missing or empty")
        check(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n", f"{p} is not a PNG")


def test_grpc_random_ids_poisson():
    j, out, _ = bench("--grpc", grpc_addr(), "--api-key", KEY, "--input-len-range", "8:48",
                      "--output-len", 5, "--num-requests", 6, "--request-rate", 20,
                      "--seed", 3, "--goodput", "ttft:0.001")
    check_run(j, 6, j["server_input_lens"], 5)
    check(all(8 <= n <= 48 for n in j["input_lens"]), f"{j['input_lens']}")
    check(j["backend"] == "burst-grpc" and j["request_rate"] == 20, "gRPC run metadata")
    check(j["request_goodput"] == 0, "nobody meets a 1 us TTFT")
    starts = j["start_times"]
    check(starts == sorted(starts) and starts[-1] > 0.01, f"Poisson arrivals: {starts}")


def test_exact_text_prompts():
    """Text cut to exact token counts with the server's tokenizer: the server counts the same."""
    dataset = ["--dataset-name", "kjv"] if shutil.which("bible") else ["--prompt-format", "text"]
    if not HAVE_KJV:
        print("  (skipped: text prompts need kjv-tiny's vocabulary)")
        return
    lens = [24, 64, 160]
    # --ignore-eos: the workload's seed is fresh each run, and a prompt may lead to EOS
    j, _, _ = bench("--base-url", http_url(), "--api-key", KEY, *dataset, "--input-lens",
                    "24,64,160", "--output-len", 4, "--ignore-eos", "--num-requests", 3)
    check_run(j, 3, lens, 4)
    check(j["tokenizer_id"] == "server:/tokenize", f"{j['tokenizer_id']}")
    j, _, _ = bench("--grpc", grpc_addr(), "--api-key", KEY, "--prompt-format", "text",
                    "--input-lens", "24,64,160", "--output-len", 4, "--ignore-eos",
                    "--num-requests", 3)
    check_run(j, 3, lens, 4)
    check(j["tokenizer_id"] == "server:Tokenize", f"{j['tokenizer_id']}")
    # chat: the length is the message's; the server adds the LLaMA-2 template around it
    j, _, _ = bench("--base-url", http_url(), "--api-key", KEY, "--endpoint",
                    "/v1/chat/completions", "--input-len", 32, "--output-len", 4,
                    "--num-requests", 2)
    check(j["completed"] == 2 and j["input_lens"] == [32, 32], f"{j['input_lens']}")
    check(all(s > 32 for s in j["server_input_lens"]), f"{j['server_input_lens']}")


def test_errors_by_kind():
    over = max_len + 100
    # a mixed workload whose long prompts are over the context: 400, the short ones complete
    j, out, _ = bench("--base-url", http_url(), "--api-key", KEY, "--input-len", 16,
                      "--long-fraction", 0.5, "--long-len", over, "--output-len", 3,
                      "--num-requests", 6, "--seed", 1)
    check(j["completed"] == 3 and j["failed"] == 3, f"{j['completed']} / {j['failed']}")
    check(j["error_counts"] == {"HTTP 400": 3}, f"{j['error_counts']}")
    check(sorted(j["groups"]) == ["long"] * 3 + ["short"] * 3, f"{j['groups']}")
    check(j["groups_summary"]["short"]["completed"] == 3, f"{j['groups_summary']}")
    check("HTTP 400:" in out and "Errors by kind" in out, f"{out}")
    bad = [e for e in j["errors"] if e]
    check(len(bad) == 3 and all(e.startswith("HTTP 400: ") for e in bad), f"{bad}")
    j, _, _ = bench("--grpc", grpc_addr(), "--api-key", KEY, "--input-len", 16,
                    "--long-fraction", 0.5, "--long-len", over, "--output-len", 3,
                    "--num-requests", 4, "--seed", 1)
    check(j["error_counts"] == {"gRPC INVALID_ARGUMENT": 2} and j["completed"] == 2,
          f"{j['error_counts']}")
    # a wrong key: every request fails (exit code 1), the run still ends with its results
    j, _, _ = bench("--base-url", http_url(), "--api-key", "wrong", "--input-len", 8,
                    "--output-len", 2, "--num-requests", 3, expect_rc=1)
    check(j["error_counts"] == {"HTTP 401": 3} and j["completed"] == 0, f"{j['error_counts']}")
    j, _, _ = bench("--grpc", grpc_addr(), "--input-len", 8, "--output-len", 2,
                    "--num-requests", 2, expect_rc=1)
    check(j["error_counts"] == {"gRPC UNAUTHENTICATED": 2}, f"{j['error_counts']}")
    # nobody listening
    j, _, _ = bench("--base-url", "http://127.0.0.1:1", "--input-len", 8, "--output-len", 2,
                    "--num-requests", 2, expect_rc=1)
    check(j["error_counts"] == {"connection refused": 2}, f"{j['error_counts']}")


def test_queue_full():
    """A server with a batch of one and no queue (--max-running 1 --max-queue 0): concurrent
    requests beyond the running one get 503 / UNAVAILABLE, counted as such."""
    with Server("--max-queue", 0, "--max-running", 1, workers=1) as s:
        j, _, _ = bench("--base-url", http_url(s), "--input-len", 16, "--output-len", 24,
                        "--num-requests", 5)
        check(j["completed"] >= 1 and j["error_counts"].get("HTTP 503", 0) >= 1 and
              j["completed"] + j["error_counts"]["HTTP 503"] == 5, f"{j['error_counts']}")
        j, _, _ = bench("--grpc", grpc_addr(s), "--input-len", 16, "--output-len", 24,
                        "--num-requests", 5)
        check(j["completed"] >= 1 and j["error_counts"].get("gRPC UNAVAILABLE", 0) >= 1,
              f"{j['error_counts']}")


def test_interrupt_keeps_partial_results():
    out = os.path.join(TMP, "interrupted.json")
    p = subprocess.Popen([BENCH, "--base-url", http_url(), "--api-key", KEY, "--input-len", "16",
                          "--output-len", "400", "--num-requests", "30", "--max-concurrency", "1",
                          "--token-id-range", IDS, "--result-json", out, "--no-progress"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while time.time() < deadline and srv.metric("burst:num_requests_running") == 0:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=30)
    check(p.returncode == 130, f"rc {p.returncode}\n{stdout}\n{stderr}")
    j = json.load(open(out))
    check(j["interrupted_run"] and j["interrupted"] >= 1 and j["completed"] < 30,
          f"{j['completed']} completed, {j['interrupted']} interrupted")
    check(j["error_counts"].get("interrupted") == j["interrupted"], f"{j['error_counts']}")
    check("Serving Benchmark Result" in stdout, "the summary is printed")
    deadline = time.time() + 20
    while time.time() < deadline and srv.metric("burst:num_requests_running") != 0:
        time.sleep(0.1)
    check(srv.metric("burst:num_requests_running") == 0, "the server saw the cancel")


def prefix_repetition_run(s, *extra):
    """P 200, S 20, D 2, 12 prompts: each prefix's 6 full blocks (2 ranks x 16 tokens) are
    cached after its first request."""
    j, out, _ = bench("--base-url", http_url(s), *extra, "--dataset-name", "prefix-repetition",
                      "--prefix-repetition-prefix-len", 200, "--prefix-repetition-suffix-len", 20,
                      "--prefix-repetition-num-prefixes", 2, "--prefix-repetition-output-len", 3,
                      "--ignore-eos", "--num-prompts", 12, "--max-concurrency", 2,
                      "--request-rate", 200, "--seed", 5, "--goodput", "ttft:60000")
    check_run(j, 12, [220] * 12, 3)
    check(sorted(j["prefixes"]) == [0] * 6 + [1] * 6, f"prefixes {j['prefixes']}")
    check(j["request_goodput"] is not None and j["request_goodput"] > 0, "goodput")
    check("Prefix cache hit rate (%):" in out and "Request goodput" in out, f"summary:\n{out}")
    cached = j["cached_tokens"]
    check(all(c is not None for c in cached), f"cached_tokens {cached}")
    check(j["total_cached_tokens"] == sum(cached), "total_cached_tokens")
    check(j["prefix_cache_hit_rate"] == sum(cached) / sum(j["server_input_lens"]),
          f"hit rate {j['prefix_cache_hit_rate']} != {sum(cached)} / "
          f"{sum(j['server_input_lens'])}")
    check(j["server_prefix_cache_hits"] == sum(cached), f"/metrics hits "
          f"{j['server_prefix_cache_hits']} != usage {sum(cached)}")
    return j


def test_prefix_repetition():
    j = prefix_repetition_run(srv, "--api-key", KEY)
    check(j["prefix_cache_hit_rate"] > 0.5,
          f"hit rate {j['prefix_cache_hit_rate']}: {j['cached_tokens']}")
    check(j["server_prefix_cache_hit_rate"] is not None and
          j["server_prefix_cache_hit_rate"] > 0.5, f"{j['server_prefix_cache_hit_rate']}")
    with Server("--no-prefix-caching") as s:
        j = prefix_repetition_run(s)
        check(j["prefix_cache_hit_rate"] == 0 and j["cached_tokens"] == [0] * 12,
              f"no prefix caching: {j['prefix_cache_hit_rate']}, {j['cached_tokens']}")


def test_vllm_flags():
    """vLLM bench serve's command line runs unchanged but for the server's address: --backend,
    --host / --port, --random-input-len / -output-len / -range-ratio, --num-prompts,
    --max-concurrency, --save-result with --result-dir / --result-filename, --disable-tqdm,
    --percentile-metrics, --tokenizer as a Hugging Face id or a model directory; the JSON has vLLM's max_concurrency and max_concurrent_requests (the
    most requests in flight at once, measured)."""
    out_dir = os.path.join(TMP, "vllm-results")
    _, out, _ = bench("--backend", "openai", "--host", "127.0.0.1", "--port", srv.http_port,
                      "--api-key", KEY, "--dataset-name", "random", "--random-input-len", 20,
                      "--random-output-len", 4, "--ignore-eos", "--num-prompts", 6,
                      "--max-concurrency", 2, "--request-rate", "inf", "--seed", 11,
                      "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "90,99",
                      "--save-result", "--result-dir", out_dir, "--result-filename", "vllm.json",
                      "--disable-tqdm", "--trust-remote-code",
                      "--tokenizer", "meta-llama/Llama-2-7b-chat-hf", json_out=False)
    j = json.load(open(os.path.join(out_dir, "vllm.json")))
    check_run(j, 6, [20] * 6, 4)
    check(j["endpoint"] == "/v1/completions" and j["base_url"] == http_url(), f"{j['base_url']}")
    check(j["max_concurrency"] == 2 and j["max_concurrent_requests"] == 2,
          f"max_concurrency {j['max_concurrency']}, max_concurrent_requests "
          f"{j['max_concurrent_requests']}")
    check("Maximum request concurrency:" in out and "Peak concurrent requests:" in out, out)
    # Without a limit the six are in flight at once.
    j, _, _ = bench("--base-url", http_url(), "--api-key", KEY, "--random-input-len", 12,
                    "--random-output-len", 6, "--ignore-eos", "--num-prompts", 6)
    check(j["max_concurrency"] is None and j["max_concurrent_requests"] == 6,
          f"{j['max_concurrent_requests']} at once")
    # vLLM's file name: BACKEND-RATEqps-MODEL-DATE.json; --tokenizer a model's directory
    bench("--backend", "vllm", "--base-url", http_url(), "--api-key", KEY,
          "--random-input-len", 8, "--random-output-len", 2, "--num-prompts", 2, "--save-result",
          "--result-dir", out_dir, "--tokenizer", os.path.dirname(TOKENIZER), json_out=False)
    names = sorted(n for n in os.listdir(out_dir) if n != "vllm.json")
    check(len(names) == 1 and names[0].startswith("vllm-infqps-") and names[0].endswith(".json"),
          f"{names}")
    j = json.load(open(os.path.join(out_dir, names[0])))
    check(j["tokenizer_id"] == "sentencepiece:" + TOKENIZER, f"tokenizer {j['tokenizer_id']}")
    # --random-range-ratio: lengths uniform in [L(1 - R), L(1 + R)]
    j, _, _ = bench("--base-url", http_url(), "--api-key", KEY, "--random-input-len", 40,
                    "--random-range-ratio", 0.5, "--random-output-len", 2, "--ignore-eos",
                    "--num-prompts", 8, "--seed", 4)
    check(j["input_len_range"] == [20, 60] and all(20 <= n <= 60 for n in j["input_lens"])
          and len(set(j["input_lens"])) > 1, f"{j['input_lens']}")
    # Disagreeing or unsupported flags: usage errors naming them
    _, _, err = bench("--base-url", http_url(), "--input-len", 10, "--random-input-len", 20,
                      expect_rc=2, json_out=False)
    check("--input-len and its vLLM alias disagree" in err, err)
    _, _, err = bench("--base-url", http_url(), "--random-prefix-len", 5, expect_rc=2,
                      json_out=False)
    check("--random-prefix-len is not supported" in err, err)


def test_installed():
    """cmake --install lays burst-bench out (bin/burst-bench, share/burst/bench) and the
    installed launcher runs the installed script, not the source tree's."""
    prefix = os.path.join(TMP, "install")
    p = subprocess.run(["cmake", "--install", build_dir(), "--prefix", prefix],
                       capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, p.stdout + p.stderr)
    exe = os.path.join(prefix, "bin", "burst-bench")
    script = os.path.join(prefix, "share", "burst", "bench", "burst_bench.py")
    check(os.access(exe, os.X_OK) and os.path.exists(script) and
          os.path.exists(os.path.join(prefix, "share", "burst", "bench", "burstbench", "cli.py")),
          f"installed: {sorted(os.listdir(prefix))}")
    # An interpreter that prints the script it is given: the installed one.
    echo = os.path.join(TMP, "echo-python")
    with open(echo, "w") as f:
        f.write("#!/bin/sh\necho \"$1\"\n")
    os.chmod(echo, 0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("BURST_BENCH_SCRIPT",
                                                             "BURST_SOURCE_DIR")}
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60,
                       env=dict(env, BURST_PYTHON=echo))
    check(os.path.realpath(p.stdout.strip()) == os.path.realpath(
        os.path.join(prefix, "bin", "..", "share", "burst", "bench", "burst_bench.py")),
          f"the installed launcher ran {p.stdout.strip()!r}")
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60, env=env)
    check(p.returncode == 0 and "vLLM bench serve's flags" in p.stdout, p.stdout + p.stderr)


def test_report():
    files = sorted(os.path.join(TMP, f) for f in os.listdir(TMP) if f.startswith("run"))[:3]
    md = os.path.join(TMP, "table.md")
    plots = os.path.join(TMP, "report-plots")
    p = subprocess.run([BENCH, "--report", *files, "--markdown", md, "--plot", plots],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, p.stderr)
    rows = [line for line in open(md).read().splitlines() if line.startswith("|")]
    check(len(rows) == 2 + len(files) and "TTFT mean ms" in rows[0], f"{rows}")
    check(os.path.exists(os.path.join(plots, "ttft_cdf.png")), "report plot")


if __name__ == "__main__":
    if not os.path.exists(BENCH):
        print(f"no {BENCH}: build the burst-bench target")
        sys.exit(1)
    srv = Server("--api-key", KEY)
    st, models = srv.json("GET", "/v1/models", None, {"Authorization": "Bearer " + KEY})
    max_len = models["data"][0]["max_model_len"]
    try:
        run([test_http_random_ids_and_plots, test_grpc_random_ids_poisson,
             test_exact_text_prompts, test_errors_by_kind, test_queue_full,
             test_interrupt_keeps_partial_results, test_prefix_repetition, test_vllm_flags,
             test_installed, test_report])
    finally:
        srv.stop()
        shutil.rmtree(TMP, ignore_errors=True)
