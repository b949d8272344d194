"""Names and small pure helpers that the attach/mount path shares: the attach-detach controller,
the external-attacher and the node agent must agree on them byte for byte (see docs/contracts.md)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kubeloop_grpc.csi import csi_pb2

from .attach_rules import multi_attach_allowed
from .kinds import PersistentVolume, PersistentVolumeClaim, Pod, pod_view
from .resources import Obj, object_key
from .storage import ROX, RWO, RWOP, RWX

ANN_CONTROLLER_MANAGED = "volumes.kubernetes.io/controller-managed-attach-detach"
ANN_NODE_ID = "csi.volume.kubernetes.io/nodeid"
# kubeloop's node agent: where it serves kubelet's volume metrics (a real kubelet is read through the
# apiserver's node proxy instead), for `kubectl kubeloop get volumes`.
ANN_METRICS_URL = "kubeloop.dev/metrics-url"
CSI_PLUGIN_NAME = "kubernetes.io/csi"


def va_name(handle: str, driver: str, node: str) -> str:
    """VolumeAttachment name: csi- + hex sha256 of the plain concatenation."""
    return "csi-" + hashlib.sha256(f"{handle}{driver}{node}".encode()).hexdigest()


def unique_volume_name(driver: str, handle: str) -> str:
    """The name in Node status.volumesAttached / volumesInUse."""
    return f"{CSI_PLUGIN_NAME}/{driver}^{handle}"


def attacher_finalizer(driver: str) -> str:
    return "external-attacher/" + re.sub(r"[^a-zA-Z0-9-]", "-", driver)


@dataclass(frozen=True)
class CSIVolume:
    """What the attach/mount path needs from a bound PV with a spec.csi source."""

    pv_name: str
    driver: str
    handle: str
    access_modes: tuple[str, ...]
    block: bool
    fs_type: str
    read_only: bool
    mount_options: tuple[str, ...]
    attributes: dict[str, str]
    # A pod's inline `csi:` volume (lifecycle mode Ephemeral): no PV, no attach, no stage; only
    # NodePublishVolume and NodeUnpublishVolume. `pv_name` is then the pod's volume name.
    ephemeral: bool = False

    @property
    def unique_name(self) -> str:
        return unique_volume_name(self.driver, self.handle)

    @property
    def multi_node(self) -> bool:
        """Several nodes may attach it at once: `multi_attach_allowed` of its access modes."""
        return multi_attach_allowed(self.access_modes)


def csi_volume(pv: PersistentVolume) -> CSIVolume | None:
    spec = pv.get("spec") or {}
    csi = spec.get("csi")
    if not csi or not csi.get("driver") or not csi.get("volumeHandle"):
        return None
    return CSIVolume(
        pv_name=str(pv.get("metadata", {}).get("name", "")),
        driver=str(csi["driver"]),
        handle=str(csi["volumeHandle"]),
        access_modes=tuple(spec.get("accessModes") or ()),
        block=spec.get("volumeMode") == "Block",
        fs_type=str(csi.get("fsType") or ""),
        read_only=bool(csi.get("readOnly")),
        mount_options=tuple(spec.get("mountOptions") or ()),
        attributes=dict(csi.get("volumeAttributes") or {}),
    )


def inline_volume_handle(pod_uid: str, volume_name: str) -> str:
    """The volume_id kubelet gives an inline CSI volume: csi- + hex sha256 of the pod's UID and
    the volume's name, concatenated."""
    return "csi-" + hashlib.sha256(f"{pod_uid}{volume_name}".encode()).hexdigest()


def inline_csi_volumes(pod: Pod) -> list[CSIVolume]:
    """A pod's inline `csi:` volumes, as kubelet hands them to the driver (the pod's information,
    which the CSIDriver decides about, is for the caller to add to `attributes`)."""
    uid = str(pod.get("metadata", {}).get("uid", ""))
    out = []
    for vol in pod.get("spec", {}).get("volumes") or []:
        src = vol.get("csi")
        if not src or not src.get("driver"):
            continue
        out.append(
            CSIVolume(
                pv_name=str(vol["name"]),
                driver=str(src["driver"]),
                handle=inline_volume_handle(uid, str(vol["name"])),
                access_modes=(RWO,),
                block=False,
                fs_type=str(src.get("fsType") or ""),
                read_only=bool(src.get("readOnly")),
                mount_options=(),
                attributes=dict(src.get("volumeAttributes") or {}),
                ephemeral=True,
            )
        )
    return out


def pod_info_attributes(pod: Pod, ephemeral: bool) -> dict[str, str]:
    """What kubelet adds to a volume's context when the CSIDriver says podInfoOnMount."""
    md, spec = pod.get("metadata", {}), pod.get("spec", {})
    return {
        "csi.storage.k8s.io/pod.name": str(md.get("name", "")),
        "csi.storage.k8s.io/pod.namespace": str(md.get("namespace", "")),
        "csi.storage.k8s.io/pod.uid": str(md.get("uid", "")),
        "csi.storage.k8s.io/serviceAccount.name": str(spec.get("serviceAccountName") or "default"),
        "csi.storage.k8s.io/ephemeral": "true" if ephemeral else "false",
    }


def pod_claims(pod: Pod) -> list[tuple[str, str, bool]]:
    """(volume name in the pod, claim name, readOnly) of each PVC-backed volume, including generic
    ephemeral volumes (their claim is `<pod>-<volume>`)."""
    pod_name = pod.get("metadata", {}).get("name", "")
    out = []
    for vol in pod.get("spec", {}).get("volumes") or []:
        src = vol.get("persistentVolumeClaim")
        if src:
            out.append((vol["name"], str(src.get("claimName", "")), bool(src.get("readOnly"))))
        elif vol.get("ephemeral"):
            out.append((vol["name"], f"{pod_name}-{vol['name']}", False))
    return out


