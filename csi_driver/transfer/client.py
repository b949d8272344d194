"""The receiving side of a transfer: pulls a peer's volume or snapshot file into this node's pool.

The file is written as `<final>.part`, beside a progress record `<final>.part.progress` (the
source's generation and size and the digest of every region already durable in the part). A pull
killed at any instant, on either side, is resumed by calling `pull` again with the same arguments:
it asks for the first region the record does not cover, unless the source's generation changed,
which starts over. Only a verified stream becomes the final file (rename, then the directory's
fsync); a stream that proves corrupt leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from controller_runtime.files import fsync_dir
from controller_runtime.logs import get_logger

from ..backend.store import write_json_atomic
from . import wire
from .errors import BadRequest, CorruptStream, SourceNotFound, StreamCut, TransferDenied, TransferError
from .server import NODE_HEADER

log = get_logger("csi.transfer.client")

# Every this many regions (64 MiB of file) the part is fsync'd and the progress recorded: a kill
# loses at most that much, and an fsync per region would cost more than the network does.
DURABLE_EVERY = 8
# A peer silent this long (a connect, a response head, the next piece of the stream) is a cut stream.
IDLE_TIMEOUT = 60.0
# The slowest a server is expected to read a resumed part again (bytes/s), when it must.
REREAD_RATE = 64 << 20
PATHS = {"volume": "volumes", "snapshot": "snapshots"}
_REFUSALS: dict[int, type[TransferError]] = {400: BadRequest, 405: BadRequest, 401: TransferDenied}
_REFUSALS |= {403: TransferDenied, 404: SourceNotFound}
# The reader's buffer: it bounds the response head too, and a buffer as large as a chunk keeps the
# transport from pausing and resuming many times per chunk.
_BUFFER = wire.CHUNK
_CUT = (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, TimeoutError, OSError)


@dataclass(frozen=True)
class Peer:
    """Where and as whom to ask."""

    endpoint: tuple[str, int]
    ssl_context: ssl.SSLContext
    server_hostname: str
    token: str
    node: str
    idle_timeout: float = IDLE_TIMEOUT

    def __str__(self) -> str:
        return f"{self.server_hostname} at {self.endpoint[0]}:{self.endpoint[1]}"


@dataclass(frozen=True)
class PullResult:
    source: wire.RemoteSource
    resumed_from: int  # the first region this call received (0: from the start)
    regions_received: int
    bytes_received: int  # extent data only: holes are never sent
    digest: str  # the whole-file digest, hex


@dataclass
class Progress:
    """The part's durable state: what `digests` lists is fsync'd in the part."""

    generation: str
    region_size: int
    source_size: int
    digests: list[str]


def part_paths(final_path: str) -> tuple[str, str]:
    """The part file and its progress record."""
    return final_path + ".part", final_path + ".part.progress"


def discard(final_path: str) -> None:
    """Removes a pull's part and progress (a deleted volume, an abandoned move). Blocking."""
    for path in part_paths(final_path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fsync_dir(os.path.dirname(final_path) or ".")


class _Response:
    """One response: its status and headers, and the rest of the connection as its body."""

    def __init__(self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    async def read(self, n: int) -> bytes:
        """Exactly `n` bytes of the body; StreamCut when the connection fails or ends first."""
        try:
            async with asyncio.timeout(self.peer.idle_timeout):
                return await self.reader.readexactly(n)
        except _CUT as e:
            raise StreamCut(str(e) or type(e).__name__) from e

    def refusal(self, body: bytes) -> TransferError:
        message = self.headers.get(wire.ERROR_HEADER.lower()) or body.decode(errors="replace").strip()
        message = message or f"{self.peer} answered {self.status} without a reason"
        return _REFUSALS.get(self.status, TransferError)(message, self.status)

    def close(self) -> None:
        self.writer.transport.abort()  # nothing more is wanted from this connection


async def _request(peer: Peer, method: str, kind: str, source_id: str, from_region: int = 0) -> _Response:
    """Sends one request and reads its response head; a refusal raises with the server's reason."""
    collection = PATHS.get(kind)
    if collection is None:
        raise BadRequest(f"unknown kind {kind!r}: volume or snapshot")
    target = f"/v1/{collection}/{quote(source_id, safe='')}" + (
        f"?from_region={from_region}" if method == "GET" else ""
    )
    host, port = peer.endpoint
    try:
        async with asyncio.timeout(peer.idle_timeout):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=peer.ssl_context, server_hostname=peer.server_hostname, limit=_BUFFER
            )
    except _CUT as e:
        raise StreamCut(f"cannot reach {peer}: {e or type(e).__name__}") from e
    resp = _Response(peer, reader, writer)
    try:
        headers = {
            "Host": peer.server_hostname,
            "Authorization": f"Bearer {peer.token}",
            NODE_HEADER: peer.node,
        }
        writer.write(wire.render_head(f"{method} {target} HTTP/1.1", headers))
        # A server that no longer remembers the digests of the regions before from_region reads
        # them again before it answers: allow for that.
        async with asyncio.timeout(peer.idle_timeout + from_region * wire.REGION / REREAD_RATE):
            block = await reader.readuntil(b"\r\n\r\n")
        first, resp.headers = wire.parse_head(block)
        version, _, rest = first.partition(" ")
        code = rest.partition(" ")[0]
        if not version.startswith("HTTP/1.") or not code.isdecimal():
            raise wire.WireError(f"not an HTTP/1.x status line: {first[:80]!r}")
        resp.status = int(code)
        if resp.status != 200:
            body = b""
            if method != "HEAD":
                with contextlib.suppress(*_CUT):
                    async with asyncio.timeout(peer.idle_timeout):
                        body = await reader.read(4096)
            raise resp.refusal(body)
        return resp
    except BaseException as e:
        resp.close()
        if isinstance(e, asyncio.LimitOverrunError | wire.WireError):
            raise CorruptStream(f"{peer} sent a malformed response head: {e}") from e
        if isinstance(e, _CUT):
            raise StreamCut(f"{peer} cut the connection before its response: {e or type(e).__name__}") from e
        raise


async def describe(
    endpoint: tuple[str, int],
    ssl_context: ssl.SSLContext,
    server_hostname: str,
    token: str,
    node: str,
    kind: str,
    source_id: str,
) -> wire.RemoteSource | None:
    """What a peer holds of `kind` ("volume" | "snapshot") `source_id` (HEAD); None when it has no
    ready one. Other refusals raise (TransferDenied, BadRequest, ...)."""
    try:
        return await _head(Peer(endpoint, ssl_context, server_hostname, token, node), kind, source_id)
    except SourceNotFound:
        return None


async def _head(peer: Peer, kind: str, source_id: str) -> wire.RemoteSource:
    resp = await _request(peer, "HEAD", kind, source_id)
    resp.close()
    return _source_of(resp)


def _source_of(resp: _Response) -> wire.RemoteSource:
    try:
        return wire.remote_source(resp.headers)
    except wire.WireError as e:
        raise CorruptStream(f"{resp.peer}: {e}") from e


async def pull(
    endpoint: tuple[str, int],
    ssl_context: ssl.SSLContext,
    server_hostname: str,
    token: str,
    node: str,
    kind: str,
    source_id: str,
    final_path: str,
    size: int,
) -> PullResult:
    """Pulls a peer's `kind` `source_id` into `final_path`, at least `size` bytes long (a volume
    made from a smaller source). Resumes a part left by an earlier call unless the source changed.

    Raises StreamCut when the connection fails (the part and its progress stay, for the next call),
    CorruptStream when the data is not the source's (both are removed), and the server's refusals.
    """
    peer = Peer(endpoint, ssl_context, server_hostname, token, node)
    part, progress_path = part_paths(final_path)
    done = await asyncio.to_thread(_load_progress, progress_path)
    if done is not None:
        # Asked first, so a source that changed (and maybe shrank below the part's regions) is
        # seen before the GET names a region; the GET's own headers are checked again below.
        now = await _head(peer, kind, source_id)
        if (done.generation, done.source_size) != (now.generation, now.size):
            done = None
    start = len(done.digests) if done else 0
    resp = await _request(peer, "GET", kind, source_id, start)
    source = _source_of(resp)
    if done is not None and (done.generation, done.source_size) != (source.generation, source.size):
        log.info("source changed since the part was begun: starting over", id=source_id, peer=str(peer))
        resp.close()
        done, start = None, 0
        resp = await _request(peer, "GET", kind, source_id, 0)
        source = _source_of(resp)
    if done is None:
        done = Progress(source.generation, source.region_size, source.size, [])
    receiver = _Receiver(resp, source, done, part, progress_path)
    try:
        receiver.fd = await asyncio.to_thread(_open_part, part, start * wire.REGION, source.size)
        whole = await receiver.receive(start)
        await receiver.settle()
        await asyncio.to_thread(
            _finish, receiver.take_fd(), part, progress_path, final_path, max(size, source.size)
        )
    except CorruptStream:
        await receiver.close()
        await asyncio.to_thread(discard, final_path)
        raise
    except StreamCut:
        await receiver.quiesce()
        await receiver.save()  # what arrived verified is kept: the next call starts after it
        raise
    finally:
        await receiver.close()
        resp.close()
    log.info(
        "pulled",
        kind=kind,
        id=source_id,
        peer=str(peer),
        from_region=start,
        regions=receiver.regions,
        bytes=receiver.received,
    )
    return PullResult(source, start, receiver.regions, receiver.received, whole.hex())


class _Receiver:
    """Reads the framed stream of one GET into the part file, region by region.

    Disk work runs in threads beside the network: each chunk is written while the next is read
    (one write in flight), and every DURABLE_EVERY regions the fsync and the progress record run
    while later regions arrive (one save in flight). Data is written before its region's digest
    is checked: a region that fails it condemns the whole part, and one cut short lies past what
    the progress records, which the next pull truncates away.
    """

    def __init__(
        self, resp: _Response, source: wire.RemoteSource, done: Progress, part: str, progress: str
    ) -> None:
        self.resp = resp
        self.source = source
        self.done = done
        self.part = part
        self.progress_path = progress
        self.fd = -1
        self.pending = 0  # regions verified since the last save began
        self.regions = 0
        self.received = 0
        self._write: asyncio.Future[None] | None = None
        self._save: asyncio.Future[None] | None = None

    async def receive(self, start: int) -> bytes:
        """Every region from `start`, then the end; the whole-file digest once it matched."""
        size = self.source.size
        index = start
        try:
            while True:
                frame_bytes = await self.resp.read(wire.FRAME.size)
                frame = wire.parse_frame(frame_bytes, index, size)
                if isinstance(frame, wire.End):
                    break
                await self._region(frame, frame_bytes)
                index += 1
            claimed = await self.resp.read(wire.DIGEST_SIZE)
        except wire.WireError as e:
            raise CorruptStream(f"{self.resp.peer} broke the stream format at region {index}: {e}") from e
        except StreamCut as e:
            raise StreamCut(f"{self.resp.peer} cut the stream at region {index}: {e.message}") from e
        whole = wire.whole_digest(bytes.fromhex(d) for d in self.done.digests)
        if claimed != whole:
            raise CorruptStream(f"the file from {self.resp.peer} does not match its whole-file digest")
        return whole

    async def _region(self, frame: wire.RegionStart, frame_bytes: bytes) -> None:
        start, end = wire.region_bounds(frame.index, self.source.size)
        digest = wire.RegionDigest(frame_bytes)
        after = start
        for _ in range(frame.extents):
            head = await self.resp.read(wire.EXTENT.size)
            offset, length = wire.parse_extent(head, after, end)
            digest.update(head)
            for pos in range(offset, offset + length, wire.CHUNK):
                data = await self.resp.read(min(wire.CHUNK, offset + length - pos))
                digest.update(data)
                await _done(self._write)
                self._write = _in_thread(_pwrite_all, self.fd, [(pos, data)])
                self.received += len(data)
            after = offset + length
        if await self.resp.read(wire.DIGEST_SIZE) != digest.digest():
            raise CorruptStream(f"region {frame.index} from {self.resp.peer} does not match its digest")
        await _done(self._write)  # the region is in the part (a save covers only whole regions)
        self.done.digests.append(digest.digest().hex())
        self.regions += 1
        self.pending += 1
        if self.pending >= DURABLE_EVERY:
            await _done(self._save)
            self._save = _in_thread(_save, self.fd, self.progress_path, self._snapshot())
            self.pending = 0

    def _snapshot(self) -> Progress:
        """The progress as it stands: a save records this while later regions go on arriving."""
        return dataclasses.replace(self.done, digests=list(self.done.digests))

    async def save(self) -> None:
        """Makes the regions received so far durable, then records them (in that order: the
        record never claims a region the part might lose). Nothing may be in flight."""
        if self.pending and self.fd >= 0:
            await asyncio.to_thread(_save, self.fd, self.progress_path, self._snapshot())
            self.pending = 0

    async def settle(self) -> None:
        """Waits for the write and the save in flight; their failure is this pull's."""
        await _done(self._write)
        await _done(self._save)

    async def quiesce(self) -> None:
        """Waits for the threads that use the descriptor, whatever became of their work."""
        for work in (self._write, self._save):
            with contextlib.suppress(Exception):
                await _done(work)

    def take_fd(self) -> int:
        fd, self.fd = self.fd, -1
        return fd

    async def close(self) -> None:
        if self.fd >= 0:
            await self.quiesce()
            os.close(self.take_fd())


def _in_thread(func: Callable[..., None], *args: Any) -> asyncio.Future[None]:
    return asyncio.ensure_future(asyncio.to_thread(func, *args))


async def _done(work: asyncio.Future[None] | None) -> None:
    """Waits for work in a thread. Shielded: a cancelled pull still waits for it, in `close`,
    before the descriptor it uses is closed."""
    if work is not None:
        await asyncio.shield(work)


# --- blocking file work (each runs in a thread) ---------------------------------------------------


def _load_progress(path: str) -> Progress | None:
    """The progress record, or None when there is none or it is not one this code wrote (then the
    pull starts over, which is always safe)."""
    try:
        doc = json.loads(Path(path).read_text())
        progress = Progress(**doc)
    except (OSError, ValueError, TypeError):
        return None
    digests_ok = all(isinstance(d, str) and len(d) == 2 * wire.DIGEST_SIZE for d in progress.digests)
    try:
        digests_ok = digests_ok and all(bytes.fromhex(d) for d in progress.digests)
    except ValueError:
        return None
    if progress.region_size != wire.REGION or not digests_ok:
        return None
    if not isinstance(progress.source_size, int) or len(progress.digests) > wire.region_count(
        progress.source_size
    ):
        return None
    return progress


def _open_part(path: str, keep: int, size: int) -> int:
    """Opens the part (created if missing, never through a symlink), drops whatever lies past the
    `keep` bytes the progress covers (a killed pull may have written regions it never recorded),
    and gives it the source's size: what is not written stays a hole."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, min(keep, size))
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, writes: list[tuple[int, bytes]]) -> None:
    for offset, data in writes:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def _save(fd: int, progress_path: str, progress: Progress) -> None:
    os.fsync(fd)
    write_json_atomic(Path(progress_path), dataclasses.asdict(progress))


def _finish(fd: int, part: str, progress_path: str, final_path: str, size: int) -> None:
    """The verified part becomes the final file, durably; then its progress goes."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(part, final_path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(progress_path)
    fsync_dir(os.path.dirname(final_path) or ".")
