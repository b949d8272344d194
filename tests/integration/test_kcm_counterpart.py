"""kubeloop's three controllers switched on by mistake beside a kube-controller-manager that runs
every controller (`--controllers=*`): each runs as its own process under its RBAC identity (as
`make up` starts it), sees its kcm counterpart within seconds of kcm's first write, then writes
nothing more to the objects kcm owns while kcm keeps working on new ones, and says why: one
Warning `KubeControllerManagerActive`, `kubeloop_kcm_counterpart_active` at 1, a log line naming
kcm's flag, /readyz not ready (/healthz still ok), and `kubectl kubeloop describe pvc`.

Every wait is for something the API or the component shows (a watch event, a metric); "writes
nothing" is every version of every PV, claim, VolumeAttachment, Node and Event the watches deliver
while kcm finishes a second round of the same work, none written by the kubeloop controller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient
from controller_runtime.counterpart import ATTACH_DETACH, BINDER, EXPANDER, REASON, Counterpart
from controller_runtime.resources import (
    EVENTS,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    Obj,
    Resource,
)
from controller_runtime.toolchain import REPO_ROOT
from localstack.components import Components
from localstack.controlplane import KCM_CONTROLLERS, ControlPlane
from localstack.storage_stack import storage_components
from localstack.testing import start_test_control_plane
from tests.support.namespaces import default_service_account

pytestmark = pytest.mark.integration

DRIVER = "kcm-side.example.com"  # no driver runs: kcm and the test play every part of it needed
NODE = "kcm-side-node"
WATCHED = (PERSISTENT_VOLUMES, PERSISTENT_VOLUME_CLAIMS, VOLUME_ATTACHMENTS, NODES, EVENTS)
DETECTED_WITHIN = 15.0  # seconds from kcm's first chance to act to the Warning


@dataclass(frozen=True)
class Side:
    component: str  # localstack's registry name
    manager: str  # its user agent: its field manager and its Warning's source
    counterpart: Counterpart


PV_CONTROLLER = Side("pv-controller", "kubeloop-pv-controller", BINDER)
ATTACH_DETACH_CONTROLLER = Side(
    "attach-detach-controller", "kubeloop-attach-detach-controller", ATTACH_DETACH
)
VOLUME_EXPAND_CONTROLLER = Side("volume-expand-controller", "kubeloop-volume-expand-controller", EXPANDER)
SIDES = (PV_CONTROLLER, ATTACH_DETACH_CONTROLLER, VOLUME_EXPAND_CONTROLLER)


@dataclass
class Seen:
    resource: Resource
    kind: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    at: float  # monotonic


@dataclass
class Stream:
    """Every version of the watched resources from the module's start, as the API serves them."""

    api: ApiClient
    seen: list[Seen] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        for res in WATCHED:
            _, rv = await self.api.list_all(res)
            self.tasks.append(asyncio.create_task(self._watch(res, rv)))

    async def _watch(self, res: Resource, rv: str) -> None:
        while True:
            async for kind, obj in self.api.watch(res, resource_version=rv, timeout_seconds=600):
                rv = obj.get("metadata", {}).get("resourceVersion", rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.seen.append(Seen(res, kind, obj, time.monotonic()))
                    async with self.changed:
                        self.changed.notify_all()

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def until(
        self, match: Callable[[Seen], bool], what: str, timeout: float = 60.0, since: int = 0
    ) -> Seen:
        """The first version seen (from index `since`) that `match`es, waiting for the watches."""

        async def found() -> Seen:
            start = since
            while True:
                for s in self.seen[start:]:
                    if match(s):
                        return s
                start = len(self.seen)
                async with self.changed:
                    await self.changed.wait()

        try:
            return await asyncio.wait_for(found(), timeout)
        except TimeoutError:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


@dataclass
class SideBySide:
    cp: ControlPlane
    api: ApiClient
    components: Components
    stream: Stream
    namespace: str

    def endpoint(self, side: Side) -> str:
        return str(self.components.status()[side.component]["http_endpoint"])


async def _http(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.text()


@contextlib.asynccontextmanager
async def cluster(home: Path, kcm_controllers: str) -> AsyncIterator[SideBySide]:
    """A control plane of its own whose kcm runs `kcm_controllers`, kubeloop's three beside it as
    processes, a namespace, a Node whose attachments a controller manages, two classes."""
    cp = await start_test_control_plane(home, with_kcm=True, kcm_controllers=kcm_controllers)
    api = await ApiClient.from_kubeconfig(
        str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="kubeloop-tests"
    )
    stream = Stream(api)
    components = Components(cp, storage_components(tuple(s.component for s in SIDES)), nodes=())
    try:
        await stream.start()
        await components.start()
        namespace = f"kcm-side-{uuid.uuid4().hex[:6]}"
        await api.create(NAMESPACES, {"metadata": {"name": namespace}})
        await default_service_account(api, namespace)
        await api.create(
            NODES,
            {
                "metadata": {
                    "name": NODE,
                    "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
                }
            },
        )
        for name, expand in (("kcm-side", False), ("kcm-side-expand", True)):
            await api.create(
                STORAGE_CLASSES,
                {"metadata": {"name": name}, "provisioner": DRIVER, "allowVolumeExpansion": expand},
            )
        yield SideBySide(cp, api, components, stream, namespace)
    finally:
        await stream.stop()
        await components.stop()
        await api.close()
        await cp.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SideBySide]:
    """kcm with every controller: its three storage controllers on."""
    async with cluster(Path(tmp_path_factory.mktemp("kcm-side")), "*") as env:
        yield env


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def kubeloops_own(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SideBySide]:
    """kcm as the local stack runs it: its three storage controllers off, every other on."""
    async with cluster(Path(tmp_path_factory.mktemp("kubeloop-own")), KCM_CONTROLLERS) as env:
        yield env


# -- objects ---------------------------------------------------------------------------------------


def claim(namespace: str, name: str, class_name: str = "", size: str = "1Gi") -> Obj:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": class_name,
            "resources": {"requests": {"storage": size}},
        },
    }


