"""The node agent's volume decisions, pure: what to unmount, mount and unstage, in kubelet's order,
and what the node must report in volumesInUse."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Set
from dataclasses import dataclass, field

from controller_runtime.volumes import CSIVolume, unique_volume_name


@dataclass(frozen=True)
class PodVolume:
    """A volume one pod wants mounted."""

    pod_uid: str
    pod_key: str  # namespace/name
    volume: CSIVolume
    read_only: bool

    @property
    def key(self) -> tuple[str, str]:
        return (self.pod_uid, self.volume.pv_name)

    @property
    def stage_key(self) -> tuple[str, str]:
        return (self.volume.driver, self.volume.handle)


@dataclass(frozen=True)
class Mounted:
    """A publish the agent began (vol_data.json on disk), confirmed or not."""

    pod_uid: str
    pv_name: str
    driver: str
    handle: str
    block: bool
    ephemeral: bool = False  # an inline volume: never staged, never in use for an attach

    @property
    def stage_key(self) -> tuple[str, str]:
        return (self.driver, self.handle)


@dataclass
class VolumePlan:
    unmount: list[Mounted] = field(default_factory=list)
    mount: list[PodVolume] = field(default_factory=list)
    unstage: list[tuple[str, str]] = field(default_factory=list)
    in_use: tuple[str, ...] = ()


def plan_volumes(
    desired: Sequence[PodVolume],
    mounted: Mapping[tuple[str, str], Mounted],
    confirmed: Collection[tuple[str, str]],
    staged: Set[tuple[str, str]],
) -> VolumePlan:
    """`mounted` holds every publish begun; `confirmed` those known to be mounted now (after a
    restart a publish is unconfirmed until NodePublishVolume, idempotent, has run again)."""
    plan = VolumePlan()
    wanted = {pv.key for pv in desired}
    # Inline volumes are never staged, attached or reported in use: only published.
    wanted_stage = {pv.stage_key for pv in desired if not pv.volume.ephemeral}
    plan.unmount = [m for k, m in sorted(mounted.items()) if k not in wanted]
    plan.mount = [pv for pv in desired if pv.key not in confirmed]
    still_used = wanted_stage | {m.stage_key for k, m in mounted.items() if not m.ephemeral}
    plan.unstage = sorted(s for s in staged if s not in still_used)
    # A volume stays in use from the moment a pod wants it until it is unstaged: the controller
    # must not detach it while anything on this node may still touch the device.
    plan.in_use = tuple(sorted(unique_volume_name(d, h) for d, h in wanted_stage | staged | still_used))
    return plan


def ready_to_mount(
    pv: PodVolume, in_use: Collection[str], attached: Collection[str], attach_required: bool
) -> bool:
    """Whether a volume the plan mounts may be mounted now, from the node's status: an inline
    volume at once; any other once the node reports it in volumesInUse (reported first, mounted
    after: the attach-detach controller must see it in use), and, when its driver needs an attach,
    once the node lists it in volumesAttached."""
    vol = pv.volume
    if vol.ephemeral:
        return True
    if vol.unique_name not in in_use:
        return False
    return not attach_required or vol.unique_name in attached
