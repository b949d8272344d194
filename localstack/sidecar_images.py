"""kubeloop's sidecars as images named like upstream's, each with its own process as entrypoint.

A manifest written for upstream's sidecars (the Kubernetes e2e suite's storage-csi manifests,
csi-driver-host-path's deploy, a vendor's chart) names an image and gives only `args`: the image's
entrypoint is the sidecar. kubeloop's one image holds every process, so a swap of the image alone
would run its default command. These images are that image with the entrypoint set, one per
upstream sidecar kubeloop replaces: `registry.k8s.io/sig-storage/csi-provisioner:vX` becomes
`kubeloop/csi-provisioner:<kubeloop's version>`, and nothing else in the manifest changes
(docs/sidecar-flags.md). Like upstream's images they name no user, so they run as root unless the
pod says otherwise. tools/build-images.sh builds them; localstack/kind.py loads them."""

from __future__ import annotations

import sys

from .compose import KUBELOOP_IMAGE

# upstream's image name (registry.k8s.io/sig-storage/<name>) -> the console script it runs.
SIDECARS = {
    "csi-provisioner": "kubeloop-external-provisioner",
    "csi-attacher": "kubeloop-external-attacher",
    "csi-resizer": "kubeloop-external-resizer",
    "csi-node-driver-registrar": "kubeloop-node-driver-registrar",
    "livenessprobe": "kubeloop-livenessprobe",
}
UPSTREAM_REPOSITORY = "registry.k8s.io/sig-storage/"
# Where the image installs the console scripts (Dockerfile: the virtualenv /opt/kubeloop).
SCRIPTS = "/opt/kubeloop/bin"


def sidecar_image(upstream_name: str) -> str:
    """kubeloop's image standing for upstream's image of this name, at kubeloop's version."""
    if upstream_name not in SIDECARS:
        raise KeyError(f"kubeloop has no image for {upstream_name}: it replaces {', '.join(SIDECARS)}")
    return f"kubeloop/{upstream_name}:{KUBELOOP_IMAGE.rsplit(':', 1)[1]}"


def sidecar_images() -> list[str]:
    """Every one of these images (one `kind load` of them all shares the kubeloop image's layers)."""
    return [sidecar_image(name) for name in SIDECARS]


def replacement(image: str) -> str | None:
    """kubeloop's image for an upstream sidecar image reference (any tag), or None when kubeloop
    replaces no such sidecar."""
    if not image.startswith(UPSTREAM_REPOSITORY):
        return None
    name = image[len(UPSTREAM_REPOSITORY) :].split("@", 1)[0].split(":", 1)[0]
    return sidecar_image(name) if name in SIDECARS else None


def dockerfile(upstream_name: str) -> str:
    """The image's whole Dockerfile: kubeloop's image, the sidecar as entrypoint, no command (a
    manifest's args are the sidecar's flags)."""
    return (
        f"FROM {KUBELOOP_IMAGE}\n"
        f'ENTRYPOINT ["{SCRIPTS}/{SIDECARS[upstream_name]}"]\n'
        "CMD []\n"
        f"LABEL org.opencontainers.image.title=kubeloop-{upstream_name}\n"
    )


def main(argv: list[str]) -> None:
    """For tools/build-images.sh: no argument prints `<tag> <upstream name>` per image;
    `dockerfile NAME` prints that image's Dockerfile."""
    if argv[:1] == ["dockerfile"] and len(argv) == 2:
        print(dockerfile(argv[1]), end="")
    elif not argv:
        for name, image in zip(SIDECARS, sidecar_images(), strict=True):
            print(image, name)
    else:
        raise SystemExit("usage: python -m localstack.sidecar_images [dockerfile NAME]")


if __name__ == "__main__":
    main(sys.argv[1:])
