"""The node agent's actual state of the world (kubelet's ActualStateOfWorld,
pkg/kubelet/volumemanager/cache): the publishes (a pod's volume at its target path) and the
stagings (a volume's device at its staging path) the agent began and has not undone, and which of
them are known to be mounted.

A publish or a staging is recorded when its vol_data.json is written, before the CSI call, so the
record names everything the driver may hold; it is confirmed once the call returned (or, at a
restart, once the mount table shows it). Between the two it is uncertain, as kubelet's
VolumeMountUncertain and DeviceMountUncertain: the next pass calls the idempotent CSI call again,
or its inverse if no pod wants it any more.

The state changes only through the `mark_*` methods, which the operations call as they go, and is
read through methods that hand out copies or immutable values. It decides nothing:
`decide.plan_volumes` does, from what it returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .decide import Mounted

PodVolumeKey = tuple[str, str]  # (pod UID, volume name): one publish
VolumeKey = tuple[str, str]  # (driver, volume handle): one staging, and one operation at a time


class VolumeMountState(enum.Enum):
    """kubelet's VolumeMountState of one pod's volume."""

    NOT_MOUNTED = "VolumeNotMounted"
    UNCERTAIN = "VolumeMountUncertain"
    MOUNTED = "VolumeMounted"


class DeviceMountState(enum.Enum):
    """kubelet's DeviceMountState of one volume's staging."""

    NOT_MOUNTED = "DeviceNotMounted"
    UNCERTAIN = "DeviceMountUncertain"
    GLOBALLY_MOUNTED = "DeviceGloballyMounted"


@dataclass
class ActualStateOfWorld:
    # Publishes begun and not undone, and the keys of those confirmed mounted (a subset).
    _publishes: dict[PodVolumeKey, Mounted] = field(default_factory=dict, init=False)
    _mounted: set[PodVolumeKey] = field(default_factory=set, init=False)
    # Stagings begun and not undone, and those confirmed mounted (a subset).
    _stagings: set[VolumeKey] = field(default_factory=set, init=False)
    _globally_mounted: set[VolumeKey] = field(default_factory=set, init=False)
    # Volumes whose driver can grow them only while unstaged (kubelet's in-use expansion error).
    _in_use_expansion_errors: set[VolumeKey] = field(default_factory=set, init=False)

    # -- publishes ---------------------------------------------------------------------------------

    def mark_volume_mount_as_uncertain(self, publish: Mounted) -> None:
        """A publish begun (its vol_data.json written) and not known to be mounted: after a
        restart, or before NodePublishVolume returned."""
        key = (publish.pod_uid, publish.pv_name)
        self._publishes[key] = publish
        self._mounted.discard(key)

    def mark_volume_as_mounted(self, pod_uid: str, pv_name: str) -> None:
        """NodePublishVolume returned, or the target is in the mount table: the pod's volume is
        mounted. The publish must have been recorded (`mark_volume_mount_as_uncertain`)."""
        key = (pod_uid, pv_name)
        if key not in self._publishes:
            raise KeyError(f"no publish of {pv_name} for pod {pod_uid} was begun")
        self._mounted.add(key)

    def mark_volume_as_unmounted(self, pod_uid: str, pv_name: str) -> None:
        """NodeUnpublishVolume returned and the target is gone: the publish is undone."""
        key = (pod_uid, pv_name)
        self._mounted.discard(key)
        self._publishes.pop(key, None)

    def get_volume_mount_state(self, pod_uid: str, pv_name: str) -> VolumeMountState:
        key = (pod_uid, pv_name)
        if key in self._mounted:
            return VolumeMountState.MOUNTED
        if key in self._publishes:
            return VolumeMountState.UNCERTAIN
        return VolumeMountState.NOT_MOUNTED

    def pod_exists_in_volume(self, pod_uid: str, pv_name: str) -> bool:
        """Whether the pod's volume is known to be mounted (an uncertain publish is not, as in
        kubelet)."""
        return (pod_uid, pv_name) in self._mounted

    def get_mounted_volumes(self) -> tuple[Mounted, ...]:
        """The publishes known to be mounted."""
        return tuple(m for key, m in self._publishes.items() if key in self._mounted)

    def get_all_mounted_volumes(self) -> dict[PodVolumeKey, Mounted]:
        """Every publish begun and not undone, mounted or uncertain (a copy)."""
        return dict(self._publishes)

    def get_mounted_volume_keys(self) -> frozenset[PodVolumeKey]:
        """The (pod UID, volume name) of the publishes known to be mounted."""
        return frozenset(self._mounted)

    def get_possibly_mounted_volumes_for_pod(self, pod_uid: str) -> tuple[Mounted, ...]:
        """The pod's publishes begun and not undone, mounted or uncertain."""
        return tuple(m for (uid, _), m in self._publishes.items() if uid == pod_uid)

    def volume_published_for_any_pod(self, key: VolumeKey) -> bool:
        """Whether a publish of the volume, for any pod, was begun and not undone: its staging
        must stay."""
        return any(m.stage_key == key for m in self._publishes.values())

    # -- stagings ----------------------------------------------------------------------------------

    def mark_device_as_uncertain(self, key: VolumeKey) -> None:
        """A staging begun (vol_data.json written before NodeStageVolume) or an unstage begun:
        the staging may or may not be mounted, so a pod that wants the volume gets
        NodeStageVolume again before its publish."""
        self._stagings.add(key)
        self._globally_mounted.discard(key)

    def mark_device_as_mounted(self, key: VolumeKey) -> None:
        """NodeStageVolume returned, or the staging is in the mount table (always, for a block
        volume, whose staging is no mount)."""
        self._stagings.add(key)
        self._globally_mounted.add(key)

    def mark_device_as_unmounted(self, key: VolumeKey) -> None:
        """NodeUnstageVolume returned and the staging is gone."""
        self._stagings.discard(key)
        self._globally_mounted.discard(key)

    def get_device_mount_state(self, key: VolumeKey) -> DeviceMountState:
        if key in self._globally_mounted:
            return DeviceMountState.GLOBALLY_MOUNTED
        if key in self._stagings:
            return DeviceMountState.UNCERTAIN
        return DeviceMountState.NOT_MOUNTED

    def get_possibly_mounted_devices(self) -> frozenset[VolumeKey]:
        """Every staging begun and not undone, mounted or uncertain."""
        return frozenset(self._stagings)

    # -- expansion ---------------------------------------------------------------------------------

    def mark_for_in_use_expansion_error(self, key: VolumeKey) -> None:
        """The driver grows the volume only while it is unstaged: no online attempt until then."""
        self._in_use_expansion_errors.add(key)

    def clear_in_use_expansion_error(self, key: VolumeKey) -> None:
        """The volume is being unstaged: its next NodeStageVolume is the offline growth it waited
        for, and its expansion is then finished like any other."""
        self._in_use_expansion_errors.discard(key)

    def has_in_use_expansion_error(self, key: VolumeKey) -> bool:
        return key in self._in_use_expansion_errors
