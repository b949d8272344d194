"""The node plugin's side of moving a volume to another node (controller_runtime.volume_moves has
the contract and its steps; docs/volume-moves.md the whole story).

Each plugin watches only the PVs whose move concerns its node, through two label-selected
informers (moves into this node, moves out of it), and takes one step per sync, from what the PV
and its own records say, so a kill at any point is followed by the same step again:

- out of this node, not switched yet: mark the copy as leaving (durable; NodeStage refuses it from
  then on, so its data cannot change), then tell the target with the `source-ready` annotation; a
  copy that is staged cannot leave, and the PV says so;
- into this node: once the source is ready, pull the volume (resuming what an earlier pull left),
  mark it ready, then point the PV's node affinity here and drop the `to` label in one patch;
- out of this node, switched: delete the copy here, then drop what is left of the move.

A PV that leaves an informer (its labels removed: a cancelled move, or a finished one, or the PV
deleted) is looked at again through the records that name it: what a cancelled move pulled here is
dropped, a cancelled move's source copy is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.failpoints import Failpoints
from controller_runtime.informer import EventHandler, SharedInformerFactory
from controller_runtime.kinds import PersistentVolume, pv_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import PERSISTENT_VOLUMES, Obj, object_key
from controller_runtime.volume_moves import (
    FROM_LABEL,
    SOURCE_READY_ANNOTATION,
    STATE_ANNOTATION,
    TO_LABEL,
    affinity_node,
    cancel_patch,
    moving,
    node_affinity,
    node_label_value,
)
from controller_runtime.workqueue import ItemExponentialRateLimiter, ShutDown, WorkQueue

from .. import mutable
from ..controller import ControllerServer
from ..errors import CsiError
from ..state import VolumeRecord
from ..validation import check_id
from .access import PeerAccess
from .wire import RemoteSource

log = get_logger("csi.moves")

# A step that waits on something no PV event announces (a staged copy being unstaged) looks again
# this often.
RECHECK_SECONDS = 10.0

# Where tests/csi/test_volume_moves.py kills a plugin mid-move (nothing shipped arms them).
AFTER_RELEASE = "move-after-release"  # source: copy marked leaving, PV not told yet
AFTER_PULL = "move-after-pull"  # target: copy complete, PV not switched yet
AFTER_SWITCH = "move-after-switch"  # target: PV switched, its record still says incoming
AFTER_DROP = "move-after-drop"  # source: copy deleted, the move's labels still on the PV
MOVE_STEPS = Failpoints(AFTER_RELEASE, AFTER_PULL, AFTER_SWITCH, AFTER_DROP)


class StepBlocked(Exception):
    """A move that cannot go on for now; the message goes on the PV for `kubectl kubeloop move`."""


class MoveController:
    def __init__(
        self,
        client: ApiClient,
        peers: PeerAccess,
        controller: ControllerServer,
        driver: str,
        topology_key: str,
    ) -> None:
        self.client = client
        self.peers = peers
        self.controller = controller
        self.state = controller.state
        self.node = peers.config.node
        self.driver = driver
        self.topology_key = topology_key
        factory = SharedInformerFactory(client)
        mine = node_label_value(self.node)
        self.incoming = factory.informer(PERSISTENT_VOLUMES, label_selector=f"{TO_LABEL}={mine}")
        self.outgoing = factory.informer(PERSISTENT_VOLUMES, label_selector=f"{FROM_LABEL}={mine}")
        self.factory = factory
        self.queue: WorkQueue[str] = WorkQueue("volume_moves", ItemExponentialRateLimiter(1.0, 60.0))
        handler = EventHandler(on_add=self._enqueue, on_update=self._updated, on_delete=self._enqueue)
        for informer in (self.incoming, self.outgoing):
            informer.add_handler(handler)

    def _enqueue(self, pv: Obj) -> None:
        self.queue.add(pv_view(pv)["metadata"]["name"])

    def _updated(self, old: Obj, new: Obj) -> None:
        # The state annotation is this process's own report: a change of it alone is no news, and
        # reacting to it would turn every failed step into a loop of writes.
        if _significant(old) != _significant(new):
            self._enqueue(new)

    async def run(self) -> None:
        self.factory.start()
        try:
            await self.factory.wait_for_sync()
            # Moves whose labels went while this plugin was down are found through its records.
            for vol in self.state.list_volumes():
                if vol.move_pv:
                    self.queue.add(vol.move_pv)
            while True:
                try:
                    name = await self.queue.get()
                except ShutDown:
                    return
                try:
                    await self.sync(name)
                    self.queue.forget(name)
                except StepBlocked as e:
                    await self._tell(name, str(e))
                    self.queue.add_after(name, RECHECK_SECONDS)
                except (ApiError, CsiError, OSError) as e:
                    log.warning("a move step failed; retrying", pv=name, error=str(e))
                    await self._tell(name, f"node {self.node}: {e}")
                    self.queue.add_rate_limited(name)
                finally:
                    self.queue.done(name)
        finally:
            self.queue.shutdown()
            await self.factory.stop()

    # --- one step -------------------------------------------------------------------------------
    async def sync(self, name: str) -> None:
        key = object_key(None, name)
        pv = pv_view(self.incoming.store.get(key) or self.outgoing.store.get(key))
        if pv is None:
            await self._left(name)
            return
        spec = pv.get("spec", {})
        csi = spec.get("csi", {})
        ends = moving(pv.get("metadata", {}).get("annotations") or {})
        if csi.get("driver") != self.driver or ends is None:
            return
        source, target = ends
        handle = csi.get("volumeHandle", "")
        try:
            check_id(handle, "the PV's volumeHandle")
        except CsiError as e:
            raise StepBlocked(e.message) from e
        if target == self.node and source != self.node:
            await self._bring_in(pv, name, handle, source)
        elif source == self.node:
            await self._send_out(pv, name, handle, target)

    async def _send_out(self, pv: PersistentVolume, name: str, handle: str, target: str) -> None:
        serving = affinity_node(pv, self.topology_key)
        if serving != self.node:
            # Switched: the target serves the volume now. The copy here goes only when everything
            # agrees it is the move this node released it for; anything else (an affinity edited
            # by hand, a move re-aimed) keeps it and says why.
            vol = self.state.volume(handle)
            if vol is not None and not (vol.leaving_to == target == serving):
                raise StepBlocked(
                    f"the PV's node affinity names {serving or 'no single node'}, but node {self.node} "
                    f"released volume {handle} for node {vol.leaving_to or '(none)'}: its copy is kept"
                )
            await self.controller.drop_copy(handle, f"moved to node {target}")
            MOVE_STEPS.reach(AFTER_DROP)
            await self._patch(name, cancel_patch())
            log.info("volume moved away", pv=name, volume=handle, to=target)
            return
        async with self.state.locks.hold(handle):
            vol = self.state.volume(handle)
            if vol is None or not vol.ready:
                raise StepBlocked(f"node {self.node} does not hold volume {handle}")
            if self.state.staging(handle) is not None:
                raise StepBlocked(
                    f"volume {handle} is staged on node {self.node}: stop the pods that use it to move it"
                )
            if vol.leaving_to != target or vol.move_pv != name:
                await self.state.put_volume(dataclasses.replace(vol, leaving_to=target, move_pv=name))
                MOVE_STEPS.reach(AFTER_RELEASE)
        md = pv.get("metadata", {})
        if (md.get("annotations") or {}).get(SOURCE_READY_ANNOTATION) != "true":
            # On the PV as seen: after a cancel, the mark must not come back.
            await self._patch(
                name,
                {"metadata": {"resourceVersion": md.get("resourceVersion"), "annotations": {
                    SOURCE_READY_ANNOTATION: "true",
                    STATE_ANNOTATION: f"node {self.node} released the volume; node {target} copies it",
                }}},
            )  # fmt: skip

    async def _bring_in(self, pv: PersistentVolume, name: str, handle: str, source: str) -> None:
        md = pv.get("metadata", {})
        if affinity_node(pv, self.topology_key) != self.node:
            if (md.get("annotations") or {}).get(SOURCE_READY_ANNOTATION) != "true":
                return  # the source has not released it yet; its patch brings the next event
            if md.get("deletionTimestamp"):
                raise StepBlocked(f"the PV is being deleted: node {self.node} does not take it")
            info = await self._describe(source, handle)
            vol = self.state.volume(handle)
            if vol is not None and not vol.incoming_from:
                raise StepBlocked(f"node {self.node} already holds a volume {handle} of its own")
            if vol is not None and vol.ready and vol.pulled_generation != info.generation:
                # A copy of an earlier move (cancelled before it switched, the volume used on the
                # source since): what it holds is not the volume now.
                await self.controller.drop_copy(handle, "the source changed since this copy was made")
                vol = None
            if vol is None:
                vol = await self.controller.receive(
                    VolumeRecord(
                        volume_id=handle,
                        name=name,
                        capacity=info.size,
                        seq=0,
                        access_type=info.access_type or "mount",
                        fs_type=info.fs_type,
                        topology=[{self.topology_key: self.node}],
                        kind=info.pool_kind,
                        mutable_parameters=dict(info.mutable_parameters),
                        move_pv=name,
                        incoming_from=source,
                    )
                )
            if not vol.ready:
                await self._tell(name, f"node {self.node} copies the volume from node {source}")
                path = self.state.volume_file(handle)
                pulled = await self.peers.pull(source, "volume", handle, path, vol.capacity)
                # A copy starts with the attributes of a new file: it is given the volume's.
                await asyncio.to_thread(mutable.apply, path, vol.mutable_parameters)
                async with self.state.locks.hold(handle):
                    await self.state.put_volume(
                        dataclasses.replace(vol, ready=True, pulled_generation=pulled.source.generation)
                    )
            MOVE_STEPS.reach(AFTER_PULL)
            # One patch: the PV serves from here, and it leaves this node's informer. It is made
            # on the latest PV this plugin saw, so a cancel that came during the pull wins.
            latest = pv_view(self.incoming.store.get(object_key(None, name)))
            if latest is None:
                return  # cancelled meanwhile: the informer's delete brings _left
            await self._patch(
                name,
                {
                    "metadata": {
                        "resourceVersion": latest.get("metadata", {}).get("resourceVersion"),
                        "labels": {TO_LABEL: None},
                        "annotations": {
                            STATE_ANNOTATION: f"moved to node {self.node}; node {source} deletes its copy"
                        },
                    },
                    "spec": {"nodeAffinity": node_affinity(self.topology_key, self.node)},
                },
            )
            log.info("volume moved here", pv=name, volume=handle, source=source)
            MOVE_STEPS.reach(AFTER_SWITCH)
        await self._settle(handle)

    async def _describe(self, source: str, handle: str) -> RemoteSource:
        located = await self.peers.ask(source, await self.peers.endpoint(source), "volume", handle)
        if located is None:
            raise StepBlocked(f"node {source} does not offer volume {handle}")
        return located.info

    async def _settle(self, handle: str) -> None:
        """The copy here is the volume's now: no longer a move's."""
        async with self.state.locks.hold(handle):
            vol = self.state.volume(handle)
            if vol is not None and (vol.incoming_from or vol.move_pv):
                await self.state.put_volume(dataclasses.replace(vol, incoming_from="", move_pv=""))

    async def _left(self, name: str) -> None:
        """A PV out of both informers: its move is over, cancelled, or the PV is gone."""
        records = [v for v in self.state.list_volumes() if v.move_pv == name]
        if not records:
            return
        try:
            pv: PersistentVolume | None = pv_view(await self.client.get(PERSISTENT_VOLUMES, name))
        except ApiError as e:
            if not e.not_found:
                raise
            pv = None
        here = pv is not None and affinity_node(pv, self.topology_key) == self.node
        for vol in records:
            if vol.leaving_to and (here or pv is None):
                # Cancelled (or the PV deleted, its reclaim policy keeping the data): it stays.
                async with self.state.locks.hold(vol.volume_id):
                    await self.state.put_volume(dataclasses.replace(vol, leaving_to="", move_pv=""))
                log.info(
                    "a move away ended without switching; the volume stays", pv=name, volume=vol.volume_id
                )
            elif vol.leaving_to:
                await self.controller.drop_copy(vol.volume_id, f"moved to node {vol.leaving_to}")
            elif vol.incoming_from and not here:
                await self.controller.drop_copy(vol.volume_id, "its move was cancelled")
            elif vol.incoming_from:
                await self._settle(vol.volume_id)

    # --- writes ---------------------------------------------------------------------------------
    async def _patch(self, name: str, patch: dict[str, Any]) -> None:
        await self.client.patch(PERSISTENT_VOLUMES, name, patch)

    async def _tell(self, name: str, state: str) -> None:
        seen = pv_view(
            self.incoming.store.get(object_key(None, name)) or self.outgoing.store.get(object_key(None, name))
        )
        if seen is None or (seen["metadata"].get("annotations") or {}).get(STATE_ANNOTATION) == state:
            return
        with contextlib.suppress(ApiError):
            await self._patch(name, {"metadata": {"annotations": {STATE_ANNOTATION: state}}})


def _significant(obj: Obj) -> tuple[object, ...]:
    """What of a PV a move step decides on: all but the resource version and the state report."""
    pv = pv_view(obj)
    md = pv.get("metadata", {})
    annotations = {k: v for k, v in (md.get("annotations") or {}).items() if k != STATE_ANNOTATION}
    return (md.get("labels"), annotations, md.get("deletionTimestamp"), pv.get("spec"))
