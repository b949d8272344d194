"""Node expansion, kubelet's part of a resize: once the external resizer has grown the volume and
set the claim's resize status to NodeResizePending, NodeExpandVolume grows what the node sees (the
loop device, then the filesystem), and the claim's status capacity is set.

It runs for a volume in use on this node: online for one already mounted, and at mount time for
one expanded while no pod used it. The claim is read live (not from the cache) before anything is
decided, as kubelet does, and every status write carries the resourceVersion read.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from controller_runtime import resize_status as rs
from controller_runtime.client import ApiClient
from controller_runtime.clock import now_rfc3339
from controller_runtime.csi_client import error_text
from controller_runtime.events import EventRecorder
from controller_runtime.kinds import PersistentVolume, PersistentVolumeClaim, as_obj, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.quantity import format_quantity, parse_quantity
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, Obj, typed
from controller_runtime.storage import storage_of
from controller_runtime.volumes import CSIVolume
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

log = get_logger("node-agent")

FS_RESIZE_SUCCESSFUL = "FileSystemResizeSuccessful"
FS_RESIZE_FAILED = "FileSystemResizeFailed"
VOLUME_RESIZE_FAILED = "VolumeResizeFailed"


def pending_size(claim: PersistentVolumeClaim, pv: PersistentVolume) -> int | None:
    """The size the node must grow the volume to, or None when the node has nothing to do: the
    claim's status is below the PV's capacity and the resizer handed it over (NodeResizePending,
    or NodeResizeInProgress after an interrupted attempt)."""
    status = claim.get("status") or {}
    if rs.resize_status(claim) not in (rs.NODE_PENDING, rs.NODE_IN_PROGRESS):
        return None
    pv_size = storage_of((pv.get("spec") or {}).get("capacity"))
    if storage_of(status.get("capacity")) >= pv_size:
        return None
    allocated = (status.get("allocatedResources") or {}).get("storage")
    return parse_quantity(allocated) if allocated is not None else pv_size


@dataclass(frozen=True)
class Target:
    """One volume as the node sees it, for NodeExpandVolume."""

    volume: CSIVolume
    volume_path: str  # a pod's mount (or block device) path
    staging_path: str  # "" for a driver without STAGE_UNSTAGE
    capability: csi_pb2.VolumeCapability
    read_only: bool
    pod: Obj  # a pod using it, for the events


class InUseExpansionError(Exception):
    """The driver can grow this volume only while it is not staged (FAILED_PRECONDITION)."""


class NodeExpander:
    def __init__(
        self, client: ApiClient, recorder: EventRecorder, node_name: str, csi_timeout: float
    ) -> None:
        self.client = client
        self.recorder = recorder
        self.node_name = node_name
        self.csi_timeout = csi_timeout

    async def expand(
        self,
        node: csi_pb2_grpc.NodeStub,
        t: Target,
        claim_ns: str,
        claim_name: str,
        pv: PersistentVolume,
    ) -> bool:
        """Grows the volume if its claim still asks for it; whether it did. Raises on failure
        (InUseExpansionError when only an offline expansion can work)."""
        claim = pvc_view(await self.client.get(PERSISTENT_VOLUME_CLAIMS, claim_name, claim_ns))
        size = pending_size(claim, pv)
        if size is None:
            return False
        pv_name = t.volume.pv_name
        claim_ref = typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS)
        if t.read_only:
            message = (
                f'MountVolume.NodeExpandVolume failed for volume "{pv_name}" requested read-only file system'
            )
            self.recorder.warning(t.pod, FS_RESIZE_FAILED, message)
            self.recorder.warning(claim_ref, FS_RESIZE_FAILED, message)
            return False
        claim = await self._patch(claim, rs.node_in_progress(claim.get("status") or {}))
        try:
            await node.NodeExpandVolume(
                csi_pb2.NodeExpandVolumeRequest(
                    volume_id=t.volume.handle,
                    volume_path=t.volume_path,
                    staging_target_path=t.staging_path,
                    capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                    volume_capability=t.capability,
                ),
                timeout=self.csi_timeout,
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise InUseExpansionError(error_text(exc)) from exc
            if rs.is_final(code):
                failed = rs.node_failed(
                    claim.get("status") or {},
                    f"failed to expand pvc with {error_text(exc)}",
                    rs.is_infeasible(code),
                    now_rfc3339(),
                )
                await self._patch(claim, failed, resource_version=False)
            raise
        message = f'MountVolume.NodeExpandVolume succeeded for volume "{pv_name}" {self.node_name}'
        self.recorder.normal(t.pod, FS_RESIZE_SUCCESSFUL, message)
        self.recorder.normal(claim_ref, FS_RESIZE_SUCCESSFUL, message)
        await self._patch(claim, rs.finished(claim.get("status") or {}, format_quantity(size)))
        log.info("expanded volume on node", pv=pv_name, size=size, pvc=f"{claim_ns}/{claim_name}")
        return True

    async def _patch(
        self, claim: PersistentVolumeClaim, status: Obj, *, resource_version: bool = True
    ) -> PersistentVolumeClaim:
        body: Obj = {"status": rs.status_patch(claim.get("status") or {}, status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": claim["metadata"]["resourceVersion"]}
        updated = await self.client.patch(
            PERSISTENT_VOLUME_CLAIMS,
            claim["metadata"]["name"],
            body,
            namespace=claim["metadata"]["namespace"],
            subresource="status",
        )
        return pvc_view(updated)