def volume(name: str, for_claim: tuple[str, str], class_name: str = "") -> Obj:
    """A static CSI volume reserved for one claim (namespace, name), so no two claims swap them."""
    return {
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "capacity": {"storage": "1Gi"},
            "storageClassName": class_name,
            "persistentVolumeReclaimPolicy": "Retain",
            "claimRef": {"namespace": for_claim[0], "name": for_claim[1]},
            "csi": {"driver": DRIVER, "volumeHandle": f"handle-{name}"},
        },
    }


def pod(namespace: str, name: str, claim_name: str) -> Obj:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "c", "image": "busybox"}],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim_name}}],
        },
    }


def named(s: Seen, res: Resource, name: str) -> bool:
    return s.resource == res and s.obj["metadata"]["name"] == name


def bound(name: str) -> Callable[[Seen], bool]:
    return lambda s: (
        named(s, PERSISTENT_VOLUME_CLAIMS, name) and s.obj.get("status", {}).get("phase") == "Bound"
    )


def event_about(reason: str, name: str, manager: str = "kube-controller-manager") -> Callable[[Seen], bool]:
    return lambda s: (
        s.resource == EVENTS
        and s.obj.get("reason") == reason
        and s.obj["involvedObject"].get("name") == name
        and managers(s.obj) == {manager}
    )


def managers(obj: Obj) -> set[str]:
    return {str(e.get("manager")) for e in obj["metadata"].get("managedFields") or ()}


def warning_of(side: Side) -> Callable[[Seen], bool]:
    return lambda s: (
        s.resource == EVENTS
        and s.obj.get("reason") == REASON
        and (s.obj.get("source") or {}).get("component") == side.manager
    )


async def va_of(env: SideBySide, pv_name: str, since: int) -> Obj:
    seen = await env.stream.until(
        lambda s: (
            s.resource == VOLUME_ATTACHMENTS
            and s.kind == "ADDED"
            and s.obj["spec"]["source"].get("persistentVolumeName") == pv_name
        ),
        f"a VolumeAttachment of {pv_name}",
        since=since,
    )
    return seen.obj


