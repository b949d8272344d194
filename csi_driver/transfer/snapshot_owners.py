"""Pre-provisioned snapshots find their node (node-local mode with transfers).

With distributed snapshotting (docs/node-local.md) each node's csi-snapshotter takes only the
VolumeSnapshotContents labelled `snapshot.storage.kubernetes.io/managed-by: <its node>`, and
external-snapshotter's snapshot-controller writes that label only on the contents it makes for
dynamic snapshots. A content made by hand from a `snapshotHandle` (a pre-provisioned snapshot, a
restore from a backup) carries none unless its author knew to add it, and is then never ready: no
node's sidecar takes it. The pool that holds the snapshot is the one that knows, so each plugin
watches this driver's unlabelled contents and labels those whose handle its own pool holds with its
node. Only the holder ever writes the label, so two plugins never disagree.
"""

from __future__ import annotations

import asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.kinds import snapshot_content_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import VOLUME_SNAPSHOT_CONTENTS, Obj

from ..errors import CsiError
from ..state import DriverState
from ..validation import check_id

log = get_logger("csi.snapshot-owners")

MANAGED_BY = "snapshot.storage.kubernetes.io/managed-by"


class SnapshotOwners:
    def __init__(self, client: ApiClient, state: DriverState, node: str, driver: str) -> None:
        self.client, self.state, self.node, self.driver = client, state, node, driver
        # Resynced every minute: a label that failed, or a snapshot this pool got since (a move's, a
        # restart's), is tried again without an event of its own.
        self.informer = SharedInformer(
            client, VOLUME_SNAPSHOT_CONTENTS, label_selector=f"!{MANAGED_BY}", resync_period=60.0
        )
        self.informer.add_handler(
            EventHandler(on_add=self._seen, on_update=lambda _, new: self._seen(new), on_delete=self._gone)
        )
        self._asked: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # A node name longer than a label value may be (63) cannot be the label: such a node's
        # contents must be labelled by hand, as without this watch.
        self.labellable = len(node) <= 63

    async def available(self) -> bool:
        """Whether the cluster serves VolumeSnapshotContents (snapshots may be left out)."""
        try:
            await self.client.list_page(VOLUME_SNAPSHOT_CONTENTS, limit=1)
        except ApiError as e:
            if e.not_found:
                return False
            raise
        return True

    def start(self) -> None:
        self.informer.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.informer.stop()

    def _gone(self, obj: Obj) -> None:
        # Labelled (it left the selector) or deleted: nothing more to do for it.
        self._asked.discard(snapshot_content_view(obj)["metadata"]["name"])

    def _seen(self, obj: Obj) -> None:
        content = snapshot_content_view(obj)
        spec = content.get("spec", {})
        handle = spec.get("source", {}).get("snapshotHandle", "")
        name = content["metadata"]["name"]
        if spec.get("driver") != self.driver or not handle or name in self._asked or not self.labellable:
            return
        snap = self.state.snapshot(handle) if _valid(handle) else None
        if snap is None or not snap.ready:
            return
        self._asked.add(name)
        task = asyncio.get_running_loop().create_task(self._label(name, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _label(self, name: str, handle: str) -> None:
        try:
            await self.client.patch(
                VOLUME_SNAPSHOT_CONTENTS, name, {"metadata": {"labels": {MANAGED_BY: self.node}}}
            )
            log.info(
                "labelled a pre-provisioned snapshot content with its node", content=name, snapshot=handle
            )
        except ApiError as e:
            self._asked.discard(name)  # the next update of the content tries again
            log.warning("could not label a snapshot content", content=name, error=str(e))


def _valid(handle: str) -> bool:
    try:
        check_id(handle, "snapshotHandle")
    except CsiError:
        return False
    return True
