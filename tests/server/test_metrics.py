"""/metrics beyond the request counters that test_http checks: Prometheus's standard process_*
family (compared with /proc), HTTP errors counted by status, per-request prompt and generation
token histograms, request inference time and inter-token latency under vLLM's names (and the
older time_per_output_token_seconds beside it, which the Grafana dashboard queries), all in an
exposition promtool accepts."""
import json
import os
import re
import shutil
import subprocess
import time

from harness import PROMPT, ROOT, Server, check, run


def samples(text):
    """{(name, labels without model_name): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$", line)
        check(m is not None, f"malformed sample line {line!r}")
        labels = re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", m.group(2) or "")
        labels = labels.replace(",}", "}").replace("{}", "")
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(srv):
    st, data, _ = srv.request("GET", "/metrics")
    check(st == 200, f"/metrics {st}")
    return data.decode(), samples(data.decode())


def test_process_metrics_match_proc():
    t0 = time.time()
    srv = Server(workers=1)
    try:
        text, s = scrape(srv)
        pid = srv.proc.pid
        rss_kb = int(re.search(r"VmRSS:\s+(\d+) kB", open(f"/proc/{pid}/status").read()).group(1))
        rss = s[("process_resident_memory_bytes", "")]
        check(abs(rss - rss_kb * 1024) < 0.2 * rss_kb * 1024 and rss > 1e6,
              f"resident {rss} vs VmRSS {rss_kb} kB")
        start = s[("process_start_time_seconds", "")]
        check(t0 - 2 <= start <= time.time(), f"start time {start} (test began {t0})")
        fds = s[("process_open_fds", "")]
        now = len(os.listdir(f"/proc/{pid}/fd"))
        check(fds > 5 and abs(fds - now) <= 3, f"open fds {fds} vs /proc {now}")
        check(s[("process_max_fds", "")] >= fds, "max fds")
        cpu0 = s[("process_cpu_seconds_total", "")]
        check(cpu0 > 0 and s[("process_virtual_memory_bytes", "")] > rss, f"cpu {cpu0}")
        # Work raises the server's CPU time.
        for _ in range(3):
            srv.json("POST", "/v1/completions", {"prompt": PROMPT * 20, "max_tokens": 16})
        _, s2 = scrape(srv)
        check(s2[("process_cpu_seconds_total", "")] > cpu0, "CPU seconds grow")
        for t in ["process_cpu_seconds_total counter", "process_resident_memory_bytes gauge",
                  "process_open_fds gauge", "process_start_time_seconds gauge"]:
            check(f"# TYPE {t}" in text, f"TYPE {t}")
    finally:
        srv.stop()


def test_request_histograms_and_errors_by_status():
    srv = Server(workers=2)
    try:
        _, before = scrape(srv)
        errors0 = {k[1]: v for k, v in before.items() if k[0] == "burst:http_errors_total"}
        check(errors0 and '{status="404"}' not in errors0 and '{status="400"}' not in errors0,
              f"errors before: {errors0}")
        prompts, completions = [], []
        for n in [3, 7]:
            st, r = srv.json("POST", "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": n, "ignore_eos": True})
            check(st == 200, f"{st} {r}")
            prompts.append(r["usage"]["prompt_tokens"])
            completions.append(r["usage"]["completion_tokens"])
        check(completions == [3, 7], f"completions {completions}")
        st, _, _ = srv.request("GET", "/nope")
        check(st == 404, f"GET /nope {st}")
        for _ in range(2):
            st, _, _ = srv.request("POST", "/v1/completions", "{not json",
                                   {"Content-Type": "application/json"})
            check(st == 400, f"bad JSON {st}")
        srv.wait_kv_released()
        text, s = scrape(srv)
        check(s[("burst:http_errors_total", '{status="404"}')] == 1
              and s[("burst:http_errors_total", '{status="400"}')] == 2,
              f"errors: {[(k, v) for k, v in s.items() if k[0] == 'burst:http_errors_total']}")
        check(s[("burst:request_prompt_tokens_count", "")] == 2
              and s[("burst:request_prompt_tokens_sum", "")] == sum(prompts),
              f"prompt tokens histogram vs usage {prompts}")
        check(s[("burst:request_generation_tokens_count", "")] == 2
              and s[("burst:request_generation_tokens_sum", "")] == 10
              and s[("burst:request_generation_tokens_bucket", '{le="5"}')] == 1
              and s[("burst:request_generation_tokens_bucket", '{le="10"}')] == 2,
              "generation tokens histogram")
        inf = s[("burst:request_inference_time_seconds_sum", "")]
        e2e = s[("burst:e2e_request_latency_seconds_sum", "")]
        check(s[("burst:request_inference_time_seconds_count", "")] == 2 and 0 < inf <= e2e,
              f"inference time {inf} vs e2e {e2e}")
        # Inter-token latency: one observation per token after the first, under both names.
        itl = s[("burst:inter_token_latency_seconds_count", "")]
        check(itl == (3 - 1) + (7 - 1) and
              s[("burst:time_per_output_token_seconds_count", "")] == itl,
              f"inter-token observations {itl}")
        promtool = shutil.which("promtool") or os.path.join(
            ROOT, "build", "third_party", "prometheus", "usr", "bin", "promtool")
        if os.access(promtool, os.X_OK):
            r = subprocess.run([promtool, "check", "metrics"], input=text.encode(),
                               capture_output=True)
            problems = [ln for ln in (r.stdout + r.stderr).decode().splitlines()
                        if ln and not ln.endswith("metric names should not contain ':'")]
            check(r.returncode in (0, 3) and not problems, f"promtool: {problems}")
        else:
            print("note: promtool not found (scripts/setup.sh fetches it): its check is skipped")
        # The Grafana dashboard's metrics are all there.
        dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "burst-dashboard.json")))
        queried = {m for p in dash["panels"] for t in p["targets"]
                   for m in re.findall(r"burst:[a-z0-9_]+", t["expr"])}
        names = {re.sub(r"_(bucket|sum|count)$", "", k[0]) for k in s} | {k[0] for k in s}
        check(queried and queried <= names, f"dashboard queries missing {queried - names}")
    finally:
        srv.stop()


if __name__ == "__main__":
    run([test_process_metrics_match_proc, test_request_histograms_and_errors_by_status])
