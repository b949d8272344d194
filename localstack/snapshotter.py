"""external-snapshotter's Go binaries (snapshot-controller, csi-snapshotter) and the CRDs of its
client module, as `tools/build-binaries.sh snapshotter` caches them: what the local stack, compose
and kind run for VolumeSnapshots and VolumeGroupSnapshots. kubeloop has no snapshotter of its own;
these are upstream's at EXTERNAL_SNAPSHOTTER_VERSION."""

from __future__ import annotations

from pathlib import Path

from controller_runtime.toolchain import MissingBinaryError, Toolchain

GROUP = "external-snapshotter"
VERSION_KEY = "EXTERNAL_SNAPSHOTTER_VERSION"
BUILD = "bash tools/build-binaries.sh snapshotter"


def snapshotter_dir(tools: Toolchain | None = None) -> Path:
    tools = tools or Toolchain.default()
    return tools.cache / "bin" / f"{GROUP}-{tools.versions[VERSION_KEY]}"


def snapshotter_binary(name: str, tools: Toolchain | None = None) -> Path:
    """`snapshot-controller` or `csi-snapshotter`; MissingBinaryError naming the build when absent."""
    path = snapshotter_dir(tools) / name
    if not path.exists():
        raise MissingBinaryError(f"{path} is missing: run `{BUILD}`")
    return path


def snapshot_crds(tools: Toolchain | None = None) -> list[Path]:
    """The snapshot.storage.k8s.io and groupsnapshot.storage.k8s.io CRDs, from external-snapshotter's
    client module at the pinned version."""
    crd = snapshotter_dir(tools) / "crd"
    found = sorted(crd.glob("snapshot.storage.k8s.io_*.yaml")) + sorted(
        crd.glob("groupsnapshot.storage.k8s.io_*.yaml")
    )
    if len(found) < 6:
        raise MissingBinaryError(
            f"the VolumeSnapshot and VolumeGroupSnapshot CRDs are missing in {crd}: run `{BUILD}`"
        )
    return found


def snapshot_metadata_crd(tools: Toolchain | None = None) -> Path:
    """external-snapshot-metadata's SnapshotMetadataService CRD (cbt.storage.k8s.io), as
    `tools/build-binaries.sh snapshot-metadata` caches it beside the sidecar."""
    tools = tools or Toolchain.default()
    version = tools.versions["EXTERNAL_SNAPSHOT_METADATA_VERSION"]
    crd = (
        tools.cache
        / "bin"
        / f"external-snapshot-metadata-{version}"
        / "api"
        / ("cbt.storage.k8s.io_snapshotmetadataservices.yaml")
    )
    if not crd.exists():
        raise MissingBinaryError(f"{crd} is missing: run `bash tools/build-binaries.sh snapshot-metadata`")
    return crd
