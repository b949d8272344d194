"""The API client's HTTP/1.1 transport (controller_runtime.http_client) against servers that answer
every way HTTP/1.1 allows and some ways it does not: bodies by length, chunked and to the close,
gzip, kept connections (and ones the server closed while idle), answers cut short, heads that are
not HTTP, a peer that never answers, and the TLS of a kubeconfig's server."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from controller_runtime.certs import PKI
from controller_runtime.http_client import CannotConnect, ConnectionPool, Disconnected

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(
    handler: Handler, closed: asyncio.Event | None = None
) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on loopback running `handler` per connection; yields its URL and a list that
    gets one entry per connection accepted. `closed` is set each time the server has closed a
    connection."""
    accepted: list[int] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if closed is not None:
                closed.set()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


def pool_of(url: str, limit: int = 4) -> ConnectionPool:
    return ConnectionPool(
        url, None, limit=limit, headers={"User-Agent": "test", "Accept": "application/json"}
    )


async def test_the_request_as_sent_and_bodies_by_length_chunked_and_to_the_close() -> None:
    seen: list[tuple[str, dict[str, str], bytes]] = []
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\nuntil the close",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            seen.append(await read_request(reader))
            writer.write(answer)
            await writer.drain()

    async with raw_server(handler) as (url, accepted):
        pool = pool_of(url)
        one = await pool.request("GET", "/api/v1/pods?limit=1", timeout=5)
        two = await pool.request("POST", "/api/v1/x", headers={"Content-Type": "a/b"}, body=b"{}", timeout=5)
        three = await pool.request("PUT", "/y", body=b"", timeout=5)
        four = await pool.request("GET", "/z", timeout=5)
        await pool.close()
    assert (one.status, one.body) == (200, b"hello")
    assert (two.status, two.body) == (201, b"abcde")
    assert (three.status, three.body) == (204, b"")
    assert (four.status, four.body) == (200, b"until the close")
    assert accepted == [1], "the four requests did not share one kept connection"
    assert seen[0][0] == "GET /api/v1/pods?limit=1 HTTP/1.1"
    assert seen[0][1]["host"] == url.removeprefix("http://")
    assert seen[0][1]["user-agent"] == "test" and "content-length" not in seen[0][1]
    assert seen[1][1]["content-type"] == "a/b" and seen[1][2] == b"{}"
    assert seen[2][1]["content-length"] == "0"


async def test_a_kept_connection_the_server_closed_is_replaced_for_a_get_not_resent_for_a_post() -> None:
    """The server answers one request per connection but claims keep-alive, then closes: the
    next GET finds the kept connection closed and goes on a new one; a POST that met a close
    after being written is not sent again (it may have been done)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    closed = asyncio.Event()
    async with raw_server(handler, closed) as (url, accepted):
        pool = pool_of(url)
        assert (await pool.request("GET", "/a", timeout=5)).body == b"ok"
        await closed.wait()  # the server closed the connection, which is now idle in the pool
        assert (await pool.request("GET", "/b", timeout=5)).body == b"ok"
        assert len(accepted) == 2

    async def closes_after_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.transport.abort()

    async with raw_server(closes_after_reading) as (url, accepted):
        pool = pool_of(url)
        with pytest.raises(Disconnected, match="before answering"):
            await pool.request("POST", "/c", body=b"{}", timeout=5)
        assert len(accepted) == 1


async def test_answers_cut_short_or_not_http_are_disconnected_and_their_connection_dropped() -> None:
    bad = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
    ]
    for answer in bad:

        async def handler(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, a: bytes = answer
        ) -> None:
            await read_request(reader)
            writer.write(a)
            await writer.drain()
            writer.close()

        async with raw_server(handler) as (url, _):
            pool = pool_of(url)
            with pytest.raises(Disconnected):
                await pool.request("GET", "/", timeout=5)
            assert not pool._idle, f"a connection was kept after {answer[:40]!r}"


async def test_no_server_is_cannot_connect_and_a_silent_one_times_out() -> None:
    async with raw_server(read_request_then_wait) as (url, _):
        pool = pool_of(url)
        with pytest.raises(TimeoutError):
            await pool.request("GET", "/", timeout=0.2)
        assert not pool._idle
    closed = pool_of(url)  # the server is gone: nothing listens on its port
    with pytest.raises(CannotConnect, match=r"cannot connect to 127\.0\.0\.1"):
        await closed.request("GET", "/", timeout=5)
    with pytest.raises(ValueError, match="not an http"):
        pool_of("unix:///run/sock")


async def read_request_then_wait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that reads the request and never answers (until the client goes)."""
    await read_request(reader)
    await reader.read()


async def test_the_cap_holds_requests_beyond_it_and_a_cancel_frees_its_slot() -> None:
    """With a cap of 3, the server holds each request until 3 are in flight at once (the cap
    reached), then answers every one: more in flight at once would show in `most`."""
    in_flight = 0
    most = 0
    reached = asyncio.Event()
    received = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        while True:
            line, _, _ = await read_request(reader)
            received.set()
            if "/cancelled" in line:
                await reader.read()  # never answered: the client cancels it and goes
                return
            in_flight += 1
            most = max(most, in_flight)
            if in_flight == 3:
                reached.set()
            await reached.wait()
            in_flight -= 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()

    async with raw_server(handler) as (url, accepted):
        pool = pool_of(url, limit=3)
        await asyncio.gather(*(pool.request("GET", f"/{i}", timeout=5) for i in range(12)))
        assert most == 3 and len(accepted) == 3
        received.clear()
        task = asyncio.create_task(pool.request("GET", "/cancelled", timeout=5))
        await received.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*(pool.request("GET", f"/after{i}", timeout=5) for i in range(3)))
        await pool.close()


