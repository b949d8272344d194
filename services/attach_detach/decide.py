"""The attach-detach controller's values and its decision, pure.

The desired state (`desired_state.DesiredState`) hands out `DesiredEntry` per (node, volume); the
actual state (`actual_state.ActualState`) hands out `Attachment` and the node's mounted set;
`decide` turns both into one plan: detaches first, then attaches (or Multi-Attach refusals), then
the node status lists. The controller carries the plan out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from controller_runtime.volumes import CSI_PLUGIN_NAME, va_name

MULTI_ATTACH_PREFIX = 'Multi-Attach error for volume "{pv}" '
# Nobody this controller knows of uses the volume on the other node(s): no pod names to give.
MULTI_ATTACH_EXCLUSIVE = "Volume is already exclusively attached to one node and can't be attached to another"
# kcm builds it as "<prefix> for volume <name> <suffix>" with an empty suffix: it ends in a space.
ATTACH_SUCCEEDED_MESSAGE = 'AttachVolume.Attach succeeded for volume "{pv}" '
ATTACH_FAILED_MESSAGE = 'AttachVolume.Attach failed for volume "{pv}" : {error}'
# kcm's CSI attacher gives up waiting for status.attached after its CSI timeout (2 min) with this.
ATTACH_TIMEOUT_ERROR = (
    "timed out waiting for external-attacher of {driver} CSI driver to attach volume {handle}"
)

TAINT_OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
FORCE_REASON_TIMEOUT = "timeout"
FORCE_REASON_OUT_OF_SERVICE = "out-of-service"


def split_unique_name(unique: str) -> tuple[str, str] | None:
    """(driver, handle) of a CSI unique volume name, None for any other plugin's name."""
    prefix = CSI_PLUGIN_NAME + "/"
    if not unique.startswith(prefix) or "^" not in unique:
        return None
    driver, _, handle = unique[len(prefix) :].partition("^")
    return (driver, handle) if driver and handle else None


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class DesiredVolume:
    pv_name: str
    driver: str
    handle: str
    unique_name: str
    multi_node: bool


@dataclass(frozen=True)
class DesiredEntry:
    """One volume wanted on one node, and the pods that want it there."""

    node: str
    volume: DesiredVolume
    pods: tuple[PodRef, ...]

    @functools.cached_property
    def va_name(self) -> str:
        # A sha256 each time was a sixth of the controller's CPU at 500 pods: a pass asks every
        # entry for it several times, and entries are rebuilt only when a pod changes.
        return va_name(self.volume.handle, self.volume.driver, self.node)


@dataclass(frozen=True)
class Attachment:
    """One (volume, node) of the actual state: a VolumeAttachment as the controller sees it, or a
    volume a node's status.volumesAttached listed at start without one. unique_name is "" when its
    PV is unknown.

    pending: an attach this controller started is still under way (the create is in flight, or
    the VA waits for status.attached within the attach timeout). Like kcm's running attach
    operation it is neither detached nor counted as attached; an exclusive volume waits for it
    silently. A VA that is neither attached nor pending is kcm's "uncertain" attachment: the attach
    failed or timed out, so it may or may not be published; it is detached when no pod wants it but
    does not make another node's attach a Multi-Attach error."""

    name: str
    node: str
    pv_name: str
    driver: str
    handle: str
    unique_name: str
    attached: bool
    deleting: bool
    attach_error: str = ""
    pending: bool = False


@dataclass(frozen=True)
class NodeInfo:
    """A node as the controller knows it, including one deleted since it was last seen (exists
    False, in_use as it last reported: kcm keeps that too)."""

    name: str
    managed: bool
    ready: bool
    in_use: frozenset[str]  # the "mounted by node" set (volumesInUse, plus assumed mounts)
    attached: tuple[str, ...]  # status.volumesAttached names as they are now
    exists: bool = True
    out_of_service: bool = False


@dataclass(frozen=True)
class Detach:
    attachment: Attachment
    # "" for a normal detach; else why it skips the safe-to-detach check (kcm's metric label).
    force_reason: str = ""

    @property
    def forced(self) -> bool:
        return bool(self.force_reason)


@dataclass(frozen=True)
class MultiAttach:
    entry: DesiredEntry
    other_nodes: tuple[str, ...]
    # Pods that want the volume on those nodes (they name the blockers in the event).
    other_pods: tuple[PodRef, ...]


def multi_attach_message(pv: str, pod: PodRef, other_pods: Iterable[PodRef]) -> str:
    """The FailedAttachVolume text for one waiting pod. Names are given only for pods of its own
    namespace; pods elsewhere are counted, so a user never learns another namespace's pod names."""
    others = list(other_pods)
    if not others:
        return MULTI_ATTACH_PREFIX.format(pv=pv) + MULTI_ATTACH_EXCLUSIVE
    local = sorted(p.name for p in others if p.namespace == pod.namespace)
    foreign = sum(1 for p in others if p.namespace != pod.namespace)
    if local:
        detail = "Volume is already used by pod(s) " + ", ".join(local)
        if foreign:
            detail += f" and {foreign} pod(s) in different namespaces"
    else:
        detail = f"Volume is already used by {foreign} pod(s) in different namespaces"
    return MULTI_ATTACH_PREFIX.format(pv=pv) + detail


