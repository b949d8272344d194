"""kubeloop's sidecars in upstream's own manifests, unchanged but for their images (issue 51): the
Kubernetes e2e suite's csi-driver-host-path deployment and the sidecars' rbac.yaml files from the Go
module cache, with kubeloop's driver under hostpath's name (tests/kind/upstream_manifests.py says
exactly what changes), then the `quick` e2e selection against it. Before kubeloop's sidecars took
Go's flag syntax, worked under upstream's RBAC and ran as root with images of their own, each of
those was a reason this deployment never started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from localstack import kind
from localstack.e2e_storage import QUICK_SPECS
from localstack.sidecar_images import SIDECARS, sidecar_image
from tests.support.waits import WaitFailed, eventually

from .conftest import KindCluster
from .e2e_quick import assert_quick_specs_pass
from .upstream_manifests import (
    DRIVER,
    E2E_DRIVER_FILE,
    KUBELOOP_SIDECARS,
    NAMESPACE,
    POOL_IN_CONTAINER,
    STATEFULSET,
    changed_fields,
    driver_info,
    hostpath_dir,
    plugin_documents,
    rbac_paths,
    swapped,
)

pytestmark = pytest.mark.root
# Less what the deployment does not offer: capacity (no --enable-capacity in upstream's args) and
# topology, whose specs want the key on every node where this single replica serves one.
SPECS = tuple(s for s in QUICK_SPECS if "capacity" not in s and "topology" not in s)


def registered_on(kc: KindCluster, node: str) -> bool:
    drivers = kc.get("csinode", node)["spec"].get("drivers") or []
    return any(d["name"] == DRIVER for d in drivers)


def our_volumes(kc: KindCluster) -> list[str]:
    return [
        pv["metadata"]["name"]
        for pv in kc.get("pv")["items"]
        if (pv["spec"].get("csi") or {}).get("driver") == DRIVER
    ]


def our_loop_devices() -> list[str]:
    out = kind.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], check=False).stdout
    return [line.strip() for line in out.splitlines() if POOL_IN_CONTAINER in line]


def restarts(pod: dict[str, Any]) -> dict[str, int]:
    return {s["name"]: s["restartCount"] for s in pod["status"].get("containerStatuses", [])}


@pytest.fixture(scope="module")
def upstream_deployment(kind_cluster: KindCluster) -> Iterator[str]:
    """The deployment up and registered; yields the node its one replica runs on. Afterwards: every
    volume of the driver gone, the deployment deleted, kubelet's registration gone, no loop device
    of its pool left on the host."""
    kc = kind_cluster
    files = [f"--filename={p}" for p in (driver_info(), *rbac_paths())]
    kc.kubectl("apply", *files)
    kc.apply(yaml.safe_dump_all(plugin_documents()))
    pod = f"{STATEFULSET}-0"
    node = ""
    problems: list[str] = []
    try:
        kc.kubectl(
            "rollout", "status", "-n", NAMESPACE, f"statefulset/{STATEFULSET}", "--timeout=240s", timeout=270
        )  # fmt: skip
        node = kc.get("pod", "-n", NAMESPACE, pod)["spec"]["nodeName"]
        eventually(f"kubelet registers {DRIVER} on {node}", lambda: registered_on(kc, node), 120)
        yield node
    finally:
        try:
            eventually(
                f"every volume of {DRIVER} deleted",
                lambda: not our_volumes(kc),
                300,
                context=lambda: our_volumes(kc),
            )
        except WaitFailed as e:
            problems.append(str(e))
        logs = kc.kubectl(
            "logs", "-n", NAMESPACE, pod, "--all-containers", "--prefix", "--tail=40", check=False
        )
        kc.kubectl(
            "delete",
            "-f",
            "-",
            "--wait=true",
            "--timeout=120s",
            input=yaml.safe_dump_all(plugin_documents()),
            check=False,
            timeout=150,
        )
        if node:
            try:
                eventually(f"{DRIVER} unregistered from {node}", lambda: not registered_on(kc, node), 120)
            except WaitFailed as e:
                problems.append(str(e))
        kc.kubectl("delete", "--ignore-not-found", *files, check=False)
        if our_loop_devices():
            problems.append(f"loop devices of the driver's pool left on the host: {our_loop_devices()}")
        if problems:
            pytest.fail("\n".join(problems) + f"\nthe deployment's last logs:\n{logs[-6000:]}")


def test_only_the_images_of_kubeloops_sidecars_change() -> None:
    docs = [d for d in yaml.safe_load_all((hostpath_dir() / "csi-hostpath-plugin.yaml").read_text()) if d]
    (original,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert changed_fields(original, swapped(original)) == {name: {"image"} for name in KUBELOOP_SIDECARS}
    ours = {c["name"]: c["image"] for c in swapped(original)["spec"]["template"]["spec"]["containers"]}
    assert {ours[n] for n in KUBELOOP_SIDECARS} == {sidecar_image(n) for n in SIDECARS}
    # Everything but the StatefulSet (its ServiceAccount and role bindings) is applied as upstream wrote it.
    assert [d for d in plugin_documents() if d["kind"] != "StatefulSet"] == [
        d for d in docs if d["kind"] != "StatefulSet"
    ]


def test_the_quick_e2e_specs_pass_through_kubeloops_sidecars_in_upstreams_manifests(
    kind_cluster: KindCluster, upstream_deployment: str, tmp_path: Path
) -> None:
    kc = kind_cluster
    pod = kc.get("pod", "-n", NAMESPACE, f"{STATEFULSET}-0")
    images = {c["name"]: c["image"] for c in pod["spec"]["containers"]}
    assert all(images[n].startswith("kubeloop/") for n in KUBELOOP_SIDECARS), images
    # Upstream's manifests say nothing of users: the sidecars run as the image's, root, beside a
    # driver whose socket is root's 0600.
    assert not any("runAsUser" in (c.get("securityContext") or {}) for c in pod["spec"]["containers"])
    csinode = kc.get("csinode", upstream_deployment)["spec"]["drivers"]
    (entry,) = [d for d in csinode if d["name"] == DRIVER]
    assert entry["topologyKeys"] == [f"topology.loop.csi.kubeloop.dev/{DRIVER}"]
    assert_quick_specs_pass(kc.cluster, tmp_path, SPECS, driver=E2E_DRIVER_FILE)
    # No sidecar or driver restarted on the way: none exited on a flag, a refused API call or the
    # socket, and kubeloop's livenessprobe kept the driver's liveness probe answered.
    after = kc.get("pod", "-n", NAMESPACE, f"{STATEFULSET}-0")
    assert set(restarts(after).values()) == {0}, restarts(after)