async def test_gzip_answers_are_read_and_targets_that_would_break_the_request_line_are_escaped() -> None:
    targets: list[str] = []
    payload = b'{"items": []}' * 100

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _, _ = await read_request(reader)
        targets.append(line)
        body = gzip.compress(payload)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body)
        await writer.drain()

    async with raw_server(handler) as (url, _):
        pool = pool_of(url)
        answer = await pool.request("GET", "/api/v1/nodes/nöde", timeout=5)
        await pool.request("GET", "/x y\r\nX-Injected: 1", timeout=5)
    assert answer.body == payload
    assert targets == ["GET /api/v1/nodes/n%C3%B6de HTTP/1.1", "GET /x%20y%0D%0AX-Injected:%201 HTTP/1.1"]


async def test_a_stream_yields_pieces_as_they_come_and_an_unfinished_one_is_disconnected() -> None:
    async def finishes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b"one\n", b"tw", b"o\n"):  # however TCP cuts them, each chunk is a piece
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # the kept connection carries the next stream
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nend")
        await writer.drain()

    async with raw_server(finishes) as (url, accepted):
        pool = pool_of(url, limit=0)
        async with pool.stream("GET", "/w", connect_timeout=5, read_timeout=5) as streamed:
            pieces = [p async for p in streamed.pieces()]
        assert pieces == [b"one\n", b"tw", b"o\n"]
        async with pool.stream("GET", "/w2", connect_timeout=5, read_timeout=5) as streamed:
            assert [p async for p in streamed.pieces()] == [b"end"]
        assert len(accepted) == 1

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\none\n\r\n")
        await writer.drain()

    async with raw_server(cut) as (url, _):
        pool = pool_of(url, limit=0)
        got: list[bytes] = []
        with pytest.raises(Disconnected):
            async with pool.stream("GET", "/w", connect_timeout=5, read_timeout=5) as streamed:
                async for piece in streamed.pieces():
                    got.append(piece)
        assert got == [b"one\n"] and not pool._idle

    async with raw_server(read_request_then_wait) as (url, _):
        with pytest.raises(TimeoutError):
            async with pool_of(url, limit=0).stream("GET", "/w", connect_timeout=5, read_timeout=0.2):
                pass


async def test_a_streams_chunks_are_the_same_however_the_bytes_arrive() -> None:
    """Chunks are cut out of what each read returns: a burst in one segment, a few bytes or one
    byte per segment, a chunk larger than a read, extensions and trailers all give the same
    pieces, and the connection is kept; framing that is not HTTP's is Disconnected."""
    small = [b"one\n", b"", b"two\n"]
    big = [b"one\n", b"x" * 200_000, b"two\n"]

    def chunked(pieces: list[bytes], end: bytes = b"0\r\n\r\n") -> bytes:
        return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + end

    trailers = b"0\r\nX-Trailer: a\r\n\r\n"
    for data, step, expected in (
        (chunked(big), None, big),
        (chunked(big, trailers), 7_001, big),
        (chunked(small, trailers), 1, [p for p in small if p]),
    ):
        async with raw_server(_chunked_answer(data, step)) as (url, _):
            pool = pool_of(url, limit=0)
            async with pool.stream("GET", "/w", connect_timeout=5, read_timeout=5) as streamed:
                assert [p async for p in streamed.pieces()] == expected, step
            assert streamed.complete and pool._idle  # the connection is kept for the next request

    for framing in (b"4\r\none\nXX0\r\n\r\n", b"-4\r\none\n\r\n0\r\n\r\n", b"4" * 70_000):
        async with raw_server(_chunked_answer(framing, None)) as (url, _):
            pool = pool_of(url, limit=0)
            with pytest.raises(Disconnected):
                async with pool.stream("GET", "/w", connect_timeout=5, read_timeout=5) as streamed:
                    async for _piece in streamed.pieces():
                        pass
            assert not pool._idle


def _chunked_answer(body: bytes, step: int | None) -> Handler:
    """A server answering with a chunked body, `step` bytes per write (all at once for None),
    then waiting for the client to go."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), step or len(body)):
            writer.write(body[i : i + (step or len(body))])
            await writer.drain()
        await reader.read()

    return handler


async def test_tls_with_the_servers_ca_and_a_server_that_is_not_tls(tmp_path: Path) -> None:
    """TLS to a real HTTP server (aiohttp's), verifying its certificate against the CA a
    kubeconfig would name; a plain-HTTP peer answers the handshake with garbage: CannotConnect."""
    pki = PKI(tmp_path / "pki")
    serving = pki.ensure_serving("apiserver", "apiserver", dns_names=("localhost",), ips=("127.0.0.1",))
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(serving.cert, serving.key)
    ca_file = str(pki.ca.cert)
    app = web.Application()

    async def version(_request: web.Request) -> web.Response:
        return web.json_response({"major": "1"})

    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client_ctx = ssl.create_default_context(cafile=ca_file)
        pool = ConnectionPool(f"https://127.0.0.1:{port}", client_ctx, limit=2, headers={})
        answer = await pool.request("GET", "/version", timeout=5)
        assert (answer.status, answer.content_type, answer.body) == (
            200,
            "application/json",
            b'{"major": "1"}',
        )
        await pool.close()
    finally:
        await runner.cleanup()

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()

    async with raw_server(plain) as (url, _):
        tls_port = url.rsplit(":", 1)[1]
        pool = ConnectionPool(
            f"https://127.0.0.1:{tls_port}", ssl.create_default_context(), limit=1, headers={}
        )
        with pytest.raises(CannotConnect):
            await pool.request("GET", "/", timeout=5)
