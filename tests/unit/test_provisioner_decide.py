"""external-provisioner's decisions, each against the Go sidecar's (external-provisioner v6.3.0,
sig-storage-lib-external-provisioner v13): capability checks and data sources, which PVs it
finalizes and deletes (static CSI volumes included), the secret DeleteVolume gets and the PV
annotations that carry it, secret templates, and when a clone source's protection may go."""

from __future__ import annotations

from typing import Any

import pytest

from controller_runtime import storage
from controller_runtime.kinds import (
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    pv_view,
    pvc_view,
)
from controller_runtime.resources import Obj
from external_provisioner import names
from external_provisioner.decide import (
    RPC,
    SERVICE,
    DataSource,
    SlowRetries,
    capability_error,
    data_source,
    deletion_secret,
    finalizers_after,
    pending_clones,
    pending_restores,
    responsible_for,
    should_delete,
)
from external_provisioner.request import (
    CreatedVolume,
    ProvisionError,
    SecretRef,
    build_pv,
    expand_template,
    secret_reference,
    split_parameters,
    volume_spec,
)

DRIVER = "loop.csi.kubeloop.dev"
ALL_PLUGIN = {SERVICE.CONTROLLER_SERVICE}
ALL_CONTROLLER = {RPC.CREATE_DELETE_VOLUME, RPC.CLONE_VOLUME, RPC.CREATE_DELETE_SNAPSHOT, RPC.MODIFY_VOLUME}
CLONE = DataSource("PersistentVolumeClaim", "src", "ns", "")
SNAPSHOT = DataSource("VolumeSnapshot", "snap", "ns", "snapshot.storage.k8s.io")


def claim(name: str = "data", phase: str = "Pending", **spec: Any) -> PersistentVolumeClaim:
    return pvc_view(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "annotations": {"team": "a"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, **spec},
            "status": {"phase": phase},
        }
    )


def pv(
    phase: str = "Bound",
    policy: str = "Delete",
    annotations: dict[str, str] | None = None,
    finalizers: list[str] | None = None,
    deleting: bool = False,
    csi_driver: str | None = DRIVER,
) -> PersistentVolume:
    md: Obj = {"name": "pv1", "annotations": dict(annotations or {}), "finalizers": list(finalizers or [])}
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec: Obj = {
        "persistentVolumeReclaimPolicy": policy,
        "storageClassName": "fast",
        "claimRef": {"namespace": "ns", "name": "data", "uid": "u-data"},
    }
    if csi_driver is not None:
        spec["csi"] = {"driver": csi_driver, "volumeHandle": "h1"}
    return pv_view({"metadata": md, "spec": spec, "status": {"phase": phase}})


# -- capabilities and data sources -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("plugin", "controller", "source", "modify", "expected"),
    [
        (ALL_PLUGIN, ALL_CONTROLLER, None, False, None),
        (ALL_PLUGIN, ALL_CONTROLLER, CLONE, True, None),
        (
            set(),
            ALL_CONTROLLER,
            None,
            False,
            "CSI driver does not support dynamic provisioning: plugin CONTROLLER_SERVICE capability "
            "is not reported",
        ),
        (
            ALL_PLUGIN,
            {RPC.CLONE_VOLUME},
            None,
            False,
            "CSI driver does not support dynamic provisioning: controller CREATE_DELETE_VOLUME capability "
            "is not reported",
        ),
        (
            ALL_PLUGIN,
            {RPC.CREATE_DELETE_VOLUME},
            SNAPSHOT,
            False,
            "CSI driver does not support snapshot restore: controller CREATE_DELETE_SNAPSHOT capability "
            "is not reported",
        ),
        (
            ALL_PLUGIN,
            {RPC.CREATE_DELETE_VOLUME},
            CLONE,
            False,
            "CSI driver does not support clone operations: controller CLONE_VOLUME capability "
            "is not reported",
        ),
        (
            ALL_PLUGIN,
            {RPC.CREATE_DELETE_VOLUME, RPC.CLONE_VOLUME},
            CLONE,
            True,
            "CSI driver does not support VolumeAttributesClass: controller MODIFY_VOLUME capability "
            "is not reported",
        ),
        # Only the source kind asks for its capability.
        (ALL_PLUGIN, {RPC.CREATE_DELETE_VOLUME}, None, False, None),
    ],
)
def test_capability_checks(
    plugin: set[int], controller: set[int], source: DataSource | None, modify: bool, expected: str | None
) -> None:
    assert capability_error(plugin, controller, source=source, modify=modify) == expected


