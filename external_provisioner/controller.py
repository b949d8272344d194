"""The provisioning controller: claims in, CreateVolume + a pre-bound PV out; Released volumes in,
DeleteVolume + PV removal out.

Two queues, each with per-key exponential backoff (--retry-interval-start → --retry-interval-max):
claims keyed by UID (an intent outlives its claim, and a re-created claim of the same name is a
different claim) and volumes keyed by name. Every sync is level-triggered: it reads the caches and
the intent journal, decides, and writes. See docs/external-provisioner.md for the crash analysis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from controller_runtime import storage
from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.csi_client import CSIConnection, error_text, is_final_error
from controller_runtime.informer import EventHandler
from controller_runtime.logs import get_logger
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import (
    CSI_NODES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    SECRETS,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    Obj,
    key_of,
    object_key,
    typed,
)
from controller_runtime.secrets import SecretNotSendable, csi_secrets
from controller_runtime.storage import claim_class, is_deleting, volume_class
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from . import decide, failpoints, names
from .decide import DataSource
from .journal import Entry, Journal
from .request import (
    CreatedVolume,
    ProvisionError,
    SecretRef,
    VolumeSpec,
    accessibility,
    build_pv,
    go_quote,
    pv_name_for,
    split_parameters,
    volume_spec,
)

log = get_logger("external-provisioner")

UID_INDEX = "uid"
VA_BY_PV_INDEX = "pv"
RPC = csi_pb2.ControllerServiceCapability.RPC


@dataclass(frozen=True)
class Options:
    driver: str
    identity: str  # storage.kubernetes.io/csiProvisionerIdentity of this instance
    prefix: str = "pvc"
    default_fs: str = ""
    extra_metadata: bool = False
    workers: int = 100
    retry_start: float = 1.0
    retry_max: float = 300.0
    resync_period: float = 900.0
    # How often snapshots no claim restores from any more lose their source protection (0: never).
    snapshot_sweep_interval: float = 300.0
    # Saving a PV is retried this often before the volume is deleted again (upstream: 5 x 10 s).
    pv_save_attempts: int = 5
    pv_save_interval: float = 10.0


def _annotation(obj: Obj, key: str) -> str:
    return str((obj.get("metadata", {}).get("annotations") or {}).get(key) or "")


def _claim_status(claim: Obj) -> str:
    """A claim's status as Go prints the struct with %v, for the one message that quotes it."""
    st = claim.get("status") or {}
    modes = " ".join(st.get("accessModes") or [])
    capacity = " ".join(f"{k}:{v}" for k, v in sorted((st.get("capacity") or {}).items()))
    return f"{{{st.get('phase', '')} [{modes}] map[{capacity}] [] map[] map[] <nil> <nil>}}"


