"""Pod status, kubelet's status manager and the end of its pod deletion: a pod whose volumes are
all mounted is reported Running (conditions and a running status per container; nothing runs), and
a pod being deleted is deleted for good once none of its volumes is published any more.

The writes run in the background, as kubelet's status manager runs beside its volume manager: the
volume pass that found a pod ready does not wait for them, so the next unstage and the
volumesInUse write that lets the volume detach never queue behind a batch of pod writes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.clock import now_rfc3339
from controller_runtime.informer import SharedInformer
from controller_runtime.kinds import Pod, pod_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import PODS
from controller_runtime.volumes import pod_terminated

from .decide import PodVolume
from .disk import remove_pod_dir
from .volume_manager import VolumeManager

log = get_logger("node-agent")

# A request that never reached the apiserver (restarting, unreachable): nothing was written.
# (The API client's transport errors are ConnectionErrors, and TimeoutError an OSError too.)
TRANSPORT_ERRORS = (OSError,)


class PodStatus:
    def __init__(
        self, client: ApiClient, pods: SharedInformer, pods_dir: Path, volumes: VolumeManager
    ) -> None:
        self.client = client
        self.pods = pods
        self.pods_dir = pods_dir
        self.volumes = volumes
        self._deleting: set[str] = set()
        self._reported_running: set[str] = set()
        self._writes: set[asyncio.Task[None]] = set()

    def sync(self, complete: Mapping[str, Sequence[PodVolume]]) -> None:
        """Starts the writes the pods need now. `complete`: per pod key whose claims all resolve,
        its volumes (from the volume pass). A write that fails is started again by a later call."""
        writes: list[tuple[Coroutine[Any, Any, None], str, set[str]]] = []
        present = set()
        for obj in self.pods.store.values():
            pod = pod_view(obj)
            md = pod["metadata"]
            key, uid = f"{md.get('namespace', '')}/{md['name']}", md.get("uid", "")
            present.add(uid)
            if md.get("deletionTimestamp"):
                busy = self.volumes.pod_could_have_mounted_volumes(uid)
                if not busy and uid not in self._deleting:
                    self._deleting.add(uid)
                    writes.append((self._finish_deletion(pod), uid, self._deleting))
                continue
            vols = complete.get(key)
            if vols is None or pod_terminated(pod) or uid in self._reported_running:
                continue
            if self.volumes.all_mounted(vols):
                self._reported_running.add(uid)
                writes.append((self._set_running(pod), uid, self._reported_running))
        # Pods gone from the cache need no mark: without this the sets grow by every pod the node
        # ever had.
        self._deleting &= present
        self._reported_running &= present
        for write, uid, marks in writes:
            task = asyncio.create_task(self._guarded(write, uid, marks))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    @staticmethod
    async def _guarded(write: Coroutine[Any, Any, None], uid: str, marks: set[str]) -> None:
        """A write that failed in a way it did not foresee is logged and left for a later pass
        (its mark cleared), as a failure of the pass that awaited it used to be."""
        try:
            await write
        except Exception:
            marks.discard(uid)
            log.exception("pod status write failed", pod_uid=uid)

    async def settled(self) -> None:
        """Waits for the writes started so far."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await self.settled()

    async def _set_running(self, pod: Pod) -> None:
        md = pod["metadata"]
        status = pod.get("status") or {}
        if status.get("phase") == "Running" and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        ):
            return
        now = now_rfc3339()
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        ]
        containers = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "containerID": f"kubeloop://{md.get('uid', '')}/{c['name']}",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod.get("spec", {}).get("containers") or []
        ]
        patch = {
            "status": {
                "phase": "Running",
                "conditions": conditions,
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "startTime": status.get("startTime") or now,
                "containerStatuses": containers,
            }
        }
        try:
            await self.client.patch(
                PODS, md["name"], patch, namespace=md.get("namespace"), subresource="status"
            )
            log.info("pod running", pod=f"{md.get('namespace')}/{md['name']}")
        except ApiError as exc:
            self._reported_running.discard(md.get("uid", ""))
            if not exc.not_found:
                log.warning("could not update pod status", pod=md["name"], error=str(exc))
        except TRANSPORT_ERRORS as exc:
            # The apiserver was unreachable: not reported, so the next pass tries again.
            self._reported_running.discard(md.get("uid", ""))
            log.warning("could not update pod status", pod=md["name"], error=str(exc))

    async def _finish_deletion(self, pod: Pod) -> None:
        """Deletes the pod for good (grace period 0) once nothing of it is mounted, as kubelet does
        after its containers stopped and volumes were torn down."""
        md = pod["metadata"]
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": md.get("uid", "")},
        }
        try:
            await self.client.request("DELETE", PODS.path(md.get("namespace"), md["name"]), body=body)
            log.info("pod deleted", pod=f"{md.get('namespace')}/{md['name']}")
        except ApiError as exc:
            if not (exc.not_found or exc.conflict):
                self._deleting.discard(md.get("uid", ""))
                log.warning("could not delete pod", pod=md["name"], error=str(exc))
        except TRANSPORT_ERRORS as exc:
            self._deleting.discard(md.get("uid", ""))
            log.warning("could not delete pod", pod=md["name"], error=str(exc))
            return
        await asyncio.to_thread(remove_pod_dir, self.pods_dir / md.get("uid", "x"))