def test_data_source_is_read_like_the_sidecar() -> None:
    assert data_source(claim()) is None
    # dataSource wins over dataSourceRef; the claim's namespace is the source's.
    both = claim(
        dataSource={"kind": "PersistentVolumeClaim", "name": "a"},
        dataSourceRef={"kind": "PersistentVolumeClaim", "name": "b"},
    )
    assert data_source(both) == DataSource("PersistentVolumeClaim", "a", "ns", "")
    populator = data_source(claim(dataSourceRef={"kind": "Backup", "name": "b", "apiGroup": "x.io"}))
    assert populator is not None and populator.populated
    snap = data_source(
        claim(dataSource={"kind": "VolumeSnapshot", "name": "s", "apiGroup": SNAPSHOT.api_group})
    )
    assert snap is not None and snap.snapshot and not snap.populated


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"dataSource": {"kind": "PersistentVolumeClaim", "name": ""}},
            "the PVC source not found for PVC data",
        ),
        (
            {"dataSource": {"kind": "VolumeSnapshot", "name": "s"}},
            "the PVC source does not belong to the right APIGroup. Expected snapshot.storage.k8s.io, Got ",
        ),
        (
            {"dataSourceRef": {"kind": "PersistentVolumeClaim", "name": "s", "namespace": "other"}},
            "dataSourceRef namespace specified but the CrossNamespaceVolumeDataSource feature is disabled",
        ),
    ],
)
def test_bad_data_sources(spec: Obj, message: str) -> None:
    with pytest.raises(ProvisionError, match="^" + message.replace(".", r"\.") + "$"):
        data_source(claim(**spec))


# -- volumes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("volume", "ours"),
    [
        (pv(annotations={storage.ANN_PROVISIONED_BY: DRIVER}), True),
        (pv(annotations={storage.ANN_PROVISIONED_BY: "other.csi"}), False),
        (
            pv(
                annotations={
                    storage.ANN_PROVISIONED_BY: "kubernetes.io/gce-pd",
                    storage.ANN_MIGRATED_TO: DRIVER,
                }
            ),
            True,
        ),
        # Static: no provisioned-by, the driver in spec.csi decides.
        (pv(), True),
        (pv(csi_driver="other.csi"), False),
        (pv(csi_driver=None), False),
        (pv(csi_driver=None, annotations={storage.ANN_MIGRATED_TO: DRIVER}), True),
    ],
)
def test_responsible_for(volume: PersistentVolume, ours: bool) -> None:
    assert responsible_for(volume, DRIVER) is ours


def test_finalizer_follows_phase_and_policy() -> None:
    fin = names.PV_FINALIZER
    # A Bound Delete PV gets it (a static one too), keeping other finalizers.
    assert finalizers_after(pv(finalizers=["kubernetes.io/pv-protection"])) == [
        "kubernetes.io/pv-protection",
        fin,
    ]
    assert finalizers_after(pv(finalizers=[fin])) is None
    # Not Bound, or being deleted: nothing is added.
    assert finalizers_after(pv(phase="Released")) is None
    assert finalizers_after(pv(phase="Available")) is None
    assert finalizers_after(pv(deleting=True)) is None
    # Retain and Recycle: it goes, whatever the phase.
    assert finalizers_after(pv(policy="Retain", phase="Released", finalizers=[fin, "x"])) == ["x"]
    assert finalizers_after(pv(policy="Recycle", finalizers=[fin])) == []
    assert finalizers_after(pv(policy="Retain")) is None