async def attach(env: SideBySide, va: Obj) -> None:
    """What the external-attacher would write once ControllerPublishVolume succeeded."""
    await env.api.patch(
        VOLUME_ATTACHMENTS, va["metadata"]["name"], {"status": {"attached": True}}, subresource="status"
    )


# -- what each side says, and what it must not do -----------------------------------------------------


async def stood_down(env: SideBySide, side: Side, started: float, since: int) -> Obj:
    """Waits for the side's Warning; checks it came within seconds and that the metric, /readyz,
    /healthz and the log say the same. Returns the Warning."""
    seen = await env.stream.until(warning_of(side), f"{side.manager}'s {REASON} Warning", since=since)
    took = seen.at - started
    assert took < DETECTED_WITHIN, f"{side.manager} saw kcm's {side.counterpart.controller} after {took:.1f}s"
    warning = seen.obj
    assert warning["type"] == "Warning"
    assert f"kube-controller-manager's {side.counterpart.controller} is active" in warning["message"]
    assert side.counterpart.flag in warning["message"]
    assert managers(warning) == {side.manager}
    endpoint = env.endpoint(side)
    status, metrics = await _http(f"http://{endpoint}/metrics")
    line = f'kubeloop_kcm_counterpart_active{{controller="{side.counterpart.controller}"}} 1.0'
    assert status == 200 and line in metrics.splitlines()
    status, ready = await _http(f"http://{endpoint}/readyz")
    assert status == 503 and "standing down" in ready and side.counterpart.flag in ready
    status, _ = await _http(f"http://{endpoint}/healthz")
    assert status == 200, "standing down must not get the process restarted (it would write again)"
    logged = env.cp.log_path(side.component).read_text().splitlines()
    (line,) = [ln for ln in logged if "kube-controller-manager's counterpart is active, standing down" in ln]
    assert "level=error" in line and f'turn_off="{side.counterpart.flag}"' in line
    return warning


def written_by(env: SideBySide, side: Side, since: int, after: str = "") -> list[str]:
    """Every write of `side` in the versions the watches delivered from index `since` on: its
    managedFields entry stamped later than `after` (the API's seconds; "": any), on an object or
    an Event."""
    out = []
    for s in env.stream.seen[since:]:
        md = s.obj["metadata"]
        for e in md.get("managedFields") or ():
            if e.get("manager") == side.manager and str(e.get("time", "")) > after:
                where = f"{s.resource.kind} {md.get('name')}"
                out.append(f"{s.kind} {where} ({e.get('time')}, {e.get('subresource') or 'main'})")
    return out


def created_in(env: SideBySide, since: int, res: Resource) -> set[str]:
    return {
        s.obj["metadata"]["name"] for s in env.stream.seen[since:] if s.resource == res and s.kind == "ADDED"
    }


# -- the three -----------------------------------------------------------------------------------------


async def test_the_pv_controller_stands_down_for_kcms_binder(side_by_side: SideBySide) -> None:
    env, ns = side_by_side, side_by_side.namespace
    mark = len(env.stream.seen)
    started = time.monotonic()
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "dyn-1", "kcm-side"))
    await env.api.create(PERSISTENT_VOLUMES, volume("kcm-side-pv-1", (ns, "st-1")))
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "st-1"))
    warning = await stood_down(env, PV_CONTROLLER, started, mark)
    detected = warning["metadata"]["creationTimestamp"]

    # A second round: kcm binds a new static pair and hands a new claim to its provisioner; the
    # pv-controller, had it not stood down, would have raced it for every one of these writes.
    after = len(env.stream.seen)
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "dyn-2", "kcm-side"))
    await env.api.create(PERSISTENT_VOLUMES, volume("kcm-side-pv-2", (ns, "st-2")))
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "st-2"))
    await env.stream.until(bound("st-2"), "kcm binding st-2", since=after)
    await env.stream.until(bound("st-1"), "kcm binding st-1")
    await env.stream.until(
        event_about("ExternalProvisioning", "dyn-2"), "kcm's ExternalProvisioning on dyn-2", since=after
    )
    assert written_by(env, PV_CONTROLLER, mark, detected) == []
    assert written_by(env, PV_CONTROLLER, after) == []
    for name in ("dyn-2", "st-2"):
        final = await env.api.get(PERSISTENT_VOLUME_CLAIMS, name, ns)
        assert PV_CONTROLLER.manager not in managers(final)
    assert not [w for w in env.stream.seen[mark:] if warning_of(PV_CONTROLLER)(w) and w.obj is not warning]

    # kubectl kubeloop says it.
    report = await describe(env, ns, "st-1")
    (said,) = [c for c in report["control_plane"] if c["component"] == PV_CONTROLLER.manager]
    assert said["reason"].startswith("stands down since ")
    assert BINDER.flag in said["reason"]


