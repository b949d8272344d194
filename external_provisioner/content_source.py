"""The content a clone or a restore starts from: the source claim's volume handle, or the
VolumeSnapshot's snapshot handle, that CreateVolume's volume_content_source names, with the Go
sidecar's reasons for refusing a source (they are the ProvisioningFailed event's text). The checks
that need no I/O (volume modes) are decide's."""

from __future__ import annotations

from dataclasses import dataclass

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import (
    PersistentVolumeClaim,
    StorageClass,
    pv_view,
    pvc_view,
    snapshot_content_view,
    snapshot_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import (
    PERSISTENT_VOLUMES,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    key_of,
    object_key,
)
from controller_runtime.storage import is_deleting
from controller_runtime.store import Store

from . import names
from .decide import DataSource, clone_mode_error, mode_change_granted, restore_mode_error
from .request import ProvisionError, go_quote

log = get_logger("external-provisioner")


@dataclass(frozen=True)
class Content:
    volume: str = ""  # a clone's: the source claim's volume handle
    snapshot: str = ""  # a restore's: the snapshot's handle
    # A restore's: the VolumeSnapshotContent lets the claim have another volume mode (its
    # allow-volume-mode-change annotation), a grant CreateVolume passes on to the driver.
    mode_change_granted: bool = False


def _claim_status(claim: PersistentVolumeClaim) -> str:
    """A claim's status as Go prints the struct with %v, for the one message that quotes it."""
    st = claim.get("status") or {}
    modes = " ".join(st.get("accessModes") or [])
    capacity = " ".join(f"{k}:{v}" for k, v in sorted((st.get("capacity") or {}).items()))
    return f"{{{st.get('phase', '')} [{modes}] map[{capacity}] [] map[] map[] <nil> <nil>}}"


class ContentSources:
    """Reads a claim's data source: the source claim from the claims cache (the provisioning
    controller's), its PV, the VolumeSnapshot and its content from the API. `prevent_mode_conversion`
    is --prevent-volume-mode-conversion."""

    def __init__(self, client: ApiClient, claims: Store, prevent_mode_conversion: bool = True) -> None:
        self.client = client
        self.claims = claims
        self.prevent_mode_conversion = prevent_mode_conversion

    async def content(
        self, claim: PersistentVolumeClaim, storage_class: StorageClass, source: DataSource
    ) -> Content:
        try:
            if source.clone:
                return Content(volume=await self._clone_source(claim, storage_class, source))
            return await self._snapshot_source(claim, storage_class, source)
        except ProvisionError as exc:
            raise ProvisionError(
                f"error getting handle for DataSource Type {source.kind} by Name {source.name}: {exc}"
            ) from exc

    async def _clone_source(
        self, claim: PersistentVolumeClaim, storage_class: StorageClass, source: DataSource
    ) -> str:
        src = pvc_view(self.claims.get(object_key(source.namespace, source.name)))
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
            pv = pv_view(await self.client.get(PERSISTENT_VOLUMES, volume_name))
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
        if (problem := clone_mode_error(claim, pv)) is not None:
            raise ProvisionError(problem)
        return str(csi["volumeHandle"])

    async def _snapshot_source(
        self, claim: PersistentVolumeClaim, storage_class: StorageClass, source: DataSource
    ) -> Content:
        name = source.name
        try:
            snap = snapshot_view(await self.client.get(VOLUME_SNAPSHOTS, name, source.namespace))
        except ApiError as exc:
            raise ProvisionError(f"error getting snapshot {name} from api server: {exc.message}") from exc
        if is_deleting(snap) and names.SNAPSHOT_FINALIZER not in (snap["metadata"].get("finalizers") or []):
            raise ProvisionError(f"snapshot {name} is being deleted")
        status = snap.get("status") or {}
        content_name = status.get("boundVolumeSnapshotContentName")
        if not content_name:
            raise ProvisionError(f"snapshot {name} not bound")
        try:
            content = snapshot_content_view(await self.client.get(VOLUME_SNAPSHOT_CONTENTS, content_name))
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
        problem = restore_mode_error(claim, content, prevent=self.prevent_mode_conversion)
        if problem is not None:
            raise ProvisionError(problem)
        return Content(snapshot=str(handle), mode_change_granted=mode_change_granted(content))