def pod_claim_keys(obj: Obj) -> list[str]:
    """`namespace/claim` of each claim a pod uses: an informer's index function, so it takes the
    cached object and views it as a Pod."""
    pod = pod_view(obj)
    ns = pod.get("metadata", {}).get("namespace", "")
    return [object_key(ns, claim) for _, claim, _ in pod_claims(pod)]


def bound_volume_name(pvc: PersistentVolumeClaim | None, pv: PersistentVolume | None = None) -> str:
    """The PV name of a Bound claim (and, when the PV is given, only if it points back at the
    claim's UID: a half-made bind must not be attached)."""
    if pvc is None or pvc.get("status", {}).get("phase") != "Bound":
        return ""
    name = str(pvc.get("spec", {}).get("volumeName") or "")
    if pv is not None:
        ref = pv.get("spec", {}).get("claimRef") or {}
        if ref.get("uid") and ref.get("uid") != pvc.get("metadata", {}).get("uid"):
            return ""
    return name


def pod_terminated(pod: Pod) -> bool:
    """kubelet's and the attach-detach controller's notion: finished, or being deleted with no
    container running any more."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    if not pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return not any("running" in (cs.get("state") or {}) for cs in status.get("containerStatuses") or [])


def csi_access_mode(mode: str, single_node_multi_writer: bool) -> int | None:
    """A Kubernetes access mode as CSI's, None for one CSI has no name for. A driver with
    SINGLE_NODE_MULTI_WRITER gets the precise modes: ReadWriteOnce lets several pods of one node
    write, ReadWriteOncePod only one."""
    return (_CSI_MODES_MULTI_WRITER if single_node_multi_writer else _CSI_MODES).get(mode)


_Mode = csi_pb2.VolumeCapability.AccessMode.Mode
# Built once: each name read from a protobuf enum wrapper is a Python-level __getattr__, and
# CreateVolume and every node call map a mode.
_CSI_MODES: dict[str, int] = {
    RWO: _Mode.SINGLE_NODE_WRITER,
    RWOP: _Mode.SINGLE_NODE_WRITER,
    ROX: _Mode.MULTI_NODE_READER_ONLY,
    RWX: _Mode.MULTI_NODE_MULTI_WRITER,
}
_CSI_MODES_MULTI_WRITER: dict[str, int] = {
    **_CSI_MODES,
    RWO: _Mode.SINGLE_NODE_MULTI_WRITER,
    RWOP: _Mode.SINGLE_NODE_SINGLE_WRITER,
}


def capability(
    access_mode: int, block: bool, fs_type: str = "", mount_flags: Iterable[str] = ()
) -> csi_pb2.VolumeCapability:
    cap = csi_pb2.VolumeCapability(access_mode=csi_pb2.VolumeCapability.AccessMode(mode=access_mode))
    if block:
        cap.block.SetInParent()
    else:
        cap.mount.fs_type = fs_type
        cap.mount.mount_flags.extend(mount_flags)
    return cap


def volume_capability(vol: CSIVolume, single_node_multi_writer: bool = False) -> csi_pb2.VolumeCapability:
    """The CSI VolumeCapability the node agent sends for a PV: the widest access mode the PV
    lists, block or mount (fsType, mount options). The controller sidecars use pv_capability."""
    widest = next((m for m in (RWX, ROX, RWO, RWOP) if m in vol.access_modes), RWO)
    mode = csi_access_mode(widest, single_node_multi_writer)
    assert mode is not None
    return capability(mode, vol.block, vol.fs_type, vol.mount_options)


def pv_access_mode(modes: Iterable[str], single_node_multi_writer: bool) -> int:
    """The one CSI access mode for a PV's whole list of modes, as csi-lib-utils' ToCSIAccessMode
    gives it to the external-attacher and -resizer: ReadWriteMany wins over everything, and the
    lists CSI has no mode for are refused with its messages (ValueError) rather than mapped to
    something near: ReadOnlyMany with ReadWriteOnce would be published read-only to a writer."""
    Mode = csi_pb2.VolumeCapability.AccessMode.Mode
    listed = list(modes)
    present = set(listed)
    if RWOP in present:
        if len(present) > 1:
            raise ValueError(
                "Kubernetes does not support use of ReadWriteOncePod with other access modes on the same "
                "PersistentVolume"
            )
        return int(Mode.SINGLE_NODE_SINGLE_WRITER if single_node_multi_writer else Mode.SINGLE_NODE_WRITER)
    if RWX in present:
        return int(Mode.MULTI_NODE_MULTI_WRITER)
    if ROX in present and RWO in present:
        raise ValueError("CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume")
    if ROX in present:
        return int(Mode.MULTI_NODE_READER_ONLY)
    if RWO in present:
        return int(Mode.SINGLE_NODE_MULTI_WRITER if single_node_multi_writer else Mode.SINGLE_NODE_WRITER)
    raise ValueError(f"unsupported AccessMode combination: [{' '.join(listed)}]")


def pv_capability(vol: CSIVolume, single_node_multi_writer: bool) -> csi_pb2.VolumeCapability:
    """The VolumeCapability the external-attacher and -resizer send for a PV (their
    GetVolumeCapabilities): pv_access_mode of its modes, block or mount with its fsType and
    mount options. Raises ValueError for a list of modes CSI cannot express."""
    return capability(
        pv_access_mode(vol.access_modes, single_node_multi_writer), vol.block, vol.fs_type, vol.mount_options
    )
