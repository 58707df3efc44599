#!/usr/bin/python3
"""burst-bench: a load generator for burst's gRPC API and any OpenAI-compatible HTTP server
(burst, vLLM, SGLang), so that one workload runs against each of them.

    burst-bench --base-url http://127.0.0.1:8080 --input-len 1024 --output-len 128 \\
        --num-requests 100 --request-rate 4 --result-json out.json --plot plots/
    burst-bench --grpc 127.0.0.1:50051 --input-lens 4K,16K --output-len 32 --ignore-eos
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
server_ttft_ms, server_decode_tokens_per_s) where the server reports them.
"""
import argparse
import asyncio
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("BURST_SOURCE_DIR") or os.path.dirname(HERE)
DEFAULT_SPM = os.path.join(ROOT, "models", "kjv-tiny", "tokenizer.model")
# What burst's HTTP API puts in an in-stream error's "type", back to the status it stands for.
ERROR_TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                     "not_found_error": 404, "request_too_large": 413,
                     "service_unavailable": 503, "server_error": 500}
METRICS = ["ttft", "tpot", "itl", "e2el"]
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
SERVER_TIMINGS = ["queue_ms", "prefill_ms", "ttft_ms", "decode_tokens_per_s"]
WORDS = ("the and of to in that he shall unto for i his a lord they be is him not them it with "
         "all thou was god which my me said but ye their have will thee from as are when this "
         "out were by upon man people king house day hand land son children come went there "
         "one up came israel before then made also say against into earth").split()


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------

def parse_count(s):
    """'4096', '4K', '4k' (x1024), '1M' (x1048576) -> int."""
    s = str(s).strip()
    mult = 1
    if s[-1:] in ("k", "K"):
        mult, s = 1024, s[:-1]
    elif s[-1:] in ("m", "M"):
        mult, s = 1024 * 1024, s[:-1]
    v = int(float(s) * mult)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: must be > 0")
    return v


def parse_range(s):
    lo, _, hi = s.partition(":")
    if not hi:
        raise argparse.ArgumentTypeError(f"{s!r}: expected LO:HI")
    lo, hi = parse_count(lo), parse_count(hi)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"{s!r}: LO > HI")
    return lo, hi


def parse_list(s):
    return [parse_count(x) for x in s.split(",") if x.strip()]


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


class Tokenizer:
    """Counts tokens the way the target counts them (its /tokenize endpoint or gRPC Tokenize,
    BOS included), or with a local SentencePiece model; decodes only with a local model."""

    def __init__(self, count_fn, sp=None, name=""):
        self._count = count_fn
        self.sp = sp
        self.name = name

    async def count(self, text):
        return await self._count(text)

    def decode(self, ids):
        return self.sp.decode([i for i in ids if i > 2]) if self.sp else None


def load_spm(path):
    try:
        import sentencepiece
    except ImportError:
        return None
    if not path or not os.path.exists(path):
        return None
    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(path)
    return sp


def spm_tokenizer(sp, path):
    bos = 1 if sp.bos_id() >= 0 else 0

    async def count(text):
        return len(sp.encode(text)) + bos

    return Tokenizer(count, sp, f"sentencepiece:{path}")


async def fit_prefix(tok, source, n):
    """The prefix of `source` that tokenizes (BOS included) to exactly n tokens, or None when
    no prefix does (a character that adds two tokens at once) or the source is too short.
    Interpolation search on the prefix length in characters: the count grows about linearly."""
    lo, lo_m = 0, 1
    hi, hi_m = None, None
    c = min(len(source), max(1, n * 4))
    for _ in range(60):
        m = await tok.count(source[:c])
        if m == n:
            return source[:c]
        if m < n:
            lo, lo_m = c, m
        else:
            hi, hi_m = c, m
        if hi is None:
            if c >= len(source):
                return None
            c = min(len(source), max(c + 1, int(c * (n / max(m, 1)) * 1.02) + 1))
        else:
            if hi - lo <= 1:
                return None
            guess = lo + int((hi - lo) * (n - lo_m) / max(hi_m - lo_m, 1))
            mid = (lo + hi) // 2
            # Interpolate, but step towards the middle when the bracket shrinks slowly.
            c = min(hi - 1, max(lo + 1, guess if hi - lo > 64 else mid))
    return None


