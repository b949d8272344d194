"""The sending side of a transfer: a TLS server that streams the volumes and snapshots of this
node's pool to the drivers of other nodes.

It speaks just enough HTTP/1.1 that an operator can ask it with curl and read why it refused:
one request per connection, `HEAD` to describe a source, `GET ...?from_region=K` to stream it from
region K (the body is the framed stream of csi_driver.transfer.wire, ended by closing the
connection). Every refusal is a status and one line of text; a traceback stays in the log.

Who may ask is decided outside: `authenticate` turns the request's bearer token into the node it
belongs to (the driver checks it with a TokenReview) or raises TransferDenied, and the node the
request names must be that node. What may be sent is decided outside too: `Sources` says which
files are ready and holds the driver's per-id lock while one is streamed, so nothing writes it
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import os
import ssl
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from controller_runtime.logs import get_logger

from ..backend import files
from ..errors import CsiError
from ..validation import check_id
from . import wire
from .errors import TransferDenied

log = get_logger("csi.transfer.server")

Authenticate = Callable[[str], Awaitable[str]]
# Path collection -> the kind Sources.describe takes.
KINDS = {"volumes": "volume", "snapshots": "snapshot"}
NODE_HEADER = "X-Kubeloop-Node"
# How long a client may take to send its request head (a stalled one must not hold a slot).
REQUEST_TIMEOUT = 30.0
# Sources whose region digests are remembered for a resume: 32 bytes per 8 MiB region, so 400 KB
# for a 100 GiB volume at most.
DIGEST_CACHE_SIZE = 16


class Sources(Protocol):
    def describe(self, kind: str, source_id: str) -> wire.SourceInfo | None:
        """The file of a volume or snapshot ("volume" | "snapshot") of this node's pool; None
        unless it is there and ready."""

    def hold(self, source_id: str) -> AbstractAsyncContextManager[None]:
        """The driver's lock on that id, held while its file is streamed."""


def file_generation(path: str) -> str:
    """A generation for SourceInfo: it changes whenever the file may have changed (a write moves
    its mtime, a replacement its inode). Blocking."""
    st = os.stat(path, follow_symlinks=False)
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


@dataclass
class Region:
    """One region as it goes out: the pieces to write in order, and its digest (sent last)."""

    pieces: list[bytes] = field(default_factory=list)
    digest: bytes = b""


