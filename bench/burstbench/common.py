# Contract: what every module of burst-bench shares and nothing else: the repository root
# (BURST_SOURCE_DIR, else the folder above bench/) and the default SentencePiece model in it,
# the names of burst's per-request server timings, log() (stderr, flushed), and the two records
# that flow between modules: Spec (one request to send, built by workload, given its payload by
# a target's prepare) and Result (one request's outcome, filled by a target's send, read by
# metrics and report).
import os
import sys
from dataclasses import dataclass, field

ROOT = (os.environ.get("BURST_SOURCE_DIR")
        or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT_SPM = os.path.join(ROOT, "models", "kjv-tiny", "tokenizer.model")
SERVER_TIMINGS = ["queue_ms", "prefill_ms", "ttft_ms", "decode_tokens_per_s"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Spec:
    """One request to send: the prompt (token ids or text), its exact length in tokens where we
    know it, the output length, and its group (short / long in a mixed workload)."""
    index: int
    input_len: int | None
    output_len: int
    group: str = "all"
    ids: list | None = None
    text: str | None = None
    payload: object = None  # the pre-built request body (bytes) or protobuf message
    prefix: int | None = None  # prefix-repetition: which shared prefix the prompt starts with


@dataclass
class Result:
    index: int = 0
    group: str = "all"
    success: bool = False
    interrupted: bool = False
    error_kind: str = ""
    error: str = ""
    input_len: int = 0
    server_input_len: int | None = None
    output_len: int = 0
    output_len_req: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list = field(default_factory=list)
    start: float = 0.0  # seconds since the benchmark started
    sent: bool = False
    text: str = ""
    finish_reason: str | None = None
    timings: dict = field(default_factory=dict)
    chunks: int = 0
    cached_tokens: int | None = None  # of the prompt, from the server's prefix cache (usage)
    prefix: int | None = None  # the Spec's
