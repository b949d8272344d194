"""localstack.csi_mock: every image the e2e suite's CSI Mock manifests name, at the pinned
Kubernetes, is made from something kubeloop has, under the name the suite asks for once the repo
list maps its registry; anything else is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller_runtime.toolchain import REPO_ROOT
from localstack.compose import KUBELOOP_IMAGE
from localstack.csi_mock import NODE_PAUSE_IMAGE, images, mock_manifests, pause_image, registry_map
from localstack.sidecar_images import sidecar_image

REGISTRIES = {"registry.k8s.io/sig-storage": "local/sig", "registry.k8s.io/e2e-test-images": "local/e2e"}


def test_the_repo_list_maps_both_registries_the_mock_manifests_use() -> None:
    assert set(registry_map()) == set(REGISTRIES)


def test_each_mock_image_is_made_from_kubeloops_under_its_upstream_name_and_tag() -> None:
    made = {i.name.rsplit(":", 1)[0]: i for i in images(mock_manifests(), REGISTRIES)}
    assert made["local/sig/csi-provisioner"].source == sidecar_image("csi-provisioner")
    assert made["local/sig/csi-attacher"].source == sidecar_image("csi-attacher")
    assert made["local/sig/csi-resizer"].source == sidecar_image("csi-resizer")
    assert made["local/sig/csi-node-driver-registrar"].source == sidecar_image("csi-node-driver-registrar")
    plugin = made["local/sig/hostpathplugin"]
    assert plugin.source == KUBELOOP_IMAGE and plugin.entrypoint == '["/usr/local/bin/hostpathplugin"]'
    files = dict(plugin.files)
    assert (
        files["csi-mock-driver"].is_file() and "localstack.csi_proxy" in files["hostpathplugin"].read_text()
    )
    assert made["local/sig/csi-snapshotter"].entrypoint == '["/csi-snapshotter"]'
    assert made["local/e2e/busybox"].source.startswith("kubeloop.local/e2e-test-images/busybox:")
    # The tags are the manifests' own: the suite changes only the registry.
    text = "".join(p.read_text() for p in mock_manifests())
    for image in made.values():
        tag = image.name.rsplit(":", 1)[1]
        assert f"{image.name.rsplit('/', 1)[1].split(':')[0]}:{tag}" in text


def test_an_image_kubeloop_has_nothing_for_is_refused_naming_it(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text("spec:\n  containers:\n    - image: registry.k8s.io/sig-storage/csi-new-sidecar:v1\n")
    with pytest.raises(ValueError, match="csi-new-sidecar:v1: the CSI Mock manifests name an image"):
        images([manifest], REGISTRIES)
    manifest.write_text("spec:\n  containers:\n    - image: quay.io/someone/thing:v1\n")
    with pytest.raises(ValueError, match=r"maps no registry quay\.io/someone"):
        images([manifest], REGISTRIES)


def test_the_pause_image_is_the_kind_nodes_under_the_suites_tag() -> None:
    assert f"PAUSE_IMAGE={NODE_PAUSE_IMAGE}\n" in (REPO_ROOT / "tools" / "build-kind-node.sh").read_text()
    pause = pause_image()
    assert pause.source == NODE_PAUSE_IMAGE and pause.name.startswith("registry.k8s.io/pause:")
