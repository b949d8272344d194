"""The attach-detach controller: keeps VolumeAttachments and Node status.volumesAttached in step
with the pods scheduled on nodes that let the controller manage their attachments.

Pods go through a workqueue whose sync recomputes that pod's contribution to the desired state
(`desired_state.DesiredState`: PVC → bound PV → spec.csi); a populator pass every minute drops
pods the events missed and every three minutes re-queues them all, as kcm's. The actual state
(`actual_state.ActualState`) is the VolumeAttachment cache itself, read on every pass, plus what
the cache cannot say: creates still in flight, what the nodes' status.volumesAttached listed
without a VA at start, operations under way and each node's "mounted by node" set. So a restart at
any point starts from the truth: VA names are deterministic, so nothing is ever attached twice. A
reconcile pass every `loop_period` turns both into a plan (`decide.decide`, pure) and carries out
its writes, one operation per VolumeAttachment at a time, telling both states what it did.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from controller_runtime.attach_rules import attach_required, multi_attach_allowed, node_ready
from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import (
    Node,
    PersistentVolume,
    PersistentVolumeClaim,
    Pod,
    VolumeAttachmentStatus,
    csi_driver_view,
    node_view,
    pod_view,
    pv_view,
    pvc_view,
    volume_attachment_view,
)
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
    pod_claim_keys,
    pod_claims,
    pod_terminated,
    unique_volume_name,
    va_name,
)
from controller_runtime.workqueue import WorkQueue, default_rate_limiter

from .actual_state import ActualState
from .decide import (
    ATTACH_FAILED_MESSAGE,
    ATTACH_SUCCEEDED_MESSAGE,
    TAINT_OUT_OF_SERVICE,
    Attachment,
    DesiredEntry,
    DesiredVolume,
    Detach,
    NodeInfo,
    Plan,
    PodRef,
    decide,
    multi_attach_message,
    split_unique_name,
)
from .desired_state import DesiredState
from .metrics import METRICS

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


def _pod_node(pod: Obj) -> list[str]:
    node = pod.get("spec", {}).get("nodeName")
    return [node] if node else []


def _is_managed(node: Node) -> bool:
    # kcm looks only at the annotation's presence, whatever its value.
    return ANN_CONTROLLER_MANAGED in (node.get("metadata", {}).get("annotations") or {})


def _va_state(obj: Obj) -> tuple[VolumeAttachmentStatus | None, str | None]:
    """What a pass reads of a VA that can change after it is created: its status and deletion."""
    va = volume_attachment_view(obj)
    return va.get("status"), va["metadata"].get("deletionTimestamp")


def _in_use(node: Node) -> set[str]:
    return set((node.get("status") or {}).get("volumesInUse") or ())


def _out_of_service(node: Node) -> bool:
    return any(t.get("key") == TAINT_OUT_OF_SERVICE for t in node.get("spec", {}).get("taints") or [])


def _claimed_by(pv: PersistentVolume, pvc: PersistentVolumeClaim | None) -> bool:
    """The PV's claimRef names the claim's UID, as kcm requires before it attaches a claim's volume
    (getPVSpecFromCache): a PV whose claimRef an admin cleared, or one reserved for the claim's name
    only (no UID), is not that claim's volume, whatever the claim's volumeName says."""
    uid = ((pvc or {}).get("metadata") or {}).get("uid")
    return bool(uid) and ((pv.get("spec") or {}).get("claimRef") or {}).get("uid") == uid


def _pod_ref(pod: Pod) -> PodRef:
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
        # The two worlds; the controller changes them only through their methods.
        self.desired = DesiredState()
        self.actual = ActualState(self.options.attach_timeout)
        self.pod_queue: WorkQueue[str] = WorkQueue(
            "attachdetach-pods", default_rate_limiter(clock=self.clock), clock=self.clock
        )
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
        # A VA that came, became attached, failed or went away changes the node status or
        # unblocks an attach; the external-attacher's finalizer write changes nothing a pass reads.
        self.vas.add_handler(
            EventHandler(lambda _o: self._wake.set(), self._va_updated, lambda _o: self._wake.set())
        )
        self._wake = asyncio.Event()
        self.deciding = CpuMeter()  # the CPU a pass spends deciding (paces the passes)
        # One operation per VA name at a time, backing off per VA name after a failure.
        self.operations = OperationExecutor[str](
            "attachdetach",
            backoff=Backoff(self.options.backoff_start, self.options.backoff_max),
            on_done=self._wake.set,
            logger=log,
            clock=self.clock,
        )
        # VA name -> ((VA, PV resourceVersion), its Attachment without pending): reading a VA is
        # done again only when it or its PV changed.
        self._attachment_cache: dict[str, tuple[tuple[Any, Any], Attachment]] = {}
        self._populated = False
        self._counts = (0, 0)
        start = self.clock.monotonic()
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

    def _node_seen(self, obj: Obj) -> None:
        node = node_view(obj)
        name = node["metadata"]["name"]
        self.actual.set_volumes_mounted_by_node(name, _in_use(node))
        if _is_managed(node):
            self.desired.add_node(name)

    def _node_added(self, node: Obj) -> None:
        self._node_seen(node)
        self._node_changed(node)

    def _va_updated(self, old: Obj, new: Obj) -> None:
        if _va_state(old) != _va_state(new):
            self._wake.set()

    def _node_updated(self, old_obj: Obj, new_obj: Obj) -> None:
        old, new = node_view(old_obj), node_view(new_obj)
        was_managed = self.desired.node_exists(old["metadata"]["name"])
        self._node_seen(new_obj)
        managed = self.desired.node_exists(new["metadata"]["name"])
        if not was_managed and managed:
            self._node_changed(new_obj)
        # A volume the node stopped using may be detached now, and readiness or the out-of-service
        # taint decide forced detaches. A volume it started using, or this controller's own
        # volumesAttached write, allows nothing new: no pass for those (while pods mount, each
        # node's status changes with every volume).
        if (
            was_managed != managed
            or not _in_use(old) <= _in_use(new)
            or (node_ready(old), _out_of_service(old)) != (node_ready(new), _out_of_service(new))
        ):
            self._wake.set()

    def _node_deleted(self, obj: Obj) -> None:
        node = node_view(obj)
        name = node["metadata"]["name"]
        self.actual.set_volumes_mounted_by_node(name, _in_use(node), deleted=True)
        self.desired.delete_node(name)
        self._wake.set()

    # -- desired state ------------------------------------------------------------------------------

    def pod_volumes(self, pod: Pod) -> list[DesiredVolume]:
        ns = pod["metadata"].get("namespace", "")
        out = []
        for _, claim, _ in pod_claims(pod):
            pvc = pvc_view(self.pvcs.store.get(f"{ns}/{claim}"))
            pv_name = bound_volume_name(pvc)
            pv = pv_view(self.pvs.store.get(pv_name)) if pv_name else None
            if pv is None or not _claimed_by(pv, pvc):
                continue  # not bound yet: the claim's or the volume's update brings the pod back
            vol = csi_volume(pv)
            if vol is None or not self.attach_required(vol.driver):
                continue
            multi = multi_attach_allowed(vol.access_modes)
            out.append(DesiredVolume(vol.pv_name, vol.driver, vol.handle, vol.unique_name, multi))
        return out

    async def sync_pod(self, key: str) -> float | None:
        pod = pod_view(self.pods.store.get(key))
        node = (pod or {}).get("spec", {}).get("nodeName")
        if pod is None or pod_terminated(pod) or not node or not self.desired.node_exists(node):
            changed = self.desired.remove_pod(key)
        else:
            changed = self.desired.set_pod(_pod_ref(pod), node, self.pod_volumes(pod))
        if changed:  # most pod updates (its status as it starts) want nothing new: no pass
            self._wake.set()
        return None

    # -- actual state -------------------------------------------------------------------------------

    def _attachment(self, obj: Obj) -> Attachment:
        """A VA as the actual state sees it (never pending), built again only when the VA or its
        PV changed: a pass runs on every event, over every VA."""
        va = volume_attachment_view(obj)
        name = va["metadata"]["name"]
        spec = va.get("spec", {})
        pv_name = spec.get("source", {}).get("persistentVolumeName") or ""
        pv = pv_view(self.pvs.store.get(pv_name)) if pv_name else None
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
        if not handle and cached is not None:
            # Its PV was deleted while it was attached (nothing holds a PV whose driver publishes
            # nothing: the attacher puts no finalizer on it): kcm's actual state keeps the volume it
            # saw attached and still detaches it once no pod wants it, so this one keeps the handle
            # it had. Only a VA whose PV this process never saw stays unknown (kcm's start-up).
            handle = cached[1].handle
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
        """The actual state as of `now`: the VolumeAttachments the cache holds, and what the
        actual state adds to them (see ActualState.get_attached_volumes)."""
        atts = self.actual.get_attached_volumes((self._attachment(va) for va in self.vas.store.values()), now)
        if len(self._attachment_cache) > len(self.vas.store):
            self._attachment_cache = {n: c for n, c in self._attachment_cache.items() if n in self.vas.store}
        return atts

    def node_infos(self) -> dict[str, NodeInfo]:
        infos = {}
        for obj in self.nodes.store.values():
            node = node_view(obj)
            name = node["metadata"]["name"]
            status = node.get("status") or {}
            infos[name] = NodeInfo(
                name=name,
                managed=self.desired.node_exists(name),
                ready=node_ready(node),
                in_use=self.actual.get_volumes_mounted_by_node(name),
                attached=tuple(v.get("name", "") for v in status.get("volumesAttached") or ()),
                out_of_service=_out_of_service(node),
            )
        for name in self.actual.deleted_nodes() - set(infos):
            mounted = self.actual.get_volumes_mounted_by_node(name)
            infos[name] = NodeInfo(name, False, False, mounted, (), exists=False)
        return infos

    def attach_required(self, driver: str) -> bool:
        return attach_required(csi_driver_view(self.drivers.store.get(driver)))

    def seed_actual_state(self) -> None:
        """kcm's start: volumes the nodes list in status.volumesAttached are attached, whether a
        VolumeAttachment exists or not; a VA that no node lists is uncertain, counts as mounted
        until its node reports again (it is new to the actual state) and, if a pod wants it, gets
        the SuccessfulAttachVolume event once attached (kcm attaches it again)."""
        listed: list[Attachment] = []
        for node in self.nodes.store.values():
            node_name = node["metadata"]["name"]
            for entry in (node.get("status") or {}).get("volumesAttached") or ():
                unique = str(entry.get("name", ""))
                parsed = split_unique_name(unique)
                if parsed is None:
                    continue  # not a CSI volume: nothing kubeloop attaches
                driver, handle = parsed
                name = va_name(handle, driver, node_name)
                listed.append(
                    Attachment(name, node_name, "", driver, handle, unique, attached=True, deleting=False)
                )
        self.actual.populate(listed, set(self.vas.store.keys()))

    # -- desired-state populator ----------------------------------------------------------------------

    def populate(self, now: float) -> None:
        """kcm's populator pass: forget pods the informer no longer has (or has as a new pod of the
        same name, or terminated) and volumes whose driver stopped needing an attach; every
        `list_pods_period`, run every pod through the queue again."""
        for ref in self.desired.get_pods():
            pod = pod_view(self.pods.store.get(ref.key))
            if pod is None or pod_terminated(pod) or pod["metadata"].get("uid", "") != ref.uid:
                log.info("removing a pod that no longer exists from the desired state", pod=ref.key)
                self.desired.remove_pod(ref.key)
        self.desired.drop_volumes(lambda vol: not self.attach_required(vol.driver))
        if now - self._last_list_pods >= self.options.list_pods_period:
            self._last_list_pods = now
            for obj in self.pods.store.values():
                if not pod_terminated(pod_view(obj)):
                    self._pod_changed(obj)

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return super().synced and self._populated

    async def run(self) -> None:
        METRICS.sources.append(self._metric_counts)
        METRICS.deletions.append(self._deletions)
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
                listed_without_attachment=self.actual.listed_without_attachment(),
            )
            # Never spin faster than a tenth of the loop period, however many events arrive.
            pacer = PassPacer(self._wake, self.options.loop_period, self.options.loop_period / 10, self.clock)
            while True:
                try:
                    now = self.clock.monotonic()
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
            METRICS.deletions.remove(self._deletions)
            workers.cancel()
            await asyncio.gather(workers, self.operations.shutdown(), return_exceptions=True)
            await self.factory.stop()

    def _deletions(self) -> list[str]:
        return [
            str(va["metadata"]["deletionTimestamp"])
            for va in self.vas.store.values()
            if va["metadata"].get("deletionTimestamp")
        ]

    def _metric_counts(self) -> tuple[int, int]:
        return self._counts

    # -- the reconcile pass ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        now = self.clock.monotonic()
        with self.deciding:
            desired, attachments, plan = self._decide(now)
        self.actual.set_detach_requests(plan.detach_requested, now)
        # 1. Detach, 2. attach or say why not, 3. node status for the nodes the detaches did not
        # already write.
        detach_nodes = await self._start_detaches(plan)
        self._start_attaches(plan, now)
        self._report_multi_attach(plan)
        self._report_attach_outcomes(desired, attachments)
        rest = {n: v for n, v in plan.node_status.items() if n not in detach_nodes}
        if rest:
            await asyncio.gather(
                *(self._write_node_status(n, v) for n, v in rest.items()), return_exceptions=True
            )
        live = {a.name for a in attachments}
        self.actual.forget_attach_records(live)
        self.operations.forget(live | {e.va_name for e in plan.attaches})

    def _decide(self, now: float) -> tuple[list[DesiredEntry], list[Attachment], Plan]:
        """Brings the actual state up to `now` and asks `decide` for the pass's plan."""
        if now - self._last_sync_states >= self.options.sync_states_period:
            self._last_sync_states = now
            self.actual.verify_volumes_are_attached()
        desired = self.desired.entries()
        attachments = self.attachments(now)
        self.actual.mark_new_volumes_mounted(attachments)
        nodes = self.node_infos()
        self.actual.end_finished_operations(attachments)
        self._counts = (len(desired), len(attachments))
        plan = decide(
            desired,
            attachments,
            nodes,
            attach_required=self.attach_required,
            unmount_wait_since=self.actual.detach_request_times(),
            now=now,
            max_wait_for_unmount=self.options.max_wait_for_unmount,
            detaching=self.actual.detaching(),
        )
        return desired, attachments, plan

    async def _start_detaches(self, plan: Plan) -> set[str]:
        """Starts the plan's detaches: the node's status must stop listing a volume before its VA
        goes, so a detach starts only once its node's status was written. Returns the nodes of
        the detaches: their status is written here, not with the other nodes'."""
        detaches = [d for d in plan.detaches if not self.operations.is_pending(d.attachment.name)]
        detach_nodes = {d.attachment.node for d in detaches}
        if not detaches:
            return detach_nodes
        writes = [n for n in detach_nodes if n in plan.node_status]
        results = await asyncio.gather(
            *(self._write_node_status(n, plan.node_status[n]) for n in writes), return_exceptions=True
        )
        failed = {n for n, r in zip(writes, results, strict=True) if isinstance(r, BaseException)}
        for d in detaches:
            if d.attachment.node not in failed:
                self.actual.remove_volume_from_report_as_attached(d.attachment.name)
                self.operations.run(d.attachment.name, self._detach(d))
        return detach_nodes

    def _start_attaches(self, plan: Plan, now: float) -> None:
        for entry in plan.attaches:
            if not self.operations.is_pending(entry.va_name):
                self.actual.mark_attach_started(entry, now)
                self.operations.run(entry.va_name, self._attach(entry))

    def _report_multi_attach(self, plan: Plan) -> None:
        for refusal in plan.multi_attach:
            # Once per volume and node while it stays wanted there, as kcm's desired state marks it.
            if self.desired.multi_attach_error_reported(refusal.entry):
                continue
            self.desired.set_multi_attach_error(refusal.entry)
            for pod in refusal.entry.pods:
                self.recorder.warning(
                    _pod_object(pod),
                    "FailedAttachVolume",
                    multi_attach_message(refusal.entry.volume.pv_name, pod, refusal.other_pods),
                )

    def _report_attach_outcomes(self, desired: list[DesiredEntry], attachments: list[Attachment]) -> None:
        for outcome in self.actual.take_attach_outcomes(desired, attachments):
            for pod in outcome.pods:
                if outcome.error:
                    message = ATTACH_FAILED_MESSAGE.format(pv=outcome.pv_name, error=outcome.error)
                    self.recorder.warning(_pod_object(pod), "FailedAttachVolume", message)
                else:
                    message = ATTACH_SUCCEEDED_MESSAGE.format(pv=outcome.pv_name)
                    self.recorder.normal(_pod_object(pod), "SuccessfulAttachVolume", message)

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
            self.actual.mark_attach_created(entry.va_name)
            log.info("attaching", va=entry.va_name, pv=entry.volume.pv_name, node=entry.node)
        except ApiError as exc:
            if not exc.already_exists:
                self.actual.mark_attach_failed(entry.va_name)
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
                self.actual.add_volume_to_report_as_attached(att.name)
                raise
        self.actual.mark_volume_as_detached(att.name)
        log.info("detaching", va=att.name, pv=att.pv_name, node=att.node, forced=d.forced)

    async def _write_node_status(self, node: str, names: tuple[str, ...]) -> None:
        if not self.actual.node_status_update_needed(node, names, self.clock.monotonic()):
            return
        patch = {"status": {"volumesAttached": [{"name": n, "devicePath": ""} for n in names]}}
        try:
            await self.client.patch(NODES, node, patch, subresource="status")
        except ApiError as exc:
            if exc.not_found:
                return
            raise
        self.actual.mark_node_status_updated(node, names, self.clock.monotonic())
