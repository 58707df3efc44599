# Contract: the gRPC target, burst.v1.Burst (--grpc HOST:PORT), with the same interface as the
# HTTP one (openai_http.HttpTarget): kind, backend, model, wait_ready, discover_model,
# server_tokenizer, prepare(spec), send(spec, res, t0) (Finished's cached_tokens included),
# classify(exception), prefix_cache_counters (None: /metrics is HTTP's), close. grpcio is
# imported, and the Python modules generated from proto/burst/v1/burst.proto (protoc with
# grpc_python_plugin, else grpc_tools) into a temporary folder, only when a GrpcTarget is made.
import asyncio
import atexit
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .tokenizer import Tokenizer


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
                    res.cached_tokens = getattr(f, "cached_tokens", None)
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

    async def prefix_cache_counters(self):
        return None  # the counters are in the HTTP port's /metrics

    async def close(self):
        if self.channel is not None:
            await self.channel.close()
