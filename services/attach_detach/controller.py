"""The attach-detach controller: keeps VolumeAttachments and Node status.volumesAttached in step
with the pods scheduled on nodes that let the controller manage their attachments.

Pods go through a workqueue whose sync recomputes that pod's contribution to the desired state
(PVC → bound PV → spec.csi); a populator pass every minute drops pods the events missed and every
three minutes re-queues them all, as kcm's. The actual state is the VolumeAttachment cache itself,
plus the creates still in flight and, from the start, what the nodes' status.volumesAttached
listed without a VA, so a restart at any point starts from the truth: VA names are deterministic,
so nothing is ever attached twice. The "mounted by node" set of each node is what it last reported
in volumesInUse (kept after the node is deleted), plus attachments new to the actual state, which
count as mounted until the node reports again, as in kcm. A reconcile pass every `loop_period`
turns both into a plan (state.decide) and runs its writes, one operation per VolumeAttachment at a
time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.informer import EventHandler
from controller_runtime.logs import get_logger
from controller_runtime.operations import Backoff, OperationExecutor
from controller_runtime.passes import CpuMeter, PassPacer
from controller_runtime.resources import (
    CSI_DRIVERS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import (
    ANN_CONTROLLER_MANAGED,
    bound_volume_name,
    csi_volume,
    node_ready,
    pod_claim_keys,
    pod_claims,
    pod_terminated,
    unique_volume_name,
    va_name,
)
from controller_runtime.workqueue import WorkQueue, default_rate_limiter

from .metrics import METRICS
from .state import (
    ATTACH_FAILED_MESSAGE,
    ATTACH_SUCCEEDED_MESSAGE,
    ATTACH_TIMEOUT_ERROR,
    TAINT_OUT_OF_SERVICE,
    Attachment,
    DesiredEntry,
    DesiredState,
    DesiredVolume,
    Detach,
    NodeInfo,
    PodRef,
    decide,
    multi_attach_allowed,
    multi_attach_message,
    split_unique_name,
)

log = get_logger("attach-detach")

POD_BY_CLAIM = "claim"
POD_BY_NODE = "node"


@dataclass(frozen=True)
class Options:
    loop_period: float = 0.1
    max_wait_for_unmount: float = 360.0
    pod_workers: int = 4
    # Failed operations back off per VolumeAttachment: 0.5 s doubling to about 2 min, as kcm.
    backoff_start: float = 0.5
    backoff_max: float = 122.0
    # kcm's desired-state populator: drop vanished pods every minute, re-add all every 3 minutes.
    populator_period: float = 60.0
    list_pods_period: float = 180.0
    # kcm's --attach-detach-reconcile-sync-period: node-status-only attachments are checked
    # against the VolumeAttachments this often.
    sync_states_period: float = 60.0
    # How long an attach may wait for status.attached before it counts as uncertain (kcm's CSI
    # attacher timeout).
    attach_timeout: float = 120.0
    # Monotonic seconds; tests pass a fake one so that timeouts need no sleeping.
    clock: Callable[[], float] = time.monotonic


def _pod_node(pod: Obj) -> list[str]:
    node = pod.get("spec", {}).get("nodeName")
    return [node] if node else []


def _is_managed(node: Obj) -> bool:
    # kcm looks only at the annotation's presence, whatever its value.
    return ANN_CONTROLLER_MANAGED in (node.get("metadata", {}).get("annotations") or {})


def _in_use(node: Obj) -> set[str]:
    return set((node.get("status") or {}).get("volumesInUse") or ())


def _out_of_service(node: Obj) -> bool:
    return any(t.get("key") == TAINT_OUT_OF_SERVICE for t in node.get("spec", {}).get("taints") or [])


def _pod_ref(pod: Obj) -> PodRef:
    md = pod["metadata"]
    return PodRef(md.get("namespace", ""), md["name"], md.get("uid", ""))


def _pod_object(ref: PodRef) -> Obj:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
    }


class AttachDetachController(InformerController):
    def __init__(self, context: ControllerContext, options: Options | None = None) -> None:
        super().__init__(context)
        self.options = options or Options()
        self.desired = DesiredState()
        self.pod_queue: WorkQueue[str] = WorkQueue("attachdetach-pods", default_rate_limiter())
        self.pods = self.factory.informer(PODS)
        self.nodes = self.factory.informer(NODES)
        self.pvs = self.factory.informer(PERSISTENT_VOLUMES)
        self.pvcs = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.vas = self.factory.informer(VOLUME_ATTACHMENTS)
        self.drivers = self.factory.informer(CSI_DRIVERS)
        self.pods.add_index(POD_BY_CLAIM, pod_claim_keys)
        self.pods.add_index(POD_BY_NODE, _pod_node)
        self.pods.add_handler(
            EventHandler(self._pod_changed, lambda _o, n: self._pod_changed(n), self._pod_changed)
        )
        self.pvcs.add_handler(
            EventHandler(self._pvc_changed, lambda _o, n: self._pvc_changed(n), self._pvc_changed)
        )
        self.pvs.add_handler(
            EventHandler(self._pv_changed, lambda _o, n: self._pv_changed(n), self._pv_changed)
        )
        self.nodes.add_handler(EventHandler(self._node_added, self._node_updated, self._node_deleted))
        # A VA that became attached or went away changes the node status or unblocks an attach.
        self.vas.add_handler(
            EventHandler(
                lambda _o: self._wake.set(), lambda _o, _n: self._wake.set(), lambda _o: self._wake.set()
            )
        )
        self._wake = asyncio.Event()
        self.deciding = CpuMeter()  # the CPU a pass spends deciding (paces the passes)
        # One operation per VA name at a time, backing off per VA name after a failure.
        self.operations = OperationExecutor[str](
            "attachdetach",
            backoff=Backoff(self.options.backoff_start, self.options.backoff_max),
            on_done=self._wake.set,
            logger=log,
        )
        # Creates count as attachments until the cache has them.
        self._creating: dict[str, Attachment] = {}
        # VA name -> ((VA, PV resourceVersion), its Attachment without pending).
        self._attachment_cache: dict[str, tuple[tuple[Any, Any], Attachment]] = {}
        self._detaching: set[str] = set()
        self._unmount_wait_since: dict[str, float] = {}
        self._created_here: set[str] = set()
        # When this run started each attach it is still waiting for (VA name -> clock).
        self._attach_started: dict[str, float] = {}
        # The pods that wanted each attach when it started (VA name -> pods): kcm's attach
        # operation reports its outcome to those, not to pods that joined while it ran.
        self._attach_pods: dict[str, tuple[PodRef, ...]] = {}
        # (node, unique volume name) already given their Multi-Attach event, as long as wanted.
        self._multi_attach_reported: set[tuple[str, str]] = set()
        self._attach_errors_reported: dict[str, str] = {}
        self._status_written: dict[str, tuple[tuple[str, ...], float]] = {}
        # Nodes whose pods count (annotated once; kept after deletion while pods still want volumes).
        self._managed_nodes: set[str] = set()
        # Node -> its "mounted by node" set; deleted nodes keep their last one.
        self._mounted: dict[str, set[str]] = {}
        self._deleted_nodes: set[str] = set()
        # Attachments listed in a node's status at start that have no VolumeAttachment.
        self._seeded: dict[str, Attachment] = {}
        # Names in the actual state at the last pass (a newcomer counts as mounted, see above).
        self._known: set[str] = set()
        self._populated = False
        self._counts = (0, 0)
        start = self.options.clock()
        self._last_populate = self._last_list_pods = self._last_sync_states = start

    # -- handlers: only enqueue ---------------------------------------------------------------------

    def _pod_changed(self, pod: Obj) -> None:
        md = pod.get("metadata", {})
        self.pod_queue.add(f"{md.get('namespace', '')}/{md.get('name', '')}")

    def _pvc_changed(self, pvc: Obj) -> None:
        md = pvc.get("metadata", {})
        for key in self.pods.store.index_keys(
            POD_BY_CLAIM, f"{md.get('namespace', '')}/{md.get('name', '')}"
        ):
            self.pod_queue.add(key)

    def _pv_changed(self, pv: Obj) -> None:
        ref = pv.get("spec", {}).get("claimRef") or {}
        if ref.get("name"):
            for key in self.pods.store.index_keys(POD_BY_CLAIM, f"{ref.get('namespace', '')}/{ref['name']}"):
                self.pod_queue.add(key)

    def _node_changed(self, node: Obj) -> None:
        for key in self.pods.store.index_keys(POD_BY_NODE, node["metadata"]["name"]):
            self.pod_queue.add(key)

    def _node_seen(self, node: Obj) -> None:
        name = node["metadata"]["name"]
        # Every report replaces the set, which also ends the assumed mounts of new attachments.
        self._mounted[name] = _in_use(node)
        self._deleted_nodes.discard(name)
        if _is_managed(node):
            self._managed_nodes.add(name)  # kcm never takes a node out again while it exists

    def _node_added(self, node: Obj) -> None:
        self._node_seen(node)
        self._node_changed(node)

    def _node_updated(self, old: Obj, new: Obj) -> None:
        was_managed = old["metadata"]["name"] in self._managed_nodes
        self._node_seen(new)
        if not was_managed and new["metadata"]["name"] in self._managed_nodes:
            self._node_changed(new)
        self._wake.set()  # volumesInUse may have changed: a detach may be possible now

    def _node_deleted(self, node: Obj) -> None:
        name = node["metadata"]["name"]
        self._mounted[name] = _in_use(node)
        self._deleted_nodes.add(name)
        # Its pods' volumes stay wanted (and so attached) until the pods go; only a node nobody
        # wants anything on leaves the managed set.
        if not self.desired.has_node(name):
            self._managed_nodes.discard(name)
        self._wake.set()

    # -- desired state ------------------------------------------------------------------------------

    def pod_volumes(self, pod: Obj) -> list[DesiredVolume]:
        ns = pod["metadata"].get("namespace", "")
        out = []
        for _, claim, _ in pod_claims(pod):
            pvc = self.pvcs.store.get(f"{ns}/{claim}")
            pv_name = bound_volume_name(pvc)
            pv = self.pvs.store.get(pv_name) if pv_name else None
            if pv is None or not bound_volume_name(pvc, pv):
                continue  # not bound yet: the claim's or the volume's update brings the pod back
            vol = csi_volume(pv)
            if vol is None or not self.attach_required(vol.driver):
                continue
            multi = multi_attach_allowed(vol.access_modes)
            out.append(DesiredVolume(vol.pv_name, vol.driver, vol.handle, vol.unique_name, multi))
        return out

    async def sync_pod(self, key: str) -> float | None:
        pod = self.pods.store.get(key)
        if pod is None or pod_terminated(pod):
            self.desired.remove_pod(key)
        else:
            node = pod.get("spec", {}).get("nodeName")
            if not node or node not in self._managed_nodes:
                self.desired.remove_pod(key)
            else:
                self.desired.set_pod(_pod_ref(pod), node, self.pod_volumes(pod))
        self._wake.set()
        return None

    # -- actual state -------------------------------------------------------------------------------

    def _attachment(self, va: Obj) -> Attachment:
        """A VA as the actual state sees it (never pending), built again only when the VA or its
        PV changed: a pass runs on every event, over every VA."""
        name = va["metadata"]["name"]
        spec = va.get("spec", {})
        pv_name = spec.get("source", {}).get("persistentVolumeName") or ""
        pv = self.pvs.store.get(pv_name) if pv_name else None
        version = (
            va["metadata"].get("resourceVersion"),
            (pv or {}).get("metadata", {}).get("resourceVersion"),
        )
        # Objects always carry a resourceVersion from the API; one without is never cached.
        cacheable = version[0] is not None and (pv is None or version[1] is not None)
        cached = self._attachment_cache.get(name)
        if cacheable and cached is not None and cached[0] == version:
            return cached[1]
        vol = csi_volume(pv) if pv is not None else None
        driver = str(spec.get("attacher", ""))
        handle = vol.handle if vol is not None else ""
        status = va.get("status") or {}
        att = Attachment(
            name=name,
            node=str(spec.get("nodeName", "")),
            pv_name=pv_name,
            driver=driver,
            handle=handle,
            unique_name=unique_volume_name(driver, handle) if handle else "",
            attached=bool(status.get("attached")),
            deleting=bool(va["metadata"].get("deletionTimestamp")),
            attach_error=str((status.get("attachError") or {}).get("message") or ""),
        )
        if cacheable:
            self._attachment_cache[name] = (version, att)
        return att

    def attachments(self, now: float) -> list[Attachment]:
        out: dict[str, Attachment] = {}
        for va in self.vas.store.values():
            att = self._attachment(va)
            started = self._attach_started.get(att.name)
            # kcm's attach operation ends at success, a reported error, the VA's deletion or its
            # timeout; until then the VA is neither attached nor uncertain.
            if (
                started is not None
                and not (att.attached or att.deleting or att.attach_error)
                and now - started <= self.options.attach_timeout
            ):
                att = dataclasses.replace(att, pending=True)
            out[att.name] = att
            self._seeded.pop(att.name, None)  # the VA is the truth from now on
        if len(self._attachment_cache) > len(out):
            self._attachment_cache = {n: c for n, c in self._attachment_cache.items() if n in out}
        for name, att in list(self._creating.items()):
            if name in out:
                del self._creating[name]
            else:
                out[name] = att
        for name, att in self._seeded.items():
            out.setdefault(name, att)
        return list(out.values())

    def _track_mounts(self, attachments: list[Attachment]) -> None:
        """kcm adds a volume newly taken into its actual state to the node's mounted set ("assume
        mounted until proven otherwise"); the node's next report replaces the set."""
        members = {a.name for a in attachments if not a.pending}
        for att in attachments:
            if att.name in members and att.name not in self._known and att.unique_name:
                self._mounted.setdefault(att.node, set()).add(att.unique_name)
        self._known = members
        # A deleted node is forgotten once nothing of it is left in the actual state.
        for name in self._deleted_nodes - {a.node for a in attachments}:
            self._deleted_nodes.discard(name)
            self._mounted.pop(name, None)

    def node_infos(self) -> dict[str, NodeInfo]:
        infos = {}
        for node in self.nodes.store.values():
            name = node["metadata"]["name"]
            status = node.get("status") or {}
            infos[name] = NodeInfo(
                name=name,
                managed=name in self._managed_nodes,
                ready=node_ready(node),
                in_use=frozenset(self._mounted.get(name, ())),
                attached=tuple(v.get("name", "") for v in status.get("volumesAttached") or ()),
                out_of_service=_out_of_service(node),
            )
        for name in self._deleted_nodes - set(infos):
            mounted = frozenset(self._mounted.get(name, ()))
            infos[name] = NodeInfo(name, False, False, mounted, (), exists=False)
        return infos

    def attach_required(self, driver: str) -> bool:
        obj = self.drivers.store.get(driver)
        if obj is None:
            return True  # no CSIDriver object: Kubernetes assumes the driver needs attaching
        return obj.get("spec", {}).get("attachRequired", True) is not False

    def seed_actual_state(self) -> None:
        """kcm's start: volumes the nodes list in status.volumesAttached are attached, whether a
        VolumeAttachment exists or not; a VA that no node lists is uncertain, counts as mounted
        until its node reports again (it is new to the actual state) and, if a pod wants it, gets
        the SuccessfulAttachVolume event once attached (kcm attaches it again)."""
        listed: set[str] = set()
        for node in self.nodes.store.values():
            node_name = node["metadata"]["name"]
            for entry in (node.get("status") or {}).get("volumesAttached") or ():
                unique = str(entry.get("name", ""))
                parsed = split_unique_name(unique)
                if parsed is None:
                    continue  # not a CSI volume: nothing kubeloop attaches
                driver, handle = parsed
                name = va_name(handle, driver, node_name)
                listed.add(name)
                if name not in self.vas.store:
                    self._seeded[name] = Attachment(
                        name, node_name, "", driver, handle, unique, attached=True, deleting=False
                    )
        self._known = listed
        # kcm runs an attach for each of those that a pod wants, which reports its success.
        self._created_here |= set(self.vas.store.keys()) - listed

    # -- desired-state populator ----------------------------------------------------------------------

    def populate(self, now: float) -> None:
        """kcm's populator pass: forget pods the informer no longer has (or has as a new pod of the
        same name, or terminated) and volumes whose driver stopped needing an attach; every
        `list_pods_period`, run every pod through the queue again."""
        for key, (ref, _node, _vols) in list(self.desired.pods.items()):
            pod = self.pods.store.get(key)
            if pod is None or pod_terminated(pod) or pod["metadata"].get("uid", "") != ref.uid:
                log.info("removing a pod that no longer exists from the desired state", pod=key)
                self.desired.remove_pod(key)
        self.desired.drop_volumes(lambda vol: not self.attach_required(vol.driver))
        if now - self._last_list_pods >= self.options.list_pods_period:
            self._last_list_pods = now
            for pod in self.pods.store.values():
                if not pod_terminated(pod):
                    self._pod_changed(pod)

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return super().synced and self._populated

    async def run(self) -> None:
        METRICS.sources.append(self._metric_counts)
        workers = asyncio.create_task(run_workers(self.pod_queue, self.sync_pod, self.options.pod_workers))
        try:
            await self.start_informers()
            self.seed_actual_state()
            # Populate the desired state from every pod before the first pass: a pass with a
            # half-filled desired state would detach volumes pods still need (volumesInUse would
            # stop it, but a node that is down cannot protect itself).
            await self.pod_queue.wait_idle()
            self._populated = True
            log.info(
                "caches synced, desired state populated",
                pods=len(self.desired.pods),
                attachments=len(self.vas.store),
                listed_without_attachment=len(self._seeded),
            )
            # Never spin faster than a tenth of the loop period, however many events arrive.
            pacer = PassPacer(self._wake, self.options.loop_period, self.options.loop_period / 10)
            while True:
                try:
                    now = self.options.clock()
                    if now - self._last_populate >= self.options.populator_period:
                        self._last_populate = now
                        with self.deciding:
                            self.populate(now)
                    await self.reconcile()
                except Exception:
                    log.exception("reconcile pass failed")
                pacer.pass_ended(self.deciding.take())
                await pacer.next_pass()
        finally:
            METRICS.sources.remove(self._metric_counts)
            workers.cancel()
            await asyncio.gather(workers, self.operations.shutdown(), return_exceptions=True)
            await self.factory.stop()

    def _metric_counts(self) -> tuple[int, int]:
        return self._counts

    # -- the reconcile pass ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        now = self.options.clock()
        with self.deciding:
            if now - self._last_sync_states >= self.options.sync_states_period:
                # kcm's periodic check of its attached volumes: one listed by a node but without a
                # VolumeAttachment is not attached after all (a wanted one is then attached anew).
                self._last_sync_states = now
                self._seeded = {n: a for n, a in self._seeded.items() if n in self._detaching}
            desired = self.desired.entries()
            attachments = self.attachments(now)
            self._track_mounts(attachments)
            nodes = self.node_infos()
            live = {a.name for a in attachments}
            self._detaching &= {a.name for a in attachments if not a.deleting}
            self._attach_started = {
                n: t for n, t in self._attach_started.items() if n in live and n not in self._detaching
            }
            self._counts = (len(desired), len(attachments))
            plan = decide(
                desired,
                attachments,
                nodes,
                attach_required=self.attach_required,
                unmount_wait_since=self._unmount_wait_since,
                now=now,
                max_wait_for_unmount=self.options.max_wait_for_unmount,
                detaching=frozenset(self._detaching),
            )
        self._unmount_wait_since = {
            name: self._unmount_wait_since.get(name, now) for name in plan.detach_requested
        }

        # 1. Detach: the node's status must stop listing the volume before its VA goes.
        detaches = [d for d in plan.detaches if not self.operations.is_pending(d.attachment.name)]
        detach_nodes = {d.attachment.node for d in detaches}
        if detaches:
            results = await asyncio.gather(
                *(
                    self._write_node_status(n, plan.node_status[n])
                    for n in detach_nodes
                    if n in plan.node_status
                ),
                return_exceptions=True,
            )
            failed = {
                n
                for n, r in zip([n for n in detach_nodes if n in plan.node_status], results, strict=True)
                if isinstance(r, BaseException)
            }
            for d in detaches:
                if d.attachment.node not in failed:
                    self._detaching.add(d.attachment.name)
                    self.operations.run(d.attachment.name, self._detach(d))

        # 2. Attach, or say why not.
        for entry in plan.attaches:
            if not self.operations.is_pending(entry.va_name):
                self._creating[entry.va_name] = Attachment(
                    entry.va_name,
                    entry.node,
                    entry.volume.pv_name,
                    entry.volume.driver,
                    entry.volume.handle,
                    entry.volume.unique_name,
                    attached=False,
                    deleting=False,
                    pending=True,
                )
                self._attach_started[entry.va_name] = now
                self._attach_pods[entry.va_name] = entry.pods
                self.operations.run(entry.va_name, self._attach(entry))
        self._multi_attach_reported &= {(e.node, e.volume.unique_name) for e in desired}
        for refusal in plan.multi_attach:
            # Once per volume and node while it stays wanted there, as kcm's desired state marks it.
            mark = (refusal.entry.node, refusal.entry.volume.unique_name)
            if mark in self._multi_attach_reported:
                continue
            self._multi_attach_reported.add(mark)
            for pod in refusal.entry.pods:
                self.recorder.warning(
                    _pod_object(pod),
                    "FailedAttachVolume",
                    multi_attach_message(refusal.entry.volume.pv_name, pod, refusal.other_pods),
                )
        self._report_attach_results(desired, attachments)

        # 3. Node status for the nodes the detaches did not already write.
        rest = {n: v for n, v in plan.node_status.items() if n not in detach_nodes}
        if rest:
            await asyncio.gather(
                *(self._write_node_status(n, v) for n, v in rest.items()), return_exceptions=True
            )
        # Forget bookkeeping of attachments that are gone.
        kept = live | set(self._creating)
        self._created_here &= kept
        self._attach_pods = {n: p for n, p in self._attach_pods.items() if n in kept}
        self.operations.forget(live | {e.va_name for e in plan.attaches})

    def _report_attach_results(self, desired: list[DesiredEntry], attachments: list[Attachment]) -> None:
        by_name = {a.name: a for a in attachments}
        for entry in desired:
            att = by_name.get(entry.va_name)
            if att is None:
                continue
            error = att.attach_error
            settled = error or att.attached or att.pending or att.deleting
            if not settled and att.name in self._attach_started:  # timed out waiting for the attacher
                error = ATTACH_TIMEOUT_ERROR.format(driver=att.driver, handle=att.handle)
            # Without a record (an attach found at start), the pods that want it now.
            pods = self._attach_pods.get(att.name, entry.pods)
            if att.attached and entry.va_name in self._created_here:
                self._created_here.discard(entry.va_name)
                self._attach_errors_reported.pop(entry.va_name, None)
                self._attach_pods.pop(entry.va_name, None)
                for pod in pods:
                    self.recorder.normal(
                        _pod_object(pod),
                        "SuccessfulAttachVolume",
                        ATTACH_SUCCEEDED_MESSAGE.format(pv=entry.volume.pv_name),
                    )
            elif error and self._attach_errors_reported.get(att.name) != error:
                self._attach_errors_reported[att.name] = error
                # kcm retries a failed attach as a new operation, for the pods wanting it by then.
                self._attach_pods[att.name] = entry.pods
                for pod in pods:
                    self.recorder.warning(
                        _pod_object(pod),
                        "FailedAttachVolume",
                        ATTACH_FAILED_MESSAGE.format(pv=entry.volume.pv_name, error=error),
                    )

    # -- operations ---------------------------------------------------------------------------------

    async def _attach(self, entry: DesiredEntry) -> None:
        body = {
            "metadata": {"name": entry.va_name},
            "spec": {
                "attacher": entry.volume.driver,
                "nodeName": entry.node,
                "source": {"persistentVolumeName": entry.volume.pv_name},
            },
        }
        try:
            await self.client.create(VOLUME_ATTACHMENTS, body)
            self._created_here.add(entry.va_name)
            log.info("attaching", va=entry.va_name, pv=entry.volume.pv_name, node=entry.node)
        except ApiError as exc:
            if not exc.already_exists:
                self._creating.pop(entry.va_name, None)
                raise
            # Created by an earlier run of this controller: the cache will show it.

    async def _detach(self, d: Detach) -> None:
        att = d.attachment
        if d.forced:
            METRICS.record_forced_detach(d.force_reason)
            log.warning(
                "force-detaching without checking that the volume is unmounted",
                reason=d.force_reason,
                va=att.name,
                pv=att.pv_name,
                node=att.node,
                max_wait=f"{self.options.max_wait_for_unmount:.0f}s",
            )
        try:
            await self.client.delete(VOLUME_ATTACHMENTS, att.name)
        except ApiError as exc:
            if not exc.not_found:
                self._detaching.discard(att.name)
                raise
        self._seeded.pop(att.name, None)
        log.info("detaching", va=att.name, pv=att.pv_name, node=att.node, forced=d.forced)

    async def _write_node_status(self, node: str, names: tuple[str, ...]) -> None:
        # The cache can lag behind our own write: do not send the same list again at once.
        last = self._status_written.get(node)
        if last is not None and last[0] == names and self.options.clock() - last[1] < 2.0:
            return
        patch = {"status": {"volumesAttached": [{"name": n, "devicePath": ""} for n in names]}}
        try:
            await self.client.patch(NODES, node, patch, subresource="status")
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        self._status_written[node] = (names, self.options.clock())