@pytest.mark.parametrize(
    ("volume", "delete"),
    [
        (pv(phase="Released"), True),
        (pv(phase="Released", finalizers=[names.PV_FINALIZER], deleting=True), True),
        # Deleted and our finalizer gone: the backend volume was deleted already.
        (pv(phase="Released", deleting=True), False),
        (pv(phase="Released", policy="Retain"), False),
        (pv(phase="Bound"), False),
        # Only Released counts, also for a deleted PV holding the finalizer (upstream leaves it).
        (pv(phase="Failed", finalizers=[names.PV_FINALIZER], deleting=True), False),
        (pv(phase="Available", finalizers=[names.PV_FINALIZER], deleting=True), False),
    ],
)
def test_should_delete(volume: PersistentVolume, delete: bool) -> None:
    assert should_delete(volume) is delete


# -- secrets ---------------------------------------------------------------------------------------

SECRET_CLASS: StorageClass = {
    "metadata": {"name": "fast"},
    "parameters": {
        "csi.storage.k8s.io/provisioner-secret-name": "${pv.name}-key",
        "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
    },
}


def test_deletion_secret_from_the_pv_annotations_first() -> None:
    annotated = pv(
        annotations={names.ANN_DELETION_SECRET_NAME: "s", names.ANN_DELETION_SECRET_NAMESPACE: "vault"}
    )
    assert deletion_secret(annotated, SECRET_CLASS) == SecretRef("s", "vault")
    # Empty values: provisioned without a secret, even if the class names one now.
    empty = pv(annotations={names.ANN_DELETION_SECRET_NAME: "", names.ANN_DELETION_SECRET_NAMESPACE: ""})
    assert deletion_secret(empty, SECRET_CLASS) is None


def test_deletion_secret_falls_back_to_the_class() -> None:
    assert deletion_secret(pv(), SECRET_CLASS) == SecretRef("pv1-key", "ns")
    assert deletion_secret(pv(), None) is None
    unreferenced = pv()
    del unreferenced["spec"]["claimRef"]
    assert deletion_secret(unreferenced, SECRET_CLASS) is None
    by_annotation: StorageClass = {
        "parameters": {
            "csi.storage.k8s.io/provisioner-secret-name": "${pvc.annotations['team']}",
            "csi.storage.k8s.io/provisioner-secret-namespace": "ns",
        }
    }
    with pytest.raises(ProvisionError) as err:
        deletion_secret(pv(), by_annotation)
    assert str(err.value) == (
        "failed to get secretreference for volume pv1: error resolving value "
        "\"${pvc.annotations['team']}\": invalid tokens: [\"pvc.annotations['team']\"]"
    )


