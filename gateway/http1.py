"""A small keep-alive HTTP/1.1 client for the backend protocol (POST JSON, read an NDJSON body).

Why not aiohttp's ClientSession here: per request it builds a ClientRequest, a ClientResponse, timer
contexts, trace hooks and header multidicts, ~250 us of CPU on the hot path; this client is a
protocol object per connection and bytes in, lines out. aiohttp is still used for the probes.

Body framing: Content-Length, chunked, or until the connection closes. A connection goes back to the
pool only after its response body ended cleanly and the server did not ask to close it; a pooled
connection the server closed is noticed by connection_lost and never handed out.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit


class HTTPProtocolError(Exception):
    """The server's bytes are not a well-formed HTTP/1.1 response."""


class LineTooLong(HTTPProtocolError):
    """A node's NDJSON line over MAX_LINE: the hop fails (counted as a broken stream); nothing more is buffered."""


class ConnectionDropped(ConnectionError):
    """The connection closed before the response (or its body) was complete."""

    def __init__(self, message: str, *, got_bytes: bool) -> None:
        super().__init__(message)
        self.got_bytes = got_bytes


_MAX_HEAD = 64 * 1024
MAX_LINE = 8 << 20        # one NDJSON line of a node's stream (a chunk: tokens, logprobs, usage); the gateway's cap
MAX_BUFFERED = 8 << 20    # decoded body bytes held before reading pauses (the node's writes then wait)
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


class Connection(asyncio.Protocol):
    """One TCP connection; one response at a time. Raw bytes are decoded into `body` as they arrive."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool], loop: asyncio.AbstractEventLoop) -> None:
        self._pool, self.key, self._loop = pool, key, loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._raw = bytearray()
        self._waiter: asyncio.Future | None = None
        self._park = False         # return to the pool when the current body ends
        self.idle_since = 0.0
        self.reused = False
        self.paused = False        # reading paused: the decoded body is over MAX_BUFFERED and not yet consumed
        self._reset()

    def _reset(self) -> None:
        if self.paused and self.transport is not None:    # back in the pool: the next response must be read
            self.paused = False
            self.transport.resume_reading()
        self.state = _HEAD
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self._left = 0
        self.keep_alive = True
        self.got_bytes = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._raw += data
        try:
            self._decode()
        except HTTPProtocolError:
            self.keep_alive = False
            self.state = -1
        if len(self.body) > MAX_BUFFERED and not self.paused and self.transport is not None:
            self.paused = True       # back-pressure: the node waits until the reader has taken lines out
            self.transport.pause_reading()
        if self._park and self.state == _DONE:
            self._park = False
            self._pool.put(self)
        self._wake()

    def connection_lost(self, exc) -> None:
        self.lost = True
        if self.state == _UNTIL_CLOSE:
            self.state = _DONE
        self._pool.forget(self)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- decoding ----
    def _decode(self) -> None:
        raw = self._raw
        while raw:
            s = self.state
            if s == _HEAD:
                end = raw.find(b"\r\n\r\n")
                if end < 0:
                    if len(raw) > _MAX_HEAD:
                        raise HTTPProtocolError("response head over 64 KiB")
                    return
                self._parse_head(bytes(raw[:end]))
                del raw[:end + 4]
            elif s == _LENGTH:
                take = min(self._left, len(raw))
                self.body += raw[:take]
                del raw[:take]
                self._left -= take
                if not self._left:
                    self.state = _DONE
            elif s == _CHUNK_SIZE:
                end = raw.find(b"\r\n")
                if end < 0:
                    return
                try:
                    size = int(bytes(raw[:end]).split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPProtocolError(f"bad chunk size {bytes(raw[:end])[:40]!r}") from None
                del raw[:end + 2]
                self._left = size
                self.state = _CHUNK_DATA if size else _TRAILER
            elif s == _CHUNK_DATA:
                take = min(self._left, len(raw))
                self.body += raw[:take]
                del raw[:take]
                self._left -= take
                if not self._left:
                    self.state = _CHUNK_CRLF
            elif s == _CHUNK_CRLF:
                if len(raw) < 2:
                    return
                if raw[:2] != b"\r\n":
                    raise HTTPProtocolError("chunk not followed by CRLF")
                del raw[:2]
                self.state = _CHUNK_SIZE
            elif s == _TRAILER:
                end = raw.find(b"\r\n")
                if end < 0:
                    return
                del raw[:end + 2]
                if end == 0:
                    self.state = _DONE
            elif s == _UNTIL_CLOSE:
                self.body += raw
                raw.clear()
            else:  # _DONE or broken: bytes after the response mean the connection cannot be reused
                self.keep_alive = False
                raw.clear()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise HTTPProtocolError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:  # 100 Continue and friends: the real head follows
            headers.clear()
            return
        self.status = status
        conn = headers.get("connection", "").lower()
        self.keep_alive = conn != "close" and (parts[0] != "HTTP/1.0" or conn == "keep-alive")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise HTTPProtocolError(f"bad content-length {headers['content-length'][:40]!r}") from None
            self.state = _LENGTH if self._left else _DONE
        elif status in (204, 304):
            self.state = _DONE
        else:
            self.keep_alive = False
            self.state = _UNTIL_CLOSE

    # ---- used by Response ----
    async def wait(self, deadline: float | None) -> None:
        """Until more bytes arrive or the connection closes; TimeoutError past `deadline` (loop time)."""
        fut = self._waiter = self._loop.create_future()
        timer = None
        if deadline is not None:
            timer = self._loop.call_at(deadline, _expire, fut)
        try:
            await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def resume(self) -> None:
        """Read again once the reader has taken the body under MAX_BUFFERED."""
        if self.paused and len(self.body) <= MAX_BUFFERED and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self._park = False
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def release(self) -> None:
        """The caller is done: keep the connection if the response ended cleanly, else close it."""
        if self.lost or not self.keep_alive or self.state < 0:
            self.close()
        elif self.state == _DONE:
            if not self._raw:
                self._pool.put(self)
            else:
                self.close()
        else:
            self.close()

    def release_after_body(self) -> None:
        """Like release, but a body still arriving (the chunked terminator) may finish first."""
        if self.state in (_CHUNK_SIZE, _CHUNK_CRLF, _TRAILER) and not self.lost and self.keep_alive:
            self._park = True
        else:
            self.release()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class Response:
    """The head of one response; the body is read line by line (NDJSON) or whole."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers

    async def readline(self, deadline: float | None) -> bytes:
        """The next line including b"\\n", the unterminated rest at the end, or b"" at the end."""
        conn = self.conn
        while True:
            body = conn.body
            i = body.find(b"\n")
            if i >= 0:
                if i >= MAX_LINE:
                    raise LineTooLong(f"a line of {i + 1} bytes from the node: over the {MAX_LINE}-byte cap")
                line = bytes(body[:i + 1])
                del body[:i + 1]
                conn.resume()
                return line
            if len(body) > MAX_LINE:      # no newline in the first MAX_LINE bytes: never buffered further
                conn.keep_alive = False
                raise LineTooLong(f"over {MAX_LINE} bytes from the node without a newline")
            if conn.state == _DONE:
                line = bytes(body)
                body.clear()
                return line
            if conn.state < 0:
                raise HTTPProtocolError("malformed response body framing")
            if conn.lost:
                raise ConnectionDropped("connection closed mid-body", got_bytes=True)
            await conn.wait(deadline)

    def has_line(self) -> bool:
        """A whole line other than empty (keepalive) ones, or the end, is already here: reading the next
        NDJSON chunk would not wait."""
        conn = self.conn
        body = conn.body
        start = len(body) - len(body.lstrip(b"\n")) if body[:1] == b"\n" else 0   # keepalive lines: skipped
        return body.find(b"\n", start) >= 0 or conn.state == _DONE

    async def read(self, deadline: float | None, limit: int = 1 << 20) -> bytes:
        conn = self.conn
        while conn.state != _DONE:
            if conn.state < 0:
                raise HTTPProtocolError("malformed response body framing")
            if conn.lost:
                raise ConnectionDropped("connection closed mid-body", got_bytes=True)
            if len(conn.body) > limit:
                conn.keep_alive = False
                break
            conn.resume()
            await conn.wait(deadline)
        out = bytes(conn.body[:limit])
        conn.body.clear()
        return out

    def release(self) -> None:
        self.conn.release_after_body()

    def close(self) -> None:
        self.conn.close()


