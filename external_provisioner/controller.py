"""The provisioning controller: claims in, CreateVolume + a pre-bound PV out; Released volumes in,
DeleteVolume + PV removal out.

Two queues, each with per-key exponential backoff (--retry-interval-start → --retry-interval-max):
claims keyed by UID (an intent outlives its claim, and a re-created claim of the same name is a
different claim) and volumes keyed by name. Every sync is level-triggered: it reads the caches and
the intent journal, decides, and writes. See docs/external-provisioner.md for the crash analysis.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
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
from controller_runtime.storage import claim_class, is_deleting
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from . import failpoints, names
from .journal import Entry, Journal
from .request import (
    CreatedVolume,
    ProvisionError,
    VolumeSpec,
    accessibility,
    build_pv,
    pv_name_for,
    split_parameters,
    volume_spec,
)

log = get_logger("external-provisioner")

UID_INDEX = "uid"
VA_BY_PV_INDEX = "pv"
CLONE_KIND = "PersistentVolumeClaim"
SNAPSHOT_KIND = "VolumeSnapshot"


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
    # Saving a PV is retried this often before the volume is deleted again (upstream: 5 x 10 s).
    pv_save_attempts: int = 5
    pv_save_interval: float = 10.0


def _annotation(obj: Obj, key: str) -> str:
    return str((obj.get("metadata", {}).get("annotations") or {}).get(key) or "")


def _data_source(claim: Obj) -> Obj | None:
    spec = claim.get("spec", {})
    return spec.get("dataSourceRef") or spec.get("dataSource") or None


class Provisioner(InformerController):
    def __init__(
        self, context: ControllerContext, conn: CSIConnection, journal: Journal, options: Options
    ) -> None:
        super().__init__(context)
        self.conn = conn
        self.journal = journal
        self.options = options
        self.multi_writer = conn.has_controller_capability(
            csi_pb2.ControllerServiceCapability.RPC.SINGLE_NODE_MULTI_WRITER
        )
        self.topology = conn.has_plugin_capability(
            csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
        )
        self.claim_queue: WorkQueue[str] = WorkQueue(
            "claims", ItemExponentialRateLimiter(options.retry_start, options.retry_max)
        )
        self.volume_queue: WorkQueue[str] = WorkQueue(
            "volumes", ItemExponentialRateLimiter(options.retry_start, options.retry_max)
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

    def _claim_deleted(self, claim: Obj) -> None:
        uid = claim.get("metadata", {}).get("uid", "")
        if uid in self.journal.entries:
            self.claim_queue.add(uid)

    def _volume_changed(self, pv: Obj) -> None:
        if self._provisioned_here(pv) and (
            pv.get("status", {}).get("phase") == storage.PV_RELEASED
            or is_deleting(pv)
            or names.PV_FINALIZER in (pv["metadata"].get("finalizers") or [])
        ):
            self.volume_queue.add(pv["metadata"]["name"])

    def _attachment_deleted(self, va: Obj) -> None:
        pv = va.get("spec", {}).get("source", {}).get("persistentVolumeName")
        if pv:
            self.volume_queue.add(pv)

    def _provisioned_here(self, pv: Obj) -> bool:
        driver = self.options.driver
        ann = pv.get("metadata", {}).get("annotations") or {}
        return (
            ann.get(storage.ANN_PROVISIONED_BY) == driver or ann.get(storage.ANN_MIGRATED_TO) == driver
        ) and pv.get("spec", {}).get("csi", {}).get("driver") == driver

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
            )
        finally:
            self.claim_queue.shutdown()
            self.volume_queue.shutdown()
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
        try:
            if storage_class is None:
                raise ProvisionError(f'storageclass.storage.k8s.io "{class_name}" not found')
            if storage_class.get("provisioner") != self.options.driver:
                return  # the class moved to another provisioner; not ours to act on
            selected = _annotation(claim, storage.ANN_SELECTED_NODE)
            if storage_class.get("volumeBindingMode") == "WaitForFirstConsumer" and not selected:
                return  # the scheduler picks a node first
            source = _data_source(claim)
            if source is not None and source.get("kind") not in (CLONE_KIND, SNAPSHOT_KIND):
                return  # a volume populator's claim
            node = await self._selected_node(claim, selected) if selected else None
            await self._provision(claim, storage_class, pv_name, entry, node)
        except ProvisionError as exc:
            self.recorder.warning(
                typed(claim, PERSISTENT_VOLUME_CLAIMS),
                storage.PROVISIONING_FAILED,
                names.msg_failed(class_name, str(exc)),
            )
            if exc.reschedule:
                await self._reschedule(claim)
            raise

    async def _selected_node(self, claim: Obj, name: str) -> Obj:
        node = self.nodes.store.get(name)
        if node is not None:
            return node
        try:
            node = await self.client.get(NODES, name)
        except ApiError as exc:
            if exc.not_found:
                raise ProvisionError(
                    f'failed to get target node: nodes "{name}" not found', reschedule=True
                ) from exc
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

    async def _source(self, claim: Obj, storage_class: Obj) -> tuple[str, str]:
        """(source volume id, source snapshot id) from the claim's data source."""
        source = _data_source(claim)
        if source is None:
            return "", ""
        ns, name = claim["metadata"]["namespace"], source.get("name", "")
        key = object_key(ns, name)
        if source.get("kind") == CLONE_KIND:
            src = self.claims.store.get(key)
            if src is None or not src["spec"].get("volumeName"):
                raise ProvisionError(f"the source claim {key} does not exist or is not bound")
            if claim_class(src) != claim_class(claim):
                raise ProvisionError(f"the source claim {key} is of another StorageClass")
            pv = self.volumes.store.get(src["spec"]["volumeName"])
            if pv is None or pv["spec"].get("csi", {}).get("driver") != self.options.driver:
                raise ProvisionError(f"the volume of source claim {key} is not one of {self.options.driver}")
            want = parse_quantity(claim["spec"]["resources"]["requests"].get("storage"))
            have = parse_quantity((src.get("status", {}).get("capacity") or {}).get("storage"))
            if want < have:
                raise ProvisionError(f"the requested size {want} is smaller than the source claim's {have}")
            return pv["spec"]["csi"]["volumeHandle"], ""
        try:
            snap = await self.client.get(VOLUME_SNAPSHOTS, name, ns)
            content_name = snap.get("status", {}).get("boundVolumeSnapshotContentName") or ""
            if not snap.get("status", {}).get("readyToUse") or not content_name:
                raise ProvisionError(f"snapshot {key} is not ready to use")
            content = await self.client.get(VOLUME_SNAPSHOT_CONTENTS, content_name)
        except ApiError as exc:
            raise ProvisionError(f"error getting snapshot {key}: {exc.message}") from exc
        handle = content.get("status", {}).get("snapshotHandle") or ""
        if not handle or content.get("spec", {}).get("driver") != self.options.driver:
            raise ProvisionError(f"snapshot {key} has no handle of driver {self.options.driver}")
        return "", handle

    def _new_spec(self, claim: Obj, storage_class: Obj, pv_name: str, node: Obj | None) -> VolumeSpec:
        params = split_parameters(
            storage_class.get("parameters") or {}, claim, pv_name, self.options.default_fs
        )
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
        return volume_spec(
            claim,
            storage_class,
            params,
            pv_name,
            extra_metadata=self.options.extra_metadata,
            multi_writer=self.multi_writer,
            topology=topology,
        )

    async def _secrets(self, spec: VolumeSpec, required: bool = True) -> dict[str, str]:
        if spec.secret is None:
            return {}
        try:
            secret = await self.client.get(SECRETS, spec.secret.name, spec.secret.namespace)
        except ApiError as exc:
            if not required:
                return {}
            raise ProvisionError(
                f"failed to get secret {object_key(spec.secret.namespace, spec.secret.name)}: {exc.message}"
            ) from exc
        return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}

    async def _create_volume(self, spec: VolumeSpec, secrets: dict[str, str]) -> CreatedVolume:
        try:
            rsp = await self.conn.controller.CreateVolume(spec.to_request(secrets), timeout=self.conn.timeout)
        except grpc.aio.AioRpcError as exc:
            raise ProvisionError(error_text(exc), final=is_final_error(exc)) from exc
        return CreatedVolume.from_proto(rsp.volume)

    async def _provision(
        self, claim: Obj, storage_class: Obj, pv_name: str, entry: Entry | None, node: Obj | None
    ) -> None:
        md = claim["metadata"]
        if entry is None:
            spec = self._new_spec(claim, storage_class, pv_name, node)
            spec.source_volume, spec.source_snapshot = await self._source(claim, storage_class)
            entry = Entry(md["uid"], md["namespace"], md["name"], claim_class(claim), spec)
            await self.journal.put(entry)
        # A repeat sends the journalled request unchanged: CreateVolume is idempotent only for an
        # identical request, and the first one may still be running in the driver.
        spec = entry.spec
        params = split_parameters(
            storage_class.get("parameters") or {}, claim, pv_name, self.options.default_fs
        )
        self.recorder.normal(
            typed(claim, PERSISTENT_VOLUME_CLAIMS),
            names.PROVISIONING,
            names.msg_provisioning(md["namespace"], md["name"]),
        )
        failpoints.reach(failpoints.BEFORE_CREATE_VOLUME)
        try:
            created = await self._create_volume(spec, await self._secrets(spec))
        except ProvisionError as exc:
            code = getattr(exc.__cause__, "code", lambda: None)()
            if exc.final and code != grpc.StatusCode.ALREADY_EXISTS:
                await self.journal.remove(entry.uid)  # a final error: nothing was created
            exc.reschedule = code == grpc.StatusCode.RESOURCE_EXHAUSTED and node is not None
            raise
        if entry.volume_id != created.volume_id:
            entry.volume_id = created.volume_id
            await self.journal.put(entry, durable=False)
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
        await self._save_pv(pv, claim, entry)
        failpoints.reach(failpoints.AFTER_PV_SAVED)
        await self.journal.remove(entry.uid)
        log.info("provisioned", claim=key_of(claim), volume=pv_name, handle=created.volume_id)
        self.recorder.normal(
            typed(claim, PERSISTENT_VOLUME_CLAIMS), names.PROVISIONING_SUCCEEDED, names.msg_succeeded(pv_name)
        )

    async def _save_pv(self, pv: Obj, claim: Obj, entry: Entry) -> None:
        name = pv["metadata"]["name"]
        error = ""
        for attempt in range(self.options.pv_save_attempts):
            if attempt:
                await asyncio.sleep(self.options.pv_save_interval)
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
            await self._delete_volume(entry.volume_id)
        except ProvisionError as exc:
            self.recorder.warning(
                typed(claim, PERSISTENT_VOLUME_CLAIMS),
                names.PROVISIONING_CLEANUP_FAILED,
                f"Failed to clean up volume {name} after failing to save its PersistentVolume: {exc}",
            )
            raise ProvisionError(f"failed to save PersistentVolume {name}: {error}") from exc
        await self.journal.remove(entry.uid)
        raise ProvisionError(f"failed to save PersistentVolume {name}: {error}; the volume was deleted")

    async def _delete_volume(self, volume_id: str) -> None:
        try:
            await self.conn.controller.DeleteVolume(
                csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=self.conn.timeout
            )
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
        if not volume_id:
            try:
                volume_id = (
                    await self._create_volume(entry.spec, await self._secrets(entry.spec, False))
                ).volume_id
            except ProvisionError as exc:
                code = getattr(exc.__cause__, "code", lambda: None)()
                if exc.final and code != grpc.StatusCode.ALREADY_EXISTS:
                    log.info("claim gone and no volume was created for it", claim=where, error=str(exc))
                    await self.journal.remove(entry.uid)
                    return
                raise
        await self._delete_volume(volume_id)
        log.info("claim deleted while provisioning; deleted its volume", claim=where, handle=volume_id)
        await self.journal.remove(entry.uid)

    # -- volumes ---------------------------------------------------------------------------------------

    async def sync_volume(self, name: str) -> float | None:
        pv = self.volumes.store.get(name)
        if pv is None or not self._provisioned_here(pv):
            return None
        spec, md = pv["spec"], pv["metadata"]
        finalizers = md.get("finalizers") or []
        policy = spec.get("persistentVolumeReclaimPolicy")
        phase = pv.get("status", {}).get("phase")
        if policy != storage.DELETE:
            if names.PV_FINALIZER in finalizers:
                await self._drop_finalizer(pv)  # Retain: the volume outlives the PV by design
            return None
        # Bound volumes wait: pv-protection keeps a deleted Bound PV until its claim lets go.
        if phase != storage.PV_RELEASED and not (is_deleting(pv) and phase != storage.PV_BOUND):
            return None
        for va in self.attachments.store.by_index(VA_BY_PV_INDEX, name):
            message = names.msg_still_attached(name, va["spec"].get("nodeName", ""))
            self.recorder.warning(typed(pv, PERSISTENT_VOLUMES), storage.VOLUME_FAILED_DELETE, message)
            raise RuntimeError(message)
        try:
            await self._delete_volume(spec["csi"]["volumeHandle"])
        except ProvisionError as exc:
            self.recorder.warning(typed(pv, PERSISTENT_VOLUMES), storage.VOLUME_FAILED_DELETE, str(exc))
            raise
        if not is_deleting(pv):
            try:
                pv = await self.client.delete(PERSISTENT_VOLUMES, name, uid=md["uid"])
            except ApiError as exc:
                if exc.not_found:
                    return None
                raise
        if names.PV_FINALIZER in (pv.get("metadata", {}).get("finalizers") or []):
            await self._drop_finalizer(pv)
        log.info("deleted volume", volume=name, handle=spec["csi"]["volumeHandle"])
        return None

    async def _drop_finalizer(self, pv: Obj) -> None:
        md = pv["metadata"]
        rest = [f for f in md.get("finalizers") or [] if f != names.PV_FINALIZER]
        patch = {"metadata": {"resourceVersion": md["resourceVersion"], "finalizers": rest or None}}
        try:
            await self.client.patch(PERSISTENT_VOLUMES, md["name"], patch)
        except ApiError as exc:
            if not exc.not_found:
                raise
