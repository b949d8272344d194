"""Shared pieces of the pv-controller integration tests (no tests here): a table-case vocabulary,
a harness that creates the initial objects against the real apiserver, runs one PVController
in-process, waits for the expected final objects and events, and cleans its cluster-scoped
objects up so the next test's controller never sees them."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import (
    EVENTS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    Obj,
)
from localstack.controlplane import ControlPlane
from services.pv_controller import names
from services.pv_controller.controller import Options, PVController
from tests.support.waits import consistently_async, eventually_async, no_problems

OTHER_UID = "other-uid"  # a claimRef UID that belongs to no existing claim
NO_UID = ""

PROVISIONER = "example.com/external"


@dataclass(frozen=True)
class PV:
    name: str
    size: str = "1Gi"
    modes: tuple[str, ...] = ("ReadWriteOnce",)
    cls: str | None = ""  # None leaves storageClassName out
    claim: str | None = None  # claimRef to this claim name
    claim_uid: str | None = None  # None: the claim's real UID; NO_UID or OTHER_UID otherwise
    phase: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    volume_mode: str | None = None
    policy: str = "Retain"
    csi: bool = False  # a CSI volume source instead of hostPath


@dataclass(frozen=True)
class PVC:
    name: str
    size: str = "1Gi"
    modes: tuple[str, ...] = ("ReadWriteOnce",)
    cls: str | None = ""
    volume: str | None = None  # spec.volumeName (a PV's short name)
    phase: str | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    selector: Obj | None = None
    volume_mode: str | None = None


@dataclass(frozen=True)
class SC:
    name: str
    provisioner: str = PROVISIONER
    wait_for_consumer: bool = False
    default: bool = False


ANY = "<any>"


@dataclass(frozen=True)
class WantPV:
    name: str
    phase: str
    claim: str | None = None  # claimRef name, None for no claimRef
    uid_of: str | None = ANY  # claimRef.uid is this claim's UID; NO_UID for empty; ANY skips
    annotations: Mapping[str, str | None] = field(default_factory=dict)  # None: must be absent


@dataclass(frozen=True)
class WantPVC:
    name: str
    phase: str
    volume: str | None = None
    annotations: Mapping[str, str | None] = field(default_factory=dict)
    cls: str | None = ANY


@dataclass(frozen=True)
class WantEvent:
    obj: str  # the object's short name (PV or PVC)
    reason: str
    message: str = ""  # a substring of the message


@dataclass(frozen=True)
class Case:
    id: str
    pvs: tuple[PV, ...] = ()
    pvcs: tuple[PVC, ...] = ()
    classes: tuple[SC, ...] = ()
    want_pvs: tuple[WantPV, ...] = ()
    want_pvcs: tuple[WantPVC, ...] = ()
    want_events: tuple[WantEvent, ...] = ()


BIND_COMPLETED = storage.ANN_BIND_COMPLETED
BOUND_BY_CONTROLLER = storage.ANN_BOUND_BY_CONTROLLER


class Harness:
    def __init__(self, cp: ControlPlane, api: ApiClient, namespace: str) -> None:
        self.cp = cp
        self.api = api
        self.ns = namespace
        self.prefix = f"{namespace}-{uuid.uuid4().hex[:4]}"
        self.uids: dict[str, str] = {}
        self.controller: PVController | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: ApiClient | None = None
        self._recorder: EventRecorder | None = None

    # -- names ---------------------------------------------------------------------------------------

    def pv_name(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def sc_name(self, short: str) -> str:
        return f"{self.prefix}-{short}"

    def short(self, name: str) -> str:
        return name.removeprefix(f"{self.prefix}-")

    def _cls(self, cls: str | None) -> str | None:
        return self.sc_name(cls) if cls else cls

    # -- objects ---------------------------------------------------------------------------------------

    async def create_class(self, sc: SC) -> Obj:
        body: Obj = {
            "metadata": {"name": self.sc_name(sc.name)},
            "provisioner": sc.provisioner,
            "volumeBindingMode": "WaitForFirstConsumer" if sc.wait_for_consumer else "Immediate",
            "reclaimPolicy": "Delete",
        }
        if sc.default:
            body["metadata"]["annotations"] = {storage.ANN_DEFAULT_CLASS: "true"}
        return await self.api.create(STORAGE_CLASSES, body)

    async def create_pvc(self, c: PVC) -> Obj:
        spec: Obj = {
            "accessModes": list(c.modes),
            "resources": {"requests": {"storage": c.size}},
        }
        if c.cls is not None:
            spec["storageClassName"] = self._cls(c.cls)
        if c.volume is not None:
            spec["volumeName"] = self.pv_name(c.volume) if c.volume else ""
        if c.selector is not None:
            spec["selector"] = c.selector
        if c.volume_mode is not None:
            spec["volumeMode"] = c.volume_mode
        body = {"metadata": {"name": c.name, "annotations": dict(c.annotations)}, "spec": spec}
        obj = await self.api.create(PERSISTENT_VOLUME_CLAIMS, body, self.ns)
        self.uids[c.name] = obj["metadata"]["uid"]
        if c.phase is not None:
            obj["status"] = {"phase": c.phase}
            if c.phase == "Bound":
                obj["status"].update(accessModes=list(c.modes), capacity={"storage": c.size})
            obj = await self.api.update_status(PERSISTENT_VOLUME_CLAIMS, obj)
        return obj

    async def create_pv(self, v: PV) -> Obj:
        spec: Obj = {
            "capacity": {"storage": v.size},
            "accessModes": list(v.modes),
            "persistentVolumeReclaimPolicy": v.policy,
        }
        if v.csi:
            spec["csi"] = {"driver": "loop.csi.kubeloop.dev", "volumeHandle": self.pv_name(v.name)}
        else:
            spec["hostPath"] = {"path": f"/tmp/kubeloop-test/{self.pv_name(v.name)}"}
        if v.cls is not None:
            spec["storageClassName"] = self._cls(v.cls)
        if v.volume_mode is not None:
            spec["volumeMode"] = v.volume_mode
        if v.claim is not None:
            uid = self.uids.get(v.claim, str(uuid.uuid4())) if v.claim_uid is None else v.claim_uid
            if uid == OTHER_UID:
                uid = str(uuid.uuid4())
            ref = {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": self.ns, "name": v.claim}
            if uid:
                ref["uid"] = uid
            spec["claimRef"] = ref
        md: Obj = {"name": self.pv_name(v.name), "labels": dict(v.labels), "annotations": dict(v.annotations)}
        obj = await self.api.create(PERSISTENT_VOLUMES, {"metadata": md, "spec": spec})
        if v.phase is not None:
            obj["status"] = {"phase": v.phase}
            obj = await self.api.update_status(PERSISTENT_VOLUMES, obj)
        return obj

    async def setup(self, case: Case) -> None:
        # Claims first: a PV's claimRef carries its claim's UID.
        for sc in case.classes:
            await self.create_class(sc)
        for c in case.pvcs:
            await self.create_pvc(c)
        for v in case.pvs:
            await self.create_pv(v)

    async def pv(self, short: str) -> Obj | None:
        try:
            return await self.api.get(PERSISTENT_VOLUMES, self.pv_name(short))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def pvc(self, name: str) -> Obj:
        return await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, self.ns)

    async def events(self) -> list[tuple[str, str, str]]:
        """(object short name, reason, message) of every event about this test's objects."""
        out = []
        for ns in (self.ns, "default"):
            for e in (await self.api.list_page(EVENTS, ns))["items"]:
                ref = e.get("involvedObject", {})
                name = ref.get("name", "")
                if ref.get("kind") == "PersistentVolume" and not name.startswith(self.prefix):
                    continue
                out.append((self.short(name), e.get("reason", ""), e.get("message", "")))
        return out

    # -- controller ------------------------------------------------------------------------------------

    async def start(
        self, workers: int = 4, resync: float = 2.0, binds_in_flight: int = Options.binds_in_flight
    ) -> PVController:
        self._client = await ApiClient.from_kubeconfig(
            str(self.cp.admin_kubeconfig), qps=0, burst=1, user_agent="pv-controller-test"
        )
        self._recorder = EventRecorder(self._client, names.COMPONENT)
        factory = SharedInformerFactory(self._client, resync_period=resync)
        context = ControllerContext(self._client, factory, self._recorder)
        options = Options(resync_period=resync, workers=workers, binds_in_flight=binds_in_flight)
        self.controller = PVController(context, options)
        self._task = asyncio.create_task(self.controller.run())
        await asyncio.wait_for(factory.wait_for_sync(), 30)
        return self.controller

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._recorder is not None:
            await self._recorder.close()
        if self._client is not None:
            await self._client.close()

    async def cleanup(self) -> None:
        """Deletes this test's PVs and classes; finalizers are dropped since no controller is left
        to move a Bound volume on."""
        await self.stop()
        # Claims go first and for good: a Pending claim left in a terminating namespace would be
        # bound by the next test's controller to that test's volumes.
        for pvc in (await self.api.list_page(PERSISTENT_VOLUME_CLAIMS, self.ns))["items"]:
            name = pvc["metadata"]["name"]
            with contextlib.suppress(ApiError):
                await self.api.patch(
                    PERSISTENT_VOLUME_CLAIMS, name, {"metadata": {"finalizers": None}}, self.ns
                )
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUME_CLAIMS, name, self.ns)

        async def claims_left() -> list[str]:
            items = (await self.api.list_page(PERSISTENT_VOLUME_CLAIMS, self.ns))["items"]
            return [c["metadata"]["name"] for c in items]

        await eventually_async("the claims gone", claims_left, 10, 0.2, satisfied=no_problems)
        pvs = (await self.api.list_page(PERSISTENT_VOLUMES))["items"]
        for pv in pvs:
            name = pv["metadata"]["name"]
            if not name.startswith(self.prefix):
                continue
            with contextlib.suppress(ApiError):
                await self.api.patch(PERSISTENT_VOLUMES, name, {"metadata": {"finalizers": None}})
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUMES, name)
        for sc in (await self.api.list_page(STORAGE_CLASSES))["items"]:
            if sc["metadata"]["name"].startswith(self.prefix):
                with contextlib.suppress(ApiError):
                    await self.api.delete(STORAGE_CLASSES, sc["metadata"]["name"])

    # -- expectations ------------------------------------------------------------------------------------

    async def mismatches(self, case: Case) -> list[str]:
        problems: list[str] = []
        for w in case.want_pvs:
            pv = await self.pv(w.name)
            if pv is None:
                problems.append(f"PV {w.name}: missing")
                continue
            problems += [f"PV {w.name}: {p}" for p in self._check_pv(pv, w)]
        for c in case.want_pvcs:
            pvc = await self.pvc(c.name)
            problems += [f"PVC {c.name}: {p}" for p in self._check_pvc(pvc, c)]
        if case.want_events:
            seen = await self.events()
            for e in case.want_events:
                if not any(o == e.obj and r == e.reason and e.message in m for o, r, m in seen):
                    problems.append(f"no event {e} among {seen}")
        return problems

    def _check_annotations(self, obj: Obj, want: Mapping[str, str | None]) -> list[str]:
        have = obj["metadata"].get("annotations") or {}
        return [f"annotation {k}={have.get(k)!r}, want {v!r}" for k, v in want.items() if have.get(k) != v]

    def _check_pv(self, pv: Obj, w: WantPV) -> list[str]:
        out = []
        phase = pv.get("status", {}).get("phase")
        if phase != w.phase:
            out.append(f"phase {phase}, want {w.phase}")
        ref = pv["spec"].get("claimRef")
        if w.claim is None:
            if ref:
                out.append(f"claimRef {ref.get('name')}, want none")
        elif not ref or ref.get("name") != w.claim:
            out.append(f"claimRef {ref and ref.get('name')}, want {w.claim}")
        elif w.uid_of != ANY:
            want_uid = self.uids.get(w.uid_of, "") if w.uid_of else ""
            if (ref.get("uid") or "") != want_uid:
                out.append(f"claimRef uid {ref.get('uid')!r}, want {want_uid!r}")
        return out + self._check_annotations(pv, w.annotations)

    def _check_pvc(self, pvc: Obj, w: WantPVC) -> list[str]:
        out = []
        phase = pvc.get("status", {}).get("phase")
        if phase != w.phase:
            out.append(f"phase {phase}, want {w.phase}")
        want_volume = self.pv_name(w.volume) if w.volume else ""
        if (pvc["spec"].get("volumeName") or "") != want_volume:
            out.append(f"volumeName {pvc['spec'].get('volumeName')!r}, want {want_volume!r}")
        if w.cls != ANY:
            want_cls = self._cls(w.cls)
            if pvc["spec"].get("storageClassName") != want_cls:
                out.append(f"storageClassName {pvc['spec'].get('storageClassName')!r}, want {want_cls!r}")
        if phase == "Bound" and w.phase == "Bound" and not pvc.get("status", {}).get("capacity"):
            out.append("Bound without status.capacity")
        return out + self._check_annotations(pvc, w.annotations)

    async def converge(self, case: Case, timeout: float = 20.0) -> None:
        """Waits until every expectation holds, then checks that they hold on every poll for half a
        second more (a late, wrong write would show up there)."""
        await eventually_async(
            f"{case.id}: converged", lambda: self.mismatches(case), timeout, 0.2, satisfied=no_problems
        )
        await consistently_async(
            f"{case.id}: still converged", lambda: self.mismatches(case), 0.5, satisfied=no_problems
        )


@contextlib.asynccontextmanager
async def harness(cp: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[Harness]:
    h = Harness(cp, api, namespace)
    try:
        yield h
    finally:
        await h.cleanup()
