# Contract: the OpenAI-compatible target (--base-url: burst, vLLM, SGLang), with the same
# interface as grpc_client.GrpcTarget: kind, backend, model, chat, wait_ready (GET /health),
# discover_model (GET /v1/models), server_tokenizer (POST /tokenize), prepare(spec) (the JSON
# body of /v1/completions or /v1/chat/completions, streaming with usage), send(spec, res, t0)
# (reads the SSE stream into res: TTFT at the first chunk with text, ITLs between such chunks,
# usage with its prompt_tokens_details.cached_tokens, burst's timings, in-stream errors; a
# non-streamed answer is taken whole), classify (an exception to its error kind: "HTTP 400",
# "connection refused", ...), prefix_cache_counters (the server's prefix-cache queries and hits
# from GET /metrics, burst: or vllm:; None without them) and close.
import asyncio
import json
import time

from .common import SERVER_TIMINGS
from .httpwire import HttpClient, HttpError
from .tokenizer import Tokenizer

# What burst's HTTP API puts in an in-stream error's "type", back to the status it stands for.
ERROR_TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                     "not_found_error": 404, "request_too_large": 413,
                     "service_unavailable": 503, "server_error": 500}


class HttpTarget(HttpClient):
    kind = "http"

    def __init__(self, args):
        super().__init__(args.base_url, args.api_key)
        self.endpoint = args.endpoint
        self.chat = "chat" in args.endpoint
        self.model = args.model
        self.args = args
        self.backend = "openai-chat" if self.chat else "openai"

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
            conn, status, headers = await self.exchange("POST", self.endpoint, spec.payload,
                                                         stream=True)
            if status != 200:
                data = b"".join([p async for p in self.read_body(conn, headers)])
                self.release(conn)
                conn = None
                raise HttpError(status, error_message(data))
            ctype = headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                data = b"".join([p async for p in self.read_body(conn, headers)])
                self.release(conn)
                conn = None
                self._whole_response(json.loads(data), res, st)
                return
            event, lines, buf, done = None, [], b"", False
            async for piece in self.read_body(conn, headers):
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
            self.release(conn)
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
            res.cached_tokens = cached_tokens(u)
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
        res.cached_tokens = cached_tokens(u)
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

    async def prefix_cache_counters(self):
        """(queries, hits): the server's prefix-cache counters in GET /metrics, in prompt
        tokens (burst's burst:prefix_cache_*_total, vLLM's vllm:prefix_cache_*_total), summed
        over their labels; None when the server has none or /metrics does not answer."""
        try:
            status, body = await self.request_json("GET", "/metrics")
        except (OSError, ConnectionError, HttpError, asyncio.IncompleteReadError):
            return None
        if status != 200 or not isinstance(body, str):
            return None
        return parse_prefix_cache_counters(body)


def cached_tokens(usage):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's), None when absent."""
    d = usage.get("prompt_tokens_details")
    if isinstance(d, dict) and d.get("cached_tokens") is not None:
        return int(d["cached_tokens"])
    return None


def parse_prefix_cache_counters(text):
    """(queries, hits) from Prometheus text, the first namespace that has both counters."""
    sums = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)[0], line.rsplit("}", 1)[-1]
        else:
            name, _, rest = line.partition(" ")
        try:
            sums[name.strip()] = sums.get(name.strip(), 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    for ns in ("burst", "vllm"):
        q, h = f"{ns}:prefix_cache_queries_total", f"{ns}:prefix_cache_hits_total"
        if q in sums and h in sums:
            return sums[q], sums[h]
    return None


def error_message(data):
    try:
        j = json.loads(data)
        e = j.get("error", j) if isinstance(j, dict) else j
        if isinstance(e, dict):
            return str(e.get("message") or e.get("detail") or e)[:300]
        return str(e)[:300]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data[:300].decode(errors="replace")
