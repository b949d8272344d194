"""The node finalizer: a Node informer, a queue of node names, one idempotent sync per Node.

A live Node gets the finalizer loop.csi.kubeloop.dev/node. A Node being deleted that carries it is
finalized, in an order where every step can be cut short by a crash and is redone or skipped by
the next sync (each reads the API afresh, and every delete carries the UID it was decided on):
  1. every PV of the driver pinned to that node (a fresh list): the claim bound to it deleted,
     so a workload can make a new one on a node that exists (TopoLVM deletes the node's claims
     for the same reason); a Delete-policy PV deleted, then the external-provisioner's finalizer
     removed (no provisioner will ever run DeleteVolume there); a PV of another policy kept;
  2. every claim of the driver still waiting for a volume on that node (a fresh list): the
     scheduler's selected-node annotation removed, so that it chooses another node;
  3. a summary event on the Node; its finalizer removed, which lets the Node go.
The claims and PVs are not waited for: a claim a pod on the dead node still uses is held by
pvc-protection until kcm's pod garbage collector removes that pod, which it does only once the
Node is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import csi_driver_view, node_view, pv_view, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import (
    CSI_DRIVERS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Obj,
    Resource,
    key_of,
    typed,
)
from controller_runtime.storage import is_deleting
from controller_runtime.workqueue import MaxOfRateLimiter, WorkQueue, default_rate_limiter

from . import messages
from .decide import (
    DRIVER_NAME,
    FINALIZER,
    TOPOLOGY_KEY,
    NodeStep,
    VolumeCleanup,
    add_node_finalizer,
    claim_to_delete,
    cleanup,
    forget_selected_node,
    node_local_driver,
    node_step,
    remove_node_finalizer,
    remove_provisioner_finalizer,
    topology_value,
    waits_for_node,
)
from .metrics import NODES_FINALIZED, VOLUMES_CLEANED

log = get_logger("node-finalizer")

QUEUE = "node-finalizer"
CONFLICT_RETRIES = 5  # client-go's retry.DefaultRetry steps
Edit = Callable[[Obj], Obj | None]  # the metadata to merge into an object's version, None: nothing


@dataclass(frozen=True)
class Options:
    workers: int = 4
    # TopoLVM's --skip-node-finalize: the finalizer is still kept on every Node and removed on
    # deletion, but nothing is cleaned up (the admin does it).
    skip_node_finalize: bool = False


@dataclass
class Tally:
    """What one finalization did, for the Node's summary event."""

    claims: int = 0
    retained: int = 0
    rescheduled: int = 0


