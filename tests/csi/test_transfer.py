"""The node-to-node transfer's data plane (csi_driver.transfer, issue 47): real sparse files in
tmp_path, a real TLS server on 127.0.0.1 with a throwaway CA, a dict of tokens standing in for the
TokenReview authenticator (tested with the driver). No root needed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller_runtime.certs import PKI
from csi_driver.backend import files
from csi_driver.transfer import client, wire
from csi_driver.transfer.errors import BadRequest, CorruptStream, SourceNotFound, StreamCut, TransferDenied
from csi_driver.transfer.server import Region, TransferServer, file_generation

MiB = 1 << 20
SERVER_NAME = "transfer.loop.csi.kubeloop.dev"
TOKENS = {"token-b": "node-b", "token-c": "node-c"}
# Data at scattered offsets of a 64 MiB file (8 regions): one region start, one across a region
# boundary, odd lengths, a whole MiB, the last bytes of the file; regions 2, 5 and 6 stay holes.
LAYOUT = [
    (0, 4096),
    (3 * MiB + 123, 5000),
    (8 * MiB - 100, 300),
    (24 * MiB, MiB),
    (57 * MiB + 7, 1),
    (64 * MiB - 4096, 4096),
]
SIZE = 64 * MiB


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts from a throwaway CA; the serving pair names SERVER_NAME only."""
    pki = PKI(tmp_path_factory.mktemp("pki"), ca_name="transfer-test-ca")
    ca = pki.ensure_ca()
    pair = pki.ensure_serving("transfer", SERVER_NAME, [SERVER_NAME], ())
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pair.cert, pair.key)
    return server, ssl.create_default_context(cafile=str(ca.cert))


@dataclass
class DirSources:
    """Sources from files named <id>.img in one directory per kind."""

    root: Path
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def path(self, kind: str, source_id: str) -> Path:
        return self.root / kind / f"{source_id}.img"

    def describe(self, kind: str, source_id: str) -> wire.SourceInfo | None:
        path = self.path(kind, source_id)
        if not path.exists():
            return None
        info = (str(path), path.stat().st_size, file_generation(str(path)))
        return wire.SourceInfo(*info, access_type="mount", fs_type="ext4")

    @contextlib.asynccontextmanager
    async def hold(self, source_id: str) -> AsyncIterator[None]:
        async with self.locks.setdefault(source_id, asyncio.Lock()):
            yield


class HookedServer(TransferServer):
    """Records the regions it reads and those it streams; can cut the stream before region
    `cut_at` (once) or flip a byte of region `corrupt`."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.read: list[int] = []
        self.streamed: list[int] = []
        self.cut_at: int | None = None
        self.corrupt: int | None = None

    def read_region(self, fd: int, index: int, size: int) -> Region:
        self.read.append(index)
        return super().read_region(fd, index, size)

    async def send_region(self, writer: asyncio.StreamWriter, index: int, region: Region) -> int:
        if index == self.cut_at:
            self.cut_at = None
            raise RuntimeError("test: stream cut")
        if index == self.corrupt:
            data = bytearray(region.pieces[-1])
            data[len(data) // 2] ^= 0x01
            region.pieces[-1] = bytes(data)
        self.streamed.append(index)
        return await super().send_region(writer, index, region)


async def authenticate(token: str) -> str:
    if token not in TOKENS:
        raise TransferDenied("the token is not valid: unknown to the test")
    return TOKENS[token]


@dataclass
class Env:
    server: HookedServer
    sources: DirSources
    client_tls: ssl.SSLContext
    dest: Path

    def source(self, source_id: str = "vol-1", kind: str = "volume") -> Path:
        path = self.sources.path(kind, source_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def args(
        self, token: str = "token-b", node: str = "node-b"
    ) -> tuple[tuple[str, int], ssl.SSLContext, str, str, str]:
        return (("127.0.0.1", self.server.port), self.client_tls, SERVER_NAME, token, node)

    async def pull(
        self, source_id: str = "vol-1", size: int = 0, kind: str = "volume", **who: str
    ) -> client.PullResult:
        return await client.pull(*self.args(**who), kind, source_id, str(self.dest), size)

    async def describe(self, source_id: str, kind: str = "volume", **who: str) -> wire.RemoteSource | None:
        return await client.describe(*self.args(**who), kind, source_id)


def new_server(sources: DirSources, tls: ssl.SSLContext) -> HookedServer:
    return HookedServer(
        node="node-a", sources=sources, authenticate=authenticate, ssl_context=tls, host="127.0.0.1"
    )


@pytest.fixture
async def env(tmp_path: Path, tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> AsyncIterator[Env]:
    sources = DirSources(tmp_path / "pool-a")
    server = new_server(sources, tls[0])
    await server.start()
    (tmp_path / "pool-b").mkdir()
    e = Env(server, sources, tls[1], tmp_path / "pool-b" / "vol-1.img")
    try:
        yield e
    finally:
        await e.server.stop()


def write_sparse(path: Path, size: int = SIZE, layout: list[tuple[int, int]] = LAYOUT, seed: int = 0) -> None:
    with path.open("wb") as f:
        f.truncate(size)
        for offset, length in layout:
            f.seek(offset)
            f.write(hashlib.shake_256(f"{seed}-{offset}".encode()).digest(length))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir())


@pytest.fixture
def often_durable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Progress every 2 regions, so a 64 MiB file has durable points mid-stream."""
    monkeypatch.setattr(client, "DURABLE_EVERY", 2)
    yield