def test_the_pv_records_the_deletion_secret() -> None:
    sc: StorageClass = {
        "metadata": {"name": "fast"},
        "reclaimPolicy": "Delete",
        "parameters": SECRET_CLASS["parameters"],
    }
    c = claim()
    params = split_parameters(sc["parameters"], c, "pvc-u-data", "")
    spec = volume_spec(c, sc, params, "pvc-u-data", extra_metadata=False, multi_writer=True, topology=None)
    assert spec.secret == SecretRef("pvc-u-data-key", "ns")
    built = build_pv(
        driver=DRIVER,
        identity="i",
        claim=c,
        storage_class=sc,
        spec=spec,
        params=params,
        created=CreatedVolume("h", 1 << 30),
    )
    ann = built["metadata"]["annotations"]
    assert ann[names.ANN_DELETION_SECRET_NAME] == "pvc-u-data-key"
    assert ann[names.ANN_DELETION_SECRET_NAMESPACE] == "ns"
    assert names.ANN_MODIFY_SECRET_NAME not in ann
    plain = split_parameters({}, c, "pvc-u-data", "")
    built = build_pv(
        driver=DRIVER,
        identity="i",
        claim=c,
        storage_class={"metadata": {"name": "fast"}},
        spec=volume_spec(c, sc, plain, "pvc-u-data", extra_metadata=False, multi_writer=True, topology=None),
        params=plain,
        created=CreatedVolume("h", 1 << 30),
    )
    ann = built["metadata"]["annotations"]
    assert ann[names.ANN_DELETION_SECRET_NAME] == "" and ann[names.ANN_DELETION_SECRET_NAMESPACE] == ""


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, None),
        # The deprecated keys and the default keys still work.
        ({"csiProvisionerSecretName": "old", "csiProvisionerSecretNamespace": "ns"}, SecretRef("old", "ns")),
        (
            {
                "csi.storage.k8s.io/secret-name": "shared",
                "csi.storage.k8s.io/secret-namespace": "kube-system",
            },
            SecretRef("shared", "kube-system"),
        ),
        # The provisioner's name may use the claim's annotations, as upstream allows.
        (
            {
                "csi.storage.k8s.io/provisioner-secret-name": "${pvc.name}-${pvc.annotations['team']}",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.namespace}",
            },
            SecretRef("data-a", "ns"),
        ),
    ],
)
def test_secret_reference(params: dict[str, str], expected: SecretRef | None) -> None:
    assert secret_reference("provisioner", params, "pv1", "ns", "data", {"team": "a"}) == expected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"csiProvisionerSecretName": "a", "csi.storage.k8s.io/provisioner-secret-name": "b"},
            "failed to get name and namespace template from params: Provisioner secrets specified in "
            'parameters with both "csi" and "csi.storage.k8s.io/" keys',
        ),
        (
            {"csi.storage.k8s.io/provisioner-secret-name": "a"},
            "failed to get name and namespace template from params: either name and namespace for "
            "Provisioner secrets specified, Both must be specified",
        ),
        (
            {"csi.storage.k8s.io/secret-name": "", "csi.storage.k8s.io/secret-namespace": "ns"},
            "failed to get default name and namespace template from params: Default secrets specified "
            "in parameters but value of either namespace or name is empty",
        ),
        (
            {
                "csi.storage.k8s.io/provisioner-secret-name": "a",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pvc.name}",
            },
            'error resolving value "${pvc.name}": invalid tokens: ["pvc.name"]',
        ),
        (
            {
                "csi.storage.k8s.io/provisioner-secret-name": "A_B",
                "csi.storage.k8s.io/provisioner-secret-namespace": "ns",
            },
            '"A_B" is not a valid secret name',
        ),
        (
            {
                "csi.storage.k8s.io/provisioner-secret-name": "x",
                "csi.storage.k8s.io/provisioner-secret-namespace": "${pv.name}.",
            },
            '"${pv.name}." resolved to "pv1." which is not a valid namespace name',
        ),
    ],
)
def test_secret_reference_errors(params: dict[str, str], message: str) -> None:
    with pytest.raises(ProvisionError) as err:
        secret_reference("provisioner", params, "pv1", "ns", "data", {"team": "a"})
    assert str(err.value) == message


def test_templates_expand_like_os_expand() -> None:
    values = {"a": "1", "pv.name": "p"}
    assert expand_template("x-$a-${a}", values) == "x-1-1"
    with pytest.raises(ValueError, match=r'^invalid tokens: \["pv"\]$'):
        expand_template("$pv.name", values)  # without braces a name ends at the dot
    assert expand_template("${pv.name}", values) == "p"
    assert expand_template("cost$", values) == "cost$", "a trailing $ stays"
    assert expand_template("a$-b", {"-": "m"}) == "amb", "a special one-character name"
    assert expand_template("a${}b", values) == "ab", "bad syntax is eaten"
    assert expand_template("a$.b", values) == "a$.b", "a $ before no name stays"
    with pytest.raises(ValueError, match=r'^invalid tokens: \["b" "c"\]$'):
        expand_template("$c$b", values)


