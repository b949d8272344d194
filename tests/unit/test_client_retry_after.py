"""ApiClient honours Retry-After as client-go's rest.Request does: a 429 (or a 5xx) carrying it is
sent again after that many seconds, up to 10 times, for requests and for watches; other errors
are not retried."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from controller_runtime.client import MAX_RETRIES, ApiClient, ApiError, retry_after
from controller_runtime.resources import PERSISTENT_VOLUMES


def test_which_answers_ask_for_a_retry() -> None:
    assert retry_after(429, "3") == 3
    assert retry_after(503, "1") == 1
    assert retry_after(429, " 0 ") == 0
    assert retry_after(429, None) is None, "a 429 without Retry-After is an error to the caller"
    assert retry_after(429, "Wed, 21 Oct 2026 07:28:00 GMT") is None, "only whole seconds, as client-go"
    assert retry_after(409, "1") is None
    assert retry_after(200, "1") is None
    assert retry_after(429, "-4") == 0


class Throttling:
    """Answers the first `n` requests with 429 and Retry-After: 0, then serves."""

    def __init__(self, n: int, header: str | None = "0") -> None:
        self.n = n
        self.header = header
        self.calls = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        if self.calls <= self.n:
            headers = {"Retry-After": self.header} if self.header is not None else {}
            return web.json_response({"kind": "Status", "code": 429}, status=429, headers=headers)
        if request.query.get("watch") == "true":
            resp = web.StreamResponse()
            await resp.prepare(request)
            event = {"type": "ADDED", "object": {"metadata": {"name": "pv", "resourceVersion": "3"}}}
            await resp.write(orjson.dumps(event) + b"\n")
            await resp.write_eof()
            return resp
        return web.json_response({"metadata": {"name": "pv"}})


Serve = Callable[[Throttling], Awaitable[ApiClient]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []
    clients: list[ApiClient] = []

    async def start(handler: Throttling) -> ApiClient:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        cfg = Configuration()
        cfg.host = f"http://127.0.0.1:{port}"
        client = ApiClient(cfg, qps=0, burst=1)
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.close()
    for r in runners:
        await r.cleanup()


async def test_request_is_retried_after_429(serve: Serve) -> None:
    handler = Throttling(3)
    client = await serve(handler)
    assert (await client.get(PERSISTENT_VOLUMES, "pv"))["metadata"]["name"] == "pv"
    assert handler.calls == 4


async def test_retries_are_bounded(serve: Serve) -> None:
    handler = Throttling(100)
    client = await serve(handler)
    with pytest.raises(ApiError) as err:
        await client.get(PERSISTENT_VOLUMES, "pv")
    assert err.value.status == 429
    assert handler.calls == MAX_RETRIES + 1


async def test_429_without_retry_after_is_not_retried(serve: Serve) -> None:
    handler = Throttling(1, header=None)
    client = await serve(handler)
    with pytest.raises(ApiError):
        await client.get(PERSISTENT_VOLUMES, "pv")
    assert handler.calls == 1


async def test_watch_is_retried_after_429(serve: Serve) -> None:
    handler = Throttling(2)
    client = await serve(handler)
    events = [e async for e in client.watch(PERSISTENT_VOLUMES)]
    assert [(kind, obj["metadata"]["name"]) for kind, obj in events] == [("ADDED", "pv")]
    assert handler.calls == 3