async def test_sparse_file_round_trips_with_its_holes(env: Env) -> None:
    src = env.source()
    write_sparse(src)
    result = await env.pull()
    assert sha256(env.dest) == sha256(src)
    assert env.dest.stat().st_size == SIZE
    # Holes stay holes: the copy allocates about what the source does (a few blocks of rounding).
    assert env.dest.stat().st_blocks <= src.stat().st_blocks + 64
    # Only the allocated extents travel (whole blocks around the data written).
    assert result.bytes_received == sum(n for _, n in files.data_ranges(str(src), 0, SIZE)) < 2 * MiB
    assert (result.resumed_from, result.regions_received) == (0, 8)
    assert leftovers(env.dest) == ["vol-1.img"]  # no part, no progress
    assert env.server.streamed == list(range(8))


async def test_larger_destination_and_snapshots(env: Env) -> None:
    src = env.source("snap-1", kind="snapshot")
    write_sparse(src, size=10 * MiB + 5, layout=[(10 * MiB, 5)])
    await env.pull("snap-1", size=SIZE, kind="snapshot")
    assert env.dest.stat().st_size == SIZE
    with env.dest.open("rb") as f:
        assert f.read(10 * MiB + 5) == src.read_bytes()
        assert f.read() == bytes(SIZE - 10 * MiB - 5)


async def test_empty_file(env: Env) -> None:
    env.source().touch()
    result = await env.pull(size=MiB)
    assert (result.regions_received, env.dest.stat().st_size) == (0, MiB)


async def test_describe(env: Env) -> None:
    src = env.source()
    write_sparse(src)
    info = await env.describe("vol-1")
    assert info == wire.RemoteSource(SIZE, file_generation(str(src)), "mount", "ext4", wire.REGION)
    assert await env.describe("absent") is None


async def test_cut_stream_resumes_with_the_remaining_regions(env: Env) -> None:
    src = env.source()
    write_sparse(src)
    env.server.cut_at = 5
    with pytest.raises(StreamCut, match="cut the stream at region 5"):
        await env.pull()
    assert leftovers(env.dest) == ["vol-1.img.part", "vol-1.img.part.progress"]
    env.server.streamed.clear()
    env.server.read.clear()
    result = await env.pull()
    assert env.server.streamed == [5, 6, 7]
    assert env.server.read == [5, 6, 7]  # it remembers the digests of the regions it sent
    assert (result.resumed_from, result.regions_received) == (5, 3)
    assert sha256(env.dest) == sha256(src)
    assert leftovers(env.dest) == ["vol-1.img"]


