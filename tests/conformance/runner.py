"""Runs conformance scenarios against a real control plane in one mode, recording what they leave.

A mode is a fresh control plane (etcd, kube-apiserver with RBAC, kube-scheduler,
kube-controller-manager) plus the storage side:

- `go`: kube-controller-manager with every controller on (its persistentvolume-binder,
  attach-detach and expander included) and the Go external-provisioner, -attacher and -resizer;
- `kubeloop`: kcm without those three and every kubeloop component `make up` starts.

Both share the node side (kubeloop's CSI driver, one node plugin and one node agent per node),
external-snapshotter's snapshot-controller and csi-snapshotter (upstream's Go binaries in both, with
the snapshot CRDs, as every run mode of kubeloop has them) and the objects of deploy/ (the CSIDriver
and StorageClasses). The suite compares two modes only when their apiservers served the same API
surface (surface.py). Scenarios of one mode share its stack,
each in its own namespace with its cluster-scoped names prefixed (model.py); those that kill
components or touch nodes run alone, after the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.resources import (
    CSI_NODES,
    CSI_STORAGE_CAPACITIES,
    EVENTS,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    SECRETS,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    Resource,
)
from controller_runtime.toolchain import REPO_ROOT
from controller_runtime.volumes import va_name
from csi_driver import DRIVER_NAME
from kubeloop_grpc.csi import csi_pb2
from localstack.components import REGISTRY, Component
from localstack.controlplane import KCM_CONTROLLERS, ControlPlane
from localstack.go_sidecars import go_sidecar_components
from localstack.proc import ManagedProcess
from localstack.storage_stack import ShortHomeComponents, StorageStack, storage_components
from localstack.testing import start_test_control_plane
from tests.support.namespaces import default_service_account
from tests.support.waits import WaitFailed, eventually_async, no_problems

from .compare import RawOutcome
from .model import (
    KINDS,
    Condition,
    Create,
    Delete,
    DriverVolume,
    Kill,
    Obj,
    Observe,
    Patch,
    Restart,
    Scenario,
    Sleep,
    Step,
    Wait,
)
from .surface import api_surface

MODES = ("go", "kubeloop")
WORK_DIR = REPO_ROOT / ".kubeloop" / "conformance"
# What the go mode runs of kubeloop's registry: the node side and external-snapshotter's two, so
# both modes' clusters serve the snapshot API (the kubeloop mode runs the whole registry).
NODE_SIDE = (
    "csi-driver-controller",
    "csi-driver-node",
    "node-agent",
    "snapshot-controller",
    "csi-snapshotter",
)
DEPLOY_MANIFESTS = ("deploy/csidriver.yaml", "deploy/storageclasses.yaml")
SHARED_CLASSES = ("", "kubeloop", "kubeloop-wffc")  # deploy/'s classes: never prefixed
# After the settle time: how long a scenario must be still before its final snapshot, and the most
# the runner waits for that.
QUIET_S = 3.0
QUIET_LIMIT_S = 20.0
RESOURCES: dict[str, Resource] = {
    "PersistentVolume": PERSISTENT_VOLUMES,
    "PersistentVolumeClaim": PERSISTENT_VOLUME_CLAIMS,
    "Pod": PODS,
    "StorageClass": STORAGE_CLASSES,
    "VolumeAttachment": VOLUME_ATTACHMENTS,
    "Node": NODES,
    "Event": EVENTS,
    "VolumeSnapshot": VOLUME_SNAPSHOTS,
    "VolumeSnapshotContent": VOLUME_SNAPSHOT_CONTENTS,
}
# Created by steps but never watched.
CREATE_ONLY: dict[str, Resource] = {"Secret": SECRETS}
NAMESPACED = {"PersistentVolumeClaim", "Pod", "Event", "Secret", "VolumeSnapshot"}
KCM = "kube-controller-manager"
ROLE_PROCESSES: dict[str, dict[str, str]] = {
    "kubeloop": {
        "binder": "pv-controller",
        "attach-detach": "attach-detach-controller",
        "expander": "volume-expand-controller",
        "provisioner": "external-provisioner",
        "attacher": "external-attacher",
        "resizer": "external-resizer",
        "node-agent-node-a": "node-agent-node-a",
        "node-agent-node-b": "node-agent-node-b",
    },
    "go": {
        "binder": KCM,
        "attach-detach": KCM,
        "expander": KCM,
        "provisioner": "go-external-provisioner",
        "attacher": "go-external-attacher",
        "resizer": "go-external-resizer",
        "node-agent-node-a": "node-agent-node-a",
        "node-agent-node-b": "node-agent-node-b",
    },
}


# The three sidecars default to 5 QPS on both sides. With 8 scenarios at once their requests queue
# for seconds, and an event could land after a scenario's final snapshot, in either mode (the first
# full run with the quiet wait had 5 of those, 3 on the Go side). Both modes' sidecars get the same
# higher limit: what is compared is what they do, not how long their queue is.
SIDECARS = {
    "external-provisioner", "external-attacher", "external-resizer",
    "go-external-provisioner", "go-external-attacher", "go-external-resizer",
}  # fmt: skip
SIDECAR_API_LIMITS = ("--kube-api-qps=50", "--kube-api-burst=100")


def unthrottled(components: list[Component]) -> list[Component]:
    def with_limits(c: Component) -> Component:
        argv = c.argv
        return dataclasses.replace(c, argv=lambda ctx: [*argv(ctx), *SIDECAR_API_LIMITS])

    return [with_limits(c) if c.name in SIDECARS else c for c in components]


class Recorder:
    """Informers on everything a scenario may touch, plus a log of every version of every Event in
    the order the watch delivered them, and the last version of every object ever seen (deleted
    ones too: their UIDs and handles are still needed to normalise events)."""

    def __init__(self, api: ApiClient) -> None:
        self.informers = {kind: SharedInformer(api, res) for kind, res in RESOURCES.items()}
        self.seen: dict[str, Obj] = {}
        self.events: list[Obj] = []
        self.changed = asyncio.Event()
        for kind, inf in self.informers.items():
            inf.add_handler(
                EventHandler(
                    on_add=self._on(kind),
                    on_update=lambda _old, new, k=kind: self._on(k)(new),  # type: ignore[misc]
                    on_delete=self._on(kind, deleted=True),
                )
            )

    def _on(self, kind: str, deleted: bool = False) -> Callable[[Obj], None]:
        def handle(obj: Obj) -> None:
            obj["kind"] = kind
            uid = obj.get("metadata", {}).get("uid")
            if kind == "Event":
                if not deleted:
                    self.events.append(obj)
            elif uid:
                self.seen[uid] = obj
            self.changed.set()

        return handle

    async def start(self) -> None:
        for inf in self.informers.values():
            inf.start()
        await asyncio.gather(*(inf.wait_for_sync() for inf in self.informers.values()))

    async def stop(self) -> None:
        for inf in self.informers.values():
            await inf.stop()

    def get(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        key = f"{namespace}/{name}" if namespace else name
        return self.informers[kind].store.get(key)

    def all(self, kind: str) -> list[Obj]:
        return self.informers[kind].store.values()


@dataclass
class ModeStack:
    """One mode's control plane and storage components."""

    mode: str
    cp: ControlPlane
    api: ApiClient
    storage: StorageStack
    extra: ShortHomeComponents | None
    recorder: Recorder
    surface: list[str]  # what the apiserver served once every component had started (surface.py)

    def process(self, role: str) -> ManagedProcess:
        name = ROLE_PROCESSES[self.mode][role]
        for group in (self.storage.components.processes, self.extra.processes if self.extra else {}):
            if name in group:
                return group[name]
        return self.cp.processes[name]


