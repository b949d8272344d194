"""What tunes the external-provisioner's controllers, from its flags."""

from __future__ import annotations

from dataclasses import dataclass

from .node_deployment import NodeDeployment


@dataclass(frozen=True)
class Options:
    identity: str  # storage.kubernetes.io/csiProvisionerIdentity of this instance
    prefix: str = "pvc"
    default_fs: str = ""
    extra_metadata: bool = False
    workers: int = 100
    retry_start: float = 1.0
    retry_max: float = 300.0
    # How often snapshots no claim restores from any more lose their source protection (0: never).
    snapshot_sweep_interval: float = 300.0
    # Saving a PV is retried this often before the volume is deleted again (upstream: 5 x 10 s).
    pv_save_attempts: int = 5
    pv_save_interval: float = 10.0
    # --strict-topology / --immediate-topology: what CreateVolume's accessibility requirements hold.
    strict_topology: bool = False
    immediate_topology: bool = True
    # --prevent-volume-mode-conversion: a restore keeps the snapshotted volume's mode unless its
    # VolumeSnapshotContent allows a change.
    prevent_mode_conversion: bool = True
    # --node-deployment: this provisioner serves its own node's claims and volumes only.
    node_deployment: NodeDeployment | None = None
