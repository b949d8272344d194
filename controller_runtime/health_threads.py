"""The HTTP endpoint of controller_runtime.health on threads, for node-driver-registrar and
livenessprobe, which import no asyncio and no prometheus_client (issue 49): the same paths,
answers and wording (controller_runtime.http_wire holds what both serve), checks that are plain
functions, and /metrics written by controller_runtime.metrics."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable
from http import HTTPStatus

from . import http_wire as wire
from .logs import get_logger
from .metrics import CONTENT_TYPE, REGISTRY, Registry
from .socket_threads import ThreadedListener

log = get_logger("health")

Check = Callable[[], str | None]
"""None when healthy, or a short reason when not; called on the request's thread."""

# The longest request head read; a longer one is refused (asyncio's streams stop at 64 KiB).
MAX_HEAD = 64 * 1024


class HealthServer(wire.Checks[Check]):
    def __init__(self, endpoint: str, registry: Registry = REGISTRY) -> None:
        super().__init__(endpoint)
        self._registry = registry
        self._listener: ThreadedListener | None = None
        self._routes: dict[str, Callable[[], wire.Reply]] = {
            "/metrics": lambda: wire.Reply(200, self._registry.exposition(), CONTENT_TYPE),
            "/healthz": lambda: self._report(self._liveness, 500),
            "/livez": lambda: self._report(self._liveness, 500),
            "/readyz": lambda: self._report({**self._liveness, **self._readiness}, 503),
            "/debug/queues": wire.queues,
        }
        assert set(self._routes) == set(wire.PATHS)

    @staticmethod
    def _report(checks: dict[str, Check], failure_status: int) -> wire.Reply:
        failures = {}
        for name, check in checks.items():
            try:
                reason = check()
            except Exception as e:  # a check that breaks is a failing check, not a broken endpoint
                reason = f"{type(e).__name__}: {e}"
            if reason is not None:
                failures[name] = reason
        return wire.report(failures, failure_status)

    def _answer(self, request: wire.Request) -> wire.Reply:
        if (refused := wire.refusal(request, self._routes)) is not None:
            return refused
        try:
            return self._routes[request.path]()
        except Exception:
            log.exception("answering a request failed", path=request.path)
            return wire.Reply.error(HTTPStatus.INTERNAL_SERVER_ERROR)

    def _serve_connection(self, sock: socket.socket) -> None:
        sock.settimeout(wire.IDLE_S)
        buffer = b""
        with contextlib.suppress(OSError):  # closed, idle too long, or gone mid-request
            while True:
                while (end := buffer.find(b"\r\n\r\n")) < 0:
                    if len(buffer) > MAX_HEAD or not (data := sock.recv(65536)):
                        return
                    buffer += data
                head, buffer = buffer[:end], buffer[end + 4 :]
                try:
                    request, length = wire.read_request(head)
                except wire.BadRequest:
                    sock.sendall(wire.encode(wire.Reply.error(HTTPStatus.BAD_REQUEST), False, True))
                    return
                while len(buffer) < length:  # a body, read and dropped
                    if not (data := sock.recv(65536)):
                        return
                    buffer += data
                buffer = buffer[length:]
                keep_alive = request.keep_alive()
                sock.sendall(wire.encode(self._answer(request), keep_alive, request.method != "HEAD"))
                if not keep_alive:
                    return

    def _listen(self) -> socket.socket:
        if self.host is not None:
            family, _, _, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            return socket.create_server(address[:2], family=family)
        try:
            return socket.create_server(("", self.port), family=socket.AF_INET6, dualstack_ipv6=True)
        except OSError as e:
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise
            # Every interface includes IPv6, which a host may have switched off; Go's `:port`
            # falls back to IPv4 alone there, and so does this.
            log.warning("cannot listen on every IPv6 interface, serving IPv4 only", error=str(e))
            return socket.create_server(("0.0.0.0", self.port))

    def start(self) -> None:
        listener = self._listen()
        if self.port == 0:  # an ephemeral port was asked for (tests)
            self.port = listener.getsockname()[1]
        self._listener = ThreadedListener(listener, self._serve_connection, "http")
        self._listener.start()
        log.info("serving metrics and health", endpoint=f"{self.host or ''}:{self.port}")

    def stop(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.stop(1.0)
