"""The API client with token authentication and RBAC, and the CSI client against the real driver."""

from __future__ import annotations

import asyncio
import base64
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import yaml

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.csi_errors import DELETE_VOLUME, OperationState, classify
from controller_runtime.resources import PERSISTENT_VOLUMES, Resource
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane

pytestmark = pytest.mark.integration

SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount", True)
CLUSTER_ROLES = Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False)
CLUSTER_ROLE_BINDINGS = Resource(
    "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False
)


async def test_token_auth_with_rbac(
    api: ApiClient, control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    name = f"{namespace}-reader"
    await api.create(SERVICE_ACCOUNTS, {"metadata": {"name": "reader"}}, namespace)
    await api.create(
        CLUSTER_ROLES,
        {
            "metadata": {"name": name},
            "rules": [{"apiGroups": [""], "resources": ["persistentvolumes"], "verbs": ["list"]}],
        },
    )
    await api.create(
        CLUSTER_ROLE_BINDINGS,
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    token = (
        await api.request(
            "POST",
            SERVICE_ACCOUNTS.path(namespace, "reader", "token"),
            body={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 600},
            },
        )
    )["status"]["token"]
    kubeconfig = tmp_path / "token.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": control_plane.server,
                            "certificate-authority-data": base64.b64encode(
                                control_plane.ca_file.read_bytes()
                            ).decode(),
                        },
                    }
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    reader = await ApiClient.from_kubeconfig(str(kubeconfig), qps=50, burst=10)
    try:
        await reader.list_page(PERSISTENT_VOLUMES, limit=1)
        with pytest.raises(ApiError) as caught:
            await reader.list_page(SERVICE_ACCOUNTS, namespace)
        assert caught.value.forbidden
        assert "system:serviceaccount:" in caught.value.message
    finally:
        await reader.close()
        await api.delete(CLUSTER_ROLE_BINDINGS, name)
        await api.delete(CLUSTER_ROLES, name)


@pytest_asyncio.fixture(loop_scope="session")
async def controller_driver(tmp_path: Path) -> AsyncIterator[Path]:
    """The real CSI driver in controller mode (no loop devices needed). The test connects while it
    is still starting, so the connection has to wait for its socket and Probe."""
    socket = tmp_path / "csi.sock"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "csi_driver.main",
        "--mode=controller",
        f"--endpoint=unix://{socket}",
        f"--pool-dir={tmp_path / 'pool'}",
        f"--state-dir={tmp_path / 'state'}",
        "--capacity=10Gi",
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield socket
    finally:
        proc.terminate()
        await proc.wait()


async def test_csi_connection_waits_for_probe_and_reads_capabilities(controller_driver: Path) -> None:
    conn = await CSIConnection.connect(f"unix://{controller_driver}", timeout=5, wait=60)
    try:
        assert conn.driver_name == "loop.csi.kubeloop.dev"
        rpc = csi_pb2.ControllerServiceCapability.RPC
        assert conn.has_controller_capability(rpc.CREATE_DELETE_VOLUME)
        assert conn.has_controller_capability(rpc.PUBLISH_UNPUBLISH_VOLUME)
        assert conn.has_plugin_capability(csi_pb2.PluginCapability.Service.CONTROLLER_SERVICE)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await conn.controller.DeleteVolume(
                csi_pb2.DeleteVolumeRequest(volume_id=""), timeout=conn.timeout
            )
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert classify(DELETE_VOLUME, caught.value.code()) is OperationState.FINISHED
    finally:
        await conn.close()


async def test_csi_connection_gives_up_after_its_wait(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="not ready"):
        await CSIConnection.connect(f"unix://{tmp_path / 'absent.sock'}", timeout=1, wait=1)


async def test_a_name_nobody_validated_means_itself(api: ApiClient, namespace: str) -> None:
    """Names from fields the apiserver does not validate (a claim's selected-node annotation, its
    dataSource name, a volumeName) reach request paths. Sent raw, `x?y` and `x#y` read the object
    `x` (issue 29); encoded, they name objects that cannot exist, as client-go's requests do."""
    name = f"{namespace}-pv"
    await api.create(
        PERSISTENT_VOLUMES,
        {
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Mi"},
                "accessModes": ["ReadWriteOnce"],
                "hostPath": {"path": "/tmp/kubeloop-nowhere"},
            },
        },
    )
    try:
        assert (await api.get(PERSISTENT_VOLUMES, name))["metadata"]["name"] == name
        for odd in (f"{name}?dryRun=All", f"{name}#x", f"{name}/status", f"{name} "):
            with pytest.raises(ApiError) as err:
                await api.get(PERSISTENT_VOLUMES, odd)
            assert err.value.not_found, (odd, err.value)
            with pytest.raises(ApiError) as err:
                await api.patch(PERSISTENT_VOLUMES, odd, {"metadata": {"labels": {"touched": "yes"}}})
            assert err.value.not_found, (odd, err.value)
        assert "labels" not in (await api.get(PERSISTENT_VOLUMES, name))["metadata"]
    finally:
        await api.delete(PERSISTENT_VOLUMES, name)