def test_unknown_reserved_keys_are_refused_after_the_secrets() -> None:
    with pytest.raises(ProvisionError) as err:
        split_parameters({"csi.storage.k8s.io/typo": "x"}, claim(), "pv1", "")
    assert str(err.value) == (
        "failed to strip CSI Parameters of prefixed keys: found unknown parameter key "
        '"csi.storage.k8s.io/typo" with reserved namespace csi.storage.k8s.io/'
    )
    # The default and controller-modify secret keys are known ones.
    ok = split_parameters(
        {
            "csi.storage.k8s.io/secret-name": "s",
            "csi.storage.k8s.io/secret-namespace": "ns",
            "csi.storage.k8s.io/controller-modify-secret-name": "m",
            "csi.storage.k8s.io/controller-modify-secret-namespace": "ns",
        },
        claim(),
        "pv1",
        "",
    )
    assert ok.secrets["node-stage"] == SecretRef("s", "ns"), "the default applies to every kind not named"
    assert ok.secrets["controller-modify"] == SecretRef("m", "ns")


# -- clone sources ---------------------------------------------------------------------------------


def test_pending_clones_hold_the_source() -> None:
    src = claim("src", "Bound")
    ref = {"kind": "PersistentVolumeClaim", "name": "src"}
    others = [
        claim("c1", "Pending", dataSource=ref),
        claim("c2", "Bound", dataSource=ref),
        claim("c3", "Pending", dataSource={"kind": "PersistentVolumeClaim", "name": "other"}),
        claim("c4", "Pending"),
        # Only the phase Pending counts, as upstream (a claim with no status yet does not).
        claim("c5", "", dataSource=ref),
    ]
    elsewhere = claim("c6", "Pending", dataSource=ref)
    elsewhere["metadata"]["namespace"] = "other"
    assert pending_clones(src, [src, *others, elsewhere]) == ["c1"]
    assert pending_clones(src, others[1:]) == []


def test_pending_restores_hold_their_snapshots() -> None:
    snap = {"kind": "VolumeSnapshot", "name": "s1", "apiGroup": "snapshot.storage.k8s.io"}
    claims = [
        claim("r1", "Pending", dataSource=snap),
        claim("r2", "", dataSourceRef={**snap, "name": "s2"}),  # no phase yet counts as pending
        claim("r3", "Bound", dataSource={**snap, "name": "s3"}),
        claim("r4", "Pending", dataSourceRef={**snap, "name": "s4", "namespace": "other"}),
        claim("r5", "Pending", dataSource={**snap, "name": "s5", "apiGroup": "example.com"}),
        claim("r6", "Pending", dataSource={"kind": "VolumeSnapshot", "name": "s6"}),
    ]
    del claims[1]["status"]["phase"]
    assert pending_restores(claims) == {"ns/s1", "ns/s2", "other/s4", "ns/s6"}


def test_an_infeasible_claim_waits_unless_its_class_changed() -> None:
    slow = SlowRetries(delay=300)
    assert slow.remaining("u1", "c1", 0) == 0
    slow.mark("u1", "c1", now=10)
    slow.mark("u1", "c1", now=20)  # the first failure counts
    assert slow.remaining("u1", "c1", 100) == 210
    assert slow.remaining("u1", "c1", 310) == 0, "waited long enough"
    assert slow.remaining("u1", "c1", 100) == 0, "and the mark is gone"
    slow.mark("u1", "c1", now=0)
    assert slow.remaining("u1", "c2", 1) == 0, "a re-created class may fix the request"
    slow.mark("u2", "c1", now=0)
    slow.forget("u2")
    assert slow.remaining("u2", "c1", 1) == 0


def test_the_deprecated_fstype_key() -> None:
    out = split_parameters({"fsType": "xfs"}, claim(), "pv1", "ext4")
    assert out.fs_type == "xfs" and out.driver == {"fsType": "xfs"}
    assert split_parameters({"csi.storage.k8s.io/fstype": ""}, claim(), "pv1", "ext4").fs_type == "ext4"
    with pytest.raises(ProvisionError) as err:
        split_parameters({"fstype": "xfs", "csi.storage.k8s.io/fstype": "ext4"}, claim(), "pv1", "")
    assert (
        str(err.value)
        == 'fstype specified in parameters with both "fstype" and "csi.storage.k8s.io/fstype" keys'
    )
