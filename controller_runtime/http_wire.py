"""The HTTP/1.1 of every process's endpoint (`/metrics`, `/healthz`, `/livez`, `/readyz`,
`/debug/queues`), apart from what serves it: controller_runtime.health serves it on asyncio's
streams, controller_runtime.health_threads on threads for the node sidecars that import no asyncio
(issue 49). Both answer alike: GET and HEAD of those paths, keep-alive as HTTP/1.1 and 1.0 ask for
it, 404 and 405 worded as aiohttp worded them, 400 and a closed connection for what cannot be read
(a malformed head, a chunked body), liveness failures as `[-]<check> failed: <reason>` lines."""

from __future__ import annotations

import json
import time
from collections.abc import Container
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Generic, TypeVar

from .debug import FAILURES

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


PATHS = ("/metrics", "/healthz", "/livez", "/readyz", "/debug/queues")


def read_request(head: bytes) -> tuple[Request, int]:
    """A request's head (without its blank line) and the length of the body to read and drop."""
    request = parse_head(head)
    if "transfer-encoding" in request.headers:
        raise BadRequest("chunked bodies are not taken")
    try:
        length = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise BadRequest("malformed content-length") from None
    if not 0 <= length <= MAX_BODY:
        raise BadRequest("body too large")
    return request, length


def refusal(request: Request, paths: Container[str]) -> Reply | None:
    """The answer to a path not served or a method not taken; None when the route may answer."""
    if request.path not in paths:
        return Reply.error(HTTPStatus.NOT_FOUND)
    if request.method not in ("GET", "HEAD"):
        return Reply.error(HTTPStatus.METHOD_NOT_ALLOWED, Allow="GET,HEAD")
    return None


def report(failures: dict[str, str], failure_status: int) -> Reply:
    """`ok`, or a line per failed check: 500 for /healthz as Kubernetes' own /healthz and the CSI
    sidecars answer (kubelet restarts on any status of 400 and above; people and scripts compare
    with what upstream prints), 503 for /readyz (not ready is a temporary refusal, not a failure)."""
    if not failures:
        return Reply.text("ok")
    body = "\n".join(f"[-]{name} failed: {reason}" for name, reason in sorted(failures.items()))
    return Reply.text(body + "\n", failure_status)


def queues() -> Reply:
    return Reply(200, json.dumps(FAILURES.snapshot()).encode(), JSON)


C = TypeVar("C")


class Checks(Generic[C]):
    """What both endpoints hold: where they listen and the checks /healthz and /readyz run (C: a
    check as each server calls it)."""

    def __init__(self, endpoint: str) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self._liveness: dict[str, C] = {}
        self._readiness: dict[str, C] = {}

    def add_liveness_check(self, name: str, check: C) -> None:
        self._liveness[name] = check

    def add_readiness_check(self, name: str, check: C) -> None:
        self._readiness[name] = check
