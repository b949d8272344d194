"""The HTTP endpoint of every process: Prometheus `/metrics`, `/healthz` (alive) and `/readyz`
(ready to serve: caches synced, leader or standby, driver probed)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from .logs import get_logger

log = get_logger("health")

Check = Callable[[], str | None]
"""A check returns None when healthy, or a short reason when not."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Parses `host:port` (`:8080` means 127.0.0.1:8080; kubeloop binds loopback by default)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http-endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class HealthServer:
    def __init__(self, endpoint: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self._registry = registry
        self._liveness: dict[str, Check] = {}
        self._readiness: dict[str, Check] = {}
        self._runner: web.AppRunner | None = None

    def add_liveness_check(self, name: str, check: Check) -> None:
        self._liveness[name] = check

    def add_readiness_check(self, name: str, check: Check) -> None:
        self._readiness[name] = check

    @staticmethod
    def _report(checks: dict[str, Check]) -> web.Response:
        failures = {name: reason for name, check in checks.items() if (reason := check()) is not None}
        if not failures:
            return web.Response(text="ok")
        body = "\n".join(f"[-]{name} failed: {reason}" for name, reason in sorted(failures.items()))
        return web.Response(status=503, text=body + "\n")

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _healthz(self, _: web.Request) -> web.Response:
        return self._report(self._liveness)

    async def _readyz(self, _: web.Request) -> web.Response:
        return self._report({**self._liveness, **self._readiness})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/livez", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if self.port == 0 and site._server is not None:  # an ephemeral port was asked for (tests)
            sockets = getattr(site._server, "sockets", None) or []
            if sockets:
                self.port = sockets[0].getsockname()[1]
        log.info("serving metrics and health", endpoint=f"{self.host}:{self.port}")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
