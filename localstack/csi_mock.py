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
- hostpathplugin: kubeloop's image running localstack.csi_proxy, hostpathplugin's proxy mode;
- busybox: the e2e busybox tools/kind-e2e/images.sh builds, under the mock manifest's tag.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller_runtime.toolchain import REPO_ROOT, go_module_dir, read_versions

from .compose import KUBELOOP_IMAGE
from .sidecar_images import SIDECARS, sidecar_image

REPO_LIST = REPO_ROOT / "tools" / "kind-e2e" / "repo-list.yaml"
UPSTREAM_REGISTRIES = {
    "sigStorageRegistry": "registry.k8s.io/sig-storage",
    "promoterE2eRegistry": "registry.k8s.io/e2e-test-images",
}
PROXY_ENTRYPOINT = '["/opt/kubeloop/bin/python", "-m", "localstack.csi_proxy"]'


@dataclass(frozen=True)
class Image:
    name: str  # as the suite asks for it, registry mapped
    source: str  # the local image it is made from
    entrypoint: str = ""  # set: built FROM source with this ENTRYPOINT; empty: source tagged as name


def mock_manifests() -> list[Path]:
    root = go_module_dir("k8s.io/kubernetes", read_versions()["KUBERNETES_VERSION"])
    return sorted((root / "test" / "e2e" / "testing-manifests" / "storage-csi" / "mock").glob("*.yaml"))


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
            out.append(Image(mapped, KUBELOOP_IMAGE, PROXY_ENTRYPOINT))
        elif name == "busybox":
            out.append(Image(mapped, e2e_busybox()))
        else:
            raise ValueError(f"{ref}: the CSI Mock manifests name an image kubeloop has nothing for")
    return out


def build(image: Image) -> None:
    if not image.entrypoint:
        subprocess.run(["docker", "tag", image.source, image.name], check=True)
        return
    dockerfile = f"FROM {image.source}\nENTRYPOINT {image.entrypoint}\nCMD []\n"
    subprocess.run(
        ["docker", "build", "-q", "-t", image.name, "-"], input=dockerfile, text=True, check=True,
        capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )  # fmt: skip


def build_all() -> list[str]:
    """Makes every image (the sources must exist: tools/build-kind-node.sh and images.sh build them)
    and returns their names, for `kind load`."""
    made = images()
    for image in made:
        build(image)
    return [i.name for i in made]
