"""The Go kubernetes-csi sidecars (external-provisioner, external-attacher, external-resizer) as
stack components: built by `tools/build-binaries.sh <group>` into the toolchain cache. Two uses:

- the side-by-side benchmarks (bench/) and the differential conformance harness
  (tests/conformance/) run them with the admin kubeconfig beside a stack of their own
  (`go_sidecar_components`);
- `make up SIDECARS=go` (`--sidecars=go`) runs the stack with them in place of kubeloop's three, each
  under the ServiceAccount identity and RBAC of the kubeloop sidecar it replaces
  (`with_go_sidecars`): the driver bench's stack campaign runs a scenario that found something
  again this way, to tell a bug of the driver from one of kubeloop's sidecars."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from controller_runtime.toolchain import MissingBinaryError, MissingModuleError, Toolchain, go_module_dir

from .certs import service_account_identity
from .components import Component, ComponentContext, EnvFactory, controller_socket


@dataclass(frozen=True)
class GoSidecar:
    group: str  # the tools/build-binaries.sh group and cache directory stem
    binary: str  # the executable's name in that directory
    version_key: str  # its pin in tools/versions.env
    account: str  # the ServiceAccount upstream's rbac.yaml declares for it (namespace default)


PROVISIONER = GoSidecar(
    "external-provisioner", "csi-provisioner", "EXTERNAL_PROVISIONER_VERSION", "csi-provisioner"
)
ATTACHER = GoSidecar("external-attacher", "csi-attacher", "EXTERNAL_ATTACHER_VERSION", "csi-attacher")
RESIZER = GoSidecar("external-resizer", "csi-resizer", "EXTERNAL_RESIZER_VERSION", "csi-resizer")
# Where upstream's rbac.yaml files put the accounts, roles and the provisioner's capacity objects.
UPSTREAM_NAMESPACE = "default"


def go_sidecar_binary(sidecar: GoSidecar, tools: Toolchain | None = None) -> Path:
    """The cached binary; MissingBinaryError naming the build command when it was never built."""
    tools = tools or Toolchain.default()
    version = tools.versions[sidecar.version_key]
    path = tools.cache / "bin" / f"{sidecar.group}-{version}" / sidecar.binary
    if not path.exists():
        raise MissingBinaryError(f"{path} is missing: run `bash tools/build-binaries.sh {sidecar.group}`")
    return path


def upstream_rbac(sidecar: GoSidecar, tools: Toolchain | None = None) -> Path:
    """Upstream's rbac.yaml for the sidecar, as the Kubernetes e2e suite ships it
    (k8s.io/kubernetes/test/e2e/testing-manifests/storage-csi/), from the Go module cache."""
    tools = tools or Toolchain.default()
    try:
        root = go_module_dir("k8s.io/kubernetes", tools.versions["KUBERNETES_VERSION"])
    except MissingModuleError as e:
        raise MissingBinaryError(f"upstream's rbac.yaml of {sidecar.binary}: {e}") from None
    return root / "test" / "e2e" / "testing-manifests" / "storage-csi" / sidecar.group / "rbac.yaml"


# The flags each takes beyond the socket and the kubeconfig: the settings kubeloop's own sidecar
# has in the registry (localstack.components), capacity publishing and extra create metadata for the
# provisioner. With no owner (level -1) its CSIStorageCapacity objects need no Pod of their own.
PROVISIONER_FLAGS = ("--extra-create-metadata", "--enable-capacity", "--capacity-ownerref-level=-1")
# The kubeloop component each replaces with --sidecars=go, and its extra flags.
REPLACES = {
    "external-provisioner": (PROVISIONER, PROVISIONER_FLAGS),
    "external-attacher": (ATTACHER, ()),
    "external-resizer": (RESIZER, ()),
}


def capacity_namespace(namespace: str) -> EnvFactory:
    """The namespace of the provisioner's CSIStorageCapacity objects, which the Go sidecar reads
    from its environment (a Deployment's downward API)."""
    return lambda c: {"NAMESPACE": namespace}


def _argv(
    binary: Path, flags: Sequence[str], c: ComponentContext, kubeconfig: Path | None = None
) -> list[str]:
    """The sidecar on the controller plugin's socket, as `kubeconfig` (default: its identity's)."""
    config = kubeconfig or c.kubeconfig
    argv = [str(binary), f"--csi-address={controller_socket(c)}", f"--kubeconfig={config}", "--v=2"]
    return [*argv, *flags, *([f"--http-endpoint={c.http_endpoint}"] if c.http_endpoint else [])]


def go_sidecar_components(admin_kubeconfig: Path) -> list[Component]:
    """The three sidecars configured like kubeloop's own in the registry, on the admin kubeconfig,
    each a component without health URL."""
    return [
        Component(
            name=f"go-{name}",
            argv=partial(_argv, go_sidecar_binary(sidecar), flags, kubeconfig=admin_kubeconfig),
            env=capacity_namespace("kube-system") if sidecar is PROVISIONER else None,
            health_path=None,
        )
        for name, (sidecar, flags) in REPLACES.items()
    ]


def with_go_sidecars(components: Sequence[Component]) -> list[Component]:
    """`components` with kubeloop's external-provisioner, -attacher and -resizer replaced by the Go
    sidecars, each authenticating as the ServiceAccount of upstream's rbac.yaml, which is applied
    in place of kubeloop's RBAC (its other manifests and objects, such as a recipe's classes, kept);
    ready once it serves /metrics on the replaced one's port. MissingBinaryError names the build
    command of a missing binary."""
    out = []
    for comp in components:
        if comp.name not in REPLACES:
            out.append(comp)
            continue
        sidecar, flags = REPLACES[comp.name]
        kept = tuple(m for m in comp.manifests if not m.startswith("deploy/rbac/"))
        out.append(
            dataclasses.replace(
                comp,
                argv=partial(_argv, go_sidecar_binary(sidecar), flags),
                env=capacity_namespace(UPSTREAM_NAMESPACE) if sidecar is PROVISIONER else None,
                identity=service_account_identity(sidecar.account, UPSTREAM_NAMESPACE),
                manifests=(str(upstream_rbac(sidecar)), *kept),
                health_path="/metrics",
            )
        )
    return out