async def test_restarted_server_reads_the_resumed_part_again(
    env: Env, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    src = env.source()
    write_sparse(src)
    env.server.cut_at = 5
    with pytest.raises(StreamCut):
        await env.pull()
    await env.server.stop()  # as after a kill -9 of the sending driver
    env.server = new_server(env.sources, tls[0])
    await env.server.start()
    result = await env.pull()
    assert env.server.streamed == [5, 6, 7]
    assert env.server.read == list(range(8))  # the digests of 0-4 for the whole-file digest
    assert result.resumed_from == 5
    assert sha256(env.dest) == sha256(src)


async def test_killed_client_resumes_from_its_last_durable_region(
    env: Env, often_durable: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = env.source()
    write_sparse(src)
    progress = Path(client.part_paths(str(env.dest))[1])
    saved = asyncio.Event()
    save, loop = client._save, asyncio.get_running_loop()

    def save_and_tell(*args: Any) -> None:
        save(*args)
        loop.call_soon_threadsafe(saved.set)

    monkeypatch.setattr(client, "_save", save_and_tell)
    task = asyncio.create_task(env.pull())
    await saved.wait()  # the first durable point (2 regions)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    durable = len(client._load_progress(str(progress)).digests)  # type: ignore[union-attr]
    assert 2 <= durable < 8
    result = await env.pull()
    assert (result.resumed_from, result.regions_received) == (durable, 8 - durable)
    # (the cancelled stream may have gone on a few regions before the server saw it gone)
    assert env.server.streamed[-(8 - durable) :] == list(range(durable, 8))
    assert sha256(env.dest) == sha256(src)


async def test_changed_source_starts_over(env: Env) -> None:
    src = env.source()
    write_sparse(src)
    env.server.cut_at = 3
    with pytest.raises(StreamCut):
        await env.pull()
    write_sparse(src, seed=1)  # new data: a new mtime, so a new generation
    os.utime(src, ns=(0, 12345))  # even within the clock's resolution
    env.server.streamed.clear()
    result = await env.pull()
    assert env.server.streamed == list(range(8))
    assert result.resumed_from == 0
    assert sha256(env.dest) == sha256(src)


async def test_corrupt_region_leaves_nothing(env: Env, often_durable: None) -> None:
    src = env.source()
    write_sparse(src)
    env.server.corrupt = 3  # after a durable point: the recorded part goes too
    with pytest.raises(CorruptStream, match=r"region 3 .* does not match its digest"):
        await env.pull()
    assert leftovers(env.dest) == []
    env.server.corrupt = None
    await env.pull()
    assert sha256(env.dest) == sha256(src)


async def test_unknown_id(env: Env) -> None:
    with pytest.raises(SourceNotFound) as e:
        await env.pull("vol-404")
    assert (e.value.status, e.value.message) == (404, "volume vol-404 is not in the pool of node node-a")
    assert leftovers(env.dest) == []


async def test_bad_token(env: Env) -> None:
    env.source().touch()
    with pytest.raises(TransferDenied) as e:
        await env.pull(token="forged")
    assert (e.value.status, e.value.message) == (401, "the token is not valid: unknown to the test")


async def test_node_header_must_be_the_tokens_node(env: Env) -> None:
    env.source().touch()
    with pytest.raises(TransferDenied) as e:
        await env.describe("vol-1", token="token-c", node="node-b")
    assert e.value.status == 403
    assert e.value.message == "the token belongs to node node-c, but the request says node node-b"


async def test_path_like_id(env: Env) -> None:
    with pytest.raises(BadRequest, match=r"volume id '\.\./x' is not valid") as e:
        await env.pull("../x")
    assert e.value.status == 400


async def test_untrusted_server_fails_the_handshake(env: Env) -> None:
    env.source().touch()
    env.client_tls = ssl.create_default_context()  # the system's CAs, not the transfer CA
    with pytest.raises(StreamCut, match="certificate verify failed"):
        await env.pull()
    assert leftovers(env.dest) == []


async def test_refusals_are_readable_without_the_client(env: Env) -> None:
    """What curl shows: a status line and one line of text, never a traceback."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", env.server.port, ssl=env.client_tls, server_hostname=SERVER_NAME
    )
    writer.write(b"GET /v1/volumes/vol-1?from_region=0 HTTP/1.1\r\nHost: x\r\n\r\n")
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert body == b"a bearer token is required (Authorization: Bearer ...)\n"


def alter_recorded_digest(progress: str, region: int) -> None:
    doc = json.loads(Path(progress).read_text())
    doc["digests"][region] = "00" * wire.DIGEST_SIZE
    Path(progress).write_text(json.dumps(doc))


async def test_whole_file_digest_catches_a_bad_resumed_part(env: Env) -> None:
    """A part whose recorded regions are not the source's (here: one recorded digest altered) fails
    the whole-file digest at the end, and nothing of it is kept."""
    src = env.source()
    write_sparse(src)
    env.server.cut_at = 5
    with pytest.raises(StreamCut):
        await env.pull()
    alter_recorded_digest(client.part_paths(str(env.dest))[1], 1)
    with pytest.raises(CorruptStream, match="does not match its whole-file digest"):
        await env.pull()
    assert leftovers(env.dest) == []


async def test_discard_removes_part_and_progress(env: Env) -> None:
    write_sparse(env.source())
    env.server.cut_at = 3
    with pytest.raises(StreamCut):
        await env.pull()
    assert leftovers(env.dest) == ["vol-1.img.part", "vol-1.img.part.progress"]
    client.discard(str(env.dest))
    assert leftovers(env.dest) == []
