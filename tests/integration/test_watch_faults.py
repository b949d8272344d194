"""An informer through a fault-injecting proxy in front of the real kube-apiserver: a watch that
ends in 410 Gone, a bookmark, a watch closed mid-stream and a throttled apiserver (429 with
Retry-After) must each be survived without a missed update: after writes made through and after
the fault, the informer's cache equals a fresh list (names and resourceVersions)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from controller_runtime.client import ApiClient
from controller_runtime.informer import SharedInformer
from controller_runtime.reflector import LISTS
from controller_runtime.resources import Obj, Resource, name_of
from localstack import certs
from localstack.controlplane import ControlPlane
from localstack.proc import client_ssl_context, free_ports
from tests.support.waits import eventually_async, no_problems

pytestmark = pytest.mark.integration

CONFIG_MAPS = Resource("", "v1", "configmaps", "ConfigMap", True)
RETRY_AFTER = 1


def status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code,
            "message": message}  # fmt: skip


@dataclass
class FaultProxy:
    """HTTP on 127.0.0.1 to the apiserver's HTTPS as the admin. Faults are armed by the test:
    `throttle` answers the next requests with 429 and Retry-After, `gone` ends the next watch with
    an ERROR event of code 410, `kick` acts on the watches open now (close them abruptly, or send
    a BOOKMARK and end them)."""

    cp: ControlPlane
    throttle: int = 0
    gone: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    watch_versions: list[str] = field(default_factory=list)  # resourceVersion of each watch request
    request_times: list[tuple[float, int]] = field(default_factory=list)  # (time, status) answered
    _kicks: list[asyncio.Queue[tuple[str, str]]] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None
    port: int = 0

    async def start(self) -> None:
        admin = self.cp.certs.pki.ensure_client(certs.ADMIN)
        ctx = client_ssl_context(self.cp.ca_file, admin.cert, admin.key)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_ports(1)[0]
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        for q in self._kicks:
            q.put_nowait(("close", ""))
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def client(self) -> ApiClient:
        cfg = Configuration()
        cfg.host = f"http://127.0.0.1:{self.port}"
        return ApiClient(cfg, qps=0, burst=1, user_agent="kubeloop-watch-faults")

    def kick(self, action: str, rv: str = "") -> int:
        for q in self._kicks:
            q.put_nowait((action, rv))
        return len(self._kicks)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("true", "1")
        if watch:
            self.watch_versions.append(request.query.get("resourceVersion", ""))
        if self.throttle > 0:
            self.throttle -= 1
            self.hits["throttled"] += 1
            self.request_times.append((time.monotonic(), 429))
            return web.json_response(
                status(429, "TooManyRequests", "the server has received too many requests"),
                status=429,
                headers={"Retry-After": str(RETRY_AFTER)},
            )
        self.request_times.append((time.monotonic(), 200))
        if watch and self.gone > 0:
            self.gone -= 1
            self.hits["gone"] += 1
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            event = {"type": "ERROR", "object": status(410, "Expired", "too old resource version")}
            await resp.write(json.dumps(event).encode() + b"\n")
            await resp.write_eof()
            return resp
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        async with self._session.request(
            request.method,
            self.cp.server + request.path_qs,
            data=body or None,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None),
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "application/json")}
            )
            await resp.prepare(request)
            if not watch:
                await resp.write(await up.read())
                await resp.write_eof()
                return resp
            await self._stream_watch(request, up, resp)
            return resp

    async def _stream_watch(
        self, request: web.Request, up: aiohttp.ClientResponse, resp: web.StreamResponse
    ) -> None:
        kicks: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._kicks.append(kicks)
        try:
            next_line = asyncio.ensure_future(up.content.readline())
            next_kick = asyncio.ensure_future(kicks.get())
            while True:
                done, _ = await asyncio.wait({next_line, next_kick}, return_when=asyncio.FIRST_COMPLETED)
                if next_line in done:
                    line = next_line.result()
                    if not line:
                        break
                    await resp.write(line)
                    next_line = asyncio.ensure_future(up.content.readline())
                if next_kick in done:
                    action, rv = next_kick.result()
                    if action == "bookmark":
                        self.hits["bookmark"] += 1
                        obj = {"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}
                        mark = {"type": "BOOKMARK", "object": obj}
                        await resp.write(json.dumps(mark).encode() + b"\n")
                        await resp.write_eof()
                    else:
                        # Mid-stream, no end of the chunked body: the client sees the connection drop.
                        self.hits["closed"] += 1
                        if request.transport is not None:  # None: the client already left
                            request.transport.close()
                    break
            next_line.cancel()
            next_kick.cancel()
        finally:
            self._kicks.remove(kicks)


@pytest_asyncio.fixture(loop_scope="session")
async def proxy(control_plane: ControlPlane) -> AsyncIterator[FaultProxy]:
    p = FaultProxy(control_plane)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def fresh(api: ApiClient, namespace: str) -> dict[str, str]:
    items, _ = await api.list_all(CONFIG_MAPS, namespace)
    return {name_of(o): o["metadata"]["resourceVersion"] for o in items if name_of(o) != "kube-root-ca.crt"}


def cached(informer: SharedInformer) -> dict[str, str]:
    return {
        name_of(o): o["metadata"]["resourceVersion"]
        for o in informer.store.values()
        if name_of(o) != "kube-root-ca.crt"
    }


async def converged(api: ApiClient, informer: SharedInformer, namespace: str, timeout: float = 30) -> None:
    async def missed() -> list[str]:
        want = await fresh(api, namespace)
        now = cached(informer)
        return [] if now == want else [f"cached {now}, listed {want}"]

    await eventually_async("the cache to hold every update", missed, timeout, satisfied=no_problems)


async def churn(api: ApiClient, namespace: str, tag: str) -> None:
    """Creates, updates and deletes: every kind of watch event."""
    for i in range(4):
        await api.create(CONFIG_MAPS, {"metadata": {"name": f"{tag}-{i}"}, "data": {"v": "0"}}, namespace)
    for i in range(4):
        await api.patch(CONFIG_MAPS, f"{tag}-{i}", {"data": {"v": "1"}}, namespace)
    await api.delete(CONFIG_MAPS, f"{tag}-0", namespace)


@contextlib.asynccontextmanager
async def informer_through(proxy: FaultProxy, namespace: str) -> AsyncIterator[SharedInformer]:
    client = proxy.client()
    informer = SharedInformer(client, CONFIG_MAPS, namespace=namespace)
    informer.start()
    try:
        await asyncio.wait_for(informer.wait_for_sync(), 30)
        yield informer
    finally:
        await informer.stop()
        await client.close()


async def until_watching(proxy: FaultProxy) -> None:
    async def watching() -> bool:
        return bool(proxy._kicks)

    await eventually_async("the informer's watch through the proxy", watching, 5, 0.05)


async def test_watch_closed_mid_stream(api: ApiClient, proxy: FaultProxy, namespace: str) -> None:
    async with informer_through(proxy, namespace) as informer:
        await churn(api, namespace, "before")
        await converged(api, informer, namespace)
        await until_watching(proxy)
        assert proxy.kick("close") == 1
        await churn(api, namespace, "after")
        await converged(api, informer, namespace)
        assert proxy.hits["closed"] == 1
        # It resumed from where it was: a watch, no new list.
        assert proxy.watch_versions[-1] not in ("", "0")


async def test_watch_410_gone_relists(api: ApiClient, proxy: FaultProxy, namespace: str) -> None:
    async with informer_through(proxy, namespace) as informer:
        await churn(api, namespace, "before")
        await converged(api, informer, namespace)
        await until_watching(proxy)
        lists = LISTS.labels("configmaps").value
        proxy.gone = 1
        proxy.kick("close")
        # Changes the informer can only learn of by listing again.
        await churn(api, namespace, "after")
        await converged(api, informer, namespace)
        assert proxy.hits["gone"] == 1
        assert LISTS.labels("configmaps").value > lists, "a 410 must be answered by a re-list"


async def test_bookmark_moves_the_resume_point(api: ApiClient, proxy: FaultProxy, namespace: str) -> None:
    async with informer_through(proxy, namespace) as informer:
        await churn(api, namespace, "before")
        await converged(api, informer, namespace)
        await until_watching(proxy)
        # Writes elsewhere move the global resourceVersion past the last event this watch saw;
        # a bookmark carries the newer version, and the next watch must start from it.
        other = f"t-{uuid.uuid4().hex[:8]}"
        await api.create(Resource("", "v1", "namespaces", "Namespace", False), {"metadata": {"name": other}})
        head = (await api.list_page(CONFIG_MAPS, namespace, limit=1))["metadata"]["resourceVersion"]
        proxy.kick("bookmark", head)
        await churn(api, namespace, "after")
        await converged(api, informer, namespace)
        assert proxy.hits["bookmark"] == 1
        assert head in proxy.watch_versions, f"the watch did not resume from the bookmark's {head}"
        await api.delete(Resource("", "v1", "namespaces", "Namespace", False), other)


async def test_throttled_apiserver_retry_after(api: ApiClient, proxy: FaultProxy, namespace: str) -> None:
    async with informer_through(proxy, namespace) as informer:
        await churn(api, namespace, "before")
        await converged(api, informer, namespace)
        await until_watching(proxy)
        proxy.throttle = 3
        proxy.kick("close")
        await churn(api, namespace, "after")
        await converged(api, informer, namespace)
        assert proxy.hits["throttled"] == 3
        # Each retry came no sooner than the Retry-After the 429 before it asked for.
        times = proxy.request_times
        for (t0, code), (t1, _) in itertools.pairwise(times):
            if code == 429:
                waited = t1 - t0
                assert waited >= RETRY_AFTER * 0.95, f"retried {waited:.2f}s after a 429"