def kjv_corpus():
    """The King James Bible from Debian's bible-kjv (`bible`), one verse per line, the verse
    numbers dropped (as scripts/train_tiny_model.py reads it)."""
    try:
        out = subprocess.run(["bible", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit("burst-bench: --dataset-name kjv needs the `bible` command (Debian "
                         f"package bible-kjv) or use --dataset-name text --dataset-path FILE: {e}")
    verses = []
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
        elif line.startswith(" ") or not re.match(r"^\S.* \d+$", line):
            if verses:
                verses[-1] += " " + line.strip()
        else:
            verses.append("")  # a chapter heading: a blank line between chapters
    return "\n".join(verses)


def input_lengths(args, rng, n):
    """The requested input length of each of n requests and its group."""
    if args.input_lens:
        base = [args.input_lens[i % len(args.input_lens)] for i in range(n)]
    elif args.input_len_range:
        lo, hi = args.input_len_range
        base = [rng.randint(lo, hi) for _ in range(n)]
    else:
        base = [args.input_len] * n
    groups = ["all"] * n
    if args.long_fraction > 0:
        k = round(args.long_fraction * n)
        if args.long_fraction > 0 and k == 0 and n > 0:
            k = 1
        longs = set(rng.sample(range(n), k))
        groups = ["long" if i in longs else "short" for i in range(n)]
        base = [args.long_len if i in longs else base[i] for i in range(n)]
    return base, groups


def random_ids(rng, n, args):
    lo, hi = args.token_id_range
    body = rng.choices(range(lo, hi), k=n - (1 if args.bos_id >= 0 else 0))
    return ([args.bos_id] if args.bos_id >= 0 else []) + body


async def random_text(rng, n, args, tok):
    """Random text of exactly n tokens: random ids decoded with a local tokenizer when there is
    one, else random common words; cut to the exact count with the tokenizer."""
    for _ in range(8):
        if tok.sp is not None:
            source = tok.decode(random_ids(rng, n * 2 + 16, args))
        else:
            source = " ".join(rng.choice(WORDS) for _ in range(n * 2 + 16))
        text = await fit_prefix(tok, source, n)
        if text is not None:
            return text
    raise SystemExit(f"burst-bench: could not build random text of exactly {n} tokens")


async def corpus_text(rng, n, corpus, tok):
    """A slice of the corpus, from a random offset (wrapping around), of exactly n tokens."""
    need = n * 8 + 64
    for _ in range(8):
        start = rng.randrange(len(corpus))
        source = corpus[start:start + need]
        while len(source) < need:
            source += "\n" + corpus[:need - len(source)]
        text = await fit_prefix(tok, source.lstrip(), n)
        if text is not None:
            return text
    raise SystemExit(f"burst-bench: could not cut the corpus to exactly {n} tokens")


async def build_specs(args, rng, tok, wants_text, total):
    """The requests of the run (warm-ups first)."""
    specs = []
    if args.dataset_name == "jsonl":
        rows = []
        with open(args.dataset_path) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"burst-bench: {args.dataset_path}:{line_no}: {e}")
        if not rows:
            raise SystemExit(f"burst-bench: {args.dataset_path} has no prompts")
        for i in range(total):
            row = rows[i % len(rows)]
            prompt = row.get("prompt", row.get("text"))
            out_len = int(row.get("output_len", row.get("max_tokens", args.output_len)))
            if isinstance(prompt, list):
                if wants_text:
                    raise SystemExit("burst-bench: token-id prompts need --endpoint "
                                     "/v1/completions or --grpc")
                specs.append(Spec(i, len(prompt), out_len, "all", ids=prompt))
            elif isinstance(prompt, str):
                n = await tok.count(prompt) if tok else None
                specs.append(Spec(i, n, out_len, "all", text=prompt))
            else:
                raise SystemExit(f"burst-bench: {args.dataset_path}: each line needs a "
                                 "\"prompt\" (a string or a list of token ids)")
        return specs
    lens, groups = input_lengths(args, rng, args.num_requests)
    if args.num_warmups:  # warm-ups take the run's first lengths, so the run's pattern holds
        lens = [lens[i % len(lens)] if lens else args.input_len
                for i in range(args.num_warmups)] + lens
        groups = ["warmup"] * args.num_warmups + groups
    corpus = None
    if args.dataset_name == "kjv":
        corpus = kjv_corpus()
    elif args.dataset_name == "text":
        with open(args.dataset_path, encoding="utf-8", errors="replace") as f:
            corpus = f.read()
    for i, (n, g) in enumerate(zip(lens, groups)):
        if corpus is not None:
            text = await corpus_text(rng, n, corpus, tok)
            if not wants_text and args.prompt_format == "ids" and tok.sp is not None:
                ids = tok.sp.encode(text)
                specs.append(Spec(i, n, args.output_len, g, ids=[1] + ids))
            else:
                specs.append(Spec(i, n, args.output_len, g, text=text))
        elif wants_text:
            specs.append(Spec(i, n, args.output_len, g, text=await random_text(rng, n, args, tok)))
        else:
            specs.append(Spec(i, n, args.output_len, g, ids=random_ids(rng, n, args)))
        if total >= 20 and (i + 1) % max(1, total // 10) == 0 and not args.no_progress:
            log(f"burst-bench: built {i + 1}/{total} prompts")
    return specs


# ---------------------------------------------------------------------------------------------
# HTTP (OpenAI-compatible) target: asyncio streams, HTTP/1.1 keep-alive, chunked SSE
# ---------------------------------------------------------------------------------------------

class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Conn:
    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def close(self):
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a broken socket must not raise
            pass


class HttpTarget:
    kind = "http"

    def __init__(self, args):
        u = urllib.parse.urlsplit(args.base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise SystemExit(f"burst-bench: --base-url {args.base_url!r}: expected "
                             "http://HOST:PORT or https://HOST[:PORT]")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        self.host_header = u.netloc
        self.endpoint = args.endpoint
        self.chat = "chat" in args.endpoint
        self.api_key = args.api_key
        self.model = args.model
        self.args = args
        self.idle = []
        self.backend = "openai-chat" if self.chat else "openai"

    async def _connect(self):
        r, w = await asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                             limit=1 << 24)
        return Conn(r, w)

    def _head(self, method, path, body, stream):
        h = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}",
             "User-Agent: burst-bench", "Connection: keep-alive"]
        if body is not None:
            h += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        if stream:
            h.append("Accept: text/event-stream")
        if self.api_key:
            h.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(h) + "\r\n\r\n").encode()

    # Servers close idle keep-alive connections after a few seconds (burst: 5 s): older ones are
    # not reused, since a request sent as the server closes is lost.
    IDLE_REUSE_S = 3.0

    def _take_idle(self):
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since < self.IDLE_REUSE_S and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def _exchange(self, method, path, body=None, stream=False):
        """Sends one request; returns (conn, status, headers). A kept-alive connection the
        server has closed meanwhile is replaced once, by a fresh connection (another idle one
        may have been closed by the server just the same)."""
        data = self._head(method, path, body, stream) + (body or b"")
        for attempt in range(2):
            conn = self._take_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(data)
                await conn.writer.drain()
                line = await conn.reader.readline()
                if not line:
                    raise ConnectionResetError("the server closed the connection")
            except (OSError, asyncio.IncompleteReadError) as e:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise ConnectionError(str(e) or type(e).__name__) from e
            except BaseException:
                conn.close()
                raise
            parts = line.decode("latin-1").split(" ", 2)
            try:
                status = int(parts[1])
            except (IndexError, ValueError):
                conn.close()
                raise ConnectionError(f"not an HTTP response: {line[:80]!r}")
            headers = {}
            while True:
                hl = await conn.reader.readline()
                if hl in (b"\r\n", b"\n", b""):
                    break
                k, _, v = hl.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            conn.keep = (headers.get("connection", "").lower() != "close"
                         and parts[0].upper() == "HTTP/1.1")
            return conn, status, headers
        raise ConnectionError("unreachable")

    async def _body(self, conn, headers):
        """Yields the body's bytes as they arrive (chunked, sized, or until close)."""
        r = conn.reader
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                line = await r.readline()
                if not line:
                    raise ConnectionError("the connection closed in the middle of the body")
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    return
                yield await r.readexactly(size)
                await r.readexactly(2)
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                piece = await r.read(min(left, 1 << 16))
                if not piece:
                    raise ConnectionError("the connection closed in the middle of the body")
                left -= len(piece)
                yield piece
        else:
            conn.keep = False
            while True:
                piece = await r.read(1 << 16)
                if not piece:
                    return
                yield piece

    def _release(self, conn):
        if getattr(conn, "keep", False) and not conn.reader.at_eof():
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    async def request_json(self, method, path, obj=None):
        body = json.dumps(obj).encode() if obj is not None else None
        conn, status, headers = await self._exchange(method, path, body)
        try:
            data = b"".join([p async for p in self._body(conn, headers)])
        except BaseException:
            conn.close()
            raise
        self._release(conn)
        try:
            return status, json.loads(data) if data else None
        except json.JSONDecodeError:
            return status, data.decode(errors="replace")

    async def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                status, _ = await self.request_json("GET", "/health")
                if status == 200:
                    return
                last = f"HTTP {status}"
            except (OSError, ConnectionError) as e:
                last = str(e)
            self.idle.clear()
            await asyncio.sleep(0.5)
        raise SystemExit(f"burst-bench: {self.host}:{self.port} not ready after {timeout} s "
                         f"({last})")

    async def discover_model(self):
        if self.model:
            return
        try:
            status, j = await self.request_json("GET", "/v1/models")
            if status == 200 and isinstance(j, dict) and j.get("data"):
                self.model = j["data"][0].get("id")
        except (OSError, ConnectionError):
            pass

    async def server_tokenizer(self):
        async def count(text):
            body = {"prompt": text}
            if self.model:
                body["model"] = self.model
            status, j = await self.request_json("POST", "/tokenize", body)
            if status != 200 or not isinstance(j, dict):
                raise RuntimeError(f"/tokenize: HTTP {status}: {str(j)[:200]}")
            return int(j["count"]) if "count" in j else len(j["tokens"])

        try:
            await count("Hello")
        except (OSError, ConnectionError, RuntimeError, KeyError, ValueError):
            return None
        return Tokenizer(count, None, "server:/tokenize")

    def prepare(self, spec):
        a = self.args
        body = {"max_tokens": spec.output_len, "temperature": a.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": spec.text}]
        else:
            body["prompt"] = spec.ids if spec.ids is not None else spec.text
        if self.model:
            body["model"] = self.model
        if a.top_p is not None:
            body["top_p"] = a.top_p
        if a.top_k is not None:
            body["top_k"] = a.top_k
        if a.ignore_eos:
            body["ignore_eos"] = True
        body.update(a.extra_body)
        spec.payload = json.dumps(body, separators=(",", ":")).encode()

    async def send(self, spec, res, t0):
        st = time.perf_counter()
        res.start, res.sent = st - t0, True
        last = st
        conn = None
        try:
            conn, status, headers = await self._exchange("POST", self.endpoint, spec.payload,
                                                         stream=True)
            if status != 200:
                data = b"".join([p async for p in self._body(conn, headers)])
                self._release(conn)
                conn = None
                raise HttpError(status, error_message(data))
            ctype = headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                data = b"".join([p async for p in self._body(conn, headers)])
                self._release(conn)
                conn = None
                self._whole_response(json.loads(data), res, st)
                return
            event, lines, buf, done = None, [], b"", False
            async for piece in self._body(conn, headers):
                buf += piece
                while not done:
                    i = buf.find(b"\n")
                    if i < 0:
                        break
                    line, buf = buf[:i].rstrip(b"\r").decode(errors="replace"), buf[i + 1:]
                    if line.startswith(":"):
                        continue
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        lines.append(line[5:].lstrip())
                    elif line == "" and lines:
                        data, name = "\n".join(lines), event
                        event, lines = None, []
                        if name not in (None, "", "message"):
                            continue  # burst's progress events and the like
                        if data.strip() == "[DONE]":
                            done = True
                            res.e2el = time.perf_counter() - st
                            break
                        now = time.perf_counter()
                        if self._chunk(json.loads(data), res, st, now, last):
                            last = now
            if not done:
                res.e2el = time.perf_counter() - st
            self._release(conn)
            conn = None
            if not res.error_kind:
                if not done and res.finish_reason is None:
                    raise HttpError(None, "the stream ended without [DONE]")
                if res.chunks == 0:
                    res.ttft = res.e2el  # nothing but the end: the whole latency
                if not res.output_len:
                    res.output_len = res.chunks
                res.success = True
        finally:
            if conn is not None:
                conn.close()

    def _chunk(self, j, res, st, now, last):
        """One SSE data object; True when it carried text (a token chunk)."""
        if "error" in j and j["error"]:
            e = j["error"]
            e = e if isinstance(e, dict) else {"message": str(e)}
            code = e.get("code")
            status = code if isinstance(code, int) else ERROR_TYPE_STATUS.get(e.get("type"))
            res.error_kind = f"HTTP {status} (in stream)" if status else "error in stream"
            res.error = str(e.get("message", e))[:300]
            return False
        got_text = False
        choices = j.get("choices") or []
        if choices:
            c = choices[0]
            text = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if text:
                got_text = True
                res.text += text
                res.chunks += 1
                if res.chunks == 1:
                    res.ttft = now - st
                else:
                    res.itls.append(now - last)
            if c.get("finish_reason"):
                res.finish_reason = c["finish_reason"]
        if j.get("usage"):
            u = j["usage"]
            res.output_len = int(u.get("completion_tokens") or 0)
            if u.get("prompt_tokens") is not None:
                res.server_input_len = int(u["prompt_tokens"])
        if isinstance(j.get("timings"), dict):
            res.timings = {k: j["timings"].get(k) for k in SERVER_TIMINGS}
        return got_text

    def _whole_response(self, j, res, st):
        """A server that ignored stream: true. TTFT is then the whole latency."""
        if not isinstance(j, dict) or not j.get("choices"):
            raise HttpError(200, f"unexpected response: {str(j)[:200]}")
        res.e2el = res.ttft = time.perf_counter() - st
        c = j["choices"][0]
        res.text = (c.get("message") or {}).get("content") or c.get("text") or ""
        res.finish_reason = c.get("finish_reason")
        u = j.get("usage") or {}
        res.output_len = int(u.get("completion_tokens") or 0) or (1 if res.text else 0)
        res.server_input_len = u.get("prompt_tokens")
        if isinstance(j.get("timings"), dict):
            res.timings = {k: j["timings"].get(k) for k in SERVER_TIMINGS}
        res.chunks = 1
        res.success = True

    def classify(self, e):
        if isinstance(e, HttpError):
            return (f"HTTP {e.status}" if e.status else "bad stream"), str(e)
        if isinstance(e, ConnectionRefusedError):
            return "connection refused", str(e)
        if isinstance(e, (ConnectionError, OSError, asyncio.IncompleteReadError)):
            return "connection error", str(e) or type(e).__name__
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError, ValueError)):
            return "bad response", str(e)
        return None

    async def close(self):
        for c in self.idle:
            c.close()
        self.idle.clear()


