"""A small asyncio client for the Kubernetes API that returns plain dicts.

Configuration (server, CA, client certificate or token) comes from a kubeconfig or the in-cluster
service account (controller_runtime.kubeconfig); requests go over HTTP/1.1 on kept connections
(controller_runtime.http_client) and are decoded once with orjson. Every request, watches
included, first takes a token from the client-side limiter, as client-go does with
--kube-api-qps/--kube-api-burst.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import orjson

from . import kubeconfig
from .http_client import Answer, ConnectionPool, Streamed
from .kubeconfig import ClientConfig
from .logs import get_logger
from .metrics import Counter, Histogram
from .ratelimit import TokenBucket
from .resources import Obj, Resource, name_of, namespace_of

log = get_logger("client")

REQUESTS = Counter(
    "rest_client_requests_total", "API requests by status code and method", ["code", "method", "host"]
)
LATENCY = Histogram(
    "rest_client_request_duration_seconds",
    "API request latency by verb",
    ["verb"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RATE_LIMITER_WAIT = Histogram(
    "rest_client_rate_limiter_duration_seconds",
    "Time spent waiting for the client-side rate limiter",
    ["verb"],
)

# Connections that requests (not watches) share. HTTP/1.1 carries one request at a time per
# connection, and a client that opens a new one for every request that finds none idle (aiohttp's
# did, uncapped) turns a burst of 100
# workers meant 100 TLS handshakes, each costing client and apiserver CPU (40 concurrent GETs on a
# fresh client: 0.56 s and 0.15 CPU s uncapped, 0.31 s and 0.06 CPU s over 8 connections; 200:
# 3.6 s and 0.87 CPU s against 1.5 s and 0.19 CPU s). client-go multiplexes every request over one
# HTTP/2 connection; a few reused connections are the nearest HTTP/1.1 gets to that. 32 rather
# than 8: the attach-detach controller's creates for 100 pods queued behind 8 connections, their
# VolumeAttachments appearing 0.76 s (p50) after the pods against kcm's 0.33 s; over 32, 0.37 s
# against 0.30 s (bench.attach, 100 pods, 3 rounds). The connections are opened once and kept.
REQUEST_CONNECTIONS = 32

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}


# What client-go says for an error answer that is not a Status (a group the server does not
# serve answers a plain "404 page not found"): reason and message by HTTP code. None as the
# message means the server's own text is the message.
_UNSTRUCTURED: dict[int, tuple[str, str | None]] = {
    400: ("BadRequest", "the server rejected our request for an unknown reason"),
    401: ("Unauthorized", "the server has asked for the client to provide credentials"),
    403: ("Forbidden", None),
    404: ("NotFound", "the server could not find the requested resource"),
    405: ("MethodNotAllowed", "the server does not allow this method on the requested resource"),
    415: ("UnsupportedMediaType", None),
    422: ("Invalid", "the server rejected our request due to an error in our request"),
    429: ("TooManyRequests", "the server has received too many requests and has asked us to try again later"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: (
        "Timeout",
        "the server was unable to return a response in the time allotted, "
        "but may still be processing the request",
    ),
}


@dataclass(frozen=True)
class Target:
    """What a request was about, for the message of an error answer that carries no Status."""

    resource: Resource
    name: str = ""

    def describe(self, method: str) -> str:
        res = self.resource
        qualified = f"{res.plural}.{res.group}" if res.group else res.plural
        return " ".join(p for p in (method.lower(), qualified, self.name) if p)


def unstructured_status(status: int, method: str, server_text: str, target: Target | None) -> Obj:
    """The Status client-go makes of an error answer without one, so that messages read alike."""
    if status == 409:
        reason = "AlreadyExists" if method == "POST" else "Conflict"
        message = "the server reported a conflict"
    elif status == 406:
        reason = "NotAcceptable"
        message = (
            server_text
            if server_text not in ("", "unknown")
            else "the server was unable to respond with a content type that the client supports"
        )
    elif status in _UNSTRUCTURED:
        reason, fixed = _UNSTRUCTURED[status]
        message = server_text if fixed is None else fixed
    elif status >= 500:
        reason = "InternalError"
        quoted = json.dumps(server_text, ensure_ascii=False)  # Go's %q, for such text
        message = f"an error on the server ({quoted}) has prevented the request from succeeding"
    else:
        reason = "Unknown"
        message = f"the server responded with the status code {status} but did not return more information"
    if target is not None:
        message = f"{message} ({target.describe(method)})"
    return {"kind": "Status", "status": "Failure", "code": status, "reason": reason, "message": message}


class ApiError(Exception):
    """A non-2xx answer from the API server, with its Status object (or, for an answer without
    one, the Status client-go would make of it)."""

    def __init__(self, status: int, body: Obj | None, method: str = "", path: str = "") -> None:
        self.status = status
        self.body = body or {}
        self.reason = str(self.body.get("reason", ""))
        self.message = str(self.body.get("message", "")) or f"HTTP {status}"
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}".strip())

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        """An optimistic-concurrency failure (stale resourceVersion) or a name already taken."""
        return self.status == 409

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def gone(self) -> bool:
        return self.status == 410

    @property
    def forbidden(self) -> bool:
        return self.status == 403


class InvalidNameError(ApiError):
    """A request for a name or namespace no object can have, refused before it is sent, as
    client-go refuses it (`invalid resource name "a/b": [may not contain '/']`). Such names come
    from fields nobody validates (a claim's selected-node annotation, its dataSource name, a
    volumeName); sent, `a/status` reached the object's status subresource. No object has such a
    name, so it answers as NotFound does: a caller asking whether it exists learns that it does not."""

    def __init__(self, what: str, value: str, problems: list[str], method: str) -> None:
        message = f"invalid {what} {json.dumps(value, ensure_ascii=False)}: [{' '.join(problems)}]"
        super().__init__(
            404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "message": message}, method
        )


def path_segment_problems(value: str) -> list[str]:
    """apimachinery's IsValidPathSegmentName: what makes a name unusable in a request path."""
    if value in (".", ".."):
        return [f"may not be '{value}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in value]


def _check_names(method: str, name: str | None, namespace: str | None) -> None:
    if namespace and (problems := path_segment_problems(namespace)):
        raise InvalidNameError("namespace", namespace, problems, method)
    if name and (problems := path_segment_problems(name)):
        raise InvalidNameError("resource name", name, problems, method)


class WritesStoppedError(Exception):
    """A write refused in the process, never sent: the client's writes were stopped
    (ApiClient.stop_writes), as a controller's are once it stands down for its kcm counterpart."""


class WatchExpiredError(Exception):
    """The watch's resourceVersion is older than what etcd still has (410 Gone): re-list."""


def _ssl_context(cfg: ClientConfig) -> ssl.SSLContext | None:
    if not str(cfg.host).startswith("https"):
        return None
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cfg.cert_file and cfg.key_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


class ApiClient:
    def __init__(
        self, cfg: ClientConfig, qps: float = 5.0, burst: int = 10, user_agent: str = "kubeloop"
    ) -> None:
        self.server = str(cfg.host).rstrip("/")
        self._cfg = cfg
        self._ssl = _ssl_context(cfg)
        self._limiter = TokenBucket(qps, burst)
        self._user_agent = user_agent
        self._pool: ConnectionPool | None = None
        self._watch_pool: ConnectionPool | None = None
        self._host_label = self.server.split("://", 1)[-1]
        # The hot path of every request, prepared once: metric children by verb and status, and
        # the Authorization header when nothing can rotate it.
        self._latency: dict[str, Any] = {}
        self._requests: dict[tuple[int, str], Any] = {}
        self._static_auth: dict[str, str] | None = None
        self._writes_stopped: str | None = None

    def stop_writes(self, reason: str) -> None:
        """From now on every request but a GET (a create, update, patch or delete, Events
        included) fails with WritesStoppedError before it is sent; reads and watches go on. For
        good: nothing turns writes on again. Clients made by with_own_limiter are not affected."""
        self._writes_stopped = reason or "writes stopped"

    def with_own_limiter(self) -> ApiClient:
        """A client of the same server and credentials whose requests wait in a rate limiter of their
        own. Leader election uses one, as client-go gives it a clientset of its own: a Lease renewal
        queued behind a burst of the controller's work (a provisioner deleting hundreds of volumes
        at its QPS) misses the renew deadline, and the process loses the lease and exits."""
        return ApiClient(
            self._cfg, qps=self._limiter.qps, burst=self._limiter.burst, user_agent=self._user_agent
        )

    @classmethod
    async def from_kubeconfig(
        cls, path: str | None, qps: float = 5.0, burst: int = 10, user_agent: str = "kubeloop"
    ) -> ApiClient:
        """Loads `path`, or the in-cluster service account when path is empty."""
        return cls(await kubeconfig.load(path), qps=qps, burst=burst, user_agent=user_agent)

    def _auth(self) -> dict[str, str]:
        """The request's auth headers, as a new dict the caller may extend. Evaluated per request
        when a refresh hook exists (in-cluster service-account tokens are rotated on disk);
        otherwise the header cannot change and is built once."""
        if self._cfg.refresh_api_key_hook is not None:
            self._cfg.refresh_api_key_hook(self._cfg)
        elif self._static_auth is not None:
            return dict(self._static_auth)
        token = self._cfg.api_key.get("BearerToken") or self._cfg.api_key.get("authorization")
        headers = (
            {"Authorization": token if token.startswith("Bearer ") else f"Bearer {token}"} if token else {}
        )
        if self._cfg.refresh_api_key_hook is None:
            self._static_auth = dict(headers)
        return headers

    @staticmethod
    def _target(path: str, params: dict[str, Any] | None) -> str:
        """The request target: paths are made of names the apiserver validated (DNS labels and
        subdomains; _check_names refuses the rest), and the query is encoded here."""
        query = _clean(params)
        return f"{path}?{urlencode(query)}" if query else path

    def _observe(self, method: str, status: int, seconds: float) -> None:
        latency = self._latency.get(method)
        if latency is None:
            latency = self._latency[method] = LATENCY.labels(method)
        latency.observe(seconds)
        counter = self._requests.get((status, method))
        if counter is None:
            counter = self._requests[(status, method)] = REQUESTS.labels(
                str(status), method, self._host_label
            )
        counter.inc()

    def _new_pool(self, connections: int) -> ConnectionPool:
        # Idle connections are kept 90 s, as client-go's transport keeps them: a controller working
        # in bursts would otherwise pay a TLS handshake per request of each burst, a profiled cost
        # of the external-attacher. No Accept-Encoding on watches: the apiserver compresses only
        # whole answers, and a large list is worth it; requests ask for gzip as Go's transport does.
        return ConnectionPool(
            self.server,
            self._ssl,
            limit=connections,
            headers={"User-Agent": self._user_agent, "Accept": "application/json"},
        )

    @property
    def pool(self) -> ConnectionPool:
        """The connections of requests: at most REQUEST_CONNECTIONS, kept and reused."""
        if self._pool is None:
            self._pool = self._new_pool(REQUEST_CONNECTIONS)
        return self._pool

    @property
    def watch_pool(self) -> ConnectionPool:
        """The connections of watches, uncapped: every informer holds a connection for as long as
        its watch lasts, and none may wait for another to end."""
        if self._watch_pool is None:
            self._watch_pool = self._new_pool(0)
        return self._watch_pool

    async def warm(self) -> None:
        """Opens the request connections before the first burst needs them."""
        await asyncio.gather(
            *(self.pool.request("GET", "/version", timeout=60.0) for _ in range(REQUEST_CONNECTIONS)),
            return_exceptions=True,
        )

    async def close(self) -> None:
        for pool in (self._pool, self._watch_pool):
            if pool is not None:
                await pool.close()
        self._pool = self._watch_pool = None

    @property
    def throttled(self) -> bool:
        """True when the client-side limiter has no token for a request sent now: callers that
        could start more work concurrently gain nothing from it, the limiter is the bottleneck."""
        return self._limiter.available() < 1.0

    async def _throttle(self, verb: str) -> None:
        delay = self._limiter.reserve()
        if delay > 0:
            RATE_LIMITER_WAIT.labels(verb).observe(delay)
            await asyncio.sleep(delay)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 60.0,
        target: Target | None = None,
    ) -> Obj:
        await self._throttle(method)
        data = orjson.dumps(body) if body is not None else None
        headers = self._auth()
        headers["Accept-Encoding"] = "gzip"
        if data is not None:
            headers["Content-Type"] = content_type
        request_target = self._target(path, params)
        for attempt in range(MAX_RETRIES + 1):
            # Checked with no await between it and the send (after the limiter's and a retry's waits).
            if self._writes_stopped is not None and method != "GET":
                raise WritesStoppedError(f"{method} {path}: not sent: {self._writes_stopped}")
            start = time.perf_counter()
            resp = await self.pool.request(
                method, request_target, headers=headers, body=data, timeout=timeout
            )
            raw = resp.body
            self._observe(method, resp.status, time.perf_counter() - start)
            wait = retry_after(resp.status, resp.headers.get("retry-after"))
            if wait is None or attempt == MAX_RETRIES:
                break
            log.info("the apiserver asked to retry later", method=method, path=path, status=resp.status,
                     retry_after=f"{wait}s", attempt=attempt + 1)  # fmt: skip
            await asyncio.sleep(wait)
        if resp.status >= 300:
            # Not always a Status: a group the server does not serve answers "404 page not found".
            try:
                status: Obj | None = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError:
                status = None
            if not isinstance(status, dict):
                plain = resp.content_type == "text/plain"
                text = raw[:2048].decode(errors="replace").strip() if plain else "unknown"
                status = unstructured_status(resp.status, method, text, target)
            raise ApiError(resp.status, status, method, path)
        decoded: Obj = orjson.loads(raw) if raw else {}
        return decoded

    async def get_text(self, path: str, timeout: float = 10.0) -> str:
        """GET a non-JSON path (`/metrics`, a node's proxied `/metrics`); ApiError on a non-2xx."""
        await self._throttle("GET")
        resp = await self.pool.request("GET", path, headers=self._auth(), timeout=timeout)
        text = _text(resp)
        if resp.status >= 300:
            raise ApiError(
                resp.status, unstructured_status(resp.status, "GET", text[:2048], None), "GET", path
            )
        return text

    # -- typed verbs -------------------------------------------------------------------------

    async def get(self, res: Resource, name: str, namespace: str | None = None) -> Obj:
        _check_names("GET", name, namespace)
        return await self.request("GET", res.path(namespace, name), target=Target(res, name))

    async def list_page(self, res: Resource, namespace: str | None = None, **params: Any) -> Obj:
        """One page of a list; pass `limit` and `continue_` (sent as `continue`) to page."""
        if "continue_" in params:
            params["continue"] = params.pop("continue_")
        return await self.request("GET", res.path(namespace), params=params, target=Target(res))

    async def list_all(
        self, res: Resource, namespace: str | None = None, page_size: int = 500, **params: Any
    ) -> tuple[list[Obj], str]:
        """Every item across pages, and the list's resourceVersion."""
        items: list[Obj] = []
        token = ""
        while True:
            page = await self.list_page(res, namespace, limit=page_size, continue_=token, **params)
            items.extend(page.get("items") or [])
            token = page.get("metadata", {}).get("continue", "")
            if not token:
                return items, str(page.get("metadata", {}).get("resourceVersion", ""))

    async def create(self, res: Resource, obj: Obj, namespace: str | None = None) -> Obj:
        ns = namespace or namespace_of(obj) or None
        return await self.request("POST", res.path(ns), body=_with_type(res, obj), target=Target(res))

    async def update(self, res: Resource, obj: Obj) -> Obj:
        """PUT with the object's resourceVersion: a stale one fails with 409 (ApiError.conflict)."""
        _check_names("PUT", name_of(obj), namespace_of(obj))
        return await self.request(
            "PUT",
            res.path(namespace_of(obj) or None, name_of(obj)),
            body=_with_type(res, obj),
            target=Target(res, name_of(obj)),
        )

    async def update_status(self, res: Resource, obj: Obj) -> Obj:
        _check_names("PUT", name_of(obj), namespace_of(obj))
        return await self.request(
            "PUT",
            res.path(namespace_of(obj) or None, name_of(obj), "status"),
            body=_with_type(res, obj),
            target=Target(res, name_of(obj)),
        )

    async def patch(
        self,
        res: Resource,
        name: str,
        patch: Any,
        namespace: str | None = None,
        patch_type: str = "merge",
        subresource: str | None = None,
    ) -> Obj:
        _check_names("PATCH", name, namespace)
        return await self.request(
            "PATCH",
            res.path(namespace, name, subresource),
            body=patch,
            content_type=PATCH_TYPES[patch_type],
            target=Target(res, name),
        )

    async def delete(
        self,
        res: Resource,
        name: str,
        namespace: str | None = None,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation: str | None = None,
    ) -> Obj:
        _check_names("DELETE", name, namespace)
        body: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
        pre = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if pre:
            body["preconditions"] = pre
        if propagation:
            body["propagationPolicy"] = propagation
        return await self.request("DELETE", res.path(namespace, name), body=body, target=Target(res, name))

    async def watch(
        self,
        res: Resource,
        namespace: str | None = None,
        *,
        resource_version: str = "",
        timeout_seconds: int = 300,
        **params: Any,
    ) -> AsyncIterator[tuple[str, Obj]]:
        """Yields (type, object) pairs until the server closes the watch.

        Raises WatchExpiredError on 410 Gone, whether as the HTTP status or as an ERROR event.
        """
        await self._throttle("WATCH")
        query = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
            **params,
        }
        # The server ends the watch after timeoutSeconds; the read timeout only catches a dead peer.
        target = self._target(res.path(namespace), query)
        attempt = 0
        while True:
            async with self.watch_pool.stream(
                "GET", target, headers=self._auth(), connect_timeout=15, read_timeout=timeout_seconds + 30
            ) as resp:
                REQUESTS.labels(str(resp.status), "WATCH", self._host_label).inc()
                wait = retry_after(resp.status, resp.headers.get("retry-after"))
                if wait is None or attempt == MAX_RETRIES:
                    async for event in _watch_events(resp, res.path(namespace)):
                        yield event
                    return
            attempt += 1
            log.info("the apiserver asked to retry the watch later", path=res.path(namespace),
                     status=resp.status, retry_after=f"{wait}s", attempt=attempt)  # fmt: skip
            await asyncio.sleep(wait)


