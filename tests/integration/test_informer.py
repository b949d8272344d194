"""Informers against the real kube-apiserver: ordering, watch recovery and 410 Gone."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError, WatchExpiredError
from controller_runtime.informer import EventHandler, SharedInformer, SharedInformerFactory
from controller_runtime.reflector import LISTS
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj, Resource, name_of
from controller_runtime.toolchain import Toolchain
from tests.support.waits import eventually_async

pytestmark = pytest.mark.integration


def pv_body(name: str, label: str, size: str = "1Gi") -> Obj:
    return {
        "metadata": {"name": name, "labels": {"test": label}},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "csi": {"driver": "loop.csi.kubeloop.dev", "volumeHandle": name},
        },
    }


def pvc_body(name: str) -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": "",
        },
    }


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.changed = asyncio.Event()

    def handler(self, kind: str) -> EventHandler:
        def add(o: Obj) -> None:
            self._note("add", kind, o)

        def update(old: Obj, new: Obj) -> None:
            self._note("update", kind, new)

        def delete(o: Obj) -> None:
            self._note("delete", kind, o)

        return EventHandler(on_add=add, on_update=update, on_delete=delete)

    def _note(self, verb: str, kind: str, obj: Obj) -> None:
        self.events.append((verb, kind, name_of(obj)))
        self.changed.set()

    async def wait_for(self, expected: list[tuple[str, str, str]], timeout: float = 15) -> None:
        """Waits until `expected` appears in order (other events may come between)."""

        def seen() -> bool:
            it = iter(self.events)
            return all(any(e == want for e in it) for want in expected)

        async def until() -> None:
            while not seen():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), timeout)


@contextlib.asynccontextmanager
async def running(*informers: SharedInformer) -> AsyncIterator[None]:
    for i in informers:
        i.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(i.wait_for_sync() for i in informers)), 30)
        yield
    finally:
        for i in informers:
            await i.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def label(api: ApiClient) -> AsyncIterator[str]:
    """A label for this test's PVs; they are cluster-scoped, so they are all deleted afterwards
    (a leftover unbound PV would be bound by another test's pv-controller)."""
    value = uuid.uuid4().hex[:8]
    yield value
    items, _ = await api.list_all(PERSISTENT_VOLUMES, labelSelector=f"test={value}")
    for item in items:
        await delete_now(api, PERSISTENT_VOLUMES, name_of(item))


async def delete_now(api: ApiClient, res: Resource, name: str, namespace: str | None = None) -> None:
    """Deletes without waiting for kcm's pv/pvc-protection controllers to drop their finalizers."""
    await api.patch(res, name, {"metadata": {"finalizers": None}}, namespace)
    await api.delete(res, name, namespace)


async def fresh_names(api: ApiClient, label: str) -> dict[str, str]:
    items, _ = await api.list_all(PERSISTENT_VOLUMES, labelSelector=f"test={label}")
    return {name_of(o): o["metadata"]["resourceVersion"] for o in items}


def cached_names(informer: SharedInformer, label: str) -> dict[str, str]:
    return {
        name_of(o): o["metadata"]["resourceVersion"]
        for o in informer.store.values()
        if o["metadata"].get("labels", {}).get("test") == label
    }


async def test_informer_sees_create_update_delete_in_order(
    api: ApiClient, namespace: str, label: str
) -> None:
    factory = SharedInformerFactory(api)
    pvs = factory.informer(PERSISTENT_VOLUMES)
    pvcs = factory.informer(PERSISTENT_VOLUME_CLAIMS, namespace)
    assert factory.informer(PERSISTENT_VOLUMES) is pvs, "one informer per resource"
    rec = Recorder()
    pvs.add_handler(rec.handler("pv"))
    pvcs.add_handler(rec.handler("pvc"))
    async with running(pvs, pvcs):
        a = await api.create(PERSISTENT_VOLUMES, pv_body(f"inf-{label}-a", label))
        await api.create(PERSISTENT_VOLUME_CLAIMS, pvc_body("claim"), namespace)
        a["metadata"].setdefault("annotations", {})["touched"] = "yes"
        await api.update(PERSISTENT_VOLUMES, a)
        await delete_now(api, PERSISTENT_VOLUMES, f"inf-{label}-a")
        await delete_now(api, PERSISTENT_VOLUME_CLAIMS, "claim", namespace)
        name = f"inf-{label}-a"
        await rec.wait_for(
            [
                ("add", "pv", name),
                ("add", "pvc", "claim"),
                ("update", "pv", name),
                ("delete", "pv", name),
                ("delete", "pvc", "claim"),
            ]
        )
        # The finalizer patch is an update before the delete; order across kinds is what matters.
        pv_events = [e[0] for e in rec.events if e[2] == name]
        assert pv_events[0] == "add" and pv_events[-1] == "delete"
        assert name not in pvs.store


async def kcm_caught_up(api: ApiClient, label: str) -> None:
    """Waits until kube-controller-manager works again after an apiserver restart: its informers
    re-list with client-go's backoff (up to 30 s) and meet Forbidden until the new apiserver has
    bootstrapped RBAC. A claim no pod uses, deleted, goes once kcm's pvc-protection lifts its
    finalizer. Without this wait the next module inherited a kcm still catching up
    (test_node_finalizer's claim waited past its time-out in one CI-equivalent run)."""
    name = f"kcm-canary-{label}"
    spec = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Mi"}},
        "storageClassName": "kcm-canary",
    }
    await api.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": name}, "spec": spec}, "default")
    await api.delete(PERSISTENT_VOLUME_CLAIMS, name, "default")

    async def gone() -> bool:
        try:
            await api.get(PERSISTENT_VOLUME_CLAIMS, name, "default")
        except ApiError as exc:
            if exc.not_found:
                return True
            raise
        return False

    await eventually_async("kube-controller-manager's pvc-protection back (the canary claim gone)", gone, 120)


