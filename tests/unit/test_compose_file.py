"""docker-compose.yml is generated from the component registry: the checked-in file must be exactly
what `python -m localstack.compose generate` prints, and it must mirror the registry."""

from __future__ import annotations

import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack import compose
from localstack.components import REGISTRY, instance_ports, instances
from localstack.controlplane import Ports


def test_checked_in_compose_file_is_generated() -> None:
    checked_in = (REPO_ROOT / "docker-compose.yml").read_text()
    assert checked_in == compose.render(), (
        "docker-compose.yml is stale: run `python -m localstack.compose generate > docker-compose.yml`"
    )


def test_every_registry_instance_is_a_service() -> None:
    doc = yaml.safe_load(compose.render())
    services = doc["services"]
    for inst in instances(REGISTRY, compose.NODES):
        svc = services[inst.name]
        assert svc["network_mode"] == "host"
        assert svc["restart"] == "unless-stopped"
        assert svc["depends_on"]["setup"]["condition"] == "service_completed_successfully"
        if inst.component.name in compose.GO_IMAGES:
            # Upstream's binary is the image's entrypoint; a scratch image has no shell to probe with.
            assert svc["image"] == compose.images()[inst.component.name]
            assert svc["command"][0].startswith("--")
            continue
        assert "healthcheck" in svc, inst.name
        args = svc["command"]
        assert args[:2] == ["python", "-m"]
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        assert "healthcheck" in services[name] and services[name]["restart"] == "unless-stopped"
    # Only the node plugins are privileged; the controllers run as the non-root user.
    privileged = {n for n, s in services.items() if s.get("privileged")}
    assert privileged == {f"csi-driver-node-{n}" for n in compose.NODES}
    for name in compose.NON_ROOT & set(services):  # the node finalizer runs in node-local mode only
        assert services[name]["user"] == str(compose.NONROOT)


def test_ports_stay_clear_of_the_local_stack() -> None:
    local = set(Ports().described().values()) | set(instance_ports(REGISTRY, compose.NODES).values())
    ours = set(compose.PORTS.described().values()) | {
        p for inst in instances(REGISTRY, compose.NODES) if (p := compose.instance_port(inst)) is not None
    }
    assert not local & ours


def test_control_plane_images_keep_their_conventional_names() -> None:
    imgs = compose.images()
    assert imgs["kube-apiserver"].startswith("registry.k8s.io/kube-apiserver:v")
    assert imgs["etcd"].startswith("registry.k8s.io/etcd:3.")
