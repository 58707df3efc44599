"""TTFT through burst-server's OpenAI-compatible HTTP API, measured by the client.

    python3 bench/gpu/server_ttft.py PORTS_JSON N [N ...]

Waits for the server's port file and /health, then for each N streams one /v1/completions
request whose prompt is N token ids (BOS, then the ids burst-generate --prompt-tokens uses),
max_tokens 8, greedy, and prints the client-side time to the first streamed token, the total,
and the server's own timings from the usage chunk.
"""
import sys

from gpu_client import splitmix64, stream_completion, wait_ready

def main():
    ports_file, sizes = sys.argv[1], [int(x) for x in sys.argv[2:]]
    port = wait_ready(ports_file, timeout=600)
    for n in sizes:
        prompt = [1] + [259 + splitmix64(i) % 31741 for i in range(1, n)]
        try:
            ttft, total, final = stream_completion(port, prompt, 8)
        except RuntimeError as e:
            print(f"{n} tokens: {e}", flush=True)
            continue
        print(f"{n} tokens: client TTFT {ttft:.2f} s, total {total:.2f} s, "
              f"usage {final.get('usage')}, timings {final.get('timings')}", flush=True)


if __name__ == "__main__":
    main()
