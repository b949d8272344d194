"""The attach-detach controller's worlds and its decision, as pure data and functions.

Desired state: which volume each pod on a managed node needs (kept per pod, so a pod's update
replaces exactly its own contribution). Actual state: what VolumeAttachments exist, read afresh
from the cache on every pass, with the node's volumesInUse as the "mounted by node" flag. `decide`
turns both into one plan: detaches first, then attaches (or Multi-Attach refusals), then the node
status lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from controller_runtime.volumes import va_name

MULTI_ATTACH_MESSAGE = (
    'Multi-Attach error for volume "{pv}" Volume is already exclusively attached to one node and '
    "can't be attached to another"
)
ATTACH_SUCCEEDED_MESSAGE = 'AttachVolume.Attach succeeded for volume "{pv}"'
ATTACH_FAILED_MESSAGE = 'AttachVolume.Attach failed for volume "{pv}" : {error}'


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

    @property
    def va_name(self) -> str:
        return va_name(self.volume.handle, self.volume.driver, self.node)


@dataclass
class DesiredState:
    # pod key -> (pod, node, volumes): one pod's whole contribution, replaced as a unit.
    pods: dict[str, tuple[PodRef, str, tuple[DesiredVolume, ...]]] = field(default_factory=dict)

    def set_pod(self, pod: PodRef, node: str, volumes: Iterable[DesiredVolume]) -> None:
        vols = tuple(volumes)
        if vols:
            self.pods[pod.key] = (pod, node, vols)
        else:
            self.pods.pop(pod.key, None)

    def remove_pod(self, key: str) -> None:
        self.pods.pop(key, None)

    def entries(self) -> list[DesiredEntry]:
        """Entries in a stable order (node, then volume), so concurrent wishes for one exclusive
        volume are resolved the same way on every pass."""
        grouped: dict[tuple[str, str], tuple[DesiredVolume, list[PodRef]]] = {}
        for pod, node, vols in self.pods.values():
            for vol in vols:
                slot = grouped.setdefault((node, vol.unique_name), (vol, []))
                slot[1].append(pod)
        return [
            DesiredEntry(node, vol, tuple(sorted(pods, key=lambda p: p.key)))
            for (node, _), (vol, pods) in sorted(grouped.items())
        ]


@dataclass(frozen=True)
class Attachment:
    """A VolumeAttachment as the controller sees it. unique_name is "" when its PV is unknown."""

    name: str
    node: str
    pv_name: str
    driver: str
    handle: str
    unique_name: str
    attached: bool
    deleting: bool
    attach_error: str = ""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    managed: bool
    ready: bool
    in_use: frozenset[str]
    attached: tuple[str, ...]  # status.volumesAttached names as they are now


@dataclass(frozen=True)
class Detach:
    attachment: Attachment
    forced: bool


@dataclass(frozen=True)
class MultiAttach:
    entry: DesiredEntry
    other_nodes: tuple[str, ...]


@dataclass
class Plan:
    detaches: list[Detach] = field(default_factory=list)
    attaches: list[DesiredEntry] = field(default_factory=list)
    multi_attach: list[MultiAttach] = field(default_factory=list)
    # VA names that should be detached but whose node still reports the volume in use.
    waiting_for_unmount: set[str] = field(default_factory=set)
    # Node name -> the volumesAttached names it should list (only where that differs from now).
    node_status: dict[str, tuple[str, ...]] = field(default_factory=dict)


def decide(
    desired: list[DesiredEntry],
    attachments: list[Attachment],
    nodes: dict[str, NodeInfo],
    *,
    attach_required: Callable[[str], bool],
    unmount_wait_since: dict[str, float],
    now: float,
    max_wait_for_unmount: float,
    detaching: frozenset[str] = frozenset(),
) -> Plan:
    plan = Plan()
    wanted = {e.va_name for e in desired}
    by_name = {a.name: a for a in attachments}

    # 1. Detach what no pod wants, once its node has stopped using it.
    for att in attachments:
        if att.deleting or att.name in wanted or att.name in detaching:
            continue
        node = nodes.get(att.node)
        if node is not None and not att.unique_name:
            continue  # cannot tell whether the node uses it: never guess towards a detach
        if node is None or att.unique_name not in node.in_use:
            plan.detaches.append(Detach(att, forced=False))
            continue
        since = unmount_wait_since.get(att.name, now)
        if not node.ready and now - since >= max_wait_for_unmount:
            plan.detaches.append(Detach(att, forced=True))
        else:
            plan.waiting_for_unmount.add(att.name)

    # 2. Attach what pods want, unless an exclusive volume is attached to another node.
    holders: dict[tuple[str, str], set[str]] = {}
    for att in attachments:
        holders.setdefault((att.driver, att.handle), set()).add(att.node)
    for entry in desired:
        vol = entry.volume
        if not attach_required(vol.driver):
            continue
        existing = by_name.get(entry.va_name)
        if existing is not None:
            continue  # attaching, attached, or still going away: wait for it either way
        others = holders.setdefault((vol.driver, vol.handle), set()) - {entry.node}
        if others and not vol.multi_node:
            plan.multi_attach.append(MultiAttach(entry, tuple(sorted(others))))
            continue
        plan.attaches.append(entry)
        holders[(vol.driver, vol.handle)].add(entry.node)

    # 3. Node status: attached, not being deleted, not being detached by this plan.
    leaving = {d.attachment.name for d in plan.detaches} | set(detaching)
    lists: dict[str, set[str]] = {n: set() for n, info in nodes.items() if info.managed}
    for att in attachments:
        usable = att.attached and not att.deleting and att.unique_name and att.name not in leaving
        if usable and att.node in lists:
            lists[att.node].add(att.unique_name)
    for node_name, names in lists.items():
        target = tuple(sorted(names))
        if tuple(sorted(nodes[node_name].attached)) != target:
            plan.node_status[node_name] = target
    return plan
