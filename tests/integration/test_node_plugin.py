"""`kubeloop-node-plugin` against the real apiserver: the driver (`--mode=all --node-local`), the
node's external-provisioner and external-resizer (`--node-deployment`) in one process, as the Helm
chart's `node.embedSidecars` runs them.

- a WaitForFirstConsumer claim selected for the node is provisioned, bound and then expanded by the
  process's own provisioner and resizer, each under its own identity: the provisioner with a
  kubeconfig, the resizer with a service account's token directory (a real TokenRequest), read as
  in-cluster credentials;
- one /metrics holds each family once, the calls of both sidecars and the driver's;
- /readyz holds the checks of the three; SIGTERM stops the three and exits 0;
- a component that cannot start (the resizer's credentials missing) takes the process down, exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.http_client import ConnectionPool, TransportError
from controller_runtime.resources import CSI_NODES, NODES, PERSISTENT_VOLUME_CLAIMS, Resource
from controller_runtime.toolchain import REPO_ROOT
from localstack.controlplane import ControlPlane
from localstack.proc import free_ports
from tests.support.waits import eventually_async, no_problems

from .provisioner_harness import IDENTITY, Harness, create_topology_node, kubectl, terminate

pytestmark = pytest.mark.integration

SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
CLUSTER_ROLE_BINDINGS = Resource(
    "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False
)


class Plugin:
    """One node's kubeloop-node-plugin process and what it was started with."""

    def __init__(self, h: Harness, node: str) -> None:
        self.h, self.node = h, node
        self.root = h.root / "plugin"
        (self.root / "pool").mkdir(parents=True)  # a node-local pool must exist before the plugin
        self.socket = self.root / "csi.sock"
        self.log = self.root / "plugin.log"
        self.port = free_ports(1)[0]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, resizer_kubeconfig: Path, env: dict[str, str]) -> None:
        csi = f"--csi-address={self.socket}"
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_plugin.main",
            f"--http-endpoint=127.0.0.1:{self.port}",
            "--v=4",
            "--",
            "csi-driver",
            "--mode=all",
            "--node-local",
            f"--endpoint=unix://{self.socket}",
            f"--node-id={self.node}",
            f"--pool-dir={self.root / 'pool'}",
            f"--state-dir={self.root / 'state'}",
            f"--kubelet-dir={self.root / 'kubelet'}",
            "--",
            "external-provisioner",
            f"--kubeconfig={self.h.cp.kubeconfig_for(IDENTITY)}",
            csi,
            f"--state-dir={self.root / 'provisioner'}",
            "--node-deployment",
            "--strict-topology",
            "--immediate-topology=false",
            "--retry-interval-start=100ms",
            "--",
            "external-resizer",
            f"--kubeconfig={resizer_kubeconfig}",
            csi,
            "--node-deployment",
            "--retry-interval-start=100ms",
            cwd=REPO_ROOT,
            env={**os.environ, "NODE_NAME": self.node, **env},
            stdout=self.log.open("ab"),
            stderr=asyncio.subprocess.STDOUT,
        )

    async def get(self, path: str) -> tuple[int, str]:
        pool = ConnectionPool(f"http://127.0.0.1:{self.port}", None, limit=1, headers={})
        try:
            answer = await pool.request("GET", path, timeout=5)
            return answer.status, answer.body.decode()
        finally:
            await pool.close()

    async def wait_readyz(self, what: str, status: int, text: str) -> None:
        """Until /readyz answers `status` with `text` in its body."""

        async def seen() -> tuple[int, str] | None:
            assert self.proc is not None and self.proc.returncode is None, f"exited\n{self.log_tail()}"
            with contextlib.suppress(TransportError, TimeoutError):
                return await self.get("/readyz")
            return None

        await eventually_async(
            what,
            seen,
            60,
            0.2,
            satisfied=lambda a: a is not None and a == (status, text),
            context=self.log_tail,
        )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


async def service_account_dir(
    cp: ControlPlane, api: ApiClient, namespace: str, name: str, into: Path
) -> Path:
    """A new ServiceAccount `namespace`/`name`: its token and the cluster's CA in a directory, as a
    token Secret mounts them."""
    await api.create(SERVICE_ACCOUNTS, {"metadata": {"name": name}}, namespace)
    token = (
        await api.request(
            "POST",
            SERVICE_ACCOUNTS.path(namespace, name, "token"),
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        )
    )["status"]["token"]
    write_service_account_dir(into, token, cp.ca_file)
    return into


async def bind(api: ApiClient, namespace: str, account: str, cluster_role: str) -> str:
    """`namespace`/`account` given `cluster_role`; the binding's name, to delete it."""
    name = f"{namespace}-{account}-{cluster_role.replace(':', '-')}"
    await api.create(
        CLUSTER_ROLE_BINDINGS,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
    )
    return name


