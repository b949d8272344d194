"""The HTTP endpoint of every process: Prometheus `/metrics`, `/healthz` (alive) and `/readyz`
(ready to serve: caches synced, leader or standby, driver probed)."""

from __future__ import annotations

import errno
import inspect
from collections.abc import Awaitable, Callable

from aiohttp import web
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


def parse_endpoint(endpoint: str) -> tuple[str | None, int]:
    """Parses `host:port` as the kubernetes-csi sidecars read --http-endpoint: an empty host
    (`:8080`) means every interface, IPv4 and IPv6, and is returned as None (kubelet's probes come
    from outside the pod, to its IP). Processes that must stay on loopback say `127.0.0.1:8080`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http-endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]") or None, int(port)


class HealthServer:
    def __init__(self, endpoint: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self._registry = registry
        self._liveness: dict[str, Check] = {}
        self._readiness: dict[str, Check] = {}
        self._refreshes: list[Refresh] = []
        self._runner: web.AppRunner | None = None

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

    async def _report(self, checks: dict[str, Check], failure_status: int) -> web.Response:
        failures = {}
        for name, check in checks.items():
            if (reason := await self._reason(check)) is not None:
                failures[name] = reason
        if not failures:
            return web.Response(text="ok")
        body = "\n".join(f"[-]{name} failed: {reason}" for name, reason in sorted(failures.items()))
        return web.Response(status=failure_status, text=body + "\n")

    async def _metrics(self, _: web.Request) -> web.Response:
        for refresh in self._refreshes:
            try:
                await refresh()
            except Exception:  # its collector serves what it had; the other metrics are served
                log.exception("refreshing metrics failed")
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _healthz(self, _: web.Request) -> web.Response:
        # 500 as Kubernetes' own /healthz and the CSI sidecars' answer (kubelet restarts on any
        # status of 400 and above; people and scripts compare with what upstream prints).
        return await self._report(self._liveness, 500)

    async def _readyz(self, _: web.Request) -> web.Response:
        # 503: not ready is a temporary refusal to serve, not a failure.
        return await self._report({**self._liveness, **self._readiness}, 503)

    async def _queues(self, _: web.Request) -> web.Response:
        return web.json_response(FAILURES.snapshot())

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/livez", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/debug/queues", self._queues)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            if self.host is not None or e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise
            # Every interface includes IPv6, which a host may have switched off; Go's `:port`
            # falls back to IPv4 alone there, and so does this.
            log.warning("cannot listen on every IPv6 interface, serving IPv4 only", error=str(e))
            site = web.TCPSite(self._runner, "0.0.0.0", self.port)
            await site.start()
        if self.port == 0 and site._server is not None:  # an ephemeral port was asked for (tests)
            sockets = getattr(site._server, "sockets", None) or []
            if sockets:
                self.port = sockets[0].getsockname()[1]
        log.info("serving metrics and health", endpoint=f"{self.host or ''}:{self.port}")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