async def start_mode(mode: str, home: Path) -> ModeStack:
    await asyncio.to_thread(shutil.rmtree, home, True)
    await asyncio.to_thread(home.mkdir, parents=True)
    cp = await start_test_control_plane(
        home,
        with_kcm=True,
        with_scheduler=True,
        kcm_controllers="*" if mode == "go" else KCM_CONTROLLERS,
        startup_timeout=180.0,
    )
    api = await ApiClient.from_kubeconfig(str(cp.admin_kubeconfig), qps=0, burst=1, user_agent="conformance")
    storage: StorageStack | None = None
    extra: ShortHomeComponents | None = None
    try:
        await _kubectl_apply(cp, DEPLOY_MANIFESTS)
        names = NODE_SIDE if mode == "go" else tuple(c.name for c in REGISTRY)
        storage = StorageStack(cp, api, components=unthrottled(storage_components(names)))
        await storage.start()
        if mode == "go":
            go = unthrottled(go_sidecar_components(cp.admin_kubeconfig))
            extra = ShortHomeComponents(cp, go, storage.home)
            await extra.start()
        recorder = Recorder(api)
        await recorder.start()
        await _wait_nodes_ready(recorder, api)
        return ModeStack(mode, cp, api, storage, extra, recorder, await api_surface(api))
    except BaseException:
        if extra is not None:
            await extra.stop()
        if storage is not None:
            await storage.stop()
        await api.close()
        await cp.stop()
        raise