@dataclass
class Plan:
    detaches: list[Detach] = field(default_factory=list)
    attaches: list[DesiredEntry] = field(default_factory=list)
    multi_attach: list[MultiAttach] = field(default_factory=list)
    # Attachment names no pod wants (the detach timer runs for these, whether detached yet or not).
    detach_requested: set[str] = field(default_factory=set)
    # Of those, the ones whose node still has the volume mounted: the detach waits.
    waiting_for_unmount: set[str] = field(default_factory=set)
    # Node name -> the volumesAttached names it should list (only where that differs from now).
    node_status: dict[str, tuple[str, ...]] = field(default_factory=dict)


def decide(
    desired: list[DesiredEntry],
    attachments: list[Attachment],
    nodes: dict[str, NodeInfo],
    *,
    attach_required: Callable[[str], bool],
    unmount_wait_since: Mapping[str, float],
    now: float,
    max_wait_for_unmount: float,
    detaching: frozenset[str] = frozenset(),
) -> Plan:
    plan = Plan()
    wanted = {e.va_name for e in desired}
    by_name = {a.name: a for a in attachments}

    # 1. Detach what no pod wants, as kcm's reconciler does: a volume the node still has mounted
    # waits, unless the node carries the out-of-service taint (detach at once) or it is unhealthy
    # (not Ready, or gone) and the wait for unmount, counted from the first time the detach was
    # wanted, has expired.
    for att in attachments:
        if att.deleting or att.pending or att.name in wanted or att.name in detaching:
            continue
        if not att.unique_name:
            continue  # its PV is unknown: kcm never takes such a VA into its actual state
        plan.detach_requested.add(att.name)
        node = nodes.get(att.node)
        healthy = node is not None and node.exists and node.ready
        out_of_service = node is not None and node.exists and node.out_of_service
        # A node never seen has told nothing: kcm assumes a new attachment mounted until proven otherwise.
        mounted = node is None or att.unique_name in node.in_use
        expired = now - unmount_wait_since.get(att.name, now) > max_wait_for_unmount
        if mounted and not out_of_service and not (expired and not healthy):
            plan.waiting_for_unmount.add(att.name)
            continue
        reason = FORCE_REASON_TIMEOUT if expired else FORCE_REASON_OUT_OF_SERVICE if out_of_service else ""
        plan.detaches.append(Detach(att, reason))

    # 2. Attach what pods want. An exclusive volume waits silently while an operation on it runs
    # elsewhere (an attach not yet settled, a detach), and is refused with a Multi-Attach error
    # while it is attached to another node. An uncertain attachment elsewhere blocks neither.
    leaving = {d.attachment.name for d in plan.detaches} | set(detaching)
    holders: dict[tuple[str, str], set[str]] = {}
    busy: dict[tuple[str, str], set[str]] = {}
    for att in attachments:
        key = (att.driver, att.handle)
        if att.pending or att.deleting or att.name in leaving:
            busy.setdefault(key, set()).add(att.node)
        elif att.attached:
            holders.setdefault(key, set()).add(att.node)
    pods_by_volume: dict[tuple[str, str], list[tuple[str, PodRef]]] = {}
    for entry in desired:
        volume_pods = pods_by_volume.setdefault((entry.volume.driver, entry.volume.handle), [])
        volume_pods.extend((entry.node, pod) for pod in entry.pods)
    for entry in desired:
        vol = entry.volume
        if not attach_required(vol.driver):
            continue
        if entry.va_name in by_name:
            continue  # attaching, attached, uncertain or still going away: the VA is there either way
        key = (vol.driver, vol.handle)
        if not vol.multi_node:
            if busy.get(key, set()) - {entry.node}:
                continue
            others = holders.get(key, set()) - {entry.node}
            if others:
                blockers = tuple(p for n, p in pods_by_volume.get(key, []) if n in others)
                plan.multi_attach.append(MultiAttach(entry, tuple(sorted(others)), blockers))
                continue
        plan.attaches.append(entry)
        busy.setdefault(key, set()).add(entry.node)

    # 3. Node status: attached, not being deleted, not being detached by this plan.
    lists: dict[str, set[str]] = {n: set() for n, info in nodes.items() if info.managed and info.exists}
    for att in attachments:
        usable = att.attached and not att.deleting and att.unique_name and att.name not in leaving
        if usable and att.node in lists:
            lists[att.node].add(att.unique_name)
    for node_name, names in lists.items():
        target = tuple(sorted(names))
        if tuple(sorted(nodes[node_name].attached)) != target:
            plan.node_status[node_name] = target
    return plan
