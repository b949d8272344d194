"""The Go kubernetes-csi sidecars (external-provisioner, external-attacher, external-resizer) as
stack components, for the side-by-side benchmarks (bench/) and the differential conformance harness
(tests/conformance/): built by `tools/build-binaries.sh <group>` into the toolchain cache, run with
the admin kubeconfig against the controller socket of kubeloop's CSI driver."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from controller_runtime.toolchain import MissingBinaryError, Toolchain

from .components import Component, ComponentContext, controller_socket


@dataclass(frozen=True)
class GoSidecar:
    group: str  # the tools/build-binaries.sh group and cache directory stem
    binary: str  # the executable's name in that directory
    version_key: str  # its pin in tools/versions.env


PROVISIONER = GoSidecar("external-provisioner", "csi-provisioner", "EXTERNAL_PROVISIONER_VERSION")
ATTACHER = GoSidecar("external-attacher", "csi-attacher", "EXTERNAL_ATTACHER_VERSION")
RESIZER = GoSidecar("external-resizer", "csi-resizer", "EXTERNAL_RESIZER_VERSION")


def go_sidecar_binary(sidecar: GoSidecar, tools: Toolchain | None = None) -> Path:
    """The cached binary; MissingBinaryError naming the build command when it was never built."""
    tools = tools or Toolchain.default()
    version = tools.versions[sidecar.version_key]
    path = tools.cache / "bin" / f"{sidecar.group}-{version}" / sidecar.binary
    if not path.exists():
        raise MissingBinaryError(f"{path} is missing: run `bash tools/build-binaries.sh {sidecar.group}`")
    return path


def go_sidecar_components(admin_kubeconfig: Path) -> list[Component]:
    """The three sidecars configured like kubeloop's own in the registry (capacity publishing and
    extra create metadata for the provisioner), each a component without health URL."""
    provisioner = go_sidecar_binary(PROVISIONER)
    attacher = go_sidecar_binary(ATTACHER)
    resizer = go_sidecar_binary(RESIZER)

    def common(c: ComponentContext) -> list[str]:
        return [f"--csi-address={controller_socket(c)}", f"--kubeconfig={admin_kubeconfig}", "--v=2"]

    def provisioner_argv(c: ComponentContext) -> list[str]:
        # CSIStorageCapacity objects go to a namespace the sidecar reads from its environment; with
        # no owner (level -1) it needs no Pod of its own.
        return [
            "env",
            "NAMESPACE=kube-system",
            str(provisioner),
            *common(c),
            "--extra-create-metadata",
            "--enable-capacity",
            "--capacity-ownerref-level=-1",
        ]

    return [
        Component(name="go-external-provisioner", argv=provisioner_argv, health_path=None),
        Component(name="go-external-attacher", argv=lambda c: [str(attacher), *common(c)], health_path=None),
        Component(name="go-external-resizer", argv=lambda c: [str(resizer), *common(c)], health_path=None),
    ]