class Pool:
    """Idle keep-alive connections per (host, port, tls); no limit on open connections."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float = 60.0,
                 headers: dict[str, str] | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._extra = b"".join(f"{k}: {v}\r\n".encode() for k, v in (headers or {}).items())  # on every request
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._open: set[Connection] = set()
        self._targets: dict[str, tuple[tuple[str, int, bool], str, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def target(self, url: str) -> tuple[tuple[str, int, bool], str, bytes]:
        """(pool key, path, host header) of a URL, parsed once."""
        t = self._targets.get(url)
        if t is None:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"unsupported backend URL {url!r}: expected http(s)://host[:port]/path")
            tls = u.scheme == "https"
            port = u.port or (443 if tls else 80)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            t = self._targets[url] = ((u.hostname, port, tls), path, u.netloc.encode("idna"))
        return t

    def put(self, conn: Connection) -> None:
        conn._reset()
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _get(self, key: tuple[str, int, bool], deadline: float) -> Connection:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keepalive_s:
                conn.reused = True
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        timeout = max(0.0, min(self.connect_timeout_s, deadline - loop.time()))
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(lambda: Connection(self, key, loop), host, port,
                                                   ssl=self._ssl if tls else None)
        self._open.add(conn)
        return conn

    async def post(self, url: str, body: bytes, deadline: float, headers: bytes = b"") -> Response:
        """Send the request and wait for the response head (before `deadline`, loop time); `headers`: more header
        lines for this request alone (each ending in CRLF)."""
        key, path, host = self.target(url)
        msg = (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host +
               b"\r\nContent-Type: application/json\r\n" + self._extra + headers + b"Content-Length: " +
               str(len(body)).encode() + b"\r\n\r\n" + body)
        for attempt in (0, 1):
            conn = await self._get(key, deadline)
            try:
                conn.transport.write(msg)  # type: ignore[union-attr]
                while conn.state == _HEAD:
                    if conn.lost:
                        raise ConnectionDropped("connection closed before the response", got_bytes=conn.got_bytes)
                    await conn.wait(deadline)
                if conn.state < 0:
                    raise HTTPProtocolError("malformed response head")
                return Response(conn)
            except ConnectionDropped as e:
                conn.close()
                # a pooled connection the server closed while idle: one fresh try, nothing was received
                if attempt == 0 and conn.reused and not e.got_bytes:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