def _text(answer: Answer) -> str:
    try:
        return answer.body.decode(answer.charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return answer.body.decode("utf-8", errors="replace")


async def _watch_events(resp: Streamed, path: str) -> AsyncIterator[tuple[str, Obj]]:
    """The (type, object) pairs of a watch response; 410 Gone, as the status or as an ERROR event,
    raises WatchExpiredError."""
    if resp.status >= 300:
        raw = await resp.read()
        body = orjson.loads(raw) if raw else None
        if resp.status == 410:
            raise WatchExpiredError(str(body))
        raise ApiError(resp.status, body if isinstance(body, dict) else None, "WATCH", path)
    # Events arrive as JSON lines; a chunk may hold many of them or part of one. Split each
    # chunk once: cutting one line at a time off a large buffer copies the rest every time.
    tail = b""
    async for chunk in resp.pieces():
        if tail:
            chunk = tail + chunk
        lines = chunk.split(b"\n")
        tail = lines.pop()
        for line in lines:
            if not line or line.isspace():
                continue
            event = orjson.loads(line)
            kind, obj = event.get("type", ""), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise WatchExpiredError(str(obj.get("message", "")))
                raise ApiError(int(obj.get("code") or 500), obj, "WATCH", path)
            yield kind, obj


# As client-go's rest.Request: how often a request the apiserver answered with Retry-After is sent again.
MAX_RETRIES = 10


def retry_after(status: int, header: str | None) -> int | None:
    """The seconds the apiserver asked the client to wait before sending the request again: a 429
    (max-in-flight or priority-and-fairness rejected it) or a 5xx with a Retry-After of whole
    seconds, as client-go's checkWait reads it; None for any other answer."""
    if status != 429 and status < 500:
        return None
    if header is None:
        return None
    try:
        seconds = int(header.strip())
    except ValueError:
        return None
    return max(0, seconds)


def _clean(params: dict[str, Any] | None) -> dict[str, str] | None:
    if not params:
        return None
    return {k: str(v) for k, v in params.items() if v not in (None, "")}


def _with_type(res: Resource, obj: Obj) -> Obj:
    if "kind" in obj and "apiVersion" in obj:
        return obj
    return {"apiVersion": res.api_version, "kind": res.kind, **obj}