async def test_informer_recovers_after_watch_is_cut(api: ApiClient, control_plane: Any, label: str) -> None:
    informer = SharedInformer(api, PERSISTENT_VOLUMES)
    async with running(informer):
        await api.create(PERSISTENT_VOLUMES, pv_body(f"cut-{label}-1", label))
        await control_plane.restart_apiserver()  # every open watch is cut
        await api.create(PERSISTENT_VOLUMES, pv_body(f"cut-{label}-2", label))
        await delete_now(api, PERSISTENT_VOLUMES, f"cut-{label}-1")

        async def caught_up() -> bool:
            fresh = await fresh_names(api, label)
            return cached_names(informer, label) == fresh and set(fresh) == {f"cut-{label}-2"}

        await eventually_async("the cache caught up after the cut", caught_up, 30)
        assert cached_names(informer, label) == await fresh_names(api, label)
        assert set(cached_names(informer, label)) == {f"cut-{label}-2"}
    await kcm_caught_up(api, label)


async def test_informer_relists_after_410_gone(api: ApiClient, control_plane: Any, label: str) -> None:
    informer = SharedInformer(api, PERSISTENT_VOLUMES)
    async with running(informer):
        for i in range(3):
            await api.create(PERSISTENT_VOLUMES, pv_body(f"gone-{label}-{i}", label))

        async def three() -> bool:
            return len(cached_names(informer, label)) == 3

        await eventually_async("the three PVs in the cache", three, 10)
    # The informer is stopped but keeps its cache and resourceVersion (started again, it resumes
    # its watch from there). Change things behind its back,
    # compact etcd past its resourceVersion and restart the apiserver so no watch cache can serve it.
    stale_rv = informer.reflector.last_resource_version
    await delete_now(api, PERSISTENT_VOLUMES, f"gone-{label}-0")
    one = await api.get(PERSISTENT_VOLUMES, f"gone-{label}-1")
    one["metadata"].setdefault("labels", {})["changed"] = "yes"
    await api.update(PERSISTENT_VOLUMES, one)
    await api.create(PERSISTENT_VOLUMES, pv_body(f"gone-{label}-3", label))
    head = (await api.list_page(PERSISTENT_VOLUMES, limit=1))["metadata"]["resourceVersion"]
    etcdctl = Toolchain.default().binary("etcdctl")
    compact = await asyncio.create_subprocess_exec(
        str(etcdctl),
        f"--endpoints={control_plane.etcd_endpoint}",
        "compact",
        head,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await compact.communicate()
    assert compact.returncode == 0, out.decode()
    await control_plane.restart_apiserver()
    lists_before = LISTS.labels("persistentvolumes").value
    with pytest.raises(WatchExpiredError):
        async for _ in api.watch(PERSISTENT_VOLUMES, resource_version=stale_rv, timeout_seconds=5):
            pass
    async with running(informer):

        async def relisted() -> bool:
            return cached_names(informer, label) == await fresh_names(api, label)

        await eventually_async("the cache relisted", relisted, 20)
        assert LISTS.labels("persistentvolumes").value > lists_before, "expected a re-list"
        assert informer.reflector.last_resource_version != stale_rv
        assert cached_names(informer, label) == await fresh_names(api, label)
        assert set(cached_names(informer, label)) == {f"gone-{label}-{i}" for i in (1, 2, 3)}
        changed = informer.store.get(f"gone-{label}-1")
        assert changed is not None and changed["metadata"]["labels"]["changed"] == "yes"
    await kcm_caught_up(api, label)


async def test_stale_resource_version_write_conflicts_and_retry_succeeds(api: ApiClient, label: str) -> None:
    name = f"conflict-{label}"
    first = await api.create(PERSISTENT_VOLUMES, pv_body(name, label))
    winner = dict(first, metadata={**first["metadata"], "annotations": {"writer": "a"}})
    await api.update(PERSISTENT_VOLUMES, winner)
    loser = dict(first, metadata={**first["metadata"], "annotations": {"writer": "b"}})
    with pytest.raises(ApiError) as caught:
        await api.update(PERSISTENT_VOLUMES, loser)
    assert caught.value.conflict and caught.value.status == 409
    fresh = await api.get(PERSISTENT_VOLUMES, name)
    fresh["metadata"]["annotations"]["writer"] = "b"
    saved = await api.update(PERSISTENT_VOLUMES, fresh)
    assert saved["metadata"]["annotations"]["writer"] == "b"


async def test_status_subresource_and_patch(api: ApiClient, label: str) -> None:
    name = f"status-{label}"
    created = await api.create(PERSISTENT_VOLUMES, pv_body(name, label))
    created["status"] = {"phase": "Available"}
    updated = await api.update_status(PERSISTENT_VOLUMES, created)
    assert updated["status"]["phase"] == "Available"
    patched = await api.patch(PERSISTENT_VOLUMES, name, {"metadata": {"labels": {"p": "1"}}})
    assert patched["metadata"]["labels"]["p"] == "1"
    with pytest.raises(ApiError) as caught:
        await api.get(PERSISTENT_VOLUMES, name + "-missing")
    assert caught.value.not_found
