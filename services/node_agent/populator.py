"""The node agent's desired-state populator (kubelet's DesiredStateOfWorldPopulator,
pkg/kubelet/volumemanager/populator): from the caches of this node's pods, the claims, the volumes
and the CSIDrivers, which CSI volumes each pod wants mounted.

kubelet's populator runs in a loop of its own; here `populate` runs at the start of each reconcile
pass, so a pass decides on the caches as they are when it starts.
"""

from __future__ import annotations

import dataclasses

from controller_runtime.kinds import Pod, csi_driver_view, pod_view, pv_view, pvc_view
from controller_runtime.store import Store
from controller_runtime.volumes import (
    bound_volume_name,
    csi_volume,
    inline_csi_volumes,
    pod_claims,
    pod_info_attributes,
    pod_terminated,
)

from .decide import PodVolume
from .desired_state import DesiredStateOfWorld


class DesiredStateOfWorldPopulator:
    def __init__(
        self, desired: DesiredStateOfWorld, *, pods: Store, claims: Store, volumes: Store, drivers: Store
    ) -> None:
        self.desired = desired
        self.pods = pods
        self.claims = claims
        self.volumes = volumes
        self.drivers = drivers

    def populate(self) -> None:
        """Makes the desired state hold the volumes wanted by the pods on this node that are
        neither terminated nor being deleted; a pod with a claim that does not resolve to a bound
        CSI volume wants the others and is marked unresolved (it cannot start)."""
        present: set[str] = set()
        for obj in self.pods.values():
            pod = pod_view(obj)
            md = pod["metadata"]
            if md.get("deletionTimestamp") or pod_terminated(pod):
                continue
            uid = md.get("uid", "")
            volumes, resolved = self.pod_volumes(pod)
            present.add(uid)
            self.desired.add_pod(uid, f"{md.get('namespace', '')}/{md['name']}", volumes_resolved=resolved)
            for vol in volumes:
                self.desired.add_pod_to_volume(vol)
            for gone in self.desired.get_volume_names_for_pod(uid) - {v.volume.pv_name for v in volumes}:
                self.desired.delete_pod_from_volume(uid, gone)
        for uid in self.desired.get_pod_uids() - present:
            self.desired.delete_pod(uid)

    def pod_volumes(self, pod: Pod) -> tuple[list[PodVolume], bool]:
        """The CSI volumes the pod wants (its claims' bound volumes, then its inline volumes), and
        whether every claim resolved."""
        md = pod["metadata"]
        ns, uid = md.get("namespace", ""), md.get("uid", "")
        pod_key = f"{ns}/{md['name']}"
        vols: list[PodVolume] = []
        resolved = True
        for _, claim, read_only in pod_claims(pod):
            pvc = pvc_view(self.claims.get(f"{ns}/{claim}"))
            pv_name = bound_volume_name(pvc)
            pv = pv_view(self.volumes.get(pv_name)) if pv_name else None
            vol = csi_volume(pv) if pv is not None and bound_volume_name(pvc, pv) else None
            if vol is None:
                resolved = False
                continue
            vols.append(PodVolume(uid, pod_key, vol, read_only or vol.read_only))
        for inline in inline_csi_volumes(pod):
            if self._pod_info_on_mount(inline.driver):
                # kubelet's keys win over the pod's own volumeAttributes.
                attributes = {**inline.attributes, **pod_info_attributes(pod, ephemeral=True)}
                inline = dataclasses.replace(inline, attributes=attributes)
            vols.append(PodVolume(uid, pod_key, inline, inline.read_only))
        return vols, resolved

    def _pod_info_on_mount(self, driver: str) -> bool:
        csidriver = csi_driver_view(self.drivers.get(driver))
        return csidriver is not None and csidriver.get("spec", {}).get("podInfoOnMount") is True
