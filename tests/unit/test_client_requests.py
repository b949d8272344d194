"""ApiClient's request path against a local aiohttp server: URLs and queries as sent, watch
events split across and within chunks, 409 as ApiError.conflict, a plain-text 404 as ApiError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web
from kubernetes_asyncio.client import Configuration

from controller_runtime.client import ApiClient, ApiError, InvalidNameError, Target, unstructured_status
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, VOLUME_SNAPSHOTS
from tests.support.fake_apiserver import serve

EVENTS = [
    {"type": "ADDED", "object": {"metadata": {"name": f"pv{i}", "resourceVersion": str(i)}}} for i in range(5)
]


def _peer(request: web.Request) -> object:
    """The client end of the connection a request came on."""
    return request.transport.get_extra_info("peername") if request.transport else None


class Together:
    """Holds each request a handler is answering until `count` are in flight at once, then lets
    them all through (and every later one at once): the client had `count` connections busy
    together, which a server's delay only made likely. Bounded in real time only for a client
    that never gets there (the handler then fails with TimeoutError)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.in_flight = 0
        self.reached = asyncio.Event()

    async def hold(self) -> None:
        self.in_flight += 1
        try:
            if self.in_flight >= self.count:
                self.reached.set()
            await asyncio.wait_for(self.reached.wait(), 10)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def server() -> AsyncIterator[tuple[ApiClient, list[web.Request]]]:
    seen: list[web.Request] = []

    async def watch_or_list(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        if request.query.get("watch") != "true":
            return web.json_response({"items": [], "metadata": {"resourceVersion": "9"}})
        resp = web.StreamResponse()
        await resp.prepare(request)
        data = b"".join(orjson.dumps(e) + b"\n" for e in EVENTS) + b"\n"
        # Cut the stream at awkward places: mid-line, one byte, several lines at once.
        pos = 0
        for size in (7, 33, 1, 99, 200, 10_000):
            await resp.write(data[pos : pos + size])
            await asyncio.sleep(0)
            pos += size
        await resp.write_eof()
        return resp

    async def patch(request: web.Request) -> web.Response:
        seen.append(request)
        body = await request.json()
        if body["metadata"]["resourceVersion"] != "5":
            return web.json_response(
                {"kind": "Status", "reason": "Conflict", "message": "modified"}, status=409
            )
        return web.json_response({"metadata": {"name": "c", "resourceVersion": "6"}})

    app = web.Application()
    app.router.add_get("/api/v1/persistentvolumes", watch_or_list)
    app.router.add_patch("/api/v1/namespaces/ns/persistentvolumeclaims/c/status", patch)
    async with serve(app) as client:
        yield client, seen


async def test_watch_yields_every_event_however_the_stream_is_cut(
    server: tuple[ApiClient, list[web.Request]],
) -> None:
    client, seen = server
    got = [(kind, obj) async for kind, obj in client.watch(PERSISTENT_VOLUMES, resource_version="3")]
    assert got == [(e["type"], e["object"]) for e in EVENTS]
    assert seen[0].query["resourceVersion"] == "3" and seen[0].query["allowWatchBookmarks"] == "true"


async def test_query_parameters_are_encoded(server: tuple[ApiClient, list[web.Request]]) -> None:
    client, seen = server
    await client.list_page(PERSISTENT_VOLUMES, labelSelector="app in (a,b),x!=y", limit=5, continue_="")
    assert seen[0].query["labelSelector"] == "app in (a,b),x!=y"
    assert seen[0].query["limit"] == "5" and "continue" not in seen[0].query


async def test_merge_patch_with_a_stale_resource_version_is_a_conflict(
    server: tuple[ApiClient, list[web.Request]],
) -> None:
    client, seen = server
    patch = {"metadata": {"resourceVersion": "5"}, "status": {"phase": "Bound"}}
    new = await client.patch(PERSISTENT_VOLUME_CLAIMS, "c", patch, "ns", subresource="status")
    assert new["metadata"]["resourceVersion"] == "6"
    assert seen[0].content_type == "application/merge-patch+json"
    with pytest.raises(Exception) as err:
        await client.patch(
            PERSISTENT_VOLUME_CLAIMS, "c", {"metadata": {"resourceVersion": "4"}}, "ns", subresource="status"
        )
    assert getattr(err.value, "conflict", False)


async def test_a_plain_text_error_is_an_api_error(server: tuple[ApiClient, list[web.Request]]) -> None:
    """An API group the server does not serve answers "404 page not found", not a Status."""
    client, _ = server
    with pytest.raises(ApiError) as err:
        await client.list_page(VOLUME_SNAPSHOTS, limit=1)
    assert err.value.not_found and err.value.reason == "NotFound"
    # client-go's words for it, with what was asked: the external-provisioner's events quote them.
    assert err.value.message == (
        "the server could not find the requested resource (get volumesnapshots.snapshot.storage.k8s.io)"
    )
    with pytest.raises(ApiError) as err:
        await client.get(VOLUME_SNAPSHOTS, "snap", "ns")
    assert err.value.message == (
        "the server could not find the requested resource (get volumesnapshots.snapshot.storage.k8s.io snap)"
    )


def test_an_answer_without_a_status_reads_as_client_go_words_it() -> None:
    """A taken name stays AlreadyExists (a POST) and a conflict elsewhere; a server error quotes
    the server's text; an unknown code says it brought nothing more."""
    created = unstructured_status(409, "POST", "unknown", Target(VOLUME_SNAPSHOTS))
    assert created["reason"] == "AlreadyExists"
    assert created["message"] == (
        "the server reported a conflict (post volumesnapshots.snapshot.storage.k8s.io)"
    )
    assert unstructured_status(409, "PUT", "unknown", None)["reason"] == "Conflict"
    failed = unstructured_status(500, "GET", "boom", Target(PERSISTENT_VOLUME_CLAIMS, "c"))
    assert failed["message"] == (
        'an error on the server ("boom") has prevented the request from succeeding '
        "(get persistentvolumeclaims c)"
    )
    odd = unstructured_status(418, "GET", "", None)
    assert odd["message"] == (
        "the server responded with the status code 418 but did not return more information"
    )


def test_leader_election_waits_in_a_rate_limiter_of_its_own() -> None:
    """A controller in debt to its QPS limiter (hundreds of deletes queued) must not hold back its
    Lease renewals: run_elected's client has the same limits and a bucket of its own."""
    work = ApiClient(Configuration(host="https://127.0.0.1:1"), qps=5, burst=2)
    lease = work.with_own_limiter()
    for _ in range(50):
        work._limiter.reserve()
    assert work._limiter.reserve() > 9.0  # ten seconds of queued work: past a 10 s renew deadline
    assert lease._limiter.reserve() == 0.0
    assert (lease._limiter.qps, lease._limiter.burst) == (5, 2)


async def test_requests_share_a_few_connections_and_watches_are_not_capped() -> None:
    """A burst of requests reuses at most REQUEST_CONNECTIONS connections (no handshake per
    request), while more open watches than that still leave requests room."""
    from controller_runtime import client as client_module

    peers: set[object] = set()
    hold = asyncio.Event()
    watching = asyncio.Event()
    busy = Together(client_module.REQUEST_CONNECTIONS)  # every connection the client may open

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.add(_peer(request))
        if request.query.get("watch") == "true":
            resp = web.StreamResponse()
            await resp.prepare(request)
            if len(peers) == client_module.REQUEST_CONNECTIONS + 2:
                watching.set()
            await hold.wait()
            await resp.write_eof()
            return resp
        await busy.hold()
        return web.json_response({"metadata": {"name": "pv"}})

    app = web.Application()
    app.router.add_get("/api/v1/persistentvolumes", handler)
    app.router.add_get("/api/v1/persistentvolumes/pv", handler)
    async with serve(app) as client:

        async def drain() -> None:
            async for _ in client.watch(PERSISTENT_VOLUMES):
                pass

        watches = [asyncio.create_task(drain()) for _ in range(client_module.REQUEST_CONNECTIONS + 2)]
        try:
            await asyncio.wait_for(watching.wait(), 10)
            peers.clear()
            burst = asyncio.gather(*(client.get(PERSISTENT_VOLUMES, "pv") for _ in range(40)))
            await asyncio.wait_for(burst, 10)
            assert 1 <= len(peers) <= client_module.REQUEST_CONNECTIONS
        finally:
            hold.set()
            await asyncio.gather(*watches)


async def test_warm_opens_the_request_connections_that_a_burst_then_reuses() -> None:
    """A controller warms its client while its caches fill: its first burst of requests finds the
    connections open (no TLS handshake inside the burst), as Go finds its one HTTP/2 connection."""
    from controller_runtime import client as client_module

    warmed: set[object] = set()
    burst: set[object] = set()
    warming = Together(client_module.REQUEST_CONNECTIONS)  # all at once: each on its own connection
    bursting = Together(client_module.REQUEST_CONNECTIONS)

    async def version(request: web.Request) -> web.Response:
        warmed.add(_peer(request))
        await warming.hold()
        return web.json_response({"major": "1"})

    async def get(request: web.Request) -> web.Response:
        burst.add(_peer(request))
        await bursting.hold()
        return web.json_response({"metadata": {"name": "pv"}})

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/api/v1/persistentvolumes/pv", get)
    async with serve(app) as client:
        await client.warm()
        assert len(warmed) == client_module.REQUEST_CONNECTIONS
        burst_size = 2 * client_module.REQUEST_CONNECTIONS + 4  # more than the connections: some wait
        await asyncio.gather(*(client.get(PERSISTENT_VOLUMES, "pv") for _ in range(burst_size)))
        assert burst <= warmed, "the burst opened connections of its own"


async def test_warm_never_fails_a_start() -> None:
    app = web.Application()  # no /version: every warm-up request gets a 404
    async with serve(app) as client:
        await client.warm()


async def test_names_are_sent_as_themselves_or_refused_as_client_go_refuses_them() -> None:
    """Issue 29: names from fields nobody validates went into paths raw (`x?y` read `x`)."""
    seen: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.json_response({"kind": "Status", "reason": "NotFound", "message": "nope"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with serve(app) as client:
        for odd in ("x?dryRun=All", "x#frag", "x y"):
            with pytest.raises(ApiError):
                await client.get(PERSISTENT_VOLUMES, odd)
        assert seen == [
            "/api/v1/persistentvolumes/x%3FdryRun%3DAll",
            "/api/v1/persistentvolumes/x%23frag",
            "/api/v1/persistentvolumes/x%20y",
        ]
        seen.clear()
        for name, namespace, message in (
            ("a/status", "ns", """invalid resource name "a/status": [may not contain '/']"""),
            ("..", "ns", "invalid resource name \"..\": [may not be '..']"),
            ("c", "n%2Fs", """invalid namespace "n%2Fs": [may not contain '%']"""),
        ):
            with pytest.raises(InvalidNameError) as err:
                await client.patch(PERSISTENT_VOLUME_CLAIMS, name, {}, namespace)
            # No object can have such a name: asked for, it does not exist.
            assert err.value.not_found and err.value.message == message
        assert seen == []
