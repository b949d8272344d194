"""The API client's transport: HTTP/1.1 over asyncio's streams, with kept connections.

It replaces aiohttp under `controller_runtime.client` (issue 49). aiohttp cost every process that
talks to the apiserver 7 MiB of anonymous memory at import (with yarl, multidict and their C
parts), and its request path (URL objects, cookie and trace hooks, multidicts) a share of the
provisioner's CPU per claim. The API client needs little of it: JSON requests with a known length,
answers with a Content-Length or chunked, watches as a chunked stream, TLS, and a few kept
connections. Go's net/http does the same for client-go when HTTP/2 is off.

What a caller sees when the transport fails, never a bare socket error:

- `CannotConnect`: no connection could be made (refused, unreachable, TLS handshake refused);
- `Disconnected`: the server closed or reset the connection, or sent what is not HTTP/1.1, before
  the whole answer was read; for a watch, the stream ended without its last chunk;
- `TimeoutError`: the request's time ran out (asyncio's, as aiohttp raised it).

Both are ConnectionErrors, so OSError handlers catch them. A connection is only kept for reuse
after an answer was read to its end; anything else (a timeout, a cancel, a malformed answer) drops
it, since its state is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import quote, urlsplit

__all__ = ["Answer", "CannotConnect", "ConnectionPool", "Disconnected", "Streamed", "TransportError"]


class TransportError(ConnectionError):
    """The request failed below HTTP: see CannotConnect and Disconnected."""


class CannotConnect(TransportError):
    """No connection to the server could be made; nothing was sent."""


class Disconnected(TransportError):
    """The connection ended (or the server sent what cannot be read) before the whole answer."""


# Methods sent again, once, when a kept connection turns out closed by the server before any byte
# of the answer came back: as Go's transport retries only replayable requests, since a write may
# have reached the server before it closed.
_REPLAYABLE = frozenset({"GET", "HEAD"})
_NO_BODY_STATUS = frozenset({204, 304})
# Characters a request target keeps as they are. resources.Resource.path has encoded the names in
# it; a target that still holds a space, a control character or a non-ASCII one (which would break
# or split the request line) is percent-encoded, as Go's url.URL.EscapedPath encodes it.
_TARGET_SAFE = "/?&=%:+,;@!$'()*~"
_UNSAFE = re.compile(r"[^\x21-\x7e]")


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: status, headers (names in lower case; repeated ones joined by ', ') and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def charset(self) -> str:
        for param in self.headers.get("content-type", "").split(";")[1:]:
            key, _, value = param.strip().partition("=")
            if key.lower() == "charset" and value:
                return value.strip('"')
        return "utf-8"


class _Connection:
    __slots__ = ("idle_since", "reader", "reused", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.idle_since = 0.0

    def open(self) -> bool:
        # A server that closed an idle connection has already fed its EOF to the reader.
        return not (self.reader.at_eof() or self.writer.is_closing())

    def drop(self) -> None:
        # abort, not close: the connection's state is unknown or done with, and a TLS close would
        # wait for the peer's close_notify.
        self.writer.transport.abort()


class _Head:
    __slots__ = ("headers", "keep", "status")

    def __init__(self, status: int, headers: dict[str, str], keep: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep = keep


class ConnectionPool:
    """Connections to one server (`http://host:port` or `https://...`), at most `limit` at once
    (0: no cap), kept `idle_s` seconds after their last answer. `headers` go with every request."""

    def __init__(
        self,
        server: str,
        ssl_context: ssl.SSLContext | None,
        *,
        limit: int,
        headers: dict[str, str],
        idle_s: float = 90.0,
    ) -> None:
        url = urlsplit(server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) server URL: {server!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl_context if url.scheme == "https" else None
        self._base = url.path.rstrip("/")
        host_header = url.netloc.rpartition("@")[2]
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host_header, **headers}.items())
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit) if limit > 0 else None
        self._idle_s = idle_s
        self._closed = False

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(
                self._host, self._port, ssl=self._ssl, server_hostname=self._host if self._ssl else None
            )
        except (OSError, ssl.SSLError) as e:
            raise CannotConnect(f"cannot connect to {self._host}:{self._port}: {e}") from e
        return _Connection(reader, writer)

    async def _take(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.open() and now - conn.idle_since < self._idle_s:
                conn.reused = True
                return conn
            conn.drop()
        return await self._connect()

    def _give_back(self, conn: _Connection) -> None:
        if self._closed or not conn.open():
            conn.drop()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _head(self, method: str, target: str, headers: dict[str, str] | None, body: bytes | None) -> bytes:
        if _UNSAFE.search(target):
            target = quote(target, safe=_TARGET_SAFE)
        lines = [f"{method} {self._base}{target} HTTP/1.1\r\n", self._fixed]
        if headers:
            lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    async def _exchange_head(
        self, conn: _Connection, method: str, target: str, headers: dict[str, str] | None, body: bytes | None
    ) -> _Head:
        writer = conn.writer
        try:
            # One write: over TLS each write is a record and a send of its own.
            head = self._head(method, target, headers, body)
            writer.write(head + body if body else head)
            await writer.drain()
        except (ConnectionError, ssl.SSLError) as e:
            raise _ClosedBeforeAnswer(f"the connection closed before the request was sent: {e}") from None
        return await _read_head(conn.reader)

    async def request(
        self,
        method: str,
        target: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        timeout: float,
    ) -> Answer:
        """Sends one request and reads its whole answer, within `timeout` seconds (connecting,
        waiting for a free connection under the cap included)."""
        async with asyncio.timeout(timeout):
            if self._slots is None:
                return await self._request(method, target, headers, body)
            async with self._slots:
                return await self._request(method, target, headers, body)

    async def _request(
        self, method: str, target: str, headers: dict[str, str] | None, body: bytes | None
    ) -> Answer:
        while True:
            conn = await self._take()
            try:
                head = await self._exchange_head(conn, method, target, headers, body)
            except _ClosedBeforeAnswer as e:
                conn.drop()
                if conn.reused and method in _REPLAYABLE:
                    continue  # the server closed the kept connection; a fresh one, once per stale one
                raise Disconnected(str(e)) from None
            except BaseException as e:
                conn.drop()
                _reraise(e)
            break
        try:
            if method == "HEAD" or head.status in _NO_BODY_STATUS or head.status < 200:
                data = b""
            else:
                data = await _read_body(conn.reader, head)
        except BaseException as e:
            conn.drop()
            _reraise(e)
        if head.keep:
            self._give_back(conn)
        else:
            conn.drop()
        if head.headers.get("content-encoding", "").lower() == "gzip":
            try:
                data = zlib.decompress(data, 16 + zlib.MAX_WBITS)
            except zlib.error as e:
                raise Disconnected(f"the answer's gzip body cannot be read: {e}") from None
        return Answer(head.status, head.headers, data)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        target: str,
        *,
        headers: dict[str, str] | None = None,
        connect_timeout: float,
        read_timeout: float,
    ) -> AsyncIterator[Streamed]:
        """A request whose answer is read as it comes (a watch): the head within `connect_timeout`
        seconds, then each piece of the body within `read_timeout` of the one before."""
        async with asyncio.timeout(connect_timeout):
            conn = await self._take()
        try:
            async with asyncio.timeout(read_timeout):
                head = await self._exchange_head(conn, method, target, headers, None)
        except BaseException as e:
            conn.drop()
            _reraise(e)
        streamed = Streamed(conn.reader, head, read_timeout)
        try:
            yield streamed
        finally:
            if streamed.complete and head.keep:
                self._give_back(conn)
            else:
                conn.drop()

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().drop()


class Streamed:
    """An answer being read: its status and headers, then its body in pieces (`pieces`) or whole
    (`read`)."""

    def __init__(self, reader: asyncio.StreamReader, head: _Head, read_timeout: float) -> None:
        self.status = head.status
        self.headers = head.headers
        self._reader = reader
        self._head = head
        self._read_timeout = read_timeout
        self.complete = False

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._read_timeout):
                data = await _read_body(self._reader, self._head)
        except BaseException as e:
            _reraise(e)
        self.complete = True
        return data

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk of a chunked answer, else what each read returns.
        Ends when the body is complete; Disconnected when the connection ends before that."""
        reader, timeout, head = self._reader, self._read_timeout, self._head
        try:
            if _chunked(head):
                async for piece in _chunks(reader, timeout):
                    yield piece
            elif (length := _content_length(head)) is not None:
                while length > 0:
                    async with asyncio.timeout(timeout):
                        piece = await reader.read(min(length, 1 << 16))
                    if not piece:
                        raise _ClosedBeforeAnswer("the connection closed inside the body")
                    length -= len(piece)
                    yield piece
            else:
                while True:
                    async with asyncio.timeout(timeout):
                        piece = await reader.read(1 << 16)
                    if not piece:
                        break
                    yield piece
        except GeneratorExit:
            raise
        except BaseException as e:
            _reraise(e)
        self.complete = True