async def stop_mode(ms: ModeStack) -> None:
    await ms.recorder.stop()
    if ms.extra is not None:
        await ms.extra.stop()
    await ms.storage.stop()
    await ms.api.close()
    await ms.cp.stop()


async def _kubectl_apply(cp: ControlPlane, manifests: tuple[str, ...]) -> None:
    argv = [str(cp.toolchain.binary("kubectl")), f"--kubeconfig={cp.admin_kubeconfig}", "apply"]
    for m in manifests:
        argv += ["-f", str(REPO_ROOT / m)]
    out = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl apply failed: {out.stderr}")


async def _wait_nodes_ready(rec: Recorder, api: ApiClient, timeout: float = 120.0) -> None:
    """Both nodes Ready and untainted with the driver in their CSINode, and capacity published for
    each (the scheduler needs it for WaitForFirstConsumer claims: storageCapacity is on in
    deploy/). Ready is not enough: kcm's node lifecycle controller takes the not-ready taint the
    apiserver put on a new Node off a moment later, and a pod created in between gets a
    FailedScheduling event in one mode and not in the other (a fresh-clone run differed so)."""

    async def ready_nodes() -> list[str]:
        ready = [
            n
            for n in rec.all("Node")
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in n.get("status", {}).get("conditions") or ()
            )
            and not n.get("spec", {}).get("taints")
        ]
        csinodes, _ = await api.list_all(CSI_NODES)
        with_driver = [
            c for c in csinodes if any(d["name"] == DRIVER_NAME for d in c["spec"].get("drivers") or ())
        ]
        capacities, _ = await api.list_all(CSI_STORAGE_CAPACITIES)
        counts = {
            "Ready untainted nodes": len(ready),
            "CSINodes": len(with_driver),
            "capacities": len(capacities),
        }
        return [f"{n} {what}" for what, n in counts.items() if n < 2]

    await eventually_async(
        "two nodes, CSINodes and CSIStorageCapacities", ready_nodes, timeout, 0.5, satisfied=no_problems
    )


