"""external-provisioner behaviours taken from the Go sidecar (v6.3.0), against the real apiserver
and CSI driver: the cloning-protection finalizer on a clone's source (kept while a clone of it is
Pending, released after a SIGKILL too), a restore from a VolumeSnapshot and the snapshot's source
protection, per-claim capability checks, the deletion-secret annotations and DeleteVolume without a
vanished secret, and a static CSI PV with policy Delete deleted in the backend."""

from __future__ import annotations

import base64
import contextlib
import signal

import pytest

from controller_runtime import storage, volumes
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.resources import (
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    SECRETS,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    Obj,
)
from csi_driver import DRIVER_NAME
from external_provisioner import names
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.support.waits import consistently_async, eventually_async, no_problems

from .provisioner_harness import Harness, harness, kubectl

pytestmark = pytest.mark.integration

MiB = 1 << 20
CLONE_OF_SOURCE = {"kind": "PersistentVolumeClaim", "name": "source"}
RESTORE_OF_SNAP = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}
MISSING_SECRET = {
    "csi.storage.k8s.io/provisioner-secret-name": "missing",
    "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
}


def _snapshot_crd(kind: str, scope: str) -> str:
    """Just enough of a snapshot API kind for the provisioner's reads and finalizer patches: the
    stack runs no snapshot controller, so the test writes the objects (status included) itself."""
    plural = f"{kind.lower()}s"
    return f"""
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: {plural}.snapshot.storage.k8s.io
  annotations: {{api-approved.kubernetes.io: "https://github.com/kubernetes-csi/external-snapshotter/pull/814"}}
spec:
  group: snapshot.storage.k8s.io
  scope: {scope}
  names: {{plural: {plural}, singular: {kind.lower()}, kind: {kind}, listKind: {kind}List}}
  versions:
    - {{name: v1, served: true, storage: true,
       schema: {{openAPIV3Schema: {{type: object, x-kubernetes-preserve-unknown-fields: true}}}}}}
"""


SNAPSHOT_CRDS = "---".join(
    [_snapshot_crd("VolumeSnapshot", "Namespaced"), _snapshot_crd("VolumeSnapshotContent", "Cluster")]
)


def _claim(name: str, cls: str, **spec: object) -> Obj:
    """A claim body with fields create_pvc does not offer."""
    return {
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "8Mi"}},
            "storageClassName": cls,
            **spec,
        },
    }


async def test_a_clone_source_keeps_its_protection_while_a_clone_is_pending_even_across_a_kill(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        cls = await h.create_class("clone")
        # Provisioning from this class stops after the source was protected: its secret is missing.
        locked = await h.create_class("locked", parameters=MISSING_SECRET)
        await h.create_pvc("source", "8Mi", cls)
        await h.bound("source")
        await h.create_pvc("copy", "8Mi", cls, data_source=CLONE_OF_SOURCE)
        await h.bound("copy")

        async def source_finalizers() -> list[str]:
            src = await h.pvc("source")
            return list((src or {}).get("metadata", {}).get("finalizers") or [])

        # As upstream: the protection stays after the clone succeeded, while the source lives.
        assert names.CLONE_FINALIZER in await source_finalizers()

        await h.create_pvc("stuck", "8Mi", locked, data_source=CLONE_OF_SOURCE)
        message = await h.wait_event("stuck", storage.PROVISIONING_FAILED)
        assert message == (
            f'error getting secret missing in namespace {namespace}: secrets "missing" not found'
        )

        await api.delete(PERSISTENT_VOLUME_CLAIMS, "source", namespace)

        async def source_held() -> bool:
            src = await h.pvc("source")
            terminating = src is not None and bool(src["metadata"].get("deletionTimestamp"))
            return terminating and names.CLONE_FINALIZER in await source_finalizers()

        # Many backoff rounds (--retry-interval-max=1s).
        await consistently_async("the Terminating source held by its Pending clone", source_held, 3, 0.2)

        # SIGKILL, then the Pending clone goes while nothing runs: the restart releases the source.
        assert h.proc is not None
        h.proc.send_signal(signal.SIGKILL)
        await h.wait_exit()
        await api.delete(PERSISTENT_VOLUME_CLAIMS, "stuck", namespace)
        await h.start_provisioner()

        async def released() -> list[str]:
            left = await source_finalizers()
            return [f"source finalizers {left}"] if names.CLONE_FINALIZER in left else []

        await eventually_async("released", released, 20, satisfied=no_problems, context=h.log_tail)
        await h.assert_files_equal_pvs()


async def _snapshot_of(h: Harness, claim: str) -> str:
    """A ready VolumeSnapshot `snap` of the claim's volume: the snapshot cut in the driver, its
    VolumeSnapshotContent and VolumeSnapshot written as the snapshot controller would."""
    assert h.driver is not None
    pv = (await h.bound(claim))[claim]
    conn = await CSIConnection.connect(h.driver.endpoint)
    try:
        rsp = await conn.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(
                name=f"{h.ns}-snap", source_volume_id=pv["spec"]["csi"]["volumeHandle"]
            ),
            timeout=10,
        )
    finally:
        await conn.close()
    handle, content = rsp.snapshot.snapshot_id, f"{h.ns}-content"
    snap = await h.api.create(
        VOLUME_SNAPSHOTS,
        {
            "metadata": {"name": "snap"},
            "spec": {"source": {"volumeSnapshotContentName": content}},
            "status": {"boundVolumeSnapshotContentName": content, "readyToUse": True, "restoreSize": "8Mi"},
        },
        h.ns,
    )
    await h.api.create(
        VOLUME_SNAPSHOT_CONTENTS,
        {
            "metadata": {"name": content},
            "spec": {
                "driver": DRIVER_NAME,
                "deletionPolicy": "Retain",
                "source": {"snapshotHandle": handle},
                "volumeSnapshotRef": {"name": "snap", "namespace": h.ns, "uid": snap["metadata"]["uid"]},
            },
            "status": {"snapshotHandle": handle, "readyToUse": True},
        },
    )
    return content


