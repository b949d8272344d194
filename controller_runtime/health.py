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
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from .debug import FAILURES
from .logs import get_logger

log = get_logger("health")

Check = Callable[[], str | Awaitable[str | None] | None]
"""A check returns None when healthy, or a short reason when not. It may be a coroutine function:
a sidecar's liveness is a call to its driver."""

Refresh = Callable[[], Awaitable[None]]
"""Awaited before every /metrics answer: a collector whose values come from disk reads them there,
off the event loop (`collect`, which `generate_latest` calls on it, cannot await)."""

TEXT = "text/plain; charset=utf-8"
JSON = "application/json; charset=utf-8"
# How long a connection may sit between requests, or take to send a request's head (aiohttp's
# keep-alive timeout).
IDLE_S = 75.0
# The largest request body read (and dropped): the endpoint takes none.
MAX_BODY = 1 << 20


def parse_endpoint(endpoint: str) -> tuple[str | None, int]:
    """Parses `host:port` as the kubernetes-csi sidecars read --http-endpoint: an empty host
    (`:8080`) means every interface, IPv4 and IPv6, and is returned as None (kubelet's probes come
    from outside the pod, to its IP). Processes that must stay on loopback say `127.0.0.1:8080`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http-endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]") or None, int(port)


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = field(default=())

    @classmethod
    def text(cls, text: str, status: int = 200) -> Reply:
        return cls(status, text.encode())

    @classmethod
    def error(cls, status: HTTPStatus, **headers: str) -> Reply:
        """An error answered as aiohttp worded it: `404: Not Found`."""
        return cls(status, f"{status.value}: {status.phrase}".encode(), headers=tuple(headers.items()))


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]

    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return connection == "keep-alive"
        return connection != "close"


class BadRequest(Exception):
    pass


def parse_head(head: bytes) -> Request:
    """A request's line and headers (the bytes up to the blank line)."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        raise BadRequest("not an HTTP/1 request")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header")
        headers[name.lower()] = value.strip()
    return Request(method, target.partition("?")[0], version, headers)


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(now: float) -> str:
    """An HTTP date (`Mon, 07 Dec 2026 00:40:00 GMT`), in English whatever the locale."""
    t = time.gmtime(now)
    day, month = _DAYS[t.tm_wday], _MONTHS[t.tm_mon - 1]
    return f"{day}, {t.tm_mday:02d} {month} {t.tm_year} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"


def encode(reply: Reply, keep_alive: bool, with_body: bool) -> bytes:
    status = HTTPStatus(reply.status)
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Content-Type: {reply.content_type}",
        f"Content-Length: {len(reply.body)}",
        f"Date: {http_date(time.time())}",
        *(f"{name}: {value}" for name, value in reply.headers),
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + reply.body if with_body else head


class HealthServer:
    def __init__(self, endpoint: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self._registry = registry
        self._liveness: dict[str, Check] = {}
        self._readiness: dict[str, Check] = {}
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

    def add_liveness_check(self, name: str, check: Check) -> None:
        self._liveness[name] = check

    def add_readiness_check(self, name: str, check: Check) -> None:
        self._readiness[name] = check

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
        if not failures:
            return Reply.text("ok")
        body = "\n".join(f"[-]{name} failed: {reason}" for name, reason in sorted(failures.items()))
        return Reply.text(body + "\n", failure_status)

    async def _metrics(self) -> Reply:
        for refresh in self._refreshes:
            try:
                await refresh()
            except Exception:  # its collector serves what it had; the other metrics are served
                log.exception("refreshing metrics failed")
        return Reply(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)

    async def _healthz(self) -> Reply:
        # 500 as Kubernetes' own /healthz and the CSI sidecars' answer (kubelet restarts on any
        # status of 400 and above; people and scripts compare with what upstream prints).
        return await self._report(self._liveness, 500)

    async def _readyz(self) -> Reply:
        # 503: not ready is a temporary refusal to serve, not a failure.
        return await self._report({**self._liveness, **self._readiness}, 503)

    async def _queues(self) -> Reply:
        return Reply(200, json.dumps(FAILURES.snapshot()).encode(), JSON)

    async def _answer(self, request: Request) -> Reply:
        route = self._routes.get(request.path)
        if route is None:
            return Reply.error(HTTPStatus.NOT_FOUND)
        if request.method not in ("GET", "HEAD"):
            return Reply.error(HTTPStatus.METHOD_NOT_ALLOWED, Allow="GET,HEAD")
        try:
            return await route()
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
                    request = parse_head(head[:-4])
                    if "transfer-encoding" in request.headers:
                        raise BadRequest("chunked bodies are not taken")
                    length = int(request.headers.get("content-length", "0"))
                    if not 0 <= length <= MAX_BODY:
                        raise BadRequest("body too large")
                except (BadRequest, ValueError):
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
