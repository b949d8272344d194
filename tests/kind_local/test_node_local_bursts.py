"""Node-local provisioning under load with real kubelets: Immediate claims elected by the nodes'
provisioners (each made exactly once, on one node), and a burst during which a node's provisioner
and another node's plugin are killed with SIGKILL (kubelet restarts them; it converges with one
backing file per volume, nothing leaked once the claims are gone)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from localstack import kind
from tests.support.waits import eventually, no_problems

from ..kind.conftest import KindCluster
from ..kind.workloads import claim
from .placement import pinned_nodes, pools

IMMEDIATE = "kubeloop"
pytestmark = pytest.mark.root


def pool_files(kc: KindCluster) -> dict[str, set[str]]:
    """Each worker's backing files (volume handles), read from its own host directory."""
    return {
        node: {p.name.removesuffix(".img") for p in (pool / "volumes").glob("*.img")}
        for node, pool in pools(kc).items()
    }


def bound_volumes(kc: KindCluster, ns: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """The PVs of the claims once every one is Bound, by claim name."""

    def all_bound() -> list[str] | None:
        claims = {c["metadata"]["name"]: c for c in kc.get("pvc", "-n", ns)["items"]}
        done = [n for n in names if claims.get(n, {}).get("status", {}).get("phase") == "Bound"]
        return [claims[n]["spec"]["volumeName"] for n in names] if len(done) == len(names) else None

    eventually(f"{len(names)} claims Bound", all_bound, 300, 2)
    volumes = {pv["metadata"]["name"]: pv for pv in kc.get("pv")["items"]}
    claims = {c["metadata"]["name"]: c for c in kc.get("pvc", "-n", ns)["items"]}
    return {n: volumes[claims[n]["spec"]["volumeName"]] for n in names}


def assert_each_made_once(kc: KindCluster, pvs: dict[str, dict[str, Any]]) -> None:
    """Every volume pinned to one node and its backing file in that node's pool alone; no pool holds
    a file no PV names (a duplicate made by a lost election or a killed create)."""
    files = pool_files(kc)
    handles = {pv["spec"]["csi"]["volumeHandle"]: pv for pv in kc.get("pv")["items"]}
    for name, pv in pvs.items():
        [node] = pinned_nodes(pv)
        handle = pv["spec"]["csi"]["volumeHandle"]
        assert {n for n, held in files.items() if handle in held} == {node}, name
    for node, held in files.items():
        assert held <= set(handles), f"{node} holds backing files no PV names: {sorted(held - set(handles))}"


def kill_in(node: str, command: str) -> None:
    """SIGKILL, from the host, of the processes running `command` inside the kind node `node`: a
    node's pods run in its container's cgroup, which names the container (the node image has no
    pkill, and the host sees every process)."""
    container = kind.run(["docker", "inspect", "-f", "{{.Id}}", node]).stdout.strip()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cgroups = (proc / "cgroup").read_text()
        except OSError:
            continue  # gone meanwhile
        if command in cmdline and container in cgroups:
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(proc.name)
    assert killed, f"no {command} process in {node}"


def process_of(kc: KindCluster, component: str) -> str:
    """What to kill for a node's `component` (kubeloop-external-provisioner, kubeloop-csi-driver):
    its own process, or the plugin's that runs it with the chart's node.embedSidecars (the
    default), where the provisioner's death is the driver's too."""
    containers = kc.kubectl(
        "get", "daemonset", "-n", "kube-system", "kubeloop-csi-node",
        "-o", "jsonpath={.spec.template.spec.containers[*].name}",
    ).split()  # fmt: skip
    return component if "csi-provisioner" in containers else "kubeloop-node-plugin"


def delete_all(kc: KindCluster, ns: str, names: list[str]) -> None:
    kc.kubectl("delete", "-n", ns, "pvc", *names, "--wait=true", "--timeout=180s", timeout=210)


def test_twenty_immediate_claims_are_each_provisioned_once_on_one_node(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    names = [f"now-{i:02d}" for i in range(20)]
    kc.apply("---".join(claim(ns, n, size="32Mi", storage_class=IMMEDIATE) for n in names))
    pvs = bound_volumes(kc, ns, names)
    assert_each_made_once(kc, pvs)
    handles = {pv["spec"]["csi"]["volumeHandle"] for pv in pvs.values()}
    assert len(handles) == 20
    delete_all(kc, ns, names)
    eventually(
        "the backing files removed",
        lambda: handles & set().union(*pool_files(kc).values()),
        120,
        0.5,
        satisfied=no_problems,
    )


def test_a_burst_survives_a_killed_provisioner_and_plugin(local_cluster: KindCluster, namespace: str) -> None:
    kc, ns = local_cluster, namespace
    first, second = kc.workers()[:2]
    names = [f"burst-{i:02d}" for i in range(30)]
    kc.apply("---".join(claim(ns, n, size="32Mi", storage_class=IMMEDIATE) for n in names))
    # Mid-burst: one node's provisioner and another node's plugin die with SIGKILL.
    eventually("the first volumes made", lambda: any(pool_files(kc).values()), 120, 0.5)
    kill_in(first, process_of(kc, "kubeloop-external-provisioner"))
    kill_in(second, process_of(kc, "kubeloop-csi-driver"))
    pvs = bound_volumes(kc, ns, names)
    assert_each_made_once(kc, pvs)
    handles = {pv["spec"]["csi"]["volumeHandle"] for pv in pvs.values()}
    delete_all(kc, ns, names)

    def leftovers() -> set[str]:
        return handles & set().union(*pool_files(kc).values())

    eventually("every backing file removed", leftovers, 180, 0.5, satisfied=no_problems)
    assert all(Path(p).is_dir() for p in pools(kc).values())
