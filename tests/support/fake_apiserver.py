"""A stand-in apiserver for unit tests: an aiohttp application on a free loopback port, and an
ApiClient of it (`serve`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web
from kubernetes_asyncio.client import Configuration

from controller_runtime.client import ApiClient


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[ApiClient]:
    """`app` on a free loopback port, and a client of it."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    client = ApiClient(cfg, qps=0, burst=1)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()
