"""kubeloop deployed in a kind cluster with real kubelets, created once for tests/kind and deleted right
after them (localstack/kind.py, the code behind `make kind-up` and `make kind-down`).

The fixture builds the images when they are missing or stale (tools/build-kind-node.sh), creates the
cluster, loads the images and applies deploy/. At the end it deletes every workload (kubeloop then
unmounts, detaches and deletes the volumes), deletes the cluster and checks the host keeps no loop
device, mount or container of it. When docker or kind cannot be set up the tests fail, never skip
(CI runs them from `make test`). KUBELOOP_KIND_KEEP=1 leaves the cluster running for debugging."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from localstack import kind
from localstack.kind import Cluster, KindError
from tests.support.waits import eventually


@dataclass
class KindCluster:
    cluster: Cluster
    figures: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        return self.cluster.kubectl(*args, input=input, check=check, timeout=timeout)

    def get(self, *args: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json"))
        return result

    def apply(self, manifest: str) -> None:
        self.kubectl("apply", "-f", "-", input=manifest)

    def node_exec(self, node: str, *command: str, check: bool = True) -> str:
        return kind.run(["docker", "exec", node, *command], check=check).stdout

    def workers(self) -> list[str]:
        return sorted(n for n in self.cluster.nodes() if "control-plane" not in n)


@contextmanager
def kind_session(cluster: Cluster) -> Iterator[KindCluster]:
    """kubeloop up in `cluster` for a package of tests, and everything down after them, the host
    checked for leftovers (a failure then fails the last test)."""
    if os.geteuid() != 0:
        pytest.fail("tests/kind need root (dockerd, loop devices, mounts)")
    started = kind.run(["bash", "tools/docker-env.sh", "start"], timeout=180, check=False)
    if started.returncode != 0:
        pytest.fail(f"could not set up docker (tools/docker-env.sh start):\n{started.stderr}")
    we_started = started.stdout.strip() == "started"
    if not cluster.exists() and kind.pool_loop_devices():
        pytest.fail(f"loop devices of a kind pool are attached with no cluster: {kind.pool_loop_devices()}")
    kc = KindCluster(cluster)
    problems: list[str] = []
    try:
        try:
            kc.figures.update(kind.up(cluster))
        except KindError as e:
            pytest.fail(f"kubeloop could not be brought up in kind: {e}")
        yield kc
    finally:
        if os.environ.get("KUBELOOP_KIND_KEEP") == "1":
            print(f"\nKUBELOOP_KIND_KEEP=1: cluster {cluster.name} keeps running ({cluster.kubeconfig})")
        else:
            start = time.monotonic()
            problems = kind.down(cluster)
            kc.figures["down_s"] = time.monotonic() - start
            problems += _host_leftovers(cluster.name)
            if we_started:
                kind.run(["bash", "tools/docker-env.sh", "stop"], timeout=120, check=False)
        figures = json.dumps({k: round(v, 1) for k, v in kc.figures.items()})
        print(f"\nkind figures ({cluster.pools} pools): {figures}")
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture(scope="package")
def kind_cluster() -> Iterator[KindCluster]:
    with kind_session(Cluster()) as kc:
        yield kc


def _host_leftovers(name: str) -> list[str]:
    problems = []
    containers = kind.run(
        ["docker", "ps", "-aq", "--filter", f"label=io.x-k8s.kind.cluster={name}"], check=False
    ).stdout.split()
    if containers:
        problems.append(f"kind containers left: {containers}")
    for prefix in (["bash", "tools/docker-env.sh", "nsenter"], []):
        mounts = kind.run([*prefix, "findmnt", "-rn", "-o", "TARGET"], check=False).stdout.splitlines()
        left = [m for m in mounts if str(kind.SHARED_DIR) in m]
        if left:
            problems.append(f"mounts left: {left}")
    if kind.pool_loop_devices():
        problems.append(f"loop devices left: {kind.pool_loop_devices()}")
    if kind.SHARED_DIR.exists():
        problems.append(f"{kind.SHARED_DIR} left")
    if kind.run(["docker", "network", "inspect", kind.KIND_NETWORK], check=False).returncode == 0:
        problems.append(f"docker network {kind.KIND_NETWORK} left")
    return problems


@contextmanager
def scratch_namespace(kc: KindCluster) -> Iterator[str]:
    """A namespace of its own for one test, deleted (with its pods and claims) after it."""
    name = f"kind-{uuid.uuid4().hex[:8]}"
    kc.kubectl("create", "namespace", name)
    try:
        # Admission refuses pods until kcm has made the namespace's default ServiceAccount.
        eventually(
            f"kcm to make serviceaccount {name}/default",
            lambda: kc.kubectl("-n", name, "get", "serviceaccounts", "-o", "name", check=False),
            60,
            0.5,
            satisfied=lambda accounts: "serviceaccount/default" in accounts,
        )
        yield name
    finally:
        kc.kubectl("delete", "namespace", name, "--wait=true", "--timeout=180s", check=False, timeout=200)


@pytest.fixture
def namespace(kind_cluster: KindCluster) -> Iterator[str]:
    with scratch_namespace(kind_cluster) as name:
        yield name