async def test_the_attach_detach_controller_stands_down_for_kcms(side_by_side: SideBySide) -> None:
    env, ns = side_by_side, side_by_side.namespace
    for n in (1, 2):
        await env.api.create(PERSISTENT_VOLUMES, volume(f"kcm-side-att-{n}", (ns, f"att-{n}")))
        await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, f"att-{n}"))
    for n in (1, 2):
        await env.stream.until(bound(f"att-{n}"), f"att-{n} bound")
    mark = len(env.stream.seen)
    started = time.monotonic()
    await env.api.create(PODS, pod(ns, "app-1", "att-1"))
    # Whoever created the VolumeAttachment: once attached kcm says SuccessfulAttachVolume.
    await attach(env, await va_of(env, "kcm-side-att-1", mark))
    warning = await stood_down(env, ATTACH_DETACH_CONTROLLER, started, mark)
    detected = warning["metadata"]["creationTimestamp"]

    after = len(env.stream.seen)
    await env.api.create(PODS, pod(ns, "app-2", "att-2"))
    second = await va_of(env, "kcm-side-att-2", after)
    assert managers(second) == {"kube-controller-manager"}
    await attach(env, second)
    await env.stream.until(
        event_about("SuccessfulAttachVolume", "app-2"), "kcm's SuccessfulAttachVolume for app-2", since=after
    )
    await env.stream.until(
        lambda s: named(s, NODES, NODE) and len(s.obj.get("status", {}).get("volumesAttached") or ()) == 2,
        "kcm listing both volumes in the node's volumesAttached",
        since=after,
    )
    assert written_by(env, ATTACH_DETACH_CONTROLLER, mark, detected) == []
    assert written_by(env, ATTACH_DETACH_CONTROLLER, after) == []
    for name in created_in(env, after, VOLUME_ATTACHMENTS):
        assert ATTACH_DETACH_CONTROLLER.manager not in managers(await env.api.get(VOLUME_ATTACHMENTS, name))


async def test_the_volume_expand_controller_stands_down_for_kcms_expander(side_by_side: SideBySide) -> None:
    env, ns = side_by_side, side_by_side.namespace
    for n in (1, 2):
        await env.api.create(
            PERSISTENT_VOLUMES, volume(f"kcm-side-exp-{n}", (ns, f"exp-{n}"), "kcm-side-expand")
        )
        await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, f"exp-{n}", "kcm-side-expand"))
    for n in (1, 2):
        await env.stream.until(bound(f"exp-{n}"), f"exp-{n} bound")
    mark = len(env.stream.seen)
    started = time.monotonic()
    grow = {"spec": {"resources": {"requests": {"storage": "2Gi"}}}}
    await env.api.patch(PERSISTENT_VOLUME_CLAIMS, "exp-1", grow, ns)
    await stood_down(env, VOLUME_EXPAND_CONTROLLER, started, mark)

    after = len(env.stream.seen)
    await env.api.patch(PERSISTENT_VOLUME_CLAIMS, "exp-2", grow, ns)
    await env.stream.until(
        event_about("ExternalExpanding", "exp-2"), "kcm's ExternalExpanding on exp-2", since=after
    )
    # The expander writes nothing but Events: none of its own about exp-2, nor any other.
    assert written_by(env, VOLUME_EXPAND_CONTROLLER, after) == []


