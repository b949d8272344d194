"""The images of the Kubernetes e2e suite's "CSI Mock" specs, made locally so those specs run
kubeloop's sidecars (`make e2e-csi-mock`, docs/e2e-storage.md).

Those specs deploy, per test, the manifests of storage-csi/mock/ (in the Go module cache, at the
pinned Kubernetes): upstream's provisioner, attacher, resizer, csi-snapshotter and
node-driver-registrar, csi-driver-host-path's image as a proxy in front of the mock CSI driver that
runs inside e2e.test, and a busybox. The suite patches each image's registry through the repo list
(tools/kind-e2e/repo-list.yaml: sigStorageRegistry, promoterE2eRegistry) and keeps its name and
tag, so each is made here under the very name the suite will ask for:

- a sidecar kubeloop replaces: kubeloop's image of it (localstack.sidecar_images), tagged so;
- csi-snapshotter: upstream's binary, at the version kubeloop builds, as entrypoint;
- hostpathplugin: kubeloop's image with a start script that runs, as hostpathplugin would,
  localstack.csi_proxy for `-proxy-endpoint` (the specs that embed the mock in e2e.test), else the
  suite's own mock CSI driver as a command (tools/kind-e2e/csi-mock-driver, for the specs that run
  the mock in the cluster and read its calls from its log);
- busybox: the e2e busybox tools/kind-e2e/images.sh builds, under the mock manifest's tag;
- the suite's pause image (its test pods' image, test/utils/image's Pause, in registry.k8s.io,
  which the repo list leaves as it is): the kind node's pause (tools/build-kind-node.sh) under that
  name, so kubelet finds it on the node and never pulls.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller_runtime.toolchain import REPO_ROOT, Toolchain, go_module_dir, read_versions

from .compose import KUBELOOP_IMAGE
from .sidecar_images import SIDECARS, sidecar_image

REPO_LIST = REPO_ROOT / "tools" / "kind-e2e" / "repo-list.yaml"
UPSTREAM_REGISTRIES = {
    "sigStorageRegistry": "registry.k8s.io/sig-storage",
    "promoterE2eRegistry": "registry.k8s.io/e2e-test-images",
}
# The pause image tools/build-kind-node.sh builds for the kind node (its PAUSE_IMAGE).
NODE_PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
MOCK_DRIVER_SOURCE = REPO_ROOT / "tools" / "kind-e2e" / "csi-mock-driver" / "main.go"
# hostpathplugin's place: which of the two the mock manifests want, told by their flags.
HOSTPATHPLUGIN_START = """#!/bin/sh
# csi-driver-host-path's image as the e2e suite's CSI Mock manifests run it (localstack/csi_mock.py):
# with -proxy-endpoint its proxy mode, else the mock CSI driver itself.
for arg in "$@"; do
  case $arg in
    -proxy-endpoint*|--proxy-endpoint*) exec /opt/kubeloop/bin/python -m localstack.csi_proxy "$@" ;;
  esac