async def test_a_restore_protects_its_snapshot_while_a_claim_restores_from_it(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace, provisioner=False) as h:
        crds = h.root / "snapshot-crds.yaml"
        crds.write_text(SNAPSHOT_CRDS)
        await kubectl(control_plane, "apply", "-f", str(crds))
        content = ""
        try:
            await kubectl(control_plane, "wait", "--for=condition=Established", "-f", str(crds))
            await h.start_provisioner("--snapshot-orphan-sweep-interval=1s")
            cls = await h.create_class("restore")
            locked = await h.create_class("locked", parameters=MISSING_SECRET)
            await h.create_pvc("source", "8Mi", cls)
            source = (await h.bound("source"))["source"]
            with (h.root / "pool" / "volumes" / f"{source['spec']['csi']['volumeHandle']}.img").open(
                "r+b"
            ) as f:
                f.seek(5 * MiB)
                f.write(b"kubeloop snapshot payload")
            content = await _snapshot_of(h, "source")

            async def snapshot_finalizers() -> list[str]:
                snap: Obj = await api.get(VOLUME_SNAPSHOTS, "snap", namespace)
                return list(snap["metadata"].get("finalizers") or [])

            await h.create_pvc("restored", "8Mi", cls, data_source=RESTORE_OF_SNAP)
            restored = (await h.bound("restored"))["restored"]
            img = h.root / "pool" / "volumes" / f"{restored['spec']['csi']['volumeHandle']}.img"
            with img.open("rb") as out:
                out.seek(5 * MiB)
                assert out.read(25) == b"kubeloop snapshot payload"
            # Released once the PV was saved.
            assert names.SNAPSHOT_FINALIZER not in await snapshot_finalizers()

            # A restore that cannot finish keeps the snapshot protected, sweep after sweep...
            await h.create_pvc("stuck", "8Mi", locked, data_source=RESTORE_OF_SNAP)
            await h.wait_event("stuck", storage.PROVISIONING_FAILED, 'secrets "missing" not found')

            async def protected() -> bool:
                return names.SNAPSHOT_FINALIZER in await snapshot_finalizers()

            await consistently_async("the snapshot protected while its restore fails", protected, 3, 0.2)
            # ... and once it is gone, the sweep releases the snapshot.
            await api.delete(PERSISTENT_VOLUME_CLAIMS, "stuck", namespace)

            async def released() -> list[str]:
                left = await snapshot_finalizers()
                return [f"snapshot finalizers {left}"] if names.SNAPSHOT_FINALIZER in left else []

            await eventually_async("released", released, 20, satisfied=no_problems, context=h.log_tail)
            await h.assert_files_equal_pvs()
        finally:
            await h.stop_provisioner()
            for res, name, ns in (
                (VOLUME_SNAPSHOTS, "snap", namespace),
                (VOLUME_SNAPSHOT_CONTENTS, content, None),
            ):
                if name:
                    with contextlib.suppress(ApiError):
                        await api.patch(res, name, {"metadata": {"finalizers": None}}, ns)
                        await api.delete(res, name, ns)
            # Bounded: a snapshot another test left with a finalizer would hold the CRDs forever;
            # fail naming it rather than hang the run.
            await kubectl(control_plane, "delete", "--wait=true", "--timeout=120s", "-f", str(crds))