class _Refused(Exception):
    def __init__(self, status: http.HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class _Request:
    method: str
    kind: str
    source_id: str
    from_region: int
    peer: str


class TransferServer:
    def __init__(
        self,
        *,
        node: str,
        sources: Sources,
        authenticate: Authenticate,
        ssl_context: ssl.SSLContext,
        host: str = "0.0.0.0",
        port: int = 0,
    ) -> None:
        self.node = node
        self._sources = sources
        self._authenticate = authenticate
        self._ssl = ssl_context
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # (kind, id, generation) -> the region digests of the file from region 0, as far as known
        self._digests: dict[tuple[str, str, str], list[bytes]] = {}

    @property
    def port(self) -> int:
        """The bound port (the one the kernel chose for port 0)."""
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle,
            self._host,
            self._port,
            ssl=self._ssl,
            limit=wire.HEAD_LIMIT,
            ssl_handshake_timeout=REQUEST_TIMEOUT,
        )
        log.info("transfer server listening", node=self.node, port=self.port)

    async def stop(self) -> None:
        """Stops accepting, then cancels the streams in flight: their clients see a cut stream and
        resume from their last durable region on the next try."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    # --- one connection ---------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Connection(writer, peer=str(writer.get_extra_info("peername")))
        try:
            try:
                await self._exchange(reader, conn)
            except _Refused as r:
                if conn.answered:
                    raise
                log.info("transfer refused", peer=conn.peer, status=int(r.status), reason=r.message)
                await conn.reply(r.status, {}, r.message)
            except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
                raise
            except Exception as e:
                if conn.answered:
                    raise
                log.exception("transfer request failed", peer=conn.peer)
                await conn.reply(http.HTTPStatus.INTERNAL_SERVER_ERROR, {}, f"internal error: {e}")
            await conn.close()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            log.info("transfer connection lost", peer=conn.peer, error=str(e) or type(e).__name__)
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()  # stop(): the client resumes later
        except Exception:
            log.exception("transfer stream failed", peer=conn.peer)
            writer.transport.abort()  # the client sees a cut stream, never a bogus end
        finally:
            self._tasks.discard(task)

    async def _exchange(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                conn.method, headers, target = await self._read_request(reader)
        except TimeoutError:
            raise _Refused(
                http.HTTPStatus.REQUEST_TIMEOUT, f"no request within {REQUEST_TIMEOUT:g} s"
            ) from None
        req = await self._admit(conn.method, target, headers, conn.peer)
        await self._serve(req, conn)

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, dict[str, str], str]:
        try:
            block = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(
                http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large"
            ) from None
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise ConnectionResetError("closed without a request") from None
            raise _Refused(http.HTTPStatus.BAD_REQUEST, "request head cut short") from None
        try:
            first, headers = wire.parse_head(block)
        except wire.WireError as e:
            raise _Refused(http.HTTPStatus.BAD_REQUEST, e.args[0]) from None
        parts = first.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Refused(http.HTTPStatus.BAD_REQUEST, f"not an HTTP/1.x request line: {first[:80]!r}")
        return parts[0], headers, parts[1]

    async def _admit(self, method: str, target: str, headers: dict[str, str], peer: str) -> _Request:
        """Who asks (401, 403), then what they ask for (405, 404, 400)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _Refused(
                http.HTTPStatus.UNAUTHORIZED, "a bearer token is required (Authorization: Bearer ...)"
            )
        try:
            who = await self._authenticate(token.strip())
        except TransferDenied as e:
            raise _Refused(http.HTTPStatus.UNAUTHORIZED, e.message) from None
        except Exception as e:
            log.exception("cannot authenticate a transfer request", peer=peer)
            raise _Refused(
                http.HTTPStatus.SERVICE_UNAVAILABLE, f"cannot authenticate the token now: {e}"
            ) from None
        node = headers.get(NODE_HEADER.lower(), "")
        if not node:
            raise _Refused(http.HTTPStatus.BAD_REQUEST, f"the {NODE_HEADER} header is required")
        if who != node:
            raise _Refused(
                http.HTTPStatus.FORBIDDEN,
                f"the token belongs to node {who}, but the request says node {node}",
            )
        if method not in ("HEAD", "GET"):
            raise _Refused(
                http.HTTPStatus.METHOD_NOT_ALLOWED, f"method {method[:20]!r} is not allowed; use HEAD or GET"
            )
        url = urlsplit(target)
        collection, sep, raw_id = url.path.removeprefix("/v1/").partition("/")
        kind = KINDS.get(collection) if url.path.startswith("/v1/") and sep else None
        if kind is None:
            raise _Refused(
                http.HTTPStatus.NOT_FOUND,
                f"no such path {url.path[:100]!r}; use /v1/volumes/<id> or /v1/snapshots/<id>",
            )
        source_id = unquote(raw_id)
        try:
            check_id(source_id, f"{kind} id")
        except CsiError as e:
            raise _Refused(http.HTTPStatus.BAD_REQUEST, e.message) from None
        values = parse_qs(url.query).get("from_region", ["0"])
        if len(values) != 1 or not values[0].isdecimal():
            raise _Refused(
                http.HTTPStatus.BAD_REQUEST,
                f"from_region must be one non-negative integer, not {'&'.join(values)!r}",
            )
        return _Request(method, kind, source_id, int(values[0]), peer=f"{node} {peer}")

    async def _serve(self, req: _Request, conn: _Connection) -> None:
        if req.method == "HEAD":
            info = self._describe(req)
            await conn.reply(http.HTTPStatus.OK, wire.source_headers(info), "")
            return
        async with self._sources.hold(req.source_id):
            info = self._describe(req)  # under the lock: the file cannot change from here on
            regions = wire.region_count(info.size)
            if req.from_region > regions:
                raise _Refused(
                    http.HTTPStatus.BAD_REQUEST,
                    f"from_region {req.from_region} is past the end ({info.size} bytes: {regions} regions)",
                )
            try:
                fd = await asyncio.to_thread(files.open_regular, info.path, os.O_RDONLY)
            except FileNotFoundError:
                raise self._absent(req) from None
            try:
                await self._stream(req, info, fd, conn)
            finally:
                os.close(fd)

    def _describe(self, req: _Request) -> wire.SourceInfo:
        info = self._sources.describe(req.kind, req.source_id)
        if info is None:
            raise self._absent(req)
        return info

    def _absent(self, req: _Request) -> _Refused:
        return _Refused(
            http.HTTPStatus.NOT_FOUND, f"{req.kind} {req.source_id} is not in the pool of node {self.node}"
        )

    async def _stream(self, req: _Request, info: wire.SourceInfo, fd: int, conn: _Connection) -> None:
        regions = wire.region_count(info.size)
        # The whole-file digest covers every region; the receiver holds the digests of those it
        # already has. This side remembers what it sent of this generation (the usual resume:
        # the network failed, this process lived on) and reads again only what it does not.
        key = (req.kind, req.source_id, info.generation)
        digests = self._digests.pop(key, [])[: req.from_region]
        for i in range(len(digests), req.from_region):
            digests.append((await asyncio.to_thread(self.read_region, fd, i, info.size)).digest)
        self._digests[key] = digests  # the newest last; the list grows as regions go out
        while len(self._digests) > DIGEST_CACHE_SIZE:
            del self._digests[next(iter(self._digests))]
        # No Content-Length: the body ends with the connection, after the end marker.
        writer = conn.send_head(
            http.HTTPStatus.OK, {**wire.source_headers(info), "Content-Type": "application/octet-stream"}
        )
        log.info(
            "transfer started", peer=req.peer, kind=req.kind, id=req.source_id, from_region=req.from_region
        )
        sent = 0
        for index in range(req.from_region, regions):
            region = await asyncio.to_thread(self.read_region, fd, index, info.size)
            digests.append(region.digest)
            sent += await self.send_region(writer, index, region)
        writer.write(wire.end_frame(regions) + wire.whole_digest(digests))
        await writer.drain()
        log.info(
            "transfer sent",
            peer=req.peer,
            kind=req.kind,
            id=req.source_id,
            regions=regions - req.from_region,
            bytes=sent,
        )

    async def send_region(self, writer: asyncio.StreamWriter, index: int, region: Region) -> int:
        """Writes one region and its digest; returns the bytes sent. The tests override it to
        corrupt or cut a stream."""
        for piece in region.pieces:
            writer.write(piece)
        writer.write(region.digest)
        await writer.drain()  # at most one region waits in the transport
        return sum(map(len, region.pieces))

    def read_region(self, fd: int, index: int, size: int) -> Region:
        """Reads one region's allocated extents and frames them (blocking: runs in a thread).
        Holds at most the region's data."""
        start, end = wire.region_bounds(index, size)
        spans = list(files.extents(fd, start, end))
        frame = wire.region_frame(index, len(spans))
        region = Region([frame])
        digest = wire.RegionDigest(frame)
        for offset, length in spans:
            data = os.pread(fd, length, offset)
            if len(data) != length:  # the file shrank under the lock: never send a short extent
                raise OSError(f"short read at {offset}: {len(data)} of {length} bytes")
            head = wire.extent_header(offset, length)
            digest.update(head)
            digest.update(data)
            region.pieces += (head, data)
        region.digest = digest.digest()
        return region


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    peer: str
    method: str = ""
    answered: bool = False  # once the status line is out, a failure can only cut the stream

    def send_head(self, status: http.HTTPStatus, headers: dict[str, str]) -> asyncio.StreamWriter:
        self.writer.write(
            wire.render_head(f"HTTP/1.1 {status.value} {status.phrase}", {**headers, "Connection": "close"})
        )
        self.answered = True
        return self.writer

    async def reply(self, status: http.HTTPStatus, headers: dict[str, str], message: str) -> None:
        """A whole response: the status, `headers`, and for a refusal its one line (in a header
        too, so the caller of a HEAD, which has no body, reads it as well)."""
        text = (wire.one_line(message) + "\n").encode() if message else b""
        head = dict(headers)
        if message:
            head[wire.ERROR_HEADER] = message
            head["Content-Type"] = "text/plain; charset=utf-8"
        head["Content-Length"] = str(len(text))
        self.send_head(status, head)
        if self.method != "HEAD":
            self.writer.write(text)
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        # A peer that never answers TLS's close_notify must not keep the task alive.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self.writer.wait_closed()
