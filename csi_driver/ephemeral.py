"""CSI ephemeral inline volumes: what a pod's `csi:` volume asks for, read from the volume
attributes kubelet passes to NodePublishVolume.

kubelet publishes an inline volume without staging it and without any controller call: the
`volume_id` is its own (`csi-` and a SHA-256 of the pod's UID and the volume's name), and the
volume context holds the pod's `volumeAttributes` plus, because the CSIDriver says
`podInfoOnMount: true`, the pod's identity and `csi.storage.k8s.io/ephemeral: "true"`. The node
plugin makes the volume in its pool at the first publish and removes it at the unpublish:

    volumeAttributes:
      size: 256Mi        # a Kubernetes quantity; 100Mi when not given (hostpath's size)
      fsType: xfs        # ext4 (the default), xfs, ext3 or ext2; or the inline source's fsType
      kind: fast         # the pool kind whose --capacity it takes from (a pool split into kinds)

Its size comes out of the pool's --capacity, as a persistent volume's does (csi_driver.budget).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from controller_runtime.quantity import parse_quantity

from .backend.fs import DEFAULT_FS, SUPPORTED
from .errors import invalid, out_of_range
from .pool_kinds import KIND_PARAMETER
from .validation import SIZE_UNIT, MiB, format_size, round_up

EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
# What kubelet adds (pod info, service account tokens): read by nobody here, never refused.
KUBELET_PREFIX = "csi.storage.k8s.io/"
SIZE = "size"
FS_TYPE = "fsType"
KIND = KIND_PARAMETER  # as a StorageClass names it (and hostpath's inline volumes)
DEFAULT_SIZE = 100 * MiB
# mkfs.xfs refuses filesystems smaller than this.
XFS_MIN = 300 * MiB
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def is_ephemeral(volume_context: Mapping[str, str]) -> bool:
    return volume_context.get(EPHEMERAL_KEY) == "true"


@dataclass(frozen=True)
class InlineVolume:
    size: int
    fs_type: str
    kind: str = ""  # checked against the pool's kinds where the budget is decided


def inline_volume(volume_context: Mapping[str, str], capability_fs_type: str, max_size: int) -> InlineVolume:
    """The volume an inline `csi:` source asks for, or INVALID_ARGUMENT (OUT_OF_RANGE for a size
    over --max-volume-size) saying what is wrong with the pod's volumeAttributes."""
    unknown = sorted(
        k for k in volume_context if k not in (SIZE, FS_TYPE, KIND) and not k.startswith(KUBELET_PREFIX)
    )
    if unknown:
        raise invalid(
            f"unknown volumeAttributes {', '.join(unknown)} for an inline volume; it takes {SIZE} (a "
            f"quantity such as 256Mi), {FS_TYPE} ({', '.join(SUPPORTED)}) and {KIND} (a pool kind)"
        )
    text = volume_context.get(SIZE, "").strip()
    if text and not _QUANTITY.match(text):
        raise invalid(f"volumeAttributes {SIZE}={text[:64]!r} is not a quantity such as 256Mi")
    size = round_up(parse_quantity(text), SIZE_UNIT) if text else DEFAULT_SIZE
    if size <= 0:
        raise invalid(f"volumeAttributes {SIZE}={text!r} must be more than zero")
    if size > max_size:
        raise out_of_range(
            f"an inline volume of {format_size(size)} is larger than the maximum volume size "
            f"{format_size(max_size)} (--max-volume-size)"
        )
    from_attributes = volume_context.get(FS_TYPE, "")
    if from_attributes and capability_fs_type and from_attributes != capability_fs_type:
        raise invalid(
            f"volumeAttributes {FS_TYPE}={from_attributes!r} and the volume's fsType "
            f"{capability_fs_type!r} differ"
        )
    fs_type = from_attributes or capability_fs_type or DEFAULT_FS
    if fs_type not in SUPPORTED:
        raise invalid(f"filesystem {fs_type!r} is not supported; use one of {', '.join(SUPPORTED)}")
    if fs_type == "xfs" and size < XFS_MIN:
        raise invalid(
            f"an xfs volume must hold at least {format_size(XFS_MIN)}; {SIZE} is {format_size(size)}"
        )
    return InlineVolume(size, fs_type, volume_context.get(KIND, ""))
