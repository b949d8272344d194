"""The HTTP endpoint of every process: Prometheus `/metrics`, `/healthz` (alive) and `/readyz`
(ready to serve: caches synced, leader or standby, driver probed).

The server is a small HTTP/1.1 one on asyncio's streams rather than aiohttp's: importing
`aiohttp.web` costs a process about 10 MiB of RSS (issue 49), and the processes that talk to no
apiserver (the CSI driver, node-driver-registrar, livenessprobe) imported aiohttp for this alone.
It answers what the endpoint's clients send (kubelet's probes, Prometheus's scrapes, curl): GET and
HEAD of five paths, keep-alive as HTTP/1.1 and 1.0 ask for it, 404 and 405 worded as aiohttp worded
them, anything it cannot read (a malformed head, a chunked body) with 400 and a closed connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from .http_wire import (
    IDLE_S,
    PATHS,
    BadRequest,
    Checks,
    Reply,
    Request,
    encode,
    parse_endpoint,
    queues,
    read_request,
    refusal,
    report,
)
from .logs import get_logger
from .metrics import CONTENT_TYPE, REGISTRY, Registry

__all__ = ["Check", "HealthServer", "Refresh", "parse_endpoint"]

log = get_logger("health")

Check = Callable[[], str | Awaitable[str | None] | None]
"""A check returns None when healthy, or a short reason when not. It may be a coroutine function:
a sidecar's liveness is a call to its driver."""

Refresh = Callable[[], Awaitable[None]]
"""Awaited before every /metrics answer: a collector whose values come from disk reads them there,
off the event loop (`collect`, which the registry calls on it, cannot await)."""


class HealthServer(Checks[Check]):
    def __init__(self, endpoint: str, registry: Registry = REGISTRY) -> None:
        super().__init__(endpoint)
        self._registry = registry
        self._refreshes: list[Refresh] = []
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._routes: dict[str, Callable[[], Awaitable[Reply]]] = {
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/livez": self._healthz,
            "/readyz": self._readyz,
            "/debug/queues": self._queues,
        }
        assert set(self._routes) == set(PATHS)

    def add_metrics_refresh(self, refresh: Refresh) -> None:
        self._refreshes.append(refresh)

    @staticmethod
    async def _reason(check: Check) -> str | None:
        try:
            result = check()
            return await result if inspect.isawaitable(result) else result
        except Exception as e:  # a check that breaks is a failing check, not a broken endpoint
            return f"{type(e).__name__}: {e}"

    async def _report(self, checks: dict[str, Check], failure_status: int) -> Reply:
        failures = {}
        for name, check in checks.items():
            if (reason := await self._reason(check)) is not None:
                failures[name] = reason
        return report(failures, failure_status)

    async def _metrics(self) -> Reply:
        for refresh in self._refreshes:
            try:
                await refresh()
            except Exception:  # its collector serves what it had; the other metrics are served
                log.exception("refreshing metrics failed")
        return Reply(200, self._registry.exposition(), CONTENT_TYPE)

    async def _healthz(self) -> Reply:
        return await self._report(self._liveness, 500)

    async def _readyz(self) -> Reply:
        return await self._report({**self._liveness, **self._readiness}, 503)

    async def _queues(self) -> Reply:
        return queues()

    async def _answer(self, request: Request) -> Reply:
        if (refused := refusal(request, self._routes)) is not None:
            return refused
        try:
            return await self._routes[request.path]()
        except Exception:
            log.exception("answering a request failed", path=request.path)
            return Reply.error(HTTPStatus.INTERNAL_SERVER_ERROR)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
                    return  # closed, idle too long, or a head longer than the stream's limit
                try:
                    request, length = read_request(head[:-4])
                except BadRequest:
                    writer.write(encode(Reply.error(HTTPStatus.BAD_REQUEST), False, True))
                    await writer.drain()
                    return
                if length:
                    await reader.readexactly(length)
                keep_alive = request.keep_alive()
                reply = await self._answer(request)
                writer.write(encode(reply, keep_alive, request.method != "HEAD"))
                await writer.drain()
                if not keep_alive:
                    return
        except (asyncio.IncompleteReadError, OSError):
            return  # the client went away mid-request
        finally:
            self._connections.discard(task)
            writer.close()

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve_connection, self.host, self.port)
        except OSError as e:
            if self.host is not None or e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise
            # Every interface includes IPv6, which a host may have switched off; Go's `:port`
            # falls back to IPv4 alone there, and so does this.
            log.warning("cannot listen on every IPv6 interface, serving IPv4 only", error=str(e))
            self._server = await asyncio.start_server(self._serve_connection, "0.0.0.0", self.port)
        if self.port == 0 and self._server.sockets:  # an ephemeral port was asked for (tests)
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving metrics and health", endpoint=f"{self.host or ''}:{self.port}")

    async def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        connections = list(self._connections)
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        with contextlib.suppress(Exception):
            await server.wait_closed()
