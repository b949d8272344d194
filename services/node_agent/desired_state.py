"""The node agent's desired state of the world (kubelet's DesiredStateOfWorld,
pkg/kubelet/volumemanager/cache): the pods on this node that may have volumes mounted (neither
terminated nor being deleted), the CSI volumes each of them wants, and whether every claim of a
pod resolved to a volume (a pod with an unbound claim cannot start).

The populator (`populator.DesiredStateOfWorldPopulator`) fills it from the informers' caches; the
reconciler reads it. Pods are kept in the order they were first added, and each pod's volumes in
the order they were added, so the operations of the first pods start first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .decide import PodVolume


@dataclass
class _Pod:
    key: str  # namespace/name
    volumes_resolved: bool
    volumes: dict[str, PodVolume] = field(default_factory=dict)  # by volume name


@dataclass
class DesiredStateOfWorld:
    _pods: dict[str, _Pod] = field(default_factory=dict, init=False)  # by pod UID

    def add_pod(self, pod_uid: str, pod_key: str, *, volumes_resolved: bool) -> None:
        """The pod may have volumes mounted; `volumes_resolved` says whether every one of its
        claims resolved to a CSI volume. A pod added again keeps its volumes and its place."""
        pod = self._pods.get(pod_uid)
        if pod is None:
            self._pods[pod_uid] = _Pod(pod_key, volumes_resolved)
        else:
            pod.key, pod.volumes_resolved = pod_key, volumes_resolved

    def delete_pod(self, pod_uid: str) -> None:
        """The pod is gone, terminated or being deleted: it wants no volume any more."""
        self._pods.pop(pod_uid, None)

    def add_pod_to_volume(self, volume: PodVolume) -> None:
        """The pod wants the volume mounted (replacing what it wanted of that volume before). The
        pod must have been added."""
        pod = self._pods.get(volume.pod_uid)
        if pod is None:
            raise KeyError(f"pod {volume.pod_key} ({volume.pod_uid}) is not in the desired state")
        pod.volumes[volume.volume.pv_name] = volume

    def delete_pod_from_volume(self, pod_uid: str, pv_name: str) -> None:
        """The pod no longer wants the volume."""
        pod = self._pods.get(pod_uid)
        if pod is not None:
            pod.volumes.pop(pv_name, None)

    def pod_exists_in_volume(self, pod_uid: str, pv_name: str) -> bool:
        pod = self._pods.get(pod_uid)
        return pod is not None and pv_name in pod.volumes

    def get_pod_uids(self) -> frozenset[str]:
        return frozenset(self._pods)

    def get_volume_names_for_pod(self, pod_uid: str) -> frozenset[str]:
        pod = self._pods.get(pod_uid)
        return frozenset(pod.volumes) if pod is not None else frozenset()

    def get_volumes_to_mount(self) -> tuple[PodVolume, ...]:
        """Every volume every pod wants, pod by pod."""
        return tuple(v for pod in self._pods.values() for v in pod.volumes.values())

    def get_pods_with_resolved_volumes(self) -> dict[str, tuple[PodVolume, ...]]:
        """Per pod key whose claims all resolved, its volumes (what its start waits for)."""
        return {p.key: tuple(p.volumes.values()) for p in self._pods.values() if p.volumes_resolved}