class NodeFinalizer(InformerController):
    def __init__(self, context: ControllerContext, options: Options | None = None) -> None:
        super().__init__(context)
        self.options = options or Options()
        limiter: MaxOfRateLimiter[str] = default_rate_limiter(clock=self.clock)
        self.queue: WorkQueue[str] = WorkQueue(QUEUE, limiter, clock=self.clock)
        self.nodes = self.factory.informer(NODES)
        self.nodes.add_handler(
            EventHandler(self._enqueue, lambda _old, new: self._enqueue(new), self._forget)
        )

    def _enqueue(self, node: Obj) -> None:
        # Kubelet's status updates are most of a Node's updates: only one with work is queued.
        if node_step(node_view(node)) is not NodeStep.NOTHING:
            self.queue.add(key_of(node))

    def _forget(self, node: Obj) -> None:
        self.queue.forget(key_of(node))

    async def run(self) -> None:
        await self.start_informers()
        log.info(
            "caches synced, starting workers",
            workers=self.options.workers,
            skip_node_finalize=self.options.skip_node_finalize,
        )
        await run_workers(self.queue, self.sync, self.options.workers)

    async def sync(self, key: str) -> None:
        node = self.nodes.store.get(key)
        if node is None:
            return
        step = node_step(node_view(node))
        if step is NodeStep.ADD_FINALIZER:
            await self._edit(NODES, node, add_node_finalizer)
            log.info("added finalizer", node=key, finalizer=FINALIZER)
        elif step is NodeStep.FINALIZE:
            live = await self._live(node)
            if live is not None:
                await self._finalize(live)

    async def _live(self, cached: Obj) -> Obj | None:
        """The Node as the API has it, when it is still the cached one (same UID) and still waiting
        for this finalizer: a cache that lags (a watch cut, a relist backing off) could hand over
        a Node released long ago, and a new Node of the same name may since hold volumes."""
        md = cached["metadata"]
        try:
            live = await self.client.get(NODES, md["name"])
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        if (
            live["metadata"].get("uid") != md.get("uid")
            or node_step(node_view(live)) is not NodeStep.FINALIZE
        ):
            return None
        return live

    # -- finalizing a deleted Node ----------------------------------------------------------------

    async def _finalize(self, node: Obj) -> None:
        name, value = node["metadata"]["name"], topology_value(node_view(node))
        if value is None:
            label = str(node["metadata"]["labels"][TOPOLOGY_KEY])
            log.warning("topology label is not the node name, nothing cleaned up", node=name, label=label)
            text = messages.skipped_label_mismatch(TOPOLOGY_KEY, label)
            self.recorder.warning(typed(node, NODES), messages.NODE_FINALIZE_SKIPPED, text)
            await self._release(node, "label-mismatch")
            return
        volumes = [(pv, c) for pv in await self._volumes() if (c := cleanup(pv_view(pv), value)) is not None]
        waiting = await self._waiting_claims(name)
        if self.options.skip_node_finalize:
            log.info("skipping node finalize", node=name, volumes=len(volumes), waiting_claims=len(waiting))
            if volumes or waiting:
                text = messages.skipped_by_flag(len(volumes), len(waiting))
                self.recorder.warning(typed(node, NODES), messages.NODE_FINALIZE_SKIPPED, text)
            await self._release(node, "skipped")
            return
        if (volumes or waiting) and not node_local_driver(csi_driver_view(await self._csidriver())):
            log.warning("CSIDriver not in node-local mode, nothing cleaned up", node=name, driver=DRIVER_NAME)
            text = messages.skipped_shared_mode(DRIVER_NAME)
            self.recorder.normal(typed(node, NODES), messages.NODE_FINALIZE_SKIPPED, text)
            await self._release(node, "shared-mode")
            return
        tally = Tally()
        for pv, volume in volumes:
            await self._clean_claim(name, volume, tally)
            await self._clean_volume(name, pv, volume, tally)
        for claim in waiting:
            await self._reschedule(name, claim, tally)
        if volumes or tally.rescheduled:
            deleted = len(volumes) - tally.retained
            text = messages.node_cleaned_up(tally.claims, deleted, tally.retained, tally.rescheduled)
            self.recorder.warning(typed(node, NODES), messages.NODE_CLEANED_UP, text)
        await self._release(node, "done")

    async def _volumes(self) -> list[Obj]:
        """Every PV, read afresh: a Node is deleted rarely, and a list at that moment cannot miss
        a volume the way a cache that has not caught up could; no PV cache is kept meanwhile."""
        pvs, _ = await self.client.list_all(PERSISTENT_VOLUMES)
        return pvs

    async def _waiting_claims(self, node: str) -> list[Obj]:
        """The claims still waiting for a volume on this node, from a fresh list of every claim."""
        claims, _ = await self.client.list_all(PERSISTENT_VOLUME_CLAIMS)
        return [c for c in claims if waits_for_node(pvc_view(c), node)]

    async def _reschedule(self, node: str, claim: Obj, tally: Tally) -> None:
        if not await self._edit(PERSISTENT_VOLUME_CLAIMS, claim, forget_selected_node(node)):
            return
        tally.rescheduled += 1
        VOLUMES_CLEANED.labels("claim-rescheduled").inc()
        text = messages.claim_rescheduled(node)
        self.recorder.warning(typed(claim, PERSISTENT_VOLUME_CLAIMS), messages.CLAIM_RESCHEDULED, text)
        log.info("gave a waiting claim back to the scheduler", node=node, pvc=key_of(claim))

    async def _csidriver(self) -> Obj | None:
        try:
            return await self.client.get(CSI_DRIVERS, DRIVER_NAME)
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def _clean_claim(self, node: str, volume: VolumeCleanup, tally: Tally) -> None:
        ref = volume.claim
        if ref is None:
            return
        try:
            claim: Obj | None = await self.client.get(PERSISTENT_VOLUME_CLAIMS, ref.name, ref.namespace)
        except ApiError as e:
            if not e.not_found:
                raise
            claim = None
        if claim is None or not claim_to_delete(pvc_view(claim), ref):
            return
        if await self._delete(PERSISTENT_VOLUME_CLAIMS, ref.name, ref.namespace, ref.uid) is None:
            return
        tally.claims += 1
        VOLUMES_CLEANED.labels("claim-deleted").inc()
        text = messages.claim_deleted(node, volume)
        self.recorder.warning(typed(claim, PERSISTENT_VOLUME_CLAIMS), messages.CLAIM_DELETED, text)
        log.info("deleted claim", node=node, pvc=f"{ref.namespace}/{ref.name}", pv=volume.name)

    async def _clean_volume(self, node: str, pv: Obj, volume: VolumeCleanup, tally: Tally) -> None:
        ref = typed(pv, PERSISTENT_VOLUMES)
        if not volume.delete:
            tally.retained += 1
            VOLUMES_CLEANED.labels("volume-retained").inc()
            self.recorder.warning(ref, messages.VOLUME_RETAINED, messages.volume_retained(node, volume))
            return
        if is_deleting(pv):
            # Deleted by an earlier sync cut short (or by someone else): only its finalizer is left.
            await self._drop_provisioner_finalizer(pv)
            return
        answer = await self._delete(PERSISTENT_VOLUMES, volume.name, None, volume.uid)
        if answer is None:
            return  # gone, or replaced by another PV of that name
        # Told before the finalizer is dropped: a failure there is retried by a sync that finds
        # the PV being deleted, and says nothing again.
        VOLUMES_CLEANED.labels("volume-deleted").inc()
        self.recorder.warning(ref, messages.VOLUME_DELETED, messages.volume_deleted(node, volume))
        log.info("deleted volume", node=node, pv=volume.name, handle=volume.handle)
        await self._drop_provisioner_finalizer(answer)

    async def _delete(self, res: Resource, name: str, namespace: str | None, uid: str) -> Obj | None:
        """Deletes the object of that UID. Returns the API's answer (the object while finalizers
        hold it, or a Status once it is gone), or None when it was gone already or is another
        object of the same name (the UID precondition fails with a conflict)."""
        try:
            return await self.client.delete(res, name, namespace, uid=uid)
        except ApiError as e:
            if e.not_found or e.conflict:
                return None
            raise

    async def _drop_provisioner_finalizer(self, pv: Obj) -> None:
        if pv.get("kind") != "Status":  # a Status: deleted outright, no finalizer held it
            await self._edit(PERSISTENT_VOLUMES, pv, remove_provisioner_finalizer)

    async def _release(self, node: Obj, how: str) -> None:
        await self._edit(NODES, node, remove_node_finalizer)
        NODES_FINALIZED.labels(how).inc()
        log.info("removed finalizer, the node can go", node=node["metadata"]["name"], cleanup=how)

    async def _edit(self, res: Resource, obj: Obj, edit: Edit) -> bool:
        """Merges the metadata `edit` makes of `obj` (nothing when it says None) on obj's
        resourceVersion; True when it was written. On a conflict it reads the object again and
        edits that (client-go's RetryOnConflict): kubelet's status, kcm's taints or its
        pv-protection write these objects all the time, and a conflict must not redo a whole
        clean-up and its events."""
        md = obj["metadata"]
        name, namespace = md["name"], md.get("namespace")
        for attempt in range(CONFLICT_RETRIES):
            change = edit(obj)
            if change is None:
                return False
            patch = {"metadata": {**change, "resourceVersion": obj["metadata"]["resourceVersion"]}}
            try:
                await self.client.patch(res, name, patch, namespace=namespace)
                return True
            except ApiError as e:
                if e.not_found:
                    return False
                if not e.conflict or attempt == CONFLICT_RETRIES - 1:
                    raise
            try:
                obj = await self.client.get(res, name, namespace)
            except ApiError as e:
                if e.not_found:
                    return False
                raise
        return False