async def test_capabilities_are_checked_per_claim(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        cls = await h.create_class("caps")
        # The driver has MODIFY_VOLUME (a driver without it gets "CSI driver does not support
        # VolumeAttributesClass: ...", tests/unit): a class that does not exist fails the attempt
        # with the apiserver's words, as upstream's live read does, and is tried again.
        await api.create(
            PERSISTENT_VOLUME_CLAIMS, _claim("tuned", cls, volumeAttributesClassName="gold"), namespace
        )
        message = await h.wait_event("tuned", storage.PROVISIONING_FAILED)
        assert message == 'volumeattributesclasses.storage.k8s.io "gold" not found'
        await h.wait_event("tuned", names.PROVISIONING, f'for claim "{namespace}/tuned"')
        # A source of another kind is a volume populator's.
        backup = {"apiGroup": "backup.example.com", "kind": "Backup", "name": "b1"}
        await api.create(PERSISTENT_VOLUME_CLAIMS, _claim("populated", cls, dataSourceRef=backup), namespace)
        await h.wait_event("populated", names.PROVISIONING, names.MSG_POPULATOR)
        # A selector cannot be provisioned for.
        selector = {"matchLabels": {"tier": "gold"}}
        await api.create(PERSISTENT_VOLUME_CLAIMS, _claim("picky", cls, selector=selector), namespace)
        assert await h.wait_event("picky", storage.PROVISIONING_FAILED) == "claim Selector is not supported"
        # A request the driver calls invalid is retried slowly, and says so.
        bogus = await h.create_class("bogus", parameters={"bogus": "x"})
        await h.create_pvc("invalid", "8Mi", bogus)
        message = await h.wait_event("invalid", storage.PROVISIONING_FAILED)
        assert message.startswith(
            "Volume provisioning failed with infeasible error. Retries will be delayed. "
            "rpc error: code = InvalidArgument desc = unknown parameters bogus"
        ), message
        await h.assert_files_equal_pvs()


async def test_the_pv_records_its_deletion_secret_and_deletion_survives_its_loss(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        secret = {"metadata": {"name": "prov-key"}, "data": {"token": base64.b64encode(b"t0ken").decode()}}
        await api.create(SECRETS, secret, namespace)
        cls = await h.create_class(
            "secret",
            parameters={
                "csi.storage.k8s.io/provisioner-secret-name": "prov-key",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
            },
        )
        plain = await h.create_class("plain")
        await h.create_pvc("keyed", "8Mi", cls)
        await h.create_pvc("open", "8Mi", plain)
        pvs = await h.bound("keyed", "open")
        ann = pvs["keyed"]["metadata"]["annotations"]
        assert ann[names.ANN_DELETION_SECRET_NAME] == "prov-key"
        assert ann[names.ANN_DELETION_SECRET_NAMESPACE] == namespace
        ann = pvs["open"]["metadata"]["annotations"]
        assert ann[names.ANN_DELETION_SECRET_NAME] == "" and ann[names.ANN_DELETION_SECRET_NAMESPACE] == ""

        # The secret goes first: DeleteVolume still runs (without it), as upstream.
        await api.delete(SECRETS, "prov-key", namespace)
        await api.delete(PERSISTENT_VOLUME_CLAIMS, "keyed", namespace)
        await api.delete(PERSISTENT_VOLUME_CLAIMS, "open", namespace)

        async def gone() -> list[str]:
            left = [n for n in (p["metadata"]["name"] for p in pvs.values()) if await h.pv(n) is not None]
            return [f"PVs left: {left}"] if left else []

        await eventually_async("gone", gone, 20, satisfied=no_problems, context=h.log_tail)
        await h.assert_files_equal_pvs()


async def test_a_static_csi_pv_with_policy_delete_is_deleted_in_the_backend(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        assert h.driver is not None
        # An admin's volume: created in the driver directly, then described by a PV of their own.
        conn = await CSIConnection.connect(h.driver.endpoint)
        try:
            mode = csi_pb2.VolumeCapability.AccessMode.Mode.SINGLE_NODE_WRITER
            rsp = await conn.controller.CreateVolume(
                csi_pb2.CreateVolumeRequest(
                    name=f"{namespace}-static",
                    capacity_range=csi_pb2.CapacityRange(required_bytes=8 * MiB),
                    volume_capabilities=[volumes.capability(mode, False, "ext4")],
                ),
                timeout=10,
            )
        finally:
            await conn.close()
        handle = rsp.volume.volume_id
        assert handle in h.backing_files()
        pv_name = f"{namespace}-static"
        await api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": pv_name},
                "spec": {
                    "capacity": {"storage": "8Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Delete",
                    "storageClassName": "",
                    "csi": {"driver": DRIVER_NAME, "volumeHandle": handle, "fsType": "ext4"},
                },
            },
        )
        await api.create(PERSISTENT_VOLUME_CLAIMS, _claim("static", "", volumeName=pv_name), namespace)
        await h.bound("static")

        async def finalized() -> list[str]:
            pv = await h.pv(pv_name)
            fins = (pv or {}).get("metadata", {}).get("finalizers") or []
            return [] if names.PV_FINALIZER in fins else [f"finalizers {fins}"]

        # Bound with policy Delete: the provisioner takes it under its protection, as upstream.
        await eventually_async("finalized", finalized, 20, satisfied=no_problems, context=h.log_tail)

        await api.delete(PERSISTENT_VOLUME_CLAIMS, "static", namespace)

        async def deleted() -> list[str]:
            problems = []
            if await h.pv(pv_name) is not None:
                problems.append("PV still there")
            if handle in h.backing_files():
                problems.append("backing file still there")
            return problems

        await eventually_async("deleted", deleted, 20, satisfied=no_problems, context=h.log_tail)