def write_service_account_dir(into: Path, token: str, ca: Path) -> None:
    into.mkdir(parents=True)
    (into / "token").write_text(token)
    (into / "ca.crt").write_bytes(ca.read_bytes())


def in_cluster_env(cp: ControlPlane) -> dict[str, str]:
    server = urlsplit(cp.server)
    return {"KUBERNETES_SERVICE_HOST": str(server.hostname), "KUBERNETES_SERVICE_PORT": str(server.port)}


@contextlib.asynccontextmanager
async def one_node(cp: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[tuple[Harness, Plugin]]:
    h = Harness(cp, api, namespace)
    plugin = Plugin(h, f"{namespace}-n")
    try:
        for rbac in ("external-provisioner", "external-resizer", "node-deployment"):
            await kubectl(cp, "apply", "-f", str(REPO_ROOT / f"deploy/rbac/{rbac}.yaml"))
        await create_topology_node(api, plugin.node)
        await h.start_pv_controller()
        yield h, plugin
    finally:
        await terminate(plugin.proc)
        await h.cleanup()
        for res in (CSI_NODES, NODES):
            with contextlib.suppress(ApiError):
                await api.delete(res, plugin.node)


async def test_one_process_provisions_and_expands_with_each_components_identity(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with one_node(control_plane, api, namespace) as (h, plugin):
        # The resizer's own account, here one of the test's: bound to the external-resizer's role
        # but not yet to node-local mode's right to read its Node.
        tokens = await service_account_dir(control_plane, api, namespace, "resizer", h.root / "resizer-token")
        bindings = [await bind(api, namespace, "resizer", "kubeloop:external-resizer")]
        try:
            await plugin.start(tokens, in_cluster_env(control_plane))
            # The one /readyz holds the resizer's check, failing, beside the driver's and the
            # provisioner's, which pass.
            await plugin.wait_readyz(
                "/readyz failing on the resizer's informers alone",
                503,
                "[-]informers failed: caches not synced\n",
            )
            bindings.append(await bind(api, namespace, "resizer", "kubeloop:node-deployment:nodes"))
            await plugin.wait_readyz("the plugin ready", 200, "ok")
            await provision_and_expand(api, namespace, h, plugin)
        finally:
            for binding in bindings:
                with contextlib.suppress(ApiError):
                    await api.delete(CLUSTER_ROLE_BINDINGS, binding)


async def provision_and_expand(api: ApiClient, namespace: str, h: Harness, plugin: Plugin) -> None:
    """A claim selected for the plugin's node provisioned, bound and expanded; the metrics of the
    one endpoint; SIGTERM."""
    cls = await h.create_class("wffc", volumeBindingMode="WaitForFirstConsumer", allowVolumeExpansion=True)
    await h.create_pvc("data", "16Mi", cls, annotations={storage.ANN_SELECTED_NODE: plugin.node})
    pv = (await h.bound("data", timeout=30))["data"]
    handle = pv["spec"]["csi"]["volumeHandle"]
    assert (plugin.root / "pool" / "volumes" / f"{handle}.img").exists()

    await api.patch(
        PERSISTENT_VOLUME_CLAIMS,
        "data",
        {"spec": {"resources": {"requests": {"storage": "32Mi"}}}},
        namespace,
    )

    async def expanded() -> list[str]:
        current = await h.pv(pv["metadata"]["name"])
        size = current["spec"]["capacity"]["storage"] if current else None
        return [] if size == "32Mi" else [f"PV capacity {size}"]

    await eventually_async(
        "the PV expanded by the process's resizer",
        expanded,
        30,
        0.2,
        satisfied=no_problems,
        context=plugin.log_tail,
    )

    status, metrics = await plugin.get("/metrics")
    assert status == 200
    types = [line for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "a family served twice"

    def calls(family: str, method: str) -> float:
        prefix = f"{family}_count{{"
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(prefix) and f'method_name="{method}"' in line
        )

    sidecars = "csi_sidecar_operations_seconds"
    assert calls(sidecars, "/csi.v1.Controller/CreateVolume") == 1
    assert calls(sidecars, "/csi.v1.Controller/ControllerExpandVolume") == 1
    assert calls("csi_operations_seconds", "CreateVolume") == 1  # the driver's own, by short name

    assert plugin.proc is not None
    plugin.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(plugin.proc.wait(), 30) == 0, plugin.log_tail()
    assert not plugin.socket.exists(), "the driver's socket outlived the process"


async def test_a_component_that_cannot_start_takes_the_process_down(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with one_node(control_plane, api, namespace) as (h, plugin):
        await plugin.start(h.root / "no-such-token-dir" / "kubeconfig", in_cluster_env(control_plane))
        assert plugin.proc is not None
        code = await asyncio.wait_for(plugin.proc.wait(), 60)
        log = plugin.log_tail()
        assert code == 1, log
        assert "fatal error" in log and "no-such-token-dir" in log, log
