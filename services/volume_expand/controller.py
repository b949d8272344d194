"""The expand controller of kube-controller-manager, for a cluster whose volumes are all CSI.

kcm 1.36 expands no volume itself: its in-tree expandable plugins are gone, and the external
resizer finds CSI claims by their PV's driver. What it still does for a bound claim whose request
exceeds its capacity is check that the PV is bound to that claim and tell the user who will act:
a Normal `ExternalExpanding` event, "waiting for an external controller to expand this PVC" (kcm
finds no expandable plugin for a CSI volume, which is not an error: Warning only when the plugin
lookup itself fails, and that cannot happen for a CSI PV).
(It sets `volume.kubernetes.io/storage-resizer` only for in-tree volumes migrated to CSI, which
this cluster has none of.) A PVC informer, a rate-limited queue, one sync per claim at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import PersistentVolumeClaim, as_obj, pv_view, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.resize_status import PRE_RESIZE_CAPACITY
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj, key_of, typed
from controller_runtime.storage import claim_request, storage_of
from controller_runtime.workqueue import WorkQueue, default_rate_limiter

log = get_logger("volume-expand")

COMPONENT = "volume_expand"  # the event source and queue name kcm uses
EXTERNAL_EXPANDING = "ExternalExpanding"
MSG_EXTERNAL = "waiting for an external controller to expand this PVC"


@dataclass(frozen=True)
class Options:
    workers: int = 10  # kcm's fixed worker count


def _bound(claim: PersistentVolumeClaim) -> bool:
    return (claim.get("status") or {}).get("phase") == "Bound"


def _capacity(claim: PersistentVolumeClaim) -> int:
    return storage_of((claim.get("status") or {}).get("capacity"))


class ExpandController(InformerController):
    def __init__(self, context: ControllerContext, options: Options | None = None) -> None:
        super().__init__(context)
        self.options = options or Options()
        self.queue: WorkQueue[str] = WorkQueue(
            COMPONENT, default_rate_limiter(clock=self.clock), clock=self.clock
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.claims.add_handler(EventHandler(self._enqueue, self._updated, self._enqueue))

    def _enqueue(self, obj: Obj) -> None:
        claim = pvc_view(obj)
        if _bound(claim):
            self.queue.add(key_of(claim))

    def _updated(self, old_obj: Obj, new_obj: Obj) -> None:
        old, new = pvc_view(old_obj), pvc_view(new_obj)
        # Only a grown request or a grown capacity is news to this controller (not a resync).
        if claim_request(new) > claim_request(old) or _capacity(new) > _capacity(old):
            self._enqueue(new_obj)

    async def run(self) -> None:
        await self.start_informers()
        log.info("caches synced, starting workers", workers=self.options.workers)
        await run_workers(self.queue, self.sync, self.options.workers)

    async def sync(self, key: str) -> None:
        claim = pvc_view(self.claims.store.get(key))
        if claim is None:
            return
        pv_name = str((claim.get("spec") or {}).get("volumeName") or "")
        if not pv_name:
            return
        try:
            # A live read, as kcm does: the decision is about the PV as it is now.
            pv = pv_view(await self.client.get(PERSISTENT_VOLUMES, pv_name))
        except ApiError as e:
            raise RuntimeError(f'failed to get PV "{pv_name}": {e}') from e
        md, ref = claim["metadata"], (pv.get("spec") or {}).get("claimRef") or {}
        if ref.get("namespace") != md["namespace"] or ref.get("uid") != md["uid"]:
            raise RuntimeError(f"persistent Volume is not bound to PVC being updated : {key}")
        annotations = pv["metadata"].get("annotations") or {}
        if claim_request(claim) <= _capacity(claim) and PRE_RESIZE_CAPACITY not in annotations:
            return
        self.recorder.normal(typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS), EXTERNAL_EXPANDING, MSG_EXTERNAL)
        log.info("claim waits for an external resizer", pvc=key, pv=pv_name)
