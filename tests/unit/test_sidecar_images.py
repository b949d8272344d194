"""localstack.sidecar_images: kubeloop's image per upstream sidecar it replaces, each running that
sidecar as its entrypoint, so a manifest written for upstream's images needs only the image swapped."""

from __future__ import annotations

import tomllib

import pytest

from controller_runtime.toolchain import REPO_ROOT
from localstack.compose import KUBELOOP_IMAGE
from localstack.sidecar_images import (
    SCRIPTS,
    SIDECARS,
    dockerfile,
    replacement,
    sidecar_image,
    sidecar_images,
)


def test_each_image_runs_a_console_script_the_package_installs() -> None:
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, script in SIDECARS.items():
        assert script in scripts, name
        text = dockerfile(name)
        assert text.startswith(f"FROM {KUBELOOP_IMAGE}\n")
        assert f'ENTRYPOINT ["{SCRIPTS}/{script}"]' in text
        # No command: a manifest's args are the sidecar's flags. No user: root, as upstream's images.
        assert "CMD []" in text and "USER" not in text


def test_upstream_references_map_to_kubeloops_image_whatever_their_tag() -> None:
    tag = KUBELOOP_IMAGE.rsplit(":", 1)[1]
    assert (
        replacement("registry.k8s.io/sig-storage/csi-provisioner:v6.1.1") == f"kubeloop/csi-provisioner:{tag}"
    )
    assert (
        replacement("registry.k8s.io/sig-storage/csi-resizer@sha256:" + "0" * 64)
        == f"kubeloop/csi-resizer:{tag}"
    )
    assert replacement("registry.k8s.io/sig-storage/livenessprobe:v2.18.0") == f"kubeloop/livenessprobe:{tag}"
    # Sidecars kubeloop does not replace, and other registries, keep their image.
    assert replacement("registry.k8s.io/sig-storage/csi-snapshotter:v8.5.0") is None
    assert replacement("registry.k8s.io/sig-storage/hostpathplugin:v1.17.1") is None
    assert replacement("example.com/csi-provisioner:v1") is None
    assert sidecar_images() == [sidecar_image(n) for n in SIDECARS]
    with pytest.raises(KeyError, match="kubeloop has no image for csi-snapshotter"):
        sidecar_image("csi-snapshotter")