@dataclass
class ScenarioRun:
    ms: ModeStack
    scenario: Scenario
    namespace: str
    prefix: str
    handles: dict[str, str] = field(default_factory=dict)
    raw: RawOutcome = field(init=False)

    def __post_init__(self) -> None:
        self.raw = RawOutcome(self.scenario.name, self.namespace, self.prefix)

    @property
    def rec(self) -> Recorder:
        return self.ms.recorder

    # -- names ------------------------------------------------------------------------------------

    def cluster_name(self, name: str) -> str:
        return self.prefix + name

    def resolve(self, short: str, name: str) -> tuple[str, str | None, str] | None:
        """(kind, namespace, real name) of a step's reference; None while it cannot be resolved (a
        claim not yet bound, a PV without a handle yet)."""
        kind = KINDS[short]
        if kind == "PersistentVolume":
            pv = self._pv_name(name)
            return (kind, None, pv) if pv else None
        if kind == "VolumeAttachment":
            pv_ref, node = name.rsplit("@", 1)
            pv_name = self._pv_name(pv_ref)
            pv_obj = self.rec.get("PersistentVolume", pv_name) if pv_name else None
            handle = ((pv_obj or {}).get("spec", {}).get("csi") or {}).get("volumeHandle")
            return (kind, None, va_name(handle, DRIVER_NAME, node)) if handle else None
        if kind == "StorageClass":
            return kind, None, self.cluster_name(name)
        if kind == "VolumeSnapshotContent":
            # Only dynamic contents: named after their VolumeSnapshot's UID by the snapshot-controller.
            snap = self.rec.get("VolumeSnapshot", name.removeprefix("snapshot:"), self.namespace)
            content = ((snap or {}).get("status") or {}).get("boundVolumeSnapshotContentName")
            return (kind, None, content) if content else None
        if kind == "Node":
            return kind, None, name
        return kind, self.namespace, name

    def _pv_name(self, ref: str) -> str | None:
        if ref.startswith("claim:"):
            # A deleted claim still names its volume: the recorder keeps its last version.
            claims = [self.rec.get("PersistentVolumeClaim", ref[6:], self.namespace)] + [
                o
                for o in self.rec.seen.values()
                if o["kind"] == "PersistentVolumeClaim"
                and o["metadata"].get("namespace") == self.namespace
                and o["metadata"]["name"] == ref[6:]
            ]
            names = [c["spec"]["volumeName"] for c in claims if c and c.get("spec", {}).get("volumeName")]
            return str(names[0]) if names else None
        return self.cluster_name(ref)

    def localise(self, kind: str, body: Obj, whole: bool) -> Obj:
        obj = copy.deepcopy(body)
        md = obj.setdefault("metadata", {}) if whole else obj.get("metadata", {})
        if whole:
            if kind in NAMESPACED:
                md["namespace"] = self.namespace
            else:
                md["name"] = self.cluster_name(md["name"])
        spec = obj.get("spec") or {}
        sc = spec.get("storageClassName")
        if isinstance(sc, str) and sc not in SHARED_CLASSES:
            spec["storageClassName"] = self.cluster_name(sc)
        if kind == "PersistentVolumeClaim" and spec.get("volumeName"):
            spec["volumeName"] = self.cluster_name(spec["volumeName"])
        if kind == "PersistentVolume":
            ref = spec.get("claimRef")
            if ref:
                ref["namespace"] = ref.get("namespace") or self.namespace
            csi = spec.get("csi") or {}
            handle = csi.get("volumeHandle", "")
            if handle.startswith("{vol:"):
                csi["volumeHandle"] = self.handles[handle[5:-1]]
            elif handle.startswith("fake-"):
                csi["volumeHandle"] = "fake-" + self.prefix + handle[5:]
        return obj

    # -- steps ------------------------------------------------------------------------------------

    async def run(self) -> RawOutcome:
        api = self.ms.api
        await api.create(NAMESPACES, {"metadata": {"name": self.namespace}})
        await default_service_account(self.ms.api, self.namespace)
        for step in self.scenario.steps:
            try:
                await self.step(step)
            except ApiError as exc:
                self.raw.timeline.append(f"{_describe(step)}: error {exc.status}: {_api_message(exc)}")
        await asyncio.sleep(self.scenario.settle)
        await self._quiet()
        self.snapshot("final")
        self.collect()
        await self.clean_up()
        return self.raw

    async def clean_up(self) -> None:
        """Deletes the namespace and the scenario's own volumes, and waits until none of those is left
        unbound: a later scenario's claim must not find them."""
        api = self.ms.api
        # The namespace goes asynchronously; its claims are deleted here at once so a pending one
        # cannot bind the next scenario's volume meanwhile.
        claims = [
            c["metadata"]["name"]
            for c in self.rec.all("PersistentVolumeClaim")
            if c["metadata"]["namespace"] == self.namespace
        ]
        for claim in claims:
            with contextlib.suppress(ApiError):
                await api.delete(PERSISTENT_VOLUME_CLAIMS, claim, self.namespace)
        with contextlib.suppress(ApiError):
            await api.delete(NAMESPACES, self.namespace)
        mine = [pv["metadata"]["name"] for pv in self.rec.all("PersistentVolume")]
        mine = [name for name in mine if name.startswith(self.prefix)]
        for name in mine:
            with contextlib.suppress(ApiError):
                await api.delete(PERSISTENT_VOLUMES, name)
        if lane(self.scenario) != "pool":
            return
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            left = [self.rec.get("PersistentVolume", name) for name in mine]
            unbound = any(pv and not (pv["spec"].get("claimRef") or {}).get("uid") for pv in left)
            pending = any(self.rec.get("PersistentVolumeClaim", c, self.namespace) for c in claims)
            if not unbound and not pending:
                return
            self.rec.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rec.changed.wait(), 0.5)

    async def step(self, step: Step) -> None:
        api = self.ms.api
        if isinstance(step, DriverVolume):
            await self._driver_volume(step)
        elif isinstance(step, Create):
            kind = step.obj["kind"]
            obj = self.localise(kind, step.obj, whole=True)
            obj.pop("kind")
            await api.create({**RESOURCES, **CREATE_ONLY}[kind], obj)
            if kind in RESOURCES:
                # kubectl-paced: the next step comes once the object is in the caches, as it would
                # be in the controllers' (a claim created in the same millisecond as its volume
                # races the binder's informer in both modes, differently each time).
                md = obj["metadata"]
                await self._wait(Wait((Condition(_SHORT[kind], _local(md["name"], self.prefix)),), 10))
                await asyncio.sleep(0.3)
        elif isinstance(step, Patch):
            kind, ns, name = self._must_resolve(step.kind, step.name)
            body = self.localise(kind, step.patch, whole=False)
            await api.patch(RESOURCES[kind], name, body, ns, subresource=step.subresource)
        elif isinstance(step, Delete):
            kind, ns, name = self._must_resolve(step.kind, step.name)
            options: Obj = {"kind": "DeleteOptions", "apiVersion": "v1"}
            if step.grace_seconds is not None:
                options["gracePeriodSeconds"] = step.grace_seconds
            await api.request("DELETE", RESOURCES[kind].path(ns, name), body=options)
        elif isinstance(step, Wait):
            await self._wait(step)
        elif isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, Kill):
            proc = self.ms.process(step.role)
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await _exited(proc)
        elif isinstance(step, Restart):
            proc = self.ms.process(step.role)
            if not proc.running:
                await proc.start()
        elif isinstance(step, Observe):
            self.snapshot(step.label)

    def _must_resolve(self, short: str, name: str) -> tuple[str, str | None, str]:
        ref = self.resolve(short, name)
        if ref is None:
            raise ApiError(404, {"message": f"{short}/{name} cannot be resolved"})
        return ref

    async def _driver_volume(self, step: DriverVolume) -> None:
        csi = self.ms.storage.csi
        assert csi is not None
        mode = csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
        cap = csi_pb2.VolumeCapability(access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode))
        if step.block:
            cap.block.SetInParent()
        else:
            cap.mount.fs_type = "ext4"
        resp = await csi.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=self.cluster_name(step.name),
                capacity_range=csi_pb2.CapacityRange(required_bytes=step.size_mi << 20),
                volume_capabilities=[cap],
            ),
            timeout=30,
        )
        self.handles[step.name] = resp.volume.volume_id

    def holds(self, cond: Condition) -> bool:
        ref = self.resolve(cond.kind, cond.name)
        if ref is None:
            return False
        kind, ns, name = ref
        if cond.event_reason:
            return any(
                e.get("reason") == cond.event_reason
                and e.get("involvedObject", {}).get("kind") == kind
                and e.get("involvedObject", {}).get("name") == name
                and (ns is None or e.get("involvedObject", {}).get("namespace") == ns)
                for e in self.rec.events
            )
        obj = self.rec.get(kind, name, ns)
        if not cond.exists:
            return obj is None
        if obj is None:
            return False
        if not cond.path:
            return True
        return bool(_at(obj, cond.path) == cond.equals)

    async def _wait(self, step: Wait) -> None:
        deadline = time.monotonic() + step.timeout
        pending = list(step.conditions)
        while True:
            pending = [c for c in pending if not self.holds(c)]
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                for c in pending:
                    self.raw.timeline.append(f"wait timed out: {c.describe()}")
                return
            self.rec.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rec.changed.wait(), min(left, 0.5))

    # -- what is observed ---------------------------------------------------------------------------

    def _claim_uids(self) -> set[str]:
        return {
            o["metadata"]["uid"]
            for o in self.rec.seen.values()
            if o["kind"] == "PersistentVolumeClaim" and o["metadata"].get("namespace") == self.namespace
        }

    def _mine_pv(self, pv: Obj, claim_uids: set[str]) -> bool:
        name = pv["metadata"]["name"]
        ref = pv.get("spec", {}).get("claimRef") or {}
        return bool(
            name.startswith(self.prefix)
            or (name.startswith("pvc-") and name[4:] in claim_uids)
            or ref.get("namespace") == self.namespace
        )

    def snapshot(self, label: str) -> None:
        uids = self._claim_uids()
        objs = [o for k in ("PersistentVolumeClaim", "Pod", "VolumeSnapshot") for o in self.rec.all(k)]
        objs = [o for o in objs if o["metadata"].get("namespace") == self.namespace]
        pvs = [pv for pv in self.rec.all("PersistentVolume") if self._mine_pv(pv, uids)]
        pv_names = {pv["metadata"]["name"] for pv in pvs}
        vas = [
            va
            for va in self.rec.all("VolumeAttachment")
            if va.get("spec", {}).get("source", {}).get("persistentVolumeName") in pv_names
        ]
        handles = {(pv["spec"].get("csi") or {}).get("volumeHandle") for pv in pvs} - {None}
        nodes = []
        for node in self.rec.all("Node"):
            mine = [
                v
                for v in node.get("status", {}).get("volumesAttached") or ()
                if str(v.get("name", "")).rsplit("^", 1)[-1] in handles
            ]
            nodes.append({**node, "status": {"volumesAttached": mine}})
        self.raw.snapshots[label] = copy.deepcopy([*pvs, *objs, *vas, *nodes])

    async def _quiet(self) -> None:
        """Waits, after the settle time, until nothing of this scenario (its objects, their events)
        has changed for QUIET_S seconds, at most QUIET_LIMIT_S. Events are posted asynchronously
        and through rate-limited clients in both modes; a snapshot taken while the last of them
        is still on its way compares timing, not behaviour."""
        last, since = self._fingerprint(), time.monotonic()

        async def quiet() -> bool:
            nonlocal last, since
            now = self._fingerprint()
            if now != last:
                last, since = now, time.monotonic()
            return time.monotonic() - since >= QUIET_S

        with contextlib.suppress(WaitFailed):  # never quiet: the snapshot is taken as it is
            await eventually_async(f"nothing changed for {QUIET_S}s", quiet, QUIET_LIMIT_S, 0.25)

    def _fingerprint(self) -> tuple[str, ...]:
        seen, events = self._collected()
        return tuple(sorted(str(o["metadata"].get("resourceVersion")) for o in [*seen, *events]))

    def _collected(self) -> tuple[list[Obj], list[Obj]]:
        """The scenario's objects as last seen (deleted ones too) and the events about them."""
        uids = self._claim_uids()
        pvs = [
            o for o in self.rec.seen.values() if o["kind"] == "PersistentVolume" and self._mine_pv(o, uids)
        ]
        pv_names = {pv["metadata"]["name"] for pv in pvs}
        mine = [
            o
            for o in self.rec.seen.values()
            if o["metadata"].get("namespace") == self.namespace
            or o in pvs
            or (
                o["kind"] == "VolumeAttachment"
                and o.get("spec", {}).get("source", {}).get("persistentVolumeName") in pv_names
            )
        ]
        names = {(o["kind"], o["metadata"]["name"]) for o in mine if o["kind"] not in NAMESPACED}
        events = [
            e
            for e in self.rec.events
            if e.get("involvedObject", {}).get("namespace") == self.namespace
            or (
                e["involvedObject"].get("kind") not in NAMESPACED
                and (e["involvedObject"].get("kind"), e["involvedObject"].get("name")) in names
            )
        ]
        return mine, events

    def collect(self) -> None:
        seen, events = self._collected()
        self.raw.seen = copy.deepcopy(seen)
        self.raw.events = copy.deepcopy(events)


