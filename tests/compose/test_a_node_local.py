"""docker-compose.node-local.yml end to end: each node's plugin on a pool volume of its own, its own
provisioner in node deployment, the real kube-scheduler placing the pod by the capacity each node
publishes; one claim provisioned in the scheduled node's pool and mounted there, then deleted down to
its backing file.

The node-local stack uses the same host ports as the shared one (docker-compose.yml, the package's
`stack` fixture), so the two cannot run at once: this module's name sorts before test_compose.py,
so its stack is up and gone before the package fixture starts the shared one (it refuses to start
beside a running shared stack, saying so)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from controller_runtime.toolchain import Toolchain
from localstack.compose import COMPOSE_FILES
from localstack.pools import NODE_LOCAL
from tests.support.waits import WaitFailed, eventually

from .conftest import COMPOSE_HOME, PROJECT, Stack, _leftovers, _loop_devices, run

NODE_LOCAL_PROJECT = "kubeloop-compose-node-local-test"
NS = "default"
TOPOLOGY_KEY = "topology.loop.csi.kubeloop.dev/node"


class NodeLocalStack(Stack):
    def compose(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run(
            ["docker-compose", "-p", NODE_LOCAL_PROJECT, "-f", COMPOSE_FILES[NODE_LOCAL], *args],
            timeout=timeout,
            check=check,
        )

    def pool_files(self, node: str) -> list[str]:
        listing = f"ls /var/lib/kubeloop/pools/{node}/volumes/ 2>/dev/null || true"
        return self.exec(f"csi-driver-node-{node}", listing).split()


def _project_containers(project: str) -> list[str]:
    label = f"label=com.docker.compose.project={project}"
    return run(["docker", "ps", "-aq", "--filter", label], check=False).stdout.split()


@pytest.fixture(scope="module")
def node_local() -> Iterator[NodeLocalStack]:
    if os.geteuid() != 0:
        pytest.fail("tests/compose need root (dockerd, loop devices)")
    started = run(["bash", "tools/docker-env.sh", "start"], timeout=180, check=False)
    if started.returncode != 0:
        pytest.fail(f"could not set up docker (tools/docker-env.sh start):\n{started.stderr}")
    we_started = started.stdout.strip() == "started"
    if _project_containers(PROJECT):
        pytest.fail(
            f"the shared compose stack ({PROJECT}) is up: it holds the ports the node-local one needs"
        )
    loops_before = _loop_devices()
    build = run(
        ["bash", "tools/build-images.sh"],
        timeout=900,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if build.returncode != 0:
        pytest.fail(f"tools/build-images.sh failed:\n{build.stderr[-4000:]}")
    s = NodeLocalStack(
        str(Toolchain.default().binary("kubectl")), COMPOSE_HOME / "kubeconfig", {}, loops_before
    )
    try:
        s.compose("down", "-v", "--remove-orphans", check=False)
        t = time.monotonic()
        up = s.compose("up", "-d", timeout=600, check=False)
        if up.returncode != 0:
            logs = s.compose("logs", "--tail=40", check=False).stdout[-8000:]
            pytest.fail(f"docker-compose up -d failed:\n{up.stderr[-3000:]}\n{logs}")
        s.wait_healthy()
        s.figures["up_to_healthy_s"] = time.monotonic() - t
        yield s
    finally:
        problems = _tear_down(s)
        shutil.rmtree(COMPOSE_HOME / "nodes", ignore_errors=True)
        if we_started:
            run(["bash", "tools/docker-env.sh", "stop"], timeout=120, check=False)
        print(f"\nnode-local compose figures: {json.dumps({k: round(v, 1) for k, v in s.figures.items()})}")
    if problems:
        pytest.fail("\n".join(problems))


def _tear_down(s: NodeLocalStack) -> list[str]:
    """What a failed test left (a pod, a claim) deleted through the API, then `down -v`, which must
    leave no container, volume, mount or loop device."""
    if s.kubeconfig.exists():
        for kind in ("pods", "pvc"):
            s.kubectl("delete", kind, "--all", "--all-namespaces", "--timeout=90s", check=False)
        with contextlib.suppress(WaitFailed):  # what is left is reported below
            eventually(
                "every PV gone", lambda: not s.kubectl("get", "pv", "-o", "name", check=False).strip(), 60, 1
            )
    problems = []
    down = s.compose("down", "-v", "--remove-orphans", check=False)
    if down.returncode != 0:
        problems.append(f"docker-compose down -v failed: {down.stderr[-2000:]}")
    label = f"label=com.docker.compose.project={NODE_LOCAL_PROJECT}"
    vols = run(["docker", "volume", "ls", "-q", "--filter", label], check=False).stdout.split()
    if _project_containers(NODE_LOCAL_PROJECT) or vols:
        problems.append(f"left behind: containers {_project_containers(NODE_LOCAL_PROJECT)} volumes {vols}")
    mounts, loops = _leftovers(s.loops_before)
    if mounts or loops:
        problems.append(f"left behind: mounts {mounts} loop devices {loops}")
    for m in sorted(mounts, reverse=True):
        run(["bash", "tools/docker-env.sh", "nsenter", "umount", "-l", m], check=False)
        run(["umount", "-l", m], check=False)
    for loop in loops:
        run(["losetup", "--detach", loop.split()[0]], check=False)
    return problems


CLAIM_AND_POD = """
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: kubeloop-wffc
  resources: {requests: {storage: 64Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: app}
spec:
  containers: [{name: app, image: busybox, volumeMounts: [{name: data, mountPath: /data}]}]
  volumes: [{name: data, persistentVolumeClaim: {claimName: data}}]
"""


def test_node_local_claim_is_made_and_mounted_in_the_scheduled_nodes_pool(node_local: NodeLocalStack) -> None:
    s = node_local
    # Nothing is shared between the nodes: each plugin has a pool volume of its own.
    volumes = run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={NODE_LOCAL_PROJECT}"]
    )
    assert {f"{NODE_LOCAL_PROJECT}_pool-node-a", f"{NODE_LOCAL_PROJECT}_pool-node-b"} <= set(
        volumes.stdout.split()
    )
    driver = json.loads(s.kubectl("get", "csidriver", "loop.csi.kubeloop.dev", "-o", "json"))["spec"]
    assert (driver["attachRequired"], driver["storageCapacity"]) == (False, True)
    eventually(
        "both nodes' capacity published",
        lambda: len(json.loads(s.kubectl("get", "csistoragecapacities", "-A", "-o", "json"))["items"]) >= 2,
        90,
        0.5,
    )

    s.kubectl("apply", "-n", NS, "-f", "-", input=CLAIM_AND_POD)
    eventually(
        "app Running",
        lambda: s.kubectl("get", "pod", "app", "-o", "jsonpath={.status.phase}") == "Running",
        90,
        0.5,
    )
    node = s.kubectl("get", "pod", "app", "-o", "jsonpath={.spec.nodeName}")
    other = "node-b" if node == "node-a" else "node-a"
    pv = s.kubectl("get", "pvc", "data", "-o", "jsonpath={.spec.volumeName}")
    affinity = json.loads(s.kubectl("get", "pv", pv, "-o", "jsonpath={.spec.nodeAffinity.required}"))
    assert affinity == {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [node]}]}
        ]
    }
    handle = s.kubectl("get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")
    assert s.pool_files(node) == [f"{handle}.img"] and s.pool_files(other) == []
    assert json.loads(s.kubectl("get", "volumeattachments", "-o", "json"))["items"] == []

    uid = s.kubectl("get", "pod", "app", "-o", "jsonpath={.metadata.uid}")
    path = f"/var/lib/kubeloop/nodes/{node}/kubelet/pods/{uid}/volumes/kubernetes.io~csi/{pv}/mount"
    eventually(f"{path} mounted on {node}", lambda: s.mounted(f"csi-driver-node-{node}", path), 90, 0.5)
    s.exec(f"csi-driver-node-{node}", f"echo node-local > {path}/hello && sync")
    assert s.exec(f"csi-driver-node-{node}", f"cat {path}/hello").strip() == "node-local"

    s.kubectl("delete", "pod", "app", "-n", NS, "--wait=true", "--timeout=90s")
    s.kubectl("delete", "pvc", "data", "-n", NS, "--wait=true", "--timeout=90s")
    eventually(f"PV {pv} deleted", lambda: not s.kubectl("get", "pv", "-o", "name").strip(), 90, 0.5)
    eventually(
        "the backing file deleted by the node's provisioner", lambda: s.pool_files(node) == [], 90, 0.5
    )
    assert s.pool_loop_devices() == [], "a loop device outlived its volume"
