# burstbench: the package behind burst-bench (bench/burst_bench.py is its entry script). This
# docstring is the tool's description: parse_args (cli.py) prints all of it after its first
# paragraph as --help's epilog, so it changes only with the tool. Modules, one concern each:
#   common      shared paths and names, log(), the Spec (request) and Result records
#   cli         the command line: flags, defaults, checks, value parsers
#   tokenizer   counting tokens (the target's or SentencePiece), exact-length prefixes
#   workload    the prompts of a run: random ids or text, KJV / text file, JSONL, shared
#               prefixes (prefix-repetition)
#   httpwire    HTTP/1.1 over asyncio streams: keep-alive pool, chunked bodies
#   openai_http the OpenAI-compatible target (/v1/completions, chat, SSE streaming)
#   grpc_client the burst.v1.Burst gRPC target
#   runner      the run: arrivals, concurrency limit, progress, Ctrl-C
#   metrics     percentiles, TTFT / TPOT / ITL / E2EL statistics, goodput, groups
#   report      the result JSON, the printed summary, the markdown table, --report
#   plots       the PNG plots (matplotlib)
#   main        main(): the report or a run, wired together; its exit code
"""burst-bench: a load generator for burst's gRPC API and any OpenAI-compatible HTTP server
(burst, vLLM, SGLang), so that one workload runs against each of them.

    burst-bench --base-url http://127.0.0.1:8080 --input-len 1024 --output-len 128 \\
        --num-requests 100 --request-rate 4 --result-json out.json --plot plots/
    burst-bench --grpc 127.0.0.1:50051 --input-lens 4K,16K --output-len 32 --ignore-eos
    burst-bench --base-url http://127.0.0.1:8080 --dataset-name prefix-repetition \\
        --prefix-repetition-prefix-len 2K --prefix-repetition-suffix-len 128 \\
        --prefix-repetition-num-prefixes 4 --num-prompts 64 --request-rate 2
    burst-bench --report a.json b.json --markdown table.md --plot plots/   # combine results

Python standard library only (asyncio streams for HTTP and SSE), run by /usr/bin/python3;
grpcio (Debian python3-grpcio) only for --grpc, SentencePiece only for a local --tokenizer,
matplotlib only for --plot: each is imported when it is needed.

Metrics follow vLLM's `bench serve`, with two precisions where a server may stream chunks that
carry no text (burst's chat role chunk is sent before the prefill):
  TTFT  = from the request being sent to the first streamed chunk whose text is not empty;
  ITL   = the gaps between successive chunks with text;
  E2EL  = from the request being sent to the end of the stream;
  TPOT  = (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
  output tokens = usage.completion_tokens when the server reports it (we ask with
  stream_options.include_usage), else the number of chunks with text.
Field names of --result-json are vLLM's (completed, failed, duration, total_input_tokens, ...,
mean_/median_/std_/pNN_ of ttft_ms, tpot_ms, itl_ms, e2el_ms, input_lens, output_lens, ttfts,
itls, errors), plus burst's per-request server timings (server_queue_ms, server_prefill_ms,
server_ttft_ms, server_decode_tokens_per_s) where the server reports them, and the prefix
cache: prefix_cache_hit_rate = the completed requests' usage.prompt_tokens_details.cached_tokens
(0 where not reported) over their prompt tokens, per request cached_tokens, and
server_prefix_cache_hit_rate from the server's /metrics counters (burst: or vllm:
prefix_cache_hits_total / prefix_cache_queries_total) over the run, where it has them.
"""