def error_message(data):
    try:
        j = json.loads(data)
        e = j.get("error", j) if isinstance(j, dict) else j
        if isinstance(e, dict):
            return str(e.get("message") or e.get("detail") or e)[:300]
        return str(e)[:300]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data[:300].decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# gRPC target (burst.v1.Burst), grpcio imported only here
# ---------------------------------------------------------------------------------------------

def load_grpc_modules(proto_dir):
    try:
        import grpc
        import grpc.aio  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"burst-bench: --grpc needs grpcio (Debian python3-grpcio): {e}; "
                         "use --base-url for the HTTP API")
    proto = os.path.join(proto_dir, "burst", "v1", "burst.proto")
    if not os.path.exists(proto):
        raise SystemExit(f"burst-bench: no {proto} (set --proto-dir or BURST_SOURCE_DIR)")
    out = tempfile.mkdtemp(prefix="burst-bench-pb-")
    import atexit
    atexit.register(shutil.rmtree, out, True)
    plugin = shutil.which("grpc_python_plugin") or "/usr/bin/grpc_python_plugin"
    if shutil.which("protoc") and os.path.exists(plugin):
        cmd = ["protoc", f"--proto_path={proto_dir}", f"--python_out={out}",
               f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={plugin}", "burst/v1/burst.proto"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"burst-bench: protoc failed: {r.stderr}")
    else:
        try:
            from grpc_tools import protoc
        except ImportError:
            raise SystemExit("burst-bench: --grpc needs protoc and grpc_python_plugin (Debian "
                             "protobuf-compiler-grpc) or grpc_tools (python3-grpc-tools)")
        if protoc.main(["protoc", f"--proto_path={proto_dir}", f"--python_out={out}",
                        f"--grpc_python_out={out}", "burst/v1/burst.proto"]) != 0:
            raise SystemExit("burst-bench: grpc_tools.protoc failed")
    sys.path.insert(0, out)
    import importlib
    pb2 = importlib.import_module("burst.v1.burst_pb2")
    pb2_grpc = importlib.import_module("burst.v1.burst_pb2_grpc")
    return grpc, pb2, pb2_grpc


class GrpcTarget:
    kind = "grpc"
    backend = "burst-grpc"

    def __init__(self, args):
        self.grpc, self.pb2, self.pb2_grpc = load_grpc_modules(args.proto_dir)
        self.addr = args.grpc
        self.args = args
        self.md = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
        self.model = args.model
        self.channel = None
        self.stub = None

    def _stub(self):
        if self.stub is None:
            opts = [("grpc.max_send_message_length", 1 << 30),
                    ("grpc.max_receive_message_length", 1 << 30)]
            self.channel = self.grpc.aio.insecure_channel(self.addr, options=opts)
            self.stub = self.pb2_grpc.BurstStub(self.channel)
        return self.stub

    async def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                await self._stub().ModelInfo(self.pb2.ModelInfoRequest(), metadata=self.md,
                                             timeout=5)
                return
            except self.grpc.aio.AioRpcError as e:
                if e.code() == self.grpc.StatusCode.UNAUTHENTICATED:
                    return  # up; the run will report the key
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(0.5)
        raise SystemExit(f"burst-bench: {self.addr} not ready after {timeout} s ({last})")

    async def discover_model(self):
        if self.model:
            return
        try:
            info = await self._stub().ModelInfo(self.pb2.ModelInfoRequest(), metadata=self.md,
                                                timeout=10)
            self.model = info.model
        except self.grpc.aio.AioRpcError:
            pass

    async def server_tokenizer(self):
        async def count(text):
            r = await self._stub().Tokenize(self.pb2.TokenizeRequest(text=text, add_bos=True),
                                            metadata=self.md, timeout=60)
            return len(r.ids)

        try:
            await count("Hello")
        except self.grpc.aio.AioRpcError:
            return None
        return Tokenizer(count, None, "server:Tokenize")

    def prepare(self, spec):
        a = self.args
        sampling = self.pb2.SamplingParams(temperature=a.temperature, top_k=a.top_k or 0,
                                           top_p=a.top_p or 0)
        req = self.pb2.GenerateRequest(max_tokens=spec.output_len, sampling=sampling,
                                       ignore_eos=a.ignore_eos)
        if a.model:
            req.model = a.model
        if spec.ids is not None:
            req.token_ids.ids.extend(spec.ids)
        else:
            req.text = spec.text
        spec.payload = req

    async def send(self, spec, res, t0):
        st = time.perf_counter()
        res.start, res.sent = st - t0, True
        last = st
        call = self._stub().Generate(spec.payload, metadata=self.md,
                                     timeout=self.args.request_timeout)
        try:
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "token":
                    now = time.perf_counter()
                    if ev.token.text:
                        res.text += ev.token.text
                        res.chunks += 1
                        if res.chunks == 1:
                            res.ttft = now - st
                        else:
                            res.itls.append(now - last)
                        last = now
                elif kind == "started":
                    res.server_input_len = ev.started.prompt_tokens
                elif kind == "finished":
                    f = ev.finished
                    res.output_len = f.completion_tokens
                    res.finish_reason = f.finish_reason
                    res.server_input_len = f.prompt_tokens or res.server_input_len
                    res.timings = {"queue_ms": f.queue_ms, "prefill_ms": f.prefill_ms,
                                   "ttft_ms": f.ttft_ms,
                                   "decode_tokens_per_s": f.decode_tokens_per_s}
        except asyncio.CancelledError:
            call.cancel()
            raise
        res.e2el = time.perf_counter() - st
        if res.chunks == 0:
            res.ttft = res.e2el
        res.success = True

    def classify(self, e):
        if isinstance(e, self.grpc.aio.AioRpcError):
            return f"gRPC {e.code().name}", e.details() or ""
        return None

    async def close(self):
        if self.channel is not None:
            await self.channel.close()


# ---------------------------------------------------------------------------------------------
# The run: arrivals, concurrency, progress, Ctrl-C
# ---------------------------------------------------------------------------------------------

class Progress:
    def __init__(self, total, enabled, label="requests"):
        self.total, self.enabled, self.label = total, enabled, label
        self.tty = sys.stderr.isatty()
        self.ok = self.failed = 0
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.last_decile = -1

    def update(self, res):
        if res.success:
            self.ok += 1
        elif not res.interrupted:
            self.failed += 1
        if not self.enabled:
            return
        done = self.ok + self.failed
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw < 0.1 and done < self.total:
                return
            self.last_draw = now
            width = 30
            fill = int(width * done / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
                             f"{self.label} ok {self.ok} failed {self.failed} "
                             f"{now - self.t0:.1f} s ")
            sys.stderr.flush()
        else:
            decile = 10 * done // max(self.total, 1)
            if decile != self.last_decile:
                self.last_decile = decile
                log(f"burst-bench: {done}/{self.total} {self.label} (ok {self.ok}, failed "
                    f"{self.failed}, {now - self.t0:.1f} s)")

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def one_request(target, spec, t0, sem, timeout):
    res = Result(index=spec.index, group=spec.group, input_len=spec.input_len or 0,
                 output_len_req=spec.output_len)
    try:
        if sem is not None:
            async with sem:
                await asyncio.wait_for(target.send(spec, res, t0), timeout)
        else:
            await asyncio.wait_for(target.send(spec, res, t0), timeout)
    except asyncio.CancelledError:
        res.interrupted = True
        res.success = False
        res.error_kind, res.error = "interrupted", "the run was interrupted"
        res.output_len = res.output_len or res.chunks  # what had arrived
    except asyncio.TimeoutError:
        res.success = False
        res.error_kind, res.error = "timeout", f"no end of stream after {timeout} s"
    except Exception as e:  # noqa: BLE001 - a failed request is data, never a crash
        res.success = False
        kind = target.classify(e)
        res.error_kind, res.error = kind if kind else (type(e).__name__, str(e)[:300])
    if res.error_kind and res.success:
        res.success = False
    if not res.input_len and res.server_input_len:
        res.input_len = res.server_input_len
    return res


async def run_requests(target, specs, args, rng, label, stop):
    """Sends specs with the arrival process and the concurrency limit; returns (results,
    duration)."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = Progress(len(specs), not args.no_progress, label)
    t0 = time.perf_counter()
    tasks = []
    last_done = [t0]

    def done_cb(task):
        last_done[0] = time.perf_counter()
        if not task.cancelled() and task.exception() is None:
            progress.update(task.result())

    for i, spec in enumerate(specs):
        if stop.is_set():
            break
        if i > 0 and math.isfinite(args.request_rate):
            theta = 1.0 / (args.request_rate * args.burstiness)
            delay = rng.gammavariate(args.burstiness, theta)
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except asyncio.TimeoutError:
                pass
        t = asyncio.create_task(one_request(target, spec, t0, sem, args.request_timeout))
        t.add_done_callback(done_cb)
        tasks.append(t)
        stop.tasks = tasks
    results = list(await asyncio.gather(*tasks)) if tasks else []
    # Requests an interrupt caught before they were sent are not part of the run.
    results = [r for r in results if r.sent or not r.interrupted]
    progress.close()
    end = last_done[0] if not stop.is_set() else time.perf_counter()
    return results, max(end - t0, 1e-9)


class StopFlag(asyncio.Event):
    def __init__(self):
        super().__init__()
        self.tasks = []
        self.signals = 0


def install_signals(loop, stop):
    def handler(signame):
        stop.signals += 1
        if stop.signals > 1:
            log("burst-bench: interrupted twice, exiting without results")
            os._exit(130)
        log(f"\nburst-bench: {signame}: stopping; in-flight requests are cancelled and the "
            "partial results reported (again to quit at once)")
        stop.set()
        for t in stop.tasks:
            t.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(s, handler, s.name)
        except (NotImplementedError, RuntimeError):
            pass


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------

def percentile(xs, p):
    """numpy.percentile's default (linear interpolation)."""
    s = sorted(xs)
    if not s:
        return 0.0
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def describe(xs, percentiles, scale=1000.0):
    xs = [x * scale for x in xs]
    d = {"mean": statistics.fmean(xs) if xs else 0.0,
         "median": statistics.median(xs) if xs else 0.0,
         "std": statistics.pstdev(xs) if xs else 0.0}
    for p in percentiles:
        d[f"p{p:g}"] = percentile(xs, p)
    return d


def tpot_of(r):
    return (r.e2el - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def token_times(start, ttft, itls, output_len):
    """When each content chunk arrived (seconds since the benchmark started), and the tokens
    each stands for (chunks may carry several tokens)."""
    if not ttft:
        return [], 0.0
    times = [start + ttft]
    for g in itls:
        times.append(times[-1] + g)
    return times, (output_len / len(times) if output_len else 1.0)


def tokens_per_second_series(rows, duration, bins=None):
    """[(bin start s, output tokens/s)] from per-request (start, ttft, itls, output_len)."""
    width = bins or max(0.25, duration / 40.0)
    n = max(1, int(math.ceil(duration / width)))
    counts = [0.0] * n
    for start, ttft, itls, out_len in rows:
        times, w = token_times(start, ttft, itls, out_len)
        for t in times:
            counts[min(n - 1, max(0, int(t / width)))] += w
    return [(i * width, c / width) for i, c in enumerate(counts)]


def max_tokens_per_s(rows, duration):
    """vLLM's max_output_tokens_per_s: the busiest whole second."""
    series = tokens_per_second_series(rows, max(duration, 1.0), bins=1.0)
    return max((v for _, v in series), default=0.0)


def compute(results, duration, args, goodput):
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success and not r.interrupted]
    interrupted = [r for r in results if r.interrupted]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls]
    e2els = [r.e2el for r in ok]
    pcts = args.metric_percentiles
    out = {
        "completed": len(ok),
        "failed": len(failed),
        "interrupted": len(interrupted),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": max_tokens_per_s(
            [(r.start, r.ttft, r.itls, r.output_len) for r in ok], duration),
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in describe(xs, pcts).items():
            out[f"{stat}_{name}_ms"] = v
    if goodput:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.e2el}
            if all(vals[k] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
        out["request_goodput"] = good / duration
        out["goodput_slos_ms"] = goodput
    for key in SERVER_TIMINGS:
        xs = [r.timings.get(key) for r in ok if r.timings.get(key) is not None]
        if xs:
            d = describe(xs, pcts, scale=1.0)
            for stat in ("mean", "median", "p99"):
                out[f"{stat}_server_{key}"] = d[stat]
    counts = {}
    first = {}
    for r in failed + interrupted:
        counts[r.error_kind] = counts.get(r.error_kind, 0) + 1
        first.setdefault(r.error_kind, r.error)
    out["error_counts"] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    out["error_examples"] = first
    return out


def group_metrics(results, duration, args):
    groups = sorted({r.group for r in results})
    if groups == ["all"]:
        return None
    g = {}
    for name in groups:
        rs = [r for r in results if r.group == name]
        m = compute(rs, duration, args, None)
        g[name] = {k: v for k, v in m.items()
                   if k in ("completed", "failed", "total_input_tokens", "total_output_tokens")
                   or k.endswith("_ttft_ms") or k.endswith("_tpot_ms")
                   or k.endswith("_e2el_ms") or "server_" in k}
    return g


def result_json(results, duration, args, goodput, target, tokenizer, seed, interrupted):
    m = compute(results, duration, args, goodput)
    out = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "backend": target.backend,
        "endpoint_type": target.backend,
        "base_url": args.base_url,
        "endpoint": args.endpoint if target.kind == "http" else "burst.v1.Burst/Generate",
        "grpc": args.grpc,
        "model_id": target.model,
        "tokenizer_id": tokenizer.name if tokenizer else None,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_requests,
        "num_warmups": args.num_warmups,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "input_len": None if args.input_lens or args.input_len_range else args.input_len,
        "input_lens_requested": args.input_lens,
        "input_len_range": list(args.input_len_range) if args.input_len_range else None,
        "long_fraction": args.long_fraction,
        "long_len": args.long_len if args.long_fraction > 0 else None,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": seed,
        "interrupted_run": interrupted,
    }
    out.update(m)
    out["groups_summary"] = group_metrics(results, duration, args)
    out.update({
        "input_lens": [r.input_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itls for r in results],
        "e2els": [r.e2el for r in results],
        "tpots": [tpot_of(r) for r in results],
        "start_times": [r.start for r in results],
        "groups": [r.group for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "server_input_lens": [r.server_input_len for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [(f"{r.error_kind}: {r.error}" if r.error_kind else "") for r in results],
        "error_kinds": [r.error_kind for r in results],
    })
    for key in SERVER_TIMINGS:
        out[f"server_{key}"] = [r.timings.get(key) if r.timings else None for r in results]
    out["metadata"] = dict(args.metadata)
    return out


def print_summary(j, args):
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(name, v, fmt="{:.2f}"):
        lines.append(f"{name:<40}{fmt.format(v) if isinstance(v, float) else v:>10}")

    row("Successful requests:", j["completed"])
    row("Failed requests:", j["failed"])
    if j["interrupted"]:
        row("Interrupted requests:", j["interrupted"])
    if j["max_concurrency"]:
        row("Maximum request concurrency:", j["max_concurrency"])
    if j["request_rate"] != "inf":
        row("Request rate (req/s):", float(j["request_rate"]))
    row("Benchmark duration (s):", j["duration"])
    row("Total input tokens:", j["total_input_tokens"])
    row("Total generated tokens:", j["total_output_tokens"])
    row("Request throughput (req/s):", j["request_throughput"])
    if j["request_goodput"] is not None:
        row("Request goodput (req/s):", j["request_goodput"])
    row("Output token throughput (tok/s):", j["output_throughput"])
    row("Peak output token throughput (tok/s):", j["max_output_tokens_per_s"])
    row("Total Token throughput (tok/s):", j["total_token_throughput"])
    for m in METRICS:
        lines.append(METRIC_NAMES[m].center(w, "-"))
        short = m.upper()
        row(f"Mean {short} (ms):", j[f"mean_{m}_ms"])
        row(f"Median {short} (ms):", j[f"median_{m}_ms"])
        for p in args.metric_percentiles:
            row(f"P{p:g} {short} (ms):", j[f"p{p:g}_{m}_ms"])
    if any(k.startswith("mean_server_") for k in j):
        lines.append("Server timings (reported by burst)".center(w, "-"))
        for key, name in (("queue_ms", "queue (ms)"), ("prefill_ms", "prefill (ms)"),
                          ("ttft_ms", "TTFT (ms)"), ("decode_tokens_per_s", "decode (tok/s)")):
            if f"mean_server_{key}" in j:
                row(f"Mean server {name}:", j[f"mean_server_{key}"])
                row(f"Median server {name}:", j[f"median_server_{key}"])
    if j.get("groups_summary"):
        lines.append("Per group (mixed workload)".center(w, "-"))
        for g, s in j["groups_summary"].items():
            lines.append(f"{g}: {s['completed']} ok, {s['failed']} failed; TTFT mean "
                         f"{s['mean_ttft_ms']:.1f} / median {s['median_ttft_ms']:.1f} / p99 "
                         f"{s.get('p99_ttft_ms', 0.0):.1f} ms")
    if j["error_counts"]:
        lines.append("Errors by kind".center(w, "-"))
        for kind, n in j["error_counts"].items():
            lines.append(f"{kind + ':':<40}{n:>10}")
            ex = j["error_examples"].get(kind)
            if ex:
                lines.append(f"  e.g. {ex[:w * 2]}")
    lines.append("=" * w)
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------
# Plots and reports (matplotlib, Agg)
# ---------------------------------------------------------------------------------------------

def import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError as e:
        log(f"burst-bench: no plots: matplotlib is missing (Debian python3-matplotlib): {e}")
        return None


def _ok_rows(j):
    return [i for i, e in enumerate(j["errors"]) if not e]


def plot(results_json, outdir):
    """TTFT vs prompt length, TTFT CDF, output tokens/s over time; one series per result
    (and per group of a mixed workload). Returns the files written."""
    plt = import_pyplot()
    if plt is None:
        return []
    os.makedirs(outdir, exist_ok=True)
    written = []

    def series(j):
        """(name, [row indices]) per group."""
        label = j.get("label") or os.path.basename(j.get("_path", "")) or "run"
        rows = _ok_rows(j)
        groups = sorted({j["groups"][i] for i in rows})
        if groups in ([], ["all"]):
            return [(label, rows)]
        out = []
        for g in groups:
            idx = [i for i in rows if j["groups"][i] == g]
            lens = [j["input_lens"][i] for i in idx]
            span = f"{min(lens)}" if min(lens) == max(lens) else f"{min(lens)}-{max(lens)}"
            name = f"{g}: {span} tokens"
            out.append((name if len(results_json) == 1 else f"{label} ({name})", idx))
        return out

    def title(ax, text):
        sub = results_json[0].get("label") if len(results_json) == 1 else None
        ax.set_title(f"{text}\n{sub}" if sub else text, fontsize=10 if sub else 12)

    def save(fig, ax, heading, name):
        """Titles, grids and legends the plot, writes it as OUTDIR/name, and notes the path."""
        title(ax, heading)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    lens_all = []
    for j in results_json:
        for name, rows in series(j):
            xs = [j["input_lens"][i] for i in rows]
            lens_all += xs
            ax.scatter(xs, [j["ttfts"][i] * 1000 for i in rows], s=14, alpha=0.7, label=name)
    if lens_all and max(lens_all) > 8 * max(1, min(lens_all)):
        ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    save(fig, ax, "Time to first token vs prompt length", "ttft_vs_prompt_len.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for j in results_json:
        for name, rows in series(j):
            xs = sorted(j["ttfts"][i] * 1000 for i in rows)
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post",
                        label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    save(fig, ax, "TTFT CDF", "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for j in results_json:
        label = j.get("label") or os.path.basename(j.get("_path", "")) or "run"
        rows = _ok_rows(j)
        s = tokens_per_second_series(
            [(j["start_times"][i], j["ttfts"][i], j["itls"][i], j["output_lens"][i])
             for i in rows], j["duration"])
        ax.step([t for t, _ in s], [v for _, v in s], where="post", label=label)
    ax.set_xlabel("time since the start of the run (s)")
    ax.set_ylabel("output tokens/s")
    save(fig, ax, "Output throughput over time", "tokens_per_s.png")
    return written


def markdown_table(results_json):
    head = ["run", "reqs", "conc", "rate", "in len", "out len", "ok", "failed", "req/s",
            "out tok/s", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "TPOT mean ms",
            "ITL p99 ms", "E2EL mean ms", "server prefill ms", "errors"]
    rows = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * 16 + ["---"])
            + "|"]
    for j in results_json:
        lens = [j["input_lens"][i] for i in _ok_rows(j)] or j["input_lens"]
        if lens and min(lens) != max(lens):
            in_len = f"{min(lens)}-{max(lens)}"
        else:
            in_len = str(lens[0]) if lens else "-"
        errs = ", ".join(f"{k} x{v}" for k, v in j.get("error_counts", {}).items()) or "-"
        prefill = j.get("mean_server_prefill_ms")

        def f(v, d=1):
            return "-" if v is None else f"{v:.{d}f}"

        rows.append("| " + " | ".join([
            j.get("label") or os.path.basename(j.get("_path", "")), str(len(j["errors"])),
            str(j.get("max_concurrency") or "-"), str(j.get("request_rate")), in_len,
            str(j.get("output_len")), str(j["completed"]), str(j["failed"]),
            f(j["request_throughput"], 2), f(j["output_throughput"]), f(j["mean_ttft_ms"]),
            f(j["median_ttft_ms"]), f(j.get("p99_ttft_ms")), f(j["mean_tpot_ms"], 2),
            f(j.get("p99_itl_ms"), 2), f(j["mean_e2el_ms"]), f(prefill), errs]) + " |")
    return "\n".join(rows) + "\n"


def report(paths, markdown, plotdir):
    results = []
    for p in paths:
        with open(p) as f:
            j = json.load(f)
        j["_path"] = p
        if not j.get("label"):
            j["label"] = os.path.splitext(os.path.basename(p))[0]
        results.append(j)
    table = markdown_table(results)
    print(table, end="")
    if markdown:
        with open(markdown, "w") as f:
            f.write(table)
    if plotdir:
        for p in plot(results, plotdir):
            log(f"burst-bench: wrote {p}")
    return 0


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def key_value(s):
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"{s!r}: expected KEY=VALUE")
    return tuple(s.split("=", 1))


def parse_goodput(items):
    slos = {}
    for it in items or []:
        k, _, v = it.partition(":")
        if k not in ("ttft", "tpot", "e2el") or not v:
            raise SystemExit(f"burst-bench: --goodput {it!r}: expected ttft:MS, tpot:MS or "
                             "e2el:MS")
        slos[k] = float(v)
    return slos


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="burst-bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load generator for burst (gRPC or HTTP) and any OpenAI-compatible server.",
        epilog=__doc__.split("\n\n", 1)[1])
    t = p.add_argument_group("target")
    t.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    t.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    t.add_argument("--grpc", metavar="HOST:PORT", help="burst's gRPC API (burst.v1.Burst)")
    t.add_argument("--api-key", default=os.environ.get("BURST_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $BURST_API_KEY)")
    t.add_argument("--model", help="model name to send (default: the server's first model)")
    t.add_argument("--proto-dir", default=os.path.join(ROOT, "proto"),
                   help="where burst/v1/burst.proto is (for --grpc)")
    t.add_argument("--wait-ready", type=float, default=0, metavar="S",
                   help="wait up to S seconds for the server's /health (gRPC: ModelInfo)")
    t.add_argument("--request-timeout", type=float, default=3600.0, metavar="S")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=["random", "kjv", "text", "jsonl"],
                   help="random token ids (default), the KJV text (Debian bible-kjv), a text "
                        "file (--dataset-path) cut to exact lengths, or a JSONL file of "
                        "{\"prompt\": str | [ids], \"output_len\": n}")
    w.add_argument("--dataset-path")
    w.add_argument("--input-len", type=parse_count, default=1024,
                   help="exact prompt length in tokens, BOS included (4K = 4096)")
    w.add_argument("--input-len-range", type=parse_range, metavar="LO:HI",
                   help="uniformly random prompt lengths")
    w.add_argument("--input-lens", type=parse_list, metavar="A,B,...",
                   help="a list of prompt lengths, used in turn")
    w.add_argument("--long-fraction", type=float, default=0.0,
                   help="mixed workload: this share of the requests has --long-len tokens")
    w.add_argument("--long-len", type=parse_count, default=32768)
    w.add_argument("--output-len", type=parse_count, default=128, help="max_tokens")
    w.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly --output-len tokens (vLLM's ignore_eos: EOS does not "
                        "end a request; a server that ends some early anyway gets a warning)")
    w.add_argument("--prompt-format", default="auto", choices=["auto", "ids", "text"],
                   help="send token ids (completions and gRPC accept them; auto: ids for "
                        "random, text for kjv/text) or text")
    w.add_argument("--tokenizer", default="auto",
                   help="'server' (the target's /tokenize or Tokenize), or a SentencePiece "
                        "model file (auto: the server's, else models/kjv-tiny/tokenizer.model)")
    w.add_argument("--token-id-range", type=parse_range, default=(259, 32000), metavar="LO:HI",
                   help="random token ids are drawn from [LO, HI) (default 259:32000, LLaMA-2)")
    w.add_argument("--bos-id", type=int, default=1,
                   help="first id of a random-id prompt (-1: none)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--top-p", type=float)
    w.add_argument("--top-k", type=int)
    w.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every HTTP request body")
    ld = p.add_argument_group("load")
    ld.add_argument("--num-requests", "--num-prompts", type=int, default=100)
    ld.add_argument("--max-concurrency", type=int, default=None)
    ld.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s, Poisson (gamma with --burstiness) arrivals; inf: all at once")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival times: 1 Poisson, <1 burstier")
    ld.add_argument("--num-warmups", type=int, default=0)
    ld.add_argument("--seed", type=int, default=None,
                    help="workload seed (default: a fresh one per run, printed and saved)")
    r = p.add_argument_group("results")
    r.add_argument("--result-json", metavar="FILE")
    r.add_argument("--label")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", type=key_value,
                   help="saved in the result JSON's metadata")
    r.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    r.add_argument("--metric-percentiles", default="90,99",
                   type=lambda s: [float(x) for x in s.split(",")])
    r.add_argument("--plot", metavar="DIR", help="write PNG plots there (matplotlib)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--report", nargs="+", metavar="JSON",
                   help="no run: combine result files into a table (--markdown) and --plot")
    r.add_argument("--markdown", metavar="FILE", help="with --report: write the table there")
    a = p.parse_args(argv)
    if a.report:
        return a
    if bool(a.base_url) == bool(a.grpc):
        p.error("give exactly one of --base-url URL and --grpc HOST:PORT")
    if a.grpc and "chat" in a.endpoint:
        p.error("--endpoint is for --base-url")
    if a.dataset_name in ("jsonl", "text") and not a.dataset_path:
        p.error(f"--dataset-name {a.dataset_name} needs --dataset-path")
    if not 0 <= a.long_fraction <= 1:
        p.error("--long-fraction must be in [0, 1]")
    if a.num_requests < 0 or a.num_warmups < 0:
        p.error("--num-requests and --num-warmups must be >= 0")
    if a.request_rate <= 0 or a.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    if a.max_concurrency is not None and a.max_concurrency <= 0:
        p.error("--max-concurrency must be > 0")
    if not isinstance(a.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return a


async def choose_tokenizer(args, target, needed):
    if args.tokenizer not in ("auto", "server"):
        sp = load_spm(args.tokenizer)
        if sp is None:
            raise SystemExit(f"burst-bench: cannot load --tokenizer {args.tokenizer} (a "
                             "SentencePiece model; Python needs sentencepiece)")
        return spm_tokenizer(sp, args.tokenizer)
    if not needed:
        return None
    tok = await target.server_tokenizer()
    local = load_spm(DEFAULT_SPM)
    if tok is not None:
        tok.sp = local  # decoding random ids into text, when a local model is there
        return tok
    if args.tokenizer == "server":
        raise SystemExit("burst-bench: the target has no tokenize endpoint (--tokenizer server)")
    if local is not None:
        log(f"burst-bench: the target has no tokenize endpoint; counting tokens with "
            f"{DEFAULT_SPM}")
        return spm_tokenizer(local, DEFAULT_SPM)
    raise SystemExit("burst-bench: exact-length text prompts need a tokenizer: the target's "
                     "/tokenize, or --tokenizer FILE (SentencePiece)")


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
        results, duration = [], 0.0
        if not stop.is_set():
            log(f"burst-bench: {len(specs)} requests to {args.base_url or args.grpc} "
                f"(rate {args.request_rate}, max concurrency {args.max_concurrency})")
            results, duration = await run_requests(target, specs, args, rng, "requests", stop)
        j = result_json(results, duration, args, goodput, target, tok, seed, stop.is_set())
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


if __name__ == "__main__":
    sys.exit(main())
