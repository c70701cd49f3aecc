"""A lean HTTP/1.1 client for the load's streamed POSTs: pooled keep-alive connections on asyncio streams.

httpx spends 50-100 us of one core per streamed chunk and its connection pool grows slower with every
connection it holds; at a few hundred requests per second on a small machine that is the client, not
the server, setting the pace (docs/loadgen.md). This client does only what a load request needs: write
one POST with a JSON body, read the status line and headers, and hand the body over line by line
(`Content-Length`, `Transfer-Encoding: chunked`, or up to the connection's close), over plain http://.

Connections are kept alive and reused, one request at a time each. A reused connection the server
closed while it sat idle (llama.cpp closes after every stream although it says Keep-Alive) shows up as
the end of the stream before any byte of an answer: such a request is sent once more on a new
connection, which is safe because the server read none of it. `fresh=True` (a check that needs every
request on a connection of its own, e.g. the request-id audit) sends `Connection: close` and never
retries, as the httpx client did.

Errors are raised as httpx's (ConnectError, RemoteProtocolError, ReadError) with the same wording, so a
request fails with the same message on either client. Answers that are not an event stream are handed
over as an httpx.Response (status, headers, body) for the same messages (kvtui.remote.reach.answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator

import httpx

HEAD_LIMIT = 1 << 16  # bytes of a status line and headers, at most


def usable(url: str, transport=None) -> bool:
    """Whether the lean client can carry requests to `url`: plain http://, no test transport, and no proxy
    from the environment that httpx would go through (those go on httpx)."""
    if transport is not None:
        return False
    parsed = httpx.URL(url)
    if parsed.scheme != "http" or not parsed.host:
        return False
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parsed.host):
        return False
    return True


class _Connection:
    """One TCP connection (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def alive(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class WireResponse:
    """One answer's status and headers; its body read with `lines()` or `aread()`, once.

    Attributes:
        status_code: the HTTP status. reason_phrase: its text. headers: names lower-cased.
    """

    def __init__(self, pool: WirePool, conn: _Connection, status: int, reason: str, headers: dict[str, str],
                 url: str, reusable: bool) -> None:
        self._pool, self._conn, self._url = pool, conn, url
        self.status_code, self.reason_phrase, self.headers = status, reason, headers
        self._reusable = reusable
        self._done = False
        self._lines: AsyncIterator | None = None
        encoding = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in encoding
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked, by length, or to the close)."""
        reader = self._conn.reader
        try:
            if self._chunked:
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the empty line
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._left is not None:
                while self._left > 0:
                    data = await reader.read(min(self._left, 1 << 16))
                    if not data:
                        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
                    self._left -= len(data)
                    yield data
            else:
                self._reusable = False
                while data := await reader.read(1 << 16):
                    yield data
        except asyncio.IncompleteReadError:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body "
                                            "(incomplete chunked read)") from None
        except (ConnectionError, OSError) as e:
            raise httpx.ReadError(str(e)) from None
        self._done = True

    @property
    def path(self) -> str:
        """The request's path (for messages)."""
        return httpx.URL(self._url).path

    def lines(self) -> AsyncIterator[str]:
        """The body's lines as text (UTF-8, undecodable bytes replaced), without their line ends (\\n or
        \\r\\n); one iterator per answer (this or `byte_lines`)."""
        if self._lines is None:
            self._lines = self._decoded(self.byte_lines())
        return self._lines

    def byte_lines(self) -> AsyncIterator[bytes]:
        """The body's lines as bytes, without their line ends (\\n or \\r\\n): what the load's stream reader
        keeps as it arrives, decoding nothing (kvtui.remote.openai); one iterator per answer."""
        if self._lines is None:
            self._lines = self._iter_lines()
        return self._lines

    @staticmethod
    async def _decoded(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
        async for line in lines:
            yield line.decode("utf-8", "replace")

    async def finish(self, timeout_s: float) -> None:
        """Read what is left of the body (e.g. after `data: [DONE]`) for at most `timeout_s` seconds, so the
        connection can be reused; a body that does not end by then leaves it to be closed."""
        if self._done:
            return
        try:
            await asyncio.wait_for(self._drain(), timeout_s)
        except (asyncio.TimeoutError, httpx.HTTPError):
            self._reusable = False

    async def _drain(self) -> None:
        async for _ in self.byte_lines():
            pass

    async def _iter_lines(self) -> AsyncIterator[bytes]:
        rest = b""
        async for data in self._pieces():
            if rest:
                data = rest + data
            parts = data.split(b"\n")
            rest = parts.pop()
            for part in parts:
                yield part[:-1] if part.endswith(b"\r") else part
        if rest:
            yield rest.rstrip(b"\r")

    async def aread(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self._pieces()])

    def as_httpx(self, body: bytes) -> httpx.Response:
        """This answer as an httpx.Response with `body` (for kvtui.remote.reach's wording)."""
        return httpx.Response(self.status_code, headers=self.headers, content=body,
                              request=httpx.Request("POST", self._url))

    def release(self) -> None:
        """Back to the pool when read to its end and the connection may be reused; else closed."""
        if self._done and self._reusable:
            self._pool._put(self._conn)
        else:
            self._conn.close()


class WirePool:
    """Keep-alive connections to one http:// origin.

    Args:
        base_url: http://HOST[:PORT][/PREFIX]; request paths are added to it.
        fresh: every request on a new connection with `Connection: close`, no retry (see the module).
        max_idle: idle connections kept at most.
    """

    def __init__(self, base_url: str, *, fresh: bool = False, max_idle: int = 1024) -> None:
        url = httpx.URL(base_url.rstrip("/"))
        self.host, self.port = url.host, url.port or 80
        self.prefix = url.raw_path.decode().rstrip("/")
        self.authority = f"{self.host}:{url.port}" if url.port else self.host
        self.base_url = str(url)
        self.fresh, self.max_idle = fresh, max_idle
        self._idle: list[_Connection] = []
        self.opened = 0  # connections opened so far (the pool's reuse shows as opened << requests)
        self.retried = 0  # requests sent again because their idle connection had been closed

    def _put(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle and conn.alive():
            self._idle.append(conn)
        else:
            conn.close()

    def _take(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.alive():
                return conn
            conn.close()
        return None

    async def _open(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT)
        except OSError as e:
            raise httpx.ConnectError(str(e)) from None
        self.opened += 1
        return _Connection(reader, writer)

    def _head(self, path: str, length: int, headers: dict) -> bytes:
        lines = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.authority}", "Accept: */*",
                 "User-Agent: kvtui", "Content-Type: application/json", f"Content-Length: {length}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if self.fresh:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes, headers: dict | None = None) -> AsyncIterator[WireResponse]:
        """POST `body` (JSON bytes) to `path`; yields the answer once its headers are read. Leaving early
        (an error, a cancel, a timeout) closes the connection.

        Raises:
            httpx.ConnectError: no connection. httpx.RemoteProtocolError: the server closed the connection
            before answering, or answered something that is not HTTP/1.x. httpx.ReadError: a socket error.
        """
        request = self._head(path, len(body), headers or {}) + body
        conn = None if self.fresh else self._take()
        reused = conn is not None
        if conn is None:
            conn = await self._open()
        try:
            try:
                response = await self._exchange(conn, request, path)
            except _Stale:
                conn.close()
                if not reused:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from None
                self.retried += 1
                conn = await self._open()  # the idle connection had been closed: the server read nothing
                response = await self._exchange(conn, request, path)
        except _Stale:
            conn.close()
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from None
        except BaseException:
            conn.close()
            raise
        try:
            yield response
        except BaseException:
            conn.close()
            raise
        response.release()

    async def _exchange(self, conn: _Connection, request: bytes, path: str) -> WireResponse:
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise _Stale from None
            raise httpx.RemoteProtocolError("Server disconnected without sending a complete response.") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Stale from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError("the answer's headers are over 64 KiB") from None
        except OSError as e:
            raise httpx.ReadError(str(e)) from None
        lines = head[:-4].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status_text, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not status_text.isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        connection = headers.get("connection", "").lower()
        reusable = not self.fresh and "close" not in connection and version != "HTTP/1.0"
        return WireResponse(self, conn, int(status_text), reason, headers, f"{self.base_url}{path}", reusable)

    async def aclose(self) -> None:
        """Close the idle connections."""
        while self._idle:
            self._idle.pop().close()


class _Stale(Exception):
    """The connection ended before any byte of an answer."""
