"""The attach-detach controller's desired state of the world (kcm's DesiredStateOfWorld): the
managed nodes and which volume each pod on them needs, kept per pod so a pod's update replaces
exactly its own contribution."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .decide import DesiredEntry, DesiredVolume, PodRef


@dataclass
class DesiredState:
    """The attach-detach controller's desired state of the world (kcm's DesiredStateOfWorld): the
    nodes whose attachments it manages, the volumes the pods on them want, and which of those
    wishes were told of a Multi-Attach error.

    kcm keeps volumes per node with their pods; kubeloop keeps each pod's whole contribution,
    replaced as a unit (a pod's update replaces exactly its own), and groups them into entries
    per (node, volume) only when asked after a change."""

    # pod key -> (pod, node, volumes). Changed only through set_pod, remove_pod and
    # drop_volumes, which drop the entries computed from it.
    pods: dict[str, tuple[PodRef, str, tuple[DesiredVolume, ...]]] = field(default_factory=dict)
    _entries: list[DesiredEntry] | None = field(default=None, repr=False, compare=False)
    # Nodes whose pods count: added once annotated, kept after deletion while pods want volumes.
    _nodes: set[str] = field(default_factory=set, init=False, repr=False)
    # (node, unique volume name) whose pods were given their Multi-Attach event.
    _multi_attach_reported: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)

    def add_node(self, node: str) -> None:
        """kcm's AddNode: the node lets the controller manage its attachments, so its pods count.
        kcm never takes a node out again while it exists."""
        self._nodes.add(node)

    def delete_node(self, node: str) -> None:
        """kcm's DeleteNode, for a deleted node: forgotten unless pods still want volumes on it
        (kcm refuses to delete a node with volumes to attach), so a deleted node's volumes stay
        wanted, and attached, until its pods go."""
        if all(n != node for _, n, _ in self.pods.values()):
            self._nodes.discard(node)

    def node_exists(self, node: str) -> bool:
        """kcm's NodeExists: whether the controller manages the node's attachments."""
        return node in self._nodes

    def set_pod(self, pod: PodRef, node: str, volumes: Iterable[DesiredVolume]) -> bool:
        """kcm's AddPod for each of the pod's volumes, at once: `volumes` replace whatever the
        pod wanted before (none at all removes the pod). True if that changed the desired state."""
        vols = tuple(volumes)
        if not vols:
            return self.remove_pod(pod.key)
        if self.pods.get(pod.key) == (pod, node, vols):
            return False
        self.pods[pod.key] = (pod, node, vols)
        self._entries = None
        return True

    def remove_pod(self, key: str) -> bool:
        """kcm's DeletePod for every volume of the pod with this namespace/name key. True if the
        pod wanted any."""
        if self.pods.pop(key, None) is None:
            return False
        self._entries = None
        return True

    def get_pods(self) -> list[PodRef]:
        """Every pod that wants a volume (kcm's GetPodToAdd), for the populator's check that each
        still exists."""
        return [pod for pod, _, _ in self.pods.values()]

    def drop_volumes(self, unwanted: Callable[[DesiredVolume], bool]) -> None:
        """Removes the volumes `unwanted` picks from every pod's contribution."""
        for pod, node, vols in list(self.pods.values()):
            kept = tuple(v for v in vols if not unwanted(v))
            if kept != vols:
                self.set_pod(pod, node, kept)

    def entries(self) -> list[DesiredEntry]:
        """The volumes to attach (kcm's GetVolumesToAttach), one entry per node and volume with
        the pods that want it there, in a stable order (node, then volume), so concurrent wishes
        for one exclusive volume are resolved the same way on every pass. Computed again only
        after a change: a pass runs on every event, and most events (a VA's status, a node's)
        change no pod."""
        if self._entries is None:
            self._entries = self._group()
            # kcm keeps the mark on the volume to attach, so it goes with the entry: a volume
            # wanted on the node again is reported again.
            self._multi_attach_reported &= {(e.node, e.volume.unique_name) for e in self._entries}
        return list(self._entries)

    def multi_attach_error_reported(self, entry: DesiredEntry) -> bool:
        """Whether the pods of `entry` were told that its volume is attached elsewhere (kcm's
        MultiAttachErrorReported): once per node and volume while it stays wanted there."""
        return (entry.node, entry.volume.unique_name) in self._multi_attach_reported

    def set_multi_attach_error(self, entry: DesiredEntry) -> None:
        """kcm's SetMultiAttachError: the pods of `entry` were told."""
        self._multi_attach_reported.add((entry.node, entry.volume.unique_name))

    def _group(self) -> list[DesiredEntry]:
        grouped: dict[tuple[str, str], tuple[DesiredVolume, list[PodRef]]] = {}
        for pod, node, vols in self.pods.values():
            for vol in vols:
                slot = grouped.setdefault((node, vol.unique_name), (vol, []))
                slot[1].append(pod)
        return [
            DesiredEntry(node, vol, tuple(sorted(pods, key=lambda p: p.key)))
            for (node, _), (vol, pods) in sorted(grouped.items())
        ]