async def _exited(proc: ManagedProcess, timeout: float = 10.0) -> None:
    async def exited() -> bool:  # ManagedProcess has no exit event
        return not proc.running

    with contextlib.suppress(WaitFailed):
        await eventually_async(f"{proc.name} exited", exited, timeout, 0.05)


_SHORT = {kind: short for short, kind in KINDS.items()}


def _local(name: str, prefix: str) -> str:
    return name[len(prefix) :] if name.startswith(prefix) else name


def _at(obj: Any, path: str) -> Any:
    """The value at a dotted path; a map key may itself contain dots (annotation keys do): the
    longest run of parts that is a key wins."""
    parts = path.split(".")
    i = 0
    while i < len(parts):
        if isinstance(obj, list):
            part = parts[i]
            obj = obj[int(part)] if part.isdigit() and int(part) < len(obj) else None
            i += 1
        elif isinstance(obj, dict):
            for j in range(len(parts), i, -1):
                key = ".".join(parts[i:j])
                if key in obj:
                    obj, i = obj[key], j
                    break
            else:
                return None
        else:
            return None
    return obj


def _api_message(exc: ApiError) -> str:
    body = exc.body or {}
    return str(body.get("reason", "")) + " " + str(body.get("message", ""))


def _describe(step: Step) -> str:
    if isinstance(step, Create):
        return f"create {step.obj['kind']}/{step.obj['metadata']['name']}"
    if isinstance(step, Patch | Delete):
        return f"{type(step).__name__.lower()} {step.kind}/{step.name}"
    return type(step).__name__.lower()