done
exec /usr/local/bin/csi-mock-driver "$@"
"""


@dataclass(frozen=True)
class Image:
    name: str  # as the suite asks for it, registry mapped
    source: str  # the local image it is made from
    entrypoint: str = ""  # set: built FROM source with this ENTRYPOINT; empty: source tagged as name
    # Files added under /usr/local/bin (name -> where the content comes from), when built.
    files: tuple[tuple[str, Path], ...] = ()


def kubernetes_module() -> Path:
    return go_module_dir("k8s.io/kubernetes", read_versions()["KUBERNETES_VERSION"])


def mock_manifests() -> list[Path]:
    return sorted(
        (kubernetes_module() / "test" / "e2e" / "testing-manifests" / "storage-csi" / "mock").glob("*.yaml")
    )


def pause_image() -> Image:
    """The suite's pause image, made from the kind node's."""
    manifest = (kubernetes_module() / "test" / "utils" / "image" / "manifest.go").read_text()
    found = re.search(r'configs\[Pause\] = Config\{list\.GcRegistry, "pause", "([^"]+)"\}', manifest)
    if found is None:
        raise ValueError("test/utils/image/manifest.go names no Pause image in registry.k8s.io")
    return Image(f"registry.k8s.io/pause:{found.group(1)}", NODE_PAUSE_IMAGE)


def container_images(paths: list[Path]) -> list[str]:
    """Every container image the manifests name, once, in order."""
    seen: dict[str, None] = {}

    def walk(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "image" and isinstance(value, str):
                    yield value
                else:
                    yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            seen.update(dict.fromkeys(walk(doc)))
    return list(seen)


def registry_map(path: Path = REPO_LIST) -> dict[str, str]:
    """Upstream registry -> the one the repo list puts in its place."""
    listed = yaml.safe_load(path.read_text()) or {}
    return {upstream: listed[key] for key, upstream in UPSTREAM_REGISTRIES.items() if key in listed}


def e2e_busybox() -> str:
    """The busybox tools/kind-e2e/images.sh builds (the tag test/utils/image pins)."""
    out = subprocess.run(
        ["bash", "tools/kind-e2e/images.sh", "list"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return next(i for i in out if i.rsplit("/", 1)[-1].startswith("busybox:"))


def images(paths: list[Path] | None = None, registries: dict[str, str] | None = None) -> list[Image]:
    """What to make for each image of the mock manifests; ValueError for one kubeloop cannot stand in
    for (a new sidecar in a newer Kubernetes, say), naming it."""
    registries = registry_map() if registries is None else registries
    versions = read_versions()
    out = []
    for ref in container_images(mock_manifests() if paths is None else paths):
        registry, _, rest = ref.rpartition("/")
        name = rest.split(":", 1)[0]
        if registry not in registries:
            raise ValueError(f"{ref}: the repo list {REPO_LIST} maps no registry {registry}")
        mapped = f"{registries[registry]}/{rest}"
        if name in SIDECARS:
            out.append(Image(mapped, sidecar_image(name)))
        elif name == "csi-snapshotter":
            snapshotter = f"kubeloop/external-snapshotter:{versions['EXTERNAL_SNAPSHOTTER_VERSION']}"
            out.append(Image(mapped, snapshotter, '["/csi-snapshotter"]'))
        elif name == "hostpathplugin":
            start = ("hostpathplugin", _start_script())
            files = (start, ("csi-mock-driver", mock_driver_binary()))
            out.append(Image(mapped, KUBELOOP_IMAGE, '["/usr/local/bin/hostpathplugin"]', files))
        elif name == "busybox":
            out.append(Image(mapped, e2e_busybox()))
        else:
            raise ValueError(f"{ref}: the CSI Mock manifests name an image kubeloop has nothing for")
    return out


def mock_driver_binary() -> Path:
    """tools/kind-e2e/csi-mock-driver built (cached per version of its source)."""
    subprocess.run(
        ["bash", "tools/build-binaries.sh", "csi-mock"], cwd=REPO_ROOT, check=True, capture_output=True
    )
    digest = hashlib.sha256(MOCK_DRIVER_SOURCE.read_bytes()).hexdigest()[:12]
    tools = Toolchain.default()
    return (
        tools.cache
        / "bin"
        / f"csi-mock-driver-{tools.versions['KUBERNETES_VERSION']}-{digest}"
        / "csi-mock-driver"
    )


def _start_script() -> Path:
    path = Path(tempfile.gettempdir()) / "kubeloop-hostpathplugin-start.sh"
    path.write_text(HOSTPATHPLUGIN_START)
    return path


def build(image: Image) -> None:
    if not image.entrypoint:
        subprocess.run(["docker", "tag", image.source, image.name], check=True)
        return
    with tempfile.TemporaryDirectory(prefix="kubeloop-mock-image.") as context:
        lines = [f"FROM {image.source}"]
        for name, source in image.files:
            shutil.copy(source, Path(context) / name)
            os.chmod(Path(context) / name, 0o755)
            lines.append(f"COPY {name} /usr/local/bin/{name}")
        lines += [f"ENTRYPOINT {image.entrypoint}", "CMD []"]
        (Path(context) / "Dockerfile").write_text("\n".join(lines) + "\n")
        subprocess.run(
            ["docker", "build", "-q", "-t", image.name, context], check=True, capture_output=True,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )  # fmt: skip


def build_all() -> list[str]:
    """Makes every image (the sources must exist: tools/build-kind-node.sh and images.sh build them)
    and returns their names, for `kind load`."""
    made = [*images(), pause_image()]
    for image in made:
        build(image)
    return [i.name for i in made]