class _ClosedBeforeAnswer(Exception):
    """The connection ended, or the server sent what is not HTTP/1.1, where an answer was due."""


def _reraise(e: BaseException) -> NoReturn:
    """Raises what a caller sees of a failure inside an exchange: Disconnected for the
    connection's, the error itself for anything else (a timeout, a cancel)."""
    if isinstance(e, TransportError) or not isinstance(e, Exception):
        raise e
    if isinstance(e, _ClosedBeforeAnswer):
        raise Disconnected(str(e)) from None
    if isinstance(e, asyncio.IncompleteReadError):
        raise Disconnected("the server closed the connection before the whole answer was read") from None
    if isinstance(e, asyncio.LimitOverrunError | ValueError):
        raise Disconnected(f"the server's answer cannot be read: {e}") from e
    if isinstance(e, OSError) and not isinstance(e, TimeoutError):
        raise Disconnected(f"the connection failed: {e}") from e
    raise e


async def _read_head(reader: asyncio.StreamReader) -> _Head:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise _ClosedBeforeAnswer("the connection closed inside the answer's head") from None
        raise _ClosedBeforeAnswer("the server closed the connection before answering") from None
    except (ConnectionError, ssl.SSLError) as e:
        raise _ClosedBeforeAnswer(f"the server closed the connection before answering: {e}") from None
    lines = raw[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise _ClosedBeforeAnswer(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise _ClosedBeforeAnswer(f"a malformed header line: {line[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return _Head(int(code), headers, keep)


def _content_length(head: _Head) -> int | None:
    text = head.headers.get("content-length")
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"a Content-Length that is not a number: {text[:40]!r}")
    return int(text)


# The longest chunk-size or trailer line read: StreamReader's own limit for readuntil.
_MAX_LINE = 1 << 16


def _chunked(head: _Head) -> bool:
    return head.headers.get("transfer-encoding", "").lower().endswith("chunked")


async def _chunks(reader: asyncio.StreamReader, timeout: float | None) -> AsyncIterator[bytes]:
    """The chunks of a chunked body, each read within `timeout` of the one before (None: the
    caller bounds the whole). They are cut out of what each read returns rather than read one by
    one: a burst of watch events arrives in one read, and each read costs an await and a timer (8
    us of the 12 a watch event cost in a burst, measured)."""
    buf, pos = bytearray(), 0
    while True:
        eol = buf.find(b"\r\n", pos)
        wanted = 1 << 16
        if eol >= 0:
            size = _chunk_size_of(bytes(buf[pos:eol]))
            if size == 0:
                await _skip_trailers_after(reader, bytes(buf[eol + 2 :]), timeout)
                return
            end = eol + 2 + size
            if len(buf) >= end + 2:
                if buf[end : end + 2] != b"\r\n":
                    raise _ClosedBeforeAnswer("a chunk not followed by CRLF")
                pos = end + 2
                yield bytes(buf[eol + 2 : end])
                continue
            wanted = max(wanted, end + 2 - len(buf))
        elif len(buf) - pos > _MAX_LINE:
            raise _ClosedBeforeAnswer("a chunk-size line that does not end")
        async with asyncio.timeout(timeout):
            more = await reader.read(wanted)
        if not more:
            raise _ClosedBeforeAnswer("the connection closed inside the body")
        del buf[:pos]  # what was consumed; the bytearray grows in place, never copied whole
        buf += more
        pos = 0


def _chunk_size_of(line: bytes) -> int:
    size = int(line.partition(b";")[0].strip(), 16)  # ValueError for what is not hex
    if size < 0:
        raise ValueError(f"a negative chunk size: {line[:40]!r}")
    return size


async def _skip_trailers_after(reader: asyncio.StreamReader, rest: bytes, timeout: float | None) -> None:
    """Reads to the end of a chunked body whose last chunk is read: the trailer lines, if any, and
    the empty line. `rest` is what was read after the last chunk's size line."""
    while not (rest.startswith(b"\r\n") or b"\r\n\r\n" in rest):
        if len(rest) > _MAX_LINE:
            raise _ClosedBeforeAnswer("trailers that do not end")
        async with asyncio.timeout(timeout):
            more = await reader.read(1 << 16)
        if not more:
            raise _ClosedBeforeAnswer("the connection closed inside the trailers")
        rest += more


async def _read_body(reader: asyncio.StreamReader, head: _Head) -> bytes:
    if _chunked(head):
        return b"".join([piece async for piece in _chunks(reader, None)])
    length = _content_length(head)
    if length is not None:
        return await reader.readexactly(length) if length else b""
    head.keep = False  # the body ends where the connection does
    return await reader.read(-1)
