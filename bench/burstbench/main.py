# Contract: main(argv=None) is burst-bench: --report combines result files; otherwise one run
# (target, tokenizer, workload, warm-ups, the run, the result JSON, the summary, --plot).
# Exit code: 0, or 1 when no request of a run completed, 130 when interrupted (SIGINT /
# SIGTERM), 2 for a usage error; other fatal errors exit through SystemExit with a message.
import argparse
import asyncio
import json
import os
import random
import sys

from .cli import parse_args, parse_goodput, save_result_path
from .common import log
from .grpc_client import GrpcTarget
from .openai_http import HttpTarget
from .plots import plot
from .report import print_summary, report, result_json
from .runner import StopFlag, install_signals, run_requests
from .tokenizer import choose_tokenizer
from .workload import build_specs


async def main_async(args):
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    goodput = parse_goodput(args.goodput)
    target = GrpcTarget(args) if args.grpc else HttpTarget(args)
    try:
        if args.wait_ready:
            await target.wait_ready(args.wait_ready)
        await target.discover_model()
        chat = target.kind == "http" and target.chat
        text_dataset = args.dataset_name in ("kjv", "text")
        if args.prompt_format == "ids" and chat:
            raise SystemExit("burst-bench: the chat endpoint takes text: --prompt-format text")
        wants_text = chat or args.prompt_format == "text" or (
            text_dataset and args.prompt_format == "auto")
        need_tok = wants_text or text_dataset
        if args.dataset_name == "jsonl":
            try:  # optional: input lengths then come from the server's usage
                tok = await choose_tokenizer(args, target, True)
            except SystemExit as e:
                log(f"{e}; input lengths from the server's usage instead")
                tok = None
        else:
            tok = await choose_tokenizer(args, target, need_tok)
        if text_dataset and not wants_text and (tok is None or tok.sp is None):
            wants_text = True  # ids of a text need a local tokenizer; send the text instead
        total = args.num_warmups + args.num_requests
        log(f"burst-bench: seed {seed}; building {total} prompts ({args.dataset_name}"
            f"{', text' if wants_text else ', token ids'}"
            f"{', tokenizer ' + tok.name if tok else ''})")
        specs = await build_specs(args, rng, tok, wants_text, total)
        for s in specs:
            target.prepare(s)
        warm, specs = specs[:args.num_warmups], specs[args.num_warmups:]
        for i, s in enumerate(specs):
            s.index = i
        loop = asyncio.get_running_loop()
        stop = StopFlag()
        install_signals(loop, stop)
        if warm:
            log(f"burst-bench: {len(warm)} warm-up requests")
            inf_args = argparse.Namespace(**{**vars(args), "request_rate": float("inf")})
            wres, _ = await run_requests(target, warm, inf_args, rng, "warm-ups", stop)
            bad = [r for r in wres if not r.success and not r.interrupted]
            if bad:
                log(f"burst-bench: {len(bad)} warm-up requests failed, e.g. {bad[0].error_kind}:"
                    f" {bad[0].error}")
        results, duration, counters = [], 0.0, None
        if not stop.is_set():
            log(f"burst-bench: {len(specs)} requests to {args.base_url or args.grpc} "
                f"(rate {args.request_rate}, max concurrency {args.max_concurrency})")
            before = await target.prefix_cache_counters()
            results, duration = await run_requests(target, specs, args, rng, "requests", stop)
            if before is not None:
                counters = (before, await target.prefix_cache_counters())
        j = result_json(results, duration, args, goodput, target, tok, seed, stop.is_set(),
                        counters)
    finally:
        await target.close()
    print_summary(j, args)
    if args.ignore_eos:
        short = sum(1 for r in results if r.success and r.output_len < r.output_len_req)
        if short:
            log(f"burst-bench: warning: {short} of {j['completed']} requests ended before "
                "--output-len: the server does not honour ignore_eos")
    mism = [(r.input_len, r.server_input_len) for r in results
            if r.success and r.server_input_len is not None and r.input_len
            and r.server_input_len != r.input_len and not (target.kind == "http" and
                                                           target.chat)]
    if mism:
        log(f"burst-bench: warning: the server counted another prompt length for {len(mism)} "
            f"requests (ours, server's), e.g. {mism[0]}")
    if args.save_result:
        args.result_json = save_result_path(args, j.get("model_id"), j.get("backend"))
    if args.result_json:
        d = os.path.dirname(os.path.abspath(args.result_json))
        os.makedirs(d, exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(j, f)
        log(f"burst-bench: wrote {args.result_json}")
    if args.plot:
        j["_path"] = args.result_json or ""
        for p in plot([j], args.plot):
            log(f"burst-bench: wrote {p}")
    if stop.is_set():
        return 130
    return 0 if j["completed"] > 0 or not results else 1


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.report:
        return report(args.report, args.markdown, args.plot)
    args.metadata = list(args.metadata)
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        log("burst-bench: interrupted before the run started")
        return 130