LANES = ("parallel", "pool", "exclusive")


def lane(scn: Scenario) -> str:
    """How a scenario may share its mode's stack.

    `exclusive`: it kills components or touches nodes, or leaves an unbound static volume of one of
    deploy/'s classes (which claims of every other scenario could take): it runs alone.
    `pool`: it leaves volumes or claims of class "" unbound, which may match each other across
    namespaces: these run one after another, beside the parallel ones (which have none).
    `parallel`: everything else, several at once.
    """
    if scn.exclusive:
        return "exclusive"
    pool = False
    for step in scn.steps:
        if isinstance(step, Create) and step.obj["kind"] == "PersistentVolume":
            spec = step.obj["spec"]
            if "claimRef" not in spec:
                if spec.get("storageClassName", "") != "":
                    if spec["storageClassName"] in SHARED_CLASSES:
                        return "exclusive"
                else:
                    pool = True
        elif isinstance(step, Create) and step.obj["kind"] == "PersistentVolumeClaim":
            spec = step.obj["spec"]
            pool = pool or (spec.get("storageClassName") == "" and not spec.get("volumeName"))
        elif isinstance(step, Patch) and step.kind == "pv":
            pool = pool or ("claimRef" in step.patch.get("spec", {}) and not step.patch["spec"]["claimRef"])
    return "pool" if pool else "parallel"


