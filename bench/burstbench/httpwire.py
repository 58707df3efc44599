# Contract: HTTP/1.1 to one origin over asyncio streams, standard library only. HttpClient(base_url,
# api_key) checks the URL (http or https; SystemExit otherwise) and keeps a pool of keep-alive
# connections (an idle one older than IDLE_REUSE_S is not reused; one the server closed is
# replaced once). exchange() sends a request and returns (conn, status, headers); read_body()
# yields the body's bytes as they arrive (chunked, sized or until close); release() gives the
# connection back to the pool; request_json() is a whole JSON exchange; close() drops the pool.
# Every request carries 'Authorization: Bearer KEY' when there is a key. Nothing here knows the
# OpenAI API (openai_http does).
import asyncio
import json
import ssl
import time
import urllib.parse


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


class HttpClient:
    def __init__(self, base_url, api_key):
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise SystemExit(f"burst-bench: --base-url {base_url!r}: expected "
                             "http://HOST:PORT or https://HOST[:PORT]")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        self.host_header = u.netloc
        self.api_key = api_key
        self.idle = []

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

    async def exchange(self, method, path, body=None, stream=False):
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

    async def read_body(self, conn, headers):
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

    def release(self, conn):
        if getattr(conn, "keep", False) and not conn.reader.at_eof():
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    async def request_json(self, method, path, obj=None):
        body = json.dumps(obj).encode() if obj is not None else None
        conn, status, headers = await self.exchange(method, path, body)
        try:
            data = b"".join([p async for p in self.read_body(conn, headers)])
        except BaseException:
            conn.close()
            raise
        self.release(conn)
        try:
            return status, json.loads(data) if data else None
        except json.JSONDecodeError:
            return status, data.decode(errors="replace")

    async def close(self):
        for c in self.idle:
            c.close()
        self.idle.clear()
