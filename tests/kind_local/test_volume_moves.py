"""`kubectl kubeloop move` and `drain` with real kubelets and the real kube-scheduler (docs/volume-moves.md):
a claim with 1 GiB of data moved to another node, then off a drained node, its data intact each time,
its next pod placed on the new node by the scheduler, nothing left in the old node's pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from controller_runtime.toolchain import REPO_ROOT
from tests.support.waits import eventually

from ..kind.conftest import KindCluster
from ..kind.workloads import CHECK, claim, pod, wait_ready
from .placement import WFFC, assert_lives_on, delete_and_wait, node_of, pools

pytestmark = pytest.mark.root

# 1 GiB of random data and its checksum.
WRITE_GIB = (
    "dd if=/dev/urandom of=/data/blob bs=1M count=1024 2>/dev/null"
    " && sha256sum /data/blob > /data/blob.sha && sync && echo written && sleep 3600"
)


def kubeloop(kc: KindCluster, *args: str, timeout: float = 900) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kubectl_kubeloop.main", f"--kubeconfig={kc.cluster.kubeconfig}", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def leftovers(kc: KindCluster) -> list[str]:
    """Part files of pulls, in any worker's pool."""
    return [
        str(p)
        for pool in pools(kc).values()
        for p in (pool / "volumes").iterdir()
        if p.name.endswith((".part", ".progress"))
    ]


def read_back(kc: KindCluster, ns: str, name: str) -> str:
    """A pod that checks the data wherever the scheduler puts it; its node."""
    kc.apply(pod(ns, name, "big", None, CHECK))
    wait_ready(kc, ns, name, timeout=300)
    return node_of(kc, ns, name)


def test_a_volume_of_1_gib_moves_to_another_node_then_off_a_drained_one(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    kc.apply(claim(ns, "big", size="1536Mi", storage_class=WFFC))
    kc.apply(pod(ns, "writer", "big", None, WRITE_GIB))
    wait_ready(kc, ns, "writer", timeout=300)
    kc.kubectl("wait", "-n", ns, "--for=jsonpath={.status.phase}=Running", "pod/writer", "--timeout=60s")
    first = node_of(kc, ns, "writer")
    code, out = kubeloop(kc, "move", "pvc", "big", "-n", ns, "--to", first)
    assert code == 0 and f"already on node {first}" in out, out

    # In use: refused, with the pod named.
    target = next(n for n in kc.workers() if n != first)
    code, out = kubeloop(kc, "move", "pvc", "big", "-n", ns, "--to", target)
    assert code == 1 and f"used by pod(s) {ns}/writer" in out, out

    eventually(
        "the 1 GiB written",
        lambda: "blob" in kc.kubectl("exec", "-n", ns, "writer", "--", "cat", "/data/blob.sha", check=False),
        300,
        1,
    )
    delete_and_wait(kc, ns, "pod/writer")
    code, out = kubeloop(kc, "move", "pvc", "big", "-n", ns, "--to", target)
    assert code == 0 and f"big: moved to node {target}" in out.replace(volume_name(kc, ns), "big"), out
    assert_lives_on(kc, ns, "big", target)
    assert read_back(kc, ns, "reader") == target
    assert leftovers(kc) == []

    # Drain the node it is on now: refused while the reader uses it, moved once it is gone.
    kc.kubectl("cordon", target)
    try:
        code, out = kubeloop(kc, "drain", target)
        assert code == 1 and f"used by pod(s) {ns}/reader" in out, out
        delete_and_wait(kc, ns, "pod/reader")
        code, out = kubeloop(kc, "drain", target)
        assert code == 0 and f"drain {target}: 1 of 1 volume(s) moved" in out, out
    finally:
        kc.kubectl("uncordon", target)
    landed = read_back(kc, ns, "reader-2")
    assert landed != target
    assert_lives_on(kc, ns, "big", landed)
    assert leftovers(kc) == []


def volume_name(kc: KindCluster, ns: str) -> str:
    name: str = kc.get("pvc", "-n", ns, "big")["spec"]["volumeName"]
    return name
