"""kubeloop's sidecars under upstream's published RBAC, applied unchanged (issue 51): the rbac.yaml
of the Go sidecar, from the Kubernetes e2e suite's storage-csi manifests in the Go module cache, and
the sidecar authenticating as the ServiceAccount that file declares. tests/unit/test_upstream_rbac.py
checks that kubeloop's own deploy/rbac/ asks for no more."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from controller_runtime.client import ApiClient
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, VOLUME_ATTACHMENTS
from csi_driver import DRIVER_NAME
from external_provisioner import names
from localstack.certs import service_account_identity
from localstack.controlplane import ControlPlane
from tests.support.upstream_rbac import storage_csi
from tests.support.waits import eventually_async

from . import resizer_setup as resizer
from .attacher_setup import FINALIZER, Setup, get, setup
from .provisioner_harness import harness, kubectl

pytestmark = pytest.mark.integration
__all__ = ["setup"]  # the fixture


@pytest_asyncio.fixture(loop_scope="session")
async def resizing(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> AsyncIterator[resizer.Setup]:
    s = resizer.Setup(control_plane, api, namespace)
    try:
        yield s
    finally:
        await s.close()


async def upstream_identity(cp: ControlPlane, sidecar: str) -> Path:
    """Applies upstream's rbac.yaml of `sidecar` as it is; the kubeconfig of its ServiceAccount."""
    path = storage_csi() / sidecar / "rbac.yaml"
    await kubectl(cp, "apply", "-f", str(path))
    [sa] = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ServiceAccount"]
    md = sa["metadata"]
    return cp.kubeconfig_for(service_account_identity(md["name"], md.get("namespace", "default")))


async def test_the_attacher_attaches_and_detaches_under_upstreams_rbac(setup: Setup) -> None:
    """csi-attacher's rbac.yaml grants patch, not update, on PVs and VolumeAttachments: the
    finalizers and the node-id annotation go in as patches."""
    s, api = setup, setup.api
    kubeconfig = await upstream_identity(s.cp, "external-attacher")
    _attacher, csi = await s.start_attacher(kubeconfig)
    handle = await s.objects(csi)
    name = await s.create_va(handle)

    async def attached() -> bool:
        va = await get(api, VOLUME_ATTACHMENTS, name)
        status = (va or {}).get("status") or {}
        assert not status.get("attachError"), status["attachError"]
        return bool(status.get("attached"))

    await eventually_async("the VolumeAttachment attached", attached, 20)
    va = await api.get(VOLUME_ATTACHMENTS, name)
    assert va["metadata"]["finalizers"] == [FINALIZER]
    assert FINALIZER in (await api.get(PERSISTENT_VOLUMES, s.pv))["metadata"]["finalizers"]
    assert await s.published(csi, handle) == [s.node]

    await api.delete(VOLUME_ATTACHMENTS, name)

    async def va_gone() -> bool:
        va = await get(api, VOLUME_ATTACHMENTS, name)
        assert not ((va or {}).get("status") or {}).get("detachError"), va
        return va is None

    await eventually_async("the VolumeAttachment detached and gone", va_gone, 20)
    assert await s.published(csi, handle) == []
    await api.delete(PERSISTENT_VOLUMES, s.pv)

    async def pv_gone() -> bool:
        return await get(api, PERSISTENT_VOLUMES, s.pv) is None

    await eventually_async("the PV's attacher finalizer removed once it is being deleted", pv_gone, 20)


async def test_the_resizer_expands_under_upstreams_rbac(resizing: resizer.Setup) -> None:
    """csi-resizer's rbac.yaml: PVs and claims' status patched, core v1 Events."""
    s, api = resizing, resizing.api
    kubeconfig = await upstream_identity(s.cp, "external-resizer")
    csi = await s.start_resizer(kubeconfig)
    handle = await s.volume(csi, "upstream")
    pv = await s.bound_claim("upstream", {"csi": {"driver": DRIVER_NAME, "volumeHandle": handle}})

    async def grown() -> bool:
        claim = await api.get(PERSISTENT_VOLUME_CLAIMS, "upstream", s.ns)
        volume = await api.get(PERSISTENT_VOLUMES, pv)
        return bool(
            volume["spec"]["capacity"] == {"storage": "32Mi"}
            and (claim.get("status") or {}).get("allocatedResources") == {"storage": "32Mi"}
        )

    await eventually_async("the PV grown to 32Mi and the claim's status patched", grown, 30)

    async def recorded() -> bool:
        return "Resizing" in [reason for reason, _ in await s.events("upstream")]

    await eventually_async("the Resizing Event, a core v1 Event", recorded, 20)


async def test_the_provisioner_provisions_and_clones_under_upstreams_rbac(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """csi-provisioner's rbac.yaml: claims are updated, not patched (the cloning-protection
    finalizer on the source, put on and taken off), core v1 Events, its Lease in its namespace."""
    kubeconfig = await upstream_identity(control_plane, "external-provisioner")
    args = ("--leader-election", "--leader-election-namespace=default")
    rbac = storage_csi() / "external-provisioner" / "rbac.yaml"
    source = {"kind": "PersistentVolumeClaim", "name": "source"}
    async with harness(
        control_plane, api, namespace, provisioner_args=args, rbac=rbac, kubeconfig=kubeconfig
    ) as h:
        cls = await h.create_class("upstream-rbac")
        await h.create_pvc("source", "8Mi", cls)
        await h.bound("source")
        await h.wait_event("source", names.PROVISIONING_SUCCEEDED)
        await h.create_pvc("copy", "8Mi", cls, data_source=source)
        await h.bound("copy")
        protected = await api.get(PERSISTENT_VOLUME_CLAIMS, "source", namespace)
        assert names.CLONE_FINALIZER in protected["metadata"]["finalizers"]

        await api.delete(PERSISTENT_VOLUME_CLAIMS, "source", namespace)

        async def protection_dropped() -> bool:
            claim = await h.pvc("source") or {}
            return names.CLONE_FINALIZER not in (claim.get("metadata", {}).get("finalizers") or [])

        await eventually_async("the source's cloning protection taken off", protection_dropped, 20)
        assert "forbidden" not in h.log_tail(), h.log_tail()