class Provisioner(InformerController):
    def __init__(
        self, context: ControllerContext, conn: CSIConnection, journal: Journal, options: Options
    ) -> None:
        super().__init__(context)
        self.conn = conn
        self.journal = journal
        self.options = options
        self.multi_writer = conn.has_controller_capability(RPC.SINGLE_NODE_MULTI_WRITER)
        # Without PUBLISH_UNPUBLISH_VOLUME nothing attaches the driver's volumes: no
        # VolumeAttachment can hold a deletion back.
        self.check_attachments = conn.has_controller_capability(RPC.PUBLISH_UNPUBLISH_VOLUME)
        # Only a driver that clones protects clone sources (and releases their protection).
        self.protect_clones = conn.has_controller_capability(RPC.CLONE_VOLUME)
        self.restores_snapshots = conn.has_controller_capability(RPC.CREATE_DELETE_SNAPSHOT)
        self.infeasible = decide.SlowRetries(options.retry_max)
        self.topology = conn.has_plugin_capability(
            csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
        )
        self.claim_queue: WorkQueue[str] = WorkQueue(
            "claims", ItemExponentialRateLimiter(options.retry_start, options.retry_max), clock=self.clock
        )
        self.volume_queue: WorkQueue[str] = WorkQueue(
            "volumes", ItemExponentialRateLimiter(options.retry_start, options.retry_max), clock=self.clock
        )
        # Clone sources being deleted, keyed namespace/name: their protection goes once no clone
        # of them is Pending.
        self.source_queue: WorkQueue[str] = WorkQueue(
            "clone-sources",
            ItemExponentialRateLimiter(options.retry_start, options.retry_max),
            clock=self.clock,
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        self.classes = self.factory.informer(STORAGE_CLASSES)
        self.nodes = self.factory.informer(NODES)
        self.csinodes = self.factory.informer(CSI_NODES)
        self.attachments = self.factory.informer(VOLUME_ATTACHMENTS)
        self.claims.add_index(UID_INDEX, lambda c: [c["metadata"]["uid"]])
        self.attachments.add_index(
            VA_BY_PV_INDEX, lambda va: [n] if (n := va["spec"]["source"].get("persistentVolumeName")) else []
        )
        self.claims.add_handler(
            EventHandler(self._claim_changed, lambda _o, c: self._claim_changed(c), self._claim_deleted)
        )
        self.volumes.add_handler(
            EventHandler(self._volume_changed, lambda _o, v: self._volume_changed(v), None)
        )
        self.attachments.add_handler(EventHandler(None, None, self._attachment_deleted))

    # -- handlers: decide only whether a key is worth a sync ------------------------------------------

    def _ours(self, claim: Obj) -> bool:
        ann = claim.get("metadata", {}).get("annotations") or {}
        return self.options.driver in (
            ann.get(storage.ANN_STORAGE_PROVISIONER),
            ann.get(storage.ANN_BETA_STORAGE_PROVISIONER),
        )

    def _claim_changed(self, claim: Obj) -> None:
        uid = claim["metadata"]["uid"]
        if uid in self.journal.entries or (self._ours(claim) and not claim["spec"].get("volumeName")):
            self.claim_queue.add(uid)
        if (
            self.protect_clones
            and is_deleting(claim)
            and names.CLONE_FINALIZER in (claim["metadata"].get("finalizers") or [])
        ):
            self.source_queue.add(key_of(claim))

    def _claim_deleted(self, claim: Obj) -> None:
        uid = claim.get("metadata", {}).get("uid", "")
        self.infeasible.forget(uid)
        if uid in self.journal.entries:
            self.claim_queue.add(uid)

    def _volume_changed(self, pv: Obj) -> None:
        if decide.responsible_for(pv, self.options.driver):
            self.volume_queue.add(pv["metadata"]["name"])

    def _attachment_deleted(self, va: Obj) -> None:
        pv = va.get("spec", {}).get("source", {}).get("persistentVolumeName")
        if pv:
            self.volume_queue.add(pv)

    # -- lifecycle -------------------------------------------------------------------------------------

    async def run(self) -> None:
        await self.journal.lock.acquire(lambda holder: log.warning("waiting for the journal", holder=holder))
        try:
            await self._run()
        finally:
            self.journal.lock.release()

    async def _run(self) -> None:
        # Entries first, so the claim handlers fired by the initial list already see them.
        for entry in await asyncio.to_thread(self.journal.load):
            log.info(
                "found an unfinished provisioning",
                claim=object_key(entry.namespace, entry.claim),
                uid=entry.uid,
            )
        try:
            await self.start_informers()
            for uid in list(self.journal.entries):
                self.claim_queue.add(uid)
            log.info(
                "caches synced, starting workers",
                driver=self.options.driver,
                claims=len(self.claims.store),
                volumes=len(self.volumes.store),
                unfinished=len(self.journal.entries),
                workers=self.options.workers,
            )
            await asyncio.gather(
                run_workers(self.claim_queue, self.sync_claim, self.options.workers),
                run_workers(self.volume_queue, self.sync_volume, self.options.workers),
                run_workers(self.source_queue, self.sync_clone_source, self.options.workers),
                self.sweep_snapshot_protection(),
            )
        finally:
            self.claim_queue.shutdown()
            self.volume_queue.shutdown()
            self.source_queue.shutdown()
            await self.factory.stop()

    # -- claims ----------------------------------------------------------------------------------------

    def _claim_by_uid(self, uid: str) -> Obj | None:
        found = self.claims.store.by_index(UID_INDEX, uid)
        return found[0] if found else None

    async def _pv_exists(self, name: str) -> bool:
        """Asks the API when the cache says no: only a confirmed absence may lead to deleting a
        volume, and a PV we just created may not be in the cache yet."""
        if self.volumes.store.get(name) is not None:
            return True
        try:
            await self.client.get(PERSISTENT_VOLUMES, name)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def sync_claim(self, uid: str) -> float | None:
        claim = self._claim_by_uid(uid)
        entry = self.journal.get(uid)
        if (
            claim is not None
            and not is_deleting(claim)
            and self._ours(claim)
            and not claim["spec"].get("volumeName")
        ):
            await self._sync_pending_claim(claim, entry)
            return None
        if entry is None:
            return None
        if claim is None:
            # The cache may simply not have seen it yet: never clean up on the cache's word.
            try:
                live = await self.client.get(PERSISTENT_VOLUME_CLAIMS, entry.claim, entry.namespace)
            except ApiError as exc:
                if not exc.not_found:
                    raise
            else:
                if live["metadata"]["uid"] == uid and not is_deleting(live):
                    return 1.0
        await self._abandon(entry)
        return None

    async def _sync_pending_claim(self, claim: Obj, entry: Entry | None) -> None:
        pv_name = pv_name_for(self.options.prefix, claim)
        if self.volumes.store.get(pv_name) is not None:
            if entry is not None:
                await self.journal.remove(entry.uid)
            return  # provisioned; the binder completes the bind
        class_name = claim_class(claim)
        storage_class = self.classes.store.get(class_name) if class_name else None
        if storage_class is None:
            # No event, as upstream: the class may still be created; retried with backoff.
            raise RuntimeError(f'storageclass.storage.k8s.io "{class_name}" not found')
        md = claim["metadata"]
        class_uid = storage_class["metadata"].get("uid", "")
        if self.infeasible.remaining(md["uid"], class_uid, self.clock.monotonic()):
            # No event: the one that marked the claim said retries would be delayed.
            raise RuntimeError(
                f"skipping volume provisioning for pvc {md['uid']}, because provisioning previously "
                "failed with infeasible error"
            )
        selected = _annotation(claim, storage.ANN_SELECTED_NODE)
        if storage_class.get("volumeBindingMode") == "WaitForFirstConsumer" and not selected:
            return  # the scheduler picks a node first
        if storage_class.get("provisioner") != self.options.driver:
            return  # the class moved to another provisioner; not ours to act on
        obj = typed(claim, PERSISTENT_VOLUME_CLAIMS)
        self.recorder.normal(obj, names.PROVISIONING, names.msg_provisioning(md["namespace"], md["name"]))
        try:
            source = decide.data_source(claim)
            if source is not None and source.populated:
                self.recorder.normal(obj, names.PROVISIONING, names.MSG_POPULATOR)
                return  # a volume populator's claim
            problem = decide.capability_error(
                self.conn.plugin_capabilities,
                self.conn.controller_capabilities,
                source=source,
                modify=bool(claim["spec"].get("volumeAttributesClassName")),
            )
            if problem is not None:
                raise ProvisionError(problem)
            if claim["spec"].get("selector") is not None:
                raise ProvisionError("claim Selector is not supported")
            await self._provision(claim, storage_class, pv_name, entry, selected, source)
        except ProvisionError as exc:
            self.recorder.warning(obj, storage.PROVISIONING_FAILED, str(exc))
            if exc.reschedule:
                await self._reschedule(claim)
            raise

    async def _selected_node(self, name: str) -> Obj:
        node = self.nodes.store.get(name)
        if node is not None:
            return node
        try:
            node = await self.client.get(NODES, name)
        except ApiError as exc:
            if exc.not_found:
                raise ProvisionError(exc.message, reschedule=True) from exc
            raise
        return node

    async def _reschedule(self, claim: Obj) -> None:
        """Removes selected-node so the scheduler picks again (a full pool, a vanished node)."""
        md = claim["metadata"]
        log.info("asking the scheduler for another node", claim=key_of(claim))
        patch = {
            "metadata": {
                "resourceVersion": md["resourceVersion"],
                "annotations": {storage.ANN_SELECTED_NODE: None},
            }
        }
        with contextlib.suppress(ApiError):  # a conflict: the next sync sees the newer claim
            await self.client.patch(PERSISTENT_VOLUME_CLAIMS, md["name"], patch, md["namespace"])

    async def _content_source(self, claim: Obj, storage_class: Obj, source: DataSource) -> tuple[str, str]:
        """(source volume id, source snapshot id), with the sidecar's reasons for refusing one."""
        try:
            if source.clone:
                return await self._clone_source(claim, storage_class, source), ""
            return "", await self._snapshot_source(claim, storage_class, source)
        except ProvisionError as exc:
            raise ProvisionError(
                f"error getting handle for DataSource Type {source.kind} by Name {source.name}: {exc}"
            ) from exc

    async def _clone_source(self, claim: Obj, storage_class: Obj, source: DataSource) -> str:
        src = self.claims.store.get(object_key(source.namespace, source.name))
        if src is None:
            namespace = go_quote(claim["metadata"]["namespace"])
            raise ProvisionError(
                f"error getting PVC {source.name} (namespace {namespace}) from api server: "
                f'persistentvolumeclaim "{source.name}" not found'
            )
        if src.get("status", {}).get("phase") != storage.CLAIM_BOUND:
            raise ProvisionError(
                f"the PVC DataSource {source.name} must have a status of Bound.  Got {_claim_status(src)}"
            )
        if is_deleting(src):
            raise ProvisionError(f"the PVC DataSource {source.name} is currently being deleted")
        if src["spec"].get("storageClassName") is None:
            raise ProvisionError(f"the source PVC ({source.name}) storageclass cannot be empty")
        if claim["spec"].get("storageClassName") is None:
            name = claim["metadata"]["name"]
            raise ProvisionError(f"the requested PVC ({name}) storageclass cannot be empty")
        want = parse_quantity(claim["spec"]["resources"]["requests"].get("storage"))
        have = parse_quantity(((src["spec"].get("resources") or {}).get("requests") or {}).get("storage"))
        if want < have:
            raise ProvisionError(
                "error, new PVC request must be greater than or equal in size to the specified PVC data "
                f"source, requested {want} but source is {have}"
            )
        volume_name = src["spec"].get("volumeName")
        if not volume_name:
            raise ProvisionError(f"volume name is empty in source PVC {source.name}")
        try:
            pv = await self.client.get(PERSISTENT_VOLUMES, volume_name)
        except ApiError as exc:
            log.warning("cannot read the source claim's volume", volume=volume_name, error=exc.message)
            raise ProvisionError("claim in dataSource not bound or invalid") from exc
        csi, ref = pv["spec"].get("csi"), pv["spec"].get("claimRef") or {}
        smd = src["metadata"]
        if (
            csi is None
            or csi.get("driver") != storage_class.get("provisioner")
            or (ref.get("uid"), ref.get("namespace"), ref.get("name"))
            != (smd["uid"], smd["namespace"], smd["name"])
            or pv.get("status", {}).get("phase") != storage.PV_BOUND
        ):
            log.warning("the source claim's volume does not back it", volume=volume_name, claim=key_of(src))
            raise ProvisionError("claim in dataSource not bound or invalid")
        source_block = pv["spec"].get("volumeMode") == "Block"
        if claim["spec"].get("volumeMode") == "Block":
            if not source_block:
                raise ProvisionError(
                    "the source PVC and destination PVCs must have the same volume mode for cloning.  "
                    "Source is Filesystem, but new PVC requested Block"
                )
        elif pv["spec"].get("volumeMode") not in (None, "Filesystem"):
            raise ProvisionError(
                "the source PVC and destination PVCs must have the same volume mode for cloning.  "
                "Source is Block, but new PVC requested Filesystem"
            )
        return str(csi["volumeHandle"])

    async def _snapshot_source(self, claim: Obj, storage_class: Obj, source: DataSource) -> str:
        name = source.name
        try:
            snap = await self.client.get(VOLUME_SNAPSHOTS, name, source.namespace)
        except ApiError as exc:
            raise ProvisionError(f"error getting snapshot {name} from api server: {exc.message}") from exc
        if is_deleting(snap) and names.SNAPSHOT_FINALIZER not in (snap["metadata"].get("finalizers") or []):
            raise ProvisionError(f"snapshot {name} is being deleted")
        status = snap.get("status") or {}
        content_name = status.get("boundVolumeSnapshotContentName")
        if not content_name:
            raise ProvisionError(f"snapshot {name} not bound")
        try:
            content = await self.client.get(VOLUME_SNAPSHOT_CONTENTS, content_name)
        except ApiError as exc:
            raise ProvisionError(f"error getting snapshotcontent {content_name} for snapshot {name}") from exc
        ref, smd = content.get("spec", {}).get("volumeSnapshotRef") or {}, snap["metadata"]
        if (ref.get("uid"), ref.get("namespace"), ref.get("name")) != (
            smd["uid"],
            smd["namespace"],
            smd["name"],
        ):
            raise ProvisionError(
                f"snapshotcontent {content_name} for snapshot {name} is bound to a different snapshot"
            )
        if content.get("spec", {}).get("driver") != storage_class.get("provisioner"):
            raise ProvisionError(
                f"snapshotcontent {content_name} for snapshot {name} is not handled by CSI driver of "
                f"StorageClass {storage_class['metadata']['name']}"
            )
        if not status.get("readyToUse"):
            raise ProvisionError(f"snapshot {name} is not Ready")
        handle = (content.get("status") or {}).get("snapshotHandle")
        if not handle:
            raise ProvisionError(f"snapshot handle {name} is not available")
        if status.get("restoreSize") is not None:
            want = parse_quantity(claim["spec"]["resources"]["requests"].get("storage"))
            have = parse_quantity(status["restoreSize"])
            if want < have:
                raise ProvisionError(
                    f"requested volume size {want} is less than the size {have} "
                    f"for the source snapshot {name}"
                )
        return str(handle)

    async def _protect_clone_source(self, source: DataSource) -> None:
        """Puts the cloning-protection finalizer on the source claim before the first CreateVolume
        that copies it, so the source cannot vanish while the driver copies; sync_clone_source
        takes it off once the source is being deleted and no clone of it is Pending."""
        src = self.claims.store.get(object_key(source.namespace, source.name))
        if src is None:
            raise ProvisionError(f'persistentvolumeclaim "{source.name}" not found')
        md = src["metadata"]
        finalizers = list(md.get("finalizers") or [])
        if names.CLONE_FINALIZER in finalizers:
            return
        finalizers.append(names.CLONE_FINALIZER)
        patch = {"metadata": {"resourceVersion": md["resourceVersion"], "finalizers": finalizers}}
        try:
            saved = await self.client.patch(PERSISTENT_VOLUME_CLAIMS, md["name"], patch, md["namespace"])
        except ApiError as exc:
            raise ProvisionError(exc.message) from exc
        self.claims.store.upsert(saved)  # a second clone of it in this round must not patch again

    async def _protect_snapshot(self, source: DataSource) -> None:
        """Puts the source-protection finalizer on the VolumeSnapshot a claim restores from, so it
        stays while the restore runs. Without the RBAC to update snapshots, provisioning goes on
        unprotected, as upstream (the permission is optional there)."""
        try:
            snap = await self.client.get(VOLUME_SNAPSHOTS, source.name, source.namespace)
            finalizers = list(snap["metadata"].get("finalizers") or [])
            if names.SNAPSHOT_FINALIZER in finalizers:
                return
            finalizers.append(names.SNAPSHOT_FINALIZER)
            patch = {
                "metadata": {"resourceVersion": snap["metadata"]["resourceVersion"], "finalizers": finalizers}
            }
            await self.client.patch(VOLUME_SNAPSHOTS, source.name, patch, source.namespace)
        except ApiError as exc:
            if exc.forbidden:
                log.info(
                    "no permission to protect the snapshot source", snapshot=source.name, error=exc.message
                )
                return
            raise ProvisionError(exc.message) from exc

    async def _release_snapshot(self, namespace: str, name: str, snap: Obj | None = None) -> None:
        """Takes the source protection off a snapshot. Failures are only logged: the sweep (or the
        next restore from it) finishes the job."""
        try:
            if snap is None:
                snap = await self.client.get(VOLUME_SNAPSHOTS, name, namespace)
            finalizers = list(snap["metadata"].get("finalizers") or [])
            if names.SNAPSHOT_FINALIZER not in finalizers:
                return
            rest = [f for f in finalizers if f != names.SNAPSHOT_FINALIZER]
            patch = {
                "metadata": {
                    "resourceVersion": snap["metadata"]["resourceVersion"],
                    "finalizers": rest or None,
                }
            }
            await self.client.patch(VOLUME_SNAPSHOTS, name, patch, namespace)
        except ApiError as exc:
            if not (exc.not_found or exc.forbidden):
                log.warning(
                    "could not release the snapshot source", snapshot=f"{namespace}/{name}", error=exc.message
                )
            return
        log.info("released the snapshot source", snapshot=f"{namespace}/{name}")

    async def sweep_snapshot_protection(self) -> None:
        """Every --snapshot-orphan-sweep-interval: the source protection leaves every snapshot
        that no unbound claim restores from (a restore that failed for good, a claim deleted
        mid-way, a crash between the PV and the release). Off without CREATE_DELETE_SNAPSHOT,
        without the snapshot API, or without the RBAC to list snapshots."""
        interval = self.options.snapshot_sweep_interval
        if interval <= 0 or not self.restores_snapshots:
            return
        try:
            await self.client.list_page(VOLUME_SNAPSHOTS, limit=1)
        except ApiError as exc:
            if exc.forbidden or exc.not_found:
                log.info("snapshot source sweep off", reason=exc.message)
                return
        while True:
            try:
                await self._sweep_snapshots()
            except Exception as exc:  # a failed round must not stop provisioning; the next one retries
                log.warning("snapshot source sweep failed", error=str(exc) or type(exc).__name__)
            await self.clock.sleep(interval)

    async def _sweep_snapshots(self) -> None:
        snapshots, _ = await self.client.list_all(VOLUME_SNAPSHOTS)
        pending = decide.pending_restores(self.claims.store.values())
        for snap in snapshots:
            md = snap["metadata"]
            if names.SNAPSHOT_FINALIZER in (md.get("finalizers") or []) and key_of(snap) not in pending:
                await self._release_snapshot(md["namespace"], md["name"], snap)

    def _new_spec(
        self, claim: Obj, storage_class: Obj, pv_name: str, node: Obj | None, content: tuple[str, str]
    ) -> VolumeSpec:
        topology = None
        if self.topology:
            topology = accessibility(
                self.options.driver,
                storage_class,
                pv_name,
                node,
                self.csinodes.store.values(),
                {n["metadata"]["name"]: n for n in self.nodes.store.values()},
            )
        params = split_parameters(
            storage_class.get("parameters") or {}, claim, pv_name, self.options.default_fs
        )
        return volume_spec(
            claim,
            storage_class,
            params,
            pv_name,
            extra_metadata=self.options.extra_metadata,
            multi_writer=self.multi_writer,
            topology=topology,
            source_volume=content[0],
            source_snapshot=content[1],
        )

    async def _secrets(self, ref: SecretRef | None, required: bool = True) -> dict[str, str]:
        """The Secret's data for a CSI request. One that cannot be read stops only a provisioning
        (`required`: DeleteVolume goes without it, as upstream); one that can be read but not sent
        (data that is not UTF-8) stops either, with the error the Go sidecar's request fails with."""
        if ref is None:
            return {}
        try:
            secret = await self.client.get(SECRETS, ref.name, ref.namespace)
        except ApiError as exc:
            message = f"error getting secret {ref.name} in namespace {ref.namespace}: {exc.message}"
            if not required:
                log.warning("deleting without the provisioner secret", error=message)
                return {}
            raise ProvisionError(message) from exc
        try:
            return csi_secrets(secret)
        except SecretNotSendable as exc:
            raise ProvisionError(str(exc)) from exc

    async def _create_volume(self, spec: VolumeSpec, secrets: dict[str, str]) -> CreatedVolume:
        try:
            rsp = await self.conn.controller.CreateVolume(spec.to_request(secrets), timeout=self.conn.timeout)
        except grpc.aio.AioRpcError as exc:
            raise ProvisionError(error_text(exc), final=is_final_error(exc)) from exc
        return CreatedVolume.from_proto(rsp.volume)

    async def _provision(
        self,
        claim: Obj,
        storage_class: Obj,
        pv_name: str,
        entry: Entry | None,
        selected: str,
        source: DataSource | None,
    ) -> None:
        md = claim["metadata"]
        secrets: dict[str, str] | None = None
        if entry is None:
            # The sidecar's order: the source, its protection, the node's topology, then the
            # parameters and secrets; the first failure is the event.
            content = ("", "")
            if source is not None:
                content = await self._content_source(claim, storage_class, source)
                if source.clone:
                    await self._protect_clone_source(source)
                else:
                    await self._protect_snapshot(source)
            node = await self._selected_node(selected) if selected else None
            spec = self._new_spec(claim, storage_class, pv_name, node, content)
            secrets = await self._secrets(spec.secret)
            entry = Entry(md["uid"], md["namespace"], md["name"], claim_class(claim), spec)
            await self.journal.put(entry)
        # A repeat sends the journalled request unchanged: CreateVolume is idempotent only for an
        # identical request, and the first one may still be running in the driver.
        spec = entry.spec
        params = split_parameters(
            storage_class.get("parameters") or {}, claim, pv_name, self.options.default_fs
        )
        if secrets is None:
            secrets = await self._secrets(spec.secret)
        failpoints.reach(failpoints.BEFORE_CREATE_VOLUME)
        try:
            created = await self._create_volume(spec, secrets)
        except ProvisionError as exc:
            code = getattr(exc.__cause__, "code", lambda: None)()
            if exc.final and code != grpc.StatusCode.ALREADY_EXISTS:
                await self.journal.remove(entry.uid)  # a final error: nothing was created
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                # The same request cannot succeed: slow retries, as upstream.
                class_uid = storage_class["metadata"].get("uid", "")
                self.infeasible.mark(md["uid"], class_uid, self.clock.monotonic())
                raise ProvisionError(
                    f"Volume provisioning failed with infeasible error. Retries will be delayed. {exc}"
                ) from exc
            # Another node may have room: only meaningful when the request named a node's topology.
            exc.reschedule = code == grpc.StatusCode.RESOURCE_EXHAUSTED and bool(selected) and self.topology
            raise
        # Kept in memory for now: written to the entry only if saving the PV has to be retried
        # (see _save_pv). Losing it costs a crash's clean-up one repeated CreateVolume, while
        # writing it for every claim put a file write on every provisioning's path.
        entry.volume_id = created.volume_id
        failpoints.reach(failpoints.AFTER_CREATE_VOLUME)
        pv = build_pv(
            driver=self.options.driver,
            identity=self.options.identity,
            claim=claim,
            storage_class=storage_class,
            spec=spec,
            params=params,
            created=created,
        )
        await self._save_pv(pv, claim, entry, secrets)
        failpoints.reach(failpoints.AFTER_PV_SAVED)
        await self.journal.remove(entry.uid)
        log.info("provisioned", claim=key_of(claim), volume=pv_name, handle=created.volume_id)
        restored = claim["spec"].get("dataSource") or {}
        if restored.get("kind") == decide.SNAPSHOT_KIND:
            await self._release_snapshot(md["namespace"], restored.get("name", ""))
        self.recorder.normal(
            typed(claim, PERSISTENT_VOLUME_CLAIMS), names.PROVISIONING_SUCCEEDED, names.msg_succeeded(pv_name)
        )

    async def _save_pv(self, pv: Obj, claim: Obj, entry: Entry, secrets: Mapping[str, str]) -> None:
        name = pv["metadata"]["name"]
        error = ""
        for attempt in range(self.options.pv_save_attempts):
            if attempt == 1:
                # Retries take a while: a crash meanwhile finds the volume id in the journal.
                await self.journal.put(entry, durable=False)
            if attempt:
                await self.clock.sleep(self.options.pv_save_interval)
            try:
                saved = await self.client.create(PERSISTENT_VOLUMES, pv)
            except ApiError as exc:
                if exc.already_exists:
                    existing = await self.client.get(PERSISTENT_VOLUMES, name)
                    ref = existing["spec"].get("claimRef") or {}
                    if ref.get("uid") == claim["metadata"]["uid"]:
                        return  # saved by an earlier attempt whose answer was lost
                    error = f"a PersistentVolume {name} of another claim exists"
                    break
                error = exc.message
                log.warning("saving the PV failed, retrying", volume=name, attempt=attempt + 1, error=error)
                continue
            self.volumes.store.upsert(saved)  # the next sync must not provision twice
            return
        # The PV cannot be saved: give the volume back rather than leave it behind.
        log.error("could not save the PV, deleting the volume", volume=name, error=error)
        try:
            await self._delete_volume(entry.volume_id, secrets)
        except ProvisionError as exc:
            self.recorder.warning(
                typed(claim, PERSISTENT_VOLUME_CLAIMS),
                names.PROVISIONING_CLEANUP_FAILED,
                f"Failed to clean up volume {name} after failing to save its PersistentVolume: {exc}",
            )
            raise ProvisionError(f"failed to save PersistentVolume {name}: {error}") from exc
        await self.journal.remove(entry.uid)
        raise ProvisionError(f"failed to save PersistentVolume {name}: {error}; the volume was deleted")

    async def _delete_volume(self, volume_id: str, secrets: Mapping[str, str]) -> None:
        try:
            request = csi_pb2.DeleteVolumeRequest(volume_id=volume_id, secrets=dict(secrets))
            await self.conn.controller.DeleteVolume(request, timeout=self.conn.timeout)
        except grpc.aio.AioRpcError as exc:
            raise ProvisionError(error_text(exc), final=is_final_error(exc)) from exc

    async def _abandon(self, entry: Entry) -> None:
        """The claim is gone while a volume may exist for it: finish the CreateVolume (the same
        request) to learn the volume's id, then delete the volume. A saved PV takes over instead."""
        where = object_key(entry.namespace, entry.claim)
        if await self._pv_exists(entry.spec.name):
            await self.journal.remove(entry.uid)
            return
        volume_id = entry.volume_id
        secrets = await self._secrets(entry.spec.secret, required=False)
        if not volume_id:
            try:
                volume_id = (await self._create_volume(entry.spec, secrets)).volume_id
            except ProvisionError as exc:
                code = getattr(exc.__cause__, "code", lambda: None)()
                if exc.final and code != grpc.StatusCode.ALREADY_EXISTS:
                    log.info("claim gone and no volume was created for it", claim=where, error=str(exc))
                    await self.journal.remove(entry.uid)
                    return
                raise
        await self._delete_volume(volume_id, secrets)
        log.info("claim deleted while provisioning; deleted its volume", claim=where, handle=volume_id)
        await self.journal.remove(entry.uid)

    # -- volumes ---------------------------------------------------------------------------------------

    async def sync_volume(self, name: str) -> float | None:
        pv = self.volumes.store.get(name)
        if pv is None or not decide.responsible_for(pv, self.options.driver):
            return None
        finalizers = decide.finalizers_after(pv)
        if finalizers is not None:
            pv = await self._patch_finalizer(name, keep=names.PV_FINALIZER in finalizers)
            if pv is None:
                return None
        if not decide.should_delete(pv):
            return None
        try:
            await self._delete_backing_volume(pv)
        except ProvisionError as exc:
            self.recorder.warning(typed(pv, PERSISTENT_VOLUMES), storage.VOLUME_FAILED_DELETE, str(exc))
            raise
        md = pv["metadata"]
        if not is_deleting(pv):
            try:
                pv = await self.client.delete(PERSISTENT_VOLUMES, name, uid=md["uid"])
            except ApiError as exc:
                if exc.not_found:
                    return None
                raise
        if names.PV_FINALIZER in (pv.get("metadata", {}).get("finalizers") or []):
            await self._patch_finalizer(name, keep=False)
        log.info("deleted volume", volume=name, handle=pv["spec"]["csi"]["volumeHandle"])
        return None

    async def _delete_backing_volume(self, pv: Obj) -> None:
        """DeleteVolume for a Released PV, in the sidecar's order: the driver must be able to,
        the provisioner secret is looked up (a missing Secret is no reason to keep the volume:
        DeleteVolume goes without it), and no VolumeAttachment may still name the PV."""
        name, csi = pv["metadata"]["name"], pv["spec"].get("csi")
        if csi is None:
            raise ProvisionError("invalid CSI PV")
        problem = decide.capability_error(
            self.conn.plugin_capabilities, self.conn.controller_capabilities, source=None, modify=False
        )
        if problem is not None:
            raise ProvisionError(problem)
        class_name = volume_class(pv)
        ref = decide.deletion_secret(pv, self.classes.store.get(class_name) if class_name else None)
        secrets = await self._secrets(ref, required=False)
        if self.check_attachments:
            for va in self.attachments.store.by_index(VA_BY_PV_INDEX, name):
                raise ProvisionError(names.msg_still_attached(name, va["spec"].get("nodeName", "")))
        await self._delete_volume(csi["volumeHandle"], secrets)

    async def _patch_finalizer(self, name: str, *, keep: bool) -> Obj | None:
        """Adds or removes our finalizer on the PV (None when the PV is gone). A strategic merge
        patch of that one entry, without a resourceVersion, as the Go sidecar sends: the binder
        and the protection controller write the PV at the same moments, and a precondition would
        only turn their writes into conflicts and whole re-syncs (each one more API request
        against the same rate limit as this sidecar's events)."""
        if keep:
            patch: Obj = {"metadata": {"finalizers": [names.PV_FINALIZER]}}
        else:
            patch = {"metadata": {"$deleteFromPrimitiveList/finalizers": [names.PV_FINALIZER]}}
        try:
            return await self.client.patch(PERSISTENT_VOLUMES, name, patch, patch_type="strategic")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    # -- clone sources ---------------------------------------------------------------------------------

    async def sync_clone_source(self, key: str) -> float | None:
        """A claim with the cloning-protection finalizer is being deleted: the finalizer goes once
        no claim is Pending with it as its source (a retry with backoff until then). Level-
        triggered from the cache, so a restart anywhere converges: the initial list re-queues every
        deleting source."""
        src = self.claims.store.get(key)
        if src is None or names.CLONE_FINALIZER not in (src["metadata"].get("finalizers") or []):
            return None
        pending = decide.pending_clones(src, self.claims.store.values())
        if pending:
            raise RuntimeError(f"PVC '{pending[0]}' is in 'Pending' state, cloning in progress")
        md = src["metadata"]
        rest = [f for f in md.get("finalizers") or [] if f != names.CLONE_FINALIZER]
        patch = {"metadata": {"resourceVersion": md["resourceVersion"], "finalizers": rest or None}}
        try:
            await self.client.patch(PERSISTENT_VOLUME_CLAIMS, md["name"], patch, md["namespace"])
        except ApiError as exc:
            if not exc.not_found:
                raise
        log.info("removed the cloning protection", claim=key)
        return None
