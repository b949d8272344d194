"""Two node-local driver processes with transfers on, beside a real API server (tests/conftest's
control plane): what kubelet and the chart give a node plugin in a cluster, made by hand.

Each "node" gets a Node object, a plugin Pod (on that node, marked Running with a loopback pod IP
of its own, 127.0.0.N, where its driver's transfer server listens) and a transfer token that the
API server issues bound to that Pod, exactly as kubelet's projected token is. The drivers reach the
API server as the chart's ServiceAccount kubeloop-csi-node, with the chart's own RBAC for it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from controller_runtime.client import ApiClient
from controller_runtime.driver_names import topology_key
from controller_runtime.resources import NODES, PODS, SECRETS
from controller_runtime.toolchain import REPO_ROOT
from localstack.certs import service_account_identity
from localstack.controlplane import ControlPlane

from .conftest import Driver
from .processes import free_port

NAMESPACE = "kube-system"
PLUGIN_ACCOUNT = "kubeloop-csi-node"
# A driver name of these tests' own: the session's API server is shared with other tests, whose
# Nodes may carry kubeloop's own topology label with no plugin behind it.
DRIVER = "transfers.csi.kubeloop.dev"
TOPOLOGY = topology_key(DRIVER)
AUDIENCE = f"transfer.{DRIVER}"
SERVER_NAME = AUDIENCE
PEER_LABELS = {"app.kubernetes.io/name": "kubeloop", "app.kubernetes.io/component": "csi-node"}
RBAC_NAME = "kubeloop:csi-node-transfers"
TLS_SECRET = "kubeloop-transfer-tls"


def chart_rbac() -> str:
    """The chart's objects for the plugin's transfers, as rendered into deploy/node-local/: its
    ServiceAccount, its RBAC and the (empty) TLS Secret."""
    docs = yaml.safe_load_all((REPO_ROOT / "deploy/node-local/kubeloop.yaml").read_text())
    wanted = [
        d
        for d in docs
        if d
        and (
            d["metadata"]["name"] in (RBAC_NAME, TLS_SECRET)
            or (d["kind"] == "ServiceAccount" and d["metadata"]["name"] == PLUGIN_ACCOUNT)
        )
    ]
    assert len(wanted) == 6, [d["kind"] for d in wanted]
    return yaml.safe_dump_all(wanted)


async def token_for(api: ApiClient, account: str, audience: str, pod: dict[str, str] | None) -> str:
    """A token the API server issues for `account` (TokenRequest), bound to `pod` when given."""
    spec: dict[str, object] = {"audiences": [audience], "expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", **pod}
    reply = await api.request(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return str(reply["status"]["token"])


async def plugin_pod(
    api: ApiClient, name: str, node: str, ip: str, account: str = PLUGIN_ACCOUNT
) -> dict[str, str]:
    """A Pod on `node`, Running at `ip` (its status written as kubelet would); its name and uid."""
    pod = await api.create(
        PODS,
        {
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": dict(PEER_LABELS) if account == PLUGIN_ACCOUNT else {},
            },
            "spec": {
                "nodeName": node,
                "serviceAccountName": account,
                "automountServiceAccountToken": False,
                "containers": [{"name": "plugin", "image": "kubeloop/kubeloop:0.1.0"}],
            },
        },
        NAMESPACE,
    )
    pod["status"] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    await api.update_status(PODS, pod)
    return {"name": name, "uid": str(pod["metadata"]["uid"])}


async def force_delete_pod(api: ApiClient, name: str, namespace: str) -> None:
    """Deletes a pod no kubelet runs (graceful deletion would wait for one to confirm)."""
    await api.request(
        "DELETE",
        PODS.path(namespace, name),
        body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
    )


@dataclass
class ClusterNode:
    name: str
    ip: str
    driver: Driver
    token_file: Path
    pod: dict[str, str]


def file_digest(path: str | Path, length: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        while chunk := f.read(1 << 20 if left is None else min(1 << 20, left)):
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
                if not left:
                    break
    return h.hexdigest()


def write_scattered(path: str | Path, blocks: int, seed: int = 7) -> None:
    """1 MiB blocks of data at every fourth MiB of the file (the rest left a hole), each of its own
    content, so a block written at the wrong offset changes the digest."""
    with open(path, "r+b") as f:
        for i in range(blocks):
            f.seek(i * 4 << 20)
            f.write(hashlib.sha256(f"{seed}-{i}".encode()).digest() * (1 << 15))
        f.flush()
        os.fsync(f.fileno())


class TransferCluster:
    """Nodes with node-local drivers, made and cleaned up around one test."""

    def __init__(self, cp: ControlPlane, api: ApiClient, root: Path) -> None:
        self.cp, self.api, self.root = cp, api, root
        self.suffix = secrets.token_hex(3)
        self.port = free_port()
        self.nodes: list[ClusterNode] = []
        self.kubeconfig = str(cp.kubeconfig_for(service_account_identity(PLUGIN_ACCOUNT)))

    async def add_node(self, index: int, failpoints: str = "") -> ClusterNode:
        name = f"xfer-{self.suffix}-{index}"
        ip = f"127.0.0.{index + 2}"
        await self.api.create(NODES, {"metadata": {"name": name, "labels": {TOPOLOGY: name}}})
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
        await self.api.patch(NODES, name, {"status": {"conditions": [ready]}}, subresource="status")
        pod = await plugin_pod(self.api, f"plugin-{name}", name, ip)
        work = Path(tempfile.mkdtemp(prefix="x", dir=self.root))
        (work / "pool").mkdir()
        token_file = work / "transfer-token"
        token_file.write_text(await token_for(self.api, PLUGIN_ACCOUNT, AUDIENCE, pod))
        extra = [
            f"--drivername={DRIVER}",
            "--node-local",
            f"--transfer-port={self.port}",
            f"--transfer-address={ip}",
            f"--transfer-token-file={token_file}",
            f"--transfer-namespace={NAMESPACE}",
            f"--kubeconfig={self.kubeconfig}",
        ]
        if failpoints:
            extra.append(f"--failpoints={failpoints}")
        driver = Driver(
            work,
            "all",
            name,
            extra,
            module="tests.csi.driver_failpoints" if failpoints else "csi_driver.main",
        )
        added = ClusterNode(name, ip, driver, token_file, pod)
        self.nodes.append(added)
        return added

    def restart(self, node: ClusterNode) -> None:
        """Starts the node's driver again, its failpoints disarmed."""
        node.driver.extra = [a for a in node.driver.extra if not a.startswith("--failpoints=")]
        node.driver.module = "csi_driver.main"
        node.driver.start()

    async def tls_secret(self) -> dict[str, bytes]:
        secret = await self.api.get(SECRETS, "kubeloop-transfer-tls", NAMESPACE)
        return {k: base64.b64decode(v) for k, v in secret["data"].items()}

    async def clean(self) -> None:
        for node in self.nodes:
            await force_delete_pod(self.api, node.pod["name"], NAMESPACE)
            await self.api.delete(NODES, node.name)