async def describe(env: SideBySide, namespace: str, name: str) -> dict[str, Any]:
    """`kubectl kubeloop describe pvc -o json`, the plugin as its console script runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kubectl_kubeloop.main", "describe", "pvc", name, "-n", namespace, "-o", "json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
        env={**os.environ, "KUBECONFIG": str(env.cp.admin_kubeconfig)},
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return dict(json.loads(out))


async def test_kubeloops_own_mode_never_stands_down(kubeloops_own: SideBySide) -> None:
    """kcm with its three storage controllers off: kubeloop's three bind, attach, say
    ExternalExpanding and see a claim deleted, while kcm's other controllers write the same
    objects (the ttl controller the Node, pvc-protection the deleted claim's finalizer), with
    kube-controller-manager's field manager; none of it is kcm's counterpart."""
    env, ns = kubeloops_own, kubeloops_own.namespace
    mark = len(env.stream.seen)
    await env.api.create(PERSISTENT_VOLUMES, volume("own-att", (ns, "own-att")))
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "own-att"))
    await env.api.create(PERSISTENT_VOLUMES, volume("own-exp", (ns, "own-exp"), "kcm-side-expand"))
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "own-exp", "kcm-side-expand"))
    await env.api.create(PERSISTENT_VOLUME_CLAIMS, claim(ns, "own-dyn", "kcm-side"))
    for name in ("own-att", "own-exp"):
        await env.stream.until(bound(name), f"{name} bound")
    await env.stream.until(
        event_about("ExternalProvisioning", "own-dyn", PV_CONTROLLER.manager),
        "kubeloop's ExternalProvisioning",
    )
    await env.api.create(PODS, pod(ns, "own-app", "own-att"))
    va = await va_of(env, "own-att", mark)
    assert managers(va) == {ATTACH_DETACH_CONTROLLER.manager}
    await attach(env, va)
    await env.stream.until(
        event_about("SuccessfulAttachVolume", "own-app", ATTACH_DETACH_CONTROLLER.manager),
        "kubeloop's SuccessfulAttachVolume",
    )
    grow = {"spec": {"resources": {"requests": {"storage": "2Gi"}}}}
    await env.api.patch(PERSISTENT_VOLUME_CLAIMS, "own-exp", grow, ns)
    await env.stream.until(
        event_about("ExternalExpanding", "own-exp", VOLUME_EXPAND_CONTROLLER.manager),
        "kubeloop's ExternalExpanding",
    )
    # kcm's pvc-protection lifts its finalizer from a claim kubeloop bound; kubeloop releases its volume.
    await env.api.delete(PERSISTENT_VOLUME_CLAIMS, "own-exp", ns)
    await env.stream.until(
        lambda s: named(s, PERSISTENT_VOLUME_CLAIMS, "own-exp") and s.kind == "DELETED", "own-exp deleted"
    )
    await env.stream.until(
        lambda s: named(s, PERSISTENT_VOLUMES, "own-exp") and s.obj["status"].get("phase") == "Released",
        "own-exp's volume released",
    )
    kcm_wrote = {
        f"{s.resource.kind} {s.obj['metadata']['name']}"
        for s in env.stream.seen
        if s.resource != EVENTS and "kube-controller-manager" in managers(s.obj)
    }
    assert f"Node {NODE}" in kcm_wrote  # its ttl controller's annotation
    assert not [s for s in env.stream.seen if s.resource == EVENTS and s.obj.get("reason") == REASON]
    for side in SIDES:
        status, metrics = await _http(f"http://{env.endpoint(side)}/metrics")
        line = f'kubeloop_kcm_counterpart_active{{controller="{side.counterpart.controller}"}} 0.0'
        assert status == 200 and line in metrics.splitlines()
        status, ready = await _http(f"http://{env.endpoint(side)}/readyz")
        assert status == 200, ready
