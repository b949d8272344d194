"""The provisioning controller (the claim half of sig-storage-lib-external-provisioner's provision
controller, with external-provisioner's Provision): claims in, CreateVolume and a pre-bound PV out.

One queue of claims keyed by UID (an intent outlives its claim, and a re-created claim of the same
name is a different claim), per-key exponential backoff (--retry-interval-start →
--retry-interval-max). Every sync is level-triggered: it reads the caches and the intent journal,
decides, and writes. See docs/external-provisioner.md for the crash analysis.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable, Mapping

import grpc

from controller_runtime import storage
from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController
from controller_runtime.csi_errors import OperationState
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.kinds import (
    CSINode,
    Node,
    PersistentVolumeClaim,
    StorageClass,
    as_obj,
    csi_node_view,
    node_view,
    pv_view,
    pvc_view,
    storage_class_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import (
    CSI_NODES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    VOLUME_ATTRIBUTES_CLASSES,
    Obj,
    key_of,
    object_key,
    typed,
)
from controller_runtime.storage import claim_class, is_deleting
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from . import decide, failpoints, names
from .claims import update_claim_metadata
from .clone_protection import CloneProtectionController
from .content_source import Content, ContentSources
from .decide import DataSource
from .journal import Entry, Journal
from .node_deployment import OwnerElection, Ownership, RequestShape
from .options import Options
from .request import (
    CreatedVolume,
    ProvisionError,
    Topology,
    VolumeSpec,
    accessibility,
    build_pv,
    pv_name_for,
    split_parameters,
    volume_spec,
)
from .snapshot_protection import SnapshotProtectionController
from .volume_calls import VolumeCalls

log = get_logger("external-provisioner")

UID_INDEX = "uid"
GC_YOUNG_THRESHOLD = 10_000  # allocations between two collections of the youngest generation (run)
RPC = csi_pb2.ControllerServiceCapability.RPC


class StorageClassNotFound(Exception):
    """The claim's class is not in the cache: retried with backoff and no event, as upstream (the
    class may still be created)."""


class DelayRetryError(Exception):
    """The claim's last CreateVolume was refused as infeasible less than --retry-interval-max ago:
    not tried, and no event (the one that marked the claim said retries would be delayed)."""


def _annotation(claim: PersistentVolumeClaim, key: str) -> str:
    return str((claim.get("metadata", {}).get("annotations") or {}).get(key) or "")


class ProvisioningController(SidecarController):
    def __init__(
        self,
        context: ControllerContext,
        csi: CSIConnection,
        journal: Journal,
        options: Options,
        clones: CloneProtectionController,
        snapshots: SnapshotProtectionController,
        volume_created: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(context, csi)
        self.volume_created = volume_created  # the capacity publisher's refresh, in node deployment
        self.journal = journal
        self.options = options
        self.clones = clones
        self.snapshots = snapshots
        self.calls = VolumeCalls(self.client, csi)
        self.multi_writer = csi.has_controller_capability(RPC.SINGLE_NODE_MULTI_WRITER)
        self.topology = csi.has_plugin_capability(
            csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
        )
        self.infeasible = decide.SlowRetries(options.retry_max)
        self.queue: WorkQueue[str] = WorkQueue(
            "claims", ItemExponentialRateLimiter(options.retry_start, options.retry_max), clock=self.clock
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        self.classes = self.factory.informer(STORAGE_CLASSES)
        self.node = options.node_deployment
        self.election: OwnerElection | None = None
        if self.node is None:
            self.nodes: SharedInformer | None = self.factory.informer(NODES)
            self.csinodes: SharedInformer | None = self.factory.informer(CSI_NODES)
        else:
            # In node deployment the topology is this node's alone, from NodeGetInfo: no provisioner
            # on every node watches every Node (upstream's fixed local objects).
            self.nodes = self.csinodes = None
            self.local_csinode, self.local_node = self.node.local_objects(self.driver)
            self.election = OwnerElection(
                self.node,
                self.client,
                csi,
                self.claims.store,
                self.clock,
                RequestShape(options.default_fs, self.multi_writer),
            )
        # The PVs as this controller's own creates left them: a PV it just saved is seen before
        # the watch delivers it, so the next sync never provisions the claim a second time.
        self.volume_view = MutationCache(self.volumes.store, include_adds=True, clock=self.clock)
        self.volumes.add_handler(EventHandler(None, None, self.volume_view.deleted))
        self.claims.add_index(UID_INDEX, lambda c: [c["metadata"]["uid"]])
        self.claims.add_handler(
            EventHandler(self._claim_changed, lambda _o, c: self._claim_changed(c), self._claim_deleted)
        )
        self.sources = ContentSources(self.client, self.claims.store, self.options.prevent_mode_conversion)

    # -- handlers: decide only whether a key is worth a sync ------------------------------------------

    def _ours(self, claim: PersistentVolumeClaim) -> bool:
        ann = claim.get("metadata", {}).get("annotations") or {}
        return self.driver in (
            ann.get(storage.ANN_STORAGE_PROVISIONER),
            ann.get(storage.ANN_BETA_STORAGE_PROVISIONER),
        )

    def _claim_changed(self, obj: Obj) -> None:
        claim = pvc_view(obj)
        uid = claim["metadata"]["uid"]
        if uid in self.journal.entries or (self._ours(claim) and not claim["spec"].get("volumeName")):
            self.queue.add(uid)

    def _claim_deleted(self, obj: Obj) -> None:
        uid = pvc_view(obj).get("metadata", {}).get("uid", "")
        self.infeasible.forget(uid)
        if self.election is not None:
            self.election.forget(uid)
        if uid in self.journal.entries:
            self.queue.add(uid)

    # -- lifecycle -------------------------------------------------------------------------------------

    async def load_journal(self) -> None:
        """Reads the entries an earlier process left. Before the informers start: the claim events
        of the first list must already see them. The caller holds the journal's lock."""
        for entry in await asyncio.to_thread(self.journal.load):
            log.info(
                "found an unfinished provisioning",
                claim=object_key(entry.namespace, entry.claim),
                uid=entry.uid,
            )

    async def run(self) -> None:
        """The workers, on caches the caller has synced; every journalled claim is synced first
        (its claim may be gone, so no event would queue it)."""
        for uid in list(self.journal.entries):
            self.queue.add(uid)
        # Everything alive now (modules, the filled caches) stays alive: kept out of the cyclic
        # collector's full passes, which would otherwise walk it all again and again while a burst
        # of claims is provisioned (as the pv-controller does; 8 % of the provisioner's busy
        # samples over 1,000 claims were the collector's before). And the youngest generation is
        # collected every 10,000 allocations rather than 700: a claim's decoded watch events,
        # requests and calls are freed by their reference counts long before, and the collector
        # found little else. Over 1,000 claims it ran 148 times for 133 ms of CPU with the default
        # thresholds, 5 times for 31 ms at 20,000.
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        log.info(
            "caches synced, starting workers",
            driver=self.driver,
            claims=len(self.claims.store),
            volumes=len(self.volumes.store),
            unfinished=len(self.journal.entries),
            workers=self.options.workers,
        )
        await run_workers(self.queue, self.sync, self.options.workers)

    # -- the sync --------------------------------------------------------------------------------------

    def _claim_by_uid(self, uid: str) -> PersistentVolumeClaim | None:
        found = self.claims.store.by_index(UID_INDEX, uid)
        return pvc_view(found[0]) if found else None

    async def _pv_exists(self, name: str) -> bool:
        """Asks the API when the cache says no: only a confirmed absence may lead to deleting a
        volume, and a PV we just created may not be in the cache yet."""
        if self.volume_view.get(name) is not None:
            return True
        try:
            await self.client.get(PERSISTENT_VOLUMES, name)
        except ApiError as exc:
            if exc.not_found:
                return False
            raise
        return True

    async def sync(self, uid: str) -> float | None:
        claim = self._claim_by_uid(uid)
        entry = self.journal.get(uid)
        if (
            claim is not None
            and not is_deleting(claim)
            and self._ours(claim)
            and not claim["spec"].get("volumeName")
        ):
            return await self._sync_pending_claim(claim, entry)
        if entry is None:
            return None
        if claim is None:
            # The cache may simply not have seen it yet: never clean up on the cache's word.
            try:
                live = pvc_view(await self.client.get(PERSISTENT_VOLUME_CLAIMS, entry.claim, entry.namespace))
            except ApiError as exc:
                if not exc.not_found:
                    raise
            else:
                if live["metadata"]["uid"] == uid and not is_deleting(live):
                    return 1.0
        await self._abandon(entry)
        return None

    async def _sync_pending_claim(self, claim: PersistentVolumeClaim, entry: Entry | None) -> float | None:
        """Provisions a pending claim of ours; a number is when to look again (an Immediate claim
        no node could take yet, in node deployment)."""
        pv_name = pv_name_for(self.options.prefix, claim)
        if self.volume_view.get(pv_name) is not None:
            if entry is not None:
                await self.journal.remove(entry.uid)
            return None  # provisioned; the binder completes the bind
        class_name = claim_class(claim)
        storage_class = storage_class_view(self.classes.store.get(class_name)) if class_name else None
        if storage_class is None:
            raise StorageClassNotFound(f'storageclass.storage.k8s.io "{class_name}" not found')
        if storage_class.get("provisioner") != self.driver:
            return None  # the class moved to another provisioner; not ours to act on
        if self.node is not None and entry is None:
            # Before anything that writes an event: every node sees every claim, and only the
            # one that provisions it may speak about it. A journalled claim is this node's already.
            check = decide.node_check(
                claim,
                storage_class,
                self.node.node_name,
                immediate_binding=self.node.immediate_binding,
                allowed_here=self._allowed_here(storage_class, pv_name),
            )
            if check is decide.NodeCheck.IGNORE:
                return None
            if check is decide.NodeCheck.ELECT:
                return await self._elect(claim, storage_class, pv_name)
        uid = claim["metadata"]["uid"]
        if self.infeasible.remaining(uid, storage_class["metadata"].get("uid", ""), self.clock.monotonic()):
            raise DelayRetryError(
                f"skipping volume provisioning for pvc {uid}, because provisioning previously "
                "failed with infeasible error"
            )
        selected = _annotation(claim, storage.ANN_SELECTED_NODE)
        if storage_class.get("volumeBindingMode") == "WaitForFirstConsumer" and not selected:
            return None  # the scheduler picks a node first
        await self._attempt(claim, storage_class, pv_name, entry, selected)
        return None

    def _topology(self, storage_class: StorageClass, pv_name: str, node: Node | None) -> Topology | None:
        """CreateVolume's accessibility requirements for a volume on `node` (None: unscheduled);
        in node deployment from this node's own CSINode and Node, as upstream."""
        if not self.topology:
            return None
        if self.node is not None:
            csinodes: list[CSINode] = [self.local_csinode]
            nodes = {self.node.node_name: self.local_node}
        else:
            assert self.csinodes is not None and self.nodes is not None
            csinodes = [csi_node_view(c) for c in self.csinodes.store.values()]
            nodes = {n["metadata"]["name"]: n for n in map(node_view, self.nodes.store.values())}
        return accessibility(
            self.driver,
            storage_class,
            pv_name,
            node,
            csinodes,
            nodes,
            strict=self.options.strict_topology,
            immediate=self.options.immediate_topology,
        )

    def _allowed_here(self, storage_class: StorageClass, pv_name: str) -> bool:
        """Whether the class's allowedTopologies admit this node (upstream asks for the
        requirements a volume here would get, and an error means no)."""
        if not storage_class.get("allowedTopologies") or not self.topology:
            return True
        try:
            self._topology(storage_class, pv_name, self.local_node)
        except ProvisionError as exc:
            log.debug("ignoring claim, allowed topologies is not compatible", error=str(exc))
            return False
        return True

    async def _elect(
        self, claim: PersistentVolumeClaim, storage_class: StorageClass, pv_name: str
    ) -> float | None:
        """Tries to make this node the Immediate claim's selected node (upstream's becomeOwner).
        Won or lost, the claim's next event decides; a claim this node has no room for is looked
        at again after --node-deployment-max-delay, in case no other node takes it either."""
        assert self.election is not None and self.node is not None
        if not await self._holds_source(claim, storage_class):
            return None  # the node that holds it competes; nothing here will change that
        try:
            topology = self._topology(storage_class, pv_name, self.local_node)
        except ProvisionError:
            topology = None  # the capacity check then asks without a segment
        outcome = await self.election.become_owner(claim, storage_class, pv_name, topology)
        return self.node.max_delay if outcome is Ownership.NO_ROOM else None

    async def _holds_source(self, claim: PersistentVolumeClaim, storage_class: StorageClass) -> bool:
        """For an Immediate clone or restore (kubeloop extension): whether this node's driver
        holds its source. A node-local copy can only be made where the source is, and upstream's
        election would let any node win it, whose CreateVolume then answers NOT_FOUND. The driver
        is asked directly (ControllerGetVolume, ListSnapshots by id); a source that cannot be
        resolved, or a driver that cannot say, lets the node compete, so that provisioning's event
        says what is wrong."""
        source = decide.data_source(claim)
        if source is None or source.populated:
            return True
        try:
            content = await self.sources.content(claim, storage_class, source)
        except ProvisionError:
            return True
        try:
            if content.volume:
                if not self.csi.has_controller_capability(RPC.GET_VOLUME):
                    return True
                await self.csi.controller.ControllerGetVolume(
                    csi_pb2.ControllerGetVolumeRequest(volume_id=content.volume), timeout=self.csi.timeout
                )
                return True
            listed = await self.csi.controller.ListSnapshots(
                csi_pb2.ListSnapshotsRequest(snapshot_id=content.snapshot), timeout=self.csi.timeout
            )
            return bool(listed.entries)
        except grpc.aio.AioRpcError as exc:
            held: bool = exc.code() != grpc.StatusCode.NOT_FOUND
            if not held:
                log.debug("this node does not hold the claim's source", claim=key_of(claim))
            return held

    async def _attempt(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        entry: Entry | None,
        selected: str,
    ) -> None:
        """One attempt, between its Provisioning event and, should it fail, its ProvisioningFailed
        event (and the selected node given back when its state says so)."""
        md = claim["metadata"]
        obj = typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS)
        self.recorder.normal(obj, names.PROVISIONING, names.msg_provisioning(md["namespace"], md["name"]))
        try:
            source = decide.data_source(claim)
            if source is not None and source.populated:
                self.recorder.normal(obj, names.PROVISIONING, names.MSG_POPULATOR)
                return  # a volume populator's claim
            problem = decide.capability_error(
                self.csi.plugin_capabilities,
                self.csi.controller_capabilities,
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

    async def _selected_node(self, name: str) -> Node:
        if self.node is not None:
            return self.local_node  # only claims whose selected node is this one get here
        assert self.nodes is not None
        node = node_view(self.nodes.store.get(name))
        if node is not None:
            return node
        try:
            node = node_view(await self.client.get(NODES, name))
        except ApiError as exc:
            if exc.not_found:
                raise ProvisionError(exc.message, OperationState.RESCHEDULE) from exc
            raise
        return node

    async def _reschedule(self, claim: PersistentVolumeClaim) -> None:
        """Removes selected-node so the scheduler picks again (a full pool, a vanished node)."""
        log.info("asking the scheduler for another node", claim=key_of(claim))
        with contextlib.suppress(ApiError):  # a conflict: the next sync sees the newer claim
            await update_claim_metadata(
                self.client, as_obj(claim), annotations={storage.ANN_SELECTED_NODE: None}
            )

    def _new_spec(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        node: Node | None,
        content: Content,
        mutable_parameters: dict[str, str],
    ) -> VolumeSpec:
        topology = self._topology(storage_class, pv_name, node)
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
            source_volume=content.volume,
            source_snapshot=content.snapshot,
            mode_change_granted=content.mode_change_granted,
            mutable_parameters=mutable_parameters,
        )

    async def _mutable_parameters(self, claim: PersistentVolumeClaim) -> dict[str, str]:
        """The parameters of the claim's VolumeAttributesClass, read live as upstream reads it: a
        class that is not there yet (or cannot be read) fails the attempt with the apiserver's
        words and is tried again; a class of another driver can never serve the claim."""
        name = claim["spec"].get("volumeAttributesClassName")
        if not name:
            return {}
        try:
            vac = await self.client.get(VOLUME_ATTRIBUTES_CLASSES, name)
        except ApiError as exc:
            raise ProvisionError(exc.message) from exc
        if vac.get("driverName") != self.driver:
            raise ProvisionError(
                f"VAC {name} referenced in PVC is for driver {vac.get('driverName')} which does not match "
                f"driver name {self.driver}"
            )
        return dict(vac.get("parameters") or {})

    async def _record_intent(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        selected: str,
        source: DataSource | None,
    ) -> tuple[Entry, dict[str, str]]:
        """A first attempt's request, and the secrets it is sent with, journalled before it is
        sent. In the sidecar's order: the source, its protection, the node's topology, then the
        parameters and secrets; the first failure is the event."""
        mutable_parameters = await self._mutable_parameters(claim)
        content = Content()
        if source is not None:
            content = await self.sources.content(claim, storage_class, source)
            if source.clone:
                await self.clones.protect(source)
            else:
                await self.snapshots.protect(source)
        node = await self._selected_node(selected) if selected else None
        spec = self._new_spec(claim, storage_class, pv_name, node, content, mutable_parameters)
        secrets = await self.calls.secrets(spec.secret)
        md = claim["metadata"]
        entry = Entry(md["uid"], md["namespace"], md["name"], claim_class(claim), spec)
        await self.journal.put(entry)
        return entry, secrets

    async def _provision(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        pv_name: str,
        entry: Entry | None,
        selected: str,
        source: DataSource | None,
    ) -> None:
        md = claim["metadata"]
        secrets: dict[str, str] | None = None
        if entry is None:
            entry, secrets = await self._record_intent(claim, storage_class, pv_name, selected, source)
        # A repeat sends the journalled request unchanged: CreateVolume is idempotent only for an
        # identical request, and the first one may still be running in the driver.
        params = split_parameters(
            storage_class.get("parameters") or {}, claim, pv_name, self.options.default_fs
        )
        if secrets is None:
            secrets = await self.calls.secrets(entry.spec.secret)
        failpoints.reach(failpoints.BEFORE_CREATE_VOLUME)
        # Another node may have room only where the request named the selected node's topology.
        created = await self._create_volume(
            claim, storage_class, entry, secrets, may_reschedule=bool(selected) and self.topology
        )
        # Kept in memory for now: written to the entry only if saving the PV has to be retried
        # (see _save_pv). Losing it costs a crash's clean-up one repeated CreateVolume, while
        # writing it for every claim put a file write on every provisioning's path.
        entry.volume_id = created.volume_id
        if self.volume_created is not None:
            self.volume_created()
        failpoints.reach(failpoints.AFTER_CREATE_VOLUME)
        pv = build_pv(
            driver=self.driver,
            identity=self.options.identity,
            claim=claim,
            storage_class=storage_class,
            spec=entry.spec,
            params=params,
            created=created,
        )
        await self._save_pv(pv, claim, entry, secrets)
        failpoints.reach(failpoints.AFTER_PV_SAVED)
        await self.journal.remove(entry.uid)
        log.info("provisioned", claim=key_of(claim), volume=pv_name, handle=created.volume_id)
        restored = claim["spec"].get("dataSource") or {}
        if restored.get("kind") == decide.SNAPSHOT_KIND:
            await self.snapshots.release(md["namespace"], restored.get("name", ""))
        self.recorder.normal(
            typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS),
            names.PROVISIONING_SUCCEEDED,
            names.msg_succeeded(pv_name),
        )

    async def _create_volume(
        self,
        claim: PersistentVolumeClaim,
        storage_class: StorageClass,
        entry: Entry,
        secrets: Mapping[str, str],
        *,
        may_reschedule: bool,
    ) -> CreatedVolume:
        """CreateVolume with the journalled request. What a failure left behind (its state, decided
        where the call returned) says whether the intent stays and whether retries slow down."""
        try:
            return await self.calls.create_volume(
                entry.spec, secrets, may_reschedule=may_reschedule, node_deployment=self.node is not None
            )
        except ProvisionError as exc:
            if exc.final:
                await self.journal.remove(entry.uid)  # nothing is being created for this request
            if exc.state is OperationState.INFEASIBLE:
                # The same request cannot succeed: slow retries, as upstream.
                class_uid = storage_class["metadata"].get("uid", "")
                self.infeasible.mark(claim["metadata"]["uid"], class_uid, self.clock.monotonic())
                raise ProvisionError(
                    f"Volume provisioning failed with infeasible error. Retries will be delayed. {exc}",
                    exc.state,
                ) from exc
            raise

    async def _save_pv(
        self, pv: Obj, claim: PersistentVolumeClaim, entry: Entry, secrets: Mapping[str, str]
    ) -> None:
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
                    existing = pv_view(await self.client.get(PERSISTENT_VOLUMES, name))
                    ref = existing["spec"].get("claimRef") or {}
                    if ref.get("uid") == claim["metadata"]["uid"]:
                        return  # saved by an earlier attempt whose answer was lost
                    error = f"a PersistentVolume {name} of another claim exists"
                    break
                error = exc.message
                log.warning("saving the PV failed, retrying", volume=name, attempt=attempt + 1, error=error)
                continue
            self.volume_view.mutated(saved)  # the next sync must not provision twice
            return
        # The PV cannot be saved: give the volume back rather than leave it behind.
        log.error("could not save the PV, deleting the volume", volume=name, error=error)
        try:
            await self.calls.delete_volume(entry.volume_id, secrets)
        except ProvisionError as exc:
            self.recorder.warning(
                typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS),
                names.PROVISIONING_CLEANUP_FAILED,
                f"Failed to clean up volume {name} after failing to save its PersistentVolume: {exc}",
            )
            raise ProvisionError(f"failed to save PersistentVolume {name}: {error}") from exc
        await self.journal.remove(entry.uid)
        raise ProvisionError(f"failed to save PersistentVolume {name}: {error}; the volume was deleted")

    async def _abandon(self, entry: Entry) -> None:
        """The claim is gone while a volume may exist for it: finish the CreateVolume (the same
        request) to learn the volume's id, then delete the volume. A saved PV takes over instead."""
        where = object_key(entry.namespace, entry.claim)
        if await self._pv_exists(entry.spec.name):
            await self.journal.remove(entry.uid)
            return
        volume_id = entry.volume_id
        secrets = await self.calls.secrets(entry.spec.secret, required=False)
        if not volume_id:
            try:
                volume_id = (await self.calls.create_volume(entry.spec, secrets)).volume_id
            except ProvisionError as exc:
                if exc.final:
                    log.info("claim gone and no volume was created for it", claim=where, error=str(exc))
                    await self.journal.remove(entry.uid)
                    return
                raise
        await self.calls.delete_volume(volume_id, secrets)
        log.info("claim deleted while provisioning; deleted its volume", claim=where, handle=volume_id)
        await self.journal.remove(entry.uid)