@dataclass(frozen=True)
class ModeRun:
    outcomes: dict[str, RawOutcome]  # by scenario name
    startup: float  # seconds the stack took to start
    surface: list[str]  # the API surface the scenarios ran against (surface.py)


async def run_mode(
    mode: str,
    scenarios: list[tuple[int, Scenario]],
    parallel: int = 8,
    on_done: Callable[[str, Scenario, float], None] | None = None,
) -> ModeRun:
    """Every scenario in one mode on one fresh stack."""
    started = time.monotonic()
    ms = await start_mode(mode, WORK_DIR / mode)
    startup = time.monotonic() - started
    out: dict[str, RawOutcome] = {}
    sem = asyncio.Semaphore(parallel)

    async def one(index: int, scn: Scenario) -> None:
        async with sem:
            t0 = time.monotonic()
            run = ScenarioRun(ms, scn, f"cf-{index:03d}", f"cf{index:03d}-")
            out[scn.name] = await run.run()
            if on_done is not None:
                on_done(mode, scn, time.monotonic() - t0)

    async def in_turn(chosen: list[tuple[int, Scenario]]) -> None:
        for i, s in chosen:
            await one(i, s)

    lanes = {name: [(i, s) for i, s in scenarios if lane(s) == name] for name in LANES}
    try:
        await asyncio.gather(*(one(i, s) for i, s in lanes["parallel"]), in_turn(lanes["pool"]))
        await in_turn(lanes["exclusive"])
    finally:
        await stop_mode(ms)
    return ModeRun(out, startup, ms.surface)
